"""Shard writes in separate processes, reading the hidden states from shared (and CUDA-pinned) host memory.

Why: in one process, the chunk-write threads (compression, checksums, stores) share the interpreter and the CPU
scheduler with the thread that feeds the GPU. On one H200 (8B-shaped target, 16 cores) that slowed the extract
loop's compute by 15% against the same batches without writes; with 2 write processes by 0.6%, and end-to-end
extract reached 0.95 of the bare truncated forward (docs/benchmarks.md). With ``write_processes > 0`` (the default
on GPU workers: ``stages.extract_worker.default_write_processes``) each shard write
(``HiddenStateCache.write_shard``, unchanged) runs in a worker process of a
``concurrent.futures.ProcessPoolExecutor`` instead: its own interpreter, its own chunk-write threads, niced below
the GPU process.

No copy: the target runner allocates its reusable host buffers as :class:`SharedHostBuffer` (POSIX shared memory,
registered with ``cudaHostRegister`` on CUDA so the device-to-host copies stay pinned and asynchronous). A sample's
hidden states are then a view into one of them; :meth:`ProcessShardWriter.submit` sends only ``(buffer name, byte
offset, rows, width)`` per sample, and the write process maps the same memory. The buffer must not be reused until
the write's future is done (the extract worker releases batches in the future's done-callback, as before).

Tested on CPU for bit-exact equality with the in-process write (directly and through Dask).
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import os
import secrets
import threading
import time
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import psutil
import torch

from dflash.errors import ConfigError

__all__ = [
    "SharedHostBuffer",
    "SharedMemoryFull",
    "ProcessShardWriter",
    "shared_location",
    "remove_segments_of",
    "remove_orphaned_segments",
]

log = logging.getLogger(__name__)

_REGISTRY: dict[int, SharedHostBuffer] = {}  # base address -> live buffer (this process)
_REGISTRY_LOCK = threading.Lock()


#: Segment names: ``dflash_<creator pid>_<random>`` (under /dev/shm on Linux), so that the segments of a killed
#: worker can be found and removed (:func:`remove_segments_of`, :func:`remove_orphaned_segments`).
SEGMENT_PREFIX = "dflash_"
_SHM_DIR = "/dev/shm"


def _segment_owner(name: str) -> int | None:
    if not name.startswith(SEGMENT_PREFIX):
        return None
    pid = name[len(SEGMENT_PREFIX):].split("_", 1)[0]
    return int(pid) if pid.isdigit() else None


def remove_segments_of(pid: int) -> int:
    """Unlink every shared host buffer created by process ``pid`` (Linux ``/dev/shm``); returns how many.

    Called by a write process whose worker died: a SIGKILLed worker never runs :meth:`SharedHostBuffer.close`, and
    its segments (GiBs) would otherwise stay until the process that started the worker exits."""
    removed = 0
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return 0
    for name in names:
        if _segment_owner(name) == pid:
            try:
                os.unlink(os.path.join(_SHM_DIR, name))
                removed += 1
            except OSError:
                pass
    return removed


def remove_orphaned_segments() -> int:
    """Unlink the shared host buffers of processes that no longer exist (killed workers); returns how many."""
    try:
        owners = {_segment_owner(name) for name in os.listdir(_SHM_DIR)}
    except OSError:
        return 0
    return sum(remove_segments_of(pid) for pid in owners if pid is not None and not psutil.pid_exists(pid))


class SharedMemoryFull(ConfigError):
    """Not enough POSIX shared memory (``/dev/shm``) for a host buffer."""


def _shm_free() -> str:
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:
        return "/dev/shm not found"
    return f"/dev/shm has {stats.f_bavail * stats.f_frsize / 2**20:,.0f} MiB free of {stats.f_blocks * stats.f_frsize / 2**20:,.0f} MiB"


class SharedHostBuffer:
    """``numel`` bf16 elements of POSIX shared memory as a flat tensor (``.tensor``), pinned for CUDA copies when
    ``pin`` and CUDA is available (``cudaHostRegister``; ``.pinned`` says whether it took). Close with
    :meth:`close` (unregisters, unmaps and unlinks); views of ``.tensor`` must be gone by then.

    Raises:
        SharedMemoryFull: the pages cannot be reserved (``posix_fallocate`` on the shared-memory file failed,
            e.g. a container's small ``/dev/shm``); nothing is left behind.
    """

    def __init__(self, numel: int, *, pin: bool) -> None:
        nbytes = max(2, int(numel) * 2)
        name = f"{SEGMENT_PREFIX}{os.getpid()}_{secrets.token_hex(6)}"
        self.shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
        # Reserve the pages now: a shared-memory file is sparse, and writing past a full /dev/shm (a container's
        # default is 64 MB) kills the process with SIGBUS instead of raising.
        fd = getattr(self.shm, "_fd", -1)
        if fd >= 0 and hasattr(os, "posix_fallocate"):
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as error:
                self.shm.close()
                self.shm.unlink()
                raise SharedMemoryFull(
                    f"cannot reserve {nbytes / 2**20:,.0f} MiB of shared memory for a host buffer ({error.strerror}; "
                    f"{_shm_free()}); give the machine or container more shared memory (docker run --shm-size=...) "
                    "or write shards in threads (extract --write-processes 0)"
                ) from None
        self.name = self.shm.name
        self.nbytes = nbytes
        self.tensor = torch.frombuffer(self.shm.buf, dtype=torch.bfloat16, count=nbytes // 2)
        self.base = self.tensor.data_ptr()
        self.pinned = False
        if pin and torch.cuda.is_available():
            try:  # unpinned memory still works: the device-to-host copies then synchronize
                code = torch.cuda.cudart().cudaHostRegister(self.base, nbytes, 0)
                self.pinned = int(getattr(code, "value", code)) == 0
            except (AttributeError, RuntimeError, TypeError):
                self.pinned = False
        with _REGISTRY_LOCK:
            _REGISTRY[self.base] = self

    def close(self) -> None:
        with _REGISTRY_LOCK:
            _REGISTRY.pop(self.base, None)
        if self.pinned:
            try:
                torch.cuda.cudart().cudaHostUnregister(self.base)
            except (AttributeError, RuntimeError, TypeError):
                pass
            self.pinned = False
        self.tensor = None  # type: ignore[assignment]
        try:
            self.shm.close()
            self.shm.unlink()
        except (BufferError, FileNotFoundError):  # a view still alive / already unlinked: the OS frees it at exit
            pass


def shared_location(tensor: torch.Tensor) -> tuple[str, int] | None:
    """``(shared memory name, byte offset)`` of a CPU tensor lying inside a live :class:`SharedHostBuffer` of
    this process, else ``None``. The tensor must be C-contiguous."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    address = tensor.data_ptr()
    with _REGISTRY_LOCK:
        for base, buffer in _REGISTRY.items():
            if base <= address and address + tensor.numel() * tensor.element_size() <= base + buffer.nbytes:
                return buffer.name, address - base
    return None


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

    from dflash.cache.chunks import keep_chunk_buffers_mapped

    if parent_pid is not None:
        _exit_when_orphaned(parent_pid)

    # As stages.extract_worker.configure_write_threads: the chunk pool and zarr's pool get ``write_threads``.
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
    from dflash.cache import HiddenSample, HiddenStateCache

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

    :meth:`submit` returns a ``concurrent.futures.Future`` of the commit record, like the in-process writer.
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
