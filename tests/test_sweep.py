"""``dflash-stages sweep``: one train run per combination of ``--grid`` values over one tiny real cache, compared."""

from __future__ import annotations

import json

import pytest
from train_helpers import build_tiny_cache

from dflash.errors import ConfigError
from stages.sweep import parse_grid, plan_sweep

TINY = [
    "drafter.num_draft_layers=1", "drafter.block_size=4", "drafter.max_anchors_per_document=2",
    "data.token_budget=192", "data.num_buckets=2", "data.validation_fraction=0.2", "max_validation_batches=1",
    "max_steps=2", "telemetry.log_every=1", "device=cpu", "telemetry.progress=false", "data.prefetch_batches=2",
    "min_train_samples=1",  # a tiny cache tests the mechanics, not a useful training set
]  # fmt: skip


def test_parse_grid_types_values_by_field():
    values = parse_grid(["lr=3e-4,6e-4", "gamma=4,7", "max_steps=10", "betas=0.9:0.95", "mask_token_id=none"])
    assert values == {"lr": [3e-4, 6e-4], "gamma": [4.0, 7.0], "max_steps": [10], "betas": [[0.9, 0.95]],
                      "mask_token_id": [None]}
    runs = plan_sweep("cache", "out", values)
    assert [r.name for r in runs] == ["lr=0.0003_gamma=4.0", "lr=0.0003_gamma=7.0", "lr=0.0006_gamma=4.0",
                                      "lr=0.0006_gamma=7.0"]
    assert all(r.config.max_steps == 10 and r.config.optim.betas == (0.9, 0.95) for r in runs)
    assert runs[1].config.optim.lr == 3e-4 and runs[1].config.drafter.gamma == 7.0
    # A nested config's field by its dotted path too; the run folders keep the key as written.
    dotted = parse_grid(["optim.lr=3e-4,6e-4", "train.optim.warmup_ratio=0.1"])
    assert dotted == {"optim.lr": [3e-4, 6e-4], "optim.warmup_ratio": [0.1]}
    assert [(r.name, r.config.optim.lr, r.config.optim.warmup_ratio) for r in plan_sweep("cache", "out", dotted)] == [
        ("optim.lr=0.0003", 3e-4, 0.1), ("optim.lr=0.0006", 6e-4, 0.1)]
    assert runs[3].config.output.endswith("lr=0.0006_gamma=7.0")
    with pytest.raises(ConfigError, match="not a train config field; did you mean lr"):
        parse_grid(["lrr=1e-3"])
    with pytest.raises(ConfigError, match="max_steps"):
        parse_grid(["max_steps=ten"])
    with pytest.raises(ConfigError, match="sweep run lr=-1.0"):
        plan_sweep("cache", "out", parse_grid(["lr=-1,1e-3"]))
    # The values as one JSON array, --set's syntax: the same grid as the V1,V2 form, lists without ':'.
    assert parse_grid(["lr=[3e-4, 6e-4]", "boundaries=[[256, 512], [1024]]"]) == parse_grid(
        ["lr=3e-4,6e-4", "boundaries=256:512,1024"])
    for item, message in [("lr=[\"fast\"]", 'cannot read "fast" as float'),
                          ("boundaries=[[256, \"x\"]]", 'cannot read \\[256, "x"\\] as tuple'),
                          ("lr=[1,", "invalid JSON array"), ("lr=[]", "non-empty JSON array")]:
        with pytest.raises(ConfigError, match=message):
            parse_grid([item])


def test_sweep_trains_every_combination_and_compares(target, tmp_path):
    from typer.testing import CliRunner

    from stages.cli import _register_all, app

    cache = build_tiny_cache(tmp_path / "cache.zarr", target, num_samples=12, num_shards=1)
    _register_all()
    args = ["sweep", "--cache", str(cache), "--output", str(tmp_path / "sweep"), "--grid", "lr=1e-3,3e-3"]
    for option in TINY:  # fixed for every run: --set train.FIELD=VALUE (or FIELD=VALUE) as in every stage
        args += ["--set", option if option.startswith("max_") else "train." + option]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert [run["name"] for run in report["runs"]] == ["lr=0.001", "lr=0.003"]
    for run in report["runs"]:
        assert run["error"] is None
        assert run["summary"]["step"] == 2 and run["summary"]["val_loss"] > 0
        assert (tmp_path / "sweep" / run["name"] / "latest").read_text().strip() == "step_00000002"
    assert "lr=0.001" in result.output and "val loss" in result.output
    runs = {run["name"]: run for run in report["runs"]}
    config = json.loads((tmp_path / "sweep" / "lr=0.003" / "run.json").read_text())["config"]
    assert config["optim"]["lr"] == 3e-3 and config["max_steps"] == 2 and config["drafter"]["num_draft_layers"] == 1
    assert runs["lr=0.001"]["summary"]["train_loss"] != runs["lr=0.003"]["summary"]["train_loss"]


