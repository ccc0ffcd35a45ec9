"""Training state on disk without pickle: nests of tensors and plain values as one safetensors file.

The optimizer's ``state_dict()`` and the RNG states (:func:`dflash.training.checkpoint.capture_rng_state`) are nests of dicts,
lists and tuples holding tensors, numpy arrays and plain Python values. :func:`save_state_tree` writes one
``.safetensors`` file: every tensor (and numpy array) is a safetensors tensor named by its path in the nest, and the
nest itself, with each tensor replaced by its name, is JSON in the file's metadata (key ``dflash_state_tree``).
Reading it back (:func:`load_state_tree`) parses a JSON header and raw little-endian buffers: nothing in the file can
execute code, whoever wrote it (``torch.save`` writes a pickle, and loading a planted one runs arbitrary code).

Skeleton encoding (JSON): ``{"$tensor": name}`` (the name is the path of keys joined by dots, e.g.
``state.0.exp_avg``); ``{"$ndarray": name, "dtype": "uint32"}`` (stored as a tensor of a
safetensors-supported dtype, converted back on load); ``{"$dict": [[key, value], ...]}`` (keys are str or int, kept
as such: optimizer states are keyed by parameter index); ``{"$tuple": [...]}``; lists, str, int, float (NaN and
infinities as ``{"$float": "nan"}``), bool and None as themselves.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash.errors import CheckpointError
from dflash.io.files import parse_json

__all__ = ["STATE_TREE_FORMAT", "save_state_tree", "load_state_tree"]

#: Version of the skeleton encoding, recorded in the file's metadata.
STATE_TREE_FORMAT = 1
_TREE_KEY = "dflash_state_tree"
_FORMAT_KEY = "dflash_state_format"
#: numpy dtypes safetensors has no torch counterpart for: stored widened, restored exactly.
_WIDENED = {np.dtype(np.uint32): torch.int64, np.dtype(np.uint16): torch.int32}


def _child(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _encode(value: Any, tensors: dict[str, torch.Tensor], path: str) -> Any:
    if isinstance(value, torch.Tensor | np.ndarray) and path in tensors:
        raise TypeError(f"two state tensors would both be named {path!r} (a key holds a '.')")
    if isinstance(value, torch.Tensor):
        tensors[path] = value.detach().contiguous()
        return {"$tensor": path}
    if isinstance(value, np.ndarray):
        widened = _WIDENED.get(value.dtype)
        array = np.ascontiguousarray(value)
        tensor = torch.from_numpy(array.astype(np.int64) if widened is torch.int64 else
                                  array.astype(np.int32) if widened is torch.int32 else array.copy())
        tensors[path] = tensor
        return {"$ndarray": path, "dtype": str(value.dtype)}
    if isinstance(value, np.generic):
        return _encode(value.item(), tensors, path)
    if isinstance(value, Mapping):
        items = []
        for key, item in value.items():
            if not isinstance(key, str | int) or isinstance(key, bool):
                raise TypeError(f"state key {key!r} at {path or '/'} is a {type(key).__name__}, not str or int")
            items.append([key, _encode(item, tensors, _child(path, key))])
        return {"$dict": items}
    if isinstance(value, tuple):
        return {"$tuple": [_encode(item, tensors, _child(path, index)) for index, item in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(item, tensors, _child(path, index)) for index, item in enumerate(value)]
    if isinstance(value, float) and not math.isfinite(value):
        return {"$float": repr(value)}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"state value at {path or '/'} is a {type(value).__name__}: not storable without pickle")


def save_state_tree(tree: Any, path: str | Path, *, metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tree`` (dicts/lists/tuples of tensors, numpy arrays and plain values) to ``path`` as safetensors.

    Tensors keep their dtype and shape (written from host memory; CUDA tensors are copied). ``metadata`` adds string
    entries to the file's header.

    Raises:
        TypeError: a value that has no pickle-free encoding (a bug in the caller: training state is plain).
        OSError: the write was refused (a full disk...), naming ``path`` (:func:`dflash.io.weights.save_safetensors`).
    """
    from dflash.io.weights import save_safetensors

    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(tree, tensors, "")
    header = {_FORMAT_KEY: str(STATE_TREE_FORMAT), _TREE_KEY: json.dumps(skeleton), **dict(metadata or {})}
    save_safetensors({name: t.cpu() for name, t in tensors.items()}, path, metadata=header)


def _decode(node: Any, tensors: Mapping[str, torch.Tensor], where: Path) -> Any:
    if isinstance(node, list):
        return [_decode(item, tensors, where) for item in node]
    if not isinstance(node, dict):
        return node
    if len(node) == 1 and "$dict" in node:
        return {key: _decode(value, tensors, where) for key, value in node["$dict"]}
    if len(node) == 1 and "$tuple" in node:
        return tuple(_decode(item, tensors, where) for item in node["$tuple"])
    if len(node) == 1 and "$float" in node and node["$float"] in ("nan", "inf", "-inf"):
        return float(node["$float"])
    if len(node) == 1 and "$tensor" in node and node["$tensor"] in tensors:
        return tensors[node["$tensor"]]
    if set(node) == {"$ndarray", "dtype"} and node["$ndarray"] in tensors:
        return tensors[node["$ndarray"]].numpy().astype(np.dtype(node["dtype"]))
    raise CheckpointError(
        f"{where}: unknown entry {json.dumps(node)[:120]} in its state tree; the file was not written by this "
        "version of dflash-stages or was edited: resume from another checkpoint"
    )


def load_state_tree(path: str | Path) -> Any:
    """Read a file written by :func:`save_state_tree`; tensors on CPU.

    Raises:
        CheckpointError: the file is missing, truncated, not safetensors, or its state tree is malformed; the
            message names the file.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            header = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except (OSError, SafetensorError, RuntimeError, ValueError) as error:
        raise CheckpointError(
            f"cannot read {path}: {str(error).splitlines()[0] if str(error) else type(error).__name__}; the file is "
            "truncated or not a dflash-stages state file: resume from another checkpoint"
        ) from error
    if _TREE_KEY not in header:
        raise CheckpointError(f"{path} holds no '{_TREE_KEY}' metadata: not a dflash-stages state file")
    try:
        version = int(header.get(_FORMAT_KEY, "0"))
    except ValueError:
        raise CheckpointError(f"{path}: its state format {header.get(_FORMAT_KEY)[:20]!r} is not a number; the file "
                              "was edited") from None
    if version > STATE_TREE_FORMAT:
        raise CheckpointError(
            f"{path} has state format {version}, newer than this code's {STATE_TREE_FORMAT}; upgrade dflash-stages"
        )
    skeleton = parse_json(header[_TREE_KEY], where=f"{path} (its state tree)", error=CheckpointError,
                          fix="the file was edited")
    return _decode(skeleton, tensors, path)
