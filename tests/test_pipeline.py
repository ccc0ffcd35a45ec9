"""``dflash-stages run``: the offline pipeline end to end on real stdlib text and the real SmolLM2 target.

Uses a preset smaller than ``cpu-small`` (about 1.6K tokens, a few training steps) so the test stays short;
``cpu-small`` itself is what README's main job runs.
"""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dflash.errors import ConfigError, MismatchError
from pipelines.offline import PipelineConfig, resolve_pipeline
from stages.config.presets import PRESETS, load_preset

TINY = {
    "_why": "test-sized: seconds per stage",
    "target": "default",
    "prepare": {"max_length": 256},  # inputs: a folder of small stdlib modules (set in the fixture)
    "split": {"heldout_documents": 1, "seed": 0},
    "extract": {"target_processes": 1, "num_taps": 1, "forward_tokens": 2048, "shard_size": 2048, "dashboard_address": ":0"},
    "train": {"drafter": {"num_draft_layers": 1, "block_size": 4, "max_anchors_per_document": 8}, "epochs": 2,
              "data": {"token_budget": 512, "validation_fraction": 0.0}, "save_every": 100, "keep_last": 1,
              "device": "cpu", "telemetry": {"progress": False},
              "min_train_samples": 1},  # test-sized data: a few samples train the mechanics
    "evaluate": {"num_prompts": 1, "prompt_tokens": 16, "max_new_tokens": 4, "ignore_eos": True, "device": "cpu",
                 "cpu_threads": 1,
                 "per_epoch": True, "compare_untrained": True, "extra_prompts": ["numpy-questions"]},
}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    from stages.cli import _register_all, app

    _register_all()
    folder = tmp_path_factory.mktemp("pipeline")
    sources = folder / "stdlib-sample"
    sources.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    # ~1.6K tokens of real Python, 3 training steps an epoch (the kill tests kill at step 2, inside epoch 1); the
    # split holds tty.py out (2 rows: evaluate.num_prompts=2 takes a prompt of each)
    for name in ("bisect.py", "keyword.py", "tty.py"):
        shutil.copy(stdlib / name, sources / name)
    preset = folder / "tiny.json"
    preset.write_text(json.dumps({**TINY, "prepare": {**TINY["prepare"], "inputs": [str(sources)]}}))
    workdir = folder / "work"
    # One torch thread, as the processes of _run_in_subprocess: the kill-and-resume test compares its resumed run
    # with this one bit for bit.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = CliRunner().invoke(app, ["run", "--preset", str(preset), "--workdir", str(workdir)])
    finally:
        torch.set_num_threads(threads)
    return app, preset, workdir, result


def _extracted_workdir(finished: Path, workdir: Path, stages: tuple[str, ...] = ("prepare", "split", "extract")) -> Path:
    """``workdir`` as ``run`` leaves it once extract has finished and before train starts: the finished run's
    outputs and records of its prepare, split and extract stages, copied. The same preset run there starts at train
    (with other settings for those three stages it would be refused: their records keep their settings' digests).
    ``stages=("prepare", "split")``: as it leaves it before online (or extract) starts."""
    workdir.mkdir()
    outputs = {"prepare": ("corpus-all",), "split": ("corpus", "heldout"), "extract": ("cache",)}
    for name in (folder for stage in stages for folder in outputs[stage]):
        shutil.copytree(finished / name, workdir / name, symlinks=True)
    records = json.loads((finished / "pipeline.json").read_text())["stages"]
    (workdir / "pipeline.json").write_text(json.dumps({"stages": {name: records[name] for name in stages}}))
    return workdir


