"""Check a dict of settings against a config dataclass before any work: unknown keys (with a did-you-mean) and values
of the wrong type, each named by key and by where it came from (a preset file, an override).

Used by ``dflash-stages run`` to validate every stage section of a preset and its ``--set`` overrides before the
first stage starts (a typo in ``train`` must not cost a generate and an extract first). The dataclass's own
``__post_init__`` checks (ranges, choices) run afterwards when the caller builds the config.

Types understood: ``bool``, ``int``, ``float`` (ints accepted), ``str``, ``pathlib.Path`` (strings), ``None``,
unions/``Optional``, ``Literal``, ``list``/``tuple``/``Sequence`` of these, ``dict``/``Mapping``; any other annotation
is left to the dataclass.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import json
import math
import os
import re
import tomllib
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from dflash.errors import ConfigError, ConfigPathNotFoundError
from dflash.io.files import MAX_DEPTH, check_depth, read_bounded
from dflash.values import shown

__all__ = ["DTYPE_NAMES", "CONFIG_SECTIONS", "DuplicateKeyError", "unique_keys", "MISSING_DEFAULT", "PATH_FIELDS", "EXCLUSIVE_SETTINGS", "CONTRADICTED_SETTINGS", "layer_over", "check_fields", "check_not_empty_path", "dtype_spelling", "field_default",
           "runtime_paths",
           "matches_type", "nested_config", "set_path", "get_path", "leaf_paths",
           "deep_merge", "override_value", "read_config_file", "MAX_CONFIG_BYTES"]

#: The stage sections a config file may hold (``[train]``, ``extract:``); ``stages.config.resolve.KNOWN_SECTIONS``.
CONFIG_SECTIONS = ("generate", "prepare", "split", "extract", "train", "evaluate", "online", "export", "sweep")

#: Size cap of a ``--config`` file (``dflash.io.files.read_bounded``): a config is a few kilobytes.
MAX_CONFIG_BYTES = 2**20

#: What :func:`field_default` returns for a field without a default (a required field).
MISSING_DEFAULT = dataclasses.MISSING


def set_path(values: dict[str, Any], path: str, value: Any, *, keep_existing: bool = False) -> None:
    """Set ``values[a][b] = value`` for the dotted ``path`` ``"a.b"`` (in place), making the inner dicts (copies of
    the ones met, so a caller's nested dict is never changed). ``keep_existing``: leave a value already there."""
    parts = path.split(".")
    node = values
    for part in parts[:-1]:
        inner = node.get(part)
        if not isinstance(inner, Mapping):
            if inner is not None:
                return  # a non-mapping in the way: the config's own check names it
            inner = {}
        node[part] = dict(inner)
        node = node[part]
    if not (keep_existing and parts[-1] in node):
        node[parts[-1]] = value


def get_path(values: Mapping[str, Any], path: str, default: Any = None) -> Any:
    """``values[a][b]`` for the dotted ``path`` ``"a.b"``, else ``default``."""
    node: Any = values
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def leaf_paths(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 1}}`` -> ``{"optim.lr": 1}``: every non-mapping value by its dotted path."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            flat.update(leaf_paths(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def deep_merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` updated by ``top``, nested mappings merged key by key (``top`` wins on leaves); new dicts."""
    merged = {key: dict(value) if isinstance(value, Mapping) else value for key, value in base.items()}
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = dict(value) if isinstance(value, Mapping) else value
    return merged


#: Settings where one choice excludes the others (where target replicas or drafter ranks run). A layer that sets
#: one of a group (preset < config file < options < ``--set``) replaces the others set by the layers below it, so
#: ``--preset cpu-small --target-gpus 0`` means GPU replicas, not a contradiction; one layer giving two of a group
#: is still refused by the stage config.
EXCLUSIVE_SETTINGS: tuple[tuple[str, ...], ...] = (
    ("target_gpus", "target_processes", "scheduler_address"),
    ("drafter_gpus", "drafter_processes"),
)


#: A setting that, set by a layer, replaces a lower layer's value that contradicts it: drafter GPUs over a preset's
#: ``device: "cpu"`` (``--preset online-cpu --drafter-gpus 1`` trains on that GPU).
CONTRADICTED_SETTINGS: dict[str, tuple[str, Any]] = {"drafter_gpus": ("device", "cpu")}


