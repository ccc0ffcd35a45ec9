"""Extract throughput on one device: bare forwards vs end-to-end extract, bytes per token, compression ratio.

In ONE run, on the same model and the same token-budget batches (each shard batched on its own, length-sorted,
right-padded: exactly the batches the extract tasks run):

1. full plain forward: the transformers base model (every decoder layer + final norm, no LM head), no I/O, called
   like the runner: explicit position ids and NO attention mask (right padding + causal attention: real-token
   outputs equal the masked forward's, and SDPA keeps its ``is_causal`` flash kernel). On fixed-length batches
   (``--reference``: 8 x 2048, no padding) this is exactly the issue's reference plain forward. ``--masked-baseline``
   adds the same forward WITH the padding mask (what ``model(**tokenizer(..., padding=True))`` costs);
2. truncated runner forward: ``TargetRunner.forward`` (stops after the last tapped layer), outputs left on device;
   with ``--compare-compile-parts`` also the same runner with ``compile_parts`` (MLP and RMSNorm through
   ``torch.compile``, compiled and warmed on every batch shape before the repeats);
3. runner with host copies: ``TargetRunner.iter_batches`` shard by shard (taps copied on a side stream into reused
   pinned host buffers, each batch released after use): the extract task without the writes;
4. end-to-end extract: the Dask task's code path (``ShardExtractor``: corpus rows -> runner -> overlapped
   ``HiddenStateCache.write_shard`` (``--writes-in-flight`` at once, ``--write-threads`` compression threads) with
   compression and checksums -> commit), timed from the first shard until every write is committed and the cache
   finalized: everything a user pays except loading the target;
5. with ``--via-dask`` (targets loadable by path: ``default`` or a folder): the whole ``extract`` stage through a
   one-GPU LocalCluster (its own worker process loads the target; timed from first task to last commit).

The model is loaded and the corpus and batches built once; steps 1-4 then run ``--repeats`` times (default 3)
interleaved: each repeat runs every step once, in the order above, and step 4 writes a fresh cache each repeat (the
previous one deleted, untimed). ``--via-dask`` runs once, after the repeats. Each repeat prints its rates.

Then prints tokens/s of each, extract / truncated-forward (target >= 0.95), extract / full-forward (target >= 1),
bytes per token on disk, the compression ratio, and where the extract loop's time went: computing (target + copies),
blocked on shard writes (the device idles), the tail (last writes, finalize), the steady-state rate (tokens over
computing + blocked time: the rate without the run's start and drain), and the mean wall time of a shard write and
of its hidden chunks. Stopping the write threads or processes afterwards (once per worker, not per token) is
timed apart (``extract_close_seconds``). Token counts are real (unpadded) tokens.

Over the repeats, every time and rate figure is the MEDIAN of the per-repeat values: the tokens/s figures are medians
of each repeat's tokens/s; ``extract_over_truncated_forward`` and ``extract_over_full_forward`` are medians of the
ratios taken within each repeat (the phases of one repeat ran back to back); so are the loop's computing, blocked,
tail, steady-rate, close and mean-write figures and ``extract_seconds``. Size figures (stored and disk bytes per
token, the compression ratio, ``num_shards``) are the LAST repeat's cache; ``quarantined`` is the most in any repeat.
``repeats`` gives the count, and the ``*_runs`` keys list the per-repeat values, in repeat order:
``full_forward_tokens_per_s_runs`` (and ``full_forward_masked_tokens_per_s_runs`` with ``--masked-baseline``),
``truncated_forward_tokens_per_s_runs``, ``runner_with_host_copies_tokens_per_s_runs``, ``extract_tokens_per_s_runs``,
``extract_over_truncated_forward_runs``, ``extract_over_full_forward_runs``, ``extract_steady_tokens_per_s_runs``,
``extract_blocked_on_writes_seconds_runs``, ``extract_tail_seconds_runs`` and ``extract_seconds_runs``.

``--codec auto`` runs extract's codec calibration (:mod:`dflash.cache.codec_choice`) on this runner once, before the
first repeat's step 4 (here on any device; ``extract`` itself measures only on CUDA runners by default), prints the
production rate, each candidate's encode rate and ratio, and the choice, and times step 4 of every repeat with the
chosen codec (``codec`` in the figures; ``--via-dask`` passes ``auto`` to the stage, which chooses on its own
worker: ``dask_codec``). ``dask_extract_over_truncated_forward`` is the one Dask run's rate over the median
truncated-forward rate.

``--write-only`` measures the write path alone on the CPU (no model): ``--write-shards`` shards of ``--shard-size``
tokens x ``--num-taps`` x ``--hidden-size`` bf16 (normal values with a per-token log-normal scale, so the exponent
bytes are realistic), written like extract writes them; it prints raw MB/s, tokens/s and CPU seconds per GB.
``--write-only --compare-write-paths`` writes the same shards ``--repeats`` times interleaved through each write path:
``direct`` (ours: :mod:`dflash.cache.chunks`, whole chunks encoded and stored in our threads), ``zarr`` (zarr's own
codec pipeline, ``array[lo:hi] = rows``) and ``zarrs`` (zarr's codec pipeline backed by the ``zarrs`` Rust crate,
``zarr.config.set({"codec_pipeline.path": "zarrs.ZarrsCodecPipeline"})``, where installed), medians side by side.

Run (GPU)::

    python benchmarks/extract.py --target qwen3-8b-random --tokens 262144              # random lengths 256-2048
    python benchmarks/extract.py --target smollm2-random --tokens 262144 --profile 15  # where a forward's time goes
    python benchmarks/extract.py --target smollm2-random --tokens 262144 --compare-compile-parts --profile 15
    python benchmarks/extract.py --target qwen3-8b-random --tokens 262144 --reference  # 8 x 2048, the issue's setup
    python benchmarks/extract.py --write-only --write-shards 8                         # write path, CPU only
    python benchmarks/extract.py --write-only --compare-write-paths --shard-size 65536 # ours vs zarr vs zarrs
    python benchmarks/extract.py --target default                                      # SmolLM2-135M-Instruct
    python benchmarks/extract.py --target default --codec auto --via-dask              # the codec extract chooses
    python benchmarks/extract.py --smoke                      # tiny, on CPU (a check that it runs)
    python benchmarks/extract.py --target qwen3-8b-random --compare-packing --tokens 262144   # padded vs packed
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import resource
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from dflash.cache import (
    DEFAULT_CODEC,
    CacheMetadata,
    CacheReader,
    HiddenSample,
    HiddenStateCache,
    verify_cache,
)
from dflash.cache.chunks import keep_chunk_buffers_mapped
from dflash.cache.codec_choice import (
    AUTO_CODEC,
    calibrate_codecs,
    calibration_row_count,
    choose_codec,
    describe_choice,
)
from dflash.cache.format import codec_config, default_chunk_tokens, stored_row_bytes, zarr_compressors
from dflash.corpus.format import CorpusWriter, open_corpus
from dflash.target.load import TargetIdentity, load_target
from dflash.target.runner import PACKED_ATTENTION, TargetRunner, plan_batches
from dflash.target.taps import LAYER_ID_CONVENTION, default_target_layer_ids
from stages.extract.command import plan_shards
from stages.extract.worker import (
    ShardExtractor,
    ShardSpec,
    configure_write_threads,
    default_write_processes,
    default_write_threads,
)

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


# SmolLM2-135M-Instruct's shape (Llama) with random weights: its throughput without the GGUF (a device call
# carries less); --smoke keeps the family and shrinks it.
SMOLLM2 = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "rope_theta": 100_000.0,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
}
SMOLLM2_TINY = {**SMOLLM2, "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128}  # fmt: skip
#: Random-weight targets: name -> (transformers config class name, shape, --smoke shape).
RANDOM_TARGETS = {
    "qwen3-8b-random": ("Qwen3Config", QWEN3_8B, QWEN3_TINY),
    "smollm2-random": ("LlamaConfig", SMOLLM2, SMOLLM2_TINY),
}


def build_target(spec: str, device: torch.device, smoke: bool, seed: int,
                 num_layers: int | None = None) -> tuple[Any, TargetIdentity]:  # fmt: skip
    """The model (eval, no grads; bf16 on CUDA) and its identity: a loaded target, or one of
    :data:`RANDOM_TARGETS` with seeded random weights (``num_layers``: that many decoder layers instead of the
    shape's)."""
    if spec not in RANDOM_TARGETS:
        loaded = load_target(spec, device=device)
        return loaded.model, loaded.identity
    import transformers
    from transformers import AutoModelForCausalLM

    config_class, full, tiny = RANDOM_TARGETS[spec]
    shape = (tiny if smoke else full) | ({} if num_layers is None else {"num_hidden_layers": num_layers})
    config = getattr(transformers, config_class)(**shape)
    config.rope_parameters = {"rope_type": "default", "rope_theta": shape["rope_theta"]}
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    identity = TargetIdentity(
        name=spec + ("-tiny" if smoke else ""),
        content_hash=f"random-init:seed{seed}",
        num_hidden_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        model_type=config.model_type,
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


#: Six length buckets from 256 to 8,192 tokens (a long-tailed corpus: most rows short, most tokens in long rows),
#: with the share of ROWS drawn from each; a row's length is uniform inside its bucket.
LONG_TAIL_BUCKETS = ((256, 512, 0.34), (513, 1024, 0.26), (1025, 2048, 0.18), (2049, 4096, 0.12),
                     (4097, 6144, 0.06), (6145, 8192, 0.04))  # fmt: skip


def long_tail_lengths(num_tokens: int, seed: int, max_len: int = 8192) -> list[int]:
    """Row lengths drawn from :data:`LONG_TAIL_BUCKETS` (the buckets scaled by ``max_len / 8192``) until
    ``num_tokens`` is reached."""
    rng = np.random.default_rng(seed)
    weights = np.asarray([w for _, _, w in LONG_TAIL_BUCKETS])
    scale = max_len / LONG_TAIL_BUCKETS[-1][1]
    lengths, total = [], 0
    while total < num_tokens:
        low, high, _ = LONG_TAIL_BUCKETS[int(rng.choice(len(LONG_TAIL_BUCKETS), p=weights / weights.sum()))]
        length = max(1, int(rng.integers(round(low * scale), round(high * scale) + 1)))
        lengths.append(length)
        total += length
    return lengths


def long_tail_flop_bound(config: Any, fixed_len: int, tail_lengths: list[int]) -> float:
    """The long-tailed corpus's best possible rate as a fraction of the fixed-length rate, from FLOPs alone: decoder
    FLOPs per real token of rows of ``fixed_len`` over those of ``tail_lengths`` (token-weighted), both at the same
    kernel efficiency. Per layer and token: 2 FLOPs per multiply-add of the q/k/v/o projections and the gated MLP
    (``2 * (2*H*Q + 2*H*KV + 3*H*I)``), plus causal attention over the row, ``4 * Q * (L + 1) / 2`` (QK^T and AV over
    (L+1)/2 keys on average); embeddings and norms left out. Longer rows cost more attention per token, so a
    long-tailed corpus cannot reach the 2,048-token rate even with no padding and perfect kernels.

    Args:
        config: the target's transformers config (``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``,
            ``head_dim`` (else hidden / heads), ``intermediate_size``).
        fixed_len: the reference row length, tokens. tail_lengths: the long-tailed rows' lengths, tokens.
    Returns:
        float in (0, 1] for rows longer on average than ``fixed_len`` (token-weighted).
    """
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    q_dim, kv_dim = heads * head_dim, (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    linear = 2 * (2 * hidden * q_dim + 2 * hidden * kv_dim + 3 * hidden * config.intermediate_size)
    lengths = np.asarray(tail_lengths, dtype=np.float64)
    tail_attention = float((4 * q_dim * (lengths + 1) / 2 * lengths).sum() / lengths.sum())
    return (linear + 4 * q_dim * (fixed_len + 1) / 2) / (linear + tail_attention)


def compare_packing(args: argparse.Namespace, model: Any, identity: Any, device: torch.device, console: Console) -> dict:
    """Truncated runner forwards (``TargetRunner.iter_batches``, taps copied to host, no writes) in ONE run, ``--repeats``
    times interleaved, medians: a fixed-length corpus (rows of ``--max-len``, no padding either way: the reference
    rate), then a long-tailed corpus (:data:`LONG_TAIL_BUCKETS`) right-padded in length-grouped batches and packed
    (samples back to back, attention confined to each) with each packed kernel (:data:`PACKED_ATTENTION`:
    FlexAttention's document mask, SDPA's block-diagonal mask). Real tokens per second."""
    rng = np.random.default_rng(args.seed)
    layer_ids = default_target_layer_ids(identity.num_hidden_layers, args.num_taps)
    vocab = min(identity.vocab_size, 32000)
    fixed_len = min(2048, args.max_len)  # the reference: rows of 2,048 tokens, 8 per 16,384-token batch
    fixed = [rng.integers(0, vocab, size=fixed_len, dtype=np.int64) for _ in range(max(1, args.tokens // fixed_len))]
    tail = [rng.integers(0, vocab, size=n, dtype=np.int64) for n in long_tail_lengths(args.tokens, args.seed, args.max_len)]
    kernels = [name for name in args.packed_attention if name != "varlen" or device.type == "cuda"]
    if len(kernels) < len(args.packed_attention):
        console.print("packed varlen skipped: FlashAttention's varlen kernel runs on CUDA only")
    runners = {"padded": TargetRunner(model, layer_ids, device, token_budget=args.forward_tokens),
               **{f"packed_{name.split('_')[0]}": TargetRunner(model, layer_ids, device, token_budget=args.forward_tokens,
                                                               packing=True, packed_attention=name)
                  for name in kernels}}  # packed_flex, packed_sdpa, packed_varlen
    if args.compare_varlen_split and "varlen" in kernels:  # the same kernel with every sample through varlen
        runners["packed_varlen_nosplit"] = TargetRunner(model, layer_ids, device, token_budget=args.forward_tokens,
                                                        packing=True, packed_attention="varlen",
                                                        varlen_solo_min_length=None)  # fmt: skip

    def rate(runner: TargetRunner, rows: list[np.ndarray]) -> tuple[float, int]:
        _sync(device)
        started = time.perf_counter()
        padded = 0
        for batch in runner.iter_batches(rows):
            padded += batch.num_padded_tokens
            batch.release()
        _sync(device)
        return sum(len(r) for r in rows) / (time.perf_counter() - started), padded

    for runner in runners.values():  # warm-up: kernels, allocator, pinned buffers
        rate(runner, tail[: max(4, len(tail) // 8)])
    # Same hidden states either way (attention confined to each packed sample): the largest difference over a few
    # rows, relative to the largest value (bf16 rounding differs between kernels).
    probe = tail[:12]
    padded_out = runners["padded"].run(probe)
    scale = max(float(a.float().abs().max()) for a in padded_out)
    worst = {mode: max(float((a.float() - b.float()).abs().max()) for a, b in zip(
        padded_out, runners[mode].run(probe), strict=True)) / scale for mode in runners if mode != "padded"}  # fmt: skip
    console.print(f"packed vs padded hidden states, {len(probe)} rows: max |difference| / max |value| "
                  + ", ".join(f"{mode} {value:.3g}" for mode, value in worst.items()))
    runs: dict[str, list[float]] = {f"{name}_{mode}": [] for name in ("fixed", "long_tail") for mode in runners}
    padded_tokens = {}
    for repeat in range(args.repeats):
        for name, rows in (("fixed", fixed), ("long_tail", tail)):
            for mode, runner in runners.items():
                value, padded_tokens[f"{name}_{mode}"] = rate(runner, rows)
                runs[f"{name}_{mode}"].append(value)
        console.print(f"repeat {repeat}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in runs.items()))
    medians = {key: float(np.median(values)) for key, values in runs.items()}
    tail_tokens = sum(len(r) for r in tail)
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "target": identity.name,
        "forward_tokens": args.forward_tokens, "repeats": args.repeats, "taps": layer_ids,
        "fixed_rows": f"{len(fixed)} x {fixed_len}", "long_tail_rows": len(tail), "long_tail_tokens": tail_tokens,
        **{f"{mode}_vs_padded_max_relative_difference": value for mode, value in worst.items()},
        **{f"{k}_tokens_per_s": v for k, v in medians.items()},
        "long_tail_padding_share": 1 - tail_tokens / padded_tokens["long_tail_padded"],
        **{f"long_tail_{mode}_padding_share": 1 - tail_tokens / padded_tokens[f"long_tail_{mode}"] for mode in worst},
        **{f"long_tail_{mode}_over_padded": medians[f"long_tail_{mode}"] / medians["long_tail_padded"] for mode in worst},
        **{f"long_tail_{mode}_over_fixed": medians[f"long_tail_{mode}"] / medians["fixed_padded"] for mode in worst},
        "long_tail_padded_over_fixed": medians["long_tail_padded"] / medians["fixed_padded"],
        # The same kernel on both corpora (what packing itself loses), and what FLOPs allow at best.
        **{f"long_tail_{mode}_over_fixed_{mode}": medians[f"long_tail_{mode}"] / medians[f"fixed_{mode}"]
           for mode in worst},
        "long_tail_flop_bound_over_fixed": long_tail_flop_bound(model.config, fixed_len, [len(r) for r in tail]),
        "runs": json.dumps({k: [round(v) for v in vs] for k, vs in runs.items()}),
    }  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _padded_batches(rows: list[np.ndarray], plan: list[np.ndarray], device: torch.device) -> list[tuple]:
    """Per batch: (right-padded ids [b, P] int64, padding mask [b, P] int64 or None when no row is padded)."""
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


def warm_up_shapes(runner: TargetRunner, batches: list[tuple], device: torch.device, masked: bool = False) -> int:
    """One untimed full forward per distinct batch shape, before any phase is timed: the first call at a new shape
    pays kernel selection and allocator growth, which would otherwise land in whichever phase meets the shape first
    (with mixed lengths, the full forward: it made SmolLM2's full forward look 3x slower than the runner). Returns
    the number of distinct shapes."""
    decoder = runner._decoder
    shapes: dict[tuple, tuple] = {}
    for ids, mask in batches:
        shapes.setdefault(tuple(ids.shape), (ids, mask))
    with torch.inference_mode():
        for ids, mask in shapes.values():
            positions = torch.arange(ids.shape[1], device=device).expand(ids.shape[0], -1)
            decoder(input_ids=ids, attention_mask=None, position_ids=positions, use_cache=False)
            if masked and mask is not None:  # the masked baseline runs other attention kernels
                decoder(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
    _sync(device)
    return len(shapes)


def time_full_forward(runner: TargetRunner, batches: list[tuple], device: torch.device, masked: bool = False) -> float:
    """Every decoder layer (the base model, no LM head), explicit position ids; the padding mask only if
    ``masked`` (without it real tokens are exact under right padding, see the module docstring)."""
    decoder = runner._decoder  # the same base model the runner truncates

    def run(selected: list[tuple]) -> None:
        for ids, mask in selected:
            positions = torch.arange(ids.shape[1], device=device).expand(ids.shape[0], -1)
            decoder(input_ids=ids, attention_mask=mask if masked else None, position_ids=positions, use_cache=False)

    with torch.inference_mode():
        run(batches[:1])  # warm-up
        _sync(device)
        started = time.perf_counter()
        run(batches)
        _sync(device)
    return time.perf_counter() - started


def time_truncated_forward(runner: TargetRunner, batches: list[tuple], device: torch.device) -> float:
    runner.forward(batches[0][0])  # warm-up
    _sync(device)
    started = time.perf_counter()
    for ids, _ in batches:
        runner.forward(ids)
    _sync(device)
    return time.perf_counter() - started


def profile_forwards(runner: TargetRunner, batches: list[tuple], device: torch.device, top: int,
                     console: Console) -> dict:
    """One pass of the truncated forwards over ``batches`` under ``torch.profiler``: wall time per forward against
    the device kernels' time per forward (the gap is the host: issuing operations, Python, waits), operations
    issued and kernels run per forward, the ``top`` kernels by device time and the ``top`` operators by host time."""
    from torch.profiler import ProfilerActivity, profile

    runner.forward(batches[0][0])  # warm, outside the profile
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        for ids, _ in batches:
            runner.forward(ids)
        _sync(device)
        wall = time.perf_counter() - started
    count = len(batches)
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    operators = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("aten::")
                 and not e.cpu_parent]
    device_seconds = sum(e.time_range.elapsed_us() for e in kernels) / 1e6
    by_kernel: dict[str, float] = {}
    for event in kernels:
        by_kernel[event.name] = by_kernel.get(event.name, 0.0) + event.time_range.elapsed_us() / 1e6
    by_operator: dict[str, float] = {}
    for event in operators:
        by_operator[event.name] = by_operator.get(event.name, 0.0) + event.time_range.elapsed_us() / 1e6
    console.print(f"profile: {count} forwards, wall {wall / count * 1e3:.1f} ms per forward, device "
                  f"kernels {device_seconds / count * 1e3:.1f} ms per forward, {len(operators) / count:.0f} top-level "
                  f"operators and {len(kernels) / count:.0f} kernels per forward")
    for name, seconds in sorted(by_kernel.items(), key=lambda item: -item[1])[:top]:
        console.print(f"  kernel   {seconds / count * 1e3:7.2f} ms/forward  {name[:100]}", soft_wrap=True)
    for name, seconds in sorted(by_operator.items(), key=lambda item: -item[1])[:top]:
        console.print(f"  operator {seconds / count * 1e3:7.2f} ms/forward (host, with children)  {name}", soft_wrap=True)
    return {"profile_forwards": len(batches), "profile_wall_ms_per_forward": wall / count * 1e3,
            "profile_device_ms_per_forward": device_seconds / count * 1e3,
            "profile_operators_per_forward": len(operators) / count, "profile_kernels_per_forward": len(kernels) / count}


def time_runner_with_copies(runner: TargetRunner, rows: list[np.ndarray], plan: list[np.ndarray],
                            shard_rows: list[list[int]], device: torch.device,
                            on_start: Callable[[], None] | None = None) -> float:  # fmt: skip
    """``iter_batches`` shard by shard, as the extract task calls it (same batches), without the writes;
    ``on_start`` is called after the warm-up, as the timing starts."""
    for batch in runner.iter_batches([rows[i] for i in plan[0]]):  # warm-up: allocates the pinned buffers once
        batch.release()
    _sync(device)
    if on_start is not None:
        on_start()
    started = time.perf_counter()
    for start, stop in shard_rows:
        for batch in runner.iter_batches(rows[start:stop]):
            batch.release()
    return time.perf_counter() - started


def time_extract(runner: TargetRunner, identity: TargetIdentity, spec: str, corpus_dir: Path, cache_dir: Path,
                 shard_size: int, storage_dtype: str, codec: str, writes_in_flight: int,
                 write_threads: int, write_processes: int | None = None) -> tuple[float, dict]:  # fmt: skip
    corpus = open_corpus(corpus_dir)
    shard_rows = plan_shards(corpus.lengths, shard_size)
    metadata = CacheMetadata(
        target=identity.to_dict(), target_spec=spec, target_layer_ids=runner.target_layer_ids,
        layer_id_convention=LAYER_ID_CONVENTION, hidden_size=runner.hidden_size, num_taps=runner.num_taps,
        storage_dtype=storage_dtype, codec=codec, corpus_fingerprint=corpus.fingerprint,
        corpus_path=str(corpus_dir), num_shards=len(shard_rows), shard_rows=shard_rows,
    )  # fmt: skip
    cache = HiddenStateCache.create(cache_dir, metadata, overwrite=True)
    extractor = ShardExtractor(runner, writes_in_flight=writes_in_flight, write_threads=write_threads,
                               write_processes=write_processes)
    _sync(runner.device)
    started = time.perf_counter()
    writes: list[dict] = []
    compute = wait = 0.0
    for shard_id, (start, stop) in enumerate(shard_rows):
        result = extractor.process(ShardSpec(shard_id=shard_id, row_start=start, row_stop=stop, num_tokens=0,
                                             cache_path=str(cache_dir), corpus_path=str(corpus_dir)))  # fmt: skip
        writes += result["committed"]
        compute += result["compute_seconds"]
        wait += result["write_wait_seconds"]
    writes += extractor.flush()
    counts = cache.finalize()
    elapsed = time.perf_counter() - started  # every shard committed and the cache finalized
    closing = time.perf_counter()
    extractor.close()  # stops the write threads/processes: a once-per-worker cost, not per token (reported apart)
    counts["close_seconds"] = time.perf_counter() - closing
    errors = [w for w in writes if "error" in w]
    assert not errors, errors
    counts["size_on_disk"] = CacheReader(cache_dir).size_on_disk()
    counts["num_shards"] = len(shard_rows)
    # Telemetry: where the extract loop's wall time went (the device idles while the loop waits for writes).
    counts["loop_compute_seconds"], counts["loop_write_wait_seconds"] = compute, wait
    counts["loop_tail_seconds"] = elapsed - compute - wait  # the last writes, finalize
    counts["mean_write_seconds"] = float(np.mean([w["write_seconds"] for w in writes])) if writes else 0.0
    counts["mean_hidden_seconds"] = float(np.mean([w["hidden_seconds"] for w in writes])) if writes else 0.0
    return elapsed, counts


def time_writes(args: argparse.Namespace, workdir: Path) -> dict:
    """The write path alone (CPU): ``args.write_shards`` shards of ``args.shard_size`` tokens, ``args.num_taps`` x
    ``args.hidden_size`` bf16 per token, through ``HiddenStateCache.write_shard`` with ``args.writes_in_flight``
    writes at once and ``args.write_threads`` compression threads. Returns the figures."""
    configure_write_threads(args.write_threads)
    keep_chunk_buffers_mapped()  # as ShardExtractor does in extract workers
    width = args.num_taps * args.hidden_size
    tokens, per_sample = args.shard_size, 1024
    generator = torch.Generator().manual_seed(args.seed)
    # Hidden-state-like values: normal, with a log-normal per-token scale (a realistic spread of exponents).
    hidden = (torch.randn(tokens, width, generator=generator) * torch.randn(tokens, 1, generator=generator).mul(0.5).exp())
    hidden = hidden.to(torch.bfloat16)
    rows_per_shard = -(-tokens // per_sample)
    metadata = CacheMetadata(
        target={"name": "write-only"}, target_spec="write-only", target_layer_ids=list(range(args.num_taps)),
        layer_id_convention=LAYER_ID_CONVENTION, hidden_size=args.hidden_size, num_taps=args.num_taps,
        storage_dtype=args.storage_dtype, codec=codec_config(args.codec), corpus_fingerprint="write-only",
        num_shards=args.write_shards,
        shard_rows=[[k * rows_per_shard, (k + 1) * rows_per_shard] for k in range(args.write_shards)],
    )  # fmt: skip
    cache = HiddenStateCache.create(workdir / "cache-write-only", metadata, overwrite=True)

    def samples(shard: int) -> list[HiddenSample]:
        out = []
        for row, start in enumerate(range(0, tokens, per_sample)):
            stop = min(tokens, start + per_sample)
            out.append(HiddenSample(corpus_row=shard * rows_per_shard + row, hidden=hidden[start:stop],
                                    input_ids=torch.zeros(stop - start, dtype=torch.int32),
                                    loss_mask=torch.ones(stop - start, dtype=torch.uint8)))  # fmt: skip
        return out

    usage = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.writes_in_flight) as pool:
        records = list(pool.map(lambda shard: cache.write_shard(shard, samples(shard)), range(args.write_shards)))
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - usage.ru_utime) + (after.ru_stime - usage.ru_stime)
    raw = sum(record["raw_bytes"] for record in records)
    hidden_bytes = args.write_shards * hidden.numel() * 2
    return {
        "mode": "write-only",
        "direct_chunks": os.environ.get("DFLASH_CACHE_DIRECT_CHUNKS", "1") != "0",
        "write_shards": args.write_shards,
        "shard_tokens": tokens,
        "row_bytes": width * 2,
        "codec": args.codec,
        "writes_in_flight": args.writes_in_flight,
        "write_threads": args.write_threads,
        "cpu_count": os.cpu_count(),
        "hidden_MB_per_s": hidden_bytes / elapsed / 1e6,
        "tokens_per_s": args.write_shards * tokens / elapsed,
        "cpu_seconds_per_GB": cpu / (raw / 1e9),
        "sys_seconds_per_GB": (after.ru_stime - usage.ru_stime) / (raw / 1e9),
        "cpu_over_wall": cpu / elapsed,
        "compression_ratio": raw / max(1, sum(record["stored_bytes"] for record in records)),
        **{f"one_core_seconds_per_GB_{name}": value for name, value in component_costs(hidden, args.codec).items()},
    }


#: ``--compare-write-paths``: name -> (DFLASH_CACHE_DIRECT_CHUNKS, zarr codec pipeline class or None for zarr's).
WRITE_PATHS = {"direct": ("1", None), "zarr": ("0", None), "zarrs": ("0", "zarrs.ZarrsCodecPipeline")}


def compare_write_paths(args: argparse.Namespace, workdir: Path, console: Console) -> dict:
    """:func:`time_writes` through each of :data:`WRITE_PATHS` (``zarrs`` only where the package is installed),
    ``args.repeats`` times interleaved; medians of hidden-state MB/s and their ratios to ``direct``."""
    import importlib.util

    import zarr

    paths = {name: spec for name, spec in WRITE_PATHS.items() if spec[1] is None or importlib.util.find_spec("zarrs")}
    runs: dict[str, list[float]] = {name: [] for name in paths}
    ratios: dict[str, float] = {}
    previous = os.environ.get("DFLASH_CACHE_DIRECT_CHUNKS")
    try:
        for repeat in range(args.repeats):
            for name, (direct, pipeline) in paths.items():
                os.environ["DFLASH_CACHE_DIRECT_CHUNKS"] = direct
                settings = {"codec_pipeline.path": pipeline} if pipeline else {}
                with zarr.config.set(settings):
                    figures = time_writes(args, workdir / name)
                runs[name].append(figures["hidden_MB_per_s"])
                ratios[name] = figures["compression_ratio"]
            console.print(f"repeat {repeat}: " + ", ".join(f"{k} {v[-1]:,.0f} MB/s" for k, v in runs.items()))
        # Each path's cache (its last repeat) must read back: every chunk checksum and commit record verified.
        verified = {}
        for name in paths:
            try:
                verified[name] = bool(verify_cache(workdir / name / "cache-write-only", fail_fast=False)["ok"])
            except Exception as error:  # a path whose cache does not even open is a result too
                verified[name] = f"{type(error).__name__}: {error}"
    finally:
        if previous is None:
            os.environ.pop("DFLASH_CACHE_DIRECT_CHUNKS", None)
        else:
            os.environ["DFLASH_CACHE_DIRECT_CHUNKS"] = previous
    medians = {name: float(np.median(values)) for name, values in runs.items()}
    return {
        "mode": "compare-write-paths", "cpu_count": os.cpu_count(), "zarr": zarr.__version__,
        "zarrs": _version("zarrs"), "codec": args.codec, "write_shards": args.write_shards,
        "shard_tokens": args.shard_size, "row_bytes": args.num_taps * args.hidden_size * 2,
        "write_threads": args.write_threads, "writes_in_flight": args.writes_in_flight, "repeats": args.repeats,
        **{f"{name}_hidden_MB_per_s": value for name, value in medians.items()},
        **{f"{name}_over_direct": value / medians["direct"] for name, value in medians.items() if name != "direct"},
        **{f"{name}_compression_ratio": value for name, value in ratios.items()},
        **{f"{name}_cache_verified": value for name, value in verified.items()},
        "runs": json.dumps({k: [round(v) for v in vs] for k, vs in runs.items()}),
    }  # fmt: skip


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def component_costs(hidden: torch.Tensor, codec: str) -> dict[str, float]:
    """Single-thread CPU seconds per GB of bf16 hidden states for each step of a chunk write (the codec alone,
    sha256, crc32c, one memcpy), on ~80 MB of ``hidden``: what the write path costs per core on this host."""
    import hashlib

    import google_crc32c
    import zarr

    from dflash.cache.chunks import chunk_encoder

    values = hidden.view(torch.uint16).numpy()[: max(1, (80 << 20) // max(1, hidden.shape[1] * 2))]
    chunk = values[: min(len(values), 256)]
    group = zarr.create_group(store={}, zarr_format=3)
    array = group.create_array("h", shape=chunk.shape, dtype="uint16", chunks=chunk.shape, compressors=zarr_compressors(codec_config(codec)))
    encode = chunk_encoder(array)
    steps = {
        "encode": (lambda c: encode(c)) if encode is not None else None,
        "sha256": lambda c: hashlib.sha256(c).digest(),
        "crc32c": lambda c: google_crc32c.value(c),
        "memcpy": lambda c: c.copy(),
    }
    out = {}
    for name, step in steps.items():
        if step is None:
            continue
        started = time.thread_time()
        for start in range(0, len(values) - len(chunk) + 1, len(chunk)):
            step(values[start : start + len(chunk)])
        used = len(values) // len(chunk) * chunk.nbytes
        out[name] = (time.thread_time() - started) / (used / 1e9)
    return out


def choose_codec_here(runner: TargetRunner, rows: list[np.ndarray], lengths: np.ndarray, args: argparse.Namespace,
                      console: Console) -> dict:  # fmt: skip
    """``--codec auto``: extract's calibration (:mod:`dflash.cache.codec_choice`) on this runner, on the first rows of
    the corpus that make one batch, with ``--write-threads`` encode threads; prints the choice and returns its record.
    Unlike ``extract``, it measures on a CPU runner too (extract's default skips CPU runners)."""
    count = calibration_row_count(lengths[: args.forward_tokens], args.forward_tokens, packing=False)
    row_bytes = stored_row_bytes(args.storage_dtype, runner.num_taps, runner.hidden_size)
    calibration = calibrate_codecs(runner, rows[:count], storage_dtype=args.storage_dtype,
                                   chunk_tokens=default_chunk_tokens(row_bytes), write_threads=args.write_threads)  # fmt: skip
    choice = choose_codec({"benchmark": calibration})
    console.print(describe_choice(choice), markup=False)
    if not choice["keeps_up"]:
        console.print(f"warning: {choice['reason']}", style="yellow", markup=False)
    return choice


def time_dask_extract(args: argparse.Namespace, device: torch.device, workdir: Path) -> dict:
    """The ``extract`` stage itself (LocalCluster, one worker on GPU 0 or CPU); its summary dict."""
    from stages.extract.command import ExtractConfig, run_extract

    if args.target in RANDOM_TARGETS:
        raise SystemExit("--via-dask needs a target a worker can load by path (default or a folder)")
    config = ExtractConfig(
        corpus=str(workdir / "corpus"), output=str(workdir / "cache-dask"), target=args.target,
        num_taps=args.num_taps, shard_size=args.shard_size, forward_tokens=args.forward_tokens,
        storage_dtype={"bfloat16": "bf16", "float8_e4m3fn": "fp8"}[args.storage_dtype], codec=args.codec,
        dashboard_address=":0", write_threads=args.write_threads, writes_in_flight=args.writes_in_flight,
        write_processes=args.write_processes, **({"target_gpus": [0]} if device.type == "cuda" else {"target_processes": 1}),
    )  # fmt: skip
    return run_extract(config, Console(stderr=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="default", help="qwen3-8b-random, smollm2-random (random weights), default (SmolLM2) or a local path")
    parser.add_argument("--num-taps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=524_288, help="real tokens in the synthetic corpus")
    parser.add_argument("--min-len", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--forward-tokens", type=int, default=16384)
    parser.add_argument("--shard-size", type=int, default=16384, help="tokens per shard")
    parser.add_argument("--storage-dtype", default="bfloat16", choices=["bfloat16", "float8_e4m3fn"])
    parser.add_argument("--codec", default=DEFAULT_CODEC,
                        help="a codec preset, or auto: calibrate on the runner and use extract's choice (also passed "
                             "to --via-dask's extract, which makes its own)")
    parser.add_argument("--workdir", default=None, help="where the corpus and cache go (default: a temp folder)")
    parser.add_argument("--keep", action="store_true", help="keep the corpus and cache")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU, to check the script runs")
    parser.add_argument("--compare-compile-parts", action="store_true",
                        help="also time the truncated forward with TargetRunner(compile_parts=True) (the MLP and "
                             "RMSNorm modules through torch.compile, shape-generic) in every repeat, after compiling "
                             "and warming every batch shape untimed")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="before the repeats, one pass of the truncated forwards under torch.profiler: wall vs "
                             "device time per forward, operators and kernels per forward, the N top kernels and "
                             "operators")
    parser.add_argument("--via-dask", action="store_true", help="also time the full extract stage on a 1-worker LocalCluster")
    parser.add_argument("--reference", action="store_true",
                        help="the issue's reference setup: fixed length 2048, token budget 16384 (batch 8 x 2048)")
    parser.add_argument("--masked-baseline", action="store_true",
                        help="also time the full forward WITH the padding attention mask")
    parser.add_argument("--writes-in-flight", type=int, default=3, help="shard writes overlapping compute (extract's default)")
    parser.add_argument("--write-threads", type=int, default=None, help="chunk-write threads (default: cores - 1, at most 32)")
    parser.add_argument("--write-processes", type=int, default=None,
                        help="shard writes in N processes reading shared host memory; 0: threads (default: as extract, "
                             "2 on a GPU, 0 on CPU)")
    parser.add_argument("--compare-packing", action="store_true",
                        help="only the runner: fixed-length vs long-tailed corpora, padded vs packed batches")
    parser.add_argument("--packed-attention", nargs="+", default=[name for name in PACKED_ATTENTION if name != "auto"],
                        choices=[name for name in PACKED_ATTENTION if name != "auto"],
                        help="--compare-packing: the packed kernels to time (default: all)")
    parser.add_argument("--compare-varlen-split", action="store_true",
                        help="--compare-packing with varlen: also time varlen with every sample through the varlen "
                             "kernel (packed_varlen_nosplit), against the runner's default split (samples of "
                             "VARLEN_SOLO_MIN_LENGTH tokens or more alone through SDPA where the varlen kernel has "
                             "no native GQA)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="interleaved repeats, figures are medians: the main path's four phases (each repeat runs "
                             "them all, in order; --via-dask runs once after), --compare-packing, --compare-write-paths")
    parser.add_argument("--write-only", action="store_true", help="time the write path alone on the CPU (no model)")
    parser.add_argument("--write-shards", type=int, default=6, help="shards written by --write-only")
    parser.add_argument("--compare-write-paths", action="store_true",
                        help="with --write-only: ours vs zarr's codec pipeline vs zarrs', --repeats interleaved")
    parser.add_argument("--hidden-size", type=int, default=4096, help="H for --write-only (Qwen3-8B: 4096)")
    args = parser.parse_args()
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    if args.reference:
        args.min_len, args.max_len, args.forward_tokens = 2048, 2048, 16384
    if args.smoke:
        args.tokens, args.min_len, args.max_len, args.forward_tokens, args.shard_size = 400, 16, 48, 128, 96
        args.hidden_size, args.write_shards = 64, 3
    args.write_threads = args.write_threads or default_write_threads()
    console = Console()
    if args.write_only and args.codec == AUTO_CODEC:
        raise SystemExit("--codec auto needs a runner to measure on; --write-only takes a codec preset name")
    if args.write_only:
        workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dflash-bench-write-"))
        try:
            figures = compare_write_paths(args, workdir, console) if args.compare_write_paths else time_writes(args, workdir)
        finally:
            if not args.keep:
                shutil.rmtree(workdir, ignore_errors=True)
        _report(console, figures, "write path benchmark (CPU)", args.json)
        return
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")

    if args.compare_packing:
        if args.smoke:
            args.max_len, args.tokens, args.forward_tokens = 256, 2048, 512
        else:
            args.max_len = max(args.max_len, 8192) if args.max_len == 2048 and args.min_len == 256 else args.max_len
        model, identity = build_target(args.target, device, args.smoke, args.seed)
        _report(console, compare_packing(args, model, identity, device, console), "padded vs packed batches", args.json)
        return

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dflash-bench-extract-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        started = time.perf_counter()
        model, identity = build_target(args.target, device, args.smoke, args.seed)
        console.print(f"target {identity.name} on {device} ({next(model.parameters()).dtype}) in {time.perf_counter() - started:.1f} s")
        layer_ids = default_target_layer_ids(identity.num_hidden_layers, args.num_taps)
        runner = TargetRunner(model, layer_ids, device, token_budget=args.forward_tokens)
        write_corpus(workdir / "corpus", args.tokens, args.min_len, args.max_len, identity.vocab_size, args.seed)
        corpus = open_corpus(workdir / "corpus")
        rows = [corpus.row(i).input_ids for i in range(len(corpus))]
        num_tokens = int(corpus.lengths.sum())
        # The batches extract runs: each shard (one task) is batched on its own, so the baselines use the same ones.
        shard_rows = plan_shards(corpus.lengths, args.shard_size)
        plan = [start + batch for start, stop in shard_rows for batch in plan_batches(corpus.lengths[start:stop], args.forward_tokens)]
        padded = sum(len(b) * int(corpus.lengths[b].max()) for b in plan)
        batches = _padded_batches(rows, plan, device)

        num_shapes = warm_up_shapes(runner, batches, device, masked=args.masked_baseline)
        profiled = profile_forwards(runner, batches, device, args.profile, console) if args.profile else {}

        def compiled_runner() -> TargetRunner:  # the same runner with compile_parts (closed after each use)
            return TargetRunner(model, layer_ids, device, token_budget=args.forward_tokens, compile_parts=True)

        if args.compare_compile_parts:  # compile (shape-generic graphs) and warm every batch shape, untimed
            warm = compiled_runner()
            for ids, _ in {tuple(ids.shape): (ids, mask) for ids, mask in batches}.values():
                warm.forward(ids)
            if args.profile:
                profiled.update({f"compiled_{key}": value for key, value in
                                 profile_forwards(warm, batches, device, args.profile, console).items()})
            warm.close()
        choice, codec = None, args.codec
        # Interleaved repeats: every phase once per repeat, in order, so drift (clocks, heat, page cache) spreads over
        # all phases alike; the figures are medians of the per-repeat values (ratios taken within each repeat).
        seconds: dict[str, list[float]] = {"full": [], "masked": [], "truncated": [], "compiled": [], "copies": [],
                                           "extract": []}
        counts_runs: list[dict] = []
        for repeat in range(args.repeats):
            seconds["full"].append(time_full_forward(runner, batches, device))
            if args.masked_baseline:
                seconds["masked"].append(time_full_forward(runner, batches, device, masked=True))
            seconds["truncated"].append(time_truncated_forward(runner, batches, device))
            if args.compare_compile_parts:
                compiled = compiled_runner()
                seconds["compiled"].append(time_truncated_forward(compiled, batches, device))
                compiled.close()
            seconds["copies"].append(time_runner_with_copies(runner, rows, plan, shard_rows, device))
            if repeat == 0 and args.codec == AUTO_CODEC:  # calibrated once; every repeat writes with its choice
                choice = choose_codec_here(runner, rows, corpus.lengths, args, console)
                codec = choice["chosen"]
            shutil.rmtree(workdir / "cache", ignore_errors=True)  # a fresh cache each repeat (untimed)
            extract_s, counts = time_extract(runner, identity, args.target, workdir / "corpus", workdir / "cache",
                                             args.shard_size, args.storage_dtype, codec, args.writes_in_flight,
                                             args.write_threads, args.write_processes)  # fmt: skip
            seconds["extract"].append(extract_s)
            counts_runs.append(counts)
            console.print(f"repeat {repeat}: tokens/s " + ", ".join(
                f"{name} {num_tokens / values[-1]:,.0f}" for name, values in seconds.items() if values)
                + f"; extract / truncated {seconds['truncated'][-1] / extract_s:.3f}", soft_wrap=True)  # fmt: skip
        del batches
        dask_summary = time_dask_extract(args, device, workdir) if args.via_dask else None
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)

    raw_per_token = len(layer_ids) * identity.hidden_size * 2
    rates = {name: [num_tokens / s for s in values] for name, values in seconds.items() if values}
    runs = {
        "full_forward_tokens_per_s": rates["full"],
        **({"full_forward_masked_tokens_per_s": rates["masked"]} if "masked" in rates else {}),
        "truncated_forward_tokens_per_s": rates["truncated"],
        **({"truncated_forward_compiled_parts_tokens_per_s": rates["compiled"],
            "compiled_parts_over_truncated_forward": [t / c for t, c in
                                                      zip(seconds["truncated"], seconds["compiled"], strict=True)]}
           if "compiled" in rates else {}),
        "runner_with_host_copies_tokens_per_s": rates["copies"],
        "extract_tokens_per_s": rates["extract"],
        # Ratios within each repeat (the phases of one repeat ran back to back), then their median.
        "extract_over_truncated_forward": [t / e for t, e in zip(seconds["truncated"], seconds["extract"], strict=True)],
        "extract_over_full_forward": [f / e for f, e in zip(seconds["full"], seconds["extract"], strict=True)],
        "extract_steady_tokens_per_s": [num_tokens / (c["loop_compute_seconds"] + c["loop_write_wait_seconds"])
                                        for c in counts_runs],
        "extract_blocked_on_writes_seconds": [c["loop_write_wait_seconds"] for c in counts_runs],
        "extract_tail_seconds": [c["loop_tail_seconds"] for c in counts_runs],
        "extract_seconds": seconds["extract"],
    }  # fmt: skip

    def median(key: str) -> float:  # times and rates: the median over repeats
        return float(np.median([c[key] for c in counts_runs]))

    last = counts_runs[-1]  # sizes: the last repeat's cache (the same corpus, runner and codec every repeat)
    figures = {
        "target": identity.name,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "target_layer_ids": layer_ids,
        "num_tokens": num_tokens,
        "num_samples": len(corpus),
        "num_batches": len(plan),
        "padding_efficiency": num_tokens / padded,
        "distinct_batch_shapes": num_shapes,
        "forward_tokens": args.forward_tokens,
        "shard_size": args.shard_size,
        "num_shards": last["num_shards"],
        "storage_dtype": args.storage_dtype,
        "codec": codec,
        "codec_requested": args.codec,
        "lengths": [args.min_len, args.max_len],
        "writes_in_flight": args.writes_in_flight,
        "write_threads": args.write_threads,
        "write_processes": default_write_processes(device) if args.write_processes is None else args.write_processes,
        "repeats": args.repeats,
        **profiled,
        # The forward and copy rates (full, masked, truncated, host copies): medians over repeats.
        **{key: float(np.median(values)) for key, values in runs.items() if not key.startswith("extract_")},
        "extract_tokens_per_s": float(np.median(runs["extract_tokens_per_s"])),
        "extract_over_truncated_forward": float(np.median(runs["extract_over_truncated_forward"])),
        "extract_over_full_forward": float(np.median(runs["extract_over_full_forward"])),
        "raw_bf16_bytes_per_token": raw_per_token,
        "stored_bytes_per_token": last["stored_bytes"] / num_tokens,
        "disk_bytes_per_token": last["size_on_disk"] / num_tokens,
        "compression_ratio": last["raw_bytes"] / max(1, last["stored_bytes"]),
        "quarantined": max(c["num_quarantined"] for c in counts_runs),  # the most in any repeat: none may hide
        "extract_compute_seconds": median("loop_compute_seconds"),
        "extract_blocked_on_writes_seconds": float(np.median(runs["extract_blocked_on_writes_seconds"])),
        "extract_tail_seconds": float(np.median(runs["extract_tail_seconds"])),
        "extract_seconds": float(np.median(runs["extract_seconds"])),
        "extract_steady_tokens_per_s": float(np.median(runs["extract_steady_tokens_per_s"])),
        "extract_close_seconds": median("close_seconds"),
        "mean_shard_write_seconds": median("mean_write_seconds"),
        "mean_shard_hidden_chunks_seconds": median("mean_hidden_seconds"),
        **{f"{key}_runs": values for key, values in runs.items()},
    }
    if choice is not None:
        figures["codec_choice_reason"] = choice["reason"]
        figures["codec_production_MB_per_s"] = choice["production_bytes_per_s"]["benchmark"] / 1e6
        for name, candidate in choice["candidates"].items():
            figures[f"codec_{name}_encode_MB_per_s"] = candidate["encode_bytes_per_s"] / 1e6
            figures[f"codec_{name}_ratio"] = candidate["ratio"]
    if dask_summary is not None:
        figures["dask_codec"] = dask_summary["codec"]
        figures["dask_extract_tokens_per_s"] = dask_summary["tokens_per_second"]
        figures["dask_extract_over_truncated_forward"] = (dask_summary["tokens_per_second"]
                                                       / figures["truncated_forward_tokens_per_s"])  # the median
    _report(console, figures, f"extract benchmark: {identity.name} on {figures['device']}", args.json)


def _report(console: Console, figures: dict, title: str, json_path: str | None) -> None:
    table = Table(title=title, show_header=False)
    for name, value in figures.items():
        if isinstance(value, list) and value and all(isinstance(v, float) for v in value):  # per-repeat values
            table.add_row(name, ", ".join(f"{v:,.4g}" for v in value))
        else:
            table.add_row(name, f"{value:,.4g}" if isinstance(value, float) else str(value))
    console.print(table)
    print(json.dumps(figures))
    if json_path:
        Path(json_path).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