def test_pipeline_runs_every_stage_and_prints_tau(finished_run):
    _, _, workdir, result = finished_run
    assert result.exit_code == 0, result.output + repr(result.exception)
    tau_lines = [line for line in result.output.splitlines() if line.startswith("tau = ")]
    assert len(tau_lines) == 1
    state = json.loads((workdir / "pipeline.json").read_text())
    assert all(state["stages"][name]["done"] for name in ("prepare", "split", "extract", "train", "evaluate"))
    report = json.loads((workdir / "eval" / "final.json").read_text())
    assert 1.0 <= report["tau"] <= 4.0
    assert float(tau_lines[0].split()[2]) == pytest.approx(report["tau"], abs=5e-4)
    assert report["lossless"]["checked"] and report["lossless"]["passed"]
    assert report["prompts"]["count"] == 1
    # The checkpoint the final drafter was read from (the run's latest), in the report and its table.
    latest = (workdir / "run" / "latest").read_text().strip()
    assert report["drafter_source"] == str(workdir / "run" / "checkpoints" / latest)
    # The final drafter on both prompt sets, each with its own tau and lossless check; the last line names both.
    held_out, numpy_questions = report["prompt_sets"]
    assert (held_out["name"], numpy_questions["name"]) == ("held-out", "numpy-questions")
    assert held_out["tau"] == report["tau"] and numpy_questions["lossless"]["passed"]
    assert numpy_questions["fingerprint"].startswith("sha256:") and numpy_questions["count"] == 1
    assert tau_lines[0].startswith(f"tau = {report['tau']:.3f} (held-out) / {numpy_questions['tau']:.3f} "
                                   "(numpy-questions) (mean acceptance length")
    assert tau_lines[0].endswith(" held-out prompts)")  # one line however narrow the console (a log file: grep)
    assert state["stages"]["evaluate"]["result"]["prompt_sets"] == {"held-out": report["tau"],
                                                                   "numpy-questions": numpy_questions["tau"]}
    # Epoch by epoch: the untrained floor (epoch 0), then each epoch's checkpoint; the last one is the final drafter.
    assert [entry["epoch"] for entry in state["epochs"]] == [0, 1, 2]
    total_steps = state["stages"]["train"]["result"]["total_steps"]
    assert state["epochs"][-1]["step"] == total_steps and 0 < state["epochs"][1]["step"] < total_steps
    # The epoch ends were placed by planning the schedule from the cache, without a training step to learn it: the
    # trainer started once per epoch, at step 0 and at epoch 1's end, and planned the length the trainer used.
    from stages.train.config import TrainConfig
    from stages.train.data import planned_total_steps

    starts = [row["step"] for row in map(json.loads, (workdir / "run" / "metrics.jsonl").read_text().splitlines())
              if row["kind"] == "data"]
    assert starts == [0, state["epochs"][1]["step"]]
    run_config = TrainConfig.from_dict({**TINY["train"], "cache": str(workdir / "cache"), "output": str(workdir / "x")})
    assert planned_total_steps(run_config) == total_steps
    assert report["tau"] == state["epochs"][-1]["tau"]
    for entry in state["epochs"]:
        epoch_report = json.loads((workdir / "eval" / f"epoch_{entry['epoch']}.json").read_text())
        assert epoch_report["tau"] == entry["tau"]
        if entry is state["epochs"][-1]:  # the final drafter: both references, speedups and the lossless checks
            assert epoch_report["lossless"]["passed"] and epoch_report["lossless_vs_generate"]["passed"]
            assert epoch_report["speedup"] > 0 and epoch_report["settings"]["references"] is True
        else:  # earlier epochs: tau, acceptance and the teacher-forced check (evaluate.per_epoch_references is off)
            assert epoch_report["speedup"] is None and entry["speedup"] is None
            assert epoch_report["lossless"]["passed"] and epoch_report["settings"]["references"] is False
            assert not epoch_report["lossless_vs_generate"]["checked"]
            assert set(epoch_report["throughput"]) == {"speculative"}
            assert [entry["name"] for entry in epoch_report["prompt_sets"]] == ["held-out"]  # the first set only
            assert sum(p["cycles"] for p in epoch_report["per_prompt"]) == epoch_report["acceptance"]["num_cycles"]


def test_heldout_documents_never_reach_the_cache(finished_run):
    from dflash.corpus.format import open_corpus
    from dflash.decoding.eval_prompts import held_out_rows

    _, _, workdir, _ = finished_run
    train, heldout = open_corpus(workdir / "corpus"), open_corpus(workdir / "heldout")
    train_docs = {train.sample_id(i).split("#")[0] for i in range(len(train))}
    heldout_docs = {heldout.sample_id(i).split("#")[0] for i in range(len(heldout))}
    assert heldout_docs and not heldout_docs & train_docs
    assert len(train) + len(heldout) == len(open_corpus(workdir / "corpus-all"))
    # Both sides keep prepare's document ids (a file's identity on each of its chunks), and the cache stores them.
    assert {train.document_id(i) for i in range(len(train))} == train_docs
    assert {heldout.document_id(i) for i in range(len(heldout))} == heldout_docs
    from dflash.cache import CacheReader

    assert CacheReader(workdir / "cache").document_keys().tolist() == train.document_keys.tolist()
    with pytest.raises(ConfigError, match="no row is held out"):
        held_out_rows(train, workdir / "cache")  # the cache covers the whole training split
    with pytest.raises(MismatchError, match="corpus_fingerprint"):
        held_out_rows(heldout, workdir / "cache")
    # The training corpus records its held-out side as prepare's does: evaluate --corpus corpus/ finds heldout/.
    from dflash.corpus.split import heldout_corpus

    assert heldout_corpus(train).path == (workdir / "heldout").resolve()
    assert held_out_rows(train, workdir / "cache", heldout=heldout).tolist() == list(range(len(heldout)))


