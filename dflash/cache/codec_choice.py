"""Choosing the cache's codec from measured rates: ``extract --codec auto`` (docs/cache-format.md, "Codecs").

The codec is cache-wide (``CacheMetadata.codec``; the reader decodes every chunk with it), so it is chosen once,
before the cache is created, from what each extract worker measures on its own target replica:

1. production: the worker's runner on one forward batch of real corpus rows (the first rows of the first pending
   shard, up to the token budget), called twice: the first call warms up (compiles, allocates the host buffers),
   the second is timed (CUDA synchronized before and after). Rate = tokens x stored row bytes / seconds, the
   stored row being ``n*H*2`` bytes for bf16 or ``n*H + 4n`` for fp8 (:func:`dflash.cache.format.stored_row_bytes`).
2. encode: those hidden states cut into the cache's chunk shape (``chunk_tokens`` rows x n*H), each candidate's
   whole chunk job (fp8 quantization where the cache stores fp8, the codec, the crc32c: the writer's own
   :func:`dflash.cache.chunks.chunk_encoder`) on as many threads as the worker's write path has. Rate = the same
   stored-row bytes per wall second; ratio = raw chunk bytes / encoded bytes (crc32c included).

A candidate keeps up when its encode rate is at least :data:`KEEP_UP_MARGIN` x the production rate. Each worker
needs the first candidate, in order of ratio (:data:`CODEC_CANDIDATES`), that keeps up on it; the cache gets the
lightest any worker needs. Not measured: the storage's write bandwidth, the store calls, the small arrays and
commit records, and the CPU the thread feeding the GPU takes from the write threads; the margin stands for those.
Where even ``none`` cannot keep up, ``none`` is chosen with ``keeps_up: False``: the write path (or storage) is
then the limit, and ``--storage-dtype fp8`` (half the bytes) or the online mode (no cache written) is the answer.

Shapes: T = calibration tokens, n = taps, H = hidden size, C = ``chunk_tokens``.
"""

from __future__ import annotations

import concurrent.futures
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from dflash.cache.chunks import chunk_encoder
from dflash.cache.format import DEFAULT_CODEC, codec_config, quantize_fp8, stored_row_bytes, zarr_compressors

__all__ = [
    "AUTO_CODEC",
    "CODEC_CANDIDATES",
    "CPU_RUNNER_REASON",
    "KEEP_UP_MARGIN",
    "calibration_row_count",
    "measure_production",
    "measure_encode",
    "calibrate_codecs",
    "choose_codec",
    "uncalibrated_choice",
    "describe_choice",
]

#: The codec value that asks for a measured choice (``extract --codec auto``).
AUTO_CODEC = "auto"
#: A candidate keeps up when it encodes at least this multiple of the production rate. Calibration times the
#: encode alone; the write path also stores each chunk, writes the small arrays and the commit record, and shares
#: the cores with the thread that feeds the GPU, none of which is measured.
KEEP_UP_MARGIN = 1.25
#: Lossless candidates, best compression ratio first (SmolLM2 hidden states, docs/cache-format.md: 1.43x, 1.06x,
#: 1.00x); the first is the cache's default codec.
CODEC_CANDIDATES: tuple[str, ...] = ("blosc-zstd1-shuffle", "blosc-lz4-shuffle", "none")
assert CODEC_CANDIDATES[0] == DEFAULT_CODEC
#: Why ``auto`` resolves to the default without measuring when every runner is on the CPU.
CPU_RUNNER_REASON = "CPU runner: the forward is far slower than any codec"


