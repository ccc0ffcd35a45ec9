"""Run forensics on runs made by the real ``train`` on CPU (tiny real cache, tests/train_helpers.py): ``scan`` of
every checkpoint with optimizer state named by parameter, ``diff`` of config/environment/performance, ``report``.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import typer
from train_helpers import build_tiny_cache, tiny_config
from typer.testing import CliRunner

from dflash.io.weights import open_safetensors
from dflash.training import checkpoint as checkpoint_module
from dflash.training.checkpoint import PARAM_NAMES_KEY
from dflash.training.state_files import load_state_tree, save_state_tree
from stages.forensics import diff as diff_stage
from stages.forensics import inspect as inspect_stage
from stages.forensics import runs
from stages.forensics import scan as scan_stage
from stages.train.launch import run_training


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory, target):
    return build_tiny_cache(tmp_path_factory.mktemp("cache") / "tiny.zarr", target)


@pytest.fixture(scope="module")
def code_repo(tmp_path_factory):
    """A real git checkout standing in for the code (``dflash.training.checkpoint.CODE_DIR``), committed and clean."""
    repo = tmp_path_factory.mktemp("code")
    (repo / "trainer.py").write_text("STEP = 1\n")
    for command in (["init", "-q"], ["add", "trainer.py"],
                    ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "code"]):
        subprocess.run(["git", *command], cwd=repo, check=True)
    return repo


def _train(config, code_repo, env: dict[str, str | None] | None = None):
    """Train with ``CODE_DIR`` at ``code_repo`` and the environment variables of ``env`` set (``None``: unset)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checkpoint_module, "CODE_DIR", code_repo)
        for name, value in (env or {}).items():
            if value is None:
                patch.delenv(name, raising=False)
            else:
                patch.setenv(name, value)
        return run_training(config)


@pytest.fixture(scope="module")
def run_a(tiny_cache, tmp_path_factory, code_repo):
    """6 steps, a checkpoint every 2 (steps 2, 4, 6 all kept), from the clean code checkout."""
    run = tmp_path_factory.mktemp("runs") / "a"
    _train(tiny_config(tiny_cache, run, save_every=2, keep_last=5), code_repo, env={"OMP_NUM_THREADS": None})
    return run


@pytest.fixture(scope="module")
def run_b(run_a, tiny_cache, tmp_path_factory, code_repo):
    """Run A with another token budget, OMP_NUM_THREADS set and an edited working tree."""
    run = tmp_path_factory.mktemp("runs") / "b"
    (code_repo / "trainer.py").write_text("STEP = 2\n")
    _train(tiny_config(tiny_cache, run, save_every=2, keep_last=5, token_budget=128),
           code_repo, env={"OMP_NUM_THREADS": "1"})
    return run


def _invoke(register, *args: str):
    app = typer.Typer()
    app.callback()(lambda: None)
    register(app)
    return CliRunner().invoke(app, [*map(str, args)], env={"COLUMNS": "250"})


def test_optimizer_param_names_are_recorded_in_build_optimizer_order(run_a):
    from dflash.drafter import DFlashConfig, DFlashDrafter

    checkpoint = run_a / "checkpoints" / "step_00000002"
    with open_safetensors(checkpoint / "optimizer.safetensors") as handle:
        names = json.loads(handle.metadata()[PARAM_NAMES_KEY])
    drafter = DFlashDrafter(DFlashConfig.from_dict(json.loads((checkpoint / "drafter_config.json").read_text())))
    assert names == [name for name, param in drafter.named_parameters() if param.requires_grad]
    state = load_state_tree(checkpoint / "optimizer.safetensors")
    assert sorted(state["state"]) == list(range(len(names)))
    # The map is exact: each optimizer state has its parameter's shape.
    with open_safetensors(checkpoint / "model.safetensors") as handle:
        weights = {name: list(handle.get_slice(name).get_shape()) for name in handle.keys()}
    for index, name in enumerate(names):
        assert list(state["state"][index]["exp_avg"].shape) == weights[name], name