def layer_over(merged: dict[str, Any], layer: Mapping[str, Any]) -> dict[str, Any]:
    """``merged`` (the settings of lower layers) updated in place by ``layer`` (nested mappings merged key by key,
    :func:`deep_merge`); a key of an
    :data:`EXCLUSIVE_SETTINGS` group that ``layer`` sets (not None) removes the group's other keys of ``merged``
    that ``layer`` does not set itself, and a :data:`CONTRADICTED_SETTINGS` key the value it contradicts. Returns
    ``merged``."""
    for group in EXCLUSIVE_SETTINGS:
        if any(layer.get(key) is not None for key in group):
            for key in group:
                if key not in layer:
                    merged.pop(key, None)
    for key, (other, value) in CONTRADICTED_SETTINGS.items():
        if layer.get(key) is not None and other not in layer and merged.get(other) == value:
            merged.pop(other)
    merged.update(deep_merge(merged, layer))  # nested configs (train.optim) merge key by key
    return merged


#: Fields of the stage configs that hold a path (or a URL, or a target spec): an empty value would silently mean the
#: current folder, so it is refused wherever it comes from (:func:`check_not_empty_path`).
PATH_FIELDS = frozenset({"cache", "cache_to", "checkpoint", "corpus", "drafter", "json_path", "out", "output",
                         "prompts", "target", "tls_ca_file", "tls_cert", "tls_key", "workdir"})


def check_not_empty_path(key: str, value: Any, where: str) -> None:
    """Refuse an empty or blank string for a :data:`PATH_FIELDS` key.

    Raises:
        ConfigError: ``WHERE: empty path; ...``, with ``where`` naming the key and its source.
    """
    if key in PATH_FIELDS and isinstance(value, str) and not value.strip():
        raise ConfigError(f"{where}: empty path; give a path (an empty one would mean the current folder), or "
                          "remove the key")


def field_default(field: dataclasses.Field) -> Any:
    """A dataclass field's default value (a fresh one from its ``default_factory``), or :data:`MISSING_DEFAULT`."""
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return field.default_factory()  # type: ignore[misc]
    return MISSING_DEFAULT

def runtime_paths(cls: type) -> frozenset[str]:
    """The dotted paths of ``cls``'s fields declared ``runtime`` (``metadata={"runtime": True}``, a nested config's
    fields by their paths: ``telemetry.progress_interval``): fields that never change what the stage computes (how
    often it reports, where its processes run, its lock), so a resume or a rerun may change them."""
    hints = typing.get_type_hints(cls)
    paths: set[str] = set()
    for f in dataclasses.fields(cls):
        if f.metadata.get("runtime"):
            paths.add(f.name)
        hint = hints.get(f.name)
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            paths |= {f"{f.name}.{path}" for path in runtime_paths(hint)}
    return frozenset(paths)


#: Spellings of a dtype a user may write -> torch's name. Every dtype setting accepts each spelling of its choices
#: (``bf16`` or ``bfloat16``, ``fp32`` or ``float32``, ``fp8`` or ``float8_e4m3fn``) and stores its own one
#: (:func:`dtype_spelling`).
DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32",
               "fp16": "float16", "float16": "float16", "fp8": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn"}


def dtype_spelling(value: Any, choices: Any) -> Any:
    """The member of ``choices`` that names the same dtype as ``value`` (``"bfloat16"`` -> ``"bf16"`` where the
    choices are ``("bf16", "fp8")``), else ``value`` unchanged (the caller's own check then refuses it)."""
    if not isinstance(value, str) or value in choices:
        return value
    same = [c for c in choices if isinstance(c, str) and DTYPE_NAMES.get(c, c) == DTYPE_NAMES.get(value.lower())]
    return same[0] if same else value


def matches_type(value: Any, hint: Any) -> bool:
    """Whether a JSON-like ``value`` fits the annotation ``hint`` (see the module docstring for what is checked)."""
    if hint is Any or hint is typing.Any:
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        return any(matches_type(value, arg) for arg in args)
    if hint is type(None):
        return value is None
    if origin is typing.Literal:
        value = dtype_spelling(value, args)
        return any(value == arg and type(value) is type(arg) for arg in args)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str or hint is Path:
        return isinstance(value, str)
    if origin in (list, tuple, collections.abc.Sequence, typing.Sequence):
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(matches_type(v, a) for v, a in zip(value, args, strict=True))
        return not args or all(matches_type(v, args[0]) for v in value)
    if origin in (dict, collections.abc.Mapping, typing.Mapping) or hint is dict:
        return isinstance(value, dict)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):  # a nested config: an object of its fields
        return isinstance(value, dict)
    return True


def _type_name(hint: Any) -> str:
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return f"an object of {hint.__name__} fields"
    if typing.get_origin(hint) is typing.Literal:  # the choices, as the options' own messages spell them
        return "one of " + "|".join(str(choice) for choice in typing.get_args(hint))
    text = str(hint).replace("typing.", "").replace("pathlib.", "").replace("<class '", "").replace("'>", "")
    return text.replace("NoneType", "None")


