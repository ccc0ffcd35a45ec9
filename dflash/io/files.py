"""The one way dflash-stages replaces a small local file atomically (JSON records, reports, prompt files), and the
one way it reads a state or config file back: bounded, from a regular file, parsed with a bounded nesting depth.

A reader sees the old file or the new one, never a partly written one, and a crash leaves at most a hidden
temporary next to it (``.NAME.tmp-PID``, removed on any error in this process): the data goes to a temporary file
in the same folder, is flushed and ``fsync``-ed, then ``os.replace`` (atomic within one filesystem, POSIX and
Windows) puts it in place. No symbolic link is followed: the temporary is created new (``O_EXCL | O_NOFOLLOW``,
after removing whatever had its name), and ``os.replace`` replaces a link at ``path`` instead of writing where it
points. Used for run records (``run.json``, ``latest``), commit records of generated parts,
metrics rewrites, evaluation reports and the embedded prompt files.

Reading (:func:`read_bounded`, :func:`load_json`, :func:`parse_json`, :func:`check_depth`): every JSON/TOML/YAML
record and config file dflash-stages reads (run records, checkpoints' JSON, commit records, cache metadata, lock
records, ``metrics.jsonl``, ``--config`` files) is opened without blocking, refused unless it is a regular file (a
device such as ``/dev/zero``, a FIFO or a socket, directly or through a symlink, would be read forever or block),
refused when larger than a cap checked before reading, and its parsed value refused when nested deeper than
:data:`MAX_DEPTH` (a parser's ``RecursionError`` becomes the same refusal). Each refusal is the caller's
:class:`~dflash.errors.DFlashError` subclass, one line naming the file and the fix (exit status 2).

Lines and JSON from outside (:func:`read_lines`, :func:`decode_json`): a user's JSONL or one-prompt-per-line file
is read one line at a time, never more than ``max_line_bytes`` of it at once (memory and time per line bounded, a
signal answered between lines), and JSON that came from outside (a file line, a server's reply) is parsed by
:func:`decode_json`, whose every refusal is a :class:`JSONInputError` with a one-line reason: invalid JSON, nesting
deeper than :data:`MAX_DEPTH`, an integer of more digits than Python converts, bytes that are not UTF-8, or a lone
surrogate (``"\\ud800"``: valid JSON, but no text a tokenizer or file takes). :func:`parse_json` is the same parse
with the refusal as the caller's error class, naming the file.

Not for: the cache (contract 2, Zarr through its store: ``dflash.cache``), checkpoints (a folder renamed into
place, ``dflash.training.checkpoint``) and lock files (``dflash.io.locks`` keeps the new file's descriptor open).
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from dflash.errors import ConfigError, ConfigPathNotFoundError, DFlashError

__all__ = ["atomic_output", "atomic_write_bytes", "atomic_write_text", "MAX_DEPTH", "MAX_RECORD_BYTES",
           "DEFAULT_MAX_LINE_BYTES", "JSONInputError", "check_depth", "decode_json", "load_json",
           "open_regular", "parse_json", "read_bounded", "read_json_lines", "read_lines", "not_a_file_error", "what_is_at"]

#: Deepest nesting of lists/objects accepted in any JSON/TOML/YAML file read back (the deepest record written is a
#: handful of levels).
MAX_DEPTH = 64

#: Size cap of a JSON record (run records, checkpoint JSON, commit records, cache metadata), checked before reading.
MAX_RECORD_BYTES = 64 * 2**20

#: Default bound on one line of a prompts or chat file: 4 MiB, about a million tokens of text (far past any
#: target's context), read and parsed in well under a second.
DEFAULT_MAX_LINE_BYTES = 4 * 2**20

_SURROGATE = re.compile("[\ud800-\udfff]")


class JSONInputError(ValueError):
    """JSON from outside that cannot be used; ``str()`` is the one-line reason (no location: the caller adds it)."""


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


def _kind(mode: int) -> str:
    return ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a device")


def what_is_at(path: str | os.PathLike[str]) -> str:
    """What stands at ``path`` where a regular file is wanted, for an error message: ``"nothing"`` (no such file,
    or a symlink to nothing: ``"a broken symlink"``), ``"a folder"``, ``"a FIFO"``, ``"a socket"``, ``"a device"``,
    ``"a symlink loop"``, or ``"a regular file"``. Symlinks are followed; nothing is opened."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return "a broken symlink" if os.path.islink(path) else "nothing"
    except OSError as error:
        return "a symlink loop" if error.errno == errno.ELOOP else f"unreadable ({error.strerror})"
    return "a regular file" if stat.S_ISREG(info.st_mode) else _kind(info.st_mode)


