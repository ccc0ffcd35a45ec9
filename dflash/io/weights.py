"""Reading safetensors files so that a truncated or foreign file is a user error naming the file, not a traceback.

safetensors raises its own ``SafetensorError`` (header too small, incomplete metadata, a file shorter than its
header says) without the path; every load path of this project (checkpoints, exports, targets' embeddings,
``inspect``) opens safetensors files through :func:`open_safetensors` or :func:`load_safetensors`, which raise
the given :class:`dflash.errors.DFlashError` subclass with the path, what was found and the fix.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dflash.errors import CheckpointError, DFlashError

__all__ = ["open_safetensors", "load_safetensors", "damaged_weights_error"]

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