def check_fields(cls: type, values: Mapping[str, Any], *, section: str, source: Callable[[str], str],
                 reserved: Iterable[str] = (), extra: Mapping[str, Any] | None = None) -> None:
    """Refuse unknown keys and wrongly typed values of ``values`` for the dataclass ``cls``.

    Args:
        cls: the stage's config dataclass.
        values: the section's settings (JSON-like).
        section: its name in messages (``train`` -> ``train.lr``).
        source: key -> where the value came from, e.g. ``"--set train.lr=abc"`` or ``"preset cpu-small"``.
        reserved: fields the caller sets itself (paths inside the work folder): refused when given.
        extra: keys the caller accepts beyond the dataclass's fields, with their annotations.

    Raises:
        ConfigError: the first problem, as ``SECTION.KEY (SOURCE): what is wrong; the fix``.
    """
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    reserved = set(reserved)
    allowed = (fields - reserved) | set(extra or {})
    hints = {**hints, **dict(extra or {})}
    for key, value in values.items():
        where = f"{section}.{key} ({source(key)})"
        if key in reserved:
            raise ConfigError(f"{where}: set by the pipeline itself (paths inside the work folder, the target, the "
                              "trainer of an online section, no cache beside it); remove it")
        if key not in allowed:
            # a nested config's field is suggested by its path (train.lrr -> did you mean train.optim.lr?)
            inner = {f"{name}.{f.name}": f.name for name in sorted(allowed)
                     if isinstance(hints.get(name), type) and dataclasses.is_dataclass(hints[name])
                     for f in dataclasses.fields(hints[name]) if f.init}
            close = difflib.get_close_matches(key, sorted(allowed) + sorted(set(inner.values())), n=1)
            if close and close[0] not in allowed:
                close = [next(path for path, leaf in inner.items() if leaf == close[0])]
            hint = f"did you mean {section}.{close[0]}?" if close else f"known: {', '.join(sorted(allowed))}"
            raise ConfigError(f"{where}: unknown key; {hint}")
        if key in hints and not matches_type(value, hints[key]):
            raise ConfigError(f"{where}: expected {_type_name(hints[key])}, got {value!r}")
        check_not_empty_path(key, value, where)
        if isinstance(value, float) and not math.isfinite(value):  # 1e999 parses as inf; JSON cannot print it back
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        if isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**64:
            raise ConfigError(f"{where}: {shown(value)} is out of range: give an integer that fits in 64 bits")
        nested = hints.get(key)
        if isinstance(nested, type) and dataclasses.is_dataclass(nested) and isinstance(value, dict):
            check_fields(nested, value, section=f"{section}.{key}", source=lambda inner, k=key: source(f"{k}.{inner}"))


