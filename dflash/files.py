"""The one way dflash-stages replaces a small local file atomically (JSON records, reports, prompt files).

A reader sees the old file or the new one, never a partly written one, and a crash leaves at most a hidden
temporary next to it (``.NAME.tmp-PID``, removed on any error in this process): the data goes to a temporary file
in the same folder, is flushed and ``fsync``-ed, then ``os.replace`` (atomic within one filesystem, POSIX and
Windows) puts it in place. No symbolic link is followed: the temporary is created new (``O_EXCL | O_NOFOLLOW``,
after removing whatever had its name), and ``os.replace`` replaces a link at ``path`` instead of writing where it
points. Used for run records (``run.json``, ``latest``), commit records of generated parts,
metrics rewrites, evaluation reports and the embedded prompt files.

Not for: the cache (contract 2, Zarr through its store: ``dflash.cache``), checkpoints (a folder renamed into
place, ``dflash.checkpoint``) and lock files (``dflash.locks`` keeps the new file's descriptor open).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_output", "atomic_write_bytes", "atomic_write_text"]


@contextmanager
def atomic_output(path: str | os.PathLike[str], mode: str = "w", *, fsync: bool = True) -> Iterator[IO[Any]]:
    """Open a temporary file beside ``path`` for writing; on a clean exit flush, ``fsync`` (unless ``fsync=False``)
    and ``os.replace`` it onto ``path``; on any exception (including ``KeyboardInterrupt``) remove it and leave
    ``path`` as it was.

    Args:
        path: the file to replace (its folder must exist).
        mode: ``"w"`` (UTF-8 text) or ``"wb"``.
        fsync: force the data to the device before the rename (off only for throwaway files).

    Yields:
        The open temporary file.

    Raises:
        ValueError: a mode other than ``"w"`` / ``"wb"``.
        OSError: from the filesystem (the temporary is removed first).
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_output: mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.unlink(missing_ok=True)  # a leftover of a killed process with this pid, or a planted link: not followed
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(temporary, flags, 0o666)
        with open(fd, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as handle:
            yield handle
            handle.flush()
            if fsync:
                os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str, *, fsync: bool = True) -> None:
    """Replace ``path`` with ``text`` (UTF-8) atomically (:func:`atomic_output`)."""
    with atomic_output(path, "w", fsync=fsync) as handle:
        handle.write(text)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, fsync: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically (:func:`atomic_output`)."""
    with atomic_output(path, "wb", fsync=fsync) as handle:
        handle.write(data)