def not_a_file_error(what: str, path: str | os.PathLike[str], fix: str) -> ConfigError:
    """The error for a setting ``what`` whose ``path`` is not a regular file (to raise): ``ConfigPathNotFoundError``
    ("does not exist") where nothing is there, else ``ConfigError`` naming what is (:func:`what_is_at`); the
    message ends with ``fix``."""
    there = what_is_at(path)
    if there == "nothing":
        return ConfigPathNotFoundError(f"{what}: {os.fspath(path)} does not exist; {fix}")
    return ConfigError(f"{what}: {os.fspath(path)} is {there}, not a file; {fix}")


def _refuse(error: type[DFlashError], path: str | os.PathLike[str], problem: str, fix: str) -> DFlashError:
    return error(f"{os.fspath(path)}: {problem}; {fix}")


@contextmanager
def open_regular(path: str | os.PathLike[str], *, limit: int, error: type[DFlashError], fix: str) -> Iterator[IO[bytes]]:
    """Open ``path`` for binary reading, only if it is a regular file (symlinks followed) of at most ``limit`` bytes.

    Opened with ``O_NONBLOCK`` so that a FIFO does not block the open; the type and size come from ``fstat`` of the
    opened file (no race with a swap after a check).

    Raises:
        ``error``: a device, FIFO, socket or folder, or a file over ``limit``; the message names the file and ends
            with ``fix``.
        OSError: from the filesystem (``FileNotFoundError``, ``PermissionError``...), for the caller's handler.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _refuse(error, path, f"is {_kind(info.st_mode)}, not a regular file", fix)
        if info.st_size > limit:
            raise _refuse(error, path, f"is {info.st_size:,} bytes, over the {limit:,}-byte limit of such a file", fix)
        handle = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with handle:
        yield handle


def read_bounded(path: str | os.PathLike[str], *, limit: int = MAX_RECORD_BYTES, error: type[DFlashError],
                 fix: str) -> bytes:
    """The bytes of the regular file ``path`` (:func:`open_regular`), never more than ``limit`` (a file that grew
    past it while read is refused too).

    Raises:
        ``error``: not a regular file, or over ``limit``. OSError: from the filesystem.
    """
    with open_regular(path, limit=limit, error=error, fix=fix) as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise _refuse(error, path, f"is over the {limit:,}-byte limit of such a file", fix)
    return data


def _depth_problem(value: Any, limit: int) -> str | None:
    """Why ``value`` nests too deep or holds a lone surrogate, checked without recursion; None when it does not."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                return ("a string holds a lone surrogate escape (e.g. \\ud800), which is not text; write the character "
                        "itself or drop it")
            continue
        children = (list(node.keys()) + list(node.values()) if isinstance(node, dict)
                    else node if isinstance(node, list | tuple) else ())
        for child in children:
            if isinstance(child, dict | list | tuple):
                if depth + 1 > limit:
                    return f"nested more than {limit} levels deep"
                stack.append((child, depth + 1))
            elif isinstance(child, str):
                stack.append((child, depth))
    return None


def check_depth(value: Any, *, where: str | os.PathLike[str], error: type[DFlashError], fix: str,
                limit: int = MAX_DEPTH) -> Any:
    """``value`` (parsed JSON/TOML/YAML) unchanged, after checking without recursion that its lists and dicts nest at
    most ``limit`` deep and no string holds a lone surrogate.

    Raises:
        ``error``: nested deeper (or a lone surrogate), naming ``where``.
    """
    problem = _depth_problem(value, limit)
    if problem is not None:
        raise _refuse(error, where, problem, fix)
    return value


def decode_json(text: str | bytes, *, object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None) -> Any:
    """``json.loads(text)``, with every way it refuses, or accepts what no later step can use, as one
    :class:`JSONInputError` whose message is the reason alone (the caller names the source).

    Raises:
        JSONInputError: not UTF-8, not JSON (with line and column), nesting deeper than :data:`MAX_DEPTH` (also the
            parser's own ``RecursionError``), an integer too long to convert, or a lone surrogate in a string.
        Whatever ``object_pairs_hook`` raises (a key given twice), unchanged.
    """
    try:
        value = json.loads(text, object_pairs_hook=object_pairs_hook)
    except json.JSONDecodeError as problem:
        raise JSONInputError(f"not valid JSON at line {problem.lineno} column {problem.colno} ({problem.msg})") from None
    except UnicodeDecodeError:
        raise JSONInputError("not UTF-8 text") from None
    except RecursionError:
        raise JSONInputError(f"nested more than {MAX_DEPTH} levels deep") from None
    except ValueError as problem:
        if isinstance(problem, DFlashError) or type(problem).__module__ != "builtins":
            raise  # the caller's hook refused a value (a key given twice): its own message
        raise JSONInputError(f"unreadable value ({str(problem)[:80]})") from None
    problem = _depth_problem(value, MAX_DEPTH)
    if problem is not None:
        raise JSONInputError(problem)
    return value


