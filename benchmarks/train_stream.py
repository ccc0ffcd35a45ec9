"""Drafter training throughput: batches streamed from a Zarr cache on local disk vs the same batches in GPU memory.

One run, one GPU. A synthetic cache with random bf16 hidden states of the Qwen3-8B shapes (H = 4096, 5 taps of
36 layers, vocab 151936; lengths log-normal like chat data) is written through ``HiddenStateCache`` (reused when
it already exists with the same settings). Then the same drafter step (anchors, forward, weighted CE,
backward, AdamW; bf16 autocast) runs over the same batches twice per round:

* preloaded: every batch was copied to the GPU before timing starts;
* streamed: ``StreamingLoader`` reads the cache in plan order with background prefetch into pinned memory and a
  side-stream device copy (the trainer's input path). With ``--cold`` (default) the cache files are dropped from
  the page cache first (``posix_fadvise(DONTNEED)``), so reads come from the disk.

Printed: tokens/s of both (real context tokens and drafted block tokens), their ratio (target >= 0.97), data
wait as % of streamed step time (target < 2%), read throughput, cache size. Each step ends with a CUDA sync
(the trainer reads the loss every step), so a data stall is never hidden by queued GPU work.

GPU (the figure of issue 5, item 10)::

    python benchmarks/train_stream.py --cache /tmp/dflash_bench_cache.zarr --json-out bench_train_stream.json

CPU smoke test (tiny shapes, seconds)::

    python benchmarks/train_stream.py --smoke
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dflash.batches.stream import StreamConfig, StreamingLoader
from dflash.cache import CacheMetadata, CacheReader, HiddenSample, HiddenStateCache
from dflash.drafter import DFlashConfig, DFlashDrafter, dflash_loss, sample_anchors
from dflash.target.taps import LAYER_ID_CONVENTION, default_target_layer_ids

# Qwen3-8B (config.json of Qwen/Qwen3-8B): the shapes the cache and drafter are sized for.
QWEN3_8B = dict(
    hidden_size=4096,
    intermediate_size=12288,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    num_target_layers=36,
    vocab_size=151936,
    rope_theta=1_000_000.0,
    max_position_embeddings=40960,
    mask_token_id=151669,
)
SMOKE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_target_layers=8,
    vocab_size=512,
    rope_theta=10000.0,
    max_position_embeddings=4096,
    mask_token_id=511,
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cache", type=Path, default=None, help="cache folder (default: a temp dir; reused if valid)"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, a few steps")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--token-budget", type=int, default=8192, help="real tokens per batch")
    parser.add_argument("--steps", type=int, default=16, help="steps per phase and round (the first untimed)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before timing")
    parser.add_argument("--rounds", type=int, default=2, help="(preloaded, streamed) rounds, summed")
    parser.add_argument("--num-draft-layers", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-anchors-per-document", type=int, default=256)
    parser.add_argument(
        "--mean-length", type=int, default=1024, help="log-normal sample length mean (tokens)"
    )
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--samples-per-shard", type=int, default=64)
    parser.add_argument("--prefetch-batches", type=int, default=4)
    parser.add_argument("--num-read-workers", type=int, default=4)
    parser.add_argument("--codec", default="blosc-zstd1-shuffle", help="cache codec preset (dflash.cache)")
    parser.add_argument(
        "--cold",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="drop the cache files from the page cache before each streamed phase",
    )
    parser.add_argument("--json-out", type=Path, default=None, help="also write the figures as JSON here")
    args = parser.parse_args()
    if args.smoke:
        args.token_budget, args.steps, args.warmup, args.rounds = 512, 4, 1, 1
        args.num_draft_layers, args.max_anchors_per_document = 2, 16
        args.mean_length, args.max_length, args.samples_per_shard = 96, 256, 16
        args.device = args.device or "cpu"
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return args


def build_cache(path: Path, shapes: dict, args: argparse.Namespace, num_tokens: int) -> CacheReader:
    """Write (or reuse) a synthetic cache holding at least ``num_tokens`` tokens; random bf16 hidden states."""
    layer_ids = default_target_layer_ids(shapes["num_target_layers"], args.num_draft_layers)
    rng = np.random.default_rng(0)
    sigma = 0.6
    lengths = []
    while sum(lengths) < num_tokens:
        length = rng.lognormal(np.log(args.mean_length) - sigma**2 / 2, sigma)
        lengths.append(int(np.clip(length, 32, min(args.max_length, args.token_budget))))
    num_shards = -(-len(lengths) // args.samples_per_shard)
    rows = [
        [s * args.samples_per_shard, min(len(lengths), (s + 1) * args.samples_per_shard)]
        for s in range(num_shards)
    ]
    metadata = CacheMetadata(
        target={
            "name": "synthetic-qwen3-8b-shapes",
            "content_hash": "sha256:synthetic",
            "num_hidden_layers": shapes["num_target_layers"],
            "hidden_size": shapes["hidden_size"],
            "vocab_size": shapes["vocab_size"],
            "model_type": "qwen3",
        },
        target_spec="synthetic",
        target_layer_ids=layer_ids,
        layer_id_convention=LAYER_ID_CONVENTION,
        hidden_size=shapes["hidden_size"],
        num_taps=len(layer_ids),
        codec=args.codec,
        corpus_fingerprint=f"sha256:synthetic-{len(lengths)}-{args.mean_length}-{args.max_length}",
        num_shards=num_shards,
        shard_rows=rows,
    )
    cache = HiddenStateCache.create(path, metadata)
    done = cache.committed_shards()
    width = metadata.row_width
    generator_device = "cuda" if torch.cuda.is_available() else "cpu"
    started = time.perf_counter()
    for shard, (start, stop) in enumerate(rows):
        if shard in done:
            continue
        samples = []
        for row in range(start, stop):
            length = lengths[row]
            ids = torch.from_numpy(rng.integers(0, shapes["vocab_size"] - 1, length, dtype=np.int32))
            loss_mask = torch.zeros(length, dtype=torch.uint8)
            loss_mask[length // 4 :] = 1  # prompt quarter unsupervised, like chat data
            hidden = torch.randn(length, width, device=generator_device, dtype=torch.bfloat16).cpu()
            samples.append(HiddenSample(row, ids, loss_mask, hidden))
        cache.write_shard(shard, samples, [])
    if len(done) < num_shards:
        print(
            f"wrote {num_shards - len(done)} shards ({sum(lengths):,} tokens) in {time.perf_counter() - started:.1f} s"
        )
    return CacheReader(path)


def drop_page_cache(path: Path) -> bool:
    """Ask the kernel to evict the cache files from the page cache (no root needed for clean pages)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages are not evicted: flush the freshly written cache first
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return True


