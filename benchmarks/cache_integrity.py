"""Cost of the trainer's integrity check before step 1 (``dflash.cache.integrity.check_cache``), per million samples.

Builds a cache of random bf16 hidden states with the extract stage's layout (``--shard-tokens`` tokens a shard, as
``extract --shard-size``; ``--chunk-tokens`` tokens a hidden chunk: 256 is what an 8B target with 5 taps gets, 1024
SmolLM2's), then times ``check_cache`` on a fresh reader (commit records, every hidden chunk's stored crc32c trailer,
the small arrays decoded and hashed; no hidden state decompressed). The check's cost depends on the counts of
shards, chunks and tokens, not on the hidden width, so the hidden rows are kept narrow (``--hidden-size``) to make the
cache quick to build; the figure is scaled to one million samples of the same mean length. The page cache is warm
(the cache was just written): a cold remote store adds one small ranged read per chunk.

Run::

    python benchmarks/cache_integrity.py --output /tmp/integrity-bench                 # ~20,000 samples
    python benchmarks/cache_integrity.py --smoke --output /tmp/integrity-bench         # seconds, any machine
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from dflash.cache import CacheMetadata, CacheReader, HiddenSample, HiddenStateCache
from dflash.cache.integrity import check_cache
from dflash.target.taps import LAYER_ID_CONVENTION


def build(path: Path, *, num_samples: int, mean_tokens: int, shard_tokens: int, chunk_tokens: int, hidden_size: int,
          seed: int = 0) -> tuple[int, int]:  # fmt: skip
    """Write the cache; returns (shards, tokens)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max(1, mean_tokens // 8), 2 * mean_tokens - max(1, mean_tokens // 8), num_samples)
    shard_rows, start, running = [], 0, 0
    for row, length in enumerate(lengths.tolist()):
        running += length
        if running >= shard_tokens:
            shard_rows.append([start, row + 1])
            start, running = row + 1, 0
    if start < num_samples:
        shard_rows.append([start, num_samples])
    metadata = CacheMetadata(
        target={"name": "random", "content_hash": "sha256:" + "0" * 64, "num_hidden_layers": 2,
                "hidden_size": hidden_size, "vocab_size": 49152, "model_type": "llama"},
        target_spec="random", target_layer_ids=[1], layer_id_convention=LAYER_ID_CONVENTION, hidden_size=hidden_size,
        num_taps=1, corpus_fingerprint="sha256:" + "0" * 64, num_shards=len(shard_rows), shard_rows=shard_rows,
        chunk_tokens=chunk_tokens, codec="zstd-1",
    )  # fmt: skip
    shutil.rmtree(path, ignore_errors=True)
    cache = HiddenStateCache.create(path, metadata)
    generator = torch.Generator().manual_seed(seed)
    for shard, (first, last) in enumerate(shard_rows):
        samples = []
        for row in range(first, last):
            length = int(lengths[row])
            samples.append(HiddenSample(
                corpus_row=row,
                input_ids=torch.randint(0, 49152, (length,), dtype=torch.int32, generator=generator),
                loss_mask=torch.ones(length, dtype=torch.uint8),
                hidden=torch.randn(length, hidden_size, generator=generator).to(torch.bfloat16),
            ))  # fmt: skip
        cache.write_shard(shard, samples)
    return len(shard_rows), int(lengths.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, required=True, help="Where to build the cache (deleted first).")
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--mean-tokens", type=int, default=256, help="Mean sample length (uniform spread).")
    parser.add_argument("--shard-tokens", type=int, default=65_536, help="Tokens a shard (extract's default).")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="Tokens a hidden chunk (256: an 8B target).")
    parser.add_argument("--hidden-size", type=int, default=16, help="Hidden row width (does not change the check).")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="2,000 samples, 1 repeat.")
    args = parser.parse_args()
    if args.smoke:
        args.samples, args.repeats = 2_000, 1

    started = time.perf_counter()
    shards, tokens = build(args.output, num_samples=args.samples, mean_tokens=args.mean_tokens,
                           shard_tokens=args.shard_tokens, chunk_tokens=args.chunk_tokens, hidden_size=args.hidden_size)  # fmt: skip
    print(f"built {args.samples:,} samples, {tokens:,} tokens, {shards} shards, chunks of {args.chunk_tokens} tokens "
          f"in {time.perf_counter() - started:.1f} s")  # fmt: skip
    timings = []
    for _ in range(args.repeats):
        reader = CacheReader(args.output)  # fresh: nothing verified or cached yet
        began = time.perf_counter()
        report = check_cache(reader)
        timings.append(time.perf_counter() - began)
    best = min(timings)
    scale = 1e6 / args.samples
    print(f"check_cache: {best:.3f} s (best of {args.repeats}: {', '.join(f'{t:.3f}' for t in timings)}) for "
          f"{report['num_samples']:,} samples, {report['hidden_chunks']:,} hidden chunks, {shards} shards")
    print(f"= {best * scale:.2f} s per million samples of {tokens / args.samples:.0f} tokens "
          f"({best / tokens * 1e9:.1f} s per billion tokens; {best / report['hidden_chunks'] * 1e6:.1f} us per chunk "
          "incl. the small arrays)")


if __name__ == "__main__":
    main()