def parse_json(text: str | bytes, *, where: str | os.PathLike[str], error: type[DFlashError], fix: str,
               object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None) -> Any:
    """:func:`decode_json` with its refusal as ``error``, one line naming ``where`` and ending with ``fix``."""
    try:
        return decode_json(text, object_pairs_hook=object_pairs_hook)
    except JSONInputError as problem:
        raise _refuse(error, where, str(problem), fix) from None


def load_json(path: str | os.PathLike[str], *, error: type[DFlashError], fix: str, limit: int = MAX_RECORD_BYTES,
              expect: type | tuple[type, ...] | None = dict) -> Any:
    """The JSON value of the regular file ``path``: :func:`read_bounded`, then :func:`parse_json`; with ``expect``
    (a dict by default) the top-level value must be of that type.

    Raises:
        ``error``: not a regular file, over ``limit``, not JSON, nested too deep, or not ``expect`` at the top;
            one line naming the file and ending with ``fix``. OSError: from the filesystem
            (``FileNotFoundError`` for a missing file).
    """
    value = parse_json(read_bounded(path, limit=limit, error=error, fix=fix), where=path, error=error, fix=fix)
    if expect is not None and not isinstance(value, expect):
        names = " or ".join(t.__name__ for t in (expect if isinstance(expect, tuple) else (expect,)))
        names = names.replace("dict", "a JSON object").replace("list", "a JSON array")
        raise _refuse(error, path, f"expected {names} at the top, got {type(value).__name__}", fix)
    return value


def read_lines(path: str | os.PathLike[str], *, max_line_bytes: int, what: str, raise_with: str | None = None,
               error: type[DFlashError] = ConfigError, fix: str | None = None) -> Iterator[tuple[int, bytes]]:
    """``(line number, line)`` of the file at ``path``, from 1, the line break removed; never holds more than one
    line (of at most ``max_line_bytes`` bytes) in memory.

    Args:
        what: how messages name the input (``"prompts"``).
        raise_with: the setting that raises the limit, named in the refusal (``"--max-prompt-bytes"``); None: the
            limit is fixed.
        error, fix: the refusal's class and fix (default: :class:`ConfigError`, and a fix naming the limit).

    Raises:
        ``error``: a line longer than ``max_line_bytes`` (named by file and line number); not a regular file
            (a FIFO would block, a device never end).
        OSError: from the filesystem.
    """
    with open_regular(path, limit=2**62, error=error, fix=fix or f"give {what} as a regular file") as handle:
        number = 0
        while True:
            # Two bytes more than the limit: a line of exactly the limit still fits with its "\r\n".
            line = handle.readline(max_line_bytes + 2)
            if not line:
                return
            number += 1
            content = line.rstrip(b"\r\n")
            if len(content) > max_line_bytes:
                remedy = fix or ("shorten or split it" + (f", or raise the limit with {raise_with}" if raise_with else ""))
                raise error(f"{what}: {os.fspath(path)} line {number} is longer than {max_line_bytes:,} bytes "
                            f"(the limit per line); {remedy}")
            yield number, content


def read_json_lines(path: str | os.PathLike[str], *, error: type[DFlashError], fix: str,
                    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> Iterator[tuple[int, bytes, Any]]:
    """``(line number, line, value)`` of each non-blank line of the JSON-lines file ``path`` (``metrics.jsonl``),
    read a bounded line at a time (:func:`read_lines`); a line that is not usable JSON gives the
    :class:`JSONInputError` as its value, for the caller to refuse or skip (a torn last line after a kill).

    Raises:
        ``error``: not a regular file, or a line longer than ``max_line_bytes``; naming the file and ending with
            ``fix``. OSError: from the filesystem.
    """
    for number, line in read_lines(path, max_line_bytes=max_line_bytes, what="JSON lines", error=error, fix=fix):
        if not line.strip():
            continue
        try:
            value = decode_json(line)
        except JSONInputError as problem:
            value = problem
        yield number, line, value
