"""Exclusive ownership of a stage's output: one writer per cache, run folder, corpus, export or sweep folder.

Every stage that writes an output takes :func:`output_lock` on it before writing anything and holds it until it
returns (normal exit, error, Ctrl-C or SIGTERM: the lock is released in a ``finally``). A second writer is refused
at once with :class:`~dflash.errors.LockError` naming the holder (pid, host, since when, command) and the fix;
readers of a committed output (train reading a cache, evaluate, export reading a run) take no lock.

The lock of an output ``OUT`` is the file ``OUT.lock`` beside it (a sibling, so it never appears inside a cache,
run folder or export, and works for outputs that only appear at the end by a rename, like prepare's and
export's). It is two mechanisms at once:

* an **owner record**: a JSON file (``pid``, ``host``, ``started_at``, ``process_started``, ``command``,
  ``what``) written to a temporary name and published with ``os.link``, which fails if ``OUT.lock`` exists, so
  exactly one writer creates it; it is removed on release;
* an **OS lock**: ``fcntl.flock`` held on that file by its owner for as long as the process lives. The kernel
  drops it when the process dies, even by SIGKILL, which is how a stale record is told from a live one.

When ``OUT.lock`` already exists, the contender tries the OS lock without waiting. Held: the owner is alive,
refused. Free: the owner is gone if it ran on this host and its pid is dead (or reused by a later process): the
lock is taken over with a warning. A record from **another host** is never taken over by itself (its OS lock may
not be visible here, see NFS below): the user passes ``--break-lock`` once that host's run is known to be dead.
A lock whose OS lock is still held is never broken, ``--break-lock`` or not. Take-overs are themselves exclusive:
the contender holds the old record's OS lock while it replaces the record and checks that the file it locked is
still the one at ``OUT.lock``.

What is guaranteed where:

* **Local disks** (ext4, xfs, tmpfs...): everything above. A process killed by SIGKILL leaves its record behind;
  the next run on the same host takes it over (warning) and resumes as before.
* **NFS**: ``os.link`` onto an existing name fails atomically on NFSv3 and v4 (the classic NFS-safe lock-file
  protocol; a lost reply is detected by the temporary file's link count), so two hosts never both publish a
  record. Linux emulates ``flock`` over NFSv4 (and NFSv3 with NLM) with ``fcntl`` byte-range locks held by the
  server, which releases a dead client's locks when its lease expires (~90 s); mounts with ``local_lock=flock``
  or ``nolock`` keep OS locks local to each client. Hence a record from another host needs ``--break-lock``.
  Same-host stale detection works on every mount. Hosts are told apart by ``socket.gethostname()``: containers
  sharing one hostname on different machines must not share an output folder.
* **Object stores** (fsspec URLs such as ``s3://``, ``gs://``): no lock at all; there is no atomic
  create-if-absent the stores share. :func:`output_lock` logs a warning and returns a lock that holds nothing:
  make sure only one writer targets the URL (a cache's commit records still make each shard exactly-once).

Use::

    with output_lock(config.output, what="cache", break_lock=config.break_lock):
        ...  # write the output

Tests: ``tests/test_locks.py`` (two real processes contending, a SIGKILLed holder taken over, release on error).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
import shlex
import socket
import stat
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from dflash.errors import LockError
from dflash.io.files import parse_json

__all__ = ["OutputLock", "LockHolder", "output_lock", "lock_path_of", "LOCK_SUFFIX"]

log = logging.getLogger(__name__)

#: Suffix of the lock file beside an output: ``data/cache`` -> ``data/cache.lock``.
LOCK_SUFFIX = ".lock"

#: errno values of ``flock`` on a filesystem without OS locks (the owner record alone then decides).
_NO_OS_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS}

#: Size cap of an owner record (a few hundred bytes are written): a larger lock file is not ours.
_MAX_RECORD_BYTES = 65536

#: Attempts at publishing our record when the lock file changes under us (released or taken over meanwhile).
_ATTEMPTS = 5

#: Locks this process holds, by lock path: a nested take of the same output (a pipeline step inside another) is
#: granted, not refused (an OS lock taken twice by one process through two open files would refuse itself).
_HELD: dict[str, OutputLock] = {}


@dataclass(frozen=True, slots=True)
class LockHolder:
    """The owner record of a lock (``OUT.lock``)."""

    pid: int
    host: str
    started_at: str
    """When the lock was taken (UTC, ISO 8601)."""
    process_started: float | None
    """The holder process's start time (seconds since the epoch; ``psutil``): tells a reused pid apart."""
    command: str
    what: str

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host} since {self.started_at} ({self.command})"

    @classmethod
    def from_json(cls, text: str | bytes) -> LockHolder:
        """The record of a lock file's contents (``dflash.io.files.parse_json``: nesting bounded).

        Raises:
            LockError: not JSON, not an object, or a field of the wrong type (``pid`` a positive integer, ``host``
                a string, ``process_started`` a number or null).
        """
        data = parse_json(text, where="the lock's owner record", error=LockError, fix="the record is damaged")
        if not isinstance(data, dict):
            raise LockError(f"the lock's owner record is a {type(data).__name__}, not an object")
        pid, host, started = data.get("pid"), data.get("host"), data.get("process_started")
        if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 2**31:
            raise LockError(f"the lock's owner record has pid {str(pid)[:40]}, not a process id")
        if not isinstance(host, str) or not host:
            raise LockError(f"the lock's owner record has host {str(host)[:40]}, not a host name")
        if started is not None and (not isinstance(started, int | float) or isinstance(started, bool)
                                    or not math.isfinite(started)):
            raise LockError(f"the lock's owner record has process_started {str(started)[:40]}, not a time")
        return cls(
            pid=pid,
            host=host,
            started_at=str(data.get("started_at", "?"))[:100],
            process_started=None if started is None else float(started),
            command=str(data.get("command", "?"))[:1000],
            what=str(data.get("what", "output"))[:100],
        )