def test_scan_reads_every_checkpoint_and_names_a_nan_in_an_older_optimizer_state(run_a, tmp_path, monkeypatch):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_a, run)
    assert (run / "latest").read_text().strip() == "step_00000006"
    older = run / "checkpoints" / "step_00000004"
    with open_safetensors(older / "optimizer.safetensors") as handle:
        names = json.loads(handle.metadata()[PARAM_NAMES_KEY])
        metadata = {k: v for k, v in handle.metadata().items() if k not in ("dflash_state_tree", "dflash_state_format")}
    index = names.index("layers.0.mlp.up_proj.weight")
    state = load_state_tree(older / "optimizer.safetensors")
    state["state"][index]["exp_avg_sq"].view(-1)[5] = float("nan")
    save_state_tree(state, older / "optimizer.safetensors", metadata=metadata)

    result = _invoke(scan_stage.register, "scan", run)
    assert result.exit_code == 1, result.output
    for name in ("step_00000002", "step_00000004", "step_00000006"):  # every checkpoint read, and named
        assert f"checkpoints/{name}: scanned" in result.output
    assert "layers.0.mlp.up_proj.weight.exp_avg_sq" in result.output
    assert f"state.{index}.exp_avg_sq" in result.output
    assert "1 of 3 with problems" in result.output

    scans = scan_stage.scan_paths([run])
    bad = {scan.path.name: [(f.tensor, f.nan) for f in scan.findings] for scan in scans}
    assert bad == {"step_00000002": [], "step_00000004": [("layers.0.mlp.up_proj.weight.exp_avg_sq", 1)],
                   "step_00000006": []}
    assert all(scan.files == ["model.safetensors", "optimizer.safetensors"] for scan in scans)
    assert scans[0].tensors > 2 * len(names)  # weights + exp_avg, exp_avg_sq and step per parameter
    # Streamed in row chunks (bounded memory), a tensor counts the same as read whole.
    monkeypatch.setattr(runs, "_CHUNK_ELEMENTS", 1 << 16)  # the MLP weights: several row chunks each
    chunked = scan_stage.scan_checkpoint(older)
    assert chunked.to_dict() == scans[1].to_dict()

    # The old entry point is an alias of the same scan.
    from stages.forensics import inspect as inspect_stage

    alias = _invoke(inspect_stage.register, "inspect", run, "--scan")
    assert alias.exit_code == 1 and "layers.0.mlp.up_proj.weight.exp_avg_sq" in alias.output

    (run / "latest").write_text("step_00000099\n")  # a damaged run is still scanned, checkpoint by checkpoint
    assert [path.name for path in scan_stage.checkpoints_to_scan(run)] == ["step_00000002", "step_00000004",
                                                                           "step_00000006"]


def test_scan_of_a_clean_run_exits_0_and_counts_extremes(run_a):
    result = _invoke(scan_stage.register, "scan", run_a)
    assert result.exit_code == 0, result.output
    assert "3 checkpoint(s) scanned: all clean" in result.output
    scans = scan_stage.scan_paths([run_a / "checkpoints" / "step_00000002"], max_abs=1e-6)
    assert scans[0].findings and all(f.extreme > 0 and f.nan == f.inf == 0 for f in scans[0].findings)
    assert not any(f.tensor.endswith(".step") for f in scans[0].findings)  # Adam's step counter is no value