def calibration_row_count(lengths: Sequence[int] | np.ndarray, token_budget: int, packing: bool) -> int:
    """How many leading rows of ``lengths`` make one forward batch: ``rows x longest <= token_budget`` (padded
    batches) or ``sum <= token_budget`` (packed); at least 1 when ``lengths`` is not empty, 0 when it is."""
    count, longest, total = 0, 0, 0
    for length in (int(value) for value in lengths):
        longest, total = max(longest, length), total + length
        if count and (total if packing else (count + 1) * longest) > token_budget:
            break
        count += 1
    return count


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_production(runner: Any, input_ids_list: Sequence[Any], storage_dtype: str) -> tuple[torch.Tensor, dict[str, float]]:
    """Time ``runner`` (a :class:`dflash.target.runner.TargetRunner`) on ``input_ids_list``: one warm-up pass, then
    one timed pass of ``iter_batches`` (device work and the copies to host, CUDA synchronized).

    Args:
        runner: the worker's runner (its device, token budget and packing as extract uses them).
        input_ids_list: per sample a 1-D int sequence (length >= 1); meant to fill one batch
            (:func:`calibration_row_count`).
        storage_dtype: the cache's ``"bfloat16"`` or ``"float8_e4m3fn"``: the stored row width the rate counts.

    Returns:
        ``(hidden, figures)``: ``hidden`` is ``Tensor[T, n*H] bfloat16`` on the CPU (samples in input order, a copy),
        ``figures`` holds ``tokens``, ``seconds`` (the timed pass) and ``production_bytes_per_s``
        (tokens x stored row bytes / seconds).

    Raises:
        ValueError: ``input_ids_list`` is empty.
    """
    if not len(input_ids_list):
        raise ValueError("measure_production needs at least one sample")
    for batch in runner.iter_batches(input_ids_list):  # warm-up: compiles, allocates the host buffers
        batch.release()
    _synchronize(runner.device)
    started = time.perf_counter()
    batches = list(runner.iter_batches(input_ids_list))  # every batch finished (its copy event waited for)
    _synchronize(runner.device)
    seconds = time.perf_counter() - started
    per_sample: list[torch.Tensor | None] = [None] * len(input_ids_list)
    for batch in batches:
        for index, hidden in zip(batch.indices, batch.hidden, strict=True):
            per_sample[index] = hidden.clone()
        batch.release()
    hidden = torch.cat(per_sample)  # type: ignore[arg-type]
    tokens = int(hidden.shape[0])
    row_bytes = stored_row_bytes(storage_dtype, runner.num_slots, runner.hidden_size)
    return hidden, {"tokens": tokens, "seconds": seconds, "production_bytes_per_s": tokens * row_bytes / max(seconds, 1e-9)}


