"""Shard writes in separate processes, reading the hidden states from shared (and CUDA-pinned) host memory.

Why: in one process, the chunk-write threads (compression, checksums, stores) share the interpreter and the CPU
scheduler with the thread that feeds the GPU. On one H200 (8B-shaped target, 16 cores) that slowed the extract
loop's compute by 15% against the same batches without writes; with 2 write processes by 0.6%, and end-to-end
extract reached 0.95 of the bare truncated forward (docs/benchmarks.md). With ``write_processes > 0`` (the default
on GPU workers: ``stages.extract.worker.default_write_processes``) each shard write
(``HiddenStateCache.write_shard``, unchanged) runs in a worker process of a
``concurrent.futures.ProcessPoolExecutor`` instead: its own interpreter, its own chunk-write threads, niced below
the GPU process.

No copy: the target runner allocates its reusable host buffers as :class:`SharedHostBuffer` (POSIX shared memory,
registered with ``cudaHostRegister`` on CUDA so the device-to-host copies stay pinned and asynchronous). A sample's
hidden states are then a view into one of them; :meth:`ProcessShardWriter.submit` sends only ``(buffer name, byte
offset, rows, width)`` per sample, and the write process maps the same memory. The buffer must not be reused until
the write's future is done (the extract worker releases batches in the future's done-callback).

Tested on CPU for bit-exact equality with the in-process write (directly and through Dask).
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import torch

from dflash.cache import HiddenSample, HiddenStateCache
from dflash.cache.chunks import keep_chunk_buffers_mapped
from dflash.errors import ConfigError
from dflash.io.shm import (
    SEGMENT_PREFIX,
    SharedHostBuffer,
    SharedMemoryFull,
    remove_orphaned_segments,
    remove_segments_of,
    shared_location,
)

__all__ = [
    "SEGMENT_PREFIX",
    "SharedHostBuffer",
    "SharedMemoryFull",
    "ProcessShardWriter",
    "shared_location",
    "remove_segments_of",
    "remove_orphaned_segments",
]

log = logging.getLogger(__name__)

# The segments themselves (naming, page reservation, cleanup of killed processes) live in dflash.io.shm, shared with
# the online queue; re-exported here for the callers that imported them from this module.


@dataclass(frozen=True, slots=True)
class _SampleSpec:
    corpus_row: int
    input_ids: np.ndarray
    loss_mask: np.ndarray
    shm_name: str
    offset: int  # bytes
    rows: int
    width: int


# ------------------------------------------------------------------------------------------ write process side
_ATTACHED: dict[str, shared_memory.SharedMemory] = {}
_CACHES: dict[str, Any] = {}


def _exit_when_orphaned(parent_pid: int, poll_seconds: float = 0.05) -> None:
    """End this write process within ``poll_seconds`` of its parent's death (a daemon thread polls the parent pid).

    Exactly once depends on it: a write process whose extract worker was killed must not go on writing its shard
    while the rerun of that shard (on another worker) clears and rewrites the same shard folder. Killed mid-write,
    the shard stays uncommitted and the rerun redoes it. (An idle write process would also end, at EOF on its
    task queue; a busy one would finish its shard first.) On the way out it unlinks the dead worker's shared host
    buffers (:func:`remove_segments_of`).
    """

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_seconds)
        remove_segments_of(parent_pid)  # the dead worker's host buffers: nobody else would free them
        os._exit(1)

    threading.Thread(target=watch, name="dflash-orphan-watch", daemon=True).start()


def _init_write_process(write_threads: int, nice: int, parent_pid: int | None = None) -> None:
    import zarr

    if parent_pid is not None:
        _exit_when_orphaned(parent_pid)

    # As stages.extract.worker.configure_write_threads: the chunk pool and zarr's pool get ``write_threads``.
    zarr.config.set({"threading.max_workers": int(write_threads), "async.concurrency": max(int(write_threads), 4)})
    keep_chunk_buffers_mapped()
    if nice and hasattr(os, "nice"):
        try:
            os.nice(nice)
        except OSError:
            pass


def _attach(name: str) -> shared_memory.SharedMemory:
    shm = _ATTACHED.get(name)
    if shm is None:
        # Attaching registers the name with the resource tracker again (Python < 3.13); the spawned write process
        # shares its creator's tracker, where the name is a set entry, so the creator's unlink (which unregisters
        # it) stays the only cleanup. Unregistering here would make that later unregister fail in the tracker.
        shm = shared_memory.SharedMemory(name=name)
        _ATTACHED[name] = shm
    return shm


def _write_in_process(cache_path: str, shard_id: int, specs: list[_SampleSpec], quarantined: list[dict],
                      skipped: list[dict]) -> dict:  # fmt: skip

    def view(spec: _SampleSpec) -> HiddenSample:
        hidden = torch.frombuffer(_attach(spec.shm_name).buf, dtype=torch.bfloat16, count=spec.rows * spec.width,
                                  offset=spec.offset)
        return HiddenSample(corpus_row=spec.corpus_row, input_ids=torch.from_numpy(spec.input_ids),
                            loss_mask=torch.from_numpy(spec.loss_mask), hidden=hidden.view(spec.rows, spec.width))

    samples = [view(spec) for spec in specs]  # may be empty: every row of the shard quarantined or skipped
    if cache_path not in _CACHES:
        _CACHES[cache_path] = HiddenStateCache.open(cache_path)
    try:
        return _CACHES[cache_path].write_shard(shard_id, samples, quarantined, skipped=skipped)
    finally:
        samples.clear()  # no view of the shared memory outlives the task


# ------------------------------------------------------------------------------------------ submitting side
class ProcessShardWriter:
    """Runs ``HiddenStateCache.write_shard`` in ``processes`` worker processes (spawned, so safe beside CUDA).

    Args:
        processes: worker processes (>= 1).
        write_threads: chunk-write threads of all processes together, split evenly (default: this machine's cores
            minus one).
        nice: niceness added to the write processes (below the process that feeds the GPU).

    ``write_threads`` (attribute): the chunk-write threads of all processes together (``processes`` x the share of
    each). :meth:`submit` returns a ``concurrent.futures.Future`` of the commit record, like the in-process writer.
    Raises ConfigError for ``processes < 1``; ``submit`` raises ValueError for a sample whose hidden states are
    not inside a live :class:`SharedHostBuffer` (nothing is copied behind the caller's back).
    """

    def __init__(self, processes: int, *, write_threads: int | None = None, nice: int = 5) -> None:
        if processes < 1:
            raise ConfigError(f"write_processes: expected >= 1, got {processes}")
        removed = remove_orphaned_segments()  # host buffers of workers killed earlier on this machine
        if removed:
            log.warning("removed %d shared-memory host buffers left by killed extract workers", removed)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = max(1, (write_threads or max(1, cores - 1)) // processes)
        self.write_threads = threads * processes  # chunk-write threads of all processes together
        self._pool = concurrent.futures.ProcessPoolExecutor(
            max_workers=processes, mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_write_process, initargs=(threads, nice, os.getpid()),
        )  # fmt: skip

    def submit(self, cache_path: str, shard_id: int, samples: list, quarantined: list[dict] | None = None, *,
               skipped: list[dict] | None = None) -> concurrent.futures.Future:  # fmt: skip
        specs = []
        for sample in samples:
            hidden = sample.hidden
            location = shared_location(hidden) if hidden.dtype == torch.bfloat16 and hidden.dim() == 2 else None
            if location is None:
                raise ValueError(
                    f"shard {shard_id}, corpus row {sample.corpus_row}: hidden states are not in a SharedHostBuffer "
                    "(the runner must allocate shared host buffers for write processes)"
                )
            specs.append(_SampleSpec(int(sample.corpus_row), sample.input_ids.numpy().astype(np.int32, copy=False),
                                     sample.loss_mask.numpy().astype(np.uint8, copy=False), location[0], location[1],
                                     int(hidden.shape[0]), int(hidden.shape[1])))  # fmt: skip
        return self._pool.submit(_write_in_process, cache_path, shard_id, specs, list(quarantined or []),
                                 list(skipped or []))  # fmt: skip

    def warm_up(self) -> None:
        """Start every write process now (imports included) instead of at the first submit."""
        futures = [self._pool.submit(os.getpid) for _ in range(self._pool._max_workers)]  # noqa: SLF001
        concurrent.futures.wait(futures)

    def shutdown(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait)
