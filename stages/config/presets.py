"""Pipeline presets: the shipped ``pipelines/presets/NAME.json`` files and ``.json`` files of the same shape.

A preset is an object of sections (one per step of ``run``, plus ``target``); every command that takes
``--preset`` reads its own section through :func:`load_preset`.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from dflash.errors import ConfigError, ConfigPathNotFoundError
from stages.config.check import DuplicateKeyError, unique_keys

__all__ = ["PRESETS", "PIPELINE_SECTIONS", "read_preset_json", "load_preset", "strip_comments"]

#: The shipped presets of ``run`` (``pipelines/presets/NAME.json``).
PRESETS = ("cpu-small", "h200-smollm2")
#: The sections of a pipeline preset, in the order ``run`` runs them.
PIPELINE_SECTIONS = ("generate", "prepare", "split", "extract", "train", "evaluate")


def strip_comments(data: Any) -> Any:
    """``data`` without the keys starting with ``_`` (the ``_why`` comments of presets), at every depth."""
    if isinstance(data, dict):
        return {k: strip_comments(v) for k, v in data.items() if not k.startswith("_")}
    return data


def read_preset_json(name_or_path: str, names: tuple[str, ...]) -> Any:
    """The parsed JSON of a shipped preset (``pipelines/presets/NAME.json``, ``NAME`` in ``names``) or of a
    ``.json`` file path; the caller checks its shape.

    Raises:
        ConfigError: a missing file, a name that is not in ``names``, or invalid JSON.
    """
    path = Path(name_or_path)
    if path.suffix == ".json" and not path.is_file():
        raise ConfigPathNotFoundError(f"preset {name_or_path}: no such file")
    if path.suffix == ".json":
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(f"preset {name_or_path}: unreadable ({error})") from None
    elif name_or_path in names:
        text = resources.files("pipelines").joinpath("presets", f"{name_or_path}.json").read_text()
    else:
        raise ConfigError(f"preset {name_or_path!r} is neither one of {', '.join(names)} nor a .json file")
    try:
        return json.loads(text, object_pairs_hook=unique_keys)
    except json.JSONDecodeError as error:
        raise ConfigError(f"preset {name_or_path}: invalid JSON ({error})") from None
    except DuplicateKeyError as error:
        raise ConfigError(f"preset {name_or_path}: key {error.key!r} given twice; keep one") from None
    except (ValueError, RecursionError) as error:  # a 5,000-digit integer, nesting thousands deep
        raise ConfigError(f"preset {name_or_path}: unreadable ({type(error).__name__}: {str(error)[:120]})") from None


def load_preset(name_or_path: str) -> dict[str, Any]:
    """A preset's config: a name in :data:`PRESETS` (``pipelines/presets/NAME.json``) or a JSON file path.

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
