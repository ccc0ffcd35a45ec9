"""Each setting is declared once, in its stage's config dataclass; the CLI options cannot drift from it: an option named after a field defaults to the field's default (train's options default to ``None`` so a
saved run can fill them, and show the field's default in ``--help``), and ``--print-config`` reaches every field."""

from __future__ import annotations

import dataclasses
import json

import pytest
import typer

from stages.cli import _register_all, app

#: command -> (module, config dataclass).
CONFIGS = {
    "prepare": ("stages.prepare", "PrepareConfig"),
    "generate": ("stages.generate", "GenerateConfig"),
    "extract": ("stages.extract.command", "ExtractConfig"),
    "evaluate": ("stages.evaluate", "EvaluateConfig"),
    "export": ("stages.export", "ExportConfig"),
    "sweep": ("stages.sweep", "SweepConfig"),
    "train": ("stages.train.config", "TrainConfig"),
}
#: Options whose text form the command parses into the field's type.
PARSED = {("generate", "template_kwargs"): json.loads}


def _field_default(field: dataclasses.Field):
    from stages.config.check import MISSING_DEFAULT, field_default

    value = field_default(field)
    return None if value is MISSING_DEFAULT else value


#: Commands whose options are derived from their config dataclass (``stages.config.options``).
DERIVED = set(CONFIGS)


@pytest.mark.parametrize("command", sorted(CONFIGS))
def test_options_default_to_their_fields_defaults(command):
    import importlib

    from stages.config.options import option_specs

    _register_all()
    module, name = CONFIGS[command]
    cls = getattr(importlib.import_module(module), name)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    specs = {spec.name: spec for spec in option_specs(cls)}
    params = typer.main.get_command(app).commands[command].params
    checked = 0
    for param in params:
        if command in DERIVED:  # None on the command line; the field's default shown in --help
            if param.name not in specs:
                continue
            assert param.default is None, param.name
            assert param.show_default == (specs[param.name].shown_default or False), param.name
            assert param.opts[0] == (param.name if specs[param.name].argument else specs[param.name].spelling), param.name
        else:
            field_name = param.name
            if field_name not in fields:
                continue
            default = _field_default(fields[field_name])
            value = PARSED.get((command, field_name), lambda v: v)(param.default)
            empty = (None, (), [], {})  # "nothing given" spelled by click or by the field
            assert value == default or (value in empty and default in empty), (command, param.name, value, default)
        checked += 1
    assert checked >= min(5, len(fields))


@pytest.mark.parametrize("command", ["prepare", "generate", "extract", "evaluate", "export"])
def test_print_config_reaches_every_field(command, tmp_path, monkeypatch, capsys):
    import importlib

    from tests.cli_helpers import main_in_process_out
    from tests.test_config_resolve import _args

    module, name = CONFIGS[command]
    fields = {f.name for f in dataclasses.fields(getattr(importlib.import_module(module), name)) if f.init}
    args = _args(command, tmp_path)
    code, out, err = main_in_process_out(monkeypatch, capsys, command, *args, "--print-config")
    assert code == 0, err
    assert set(json.loads(out)[command]) == fields


def test_the_configuration_reference_is_generated_from_the_declarations():
    """docs/config-reference.md lists every field of every stage with its type, default and description, exactly as
    ``python -m stages.config.reference`` writes it from the config dataclasses."""
    from pathlib import Path

    from stages.config.reference import field_descriptions, reference_markdown, sections

    page = Path(__file__).resolve().parents[1] / "docs" / "config-reference.md"
    assert page.read_text() == reference_markdown(), "regenerate: python -m stages.config.reference > docs/config-reference.md"
    for section, cls, _ in sections():  # every field is described in its declaration, nested configs' too
        undescribed = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in field_descriptions(cls)]
        assert not undescribed, (section, undescribed)