def measure_encode(hidden: torch.Tensor, codec: str, *, storage_dtype: str, num_taps: int, chunk_tokens: int,
                   threads: int) -> dict[str, float]:  # fmt: skip
    """Encode rate and ratio of the cache codec preset ``codec`` on ``hidden``, as the writer's chunk jobs do it.

    ``hidden [T, n*H]`` (bf16) is cut into chunks of ``chunk_tokens`` rows (the tail that fills no chunk is left
    out; fewer than ``chunk_tokens`` tokens make one chunk of T rows, as a shard that small is stored). Each job
    does what a writer's chunk job does before its store call: fp8 quantization (``storage_dtype``
    ``"float8_e4m3fn"``), the codec and the crc32c (:func:`dflash.cache.chunks.chunk_encoder`, byte-identical to
    the writer). Jobs cycle over the chunks until each of the ``threads`` threads has at least two, so a short
    calibration still keeps every thread busy.

    Returns:
        ``encode_bytes_per_s``: stored-row bytes (``stored_row_bytes`` per token) encoded per wall second;
        ``ratio``: raw / encoded bytes of the chunks (crc32c included, so ``none`` is just below 1);
        ``chunks``, ``chunk_tokens``, ``jobs``: what was encoded.

    Raises:
        ConfigError: ``codec`` is not a preset name.
        ValueError: ``hidden`` is empty or not 2-D with ``num_taps`` dividing its width, or ``threads < 1``.
    """
    import zarr

    if hidden.dim() != 2 or not hidden.shape[0] or hidden.shape[1] % num_taps or threads < 1:
        raise ValueError(f"measure_encode: expected hidden [T>0, n*H] with n={num_taps} and threads >= 1, got "
                         f"{tuple(hidden.shape)} and {threads}")  # fmt: skip
    tokens, width = int(hidden.shape[0]), int(hidden.shape[1])
    rows = min(chunk_tokens, tokens)
    bits = hidden.detach().to("cpu", torch.bfloat16).contiguous().view(torch.uint16).numpy()
    chunks = [bits[start : start + rows] for start in range(0, tokens - rows + 1, rows)]
    fp8 = storage_dtype != "bfloat16"
    array = zarr.create_array(zarr.storage.MemoryStore(), shape=(rows, width), chunks=(rows, width),
                              dtype="uint8" if fp8 else "uint16", compressors=zarr_compressors(codec_config(codec)),
                              fill_value=0, config={"write_empty_chunks": True})  # fmt: skip
    encode = chunk_encoder(array)
    assert encode is not None, f"{codec}: the writer's direct encoder does not know this codec"

    def job(chunk: np.ndarray) -> int:
        stored = quantize_fp8(torch.from_numpy(chunk).view(torch.bfloat16), num_taps)[0] if fp8 else chunk
        return len(encode(stored))

    encoded = [job(chunk) for chunk in chunks]  # sizes of each distinct chunk; also warms the codec up
    raw = len(chunks) * rows * width * (1 if fp8 else 2)  # the chunks' bytes as stored before the codec
    num_jobs = math.ceil(max(len(chunks), 2 * threads) / threads) * threads
    with concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="codec-calibration") as pool:
        started = time.perf_counter()
        list(pool.map(job, (chunks[k % len(chunks)] for k in range(num_jobs))))
        seconds = time.perf_counter() - started
    row_bytes = stored_row_bytes(storage_dtype, num_taps, width // num_taps)
    return {"encode_bytes_per_s": num_jobs * rows * row_bytes / max(seconds, 1e-9), "ratio": raw / sum(encoded),
            "chunks": len(chunks), "chunk_tokens": rows, "jobs": num_jobs}  # fmt: skip


def calibrate_codecs(runner: Any, input_ids_list: Sequence[Any], *, storage_dtype: str, chunk_tokens: int,
                     write_threads: int, candidates: Sequence[str] = CODEC_CANDIDATES) -> dict[str, Any]:  # fmt: skip
    """One worker's calibration: :func:`measure_production` on ``input_ids_list``, then :func:`measure_encode` of
    those hidden states for every candidate with ``write_threads`` threads (the worker's write path).

    Returns:
        ``{"device", "tokens", "seconds", "production_bytes_per_s", "write_threads", "candidates": {name:
        {"encode_bytes_per_s", "ratio", "chunks", "chunk_tokens", "jobs"}}}`` (JSON-able; rates in bytes/s).

    Raises:
        ValueError: ``input_ids_list`` is empty; ConfigError: an unknown candidate name.
    """
    hidden, production = measure_production(runner, input_ids_list, storage_dtype)
    measured = {name: measure_encode(hidden, name, storage_dtype=storage_dtype, num_taps=runner.num_slots,
                                     chunk_tokens=chunk_tokens, threads=write_threads) for name in candidates}  # fmt: skip
    return {"device": str(runner.device), **production, "write_threads": int(write_threads), "candidates": measured}


def choose_codec(calibrations: dict[str, dict[str, Any]], *, margin: float = KEEP_UP_MARGIN,
                 candidates: Sequence[str] = CODEC_CANDIDATES) -> dict[str, Any]:  # fmt: skip
    """The cache-wide codec from the workers' :func:`calibrate_codecs` results (worker name -> result).

    Each worker needs the first of ``candidates`` (best ratio first) whose ``encode_bytes_per_s`` is at least
    ``margin`` x its ``production_bytes_per_s``, or the last one when none is; the choice is the lightest (latest in
    ``candidates``) any worker needs.

    Returns:
        The ``extra["codec_choice"]`` record: ``requested`` (``"auto"``), ``chosen`` (a preset name), ``margin``,
        ``keeps_up`` (the chosen codec keeps up on every worker), ``production_bytes_per_s`` (per worker),
        ``candidates`` ({name: {``encode_bytes_per_s`` and ``ratio`` of the slowest-encoding worker,
        ``keeps_up`` on every worker}}), ``workers`` (each worker's full result) and ``reason`` (one sentence).

    Raises:
        ValueError: no calibration given, or ``margin <= 0``.
    """
    if not calibrations or not margin > 0:
        raise ValueError(f"choose_codec needs at least one calibration and margin > 0, got {len(calibrations)} and {margin}")
    keeps = {worker: {name: result["candidates"][name]["encode_bytes_per_s"] >= margin * result["production_bytes_per_s"]
                      for name in candidates} for worker, result in calibrations.items()}  # fmt: skip
    needs = {worker: next((k for k, name in enumerate(candidates) if ok[name]), None) for worker, ok in keeps.items()}
    chosen = candidates[max(len(candidates) - 1 if k is None else k for k in needs.values())]
    summary = {}
    for name in candidates:
        slowest = min(calibrations, key=lambda worker: calibrations[worker]["candidates"][name]["encode_bytes_per_s"])
        figures = calibrations[slowest]["candidates"][name]
        summary[name] = {"encode_bytes_per_s": figures["encode_bytes_per_s"], "ratio": figures["ratio"],
                         "keeps_up": all(ok[name] for ok in keeps.values())}  # fmt: skip
    keeps_up = summary[chosen]["keeps_up"]
    if chosen == candidates[0]:
        reason = f"{chosen} (the default) encodes at least {margin:g}x the production rate on every worker"
    elif keeps_up:
        heavier = candidates[candidates.index(chosen) - 1]
        lagging = sorted(worker for worker, ok in keeps.items() if not ok[heavier])
        reason = (f"{heavier} encodes below {margin:g}x the production rate on worker(s) {', '.join(lagging)}; "
                  f"{chosen} keeps up on every worker")  # fmt: skip
    else:
        stuck = sorted(worker for worker, ok in keeps.items() if not ok[chosen])
        reason = (f"not even {chosen} encodes {margin:g}x the production rate on worker(s) {', '.join(stuck)}: the "
                  "write path (or storage) stays the limit; use --storage-dtype fp8 (half the bytes) or the online "
                  "mode (dflash-stages online: no cache written)")  # fmt: skip
    return {"requested": AUTO_CODEC, "chosen": chosen, "margin": margin, "keeps_up": keeps_up,
            "production_bytes_per_s": {worker: result["production_bytes_per_s"] for worker, result in calibrations.items()},
            "candidates": summary, "workers": calibrations, "reason": reason}  # fmt: skip


def uncalibrated_choice(reason: str) -> dict[str, Any]:
    """The ``extra["codec_choice"]`` record of an ``auto`` codec resolved to the default without measuring."""
    return {"requested": AUTO_CODEC, "chosen": DEFAULT_CODEC, "reason": reason}


def describe_choice(choice: dict[str, Any]) -> str:
    """One readable line for a :func:`choose_codec` or :func:`uncalibrated_choice` record (rates in MB/s)."""
    if "candidates" not in choice:
        return f"codec auto -> {choice['chosen']} ({choice['reason']})"
    production = choice["production_bytes_per_s"]
    where = f"on {len(production)} workers, the fastest" if len(production) > 1 else "on its worker"
    parts = [f"{name} {_megabytes(figures['encode_bytes_per_s'])} MB/s ratio {figures['ratio']:.3f} "
             f"({'keeps up' if figures['keeps_up'] else 'too slow'})" for name, figures in choice["candidates"].items()]  # fmt: skip
    return (f"codec auto: hidden states produced at {_megabytes(max(production.values()))} MB/s ({where}); encode "
            f"{'; '.join(parts)} -> {choice['chosen']} (keeping up = encoding >= {choice['margin']:g}x production)")


def _megabytes(bytes_per_s: float) -> str:
    value = bytes_per_s / 1e6
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"
