"""A command's options derived from its config dataclass (``stages.config.options``): the minimal declaration
(``metadata={"help": ...}``) is an option, nested configs flatten to their leaves, and an option given is the only
thing that reaches the command as given."""

from __future__ import annotations

from dataclasses import dataclass, field

import typer
from typer.testing import CliRunner

from stages.config.options import CommandSettings, config_options, option_specs, setting


@dataclass
class _Inner:
    lr: float = field(default=1e-3, metadata={"help": "Peak learning rate."})
    eps: float = 1e-8  # no help: config files and --set only


@dataclass
class _Config:
    output: str = setting(help="Where it goes.", short="-o")
    max_length: int | None = field(default=None, metadata={"help": "Longest row."})
    progress: bool = field(default=True, metadata={"help": "Show progress."})
    force: bool = setting(False, help="Overwrite.", option="--force")
    gpus: list[int] | None = field(default=None, metadata={"help": "GPU ids."})
    boundaries: tuple[int, ...] | None = setting(None, help="Edges.", option="--bucket-boundaries")
    extra: dict = setting(default_factory=dict, help="Free-form.", cli=False)
    inner: _Inner = field(default_factory=lambda: _Inner(lr=2e-3))


def test_specs_follow_the_field_metadata():
    specs = {spec.path: spec for spec in option_specs(_Config)}
    assert list(specs) == ["output", "max_length", "progress", "force", "gpus", "boundaries", "inner.lr"]
    assert specs["output"].decls == ("--output", "-o")
    assert specs["max_length"].decls == ("--max-length",)  # the minimal form: --field-name
    assert specs["progress"].decls == ("--progress/--no-progress",)  # a bool: a switch
    assert specs["force"].decls == ("--force",)  # a plain flag where its option says so
    assert specs["boundaries"].decls == ("--bucket-boundaries",)
    assert specs["inner.lr"].decls == ("--lr",) and specs["inner.lr"].shown_default == "0.002"  # the owner's default
    assert specs["progress"].shown_default == "true" and specs["max_length"].shown_default is None


def _app(seen: list) -> typer.Typer:
    app = typer.Typer()

    @app.command()
    @config_options(_Config, "demo")
    def demo(settings: CommandSettings, name: str = typer.Argument(...)) -> None:
        """Demo."""
        seen.append((name, settings))

    return app


def test_a_derived_command_hands_over_only_the_options_given_parsed():
    seen: list = []
    result = CliRunner().invoke(_app(seen), ["x", "-o", "out", "--no-progress", "--gpus", "0,2",
                                             "--bucket-boundaries", "8,16", "--lr", "0.5", "--set", "demo.force=true",
                                             "--print-config"])
    assert result.exit_code == 0, result.output
    name, settings = seen[0]
    assert name == "x"
    assert settings.given == {"output": "out", "progress": False, "gpus": [0, 2], "boundaries": [8, 16],
                              "inner.lr": 0.5}
    assert settings.sets == ["demo.force=true"] and settings.print_config and settings.config_file is None
    assert settings.spellings["inner.lr"] == "--lr" and settings.spellings["boundaries"] == "--bucket-boundaries"


def test_a_derived_command_refuses_a_bad_list_and_shows_defaults():
    result = CliRunner().invoke(_app([]), ["x", "--gpus", "0,a"])
    assert result.exit_code == 2 and "comma-separated integers" in result.output
    help_text = CliRunner().invoke(_app([]), ["--help"], env={"COLUMNS": "200"}).output
    assert "--max-length" in help_text and "--eps" not in help_text and "--extra" not in help_text
    assert "0.002" in help_text  # [default: ...] from the dataclass
