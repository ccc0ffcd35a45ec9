"""Each setting is declared once, in its stage's config dataclass; the CLI options cannot drift from it: every
command's options are derived from its fields (``stages.config.options``), default to ``None`` (so a preset, a file
or a saved run can fill them) and show the field's default in ``--help``, and ``--print-config`` reaches every
field."""

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
    "online": ("pipelines.online", "OnlineConfig"),
}
#: Parameters a command declares itself: the shared ones, and options that are no setting (evaluate's --json).
OWN = {"config_file", "preset", "sets", "print_config", "as_json"}


@pytest.mark.parametrize("command", sorted(CONFIGS))
def test_options_are_derived_from_their_fields(command):
    import importlib

    from stages.config.options import option_specs

    _register_all()
    module, name = CONFIGS[command]
    specs = {spec.name: spec for spec in option_specs(getattr(importlib.import_module(module), name))}
    params = typer.main.get_command(app).commands[command].params
    for param in params:
        if param.name in OWN or param.name == "help":
            continue
        spec = specs[param.name]  # every other parameter is a field's
        assert param.default is None, param.name  # None on the command line; the field's default shown in --help
        assert param.show_default == (spec.shown_default or False), param.name
        assert param.opts[0] == (param.name if spec.argument else spec.spelling), param.name
    assert len([p for p in params if p.name in specs]) >= 5


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
    ``python -m pipelines.reference`` writes it from the config dataclasses."""
    from pathlib import Path

    from pipelines.reference import field_descriptions, reference_markdown, sections

    page = Path(__file__).resolve().parents[1] / "docs" / "config-reference.md"
    assert page.read_text() == reference_markdown(), "regenerate: python -m pipelines.reference > docs/config-reference.md"
    for section, cls, _ in sections():  # every field is described in its declaration, nested configs' too
        undescribed = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in field_descriptions(cls)]
        assert not undescribed, (section, undescribed)


def test_the_section_lists_name_the_same_sections():
    """The sections a config file may hold, the sections the reference documents, and the pipeline's sections (in
    run order, each with its check) are kept in three places for the three layers: they must agree."""
    from pipelines.offline import SECTIONS
    from pipelines.reference import STAGE_CONFIGS
    from stages.config.check import CONFIG_SECTIONS
    from stages.config.presets import PIPELINE_SECTIONS

    assert set(STAGE_CONFIGS) == set(CONFIG_SECTIONS)
    assert set(SECTIONS) == set(PIPELINE_SECTIONS) <= set(CONFIG_SECTIONS)