def test_interrupted_run_stops_the_sweep_and_is_marked(monkeypatch, tmp_path):
    """A run stopped by SIGTERM / Ctrl-C (checkpoint saved, ``stopped_by_signal``) starts no further run and is
    marked interrupted, so the sweep command exits 130 instead of reporting a finished comparison."""
    import stages.sweep as sweep

    runs = plan_sweep("cache", str(tmp_path), parse_grid(["lr=1e-4,2e-4,3e-4"]))
    started = []

    def fake_training(config):
        started.append(config.output)
        return {"stopped_by_signal": len(started) == 2, "step": 5}

    monkeypatch.setattr(sweep, "run_training", fake_training)
    monkeypatch.setattr(sweep, "summarize_run", lambda output: {})
    sweep.run_sweep(runs)
    assert len(started) == 2  # the third combination never started
    assert [r.interrupted for r in runs] == [False, True, False]
    assert runs[0].error is None and "interrupted at step 5" in runs[1].error and runs[2].error is None


def test_sweep_settings_from_a_config_file_and_preset_and_errors_before_any_run(tmp_path, monkeypatch, capsys):
    """A TOML file's [sweep] grid and [train] fixed fields, under options and --set; the preset's train section
    fixes fields for every run; each run's whole TrainConfig is checked before anything is written."""
    from tests.cli_helpers import main_in_process, main_in_process_out

    (tmp_path / "s.toml").write_text('[sweep]\ncache = "c"\ngrid = {lr = [1e-3, 2e-3], gamma = [4.0]}\n'
                                     '[train]\nmax_steps = 7\n[train.drafter]\nblock_size = 8\n')
    code, out, err = main_in_process_out(monkeypatch, capsys, "sweep", "--config", str(tmp_path / "s.toml"),
                                         "-o", str(tmp_path / "sw"), "--set", "drafter.block_size=4", "--print-config")
    assert code == 0, err
    printed = json.loads(out)
    assert printed["sweep"]["grid"] == {"lr": [1e-3, 2e-3], "gamma": [4.0]}
    assert printed["train"] == {"max_steps": 7, "drafter": {"block_size": 4}}
    runs = plan_sweep("c", tmp_path / "sw", printed["sweep"]["grid"], fixed=printed["train"])
    assert [(r.name, r.config.drafter.gamma, r.config.drafter.block_size) for r in runs] == [("lr=0.001", 4.0, 4), ("lr=0.002", 4.0, 4)]
    code, out, err = main_in_process_out(monkeypatch, capsys, "sweep", "--cache", "c", "--grid", "lr=1e-3,2e-3",
                                         "--preset", "cpu-small", "--print-config")
    assert code == 0, err
    assert json.loads(out)["train"]["drafter"]["num_draft_layers"] == 1  # the cpu-small preset's train section
    for args, needle in [
        (["--set", "optim.lr=3e-4,6e-4"], "sweep several with --grid optim.lr=3e-4,6e-4"),
        (["--grid", "lr=-1,1e-3"], "sweep run lr=-1.0"),
        (["--set", "train.cache=x"], "give it as sweep.cache"),
        (["--set", "sweep.run_gpu=[0]"], "did you mean sweep.run_gpus?"),
        (["--grid", "lr=1e-3,2e-3"], "no cache at c"),  # checked before any run starts: nothing written
        (["--grid", "lr=1e-3,0.001"], "two runs would share the folder"),
        (["--grid", "lr=1e-3,2e-3", "--set", "optim.lr=5e-4"], "both swept (sweep.grid) and fixed (--set optim.lr=5e-4)"),
        (["--run-gpus", "0,0"], "distinct GPU ids"),
    ]:
        code, err = main_in_process(monkeypatch, capsys, "sweep", "--cache", "c", "-o", str(tmp_path / "never"), *args)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and needle in lines[0], (args, err)
    assert not (tmp_path / "never").exists()


def test_list_of_str_fields_are_swept_as_strings():
    from stages.sweep import parse_grid

    assert parse_grid(["report_to=tensorboard:wandb,none"]) == {"report_to": [["tensorboard", "wandb"], ["none"]]}
    assert parse_grid(["betas=0.9:0.95"]) == {"betas": [[0.9, 0.95]]}
    assert parse_grid(["target_layer_ids=1:3"]) == {"target_layer_ids": [[1, 3]]}