def cache_bytes(path: Path) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, files in os.walk(path) for f in files)


def make_drafter(shapes: dict, args: argparse.Namespace) -> DFlashDrafter:
    config = DFlashConfig(
        hidden_size=shapes["hidden_size"],
        intermediate_size=shapes["intermediate_size"],
        num_hidden_layers=args.num_draft_layers,
        num_attention_heads=shapes["num_attention_heads"],
        num_key_value_heads=shapes["num_key_value_heads"],
        head_dim=shapes["head_dim"],
        rope_theta=shapes["rope_theta"],
        max_position_embeddings=shapes["max_position_embeddings"],
        vocab_size=shapes["vocab_size"],
        block_size=args.block_size,
        mask_token_id=shapes["mask_token_id"],
        target_layer_ids=default_target_layer_ids(shapes["num_target_layers"], args.num_draft_layers),
        num_target_layers=shapes["num_target_layers"],
    )
    drafter = DFlashDrafter(config).to(args.device)
    dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32
    embed = torch.randn(shapes["vocab_size"], shapes["hidden_size"], device=args.device, dtype=dtype) * 0.02
    lm_head = torch.randn(shapes["vocab_size"], shapes["hidden_size"], device=args.device, dtype=dtype) * 0.02
    drafter.attach_target(embed, lm_head)
    return drafter