def test_rerun_skips_complete_stages_and_refuses_changed_settings(finished_run):
    app, preset, workdir, _ = finished_run
    before = (workdir / "eval" / "final.json").stat().st_mtime_ns
    again = CliRunner().invoke(app, ["run", "--preset", str(preset), "--workdir", str(workdir)])
    assert again.exit_code == 0, again.output
    assert again.output.count("complete, skipped") == 5
    assert (workdir / "eval" / "final.json").stat().st_mtime_ns == before
    changed = CliRunner().invoke(
        app, ["run", "--preset", str(preset), "--workdir", str(workdir), "--set", "train.optim.lr=0.01"]
    )
    assert changed.exit_code != 0
    assert isinstance(changed.exception, ConfigError) and "train" in str(changed.exception)


def test_pipeline_on_generated_responses(tmp_path, target):
    """A generate section replaces prepare + split: the corpus is the target's own replies, evaluation uses the
    given held-out prompts, and every stage runs."""
    from stages.cli import _register_all, app

    _register_all()
    prompts = tmp_path / "train.jsonl"
    prompts.write_text("".join(json.dumps({"text": f"def add_{i}(a, b):\n    "}) + "\n" for i in range(4)))
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text(json.dumps({"text": "def multiply(a, b):\n    "}) + "\n")
    tiny = {key: value for key, value in TINY.items() if key not in ("prepare", "split")}
    preset = {**tiny, "generate": {"prompts": str(prompts), "max_new_tokens": 12, "target_processes": 1, "part_size": 2},
              "train": {**TINY["train"], "epochs": 1},
              "evaluate": {**TINY["evaluate"], "prompts": str(heldout), "per_epoch": False, "num_prompts": 1,
                           "extra_prompts": [], "compare_untrained": False}}
    (tmp_path / "gen.json").write_text(json.dumps(preset))
    workdir = tmp_path / "work"
    result = CliRunner().invoke(app, ["run", "--preset", str(tmp_path / "gen.json"), "--workdir", str(workdir)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    state = json.loads((workdir / "pipeline.json").read_text())
    assert set(state["stages"]) == {"generate", "extract", "train", "evaluate"}
    from dflash.corpus.format import open_corpus

    corpus = open_corpus(workdir / "corpus")
    assert len(corpus) == 4 and corpus.metadata["generation"]["max_new_tokens"] == 12
    report = json.loads((workdir / "eval" / "final.json").read_text())
    assert report["prompts"]["source"] == str(heldout) and report["prompts"]["count"] == 1
    without = {**{k: v for k, v in preset.items() if k != "_why"}, "evaluate": TINY["evaluate"]}
    with pytest.raises(ConfigError, match="evaluate.prompts: generate.prompts is"):
        PipelineConfig(workdir=tmp_path / "other", **without)


def test_presets_resolve_and_overrides_apply(tmp_path):
    for name in PRESETS:
        preset = load_preset(name)
        assert not any(key.startswith("_") for section in preset.values() if isinstance(section, dict) for key in section)
        assert resolve_pipeline(workdir=tmp_path, preset=name).train == preset["train"]
    config = resolve_pipeline(workdir=tmp_path, overrides=["train.optim.lr=3e-4", "evaluate.device=cuda",
                                                           "train.drafter.target_layer_ids=[3]"])
    assert config.train["optim"] == {"lr": 3e-4} and config.evaluate["device"] == "cuda"
    assert config.train["drafter"]["target_layer_ids"] == [3] and config.train["drafter"]["block_size"] == 4
    with pytest.raises(ConfigError, match="section.field=value"):
        resolve_pipeline(workdir=tmp_path, overrides=["lr=3"])
    with pytest.raises(ConfigError, match="unknown section"):
        resolve_pipeline(workdir=tmp_path, overrides=["optimizer.lr=3"])
    with pytest.raises(ConfigError, match="neither"):
        load_preset("no-such-preset")


def test_the_settings_only_run_reads_are_checked_as_a_stage_config_is(tmp_path):
    """``split`` and evaluate's per-epoch keys, which no stage command has, are checked by their own config classes
    through the same resolver (same layers, same wording); the evaluate command skips exactly those keys of a preset."""
    from dataclasses import fields

    from pipelines.offline import PipelineEvaluateConfig
    from stages.config.resolve import PIPELINE_ONLY
    from stages.evaluate import EvaluateConfig

    assert PIPELINE_ONLY["evaluate"] == ({f.name for f in fields(PipelineEvaluateConfig)}
                                         - {f.name for f in fields(EvaluateConfig)})
    preset = tmp_path / "prepared.json"
    preset.write_text(json.dumps({**{k: v for k, v in load_preset("cpu-small").items() if k != "generate"},
                                  "prepare": {"max_length": 128}, "split": {"heldout_documents": 1}}))
    workdir = tmp_path / "work"
    for override, message in [
        ("split.heldout_documents=0", "split.heldout_documents (--set split.heldout_documents=0): must be a positive "
                                      "integer, got 0"),
        ("split.seed=true", "split.seed (--set split.seed=true): expected int, got True"),
        ("split.sead=1", "split.sead (--set split.sead=1): unknown key; did you mean split.seed?"),
        ("evaluate.per_epoch_num_prompts=0", "evaluate.per_epoch_num_prompts (--set evaluate.per_epoch_num_prompts=0): "
                                             "must be >= 1 (or null: every prompt), got 0"),
        ("evaluate.json_path=x", "evaluate.json_path (--set evaluate.json_path=x): set by the pipeline itself"),
    ]:
        with pytest.raises(ConfigError) as raised:
            resolve_pipeline(workdir=workdir, preset=str(preset), overrides=[override])
        assert str(raised.value).startswith(message), override
    (tmp_path / "seed.toml").write_text("[split]\nseed = 3\n[prepare]\ninputs = ['default']\n")
    config = resolve_pipeline(workdir=workdir, preset=str(preset), config_file=tmp_path / "seed.toml",
                              overrides=["split.heldout_documents=2"], docs=[tmp_path])
    assert config.split == {"heldout_documents": 2, "seed": 3}
    assert config.prepare == {"max_length": 128, "inputs": ["default", str(tmp_path)]}  # --docs after every layer
    assert not workdir.exists()


@pytest.mark.parametrize(("override", "message"), [
    ("train.optim.lr=abc", "train.optim.lr (--set train.optim.lr=abc): expected float, got 'abc'"),
    ("train.lrr=0.1", "train.lrr (--set train.lrr=0.1): unknown key; did you mean train.optim.lr?"),
    ("generate.max_new_tokenz=3", "did you mean generate.max_new_tokens?"),
    ("train.drafter.block_size=1", "train.drafter.block_size (--set train.drafter.block_size=1): must be an integer >= 2"),
    ("train.block_size=1", "train.block_size (--set train.block_size=1): unknown key; did you mean train.drafter.block_size?"),
    ("extract.num_taps=[1]", "extract.num_taps (--set extract.num_taps=[1]): expected int"),
    ("evaluate.per_epoch=2", "evaluate.per_epoch (--set evaluate.per_epoch=2): expected bool"),
    ("evaluate.num_promts=4", "did you mean evaluate.num_prompts?"),
    ("train.output=elsewhere", "train.output (--set train.output=elsewhere): set by the pipeline itself"),
    ("generate.temperature=-1", "generate.temperature (--set generate.temperature=-1): must be >= 0"),
])
def test_run_refuses_a_bad_setting_before_any_stage_writes(tmp_path, monkeypatch, capsys, override, message):
    """Every section is checked (keys, types, the stage config's own ranges) before the first stage: one error line
    naming the key and its source, exit 2, and the work folder is never created."""
    from cli_helpers import main_in_process

    workdir = tmp_path / "work"
    code, err = main_in_process(monkeypatch, capsys, "run", "--workdir", str(workdir), "--set", override)
    assert code == 2, err
    assert err.startswith("error: ") and message in " ".join(err.split())
    assert not workdir.exists()
    preset = tmp_path / "bad.json"
    preset.write_text(json.dumps({**load_preset("cpu-small"), "extract": {"num_tapz": 1}}))
    code, err = main_in_process(monkeypatch, capsys, "run", "--workdir", str(workdir), "--preset", str(preset))
    assert code == 2 and f"extract.num_tapz (preset {preset})" in "".join(err.split("\n"))
    assert not workdir.exists()


@pytest.mark.parametrize(("preset_sections", "override", "section"), [
    (None, "prepare.max_length=64", "prepare"),
    (None, "split.heldout_documents=2", "split"),
    ({"generate": None}, "generate.max_new_tokens=8", "generate"),
    (None, "online.ring_slots=3", "online"),
])
def test_run_refuses_a_setting_for_a_section_the_preset_does_not_run(tmp_path, monkeypatch, capsys,
                                                                     preset_sections, override, section):
    """cpu-small generates its corpus, so prepare and split never run; a preset with prepare runs no generate. A
    --set for a stage that is not run exits 2 naming the section and the stages the preset runs."""
    from cli_helpers import main_in_process

    preset = "cpu-small"
    if preset_sections is not None:
        config = {key: value for key, value in load_preset("cpu-small").items() if key != "generate"}
        config.update({"prepare": {"inputs": ["default"]}, "split": {"heldout_documents": 2}})
        preset = str(tmp_path / "prepared.json")
        (tmp_path / "prepared.json").write_text(json.dumps(config))
    workdir = tmp_path / "work"
    code, err = main_in_process(monkeypatch, capsys, "run", "--workdir", str(workdir), "--preset", preset,
                                "--set", override)
    assert code == 2, err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert f"runs no {section} stage" in err and "extract, train, evaluate" in err, err
    assert not workdir.exists()


def test_interrupted_training_ends_the_pipeline_with_130():
    """Training stopped by a signal ends ``dflash-stages run`` with exit status 130 (no evaluation of a
    half-trained drafter); a finished training passes through."""
    import typer

    from pipelines.offline import _stop_if_interrupted
    from stages.config.exit_status import ExitCode

    finished = {"stopped_by_signal": False, "step": 10}
    assert _stop_if_interrupted(finished) is finished
    with pytest.raises(typer.Exit) as stopped:
        _stop_if_interrupted({"stopped_by_signal": True, "step": 3})
    assert stopped.value.exit_code == ExitCode.INTERRUPTED == 130


def test_excluded_samples_are_reported_once_during_the_pipeline(caplog):
    """The trainer logs "excluded N of M samples" and prints the same counts right after; the pipeline keeps one."""
    import logging

    from pipelines.offline import _excluded_samples_reported_once

    trainer_log = logging.getLogger("stages.train.loop")
    caplog.set_level(logging.INFO)
    with _excluded_samples_reported_once():
        trainer_log.info("excluded %d of %d samples with fewer than %d supervised tokens", 0, 29, 4)
        trainer_log.info("resumed from step %d", 3)
    trainer_log.info("excluded %d of %d samples with fewer than %d supervised tokens", 0, 29, 4)
    messages = [record.getMessage() for record in caplog.records if record.name == "stages.train.loop"]
    assert messages == ["resumed from step 3", "excluded 0 of 29 samples with fewer than 4 supervised tokens"]


def test_a_stage_that_failed_before_writing_anything_reruns_with_corrected_settings(tmp_path):
    """extract refused by its disk-space check (the H200 preset run of 2026-12-03) leaves a not-done record and no
    cache: the same command with ``--set extract.expected_ratio=1.4`` must run it, not demand a new work folder. Once
    the stage has written into its folder, other settings are refused as before; a finished stage always is."""
    from pipelines.offline import _digest, _State

    before = {"target": "default", "num_taps": 5}
    after = {**before, "expected_ratio": 1.4}
    (tmp_path / "pipeline.json").write_text(json.dumps(
        {"stages": {"extract": {"digest": _digest(before), "settings": before, "done": False},
                    "train": {"digest": _digest(before), "settings": before, "done": True}}}))
    config = PipelineConfig(workdir=tmp_path, split={"heldout_documents": 1})
    cache, run = tmp_path / "cache", tmp_path / "run"
    cache.mkdir()  # an empty folder holds nothing either
    state = _State(tmp_path, config)
    assert state.check("extract", after, cache) is False
    assert "extract" not in state.data["stages"]
    state.start("extract", after)
    assert state.check("extract", after, cache) is False  # started, not finished
    (cache / "zarr.json").write_text("{}")
    with pytest.raises(ConfigError, match="other settings"):
        state.check("extract", before, cache)  # something written: refused
    with pytest.raises(ConfigError, match="other settings"):
        state.check("train", after, run)  # finished: refused even with nothing in the folder


def test_a_rerun_may_change_settings_that_do_not_change_a_stages_output(tmp_path):
    """Fields declared ``runtime`` (progress lines, logging, checkpoint cadence, locks, the dashboard) may differ in
    a rerun over the same work folder, and a field given at its default equals the field left out; any other field
    is refused, the refusal naming each one that changed, and pipeline.json is written as before (the digest of
    every setting given)."""
    from pipelines.offline import _digest, _State

    train = {"target": "default", "epochs": 2, "optim": {"lr": 1e-3}, "telemetry": {"progress": True}}
    extract = {"target": "default", "num_taps": 1}
    state = _State(tmp_path, PipelineConfig(workdir=tmp_path, split={"heldout_documents": 1}))
    for stage, settings in (("train", train), ("extract", extract)):
        state.start(stage, settings)
        state.finish(stage, 1.0)
    run, cache = tmp_path / "run", tmp_path / "cache"
    assert state.check("train", {**train, "save_every": 7, "telemetry": {"progress": False, "progress_interval": 5,
                                                                         "log_every": 3}}, run)
    assert state.check("extract", {**extract, "progress_interval": 0, "dashboard_address": ":0", "break_lock": True},
                       cache)
    with pytest.raises(ConfigError, match=r"other settings \(train\.optim\.lr: 0\.001 -> 0\.002\); use a new --workdir"):
        state.check("train", {**train, "optim": {"lr": 2e-3}}, run)
    with pytest.raises(ConfigError, match=r"\(extract\.num_taps: 1 -> 2, extract\.shard_size: 65536 \(default\) -> 64\)"):
        state.check("extract", {**extract, "num_taps": 2, "progress_interval": 0, "shard_size": 64}, cache)
    # A setting given at its default value is the setting left out: no change.
    assert state.check("extract", {**extract, "shard_size": 65536}, cache)
    assert state.check("train", {**train, "optim": {"lr": 1e-3, "schedule": "cosine"}}, run)
    assert json.loads((tmp_path / "pipeline.json").read_text())["stages"]["train"]["digest"] == _digest(train)


def _run_in_subprocess(preset: Path, workdir: Path, **extra_env: str):
    """``dflash-stages run`` as a user runs it, in a process of its own (forked from one that imported torch once:
    cli_helpers) with one torch thread (runs compared bit for bit share it)."""
    import os

    from cli_helpers import forked_python

    code = "import torch; torch.set_num_threads(1); from stages.cli import main; main()"
    args = ["run", "--preset", str(preset), "--workdir", str(workdir), "--set", "train.save_every=2",
            "--set", "evaluate.extra_prompts=[]"]  # one prompt set suffices here
    return forked_python(code, *args, env={**os.environ, "OMP_NUM_THREADS": "1", **extra_env}, timeout=600)


def _kill_then_rerun(preset: Path, workdir: Path, reference: Path):
    """Run ``preset`` into ``workdir`` with a SIGKILL inside the checkpoint write of step 2 (during epoch 1), check
    that it died there with no final report, run the same command again, and check that it ends with the epoch
    ends, taus and bit-identical drafter weights of the unkilled run in ``reference``. Returns the rerun's result
    and the two final checkpoints ``(resumed, uninterrupted)``."""
    import torch

    from dflash.training.checkpoint import load_checkpoint
    from pipelines.offline import _latest_checkpoint

    expected = json.loads((reference / "pipeline.json").read_text())
    killed = _run_in_subprocess(preset, workdir, DFLASH_FAULT="checkpoint.write@2=kill")
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not (workdir / "eval" / "final.json").exists()
    assert int(_latest_checkpoint(workdir / "run")[1]["step"]) == 2 < expected["epochs"][1]["step"]  # inside epoch 1
    rerun = _run_in_subprocess(preset, workdir)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    state = json.loads((workdir / "pipeline.json").read_text())
    assert [(e["epoch"], e["step"], e["tau"]) for e in state["epochs"]] == \
        [(e["epoch"], e["step"], e["tau"]) for e in expected["epochs"]]
    resumed, uninterrupted = load_checkpoint(workdir / "run"), load_checkpoint(reference / "run")
    assert resumed.model_state.keys() == uninterrupted.model_state.keys()
    for name, value in resumed.model_state.items():
        assert torch.equal(value, uninterrupted.model_state[name]), name
    return rerun, resumed, uninterrupted


def test_a_pipeline_killed_mid_epoch_resumes_to_the_same_epochs_and_drafter(finished_run, tmp_path):
    """SIGKILL inside a checkpoint write during epoch 1 (a power cut, no clean stop), then the same command again:
    the rerun resumes from the last whole checkpoint and ends with the epoch ends, taus and bit-identical final
    drafter of the same command run without a kill: the finished run of test_pipeline_runs_every_stage_and_prints_tau
    (same process settings: one torch thread). Both runs here are processes of their own and start at train, in a
    copy of the finished run's work folder after extract."""
    _, preset, finished, _ = finished_run
    workdir = _extracted_workdir(finished, tmp_path / "work")
    rerun, resumed, uninterrupted = _kill_then_rerun(preset, workdir, finished)
    assert rerun.stdout.count("complete, skipped") == 3  # prepare, split, extract: the copied ones
    assert resumed.trainer_state["step"] == uninterrupted.trainer_state["step"]


def test_a_schedule_shorter_than_half_the_epochs_still_trains_before_its_first_evaluation(finished_run, tmp_path):
    """train.max_steps=1 with 2 epochs: epoch 1's end rounds to step 0; it trains step 1 and evaluates there.
    With evaluate.per_epoch_num_prompts the evaluations before the last take the first prompts of the first set
    only; the last one (the final drafter) every prompt of every set, with evaluate.reference_prompts=1 the
    references on the first prompt of each. The second set is two short prompts of a file (numpy-questions, the
    preset's, is measured by test_pipeline_runs_every_stage_and_prints_tau)."""
    app, preset, finished, _ = finished_run
    workdir = _extracted_workdir(finished, tmp_path / "work")  # the stages before train: the finished run's
    extra = tmp_path / "questions.jsonl"
    extra.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in ("Name a sorting algorithm.",
                                                                               "What does len() return?")))
    result = CliRunner().invoke(app, ["run", "--preset", str(preset), "--workdir", str(workdir),
                                      "--set", "train.max_steps=1", "--set", "evaluate.num_prompts=2",
                                      "--set", "evaluate.per_epoch_num_prompts=1",
                                      "--set", "evaluate.reference_prompts=1",
                                      "--set", f"evaluate.extra_prompts={json.dumps([str(extra)])}"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    state = json.loads((workdir / "pipeline.json").read_text())
    assert [(e["epoch"], e["step"]) for e in state["epochs"]] == [(0, 0), (1, 1), (2, 1)]
    counts = [[(s["name"], s["count"]) for s in json.loads((workdir / "eval" / f"epoch_{e}.json").read_text())
               ["prompt_sets"]] for e in (0, 1, 2)]
    # Epoch 0 (the untrained drafter) is before the last step; epochs 1 and 2 both fall on it (max_steps=1).
    assert counts == [[("held-out", 1)]] + [[("held-out", 2), ("questions", 2)]] * 2
    final = json.loads((workdir / "eval" / "final.json").read_text())
    assert final["prompts"]["count"] == 2 and final["lossless"]["identical"] == 2
    # evaluate.reference_prompts reaches the evaluator: the references on the first prompt of each set, the
    # teacher-forced lossless check on both.
    assert final["settings"]["reference_prompts"] == 1
    for entry in final["prompt_sets"]:
        assert entry["reference_prompts"] == entry["lossless_vs_generate"]["prompts"] == 1
        assert entry["lossless"]["prompts"] == 2 and entry["lossless"]["passed"]


def test_cpu_small_preset_departs_from_no_convention_within_its_own_lengths():
    """The shipped CPU preset draws no convention warning from train: its anchors x block size cover the longest
    sample its own generate section can write (``generate.max_length``)."""
    from stages.train.config import TrainConfig
    from stages.train.hyperparameters import convention_warnings

    preset = load_preset("cpu-small")
    train = TrainConfig.from_dict({**{k: v for k, v in preset["train"].items() if not k.startswith("_")},
                                   "cache": "unused", "output": "unused"})
    assert convention_warnings(block_size=train.drafter.block_size, gamma=train.resolved_gamma(),
                               betas=train.optim.betas, max_anchors_per_document=train.drafter.max_anchors_per_document,
                               longest_sample=preset["generate"]["max_length"]) == []


def test_numpy_questions_refused_beside_a_prompt_set_that_trains_on_numpy(tmp_path):
    """The second prompt set is held out only while training never reads numpy's sources."""
    preset = {k: v for k, v in load_preset("h200-smollm2").items() if k != "_why"}
    assert preset["evaluate"]["extra_prompts"] == ["numpy-questions"]
    PipelineConfig(workdir=tmp_path, **preset)
    preset["generate"]["default_prompts"]["packages"] = ["torch", "numpy"]
    with pytest.raises(ConfigError, match="numpy-questions asks about numpy, which generate.default_prompts.packages"):
        PipelineConfig(workdir=tmp_path, **preset)


@pytest.mark.parametrize(("override", "message"), [
    ("online.ring_slots=1", "online.ring_slots (--set online.ring_slots=1): expected an integer >= 2, got 1"),
    ("online.ring_slotz=3", "online.ring_slotz (--set online.ring_slotz=3): unknown key; did you mean online.ring_slots?"),
    ("online.corpus=elsewhere", "online.corpus (--set online.corpus=elsewhere): set by the pipeline itself"),
    ("online.cache_to=elsewhere", "online.cache_to (--set online.cache_to=elsewhere): set by the pipeline itself"),
    ("extract.num_taps=2", "preset cpu-online runs no extract stage (it runs generate, online, train, evaluate)"),
])
def test_an_online_preset_refuses_a_bad_online_setting_before_any_stage_writes(tmp_path, monkeypatch, capsys,
                                                                              override, message):
    from cli_helpers import main_in_process

    workdir = tmp_path / "work"
    code, err = main_in_process(monkeypatch, capsys, "run", "--preset", "cpu-online", "--workdir", str(workdir),
                                "--set", override)
    assert code == 2, err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and message in " ".join(err.split()), err
    assert not workdir.exists()


#: The online branch of ``run``: the offline fixture's preset plus this section (producers in one CPU process).
ONLINE = {"target_processes": 1, "ring_slots": 3}


@pytest.fixture(scope="module")
def online_run(finished_run, tmp_path_factory):
    """The offline fixture's preset (same corpus, trainer and seed) with an online section, run to the end in a copy
    of the offline run's work folder after split (the same prepare and split settings: both skipped)."""
    _, preset, finished, _ = finished_run
    folder = tmp_path_factory.mktemp("online-pipeline")
    online = folder / "online.json"
    online.write_text(json.dumps({**json.loads(Path(preset).read_text()), "online": ONLINE}))
    workdir = _extracted_workdir(finished, folder / "work", stages=("prepare", "split"))
    return online, workdir, _run_in_subprocess(online, workdir)


def test_an_online_section_trains_without_a_cache_then_evaluates(online_run):
    """extract does not run and no hidden state reaches the disk: the producers feed the trainer; pipeline.json
    records the online stage as it records train; the evaluation is the offline branch's."""
    from dflash.training.checkpoint import read_run_record

    _, workdir, result = online_run
    assert result.returncode == 0, result.stderr[-3000:]
    assert [line for line in result.stdout.splitlines() if line.startswith("tau = ")]
    assert "the trainer scheduled" not in result.stderr  # the steps planned from the corpus are the trainer's
    assert not (workdir / "cache").exists() and not list(workdir.rglob("zarr.json"))
    state = json.loads((workdir / "pipeline.json").read_text())
    assert list(state["stages"]) == ["prepare", "split", "online", "evaluate"]
    online = state["stages"]["online"]
    assert online["done"] and isinstance(online["seconds"], float) and online["settings"]["online"] == ONLINE
    assert [e["epoch"] for e in state["epochs"]] == [0, 1, 2]
    assert (workdir / "eval" / "final.json").is_file()
    producers = read_run_record(workdir / "run")["resolved"]["data_source"]["online"]
    assert producers["corpus"] == str((workdir / "corpus").resolve()) and producers["ring_slots"] == 3


def test_the_online_branch_trains_on_the_offline_branchs_batch_plan(finished_run, online_run):
    """Same corpus, trainer config and seed: the online run's schedule, epoch ends and every batch's corpus rows
    (the trainer's running digest of them) equal the offline run's from extract's cache."""
    from pipelines.offline import _latest_checkpoint

    _, _, offline_workdir, offline_result = finished_run
    _, online_workdir, online_result = online_run
    assert offline_result.exit_code == 0 and online_result.returncode == 0
    offline, online = (_latest_checkpoint(w / "run")[1] for w in (offline_workdir, online_workdir))
    assert online["total_steps"] == offline["total_steps"] and online["step"] == offline["step"]
    assert online["counters"]["data_digest"] == offline["counters"]["data_digest"] != ""
    assert online["counters"]["tokens_seen"] == offline["counters"]["tokens_seen"] > 0
    steps = [[(e["epoch"], e["step"]) for e in json.loads((w / "pipeline.json").read_text())["epochs"]]
             for w in (offline_workdir, online_workdir)]
    assert steps[0] == steps[1]


def test_a_changed_online_section_or_a_switch_of_branch_in_a_work_folder_is_refused(finished_run, online_run):
    app, offline_preset, offline_workdir, _ = finished_run
    online_preset, online_workdir, _ = online_run
    changed = CliRunner().invoke(app, ["run", "--preset", str(online_preset), "--workdir", str(online_workdir),
                                       "--set", "train.save_every=2", "--set", "evaluate.extra_prompts=[]",
                                       "--set", "online.ring_slots=4"])
    assert isinstance(changed.exception, ConfigError), changed.output
    assert str(changed.exception).startswith("online: ") and "other settings" in str(changed.exception)
    switched = CliRunner().invoke(app, ["run", "--preset", str(online_preset), "--workdir", str(offline_workdir)])
    assert isinstance(switched.exception, ConfigError), switched.output
    assert "trained from extract's cache" in str(switched.exception)
    back = CliRunner().invoke(app, ["run", "--preset", str(offline_preset), "--workdir", str(online_workdir)])
    assert isinstance(back.exception, ConfigError) and "trained online" in str(back.exception), back.output


@pytest.mark.slow
def test_an_online_pipeline_killed_mid_epoch_resumes_to_the_same_epochs_and_drafter(online_run, tmp_path):
    """SIGKILL inside a checkpoint write during epoch 1 of the online branch, then the same command again: the
    rerun resumes from the last whole checkpoint (prepare and split skipped) and ends with the epoch ends, taus,
    batches and bit-identical drafter of the unkilled run. Both runs start at online, in a copy of the unkilled
    run's work folder after split."""
    preset, reference, _ = online_run
    workdir = _extracted_workdir(reference, tmp_path / "work", stages=("prepare", "split"))
    rerun, resumed, uninterrupted = _kill_then_rerun(preset, workdir, reference)
    assert rerun.stdout.count("complete, skipped") == 2  # prepare, split: the copied ones
    assert not (workdir / "cache").exists()
    assert resumed.trainer_state["counters"]["data_digest"] == uninterrupted.trainer_state["counters"]["data_digest"]
