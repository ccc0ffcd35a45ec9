"""Worker side of ``dflash-stages extract``: the Dask WorkerPlugin holding one target replica, and the shard task.

A task is pure in Dask's sense: a :class:`ShardSpec` (a corpus row range) in, a small metadata dict out, never
arrays. The worker plugin loads the target once per worker in ``setup`` (pinning its GPU) and frees it in
``teardown``. :class:`ShardExtractor` does the work and is usable without Dask (benchmarks, tests).

Overlap of storage with compute: a shard's hidden states are handed to a ``concurrent.futures`` writer pool
(``writes_in_flight`` threads, default 3), which calls ``HiddenStateCache.write_shard`` (arrays first, commit
record last) while the same worker's next shards run on the device. Each write's ``hidden`` chunks are gathered,
encoded, checksummed and stored in parallel by the cache's process-wide pool of ``write_threads`` chunk threads
(``zarr.config`` ``threading.max_workers``; niced below this thread, which feeds the GPU; numcodecs and hashlib
release the GIL; docs/cache-format.md "Write path"). A task returns once its shard is computed and reports the shards whose
writes finished since (``committed``); the driver collects the pending writes with :func:`flush_worker` and then
trusts only the cache's commit records: a shard whose write was lost (worker killed) is simply not committed and
is redone. One writer per shard holds because a shard is one task and one write.

Before a new cache is created with ``--codec auto``, :func:`calibrate_worker_codecs` (one task pinned to each
worker) measures the worker's hidden-state production and each candidate codec's encode rate on its own runner and
write threads (:mod:`dflash.cache.codec_choice`); it writes nothing.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import zarr
from distributed import get_worker

from dflash.cache import HiddenSample, HiddenStateCache, quarantine_record
from dflash.cache.chunks import keep_chunk_buffers_mapped
from dflash.cache.codec_choice import calibrate_codecs
from dflash.cache.writer import chunk_write_threads
from dflash.corpus.format import open_corpus
from dflash.errors import ConfigError
from dflash.faults import fault_point
from dflash.target.runner import TargetRunner
from stages.config.exit_status import is_user_error
from stages.replicas.replica import TargetReplicaPlugin
from stages.replicas.tasks import returns_user_errors

__all__ = [
    "ShardSpec",
    "CalibrationSpec",
    "ShardExtractor",
    "TargetWorkerPlugin",
    "extract_shard",
    "calibrate_worker_codecs",
    "flush_worker",
    "configure_write_threads",
    "default_write_threads",
    "PLUGIN_NAME",
]

log = logging.getLogger(__name__)

PLUGIN_NAME = "dflash-extract-target"


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardSpec:
    """One task: corpus rows ``[row_start, row_stop)`` become cache shard ``shard_id``.

    Fields:
        shard_id: index into the cache's ``shard_rows``.
        row_start, row_stop: corpus row range.
        num_tokens: tokens in that range (for progress).
        cache_path: the cache (path or fsspec URL).
        corpus_path: the corpus folder.
        max_length, length_policy: rows over ``max_length`` are skipped (``"drop"``) or cut (``"truncate"``;
            skipped when no supervised token is left); ``"error"`` was enforced by the driver already.
    """

    shard_id: int
    row_start: int
    row_stop: int
    num_tokens: int
    cache_path: str
    corpus_path: str
    max_length: int | None = None
    length_policy: str = "error"


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibrationSpec:
    """The codec calibration task of ``extract --codec auto`` (:mod:`dflash.cache.codec_choice`), one per worker.

    Fields:
        corpus_path: the corpus folder.
        rows: the corpus rows of one forward batch (the driver takes the first kept rows of the first pending shard,
            ``dflash.cache.codec_choice.calibration_row_count``).
        truncate_to: rows are cut to this many tokens (``length_policy="truncate"``); ``None``: whole rows.
        storage_dtype: the cache's ``"bfloat16"`` or ``"float8_e4m3fn"``.
        chunk_tokens: the cache's tokens per ``hidden`` chunk.
        on_cpu: also calibrate a CPU runner (``codec_calibration="always"``); otherwise a CPU worker runs nothing
            and reports ``calibrated: False``.
    """

    corpus_path: str
    rows: tuple[int, ...]
    truncate_to: int | None = None
    storage_dtype: str = "bfloat16"
    chunk_tokens: int
    on_cpu: bool = False


def default_write_threads(cpus_per_worker: int | None = None) -> int:
    """``cpus_per_worker - 1`` (at least 1, at most 32): every core but one for the thread feeding the GPU (chunk
    threads also run at a lower priority than it, see ``dflash.cache.writer``). ``cpus_per_worker`` defaults to the
    CPUs this process may use. An 8B target with 5 taps produces ~1.4 GB/s of bf16 per H200; the write path costs
    ~4-5 CPU-seconds per GB there (docs/benchmarks.md), so it needs ~7 cores."""
    if cpus_per_worker is None:
        cpus_per_worker = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(32, int(cpus_per_worker) - 1))


def configure_write_threads(write_threads: int) -> None:
    """Let zarr compress up to ``write_threads`` chunks at once in this process.

    Sets ``zarr.config`` ``threading.max_workers`` (zarr's pool, which runs the Blosc/Zstd encodes) and
    ``async.concurrency`` (chunks in flight per array write). The pool size applies when zarr creates its pool,
    i.e. before this process's first zarr read or write that follows the call; call it at worker start.

    Raises:
        ConfigError: ``write_threads < 1``.
    """
    if write_threads < 1:
        raise ConfigError(f"write_threads: expected >= 1, got {write_threads}")
    zarr.config.set({"threading.max_workers": int(write_threads), "async.concurrency": max(int(write_threads), 4)})


def default_write_processes(device: torch.device | str) -> int:
    """Write processes per extract worker when none are asked for: 2 for a CUDA runner, 0 (threads) on CPU, and 0
    in a daemonic process (which may not start children; e.g. workers of an external Dask cluster left at
    ``distributed.worker.daemon: true``).

    Why 2 on a GPU: with the writes in threads of the worker process, the thread feeding the GPU competes with them
    for the interpreter, and on one H200 (8B-shaped target, 16 cores) the loop's compute took 15% longer than
    the same batches without writes; with 2 write processes it took 0.6% longer (docs/benchmarks.md).
    A CPU runner uses the cores itself, so the writes stay in its threads.
    """
    if torch.device(device).type != "cuda":
        return 0
    if multiprocessing.current_process().daemon:
        log.warning("extract worker is a daemonic process (cannot start write processes): writing shards in threads; "
                    "set distributed.worker.daemon: false on the workers to write in processes")
        return 0
    return 2


class ShardExtractor:
    """Computes shards with a :class:`TargetRunner` and writes them through ``HiddenStateCache.write_shard``.

    Args:
        runner: the target runner.
        writes_in_flight: shard writes allowed to run at once beside compute (backpressure: handing over shard k
            first waits for the oldest write while ``writes_in_flight`` are pending). Host memory held: about
            ``writes_in_flight + 1`` shards of hidden states (pinned buffers, reused).
        write_threads: if given, :func:`configure_write_threads` is applied (process-wide zarr setting); with
            ``write_processes`` the threads are split evenly between the write processes.
        write_processes: 0: shard writes run in this process's writer threads. N > 0: they run in N spawned write
            processes reading the hidden states from the runner's shared host buffers
            (:mod:`dflash.cache.process_writer`; the runner is switched to shared buffers). ``None`` (default):
            :func:`default_write_processes` (2 for a CUDA runner, 0 on CPU).

    Call :meth:`flush` to wait for the pending writes; :meth:`close` flushes and stops the writer threads.

    Raises:
        ConfigError: ``writes_in_flight < 1`` or ``write_threads < 1``.
    """

    def __init__(self, runner: TargetRunner, *, writes_in_flight: int = 3, write_threads: int | None = None,
                 write_processes: int | None = None) -> None:  # fmt: skip
        if writes_in_flight < 1:
            raise ConfigError(f"writes_in_flight: expected >= 1, got {writes_in_flight}")
        if write_processes is None:
            write_processes = default_write_processes(runner.device)
        if write_processes < 0:
            raise ConfigError(f"write_processes: expected >= 0, got {write_processes}")
        self._processes = None
        self._write_processes, self._write_threads = int(write_processes), write_threads
        self._fallback_warned = False
        self._submit_lock = threading.Lock()
        if write_processes:
            runner.use_shared_host_buffers()
            self._processes = self._start_write_processes()
        if write_threads is not None:  # also in process mode: shards fall back to threads when shared memory is full
            configure_write_threads(write_threads)
        keep_chunk_buffers_mapped()  # reuse chunk-sized buffers instead of page-faulting new ones per chunk
        self.runner = runner
        self.writes_in_flight = int(writes_in_flight)
        self._writer = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.writes_in_flight, thread_name_prefix="dflash-writer"
        )
        self._pending: collections.deque[tuple[int, concurrent.futures.Future]] = collections.deque()
        self._caches: dict[str, Any] = {}
        self._corpora: dict[str, Any] = {}

    @property
    def write_threads(self) -> int:
        """Chunk-write threads this extractor's shard writes run on: those of its write processes together, or the
        process-wide chunk pool's (``dflash.cache.writer.chunk_write_threads``) when it writes in threads."""
        if self._processes is not None:
            return int(self._processes.write_threads)
        return chunk_write_threads()

    def _start_write_processes(self) -> Any:
        from dflash.cache.process_writer import ProcessShardWriter

        writer = ProcessShardWriter(self._write_processes, write_threads=self._write_threads)
        writer.warm_up()  # spawn them now (imports included), not during the first shard write
        return writer

    def _submit_to_processes(self, spec: ShardSpec, kept: list, quarantined: list[dict],
                             skipped: list[dict]) -> concurrent.futures.Future | None:  # fmt: skip
        """The shard's write in a write process, or ``None`` when it must be written in a thread: its hidden states
        are in private buffers (shared memory was full), or the process pool broke (a write process died; the pool
        is restarted for later shards)."""
        try:
            return self._processes.submit(spec.cache_path, spec.shard_id, kept, quarantined, skipped=skipped)
        except ValueError:  # hidden states in private buffers (the runner could not get shared memory)
            if not self._fallback_warned:
                self._fallback_warned = True
                log.warning("shard %d: hidden states are not in shared memory; writing such shards in threads of "
                            "this worker", spec.shard_id)
        except concurrent.futures.BrokenExecutor as error:  # a write process died (OOM killer, crash)
            log.warning("shard %d: the write processes broke (%s); writing this shard in a thread and restarting "
                        "them", spec.shard_id, error)
            self._processes.shutdown(wait=False)
            self._processes = self._start_write_processes()
        return None

    def _cache(self, path: str) -> Any:
        if path not in self._caches:
            self._caches[path] = HiddenStateCache.open(path)
        return self._caches[path]

    def _corpus(self, path: str) -> Any:
        if path not in self._corpora:
            self._corpora[path] = open_corpus(path)
        return self._corpora[path]

    @staticmethod
    def _result(shard_id: int, future: concurrent.futures.Future) -> dict:
        try:
            result = future.result()
        except Exception as error:  # reported to the driver, which redoes uncommitted shards
            if not is_user_error(error):  # a user's error (full disk...) is the driver's one line
                log.exception("writing shard %d failed", shard_id)
            return {"shard": shard_id, "error": f"{type(error).__name__}: {error}"}
        return {"shard": shard_id, **(result or {})}

    def _collect_pending(self, keep: int = 0, *, finished: bool = True) -> list[dict]:
        """Commit records (or errors) of pending writes, oldest first: waits until at most ``keep`` are pending,
        and with ``finished`` also collects any later write that is already done (without waiting)."""
        out: list[dict] = []
        while len(self._pending) > keep:
            out.append(self._result(*self._pending.popleft()))
        while finished and self._pending and self._pending[0][1].done():
            out.append(self._result(*self._pending.popleft()))
        return out

    def process(self, spec: ShardSpec) -> dict:
        """Compute shard ``spec.shard_id`` and queue its write.

        Returns:
            ``{"shard", "rows", "tokens", "skipped", "padded_tokens", "batching", "compute_seconds", "write_wait_seconds",
            "committed": [commit dicts of writes finished since the last call]}``. ``batching``: ``"padded"`` or
            ``"packed (<kernel>)"``, the packed-attention kernel this worker resolved. ``compute_seconds``: reading the
            rows, queuing the forwards and waiting for every batch's copy to host but the last; ``write_wait_seconds``:
            then blocked until at most ``writes_in_flight - 1`` earlier writes were pending (a large share means the
            write path is the bottleneck; it also covers an earlier shard's last batch still on the device).

        The shard's last batch is finished (its copy waited for, its samples checked for non-finite values) by the
        shard's write job in a writer thread, so this call returns while that batch is still computing and the next
        call queues its first forward behind it: the device does not idle between shards. The shard's samples
        and quarantined samples (``quarantined`` of its commit dict, ``CacheReader.quarantined``) are therefore
        known once its write commits. Host and device memory: at most one batch more than within a shard.
        """
        started = time.perf_counter()
        fault_point("extract.shard", spec.corpus_path)
        rows = self._corpus(spec.corpus_path).rows(spec.row_start, spec.row_stop)
        skipped: list[dict] = []
        todo: list[tuple[int, Any, Any]] = []  # (index into rows, input_ids, loss_mask) of extracted rows
        for index, row in enumerate(rows):
            input_ids, loss_mask = row.input_ids, row.loss_mask
            if spec.max_length is not None and len(input_ids) > spec.max_length:
                if spec.length_policy == "drop":
                    skipped.append({"corpus_row": spec.row_start + index, "reason": f"longer than max_length {spec.max_length}"})
                    continue
                if spec.length_policy == "truncate":
                    input_ids, loss_mask = input_ids[: spec.max_length], loss_mask[: spec.max_length]
                    if not loss_mask.any():
                        skipped.append({"corpus_row": spec.row_start + index, "reason": "no supervised token after truncation"})
                        continue
            todo.append((index, input_ids, loss_mask))
        samples: list[HiddenSample | None] = [None] * len(todo)
        quarantined: list[dict] = []
        num_padded = 0
        batches = []  # their pinned host buffers go back to the runner once the shard is written

        def take(batch: Any) -> None:  # the finished batch's samples, or their quarantine records
            batches.append(batch)
            for slot, hidden, bad_layers in zip(batch.indices, batch.hidden, batch.nonfinite_layers, strict=True):
                index, input_ids, loss_mask = todo[slot]
                row = rows[index]
                corpus_row = spec.row_start + index
                if bad_layers:
                    quarantined.append(quarantine_record(corpus_row, str(row.sample_id), bad_layers))
                    log.warning(
                        "shard %d: sample %s (corpus row %d) has non-finite hidden states at tapped layers %s; "
                        "quarantined",
                        spec.shard_id,
                        row.sample_id,
                        corpus_row,
                        bad_layers,
                    )
                    continue
                samples[slot] = HiddenSample(
                    corpus_row=corpus_row,
                    input_ids=torch.as_tensor(input_ids, dtype=torch.int32),
                    loss_mask=torch.as_tensor(loss_mask, dtype=torch.uint8),
                    hidden=hidden,
                )

        # Every batch but the last is finished here (its copy waited for while the next forward runs); the last is
        # finished by the shard's write job, so this call returns with its forward still queued and the next
        # shard's first forward is queued behind it: the device does not idle between shards.
        last = None
        for pending in self.runner.iter_pending([input_ids for _, input_ids, _ in todo]):
            num_padded += pending.num_padded_tokens
            if pending.last:
                last = pending
            else:
                take(pending.finish())
        compute_seconds = time.perf_counter() - started
        waiting = time.perf_counter()
        committed = self._collect_pending(keep=self.writes_in_flight - 1)  # backpressure: the device idles here
        write_wait_seconds = time.perf_counter() - waiting

        cache = self._cache(spec.cache_path)  # opened here, not in the writer threads

        def write() -> Any:  # in a writer thread
            if last is not None:
                take(last.finish())
            kept = [sample for sample in samples if sample is not None]
            quarantined.sort(key=lambda entry: entry["corpus_row"])
            if self._processes is not None:
                with self._submit_lock:  # one writer thread at a time may find the pool broken and restart it
                    future = self._submit_to_processes(spec, kept, quarantined, skipped)
                if future is not None:
                    return future.result()
            return cache.write_shard(spec.shard_id, kept, quarantined, skipped=skipped)

        future = self._writer.submit(write)

        def release(_: concurrent.futures.Future, batches: list = batches) -> None:
            for batch in batches:
                batch.release()

        future.add_done_callback(release)
        self._pending.append((spec.shard_id, future))
        return {
            "shard": spec.shard_id,
            "rows": [spec.row_start, spec.row_stop],
            "tokens": sum(len(input_ids) for _, input_ids, _ in todo),
            "skipped": len(skipped),
            "padded_tokens": num_padded,
            "batching": f"packed ({self.runner.packed_attention})" if self.runner.packing else "padded",
            "compute_seconds": compute_seconds,
            "write_wait_seconds": write_wait_seconds,
            "committed": committed,
        }

    def flush(self) -> list[dict]:
        """Wait for every pending write; their commit dicts (or ``{"shard", "error"}``), oldest first."""
        return self._collect_pending()

    def close(self) -> list[dict]:
        try:
            return self.flush()
        finally:
            self._writer.shutdown(wait=True)
            if self._processes is not None:
                self._processes.shutdown(wait=True)
                self.runner.close()  # the shared host buffers


class TargetWorkerPlugin(TargetReplicaPlugin):
    """Extract's target replica: the shared lifecycle of :class:`stages.replicas.replica.TargetReplicaPlugin` (target loaded
    once per worker in ``setup``, freed in ``teardown``) with a :class:`ShardExtractor` on top.

    Args:
        target_spec: ``"default"``, a transformers folder or a ``.gguf`` file (see ``dflash.target.load``).
        target_layer_ids: tapped decoder layers.
        forward_tokens: padded tokens per forward batch.
        gpu_by_worker: worker name -> physical GPU index (LocalCluster from ``--target-gpus``); the worker pins it
            with ``torch.cuda.set_device``. ``None``: ``device``.
        device: ``"cuda"`` (the worker's current GPU), ``"cpu"`` or ``"auto"`` (CUDA when present).
        torch_threads: intra-op CPU threads per worker (CPU workers), ``None`` leaves torch's default.
        die_with_parent: SIGKILL the worker when its spawning process dies (locally started clusters only).
        write_threads: zarr compression threads of the worker (:func:`configure_write_threads`); ``None``:
            :func:`default_write_threads` of the worker's CPUs (``cpus - 1``, ``cpus = torch_threads`` if given).
        writes_in_flight: shard writes per worker running beside compute (bounded backpressure).
        write_processes: write processes per worker (0: threads; ``None``: :func:`default_write_processes`; see
            :class:`ShardExtractor`).
        packing: packed forward batches instead of right-padded ones (:class:`dflash.target.runner.TargetRunner`).
        packed_attention: the attention kernel of packed batches (``TargetRunner``'s ``packed_attention``).
        final_tap: also collect the final normed hidden state (``TargetRunner``'s ``final_tap``).
    """

    name = PLUGIN_NAME
    idempotent = False

    def __init__(
        self,
        *,
        target_spec: str,
        target_layer_ids: list[int],
        forward_tokens: int,
        gpu_by_worker: dict[Any, int] | None = None,
        device: str = "auto",
        torch_threads: int | None = None,
        die_with_parent: bool = False,
        write_threads: int | None = None,
        writes_in_flight: int = 3,
        write_processes: int | None = None,
        packing: bool = False,
        packed_attention: str = "auto",
        final_tap: bool = False,
    ) -> None:
        super().__init__(target_spec=target_spec, gpu_by_worker=gpu_by_worker, device=device,
                         torch_threads=torch_threads, die_with_parent=die_with_parent)
        self.target_layer_ids = list(target_layer_ids)
        self.forward_tokens = forward_tokens
        self.packing = packing
        self.packed_attention = packed_attention
        self.final_tap = final_tap
        self.write_threads = write_threads
        self.writes_in_flight = writes_in_flight
        self.write_processes = write_processes
        self.extractor: ShardExtractor | None = None

    def build(self, loaded: Any, device: torch.device) -> None:
        pad_token_id = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
        runner = TargetRunner(
            loaded.model, self.target_layer_ids, device, token_budget=self.forward_tokens, pad_token_id=pad_token_id,
            packing=self.packing,
            packed_attention=self.packed_attention, final_tap=self.final_tap,
        )
        write_threads = self.write_threads or default_write_threads(self.torch_threads)
        self.extractor = ShardExtractor(runner, writes_in_flight=self.writes_in_flight, write_threads=write_threads,
                                        write_processes=self.write_processes)

    def release(self) -> torch.device | None:
        if self.extractor is None:
            return None
        self.extractor.close()
        device = self.extractor.runner.device
        self.extractor = None
        return device


def _extractor(worker: Any) -> ShardExtractor:
    plugin = worker.plugins.get(PLUGIN_NAME)
    if plugin is None or plugin.extractor is None:
        raise RuntimeError(f"worker {worker.address} has no target loaded (plugin {PLUGIN_NAME} missing)")
    return plugin.extractor


@returns_user_errors
def extract_shard(spec: ShardSpec) -> dict:
    """Dask task: compute one shard on this worker's target replica and queue its write (see module docstring).

    Returns the small metadata dict of :meth:`ShardExtractor.process` plus ``"worker"``; an error the user must fix
    (a corpus the worker may not read...) comes back as the task's value (:mod:`stages.replicas.tasks`).
    """
    worker = get_worker()
    result = _extractor(worker).process(spec)
    result["worker"] = str(worker.name)
    return result


@returns_user_errors
def calibrate_worker_codecs(spec: CalibrationSpec) -> dict:
    """Dask task, one pinned to each worker: :func:`dflash.cache.codec_choice.calibrate_codecs` on this worker's
    runner, with as many encode threads as its write path has (:attr:`ShardExtractor.write_threads`). Runs before
    the cache exists and writes nothing.

    Returns:
        ``{"worker", "device", "calibrated"}``, plus ``calibrate_codecs``' figures when ``calibrated`` (a CPU
        runner is calibrated only with ``spec.on_cpu``); an error the user must fix comes back as the task's value
        (:mod:`stages.replicas.tasks`).
    """
    worker = get_worker()
    extractor = _extractor(worker)
    runner = extractor.runner
    result = {"worker": str(worker.name), "device": str(runner.device)}
    if runner.device.type != "cuda" and not spec.on_cpu:
        return {**result, "calibrated": False}
    corpus = open_corpus(spec.corpus_path)
    input_ids = [corpus.row(row).input_ids[: spec.truncate_to] for row in spec.rows]
    figures = calibrate_codecs(runner, input_ids, storage_dtype=spec.storage_dtype, chunk_tokens=spec.chunk_tokens,
                               write_threads=extractor.write_threads)  # fmt: skip
    return {**result, "calibrated": True, **figures}


def flush_worker(dask_worker: Any) -> list[dict]:
    """``client.run`` helper: wait for this worker's pending shard write; its commit dicts (or errors)."""
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    if plugin is None or plugin.extractor is None:
        return []
    return plugin.extractor.flush()

