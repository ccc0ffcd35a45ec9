"""POSIX shared-memory segments of dflash-stages and their cleanup (one neutral home for both users).

Users: the extract write processes (:mod:`dflash.cache.process_writer`, host buffers of the target runner) and
the online queue (:mod:`dflash.batches.ring`, the ring of slots). Every segment is named
``dflash_<creator pid>_<random>`` (under ``/dev/shm`` on Linux), so the segments of a killed process can be found
and removed: :func:`remove_segments_of` (by the dead process's pid) and :func:`remove_orphaned_segments` (every
creator that no longer exists), which each creator of long-lived segments calls at start.

Pages are reserved at creation (``posix_fallocate``): a shared-memory file is sparse, and writing past a full
``/dev/shm`` (a container's default is 64 MB) kills the process with SIGBUS instead of raising; here it raises
:class:`SharedMemoryFull` with the fix.

Attaching (:func:`attach_segment`) never registers the segment with the attaching process's resource tracker: on
Python < 3.13 that registration makes the tracker unlink the creator's segment when the attaching process exits.
Sizes are bytes; :class:`SharedHostBuffer` views its segment as a flat bfloat16 tensor.
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
from multiprocessing import resource_tracker, shared_memory

import psutil
import torch

from dflash.errors import ConfigError

__all__ = [
    "SEGMENT_PREFIX",
    "SharedMemoryFull",
    "SharedHostBuffer",
    "pin_host_range",
    "unpin_host_range",
    "create_segment",
    "attach_segment",
    "close_segment",
    "shm_free_bytes",
    "shm_free",
    "list_segments",
    "segment_owner",
    "shared_location",
    "remove_segments_of",
    "remove_orphaned_segments",
]

#: Segment name prefix: ``dflash_<creator pid>_<random>``.
SEGMENT_PREFIX = "dflash_"
_SHM_DIR = "/dev/shm"

_REGISTRY: dict[int, SharedHostBuffer] = {}  # base address -> live host buffer (this process)
_REGISTRY_LOCK = threading.Lock()


class SharedMemoryFull(ConfigError):
    """Not enough POSIX shared memory (``/dev/shm``) for a segment."""


#: Serializes segment creation with attaches (see :func:`attach_segment`).
_REGISTRATION = threading.Lock()


def segment_owner(name: str) -> int | None:
    """The creator pid in a dflash segment's name (``dflash_<creator pid>_<random>``); ``None`` for any other name."""
    if not name.startswith(SEGMENT_PREFIX):
        return None
    pid = name[len(SEGMENT_PREFIX):].split("_", 1)[0]
    return int(pid) if pid.isdigit() else None


def list_segments() -> list[str]:
    """Names of the dflash segments in ``/dev/shm`` now (every creator), sorted; ``[]`` where there is none."""
    try:
        return sorted(name for name in os.listdir(_SHM_DIR) if segment_owner(name) is not None)
    except OSError:
        return []


def remove_segments_of(pid: int) -> int:
    """Unlink every dflash segment created by process ``pid`` (Linux ``/dev/shm``); returns how many.

    A SIGKILLed process never closes its segments; they would otherwise stay until the machine reboots."""
    removed = 0
    for name in list_segments():
        if segment_owner(name) == pid:
            try:
                os.unlink(os.path.join(_SHM_DIR, name))
                removed += 1
            except OSError:
                pass
    return removed


def remove_orphaned_segments() -> int:
    """Unlink the dflash segments of processes that no longer exist (killed ones); returns how many."""
    owners = {segment_owner(name) for name in list_segments()}
    return sum(remove_segments_of(pid) for pid in owners if pid is not None and not psutil.pid_exists(pid))


def shm_free_bytes() -> int | None:
    """Bytes available to an unprivileged process in ``/dev/shm``; ``None`` without one."""
    try:
        stats = os.statvfs(_SHM_DIR)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def shm_free() -> str:
    """``/dev/shm`` free and total space in MiB, for error messages."""
    try:
        stats = os.statvfs(_SHM_DIR)
    except OSError:
        return "/dev/shm not found"
    return (f"/dev/shm has {stats.f_bavail * stats.f_frsize / 2**20:,.0f} MiB free of "
            f"{stats.f_blocks * stats.f_frsize / 2**20:,.0f} MiB")


def create_segment(nbytes: int, *, what: str = "a host buffer", fix: str = "") -> shared_memory.SharedMemory:
    """A new segment ``dflash_<pid>_<random>`` of ``nbytes`` bytes with its pages reserved.

    Raises:
        SharedMemoryFull: the pages cannot be reserved; nothing is left behind. The message says ``what`` it was
            for, the free space, and the fix (``docker run --shm-size=...``, plus ``fix`` when given).
    """
    nbytes = max(1, int(nbytes))
    name = f"{SEGMENT_PREFIX}{os.getpid()}_{secrets.token_hex(6)}"
    with _REGISTRATION:  # never inside an attach's window without registration (attach_segment)
        shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
    fd = getattr(shm, "_fd", -1)  # CPython's own attribute; no public accessor exists
    if fd >= 0 and hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as error:
            shm.close()
            shm.unlink()
            raise SharedMemoryFull(
                f"cannot reserve {nbytes / 2**20:,.0f} MiB of shared memory for {what} ({error.strerror}; "
                f"{shm_free()}); give the machine or container more shared memory (docker run --shm-size=...)"
                + (f" or {fix}" if fix else "")
            ) from None
    return shm


