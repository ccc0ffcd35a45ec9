"""``dflash-stages inspect``: full config/provenance of runs, checkpoints and exports; --diff; --scan for NaN/Inf.

Runs are written by the trainer's Checkpointer for a small drafter of the real SmolLM2 target after one AdamW step
(so the optimizer state holds real tensors), and exported with the real exporter.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
import typer
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from dflash.drafter import DFlashConfig, DFlashDrafter
from dflash.serving.export import WEIGHTS_FILE, export_checkpoint
from dflash.training.state_files import load_state_tree, save_state_tree
from stages.forensics import inspect as inspect_stage
from stages.forensics.diff import compare, load_side
from stages.forensics.runs import describe
from stages.forensics.scan import scan_checkpoint


def _write_run(run: Path, target, *, block_size: int) -> Path:
    from dflash.training.checkpoint import (
        Checkpointer,
        capture_rng_state,
        collect_environment,
        write_run_json,
    )

    config = DFlashConfig.from_target_config(
        target.model.config, tokenizer=target.tokenizer, num_draft_layers=1, block_size=block_size
    )
    write_run_json(run, {"drafter": {"block_size": block_size, "num_draft_layers": 1}, "optim": {"lr": 6e-4}},
                   collect_environment())
    torch.manual_seed(block_size)
    drafter = DFlashDrafter(config)
    model = target.model
    drafter.attach_target(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    sum(p.square().sum() for p in drafter.parameters()).backward()
    optimizer.step()
    checkpointer = Checkpointer(run)
    try:
        snapshot = checkpointer.snapshot(
            step=2,
            model=drafter,
            optimizer=optimizer,
            trainer_state={"epoch": 0},
            rng_state=capture_rng_state(),
            drafter_config=config.to_dict(),
            target_info={**target.identity.to_dict(), "target_spec": "default", "weight_hashes": drafter.target_weight_hashes()},
        )
        checkpointer.save(snapshot)
    finally:
        checkpointer.close()
    return run


@pytest.fixture(scope="module")
def run_b8(tmp_path_factory, target) -> Path:
    return _write_run(tmp_path_factory.mktemp("run_b8"), target, block_size=8)


@pytest.fixture(scope="module")
def run_b16(tmp_path_factory, target) -> Path:
    return _write_run(tmp_path_factory.mktemp("run_b16"), target, block_size=16)


@pytest.fixture(scope="module")
def export_b8(run_b8, tmp_path_factory) -> Path:
    destination, _ = export_checkpoint(run_b8, tmp_path_factory.mktemp("exports") / "b8")
    return destination


@pytest.fixture(scope="module")
def cli():
    app = typer.Typer()
    app.callback()(lambda: None)
    inspect_stage.register(app)
    runner = CliRunner()

    def invoke(*args: str):
        return runner.invoke(app, ["inspect", *map(str, args)], env={"COLUMNS": "250"})

    return invoke


def test_run_shows_resolved_config_target_and_latest_checkpoint(run_b8, target, cli):
    result = cli(run_b8)
    assert result.exit_code == 0, result.output
    for expected in ("run.config.optim.lr", "run.latest", "step_00000002", "drafter.block_size", "drafter.target_layer_ids",
                     "target.content_hash", target.identity.content_hash, "trainer.step", "weights.parameters",
                     "weight names and shapes: ok"):
        assert expected in result.output, expected


def test_describe_kinds_and_facts(run_b8, export_b8, target):
    run = describe(run_b8)
    checkpoint = describe(run_b8 / "checkpoints" / "step_00000002")
    export = describe(export_b8)
    assert (run.kind, checkpoint.kind, export.kind) == ("run", "checkpoint", "export")
    assert run.facts["run.latest"] == "step_00000002"
    assert run.facts["drafter.block_size"] == checkpoint.facts["drafter.block_size"] == 8
    assert export.facts["serving.dflash_config.target_layer_ids"] == export.facts["drafter.target_layer_ids"]
    assert export.facts["target.content_hash"] == target.identity.content_hash
    assert export.facts["weights.dtypes"] == ["BF16"] and checkpoint.facts["weights.dtypes"] == ["F32"]
    assert export.checks == {"strict serving-format loader": "ok"}


def test_export_shows_serving_config_provenance_and_loader_verdict(export_b8, cli):
    result = cli(export_b8)
    assert result.exit_code == 0, result.output
    for expected in ("serving.architectures", "DFlashDraftModel", "serving.rope_parameters.rope_theta",
                     "provenance.files.model.safetensors.sha256", "provenance.source.step",
                     "strict serving-format loader: ok"):
        assert expected in result.output, expected


def test_a_broken_export_fails_the_loader_check(export_b8, tmp_path, cli):
    broken = tmp_path / "broken"
    shutil.copytree(export_b8, broken)
    (broken / "dflash_export.json").unlink()  # no hashes to trip over: the format check itself must fire
    tensors = load_file(str(broken / WEIGHTS_FILE))
    tensors["embed_tokens.weight"] = torch.zeros(2, 2, dtype=torch.bfloat16)
    save_file(tensors, str(broken / WEIGHTS_FILE))
    result = cli(broken)
    assert result.exit_code == 1
    assert "strict serving-format loader: FAILED" in result.output and "embed_tokens.weight" in result.output


def test_diff_of_a_checkpoint_and_its_export_is_empty(run_b8, export_b8, cli):
    result = cli(run_b8, "--diff", export_b8)
    assert result.exit_code == 0, result.output
    assert "no config differences" in result.output


def test_diff_names_the_differing_keys(run_b8, run_b16, cli):
    comparison = compare(load_side(run_b8), load_side(run_b16))
    differing = {key: (left, right) for key, left, right in comparison.config}
    assert differing["config.drafter.block_size"] == (8, 16)
    assert "drafter.block_size" not in differing  # listed once, under the train config
    assert "drafter.hidden_size" not in differing and comparison.skipped == []
    result = cli(run_b8, "--diff", run_b16)  # the alias of `dflash-stages diff`: each change once
    assert result.exit_code == 1
    assert "config.drafter.block_size" in result.output  # the train config's
    assert not re.search(r"(?<!config\.)drafter\.block_size", result.output)  # not again as the drafter config's


def test_scan_of_a_clean_run_counts_model_and_optimizer_tensors(run_b8, cli):
    checkpoint = run_b8 / "checkpoints" / "step_00000002"
    num_model = len(load_file(str(checkpoint / WEIGHTS_FILE)))
    scan = scan_checkpoint(checkpoint)
    assert scan.clean and scan.tensors > 2 * num_model  # AdamW: exp_avg and exp_avg_sq per parameter, plus steps
    result = cli(run_b8, "--scan")
    assert result.exit_code == 0, result.output
    assert f"scanned {scan.tensors} tensors" in result.output and "all clean" in result.output


def test_scan_names_tensors_holding_nan_or_inf(run_b8, tmp_path, cli):
    checkpoint = tmp_path / "step_00000002"
    shutil.copytree(run_b8 / "checkpoints" / "step_00000002", checkpoint)
    tensors = load_file(str(checkpoint / WEIGHTS_FILE))
    tensors["layers.0.mlp.up_proj.weight"][1, :3] = float("nan")
    save_file(tensors, str(checkpoint / WEIGHTS_FILE))
    optimizer = load_state_tree(checkpoint / "optimizer.safetensors")
    optimizer["state"][0]["exp_avg"].view(-1)[0] = float("inf")
    save_state_tree(optimizer, checkpoint / "optimizer.safetensors")

    findings = scan_checkpoint(checkpoint).findings
    assert {(finding.stored_as, finding.nan, finding.inf) for finding in findings} == {
        ("layers.0.mlp.up_proj.weight", 3, 0),
        ("state.0.exp_avg", 0, 1),
    }
    result = cli(checkpoint, "--scan")
    assert result.exit_code == 1
    assert "layers.0.mlp.up_proj.weight" in result.output and "state.0.exp_avg" in result.output
    assert "2 bad tensors" in result.output


def test_a_folder_that_is_no_artefact_is_refused(tmp_path, cli):
    result = cli(tmp_path)
    assert result.exit_code == 2
    assert "is not a run" in result.output


def _key_cells(output: str) -> list[str]:
    """The first cell of every table body line (empty on lines where only a value folds on)."""
    return [line.split("│")[1].strip() for line in output.splitlines() if line.startswith("│")]


def test_long_keys_stay_whole_on_one_line(run_b8, run_b16):
    """Keys are never split over two rows (``..._samples`` then ``_train`` read like a second key); values fold.

    Rich used to share a narrow width evenly between the key and value columns, folding any key longer than half
    of it; 60 columns does that to this checkpoint's longest keys (a trainer's run has keys of 60+ characters)."""
    columns = "60"
    app = typer.Typer()
    app.callback()(lambda: None)
    inspect_stage.register(app)
    runner = CliRunner()
    checkpoint = run_b8 / "checkpoints" / "step_00000002"
    facts = describe(checkpoint).facts
    result = runner.invoke(app, ["inspect", str(checkpoint)], env={"COLUMNS": columns})
    assert result.exit_code == 0, result.output
    assert "…" not in result.output  # the per-tensor table folds its names too
    result = runner.invoke(app, ["inspect", str(checkpoint), "--no-tensors"], env={"COLUMNS": columns})
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.output.splitlines()) <= int(columns)
    cells = [cell for cell in _key_cells(result.output) if cell and cell != "key"]
    assert sorted(cells) == sorted(facts)  # each key once, whole, on its own row
    assert max(len(key) for key in facts) > (int(columns) - 7) // 2  # long enough to have been folded before
    result = runner.invoke(app, ["inspect", str(run_b8), "--diff", str(run_b16)], env={"COLUMNS": columns})
    comparison = compare(load_side(run_b8), load_side(run_b16))
    differing = [key for key, _, _ in comparison.config + comparison.environment]
    assert sorted(cell for cell in _key_cells(result.output) if cell and cell != "key") == sorted(differing)


def test_a_pipeline_work_folder_stands_for_its_run(run_b8, tmp_path, cli):
    """``dflash-stages run`` writes WORKDIR/run beside WORKDIR/pipeline.json: inspect, scan and diff take the work
    folder for its run, as report does, and say which run they read."""
    import json

    from stages.forensics.scan import checkpoints_to_scan

    workdir = tmp_path / "dflash-work"
    shutil.copytree(run_b8, workdir / "run")
    (workdir / "pipeline.json").write_text(json.dumps({"tau": 1.25}) + "\n")
    (workdir / "eval").mkdir()
    (workdir / "eval" / "final.json").write_text(json.dumps({"tau": 1.25}) + "\n")
    result = cli(workdir, "--no-tensors")
    assert result.exit_code == 0, result.output
    assert f"what: run {workdir / 'run'}" in result.output and "run.latest" in result.output
    assert f"evaluated tau: 1.250 ({workdir / 'eval' / 'final.json'})" in result.output
    assert describe(workdir).facts == describe(workdir / "run").facts
    assert checkpoints_to_scan(workdir) == [workdir / "run" / "checkpoints" / "step_00000002"]
    assert load_side(workdir).path == workdir / "run"
    (workdir / "run" / "eval").mkdir()  # `evaluate --drafter WORKDIR/run` writes the run's own report: both named
    (workdir / "run" / "eval" / "final.json").write_text(json.dumps({"tau": 1.5}) + "\n")
    result = cli(workdir, "--no-tensors")
    assert (f"evaluated tau: 1.250 ({workdir / 'eval' / 'final.json'}); also 1.500 in "
            f"{workdir / 'run' / 'eval' / 'final.json'} (evaluate --drafter {workdir / 'run'})"
            ) in " ".join(result.output.split())  # the line folds at the terminal's width
    (workdir / "pipeline.json").unlink()  # a folder holding a run is not a run
    result = cli(workdir)
    assert result.exit_code == 2 and "or pipeline work folder (pipeline.json and run/)" in result.output