def _yaml_loader() -> Any:
    """PyYAML's SafeLoader (plain data only) that also reads ``3e-4`` as a float, as TOML and JSON do (YAML 1.1's
    float pattern wants a dot: ``lr: 3e-4`` would otherwise be the string ``"3e-4"``)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):  # a key given twice is an error, as in TOML (not last-wins)
            if isinstance(node, yaml.MappingNode):
                seen: set = set()
                for key_node, _ in node.value:
                    key = self.construct_object(key_node, deep=True)
                    if key in seen:
                        raise DuplicateKeyError(key, key_node.start_mark.line + 1)
                    seen.add(key)
            return super().construct_mapping(node, deep=deep)

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[0-9][0-9_]*[eE][-+]?[0-9]+|\.[0-9_]+"
                   r"(?:[eE][-+]?[0-9]+)?|\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
        list("-+0123456789."),
    )
    return Loader


class DuplicateKeyError(ValueError):
    """A key given twice in one mapping of a YAML or JSON config file."""

    def __init__(self, key: Any, line: int | None = None) -> None:
        super().__init__(key)
        self.key, self.line = key, line


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook``: the object, refusing a key given twice."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise DuplicateKeyError(key)
        result[key] = value
    return result


def override_value(raw: str, item: str) -> Any:
    """The value of a ``--set KEY=RAW`` override: JSON if it parses (``3e-4``, ``[0, 1]``, ``null``), else the text.

    Raises:
        ConfigError: JSON that Python cannot hold (a 5,000-digit integer, nesting thousands deep), naming ``item``.
    """
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw
    except (ValueError, RecursionError) as error:
        raise ConfigError(f"--set {item[:80]!r}: unreadable value ({type(error).__name__})") from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Settings from a ``.toml`` (``tomllib``), ``.yaml``/``.yml`` (PyYAML's safe loader: plain data only, never
    objects; ``3e-4`` is a float) or ``.json`` file; a JSON ``run.json`` gives its ``config`` object.

    Read through ``dflash.io.files.read_bounded`` (a regular file of at most :data:`MAX_CONFIG_BYTES`); its nesting is
    bounded (``dflash.io.files.MAX_DEPTH``; YAML's before anything is built, as PyYAML's scanner is quadratic in depth).

    Raises:
        ConfigError: the file is missing or unreadable, not a regular file (a device, a FIFO), too large, not valid
            TOML/YAML/JSON (with line and column), nested too deep, of another extension, or not a
            table/mapping/object at the top.
    """
    file = Path(path).expanduser()
    fix = "give a .toml, .yaml or .json config file"
    if not os.path.lexists(file):
        raise ConfigPathNotFoundError(f"--config {file}: no such file; {fix}")
    suffix = file.suffix.lower()
    try:
        text = read_bounded(file, limit=MAX_CONFIG_BYTES, error=ConfigError, fix=fix).decode()
    except ConfigError as error:
        raise ConfigError(f"--config {error}") from None
    except FileNotFoundError:  # a symlink to nothing
        raise ConfigPathNotFoundError(f"--config {file}: no such file (a broken link); {fix}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"--config {file}: unreadable ({error})") from None
    try:
        data: Any = check_depth(_parse(file, suffix, text), where=f"--config {file}", error=ConfigError,
                           fix=_FLATTER)
    except DuplicateKeyError as error:
        at = f" (line {error.line})" if error.line is not None else ""
        raise ConfigError(f"--config {file}: key {error.key!r} given twice{at}; keep one") from None
    except RecursionError:  # tomllib and json recurse per level of nesting
        raise ConfigError(f"--config {file}: nested more than {MAX_DEPTH} levels deep; {_FLATTER}") from None
    except ValueError as error:  # e.g. a 5,000-digit integer
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(f"--config {file}: unreadable ({type(error).__name__}: {str(error)[:120]})") from None
    if data is None and suffix in (".yaml", ".yml"):  # an empty YAML document (or comments only), like empty TOML
        data = {}
    if isinstance(data, dict) and suffix in (".yaml", ".yml"):  # `train:` with nothing under it: an empty section
        data = {key: {} if value is None and key in CONFIG_SECTIONS else value for key, value in data.items()}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {file}: expected a table/object of settings at the top, got {type(data).__name__}")
    if suffix == ".json" and isinstance(data.get("config"), dict):  # a run.json
        data = data["config"]
    return data


#: The fix of a config file nested too deep.
_FLATTER = "a config nests a few levels ([section] and its tables): write the values out flat"


def _parse(file: Path, suffix: str, text: str) -> Any:
    if suffix == ".toml":
        try:
            data: Any = tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"--config {file}: invalid TOML ({error})") from None
    elif suffix in (".yaml", ".yml"):
        import yaml

        try:
            # Before anything is built, from the event stream (which stops at the first refusal): anchors/aliases
            # refused, as nested aliases expand exponentially ("billion laughs"), and nesting bounded, as PyYAML's
            # scanner takes time quadratic in it.
            depth = 0
            for event in yaml.parse(text, Loader=_yaml_loader()):
                if isinstance(event, yaml.AliasEvent):
                    raise ConfigError(f"--config {file}: YAML aliases (*name) are not accepted in config files; write "
                                      "the values out")
                depth += isinstance(event, yaml.CollectionStartEvent) - isinstance(event, yaml.CollectionEndEvent)
                if depth > MAX_DEPTH:
                    raise ConfigError(f"--config {file}: nested more than {MAX_DEPTH} levels deep; {_FLATTER}")
            data = yaml.load(text, Loader=_yaml_loader())  # noqa: S506 (a SafeLoader subclass)
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
            problem = getattr(error, "problem", None) or str(error).splitlines()[0]
            raise ConfigError(f"--config {file}: invalid YAML{where} ({problem})") from None
    elif suffix == ".json":
        try:
            data = json.loads(text, object_pairs_hook=unique_keys)
        except json.JSONDecodeError as error:
            raise ConfigError(f"--config {file}: invalid JSON at line {error.lineno} column {error.colno} "
                              f"({error.msg})") from None
    else:
        raise ConfigError(f"--config {file}: expected a .toml, .yaml or .json file, got {suffix or 'no extension'!r}")
    return data


def nested_config(default: Any, value: Any, name: str) -> Any:
    """``value`` as a config of ``default``'s class (a nested config given as a dict: a file section, a saved run),
    checked field by field; the fields it leaves out keep ``default``'s values (the owning stage's, which may differ
    from the class's: train's ``data.validation_fraction``).

    Raises:
        ConfigError: ``NAME.KEY: unknown key`` or the nested config's own refusal, prefixed by ``NAME.``.
    """
    cls = type(default)
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be an object of {cls.__name__} fields, got {value!r}")
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"{name}.{unknown[0]}: unknown key; known: {', '.join(sorted(known))}")
    try:
        return dataclasses.replace(default, **value)
    except ConfigError as error:
        raise ConfigError(f"{name}.{error}") from None