class Stepper:
    """One drafter training step; anchors seeded by the step index so both phases do identical work."""

    def __init__(self, drafter: DFlashDrafter, args: argparse.Namespace) -> None:
        self.drafter = drafter
        self.args = args
        fused = {"fused": True} if args.device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4, **fused)
        self.autocast = args.device.type == "cuda"

    def __call__(self, batch, index: int) -> tuple[int, int]:
        generator = torch.Generator(device=self.args.device).manual_seed(index)
        anchors = sample_anchors(batch, self.args.block_size, self.args.max_anchors_per_document, generator)
        with torch.autocast(self.args.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            out = dflash_loss(self.drafter, batch, anchors)
            loss = out.weighted_ce_sum / out.weight_sum.clamp(min=1e-6)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss.item()  # the trainer reads the loss every step (non-finite check, logging): a sync per step
        return batch.num_real_tokens, int(anchors.shape[0]) * self.args.block_size


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_phase(stepper: Stepper, batches, device: torch.device, first_index: int) -> dict:
    """Run the steps over ``batches`` (an iterable); time each step end to end including the wait for data.

    The first step is untimed in both phases: for the streamed phase it includes filling the read-ahead, a cost
    paid once per run (the loader reads ahead across epochs); its data wait is reported as ``first_wait_s``.
    """
    iterator = iter(batches)
    before = time.perf_counter()
    first_batch = next(iterator)
    first_wait = time.perf_counter() - before
    stepper(first_batch, first_index)
    del first_batch
    real = drafted = 0
    wait = 0.0
    steps = 0
    sync(device)
    started = time.perf_counter()
    while True:
        before = time.perf_counter()
        batch = next(iterator, None)
        if batch is None:
            break
        wait += time.perf_counter() - before
        tokens, blocks = stepper(batch, first_index + 1 + steps)
        real += tokens
        drafted += blocks
        steps += 1
    sync(device)
    seconds = time.perf_counter() - started
    return {
        "steps": steps,
        "seconds": seconds,
        "real_tokens": real,
        "drafted_tokens": drafted,
        "wait_seconds": wait,
        "first_wait_s": first_wait,
    }


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    shapes = SMOKE if args.smoke else QWEN3_8B
    workdir = None
    if args.cache is None:
        workdir = tempfile.TemporaryDirectory(prefix="dflash_bench_")
        args.cache = Path(workdir.name) / "cache.zarr"
    batches_needed = args.warmup + args.steps * args.rounds
    reader = build_cache(args.cache, shapes, args, num_tokens=int(batches_needed * args.token_budget * 1.1))
    stream_config = StreamConfig(
        token_budget=args.token_budget,
        seed=0,
        prefetch_batches=args.prefetch_batches,
        num_read_workers=args.num_read_workers,
    )
    probe = StreamingLoader(reader, stream_config)
    if len(probe) < batches_needed:
        raise SystemExit(
            f"the cache gives {len(probe)} batches, {batches_needed} needed: lower --steps/--rounds"
        )
    drafter = make_drafter(shapes, args)
    stepper = Stepper(drafter, args)
    device = args.device

    # The same batches for both phases: the first `batches_needed` of epoch 0.
    preloaded = []
    with StreamingLoader(reader, stream_config) as loader:
        for batch in loader:
            preloaded.append(batch.to(device, non_blocking=False))
            if len(preloaded) == batches_needed:
                break
    for index in range(args.warmup):
        stepper(preloaded[index], index)
    sync(device)

    totals = {"preloaded": [], "streamed": []}
    loader_stats = []
    for round_index in range(args.rounds):
        chunk = slice(args.warmup + round_index * args.steps, args.warmup + (round_index + 1) * args.steps)
        first = chunk.start
        totals["preloaded"].append(run_phase(stepper, preloaded[chunk], device, first))
        if args.cold:
            drop_page_cache(args.cache)
        loader = StreamingLoader(CacheReader(args.cache), stream_config, device=device)
        loader.load_state_dict(
            {**loader.state_dict(), "step_in_epoch": first, "global_batches_in_epoch": first}
        )
        iterator = iter(loader)
        totals["streamed"].append(run_phase(stepper, itertools.islice(iterator, args.steps), device, first))
        iterator.close()  # stops the reader threads of this phase
        loader_stats.append(loader.stats)
        loader.close()

    def summary(phase: str) -> dict:
        runs = totals[phase]
        seconds = sum(r["seconds"] for r in runs)
        return {
            "steps": sum(r["steps"] for r in runs),
            "seconds": seconds,
            "real_tokens_per_s": sum(r["real_tokens"] for r in runs) / seconds,
            "drafted_tokens_per_s": sum(r["drafted_tokens"] for r in runs) / seconds,
            "step_ms": 1000 * seconds / max(1, sum(r["steps"] for r in runs)),
            "data_wait_pct": 100 * sum(r["wait_seconds"] for r in runs) / seconds,
            "first_wait_s": max(r["first_wait_s"] for r in runs),
        }

    pre, streamed = summary("preloaded"), summary("streamed")
    read_seconds = sum(s.read_seconds for s in loader_stats)
    read_tokens = sum(s.tokens for s in loader_stats)
    row_bytes = reader.metadata.row_bytes
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shapes": "smoke" if args.smoke else "qwen3-8b",
        "token_budget": args.token_budget,
        "block_size": args.block_size,
        "max_anchors_per_document": args.max_anchors_per_document,
        "num_draft_layers": args.num_draft_layers,
        "cold_page_cache": args.cold,
        "cache_gib": cache_bytes(args.cache) / 2**30,
        "cache_tokens": probe.num_tokens,
        "preloaded": pre,
        "streamed": streamed,
        "ratio_streamed_over_preloaded": streamed["real_tokens_per_s"] / pre["real_tokens_per_s"],
        "streamed_data_wait_pct_of_step": streamed["data_wait_pct"],
        "reader_gib_per_s_per_thread": read_tokens * row_bytes / 2**30 / max(read_seconds, 1e-9),
        "hidden_gib_per_s_needed": streamed["real_tokens_per_s"] * row_bytes / 2**30,
        "targets": {"ratio": ">= 0.97", "data_wait_pct": "< 2"},
    }
    print_result(result)
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2))
    if workdir is not None:
        workdir.cleanup()


