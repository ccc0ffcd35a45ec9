"""Extract throughput on one device: bare forwards vs end-to-end extract, bytes per token, compression ratio.

In ONE run, on the same model and the same token-budget batches (length-sorted, right-padded):

1. full plain forward: the transformers base model (every decoder layer + final norm, no LM head), no I/O;
2. truncated runner forward: ``TargetRunner.forward`` (stops after the last tapped layer), outputs left on device;
3. runner with host copies: ``TargetRunner.iter_batches`` (taps copied to pinned host buffers, non-blocking);
4. end-to-end extract: the Dask task's code path (``ShardExtractor``: corpus rows -> runner -> overlapped
   ``HiddenStateCache.write_shard`` with compression and checksums -> commit), timed until the last commit;
5. with ``--via-dask`` (targets loadable by path: ``default`` or a folder): the whole ``extract`` stage through a
   one-GPU LocalCluster (its own worker process loads the target; timed from first task to last commit).

Then prints tokens/s of each, extract / truncated-forward (target >= 0.95), extract / full-forward (target >= 1),
bytes per token on disk, and the compression ratio. Token counts are real (unpadded) tokens.

Run (GPU)::

    python benchmarks/extract.py --target qwen3-8b-random     # random-weight Qwen3-8B shape, no hub needed
    python benchmarks/extract.py --target default             # SmolLM2-135M-Instruct
    python benchmarks/extract.py --smoke                      # tiny, on CPU (a check that it runs)
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from dflash.cache import DEFAULT_CODEC, CacheMetadata, CacheReader, HiddenStateCache
from dflash.corpus import CorpusWriter, open_corpus
from dflash.target import (
    LAYER_ID_CONVENTION,
    TargetIdentity,
    default_target_layer_ids,
    load_target,
)
from dflash.target_runner import TargetRunner, plan_batches
from stages.extract import plan_shards
from stages.extract_worker import ShardExtractor, ShardSpec

# Qwen3-8B's shape (config numbers written here so no model hub is needed); weights are random.
QWEN3_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "vocab_size": 151936,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
# --smoke with --target qwen3-8b-random: the same family, tiny.
QWEN3_TINY = {**QWEN3_8B, "hidden_size": 128, "num_hidden_layers": 12, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256}  # fmt: skip


def build_target(spec: str, device: torch.device, smoke: bool, seed: int) -> tuple[Any, TargetIdentity]:
    """The model (eval, no grads; bf16 on CUDA) and its identity."""
    if spec != "qwen3-8b-random":
        loaded = load_target(spec, device=device)
        return loaded.model, loaded.identity
    from transformers import AutoModelForCausalLM, Qwen3Config

    shape = QWEN3_TINY if smoke else QWEN3_8B
    config = Qwen3Config(**shape)
    config.rope_parameters = {"rope_type": "default", "rope_theta": shape["rope_theta"]}
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    identity = TargetIdentity(
        name="qwen3-8b-random" + ("-tiny" if smoke else ""),
        content_hash=f"random-init:seed{seed}",
        num_hidden_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        model_type="qwen3",
    )
    return model, identity


def write_corpus(path: Path, num_tokens: int, min_len: int, max_len: int, vocab_size: int, seed: int) -> None:
    """Random token ids (the forward cost does not depend on them) with lengths uniform in [min_len, max_len]."""
    rng = np.random.default_rng(seed)
    total = 0
    with CorpusWriter(path, overwrite=True) as writer:
        while total < num_tokens:
            length = int(rng.integers(min_len, max_len + 1))
            ids = rng.integers(0, min(vocab_size, 32000), size=length, dtype=np.int32)
            mask = np.zeros(length, dtype=np.uint8)
            mask[length // 3 :] = 1
            writer.add(ids, mask, f"bench-{writer.num_rows}")
            total += length
        writer.commit({"source": "benchmarks/extract.py random tokens", "seed": seed})


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _padded_batches(rows: list[np.ndarray], plan: list[np.ndarray], device: torch.device) -> list[tuple]:
    batches = []
    for indices in plan:
        lengths = [len(rows[i]) for i in indices]
        padded = max(lengths)
        ids = torch.zeros(len(indices), padded, dtype=torch.int64)
        mask = torch.zeros(len(indices), padded, dtype=torch.int64)
        for r, i in enumerate(indices):
            ids[r, : lengths[r]] = torch.from_numpy(rows[i].astype(np.int64))
            mask[r, : lengths[r]] = 1
        has_padding = min(lengths) != padded
        batches.append((ids.to(device), mask.to(device) if has_padding else None))
    return batches


def time_full_forward(runner: TargetRunner, batches: list[tuple], device: torch.device) -> float:
    decoder = runner._decoder  # the same base model the runner truncates
    with torch.inference_mode():
        ids, mask = batches[0]
        decoder(input_ids=ids, attention_mask=mask, use_cache=False)  # warm-up
        _sync(device)
        started = time.perf_counter()
        for ids, mask in batches:
            positions = torch.arange(ids.shape[1], device=device).expand(ids.shape[0], -1)
            decoder(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
        _sync(device)
    return time.perf_counter() - started


def time_truncated_forward(runner: TargetRunner, batches: list[tuple], device: torch.device) -> float:
    runner.forward(*batches[0])  # warm-up
    _sync(device)
    started = time.perf_counter()
    for ids, mask in batches:
        runner.forward(ids, mask)
    _sync(device)
    return time.perf_counter() - started


def time_runner_with_copies(runner: TargetRunner, rows: list[np.ndarray], device: torch.device) -> float:
    _sync(device)
    started = time.perf_counter()
    for _ in runner.iter_batches(rows):
        pass
    return time.perf_counter() - started


def time_extract(runner: TargetRunner, identity: TargetIdentity, spec: str, corpus_dir: Path, cache_dir: Path,
                 shard_size: int, storage_dtype: str, codec: str) -> tuple[float, dict]:  # fmt: skip
    corpus = open_corpus(corpus_dir)
    shard_rows = plan_shards(corpus.lengths, shard_size)
    metadata = CacheMetadata(
        target=identity.to_dict(), target_spec=spec, target_layer_ids=runner.target_layer_ids,
        layer_id_convention=LAYER_ID_CONVENTION, hidden_size=runner.hidden_size, num_taps=runner.num_taps,
        storage_dtype=storage_dtype, codec=codec, corpus_fingerprint=corpus.fingerprint,
        corpus_path=str(corpus_dir), num_shards=len(shard_rows), shard_rows=shard_rows,
    )  # fmt: skip
    cache = HiddenStateCache.create(cache_dir, metadata, overwrite=True)
    extractor = ShardExtractor(runner)
    _sync(runner.device)
    started = time.perf_counter()
    writes: list[dict] = []
    for shard_id, (start, stop) in enumerate(shard_rows):
        result = extractor.process(ShardSpec(shard_id=shard_id, row_start=start, row_stop=stop, num_tokens=0,
                                             cache_path=str(cache_dir), corpus_path=str(corpus_dir)))  # fmt: skip
        writes += result["committed"]
    writes += extractor.close()
    elapsed = time.perf_counter() - started
    errors = [w for w in writes if "error" in w]
    assert not errors, errors
    counts = cache.finalize()
    counts["size_on_disk"] = CacheReader(cache_dir).size_on_disk()
    counts["num_shards"] = len(shard_rows)
    return elapsed, counts


def time_dask_extract(args: argparse.Namespace, device: torch.device, workdir: Path) -> dict:
    """The ``extract`` stage itself (LocalCluster, one worker on GPU 0 or CPU); its summary dict."""
    from stages.extract import ExtractConfig, run_extract

    if args.target == "qwen3-8b-random":
        raise SystemExit("--via-dask needs a target a worker can load by path (default or a folder)")
    config = ExtractConfig(
        corpus=str(workdir / "corpus"), output=str(workdir / "cache-dask"), target=args.target,
        num_taps=args.num_taps, shard_size=args.shard_size, token_budget=args.token_budget,
        storage_dtype={"bfloat16": "bf16", "float8_e4m3fn": "fp8"}[args.storage_dtype], codec=args.codec,
        dashboard_address=":0", **({"target_gpus": [0]} if device.type == "cuda" else {"workers": 1}),
    )  # fmt: skip
    return run_extract(config, Console(stderr=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="default", help="qwen3-8b-random, default (SmolLM2) or a local path")
    parser.add_argument("--num-taps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=524_288, help="real tokens in the synthetic corpus")
    parser.add_argument("--min-len", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--shard-size", type=int, default=16384, help="tokens per shard")
    parser.add_argument("--storage-dtype", default="bfloat16", choices=["bfloat16", "float8_e4m3fn"])
    parser.add_argument("--codec", default=DEFAULT_CODEC)
    parser.add_argument("--workdir", default=None, help="where the corpus and cache go (default: a temp folder)")
    parser.add_argument("--keep", action="store_true", help="keep the corpus and cache")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU, to check the script runs")
    parser.add_argument("--via-dask", action="store_true", help="also time the full extract stage on a 1-worker LocalCluster")
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.min_len, args.max_len, args.token_budget, args.shard_size = 400, 16, 48, 128, 96
    console = Console()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dflash-bench-extract-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        started = time.perf_counter()
        model, identity = build_target(args.target, device, args.smoke, args.seed)
        console.print(f"target {identity.name} on {device} ({next(model.parameters()).dtype}) in {time.perf_counter() - started:.1f} s")
        layer_ids = default_target_layer_ids(identity.num_hidden_layers, args.num_taps)
        runner = TargetRunner(model, layer_ids, device, token_budget=args.token_budget)
        write_corpus(workdir / "corpus", args.tokens, args.min_len, args.max_len, identity.vocab_size, args.seed)
        corpus = open_corpus(workdir / "corpus")
        rows = [corpus.row(i).input_ids for i in range(len(corpus))]
        num_tokens = int(corpus.lengths.sum())
        plan = plan_batches(corpus.lengths, args.token_budget)
        padded = sum(len(b) * int(corpus.lengths[b].max()) for b in plan)
        batches = _padded_batches(rows, plan, device)

        full_s = time_full_forward(runner, batches, device)
        truncated_s = time_truncated_forward(runner, batches, device)
        del batches
        copies_s = time_runner_with_copies(runner, rows, device)
        extract_s, counts = time_extract(runner, identity, args.target, workdir / "corpus", workdir / "cache",
                                         args.shard_size, args.storage_dtype, args.codec)  # fmt: skip
        dask_summary = time_dask_extract(args, device, workdir) if args.via_dask else None
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)

    raw_per_token = len(layer_ids) * identity.hidden_size * 2
    figures = {
        "target": identity.name,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "target_layer_ids": layer_ids,
        "num_tokens": num_tokens,
        "num_samples": len(corpus),
        "num_batches": len(plan),
        "padding_efficiency": num_tokens / padded,
        "token_budget": args.token_budget,
        "shard_size": args.shard_size,
        "num_shards": counts["num_shards"],
        "storage_dtype": args.storage_dtype,
        "codec": args.codec,
        "full_forward_tokens_per_s": num_tokens / full_s,
        "truncated_forward_tokens_per_s": num_tokens / truncated_s,
        "runner_with_host_copies_tokens_per_s": num_tokens / copies_s,
        "extract_tokens_per_s": num_tokens / extract_s,
        "extract_over_truncated_forward": truncated_s / extract_s,
        "extract_over_full_forward": full_s / extract_s,
        "raw_bf16_bytes_per_token": raw_per_token,
        "stored_bytes_per_token": counts["stored_bytes"] / num_tokens,
        "disk_bytes_per_token": counts["size_on_disk"] / num_tokens,
        "compression_ratio": counts["raw_bytes"] / max(1, counts["stored_bytes"]),
        "quarantined": counts["num_quarantined"],
    }
    if dask_summary is not None:
        figures["dask_extract_tokens_per_s"] = dask_summary["tokens_per_second"]
        figures["dask_extract_over_truncated_forward"] = dask_summary["tokens_per_second"] * truncated_s / num_tokens
    table = Table(title=f"extract benchmark: {identity.name} on {figures['device']}", show_header=False)
    for name, value in figures.items():
        table.add_row(name, f"{value:,.4g}" if isinstance(value, float) else str(value))
    console.print(table)
    print(json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