def attach_segment(name: str) -> shared_memory.SharedMemory:
    """Map an existing segment without taking ownership: the attaching process never unlinks it, and its resource
    tracker never hears of it (the creator's registration stays the only cleanup, also after a SIGKILL).

    Python >= 3.13: ``track=False``. Before, ``SharedMemory(name=...)`` registers every attach with the resource
    tracker (python/cpython#82300), which unlinks the segment when the attaching process exits; unregistering
    afterwards is wrong too where the attacher shares the creator's tracker (processes multiprocessing started from a
    common parent: DDP ranks and the Dask workers of one launcher), since there the name is one set entry. So the
    attach runs with ``resource_tracker.register`` set aside (under a lock that :func:`create_segment` also takes).

    Raises:
        FileNotFoundError: no segment of that name (its creator removed it, or died and it was swept).
    """
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)

    with _REGISTRATION:
        register = resource_tracker.register
        resource_tracker.register = lambda name, rtype: None
        try:
            return shared_memory.SharedMemory(name=name)
        finally:
            resource_tracker.register = register


#: Segments whose unmapping a live view refused (``BufferError``): held here so that their ``__del__`` (which would
#: retry and raise again, "Exception ignored in SharedMemory.__del__") does not run while the view lives; each
#: :func:`close_segment` call retries them, and what is still mapped at exit goes with the process.
_UNMAPPED_LATER: list[shared_memory.SharedMemory] = []
_UNMAPPED_LOCK = threading.Lock()


def close_segment(shm: shared_memory.SharedMemory, *, unlink: bool) -> None:
    """Unmap ``shm`` (and remove it when ``unlink``); tolerant of views still alive (the segment is then kept
    mapped until a later call finds its views gone) and of a segment already gone."""
    with _UNMAPPED_LOCK:
        for held in list(_UNMAPPED_LATER):
            try:
                held.close()
                _UNMAPPED_LATER.remove(held)
            except BufferError:
                pass
        try:
            shm.close()
        except BufferError:  # a view is still alive
            _UNMAPPED_LATER.append(shm)
    if unlink:
        try:
            shm.unlink()
        except FileNotFoundError:
            pass


def pin_host_range(address: int, nbytes: int) -> bool:
    """Page-lock ``nbytes`` of host memory from ``address`` for CUDA copies (``cudaHostRegister``), so that
    non-blocking device-to-host copies into it run asynchronously; returns whether it took (``False`` without CUDA
    or where the driver refuses: unpinned memory still works, its copies then synchronize). Undo with
    :func:`unpin_host_range` before the memory is unmapped."""
    if not torch.cuda.is_available():
        return False
    try:
        code = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
    except (AttributeError, RuntimeError, TypeError):
        return False
    return int(getattr(code, "value", code)) == 0


def unpin_host_range(address: int) -> None:
    """Undo :func:`pin_host_range` of the range starting at ``address`` (errors are ignored: the memory is about to
    be unmapped either way)."""
    try:
        torch.cuda.cudart().cudaHostUnregister(address)
    except (AttributeError, RuntimeError, TypeError):
        pass


class SharedHostBuffer:
    """``numel`` bf16 elements of POSIX shared memory as a flat tensor (``.tensor``), pinned for CUDA copies when
    ``pin`` and CUDA is available (``cudaHostRegister``; ``.pinned`` says whether it took). Close with
    :meth:`close` (unregisters, unmaps and unlinks); views of ``.tensor`` must be gone by then.

    Raises:
        SharedMemoryFull: the pages cannot be reserved (e.g. a container's small ``/dev/shm``); nothing is left.
    """

    def __init__(self, numel: int, *, pin: bool) -> None:
        nbytes = max(2, int(numel) * 2)
        self.shm = create_segment(nbytes, what="a host buffer",
                                  fix="write shards in threads (extract --write-processes 0)")
        self.name = self.shm.name
        self.nbytes = nbytes
        self.tensor = torch.frombuffer(self.shm.buf, dtype=torch.bfloat16, count=nbytes // 2)
        self.base = self.tensor.data_ptr()
        self.pinned = pin_host_range(self.base, nbytes) if pin else False
        with _REGISTRY_LOCK:
            _REGISTRY[self.base] = self

    def close(self) -> None:
        with _REGISTRY_LOCK:
            _REGISTRY.pop(self.base, None)
        if self.pinned:
            unpin_host_range(self.base)
            self.pinned = False
        self.tensor = None  # type: ignore[assignment]
        close_segment(self.shm, unlink=True)


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
