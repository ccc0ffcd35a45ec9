"""A command's options, derived from its config dataclass: each setting is declared once, in its field.

A field becomes an option when its metadata has a ``help`` (``field(default=..., metadata={"help": "..."})``, or
:func:`setting`, which writes that metadata); a field without one is set in a config file or with ``--set`` only.
Metadata keys:

``help``
    The option's help text (the default is shown from the field's default: never restate it).
``option``
    The option's spelling where it is not ``--`` + the field name (``"--bucket-boundaries"``); a bool field is a
    ``--x/--no-x`` switch unless its ``option`` has no slash (a plain flag: ``"--allow-config-change"``).
``short``
    A short flag (``"-o"``).
``parse``
    A callable turning the option's text into the field's value, for a type the command line cannot hold as is;
    lists (``list[int]``, ``tuple[float, ...]``, ``list[str]``) are comma-separated without one.
``argument``
    A positional argument (its metavar, ``"CKPT"``) instead of an option.
``choices``
    ``True`` for a ``Literal`` field: the option lists its choices and refuses others (else the dataclass checks).
``repeat``
    The option is given once per value (``--grid a=1,2 --grid b=3``); ``parse`` gets the list of them.
``cli``
    ``False``: not an option even with a help text.
``runtime``
    ``True``: the field never changes what the stage computes (how often it reports, where its processes run, its
    lock): a resume (``train``) or a rerun of ``run`` in the same work folder may change it
    (``stages.config.check.runtime_paths``).

A field holding a nested config dataclass (``TrainConfig.optim``) is flattened to its leaves: ``optim.lr`` is
``--lr`` (the leaf's own spelling). :func:`config_options` turns a command function into one whose parameters are
those options (each defaulting to None, so an option given is one that is not None and the resolver fills the rest
from the layers below it), the four shared options (``--config``, ``--preset``, ``--set``, ``--print-config``) and
the function's own parameters; typer reads the result's ``__signature__``.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import enum
import functools
import inspect
import types
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Any

from stages.config.check import MISSING_DEFAULT, field_default

__all__ = ["CommandSettings", "OptionSpec", "config_options", "option_specs", "setting"]


def setting(default: Any = dataclasses.MISSING, *, help: str, option: str | None = None,  # noqa: A002
            short: str | None = None, parse: Callable[[Any], Any] | None = None, repeat: bool = False,
            argument: str | None = None, choices: bool = False, cli: bool = True, runtime: bool = False,
            default_factory: Any = dataclasses.MISSING,
            **kwargs: Any) -> Any:
    """A config dataclass field with its option's declaration in its metadata (see the module docstring):
    ``lr: float = setting(6e-4, help="Peak learning rate.", option="--lr")``. ``kwargs`` go to
    :func:`dataclasses.field`."""
    metadata: dict[str, Any] = {"help": help}
    for key, value in (("option", option), ("short", short), ("parse", parse), ("argument", argument)):
        if value is not None:
            metadata[key] = value
    if repeat:
        metadata["repeat"] = True
    if choices:
        metadata["choices"] = True
    if not cli:
        metadata["cli"] = False
    if runtime:
        metadata["runtime"] = True
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata, **kwargs)
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


@dataclasses.dataclass(frozen=True)
class OptionSpec:
    """One derived option: the field's dotted ``path`` (``optim.lr``), the command parameter's ``name`` (the
    field's own name, or its path with ``__`` for dots where two leaves share a name), its spellings, the
    annotation typer sees, its help and shown default, and the parser of its text."""

    path: str
    name: str
    decls: tuple[str, ...]
    annotation: Any
    help: str
    shown_default: str | None
    parse: Callable[[Any], Any] | None
    argument: str | None = None

    @property
    def spelling(self) -> str:
        """The option as messages name it (``--lr``; a switch by its first form; an argument by its metavar)."""
        return self.argument.rstrip(".") if self.argument else self.decls[0].split("/")[0]


def _strip_optional(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _comma_list(item: Callable[[str], Any], kind: str) -> Callable[[str], Any]:
    def parse(text: str) -> list[Any] | None:
        import typer

        if text == "":
            return None
        try:
            return [item(part.strip()) for part in text.split(",") if part.strip()]
        except ValueError:
            raise typer.BadParameter(f"expected comma-separated {kind}, got {text!r}") from None

    return parse


def _cli_type(hint: Any) -> tuple[Any, Callable[[Any], Any] | None]:
    """The option's annotation for typer and the parser of its value, from the field's type hint."""
    hint = _strip_optional(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (list, tuple, collections.abc.Sequence):
        item = _strip_optional(args[0]) if args else str
        if item is int:
            return str, _comma_list(int, "integers")
        if item is float:
            return str, _comma_list(float, "numbers")
        return str, _comma_list(str, "names")
    if hint in (bool, int, float):
        return hint, None
    return str, None  # str, Path, Literal choices (the dataclass checks them) and anything else: the text


def _enum_value(member: Any) -> Any:
    return member.value


def _shown(value: Any) -> str | None:
    if value is None or value is MISSING_DEFAULT:
        return None
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return ",".join(str(item) for item in value) or None
    return str(value)


def option_specs(cls: type, *, prefix: str = "", defaults: Any = None) -> list[OptionSpec]:
    """The options of ``cls``'s fields that have a ``help`` (nested config dataclasses flattened to their leaves),
    in field order. ``defaults``: the instance whose values are shown as defaults (a nested field's own default
    instance: train's ``data.validation_fraction`` is 0.01, not the loader's 0.0)."""
    hints = typing.get_type_hints(cls)
    specs: list[OptionSpec] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        hint = _strip_optional(hints.get(f.name, f.type))
        default = getattr(defaults, f.name) if defaults is not None else field_default(f)
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            if f.metadata.get("cli", True):
                specs += option_specs(hint, prefix=f"{prefix}{f.name}.",
                                      defaults=default if dataclasses.is_dataclass(default) else None)
            continue
        if "help" not in f.metadata or not f.metadata.get("cli", True):
            continue
        annotation, parse = (list[str], None) if f.metadata.get("repeat") else _cli_type(hint)
        if f.metadata.get("choices"):  # typer lists an Enum's members and refuses other values
            annotation = enum.Enum(f"{cls.__name__}_{f.name}", {str(v): str(v) for v in typing.get_args(hint)},
                                   type=str)
            parse = _enum_value
        parse = f.metadata.get("parse", parse)
        option = f.metadata.get("option", "--" + f.name.replace("_", "-"))
        if annotation is bool and "option" not in f.metadata:
            option = f"{option}/--no-{option[2:]}"
        decls = (option, f.metadata["short"]) if "short" in f.metadata else (option,)
        specs.append(OptionSpec(path=f"{prefix}{f.name}", name=f"{prefix}{f.name}".replace(".", "__"), decls=decls,
                                annotation=annotation, help=f.metadata["help"], shown_default=_shown(default),
                                parse=parse, argument=f.metadata.get("argument")))
    if prefix:
        return specs
    # The command's parameter: the field's own name (``lr`` for optim.lr) where no other leaf has it.
    leaves = [spec.path.rsplit(".", 1)[-1] for spec in specs]
    return [dataclasses.replace(spec, name=leaf) if leaves.count(leaf) == 1 else spec
            for spec, leaf in zip(specs, leaves, strict=True)]


@dataclasses.dataclass
class CommandSettings:
    """What a derived command received: ``given`` (dotted field path -> value of each option given, parsed), the
    shared options, and ``spellings`` (path -> the option's spelling, for messages naming a source)."""

    given: dict[str, Any]
    config_file: str | None
    preset: str | None
    sets: list[str]
    print_config: bool
    spellings: dict[str, str]


def _shared(section: str, shared_help: Mapping[str, str]) -> list[inspect.Parameter]:
    import typer

    options = {
        "config_file": (str | None, typer.Option(
            None, "--config", help=shared_help.get("config") or "Settings in a .toml, .yaml or .json file: this "
            "stage's fields, or a section named after the stage. Options given override it.")),
        "preset": (str | None, typer.Option(
            None, "--preset", help=shared_help.get("preset") or "A pipeline preset of `run` (cpu-small, "
            "h200-smollm2) or a .json file of sections: its section for this stage (and its target), under the "
            "config file.")),
        "sets": (list[str], typer.Option(
            [], "--set", help=shared_help.get("set") or f"{section}.FIELD=VALUE or FIELD=VALUE (JSON value, else a "
            "string), over everything else. Repeatable.")),
        "print_config": (bool, typer.Option(
            False, "--print-config", help=shared_help.get("print_config") or "Print the resolved config as JSON "
            "(which --config reads back) and exit without doing anything.")),
    }
    return [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
            for name, (annotation, default) in options.items()]


def config_options(cls: type, section: str, *, include: Collection[str] | None = None,
                   shared_help: Mapping[str, str] | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a command function whose parameter ``settings`` receives a :class:`CommandSettings`: the result
    takes ``cls``'s options (:func:`option_specs`; only the dotted paths in ``include`` where given), the four
    shared options (``shared_help``: the help of ``config``, ``preset``, ``set`` or ``print_config`` where the
    command's differs) and the function's other parameters (command-only ones, declared with ``typer.Option`` as
    usual), for ``app.command(...)``."""
    import typer

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        specs = [s for s in option_specs(cls) if include is None or s.path in include]
        own = [p for p in inspect.signature(function).parameters.values() if p.name != "settings"]
        own_hints = typing.get_type_hints(function)
        derived = [
            inspect.Parameter(spec.name, inspect.Parameter.KEYWORD_ONLY, annotation=spec.annotation | None,
                              default=typer.Argument(None, metavar=spec.argument, help=spec.help,
                                                     show_default=spec.shown_default or False)
                              if spec.argument else typer.Option(None, *spec.decls, help=spec.help,
                                                                 show_default=spec.shown_default or False))
            for spec in specs
        ]
        parameters = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + derived + _shared(
            section, shared_help or {})
        names = [p.name for p in parameters]
        if len(set(names)) != len(names):
            raise TypeError(f"{function.__name__}: two parameters share a name: {names}")

        @functools.wraps(function)
        def command(**values: Any) -> Any:
            given = {}
            for spec in specs:
                value = values.pop(spec.name)
                if value is not None and value != []:  # a repeatable option not given: typer's empty list
                    try:
                        given[spec.path] = spec.parse(value) if spec.parse is not None else value
                    except typer.BadParameter as error:  # named by its option, as click names its own refusals
                        error.param_hint = spec.spelling
                        raise
            settings = CommandSettings(
                given=given, config_file=values.pop("config_file"), preset=values.pop("preset"),
                sets=list(values.pop("sets")), print_config=bool(values.pop("print_config")),
                spellings={spec.path: spec.spelling for spec in specs})
            return function(settings=settings, **values)

        del command.__wrapped__  # typer reads __signature__ and __annotations__, not the wrapped function's
        command.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        command.__annotations__ = {**{p.name: own_hints.get(p.name, p.annotation) for p in own},
                                   **{p.name: p.annotation for p in parameters[len(own):]}}
        return command

    return decorate

