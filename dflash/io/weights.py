"""Reading and writing safetensors files so that a truncated or foreign file, or a full disk, is a user error
naming the file, not a traceback.

safetensors raises its own ``SafetensorError`` (header too small, incomplete metadata, a file shorter than its
header says) without the path; every load path of this project (checkpoints, exports, targets' embeddings,
``inspect``) opens safetensors files through :func:`open_safetensors` or :func:`load_safetensors`, which raise
the given :class:`dflash.errors.DFlashError` subclass with the path, what was found and the fix.

Writing raises the same ``SafetensorError`` for what the operating system refused (a full disk, a quota, a
read-only filesystem: "... (os error 28) at path ..."); every write path (checkpoints, their state files, exports)
goes through :func:`save_safetensors`, which raises it as the ``OSError`` it is, naming the file, so the command
line reports it as every other refused write (one ``error:`` line, exit status 2).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from dflash.errors import CheckpointError, DFlashError
from dflash.faults import fault_point

__all__ = ["open_safetensors", "load_safetensors", "save_safetensors", "damaged_weights_error"]

#: How safetensors words an operating system error in a ``SafetensorError`` (Rust's ``io::Error``).
_OS_ERROR = re.compile(r"\(os error (\d+)\)")

DEFAULT_FIX = (
    "the file is truncated or overwritten: restore it, or use another checkpoint (RUN/checkpoints/step_XXXXXXXX) or "
    "export"
)


def damaged_weights_error(
    path: str | os.PathLike[str], error: BaseException, *, error_type: type[DFlashError] = CheckpointError,
    fix: str = DEFAULT_FIX,
) -> DFlashError:
    """The user error for an unreadable safetensors file: path, size on disk, the library's words, the fix."""
    try:
        size = f"{Path(path).stat().st_size:,} bytes"
    except OSError:
        size = "size unknown"
    return error_type(f"{os.fspath(path)} ({size}) is not a readable safetensors file ({error}); {fix}")


@contextlib.contextmanager
def open_safetensors(
    path: str | os.PathLike[str], *, error_type: type[DFlashError] = CheckpointError, fix: str = DEFAULT_FIX
) -> Iterator[Any]:
    """``safetensors.safe_open(path, framework="pt", device="cpu")``; any safetensors error while it is open
    (opening, reading a tensor) becomes ``error_type`` naming ``path`` (:func:`damaged_weights_error`)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(os.fspath(path), framework="pt", device="cpu") as handle:
            yield handle
    except (SafetensorError, OSError) as error:
        if isinstance(error, FileNotFoundError):
            raise error_type(f"{os.fspath(path)} is missing; {fix}") from error
        raise damaged_weights_error(path, error, error_type=error_type, fix=fix) from error


def load_safetensors(
    path: str | os.PathLike[str], *, error_type: type[DFlashError] = CheckpointError, fix: str = DEFAULT_FIX
) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, on CPU; errors as :func:`open_safetensors`."""
    with open_safetensors(path, error_type=error_type, fix=fix) as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def save_safetensors(
    tensors: Mapping[str, torch.Tensor], path: str | os.PathLike[str], *, metadata: Mapping[str, str] | None = None
) -> None:
    """``safetensors.torch.save_file(tensors, path, metadata)``, with what the operating system refused raised as
    an ``OSError`` naming ``path``.

    Raises:
        OSError: the write failed for an OS reason (``errno`` set: ``ENOSPC`` for a full disk...; ``filename`` is
            ``path``). Fault point ``safetensors.write`` (:mod:`dflash.faults`) injects a full disk here.
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        fault_point("safetensors.write", path)
        save_file(dict(tensors), os.fspath(path), metadata=None if metadata is None else dict(metadata))
    except SafetensorError as error:
        found = _OS_ERROR.search(str(error))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code) if code in errno.errorcode else str(error), os.fspath(path)) from error
