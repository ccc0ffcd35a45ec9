"""Write ``docs/config-reference.md``: every setting of every stage, from its one declaration.

It lives in ``pipelines`` (the top layer) because it reads the config classes of both the stages and the pipelines.

Each stage's settings are the fields of its config dataclass; this reads them (name, type, default) with
``dataclasses``, their options from the fields' metadata (``stages.config.options``) and their descriptions from the
class source (attribute docstrings, ``#:`` comments or a ``Fields:`` section of the class docstring; else the option's
help), so the reference cannot drift from the code:
``tests/test_cli_declarations.py`` regenerates it and compares. Run::

    python -m pipelines.reference > docs/config-reference.md
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
import typing
from typing import Any

from pipelines.offline import SplitConfig
from pipelines.online import OnlineConfig
from stages.config.check import MISSING_DEFAULT, field_default
from stages.config.options import option_specs
from stages.evaluate import EvaluateConfig
from stages.export import ExportConfig
from stages.extract.command import ExtractConfig
from stages.generate import GenerateConfig
from stages.prepare import PrepareConfig
from stages.sweep import SweepConfig
from stages.train.config import TrainConfig

__all__ = ["STAGE_CONFIGS", "field_descriptions", "reference_markdown", "sections"]

#: Section (the ``--config`` section and ``--set`` prefix) -> (module, config dataclass), in pipeline order. A field
#: that holds a nested config (``train.optim``) gets its own section right after its parent's (:func:`sections`).
STAGE_CONFIGS: dict[str, type] = {
    "prepare": PrepareConfig,
    "split": SplitConfig,
    "generate": GenerateConfig,
    "extract": ExtractConfig,
    "train": TrainConfig,
    "online": OnlineConfig,
    "evaluate": EvaluateConfig,
    "export": ExportConfig,
    "sweep": SweepConfig,
}


def field_descriptions(cls: type) -> dict[str, str]:
    """Field -> its description, in the class source: the string literal after the
    field (attribute docstring), the ``#:`` comment lines above it, or its entry in a ``Fields:`` / ``Attributes:`` section of the class docstring
    (an entry may name several fields: ``temperature, top_p: ...``). Fields inherited from a base config
    (``LoaderConfig`` extends ``BucketConfig``) are described where the base declares them. A field the source does
    not describe has its option's help (``metadata["help"]``)."""
    described: dict[str, str] = {}
    for base in reversed(cls.__mro__[1:]):
        if dataclasses.is_dataclass(base):
            described.update(field_descriptions(base))
    doc = inspect.getdoc(cls) or ""
    header = next((h for h in ("Fields:", "Attributes:") if h in doc), None)
    if header is not None:
        body = textwrap.dedent(doc.split(header, 1)[1].strip("\n"))
        entries = re.split(r"\n(?=[A-Za-z_][\w, ]*:)", body)
        for entry in entries:
            match = re.match(r"\s*([A-Za-z_][\w, ]*):\s*(.*)", entry, re.S)
            if match:
                text = " ".join(match.group(2).split())
                for name in match.group(1).split(","):
                    described.setdefault(name.strip(), text)
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    for index, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        name = node.target.id
        following = body[index + 1] if index + 1 < len(body) else None
        if isinstance(following, ast.Expr) and isinstance(getattr(following, "value", None), ast.Constant) \
                and isinstance(following.value.value, str):
            described[name] = " ".join(following.value.value.split())
            continue
        comments, row = [], node.lineno - 2
        while row >= 0 and lines[row].strip().startswith("#:"):
            comments.insert(0, lines[row].strip()[2:].strip())
            row -= 1
        if comments:
            described[name] = " ".join(comments)
    for field in dataclasses.fields(cls):  # a field the source does not describe: its option's help
        if field.metadata.get("help"):
            described.setdefault(field.name, " ".join(str(field.metadata["help"]).split()))
    return described


def _type_name(annotation: Any) -> str:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", None) or str(annotation)
    return str(text).replace("typing.", "").replace("pathlib.", "")


def _default(field: dataclasses.Field) -> str:
    value = field_default(field)
    if value is MISSING_DEFAULT:
        return "required"
    if dataclasses.is_dataclass(value):
        return f"see `{type(value).__name__}`"
    return f"`{value!r}`"


def sections() -> list[tuple[str, type, Any]]:
    """``(section, config dataclass, default)`` of every stage and of every nested config they hold (``train.optim``:
    ``OptimConfig``), each nested one after its parent, in field order. ``default``: the instance the parent's field
    defaults to (its values are the defaults there: train's ``data.validation_fraction`` is 0.01), or None."""
    found: list[tuple[str, type, Any]] = []
    stages = set(STAGE_CONFIGS.values())

    def walk(section: str, cls: type, default: Any = None) -> None:
        found.append((section, cls, default))
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            hint = hints.get(field.name)
            # a stage's config inside another's (online.train) has its own section already
            if field.init and isinstance(hint, type) and dataclasses.is_dataclass(hint) and hint not in stages:
                value = field_default(field) if default is None else getattr(default, field.name)
                walk(f"{section}.{field.name}", hint, None if value is MISSING_DEFAULT else value)

    for section, cls in STAGE_CONFIGS.items():
        walk(section, cls)
    return found


def reference_markdown() -> str:
    """The whole reference page (Markdown)."""
    out = [
        "# Configuration reference",
        "",
        "Every setting of every stage, generated from the config dataclasses (`python -m pipelines.reference >",
        "docs/config-reference.md`; a test fails when this page and the code disagree). A field `F` of section `S`",
        "is `S.F` everywhere: `--set S.F=VALUE`, key `F` under `[S]` in a `--config` file or a preset, and the option",
        "of the stage's command in the option column (none: files, presets and `--set` only; a nested section's",
        "options belong to the command of its stage). Precedence, lowest first: the default below <",
        "`--preset` < `--config` < options given < `--set` (README, \"Config files, presets and overrides\").",
        "A field marked (runtime) never changes what its stage computes: a `train` resume or a rerun of `run` in",
        "the same work folder may change it.",
        "",
    ]
    for section, cls, instance in sections():
        hints = typing.get_type_hints(cls)
        described = field_descriptions(cls)
        bases = [base for base in cls.__mro__[1:] if dataclasses.is_dataclass(base)]
        extends = "".join(f" (extends `{base.__name__}` of `{base.__module__.replace('.', '/')}.py`)" for base in bases)
        out += [f"## `{section}`", "", f"Declared in `{cls.__module__.replace('.', '/')}.py`: `{cls.__name__}`{extends}.", "",
                "| field | option | type | default | description |", "|---|---|---|---|---|"]
        options = {spec.path: spec for spec in option_specs(cls)}
        for field in dataclasses.fields(cls):
            if not field.init:
                continue
            text = described.get(field.name, "").replace("|", "\\|")
            if field.metadata.get("runtime"):
                text += " (runtime)"
            kind = _type_name(hints.get(field.name, field.type)).replace("|", "\\|")
            default = (_default(field) if instance is None else f"`{getattr(instance, field.name)!r}`").replace("|", "\\|")
            spec = options.get(field.name)
            option = "" if spec is None else f"`{spec.argument}`" if spec.argument else ", ".join(
                f"`{decl}`" for decl in spec.decls)
            out.append(f"| `{field.name}` | {option} | `{kind}` | {default} | {text} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(reference_markdown(), end="")
