"""Fault injection at named points, for the fault tests (``tests/test_faults.py``); nothing happens unless
``DFLASH_FAULT`` is set.

``DFLASH_FAULT=POINT[@N][=ACTION]`` makes this process do ``ACTION`` when it reaches ``POINT`` for the N-th time
(default 1st) and every later time:

* ``kill`` (default): ``SIGKILL`` this process there, as a power cut or the OOM killer would;
* ``enospc``: raise ``OSError(ENOSPC)`` naming the path being written, as a full disk would (it stays full);
* ``eacces``: raise ``OSError(EACCES)`` naming the path, as a file this user may not read or write would.

Points (each a call of :func:`fault_point` where the work happens; counts are per process, and the variable is
inherited by Dask workers and write processes):

==========================  ================================================================================
``cache.chunk-write``       before each ``hidden`` chunk of a shard is stored (``dflash/cache/writer.py``)
``cache.before-commit``     a shard's arrays are written, its commit record not yet (mid-commit)
``cache.after-commit``      a shard's commit record was just written (``@N``: after N shards committed)
``extract.shard``           an extract task is about to read its shard's corpus rows (in the Dask task itself,
                            not in its writer threads; ``stages/extract/worker.py``)
``checkpoint.write``        a checkpoint's weights are in its temporary folder, the rest not yet (mid-write)
``safetensors.write``       before each safetensors file is written (``dflash/weights_io.py``): a checkpoint's
                            weights, optimizer and RNG state (3 a checkpoint), an export's weights
``online.produce``          an online producer computed a batch into its ring slot and is about to commit it
``generate.part-write``     before each generate part's Arrow file is written (``dflash/generation/parts.py``)
==========================  ================================================================================

Zero cost when unset: the variable is read once at import, and :func:`fault_point` returns at its first test.
:func:`reload` re-reads it (tests that set it in their own process).
"""

from __future__ import annotations

import errno
import os
import signal
import threading

__all__ = ["ENV", "POINTS", "ERRNOS", "fault_point", "reload"]

ENV = "DFLASH_FAULT"
POINTS = ("cache.chunk-write", "cache.before-commit", "cache.after-commit", "extract.shard", "checkpoint.write",
          "safetensors.write", "online.produce", "generate.part-write")
#: The ``OSError`` each raising action raises.
ERRNOS = {"enospc": errno.ENOSPC, "eacces": errno.EACCES}

_spec: tuple[str, int, str] | None = None
_seen = 0
_lock = threading.Lock()


def reload() -> None:
    """Parse ``$DFLASH_FAULT`` again and reset the count.

    Raises:
        ValueError: an unknown point or action (the message lists the known ones).
    """
    global _spec, _seen
    text = os.environ.get(ENV, "").strip()
    _seen = 0
    if not text:
        _spec = None
        return
    point, _, action = text.partition("=")
    point, _, count = point.partition("@")
    action = action or "kill"
    if point not in POINTS or (action != "kill" and action not in ERRNOS) or (count and not count.isdigit()):
        raise ValueError(f"{ENV}={text!r}: expected POINT[@N][=kill|{'|'.join(ERRNOS)}] with POINT one of "
                         f"{list(POINTS)}")
    _spec = (point, int(count or 1), action)


def fault_point(point: str, path: str | os.PathLike[str] | None = None) -> None:
    """Do the configured fault if ``point`` is the configured point reached for the N-th time; else nothing.

    Raises:
        OSError: ``errno.ENOSPC`` (action ``enospc``) or ``errno.EACCES`` (``eacces``), ``path`` its filename.
    """
    global _seen
    if _spec is None or _spec[0] != point:
        return
    with _lock:
        _seen += 1
        if _seen < _spec[1]:
            return
    if _spec[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    code = ERRNOS[_spec[2]]
    raise OSError(code, os.strerror(code), os.fspath(path) if path is not None else None)


reload()