def test_inspect_json_gives_parameter_counts_tensor_statistics_and_checks_steps(run_a, tmp_path):
    import shutil

    from safetensors.torch import load_file

    result = _invoke(inspect_stage.register, "inspect", run_a, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["kind"] == "run" and data["model_file"].endswith("step_00000006/model.safetensors")
    assert data["facts"]["trainer.step"] == 6
    assert data["checks"]["steps agree (folder, trainer state, weights, optimizer, RNG)"] == "ok"
    weights = load_file(data["model_file"])
    assert data["parameters"]["total"] == sum(t.numel() for t in weights.values())
    assert {name for name in data["parameters"]["groups"] if name.startswith("layers.")} == {"layers.0"}
    by_name = {row["name"]: row for row in data["tensors"]}
    assert set(by_name) == set(weights)
    for name, tensor in weights.items():
        row, values = by_name[name], tensor.double()
        assert row["shape"] == list(tensor.shape) and row["numel"] == tensor.numel()
        assert row["min"] == pytest.approx(float(values.min())) and row["max"] == pytest.approx(float(values.max()))
        assert row["mean"] == pytest.approx(float(values.mean()), abs=1e-9)
        assert row["std"] == pytest.approx(float(values.std(unbiased=False)), rel=1e-6, abs=1e-9)
        assert row["nonfinite"] == 0

    # A checkpoint whose trainer state records another step than its files: the check names both, exit 1.
    copy = tmp_path / "step_00000004"
    shutil.copytree(run_a / "checkpoints" / "step_00000004", copy)
    state = json.loads((copy / "trainer_state.json").read_text())
    (copy / "trainer_state.json").write_text(json.dumps({**state, "step": 5}))
    result = _invoke(inspect_stage.register, "inspect", copy, "--no-tensors")
    assert result.exit_code == 1
    assert "steps disagree" in result.output and "trainer_state.json 5" in result.output
    assert "model.safetensors 4" in result.output
    assert "tensors of" not in result.output
    result = _invoke(inspect_stage.register, "inspect", run_a, "--json", "--scan")
    assert result.exit_code == 2 and result.output.startswith("error: ")


def test_scan_and_inspect_fail_a_checkpoint_resume_would_refuse(run_a, tmp_path, monkeypatch, capsys):
    """A foreign RNG file (a safetensors file that is no state tree; a state tree holding no generator state) or a
    missing optimizer state: ``train --resume`` refuses the checkpoint, so scan and inspect say so (exit 1) with the same
    message, naming the file."""
    import shutil

    import torch
    from cli_helpers import main_in_process
    from safetensors.torch import save_file

    run = tmp_path / "run"
    shutil.copytree(run_a, run)
    latest, older, oldest = (run / "checkpoints" / f"step_{step:08d}" for step in (6, 4, 2))
    save_file({"torch": torch.zeros(3)}, str(latest / "rng.safetensors"))  # not written by save_state_tree
    save_state_tree({"torch": torch.zeros(3)}, older / "rng.safetensors")  # readable, but no generator state
    (oldest / "optimizer.safetensors").unlink()

    result = _invoke(scan_stage.register, "scan", run)
    assert result.exit_code == 1, result.output
    assert "3 of 3 with problems" in result.output
    text = " ".join(result.output.split())
    assert f"train --resume would refuse it: {latest / 'rng.safetensors'} holds no 'dflash_state_tree'" in text
    assert f"{older / 'rng.safetensors'}: its 'torch' entry is not a random generator state" in text
    assert f"{oldest} has no optimizer.safetensors" in text
    resumable = "resumable (every file train --resume reads, read as it reads them)"
    data = json.loads(_invoke(inspect_stage.register, "inspect", run, "--json", "--no-tensors").output)
    assert data["checks"][resumable].startswith(f"train --resume would refuse it: {latest / 'rng.safetensors'} holds no")
    result = _invoke(inspect_stage.register, "inspect", older, "--no-tensors")
    assert result.exit_code == 1 and f"{resumable}: FAILED" in result.output

    code, stderr = main_in_process(monkeypatch, capsys, "train", "--output", str(run), "--resume", "--no-progress")
    assert code == 2 and "Traceback" not in stderr
    assert f"{latest / 'rng.safetensors'} holds no 'dflash_state_tree'" in stderr  # the message scan and inspect gave

    clean = _invoke(inspect_stage.register, "inspect", run_a, "--json", "--no-tensors")
    assert clean.exit_code == 0 and json.loads(clean.output)["checks"][resumable] == "ok"


def test_scan_of_no_artefact_is_a_usage_error(tmp_path):
    result = _invoke(scan_stage.register, "scan", tmp_path)
    assert result.exit_code == 2
    assert result.output.startswith("error: ")


def test_diff_lists_exactly_the_batch_environment_and_code_changes_and_the_throughput_gap(run_a, run_b):
    comparison = diff_stage.compare(diff_stage.load_side(run_a), diff_stage.load_side(run_b))
    print(comparison.config)
    assert {key: (a, b) for key, a, b in comparison.config} == {"config.data.token_budget": (192, 128)}
    environment = {key: (a, b) for key, a, b in comparison.environment}
    assert set(environment) == {"environment.env.OMP_NUM_THREADS", "environment.git_dirty",
                                "environment.git_diff_sha256"}
    assert environment["environment.env.OMP_NUM_THREADS"] == ("<absent>", "1")
    assert environment["environment.git_dirty"] == (False, True)
    performance = {key: (a, b, change) for key, a, b, change in comparison.performance}
    for key in ("real_tokens_per_s", "supervised_tokens_per_s", "time_step_s", "time_forward_s",
                "time_data_wait_s", "time_backward_s", "time_optimizer_s"):
        a, b, change = performance[key]
        assert a > 0 and b > 0 and change == pytest.approx(b / a - 1)
    assert any(key.startswith("bucket_step_s.") for key in performance)  # per length bucket
    assert comparison.verdict.startswith("B is ") and "% " in comparison.verdict
    assert "OMP_NUM_THREADS" in comparison.verdict and "config: config.data.token_budget 192 -> 128" in comparison.verdict

    result = _invoke(diff_stage.register, "diff", run_a, run_b)
    assert result.exit_code == 1, result.output
    for expected in ("config.data.token_budget", "environment.env.OMP_NUM_THREADS", "real_tokens_per_s", "verdict: B is"):
        assert expected in result.output, expected
    assert "drafter." not in result.output and "trainer.config" not in result.output  # each change once
    assert _invoke(diff_stage.register, "diff", run_a, run_a).exit_code == 0


def test_train_records_convention_warnings_and_the_hyperparameter_table_shows_effective_values(run_a, tiny_cache):
    from rich.console import Console

    from stages.train.hyperparameters import convention_warnings, hyperparameter_rows, render_hyperparameters

    resolved = json.loads((run_a / "run.json").read_text())["resolved"]
    # The tiny run: 2 anchors x block 4 cannot cover its longest sample; gamma and betas are the defaults.
    assert len(resolved["convention_warnings"]) == 1 and "max_anchors_per_document 2" in resolved["convention_warnings"][0]
    config = tiny_config(tiny_cache, run_a, save_every=2, keep_last=5)
    rows = hyperparameter_rows(config, resolved, schedule=[{"warmup_steps": 1, "total_steps": 6}],
                               attention_backend="auto")
    console = Console(record=True, width=200)
    console.print(render_hyperparameters(rows))
    text = console.export_text()
    for expected in ("lr (peak)", "0.001", "0.0006", "AdamW betas", "(0.9, 0.999)", "gamma", "warmup 1 steps",
                     "192 per micro-batch x 1 accum x 1 ranks = 192 per step", "compile", "dense-sdpa"):
        assert expected in text, expected
    assert {row.name for row in rows if row.departs} == {"lr (peak)", "schedule", "block size", "anchors per document"}
    # The tiny cache has no document keys: 20% of its rows are held out, and the table says by what.
    assert resolved["validation"]["split_by"] == "row" and resolved["validation"]["samples"] > 0
    assert f"{resolved['validation']['samples']:,} samples held out by row (fraction 0.2)" in text

    warnings = convention_warnings(block_size=16, gamma=4.0, betas=(0.9, 0.95), max_anchors_per_document=512,
                                   longest_sample=3072)
    assert len(warnings) == 2
    assert warnings[0].startswith("gamma 4 at block size 16: the paper uses 7")
    assert "betas (0.9, 0.95)" in warnings[1]
    assert convention_warnings(block_size=8, gamma=4.0, betas=(0.9, 0.999), max_anchors_per_document=512,
                               longest_sample=3072) == []


def test_report_writes_pngs_and_a_self_contained_html_page_for_overlaid_runs(run_a, run_b, tmp_path):
    import base64
    import shutil

    pytest.importorskip("matplotlib")
    from stages.forensics import report as report_stage

    workdir = tmp_path / "work"  # a pipeline work folder: evaluated tau per epoch comes from its pipeline.json
    shutil.copytree(run_a, workdir / "run")
    (workdir / "pipeline.json").write_text(json.dumps({"epochs": [{"epoch": 0, "step": 0, "tau": 1.0},
                                                                  {"epoch": 1, "step": 6, "tau": 1.2}]}))
    series = report_stage.load_series(workdir)
    assert [e["tau"] for e in series.evaluated] == [1.0, 1.2] and series.saves == [2, 4, 6] and series.val

    output = tmp_path / "report"
    result = _invoke(report_stage.register, "report", workdir, run_b, "--output", output)
    assert result.exit_code == 0, result.output
    page = (output / "report.html").read_text()
    for name in report_stage.PLOTS:
        png = (output / f"{name}.png").read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000, name
        assert base64.b64encode(png).decode() in page, name  # embedded, not linked
    assert "evaluated tau per epoch" in page and "2, 4, 6" in page
    assert "<img" in page and 'src="data:image/png;base64,' in page and "src=\"http" not in page
    assert _invoke(report_stage.register, "report", tmp_path / "nothing").exit_code == 2


def test_report_writes_only_into_its_own_folder_and_follows_no_link(run_a, tiny_cache, tmp_path):
    """A link planted as RUN/report or as one of its files, or an output that is a run, a cache or the user's
    folder: one error line, exit 2, nothing written anywhere. A report folder is rewritten."""
    import shutil

    pytest.importorskip("matplotlib")
    from stages.forensics import report as report_stage

    run = tmp_path / "run"
    shutil.copytree(run_a, run, ignore=shutil.ignore_patterns("report"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text("mine")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")

    def refused(*args, says: str) -> None:
        result = _invoke(report_stage.register, "report", *args)
        assert result.exit_code == 2, result.output
        assert result.output.startswith("error: ") and says in " ".join(result.output.split()), result.output

    (run / "report").symlink_to(elsewhere)
    refused(run, says=f"--output {run / 'report'} is a symbolic link (to {elsewhere})")
    assert sorted(p.name for p in elsewhere.iterdir()) == ["notes.txt"] and not (tmp_path / "elsewhere.lock").exists()
    (run / "report").unlink()

    (run / "report").mkdir()
    (run / "report" / "loss.png").symlink_to(victim)
    refused(run, says=f"--output {run / 'report'}: loss.png is a symbolic link (to {victim})")
    assert victim.read_text() == "keep me" and sorted(p.name for p in (run / "report").iterdir()) == ["loss.png"]
    (run / "report" / "loss.png").unlink()

    before = sorted(p.name for p in run.iterdir())
    for foreign in (run, tiny_cache, elsewhere):  # the error names the first entry that is no report file
        found = min(p.name for p in foreign.iterdir())
        refused(run, "--output", foreign, says=f"--output {foreign} exists and holds files that are not a "
                                               f"dflash-stages report ({found};")
    assert sorted(p.name for p in run.iterdir()) == before and not (tiny_cache / "report.html").exists()
    assert sorted(p.name for p in elsewhere.iterdir()) == ["notes.txt"]

    for _ in range(2):  # written, then rewritten in place
        result = _invoke(report_stage.register, "report", run)
        assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (run / "report").iterdir()) == sorted(report_stage.REPORT_FILES)
    assert not (run / "report.lock").exists()


def test_report_diff_and_sweep_show_one_final_loss_and_the_evaluated_tau(run_a, run_b, tmp_path):
    """The final losses are ``final_losses``'s everywhere (the last train record's interval loss, the last val
    record's loss); the evaluated tau comes from the work folder's ``eval/final.json`` (a pipeline's run) or the
    run's own ``eval/final.json``, and report and diff show it beside speed."""
    import shutil

    pytest.importorskip("matplotlib")
    from dflash.training.telemetry import final_losses, read_metrics
    from stages.forensics import report as report_stage
    from stages.sweep import summarize_run

    workdir = tmp_path / "work"  # the main job's layout: WORKDIR/run, WORKDIR/eval/final.json, WORKDIR/pipeline.json
    shutil.copytree(run_a, workdir / "run")
    (workdir / "pipeline.json").write_text(json.dumps({"tau": 1.106}))
    (workdir / "eval").mkdir()
    (workdir / "eval" / "final.json").write_text(json.dumps({"tau": 1.106, "drafter": "final drafter"}))
    other = tmp_path / "b"
    shutil.copytree(run_b, other)
    (other / "eval").mkdir()
    (other / "eval" / "epoch_1.json").write_text(json.dumps({"tau": 1.25}))  # no final.json: the last epoch's

    final = final_losses(read_metrics(run_a))
    train = read_metrics(run_a, kind="train")
    val = read_metrics(run_a, kind="val")
    assert final["train_loss"] == train[-1]["loss"] and final["val_loss"] == val[-1]["loss"]
    summary = summarize_run(run_a)
    assert (summary["train_loss"], summary["val_loss"]) == (final["train_loss"], final["val_loss"])
    assert runs.evaluated_tau(workdir / "run")["tau"] == 1.106 and runs.evaluated_tau(run_a)["tau"] is None

    output = tmp_path / "report"
    result = _invoke(report_stage.register, "report", workdir, other, "--output", output)
    assert result.exit_code == 0, result.output
    page = (output / "report.html").read_text()
    assert "evaluated tau (final drafter)</th><td>1.106" in page and "</th><td>1.250" in page
    assert f"final validation loss / implied tau</th><td>{final['val_loss']:.4f}" in page
    assert f"final train loss (last log interval)</th><td>{final['train_loss']:.4f}" in page

    comparison = diff_stage.compare(diff_stage.load_side(workdir / "run"), diff_stage.load_side(other))
    quality = {key: (a, b) for key, a, b in comparison.quality}
    assert quality["evaluated_tau"] == (1.106, 1.25) and quality["val_loss"][0] == final["val_loss"]
    assert "quality: evaluated tau 1.106 -> 1.250 (better), validation loss" in comparison.verdict
    result = _invoke(diff_stage.register, "diff", workdir / "run", other)
    assert "quality" in result.output and "evaluated_tau" in result.output and "1.1060" in result.output


def test_inspect_leads_with_a_summary_of_the_run(run_a, tmp_path):
    """inspect's first lines say what the path is, its target, steps, final losses (final_losses, as report and
    diff), the evaluated tau and the checks' verdicts; the details follow."""
    import shutil

    from dflash.training.telemetry import final_losses, read_metrics

    workdir = tmp_path / "work"
    shutil.copytree(run_a, workdir / "run")
    (workdir / "pipeline.json").write_text("{}")
    (workdir / "eval").mkdir()
    (workdir / "eval" / "final.json").write_text(json.dumps({"tau": 1.106}))
    final = final_losses(read_metrics(run_a))
    result = _invoke(inspect_stage.register, "inspect", workdir / "run", "--no-tensors")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == f"what: run {workdir / 'run'}"
    assert lines[1].startswith("target: SmolLM2-135M-Instruct")
    assert lines[2] == "steps: 6 of 6"
    assert lines[3] == (f"final loss: validation {final['val_loss']:.4f} (step {final['val_step']}), "
                        f"train {final['train_loss']:.4f} (step 6) (last log interval)")
    assert lines[4] == f"evaluated tau: 1.106 ({workdir / 'eval' / 'final.json'})"
    assert re.fullmatch(r"checks: (\d+) of \1 ok", lines[5])
    assert lines[6].startswith("details follow") and "drafter.block_size" in result.output

    summary = json.loads(_invoke(inspect_stage.register, "inspect", run_a, "--json", "--no-tensors").output)["summary"]
    assert summary["evaluated tau"] == "not evaluated (no eval/final.json)" and summary["steps"] == "6 of 6"
