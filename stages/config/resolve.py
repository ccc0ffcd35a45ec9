"""One way for every stage command to resolve its config: ``--preset``, ``--config FILE``, options, ``--set``.

Precedence, lowest first: the command's defaults < the preset's section for this stage < the config file < the
options given on the command line < ``--set`` overrides. Each layer is checked against the stage's config
dataclass before any work (``stages.config.check.check_fields``: unknown keys with a did-you-mean, wrong types),
and a value the dataclass refuses names its key and where it came from. ``--print-config`` prints the resolved
config as ``{"STAGE": {...}}`` JSON, which ``--config`` reads back.

A config file (``.toml``, ``.yaml``/``.yml`` or ``.json``, ``stages.config.check.read_config_file``) holds either this
stage's fields at the top or a section named after the stage (``[extract]`` in TOML): a pipeline preset, or a
``--print-config`` of several stages, configures each stage from its own section (other stages' sections are
ignored; a top-level ``target`` applies to every stage that has one).

The commands' options are derived from the config dataclasses (``stages.config.options``) and default to None, so
an option given is one that is not None: an option left out does not hide what the preset or the file say.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dflash.errors import ConfigError
from stages.config.check import (
    CONFIG_SECTIONS,
    MISSING_DEFAULT,
    check_fields,
    check_not_empty_path,
    field_default,
    layer_over,
    leaf_paths,
    override_value,
    read_config_file,
    set_path,
)
from stages.config.presets import load_preset

__all__ = ["layer_sets", "nested", "parse_sets", "plain_value", "print_and_exit", "printable", "resolve_stage_config", "section_of",
           "without_key"]

#: Stage sections a config file may hold besides this stage's own (ignored by the other stages).
KNOWN_SECTIONS = CONFIG_SECTIONS


#: Keys of a pipeline preset's stage section that only ``run`` reads (``pipelines.offline``); a stage skips them.
PIPELINE_ONLY = {"evaluate": frozenset({"per_epoch", "per_epoch_references", "per_epoch_num_prompts"})}


def section_of(data: Mapping[str, Any], section: str, fields: set[str], source: str = "") -> dict[str, Any]:
    """This stage's part of a config file or preset (see the module docstring).

    Raises:
        ConfigError: a file with stage sections that also holds an unknown section or key at its top, or a flat
            file with a table whose name is close to a stage's (a misspelt section), named with ``source``.
    """
    sectioned = any(isinstance(data.get(name), Mapping) for name in KNOWN_SECTIONS)
    where = f" ({source})" if source else ""
    for key, value in data.items():
        if key.startswith("_") or key == "target":
            continue
        if sectioned and key not in KNOWN_SECTIONS:
            close = difflib.get_close_matches(key, KNOWN_SECTIONS, n=1)
            raise ConfigError(f"{key}{where}: not a stage section; a file with stage sections holds its settings "
                              "inside them (and target at the top): "
                              + (f"did you mean {close[0]}?" if close else f"sections: {', '.join(KNOWN_SECTIONS)}"))
        if key in KNOWN_SECTIONS and key not in fields and not isinstance(value, Mapping):
            raise ConfigError(f"{key}{where}: expected a section (a table of {key} settings), got {value!r}")
        if not sectioned and isinstance(value, Mapping) and key not in fields:
            close = difflib.get_close_matches(key, KNOWN_SECTIONS, n=1, cutoff=0.75)
            if close:
                raise ConfigError(f"{key}{where}: unknown section; did you mean {close[0]}?")
    if isinstance(data.get(section), Mapping):
        picked = {k: v for k, v in data[section].items() if k not in PIPELINE_ONLY.get(section, ())}
        if "target" in fields and "target" in data and not isinstance(data["target"], Mapping):
            picked.setdefault("target", data["target"])
        return picked
    if any(isinstance(data.get(name), Mapping) for name in KNOWN_SECTIONS):
        return {"target": data["target"]} if "target" in fields and isinstance(data.get("target"), str) else {}
    return dict(data)


def parse_sets(overrides: Sequence[str], section: str) -> list[tuple[str, Any, str]]:
    """``--set KEY=VALUE`` or ``--set SECTION.KEY=VALUE`` (JSON value, else a string) -> (key, value, source). A key
    of a nested config is its dotted path (``train.optim.lr=3e-4`` -> ``("optim.lr", 3e-4, ...)``)."""
    parsed = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if key.startswith(section + "."):
            key = key[len(section) + 1 :]
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"--set {item!r}: expected {section}.field=value (or field=value), e.g. "
                              f"{section}.target=default")
        parsed.append((key, override_value(raw, item), f"--set {item}"))
    return parsed


def nested(key: str, value: Any) -> dict[str, Any]:
    """``("optim.lr", 3e-4)`` -> ``{"optim": {"lr": 3e-4}}``: a dotted ``--set`` key as the section dict it sets."""
    values: dict[str, Any] = {}
    set_path(values, key, value)
    return values


def layer_sets(values: dict[str, Any], sets: Sequence[tuple[str, Any, str]]) -> dict[str, Any]:
    """``values`` (a section's settings) updated in place by :func:`parse_sets`'s items, in order: a dotted key sets
    a nested config's field, a placement replaces the one it excludes (``stages.config.check.layer_over``).
    Returns ``values``."""
    for key, value, _ in sets:
        layer_over(values, nested(key, value))
    return values


def resolve_stage_config(
    cls: type,
    section: str,
    defaults: Mapping[str, Any] | None = None,
    given: Mapping[str, Any] | None = None,
    *,
    config_file: str | Path | None = None,
    preset: str | None = None,
    overrides: Sequence[str] = (),
    required: Sequence[str] = (),
    option_names: Mapping[str, str] | None = None,
    build: Callable[[dict[str, Any]], Any] | None = None,
    base: Callable[[dict[str, Any]], tuple[Mapping[str, Any], str] | None] | None = None,
    fill: Callable[[dict[str, Any]], Any] | None = None,
    read_preset: Callable[[str], Mapping[str, Any]] | None = None,
    reserved: Sequence[str] = (),
    layers: Sequence[tuple[Mapping[str, Any], str]] = (),
) -> Any:
    """Resolve and build a stage's config (precedence in the module docstring).

    Args:
        cls: the stage's config dataclass (its fields are the keys of every layer).
        section: the stage's name (``extract``): messages, sections of files and presets, ``--set`` prefixes.
        defaults: field -> the command's value where nothing else sets it (none: the dataclass's defaults).
        given: field (a nested config's leaf by its dotted path, ``optim.lr``) -> value of each option given on
            the command line (converted to the field's type).
        config_file: ``--config`` path, or None.
        preset: ``--preset`` name (``stages/config/presets``) or JSON path, or None.
        overrides: ``--set`` items.
        required: fields that must have a value in the end (``--output``...).
        option_names: field (dotted path) -> its option's spelling, for messages (default ``--`` + its last part).
        build: makes the config from the merged dict (default ``cls(**merged)``).
        base: the lowest layer above ``defaults``, chosen from the merged layers above it (train's saved run with
            ``--resume``): returns ``(values, source)`` or None. Its values are checked by the config when built.
        fill: called with the merged dict before the config is built, to fill what no layer set (train's CPU-sized
            defaults); what it returns is handed back with the config when given.
        read_preset: reads ``preset`` into its sections (default ``stages.config.presets.load_preset``: the
            pipeline presets; online's layouts have their own).
        reserved: fields no layer may set (online's ``train``: its own section).
        layers: ``(values, source)`` of settings the caller read itself (``run``: this section of its preset and of
            its config file), lowest first, above ``preset`` and ``config_file`` and checked as they are.

    Returns:
        The built config; ``(config, what fill returned)`` when ``fill`` is given.

    Raises:
        ConfigError: a missing or unreadable file, an unknown preset, an unknown key, a wrong type, a value the
            config refuses, or a required field without a value; the message names the key and its source.
    """
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    option_names = dict(option_names or {})
    read: list[tuple[Mapping[str, Any], str]] = []
    if preset is not None:
        loaded = (read_preset or load_preset)(preset)
        read.append((section_of(loaded, section, fields, f"preset {preset}"), f"preset {preset}"))
    if config_file is not None:
        data = read_config_file(config_file)
        read.append((section_of(data, section, fields, f"--config {config_file}"), f"--config {config_file}"))
    read += layers
    for values, source in read:
        check_fields(cls, values, section=section, source=lambda key, s=source: s, reserved=reserved)
    sets = parse_sets(overrides, section)
    for key, value, source in sets:
        check_fields(cls, nested(key, value), section=section, source=lambda _key, s=source: s, reserved=reserved)
    upper: dict[str, Any] = {}
    origin: dict[str, str] = {}  # dotted path -> where its value came from, for the messages
    for values, source in read:
        layer_over(upper, values)
        origin.update({key: source for key in leaf_paths(values)})
    options: dict[str, Any] = {}
    for key, value in (given or {}).items():
        set_path(options, key, value)
        origin[key] = option_names.get(key, "--" + key.rsplit(".", 1)[-1].replace("_", "-"))
    layer_over(upper, options)
    layer_sets(upper, sets)
    for key, value, source in sets:
        origin.update({path: source for path in leaf_paths(nested(key, value))})
    merged: dict[str, Any] = dict(defaults or {})
    lowest = base(upper) if base is not None else None
    if lowest is not None:
        values, source = lowest
        layer_over(merged, values)
        origin.update({key: source for key in leaf_paths(values) if key not in origin})
    layer_over(merged, upper)
    for key, value in merged.items():  # the options given too (`-o ''`)
        check_not_empty_path(key, value, f"{section}.{key} ({_source(origin, key)})")
    for key in required:
        if merged.get(key) is None:
            option = option_names.get(key, "--" + key.replace("_", "-"))
            raise ConfigError(f"{section}: {option} is required (on the command line, or {key} in --config/--preset/--set)")
    filled = fill(merged) if fill is not None else None
    try:
        config = build(merged) if build is not None else cls(**merged)
    except (ConfigError, ValueError, TypeError) as error:
        message = str(error)
        known = sorted(set(origin) | set(merged), key=len, reverse=True)
        key = next((k for k in known if message.startswith((k + " ", k + ":", k + ".", "--" + k.replace("_", "-")))),
                   None)  # fmt: skip
        if key is None:
            raise ConfigError(f"{section}: {message}") from None
        # A nested config's refusal names its leaf (``default_prompts.heldout_permille must be ...``): the message
        # names that whole path, the source is the leaf's (else the nearest enclosing key's).
        path = message.split(" ", 1)[0].rstrip(":") if message.startswith(key + ".") else key
        raise ConfigError(f"{section}.{path} ({_source(origin, path)}): {without_key(message, path)}") from None
    return (config, filled) if fill is not None else config


def _source(origin: Mapping[str, str], path: str) -> str:
    """Where the value at the dotted ``path`` came from: its own entry, else its nearest enclosing key's, else a
    leaf under it (a nested config set by one layer), else ``default``."""
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in origin:
            return origin[".".join(parts[:end])]
    return next((source for key, source in origin.items() if key.startswith(path + ".")), "default")


def without_key(message: str, key: str) -> str:
    """A config's refusal without its leading field name, for a message that names the key already
    (``lr: expected > 0`` -> ``expected > 0``; ``lr must be > 0`` -> ``must be > 0``)."""
    for prefix in (key + ": ", key + " "):
        if message.startswith(prefix) and len(message) > len(prefix):
            return message[len(prefix):]
    return message


def default_paths(cls: type) -> dict[str, Any]:
    """The defaults of ``cls``'s fields by dotted path (a nested config's fields by their paths:
    ``optim.lr``), as config-file data (:func:`plain_value`); fields without a default are left out."""
    defaults = {f.name: field_default(f) for f in dataclasses.fields(cls)}
    return leaf_paths({name: plain_value(value) for name, value in defaults.items() if value is not MISSING_DEFAULT})


def plain_value(value: Any) -> Any:
    """``value`` as config-file data: a dataclass as the dict of its init fields, paths as text, tuples as lists
    (recursively)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_value(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [plain_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain_value(v) for k, v in value.items()}
    return value


def printable(section: str, config: Any) -> str:
    """``{"SECTION": fields}`` JSON of a built config, which ``--config`` reads back."""
    return json.dumps({section: plain_value(config)}, indent=2, default=str)  # dates etc. of free-form `extra` as text


def print_and_exit(section: str, config: Any) -> None:
    """``--print-config``: print :func:`printable` and end the command (exit 0)."""
    import typer

    print(printable(section, config))
    raise typer.Exit(0)
