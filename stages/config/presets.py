"""Pipeline presets: the shipped ``stages/config/presets/NAME.json`` files and ``.json`` files of the same shape.

A preset is an object of sections (one per step of ``run``, plus ``target``); every command that takes
``--preset`` reads its own section through :func:`load_preset`.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Any

from dflash.errors import ConfigError, ConfigPathNotFoundError
from dflash.io.files import parse_json, read_bounded
from stages.config.check import MAX_CONFIG_BYTES, DuplicateKeyError, unique_keys

__all__ = ["PRESETS", "PIPELINE_SECTIONS", "read_preset_json", "load_preset", "strip_comments"]

#: The shipped presets of ``run`` (``stages/config/presets/NAME.json``).
PRESETS = ("cpu-small", "h200-smollm2", "cpu-online", "h200-smollm2-online")
#: The sections of a pipeline preset, in the order ``run`` runs them (``online``, when given, trains in place of
#: ``extract`` then ``train``: its producers compute the hidden states, and ``train`` configures its trainer).
PIPELINE_SECTIONS = ("generate", "prepare", "split", "extract", "online", "train", "evaluate")


def strip_comments(data: Any) -> Any:
    """``data`` without the keys starting with ``_`` (the ``_why`` comments of presets), at every depth."""
    if isinstance(data, dict):
        return {k: strip_comments(v) for k, v in data.items() if not k.startswith("_")}
    return data


def read_preset_json(name_or_path: str, names: tuple[str, ...]) -> Any:
    """The parsed JSON of a shipped preset (``stages/config/presets/NAME.json``, ``NAME`` in ``names``) or of a
    ``.json`` file path; the caller checks its shape.

    A file is read through ``dflash.io.files`` (a regular file of at most
    :data:`stages.config.check.MAX_CONFIG_BYTES`, nesting bounded).

    Raises:
        ConfigError: a missing file, a name that is not in ``names``, a device or FIFO, too large, invalid JSON,
            nested too deep, a key given twice.
    """
    path = Path(name_or_path)
    fix = "give a preset name or a .json preset file"
    if path.suffix == ".json" and not os.path.lexists(path):
        raise ConfigPathNotFoundError(f"preset {name_or_path}: no such file")
    if path.suffix != ".json" and name_or_path not in names:
        raise ConfigError(f"preset {name_or_path!r} is neither one of {', '.join(names)} nor a .json file")
    try:
        if path.suffix == ".json":
            text = read_bounded(path, limit=MAX_CONFIG_BYTES, error=ConfigError, fix=fix)
        else:
            text = resources.files("stages.config").joinpath("presets", f"{name_or_path}.json").read_bytes()
        return parse_json(text, where=name_or_path, error=ConfigError, fix=fix, object_pairs_hook=unique_keys)
    except DuplicateKeyError as error:
        raise ConfigError(f"preset {name_or_path}: key {error.key!r} given twice; keep one") from None
    except ConfigError as error:
        raise ConfigError(f"preset {error}") from None
    except OSError as error:
        raise ConfigError(f"preset {name_or_path}: unreadable ({error.strerror or error})") from None


def load_preset(name_or_path: str) -> dict[str, Any]:
    """A preset's config: a name in :data:`PRESETS` (``stages/config/presets/NAME.json``) or a JSON file path.

    Keys starting with ``_`` (``_why`` comments) are dropped.

    Raises:
        ConfigError: unknown preset or unreadable JSON.
    """
    data = read_preset_json(name_or_path, PRESETS)
    if not isinstance(data, dict):
        raise ConfigError(f"preset {name_or_path}: expected an object of sections, got {type(data).__name__}")
    unknown = sorted(set(strip_comments(data)) - set(PIPELINE_SECTIONS) - {"target"})
    if unknown:
        raise ConfigError(f"preset {name_or_path}: unknown sections {unknown}; expected {list(PIPELINE_SECTIONS)} and 'target'")
    return {name: dict(values) if isinstance(values, dict) else values
            for name, values in strip_comments(data).items()}