def lock_path_of(output: str | os.PathLike[str]) -> Path:
    """The lock file of a local output: ``OUT.lock`` beside ``OUT`` (symlinks resolved, ``~`` expanded)."""
    path = Path(os.fspath(output).removeprefix("file://")).expanduser().resolve()
    return path.with_name(path.name + LOCK_SUFFIX)


def _is_remote(output: str | os.PathLike[str]) -> bool:
    text = os.fspath(output)
    return "://" in text and not text.startswith("file://")


def _process_started(pid: int) -> float | None:
    try:
        import psutil

        return float(psutil.Process(pid).create_time())
    except Exception:  # no such process, no permission, no psutil: unknown
        return None


def _pid_alive(holder: LockHolder) -> bool:
    """Whether the holder's process still runs on this host (a zombie, or a later process that reused the pid,
    counts as dead)."""
    try:
        import psutil

        process = psutil.Process(holder.pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        if holder.process_started is not None and abs(process.create_time() - holder.process_started) > 1.0:
            return False
        return True
    except ImportError:
        try:
            os.kill(holder.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    except Exception:  # psutil.NoSuchProcess, AccessDenied (alive then, but not ours to judge: say alive)
        return type(sys.exc_info()[1]).__name__ == "AccessDenied"


def _try_os_lock(fd: int) -> bool | None:
    """``flock(LOCK_EX | LOCK_NB)``: True taken, False held by another open file, None no OS locks here."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as error:
        if error.errno in (errno.EAGAIN, errno.EACCES):
            return False
        if error.errno in _NO_OS_LOCKS:
            return None
        raise


class OutputLock:
    """Exclusive lock on one output (module docstring). Use as a context manager, or :meth:`acquire` /
    :meth:`release`. Re-entrant within one process."""

    def __init__(self, output: str | os.PathLike[str], *, what: str = "output", break_lock: bool = False) -> None:
        self.output = os.fspath(output)
        self.what = what
        self.break_lock = break_lock
        self.remote = _is_remote(output)
        self.path: Path | None = None if self.remote else lock_path_of(output)
        self._fd: int | None = None
        self._depth = 0
        self._outer: OutputLock | None = None

    # --------------------------------------------------------------------------------------------- public
    def acquire(self) -> OutputLock:
        """Take the lock now or raise.

        Raises:
            LockError: another live process holds it (the message names it: pid, host, since when, command), or
                a record of another host exists without ``break_lock``.
        """
        if self.remote:
            log.warning(
                "%s is an object-store URL: no lock is possible there; make sure no other process writes it", self.output
            )
            return self
        assert self.path is not None
        outer = _HELD.get(str(self.path))
        if outer is not None:
            outer._depth += 1
            self._outer = outer
            return self
        record = self._record()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            for _ in range(_ATTEMPTS):
                if self._publish(record):
                    break
                if self._take_over_stale(record):
                    break
            else:
                raise LockError(f"{self.output}: its lock {self.path} kept changing while taking it; retry the command")
        except OSError as error:  # read-only or full filesystem, no permission: the output cannot be written either
            raise LockError(
                f"cannot create the lock file {self.path} of {self.output}: {error.strerror or error}; choose an "
                "output in a folder you can write"
            ) from None
        self._depth = 1
        _HELD[str(self.path)] = self
        return self

    def release(self) -> None:
        """Give the lock up: remove our owner record (only if it is still ours), then drop the OS lock."""
        if self._outer is not None:
            self._outer._depth -= 1
            self._outer = None
            return
        if self._fd is None:
            return
        self._depth -= 1
        if self._depth > 0:
            return
        assert self.path is not None
        _HELD.pop(str(self.path), None)
        try:
            if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        finally:
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None or self._outer is not None

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.release()

    # --------------------------------------------------------------------------------------------- internals
    def _record(self) -> str:
        return json.dumps({
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "process_started": _process_started(os.getpid()),
            "command": shlex.join(["dflash-stages", *sys.argv[1:]]) if sys.argv else "?",
            "what": self.what,
        })

    def _write_temporary(self, record: str) -> tuple[Path, int]:
        """Our record under a temporary name, OS-locked before anyone can see it under the lock's name."""
        assert self.path is not None
        temporary = self.path.with_name(f"{self.path.name}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, record.encode())
            os.fsync(fd)
            _try_os_lock(fd)  # our own new file: taken (or no OS locks on this filesystem)
        except BaseException:
            os.close(fd)
            temporary.unlink(missing_ok=True)
            raise
        return temporary, fd

    def _publish(self, record: str) -> bool:
        """Create ``OUT.lock`` atomically (``link`` fails if it exists). True: the lock is ours."""
        assert self.path is not None
        temporary, fd = self._write_temporary(record)
        try:
            try:
                os.link(temporary, self.path)
                linked = True
            except FileExistsError:
                linked = False
            except OSError:  # NFS: the reply may be lost although the link was made
                linked = os.stat(temporary).st_nlink == 2
        finally:
            temporary.unlink(missing_ok=True)
        if linked:
            self._fd = fd
        else:
            os.close(fd)
        return linked

    def _take_over_stale(self, record: str) -> bool:
        """``OUT.lock`` exists: refuse (live holder, another host) or replace a stale record. False: the file
        changed under us (released or replaced); the caller tries again."""
        assert self.path is not None
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK)
        except FileNotFoundError:
            return False  # released meanwhile
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # a device, FIFO or socket (or a symlink to one)
                raise LockError(
                    f"the lock file {self.path} of {self.output} is not a regular file (a device, FIFO or a link to "
                    f"one), so it was not written by dflash-stages: remove it (rm {self.path}) and rerun"
                )
            os_lock = _try_os_lock(fd)
            holder = self._read_holder(fd)
            if os_lock is False:
                raise LockError(self._held_message(holder))
            try:
                if os.stat(self.path).st_ino != os.fstat(fd).st_ino:
                    return False  # taken over or released and retaken meanwhile: look again
            except FileNotFoundError:
                return False
            if holder is not None and holder.host == socket.gethostname():
                # Same host: a free OS lock means the holder is gone (it locks before its record is visible).
                # Without OS locks the pid decides (our own pid is a leftover: this process holds no such lock).
                if os_lock is None and holder.pid != os.getpid() and _pid_alive(holder):
                    raise LockError(self._held_message(holder))
            elif not self.break_lock and holder is None:
                raise LockError(
                    f"the lock file {self.path} of {self.output} is damaged: it holds no readable owner record (empty, "
                    f"garbled or not written by dflash-stages) and no process holds it here; if no other run writes "
                    f"{self.output} (on this or another host), remove it (rm {self.path}) or rerun with --break-lock"
                )
            elif not self.break_lock:
                assert holder is not None
                found = holder.describe()
                raise LockError(
                    f"{self.output} is locked by {found} (lock file {self.path}); a lock from another host is never "
                    f"taken over by itself: if that run is dead (host down, job gone), rerun with --break-lock, else "
                    f"wait for it or choose another output"
                )
            temporary, new_fd = self._write_temporary(record)
            try:
                os.replace(temporary, self.path)
            except BaseException:
                os.close(new_fd)
                temporary.unlink(missing_ok=True)
                raise
            self._fd = new_fd
            log.warning(
                "took over the stale lock of %s: %s %s (lock file %s)",
                self.output,
                holder.describe() if holder is not None else "an unreadable owner record",
                "no longer runs" if holder is None or holder.host == socket.gethostname() else "was broken by --break-lock",
                self.path,
            )
            return True
        finally:
            os.close(fd)

    @staticmethod
    def _read_holder(fd: int) -> LockHolder | None:
        """The owner record in the open lock file ``fd`` (a regular file), or None when it is unreadable: empty,
        over :data:`_MAX_RECORD_BYTES`, not JSON or with fields of the wrong type."""
        os.lseek(fd, 0, os.SEEK_SET)
        data = b""
        while len(data) <= _MAX_RECORD_BYTES and (chunk := os.read(fd, _MAX_RECORD_BYTES + 1 - len(data))):
            data += chunk
        if len(data) > _MAX_RECORD_BYTES:
            return None
        try:
            return LockHolder.from_json(data)
        except LockError:
            return None

    def _held_message(self, holder: LockHolder | None) -> str:
        who = holder.describe() if holder is not None else "another process (unreadable owner record)"
        return (
            f"{self.output} is being written by {who}; lock file {self.path}. Wait for that run to finish, stop "
            f"it (kill {holder.pid if holder else 'PID'}), or choose another output"
        )


def output_lock(output: str | os.PathLike[str], *, what: str = "output", break_lock: bool = False) -> OutputLock:
    """An :class:`OutputLock` on ``output`` (not yet taken: use ``with``). ``what`` names the output in the
    record (``cache``, ``run``, ``corpus``, ``export``, ``sweep``)."""
    return OutputLock(output, what=what, break_lock=break_lock)