def print_result(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"train_stream on {result['device']} ({result['shapes']}, budget {result['token_budget']})"
    )
    for column in ("phase", "steps", "step ms", "real tok/s", "drafted tok/s", "data wait %"):
        table.add_column(column, justify="right")
    for phase in ("preloaded", "streamed"):
        r = result[phase]
        table.add_row(
            phase,
            str(r["steps"]),
            f"{r['step_ms']:.1f}",
            f"{r['real_tokens_per_s']:,.0f}",
            f"{r['drafted_tokens_per_s']:,.0f}",
            f"{r['data_wait_pct']:.2f}",
        )
    console = Console()
    console.print(table)
    console.print(
        f"ratio streamed/preloaded = {result['ratio_streamed_over_preloaded']:.3f} (target >= 0.97); "
        f"data wait = {result['streamed_data_wait_pct_of_step']:.2f}% of step (target < 2%); "
        f"first batch (read-ahead fill, once per run) {result['streamed']['first_wait_s']:.2f} s; "
        f"cache {result['cache_gib']:.2f} GiB, cold={result['cold_page_cache']}; reader "
        f"{result['reader_gib_per_s_per_thread']:.2f} GiB/s per thread, "
        f"{result['hidden_gib_per_s_needed']:.2f} GiB/s needed"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
