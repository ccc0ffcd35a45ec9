"""The train stage on a tiny real cache (real SmolLM2 hidden states of stdlib snippets): exact resume, refusal of
mismatched inputs before step 1, non-finite steps skipped and counted, telemetry written."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from cli_helpers import COUNT, DURATION
from safetensors.torch import load_file
from train_helpers import build_tiny_cache, tiny_config

from dflash.drafter.config import DrafterTrainingConfig
from dflash.errors import CheckpointError, ConfigError, MismatchError
from dflash.training.checkpoint import load_checkpoint
from dflash.training.optim import OptimConfig
from dflash.training.telemetry import read_metrics
from stages.train.config import TrainConfig
from stages.train.launch import run_training


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory, target):
    return build_tiny_cache(tmp_path_factory.mktemp("cache") / "tiny.zarr", target)


def _checkpoint_state(run_dir, step):
    checkpoint = load_checkpoint(run_dir / "checkpoints" / f"step_{step:08d}")
    return checkpoint


def _assert_same_state(a, b):
    assert a.model_state.keys() == b.model_state.keys()
    for name in a.model_state:
        assert torch.equal(a.model_state[name], b.model_state[name]), name
    state_a, state_b = a.optimizer_state["state"], b.optimizer_state["state"]
    assert state_a.keys() == state_b.keys()
    for index in state_a:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state_a[index][key], state_b[index][key]), (index, key)
    assert a.optimizer_state["param_groups"] == b.optimizer_state["param_groups"]  # lr included
    assert a.trainer_state["scheduler"] == b.trainer_state["scheduler"]
    assert a.trainer_state["data"] == b.trainer_state["data"]  # data cursor: epoch and position
    assert a.trainer_state["counters"] == b.trainer_state["counters"]  # data_digest: every batch's corpus rows


def test_resume_reproduces_straight_run_bit_exactly(tiny_cache, tmp_path):
    # 4 steps x 3 micro-batches with a 256-token budget (8 batches per epoch) cross an epoch boundary after the
    # resume point (6 micro-batches in).
    common = dict(max_steps=4, grad_accum_steps=3, token_budget=256, save_every=2)
    straight = run_training(tiny_config(tiny_cache, tmp_path / "straight", **common))
    first = run_training(tiny_config(tiny_cache, tmp_path / "resumed", stop_at_step=2, **common))
    assert first["step"] == 2
    resumed = run_training(tiny_config(tiny_cache, tmp_path / "resumed", resume=True, **common))
    assert resumed["step"] == straight["step"] == 4
    assert resumed["data_digest"] == straight["data_digest"]
    _assert_same_state(_checkpoint_state(tmp_path / "straight", 2), _checkpoint_state(tmp_path / "resumed", 2))
    end_straight = _checkpoint_state(tmp_path / "straight", 4)
    end_resumed = _checkpoint_state(tmp_path / "resumed", 4)
    _assert_same_state(end_straight, end_resumed)
    assert end_straight.trainer_state["data"]["epoch"] >= 1  # the data order was checked across an epoch
    # Each checkpoint carries the resolved config and the environment, not only the run folder.
    assert end_straight.trainer_state["resolved"]["total_steps"] == 4
    assert end_straight.trainer_state["resolved"]["drafter_config"]["block_size"] == 4
    assert end_straight.trainer_state["environment"]["versions"]["torch"]
    assert resumed["val"]["loss"] == straight["val"]["loss"]

    # Telemetry of the straight run: every logged field is there and sane.
    records = read_metrics(tmp_path / "straight", kind="train")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    last = records[-1]
    for key in ("real_tokens_per_s", "padded_tokens_per_s", "supervised_tokens_per_s", "block_tokens_per_s"):
        assert last[key] > 0
    assert last["padded_tokens_per_s"] >= last["real_tokens_per_s"] >= last["supervised_tokens_per_s"]
    for phase in ("data_wait", "forward", "backward", "optimizer"):
        assert last[f"time_{phase}_s"] >= 0
    assert len(last["accuracy_per_position"]) == 3  # block_size 4 -> positions 1..3
    assert 1.0 <= last["expected_acceptance_length"] <= 4.0
    assert sum(last["bucket_batches"].values()) == 4 * 3
    assert last["skipped_steps"] == 0 and last["lr"] > 0 and last["grad_norm"] > 0
    assert records[0]["loss"] > last["loss"]  # it learns
    assert list((tmp_path / "straight" / "tb").glob("events.out.tfevents.*"))
    run = json.loads((tmp_path / "straight" / "run.json").read_text())
    assert run["config"]["optim"]["lr"] == 1e-3 and run["resolved"]["total_steps"] == 4
    assert run["resolved"]["drafter_config"]["target_layer_ids"] == [1, 3]
    assert run["resolved"]["attention"] == "dense-sdpa"  # CPU: the dense-mask path (a GPU run records flex-*)
    assert run["environment"]["versions"]["torch"] and run["environment"]["python"]
    assert (tmp_path / "straight" / "latest").read_text().strip() == "step_00000004"
    saves = read_metrics(tmp_path / "straight", kind="checkpoint")
    assert [r["step"] for r in saves] == [2, 4] and all(r["stall_s"] >= 0 for r in saves)
    assert saves[1]["previous_write_s"] > 0  # the first write finished in the background before the second save


def _expected_extension_lr(step, *, peak, start, total, warmup_ratio, start_ratio=0.0):
    """docs/training.md (Resume): the added steps [start, total) re-warm linearly from the lr in effect at
    ``start`` to the peak over round(warmup_ratio * added) steps, then cosine-decay to the floor (0 here)."""
    import math

    warmup, offset = round(warmup_ratio * (total - start)), step - start
    if offset < warmup:
        return peak * (start_ratio + (1 - start_ratio) * (offset + 1) / (warmup + 1))
    return peak * 0.5 * (1 + math.cos(math.pi * (offset - warmup) / (total - start - warmup)))


def test_resume_with_more_steps_rewarms_and_resumes_bit_exactly_inside_the_extension(tiny_cache, tmp_path, caplog):
    import logging

    common = dict(validation_fraction=0.0, save_every=2)
    finished = tmp_path / "finished"
    run_training(tiny_config(tiny_cache, finished, max_steps=4, **common))
    assert load_checkpoint(finished).optimizer_state["param_groups"][0]["lr"] == 0.0  # the schedule ended at lr 0
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    shutil.copytree(finished, straight)
    shutil.copytree(finished, interrupted)

    extend = dict(max_steps=8, resume=True, allow_config_change=True, **common)
    with caplog.at_level(logging.INFO, logger="stages.train.loop"):
        extended = run_training(tiny_config(tiny_cache, straight, **extend))
    assert extended["step"] == extended["total_steps"] == 8
    (line,) = [r.getMessage() for r in caplog.records if "lr schedule extended" in r.getMessage()]
    assert "at step 4: total steps 4 -> 8" in line and "over 1 steps" in line
    records = {r["step"]: r for r in read_metrics(straight, kind="train")}
    assert sorted(records) == list(range(1, 9))
    for step in range(5, 9):  # metrics log the lr of step n, i.e. the multiplier at 0-based step n - 1
        expected = _expected_extension_lr(step - 1, peak=1e-3, start=4, total=8, warmup_ratio=0.2)
        assert records[step]["lr"] == pytest.approx(expected, rel=1e-12) and records[step]["lr"] > 0, step
    assert records[6]["lr"] == pytest.approx(1e-3)  # back at the peak after the 1-step re-warm
    end = load_checkpoint(straight)
    (base, extension) = end.trainer_state["schedule"]
    assert base["total_steps"] == 4 and extension == {
        "schedule": "cosine", "start_step": 4, "total_steps": 8, "warmup_steps": 1, "decay_steps": 0, "start_lr": 0.0,
        "peak_lr": 1e-3, "end_lr": 0.0}

    # Killed inside the extension, then resumed with the now saved config (no --allow-config-change needed): the
    # same weights, optimizer state, schedule, data order and losses as the uninterrupted extension.
    stopped = run_training(tiny_config(tiny_cache, interrupted, stop_at_step=6, **extend))
    assert stopped["step"] == 6
    resumed = run_training(tiny_config(tiny_cache, interrupted, max_steps=8, resume=True, **common))
    assert resumed["step"] == 8 and resumed["data_digest"] == extended["data_digest"]
    _assert_same_state(end, load_checkpoint(interrupted))
    again = {r["step"]: r for r in read_metrics(interrupted, kind="train")}
    assert [again[s]["loss"] for s in range(5, 9)] == [records[s]["loss"] for s in range(5, 9)]
    assert [again[s]["lr"] for s in range(5, 9)] == [records[s]["lr"] for s in range(5, 9)]


def test_wsd_run_resumes_bit_exactly_across_a_checkpoint(tiny_cache, tmp_path):
    """``optim.schedule = "wsd"``: a run stopped at step 3 of 6 and resumed ends in the state of the straight run,
    and its lr follows warmup (1 step), the peak, then the linear decay over the last round(0.5 * 6) = 3 steps."""
    common = dict(max_steps=6, save_every=3, validation_fraction=0.0, schedule="wsd", decay_ratio=0.5)
    straight = run_training(tiny_config(tiny_cache, tmp_path / "straight", **common))
    stopped = run_training(tiny_config(tiny_cache, tmp_path / "resumed", stop_at_step=3, **common))
    assert stopped["step"] == 3
    resumed = run_training(tiny_config(tiny_cache, tmp_path / "resumed", resume=True, **common))
    assert resumed["step"] == straight["step"] == 6 and resumed["data_digest"] == straight["data_digest"]
    _assert_same_state(_checkpoint_state(tmp_path / "straight", 6), _checkpoint_state(tmp_path / "resumed", 6))
    lrs = [r["lr"] for r in read_metrics(tmp_path / "resumed", kind="train")]
    assert lrs == pytest.approx([1e-3 * m for m in (0.5, 1.0, 1.0, 1.0, 2 / 3, 1 / 3)])
    assert lrs == [r["lr"] for r in read_metrics(tmp_path / "straight", kind="train")]
    (segment,) = _checkpoint_state(tmp_path / "resumed", 6).trainer_state["schedule"]
    assert (segment["schedule"], segment["warmup_steps"], segment["decay_steps"]) == ("wsd", 1, 3)


def test_distill_kl_trains_on_the_final_tap_and_logs_the_loss_parts(target, tmp_path):
    """A cache with the final tap (real target states, fp8 storage); 3 steps with ``drafter.distill = "kl"``: the
    metrics carry ``ce_loss`` and ``distill_loss`` beside ``loss`` = ce_weight * CE + distill_weight * KL, all
    finite and positive, on the training and the validation split."""
    cache = build_tiny_cache(tmp_path / "final.zarr", target, num_samples=8, max_tokens=64, final_tap=True,
                             storage_dtype="float8_e4m3fn")
    summary = run_training(tiny_config(cache, tmp_path / "run", max_steps=3, save_every=3, eval_every=3,
                                       drafter={"distill": "kl", "distill_weight": 0.5, "ce_weight": 0.25}))
    assert summary["step"] == 3
    records = read_metrics(tmp_path / "run", kind="train")
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert record["ce_loss"] > 0 and record["distill_loss"] > 0
        assert record["loss"] == pytest.approx(0.25 * record["ce_loss"] + 0.5 * record["distill_loss"], rel=1e-6)
    (validation,) = read_metrics(tmp_path / "run", kind="val")
    assert validation["distill_loss"] > 0
    assert validation["loss"] == pytest.approx(0.25 * validation["ce_loss"] + 0.5 * validation["distill_loss"])


def test_distill_on_a_cache_without_the_final_tap_is_refused_before_training(tiny_cache, tmp_path, monkeypatch,
                                                                             capsys):
    from cli_helpers import main_in_process

    with pytest.raises(ConfigError, match=r"has no final tap .*extract --final-tap.*drafter.distill = none"):
        run_training(tiny_config(tiny_cache, tmp_path / "run", drafter={"distill": "tv"}))
    code, err = main_in_process(monkeypatch, capsys, "train", "--cache", str(tiny_cache), "--output",
                                str(tmp_path / "cli-run"), "--device", "cpu", "--set", "train.drafter.distill=kl")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "extract --final-tap" in lines[0], err
    assert "Traceback" not in err
    assert not (tmp_path / "run" / "run.json").exists() and not (tmp_path / "cli-run" / "run.json").exists()


@pytest.fixture(scope="module")
def preempted_run(tiny_cache, tmp_path_factory):
    """A run of a 2-step schedule stopped after step 1 (as a preemption would), shared read-only."""
    run_dir = tmp_path_factory.mktemp("preempted") / "run"
    run_training(tiny_config(tiny_cache, run_dir, max_steps=2, stop_at_step=1, validation_fraction=0.0))
    return run_dir


def test_resume_with_a_trajectory_change_says_so(tiny_cache, preempted_run, tmp_path):
    shutil.copytree(preempted_run, tmp_path / "run")
    with pytest.raises(CheckpointError, match=r"lr: 0\.001 -> 0\.002"):
        run_training(tiny_config(tiny_cache, tmp_path / "run", max_steps=2, lr=2e-3, resume=True, validation_fraction=0.0))
    # Several ranks: refused by the launcher before any rank is spawned (one error, not a failed launch per rank).
    with pytest.raises(CheckpointError, match=r"global batch \(world_size x grad_accum_steps\): 1 x 1 -> 2 x 1"):
        run_training(tiny_config(tiny_cache, tmp_path / "run", max_steps=2, resume=True, validation_fraction=0.0,
                                 drafter_processes=2))
    # Runtime-only changes are fine, and --allow-config-change goes on anyway.
    summary = run_training(
        tiny_config(tiny_cache, tmp_path / "run", max_steps=2, lr=2e-3, resume=True, allow_config_change=True,
                    validation_fraction=0.0, log_every=5)
    )
    assert summary["step"] == 2
    # A fresh run into an existing run folder is refused instead of overwriting it.
    with pytest.raises(CheckpointError, match="--resume"):
        run_training(tiny_config(tiny_cache, tmp_path / "run", max_steps=2, validation_fraction=0.0))


@pytest.mark.parametrize(
    ("cache_kwargs", "config_kwargs", "field"),
    [
        ({"target_identity_override": {"content_hash": "sha256:" + "1" * 64, "name": "other-model"}}, {}, "target.content_hash"),
        ({"target_identity_override": {"num_hidden_layers": 32}}, {}, "target.num_hidden_layers"),
        ({}, {"target_layer_ids": [1, 2]}, "target_layer_ids"),
    ],
)
def test_mismatched_cache_is_refused_before_step_1(target, tmp_path, cache_kwargs, config_kwargs, field):
    cache = build_tiny_cache(tmp_path / "cache.zarr", target, num_samples=6, num_shards=1, **cache_kwargs)
    config = tiny_config(cache, tmp_path / "run", validation_fraction=0.0, **config_kwargs)
    with pytest.raises(MismatchError, match=rf"^{field} differs"):
        run_training(config)
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before anything was written


def test_resume_on_a_cache_with_other_layer_ids_is_refused(preempted_run, target, tmp_path):
    shutil.copytree(preempted_run, tmp_path / "run")
    other = build_tiny_cache(tmp_path / "other.zarr", target, num_samples=6, num_shards=1, layer_ids=[1, 2])
    config = tiny_config(other, tmp_path / "run", max_steps=2, resume=True, validation_fraction=0.0)
    with pytest.raises(MismatchError, match=r"^target_layer_ids differs: cache .* has \[1, 2\], got \[1, 3\]"):
        run_training(config)


def test_mask_token_must_be_a_real_embedding_row(tiny_cache, tmp_path):
    with pytest.raises((ConfigError, MismatchError), match="mask_token_id"):
        run_training(tiny_config(tiny_cache, tmp_path / "run", mask_token_id=49152, validation_fraction=0.0))


def test_output_folder_of_other_files_is_refused_and_left_untouched(tiny_cache, tmp_path):
    output = tmp_path / "userdata"
    output.mkdir()
    (output / "important.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not a dflash run"):
        run_training(tiny_config(tiny_cache, output, validation_fraction=0.0))
    assert sorted(p.name for p in output.iterdir()) == ["important.txt"]


@pytest.mark.parametrize("where", ["loss", "gradient"])
def test_nonfinite_step_is_skipped_and_counted(tiny_cache, tmp_path, monkeypatch, where):
    import stages.train.loop as trainer_module

    real_loss = trainer_module.dflash_loss
    calls = {"n": 0, "poison_grad": False}

    def poison_grad_once(grad):
        if calls["poison_grad"]:
            calls["poison_grad"] = False
            return torch.full_like(grad, float("inf"))
        return grad

    def poisoned(drafter, batch, anchors, **kwargs):
        out = real_loss(drafter, batch, anchors, **kwargs)
        calls["n"] += 1
        if calls["n"] == 1 and where == "gradient":
            drafter.fc.weight.register_hook(poison_grad_once)
        if calls["n"] == 2:  # the second training step (grad_accum 1, no evaluation before it)
            if where == "loss":
                out.weighted_ce_sum = out.weighted_ce_sum * float("nan")
            else:
                calls["poison_grad"] = True
        return out

    monkeypatch.setattr(trainer_module, "dflash_loss", poisoned)
    summary = run_training(tiny_config(tiny_cache, tmp_path / "run", max_steps=3, save_every=1, validation_fraction=0.0))
    assert summary["skipped_steps"] == 1
    records = read_metrics(tmp_path / "run", kind="train")
    assert [r["skipped_steps"] for r in records] == [0, 1, 1]
    if where == "loss":
        assert records[1]["loss"] == "nan"  # logged as it was (JSON has no NaN literal)
    assert all(isinstance(r["loss"], float) for r in (records[0], records[2]))
    # The skipped step left weights and optimizer state exactly as they were after step 1.
    after_1 = load_checkpoint(tmp_path / "run" / "checkpoints" / "step_00000001")
    after_2 = load_checkpoint(tmp_path / "run" / "checkpoints" / "step_00000002")
    for name, value in after_1.model_state.items():
        assert torch.equal(value, after_2.model_state[name]), name
    assert all(torch.isfinite(v).all() for v in after_2.model_state.values())
    assert after_2.optimizer_state["state"][0]["step"].item() == 1
    final = load_file(str(tmp_path / "run" / "checkpoints" / "step_00000003" / "model.safetensors"))
    assert not torch.equal(final["fc.weight"], after_2.model_state["fc.weight"])  # training went on


def test_sigterm_stops_after_the_step_with_a_checkpoint(tiny_cache, tmp_path, monkeypatch):
    import os
    import signal

    import stages.train.loop as trainer_module

    real_loss = trainer_module.dflash_loss
    calls = {"n": 0}

    def preempted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice in the middle of step 2
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "dflash_loss", preempted)
    handler_before = signal.getsignal(signal.SIGTERM)
    config = tiny_config(tiny_cache, tmp_path / "run", max_steps=4, save_every=10, validation_fraction=0.0)
    summary = run_training(config)
    assert summary["stopped_by_signal"] and summary["step"] == 2
    assert (tmp_path / "run" / "latest").read_text().strip() == "step_00000002"
    assert signal.getsignal(signal.SIGTERM) == handler_before  # the previous handler is back
    monkeypatch.setattr(trainer_module, "dflash_loss", real_loss)
    resumed = run_training(tiny_config(tiny_cache, tmp_path / "run", max_steps=4, save_every=10,
                                       validation_fraction=0.0, resume=True))
    assert resumed["step"] == 4 and not resumed["stopped_by_signal"]


def test_samples_with_too_few_supervised_tokens_are_excluded_counted_and_reported(tiny_cache, tmp_path, caplog):
    import logging

    from dflash.cache import CacheReader

    reader = CacheReader(tiny_cache)
    counts = sorted(int(c) for shard in reader.shards for c in reader.shard_supervised_counts(shard))
    minimum = counts[len(counts) // 3]  # a real threshold on this cache: about a third of the samples fall below
    expected = sum(c < minimum for c in counts)
    assert expected > 0
    assert tiny_config(tiny_cache, tmp_path / "x").resolved_min_supervised_tokens() == 2 * 4  # default 2 * B
    with caplog.at_level(logging.INFO, logger="stages.train.loop"):
        summary = run_training(
            tiny_config(tiny_cache, tmp_path / "run", max_steps=1, min_supervised_tokens=minimum, validation_fraction=0.2)
        )
    assert summary["excluded_short_samples"] == expected
    assert any(f"excluded {expected} of {len(counts)} samples" in r.getMessage() for r in caplog.records)
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    excluded = run["resolved"]["excluded_samples"]
    assert excluded["min_supervised_tokens"] == minimum and excluded["excluded_short_samples"] == expected
    assert excluded["excluded_short_samples_train"] + excluded["excluded_short_samples_validation"] == expected
    assert run["resolved"]["train_loader"]["excluded_short_samples"] == excluded["excluded_short_samples_train"]
    assert run["resolved"]["train_loader"]["num_samples"] + run["resolved"]["validation_loader"]["num_samples"] == (
        len(counts) - expected
    )
    (data,) = read_metrics(tmp_path / "run", kind="data")
    assert data["excluded_short_samples"] == expected and data["min_supervised_tokens"] == minimum


def test_loaders_copy_to_the_gpu_on_their_side_stream_when_training_on_cuda(tiny_cache, tmp_path):
    from stages.train.loop import Trainer

    config = tiny_config(tiny_cache, tmp_path / "run")
    # Construction touches no device: the placement the loaders get is checked without a GPU.
    on_gpu = Trainer(config, rank=1, world_size=2, device=torch.device("cuda", 1))._loader_placement()
    assert on_gpu == {"rank": 1, "world_size": 2, "device": torch.device("cuda", 1)}
    on_cpu = Trainer(config, device=torch.device("cpu"))._loader_placement()
    assert on_cpu == {"rank": 0, "world_size": 1, "device": None}  # CPU: batches stay where they are read


@pytest.mark.gpu
def test_gpu_loader_streams_batches_onto_the_device(tiny_cache, tmp_path):
    from stages.train.loop import Trainer

    trainer = Trainer(tiny_config(tiny_cache, tmp_path / "run", device="cuda"), device=torch.device("cuda", 0))
    try:
        trainer.load()
        assert trainer.train_loader.device == torch.device("cuda", 0)
        assert trainer.train_loader._copy_stream is not None  # the overlapped side-stream copy
        batch, anchors = trainer._next_batch()
        assert batch.hidden.is_cuda and batch.hidden.device == anchors.device
    finally:
        trainer.close()


@pytest.mark.parametrize("compile_layers", [False, True])
def test_compile_flag_wires_compiled_layers_and_fixed_shape_anchors(tiny_cache, tmp_path, monkeypatch, compile_layers):
    """--compile: drafter.compile_layers(), every micro-batch padded to token_budget, sample_anchors(num_anchors=
    anchor_slots) in training and validation; eager (dynamic shapes) by default. compile_layers is recorded, not
    run: torch.compile itself is exercised on the GPU (test_gpu_compiled_fixed_shape_path)."""
    import stages.train.loop as trainer_module
    from dflash.drafter import DFlashDrafter

    calls = {"compile": 0, "shapes": []}
    monkeypatch.setattr(DFlashDrafter, "compile_layers", lambda self, **kw: calls.__setitem__("compile", calls["compile"] + 1))
    real_sample = trainer_module.sample_anchors

    def recording(batch, block_size, max_anchors, generator, *, num_anchors=None):
        anchors = real_sample(batch, block_size, max_anchors, generator, num_anchors=num_anchors)
        calls["shapes"].append((batch.num_tokens, num_anchors, tuple(anchors.shape)))
        return anchors

    monkeypatch.setattr(trainer_module, "sample_anchors", recording)
    config = tiny_config(tiny_cache, tmp_path / "run", max_steps=2, save_every=2, compile=compile_layers,
                         max_documents_per_batch=3)
    assert TrainConfig(cache="c", output="o").compile is False  # eager is the default
    run_training(config)
    assert calls["shapes"], "no anchors sampled"
    if compile_layers:
        slots = config.resolved_anchor_slots()
        assert slots == 2 * 3  # max_anchors_per_document x max_documents_per_batch
        assert calls["compile"] == 1
        assert all(tokens == config.data.token_budget and n == slots and shape == (slots,) for tokens, n, shape in calls["shapes"])
        assert all("compiled_graphs" in r for r in read_metrics(tmp_path / "run", kind="train"))  # logged with compile
    else:
        assert calls["compile"] == 0
        assert not any("compiled_graphs" in r for r in read_metrics(tmp_path / "run", kind="train"))
        assert all(n is None for _, n, _ in calls["shapes"])
        assert any(tokens != config.data.token_budget for tokens, _, _ in calls["shapes"])  # dynamic shapes


def test_config_fields_are_validated_with_their_names(tmp_path):
    with pytest.raises(ConfigError, match="grad_accum_steps"):
        TrainConfig(cache="c", output="o", grad_accum_steps=0)
    with pytest.raises(ConfigError, match="warmup_ratio"):
        TrainConfig(cache="c", output="o", optim=OptimConfig(warmup_ratio=1.5))
    with pytest.raises(ConfigError, match="optim.betas"):  # a nested config given as a dict names its path
        TrainConfig(cache="c", output="o", optim={"betas": (0.9, 1.5)})
    for drafter, name in (({"block_size": 1}, "drafter.block_size"), ({"gamma": -1.0}, "drafter.gamma"),
                          ({"num_draft_layers": 0}, "drafter.num_draft_layers"),
                          ({"mask_token_id": -1}, "drafter.mask_token_id"),
                          ({"max_anchors_per_document": True}, "drafter.max_anchors_per_document")):
        with pytest.raises(ConfigError, match=f"^{name} must be"):
            TrainConfig(cache="c", output="o", drafter=drafter)
    with pytest.raises(ConfigError, match="block_size must be an integer >= 2"):
        DrafterTrainingConfig(block_size=1)
    assert DrafterTrainingConfig(target_layer_ids=("1", 3)).target_layer_ids == [1, 3]
    assert DrafterTrainingConfig(block_size=8).resolved_gamma() == 4.0
    with pytest.raises(ConfigError, match="drafter_gpus"):
        TrainConfig(cache="c", output="o", drafter_gpus=[1, 1])
    with pytest.raises(ConfigError, match="residual_dtype"):
        TrainConfig(cache="c", output="o", residual_dtype="bfloat16")
    config = TrainConfig(cache="c", output="o", save_every=7)
    assert config.eval_every == 7 and config.optim.betas == (0.9, 0.999)
    assert TrainConfig.from_dict(config.to_dict()) == config
    assert TrainConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config  # through run.json's JSON


def test_cli_help_lists_the_options():
    from typer.testing import CliRunner

    from stages.cli import _register_all, app

    _register_all()
    result = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "200"})  # no truncated names
    assert result.exit_code == 0, result.output
    for option in ("--cache", "--output", "--resume", "--drafter-gpus", "--grad-accum-steps", "--betas",
                   "--min-supervised-tokens"):
        assert option in result.output


@pytest.mark.gpu
def test_gpu_bf16_training_step_and_checkpoint(tiny_cache, tmp_path):
    summary = run_training(tiny_config(tiny_cache, tmp_path / "run", device="cuda", max_steps=3, save_every=3))
    assert summary["skipped_steps"] == 0 and summary["val"]["loss"] > 0
    checkpoint = load_checkpoint(tmp_path / "run")
    assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in checkpoint.model_state.values())
    record = read_metrics(tmp_path / "run", kind="train")[-1]
    assert record["time_forward_s"] > 0 and record["real_tokens_per_s"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_ddp_two_gpus_matches_one_gpu_with_accumulation(tiny_cache, tmp_path):
    common = dict(device="cuda", max_steps=3, save_every=3, mixed_precision="none")
    run_training(tiny_config(tiny_cache, tmp_path / "ddp", drafter_gpus=[0, 1], **common))
    run_training(tiny_config(tiny_cache, tmp_path / "one", drafter_gpus=[0], grad_accum_steps=2, **common))
    a, b = load_checkpoint(tmp_path / "ddp"), load_checkpoint(tmp_path / "one")
    for name, value in a.model_state.items():
        torch.testing.assert_close(value, b.model_state[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.gpu
def test_gpu_compiled_fixed_shape_path(tiny_cache, tmp_path):
    summary = run_training(
        tiny_config(tiny_cache, tmp_path / "run", device="cuda", compile=True, max_documents_per_batch=4, max_steps=3)
    )
    assert summary["skipped_steps"] == 0 and summary["val"]["loss"] > 0
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["resolved"]["train_loader"]["config"]["pad_to_budget"] is True


def test_runs_saved_before_residual_dtype_resume_with_a_float32_residual(tmp_path):
    """A run.json written before ``residual_dtype`` existed resumes with the float32 residual it trained with, and a
    request for another one is reported as a trajectory change."""
    from stages.train.command import config_from_cli
    from stages.train.resume import trajectory_changes

    run = tmp_path / "run"
    run.mkdir()
    saved = TrainConfig(cache="c", output=str(run)).to_dict()
    del saved["residual_dtype"]
    (run / "run.json").write_text(json.dumps({"config": saved}))
    resumed = config_from_cli({"output": str(run), "resume": True})
    assert resumed.residual_dtype == "float32"
    assert trajectory_changes(saved, resumed.to_dict(), saved_world_size=1, world_size=1) == []
    explicit = config_from_cli({"output": str(run), "resume": True, "residual_dtype": "compute"})
    assert trajectory_changes(saved, explicit.to_dict(), saved_world_size=1, world_size=1) == [
        "residual_dtype: 'float32' -> 'compute'"]
    assert TrainConfig(cache="c", output="o").residual_dtype == "compute"  # new runs


def test_runs_saved_before_the_document_split_resume_with_the_row_split(tmp_path):
    """A run.json (and a checkpoint's config) written before ``data.validation_split_by`` existed resumes with the
    row split it validated on; asking for the document split on resume is refused like a changed
    validation_fraction (the validation set, hence the best checkpoint, would change)."""
    from dflash.errors import CheckpointError
    from stages.train.command import config_from_cli
    from stages.train.resume import check_resume_changes, trajectory_changes

    run = tmp_path / "run"
    run.mkdir()
    saved = TrainConfig(cache="c", output=str(run)).to_dict()
    assert saved["data"].pop("validation_split_by") == "document"  # new runs split by document
    (run / "run.json").write_text(json.dumps({"config": saved}))
    resumed = config_from_cli({"output": str(run), "resume": True})
    assert resumed.data.validation_split_by == "row"
    assert trajectory_changes(saved, resumed.to_dict(), saved_world_size=1, world_size=1) == []
    explicit = config_from_cli({"output": str(run), "resume": True, "data.validation_split_by": "document"})
    assert trajectory_changes(saved, explicit.to_dict(), saved_world_size=1, world_size=1) == [
        "data.validation_split_by: 'row' -> 'document'"]
    with pytest.raises(CheckpointError, match=r"data.validation_split_by: 'row' -> 'document'.*--allow-config-change"):
        check_resume_changes(run / "checkpoints" / "step_00000001", {"config": saved}, explicit, 1)
    # It decides the batch plan, which the saved data cursor cannot leave: --allow-config-change does not cover it
    # (the loader would refuse the cursor later, after a warning that promised to go on).
    explicit.allow_config_change = True
    with pytest.raises(CheckpointError, match=r"validation_split_by.*cursor cannot continue.*does not cover them"):
        check_resume_changes(run / "checkpoints" / "step_00000001", {"config": saved}, explicit, 1)
    with pytest.raises(ConfigError, match=r"train.data.validation_split_by \(--validation-split-by\): must be "
                                          r"'document' or 'row'; got 'doc'"):
        config_from_cli({"output": str(tmp_path / "new"), "cache": "c", "data.validation_split_by": "doc"})


def test_a_nested_section_of_a_file_under_an_option_and_set(tmp_path):
    """An option or ``--set`` over a file's nested section (``[train.optim]``) replaces that field only."""
    from stages.train.command import config_from_cli

    paths = {"cache": "c", "output": str(tmp_path / "run"), "device": "cpu"}
    (tmp_path / "nested.toml").write_text("[train.drafter]\nblock_size = 8\n[train.optim]\nlr = 3e-4\n")
    layered = config_from_cli({**paths, "optim.warmup_ratio": 0.1}, tmp_path / "nested.toml",
                              sets=["train.optim.eps=1e-6"])
    assert (layered.optim.lr, layered.optim.warmup_ratio, layered.optim.eps) == (3e-4, 0.1, 1e-6)


def test_a_partial_nested_section_keeps_the_train_stages_other_defaults(tmp_path):
    """``[train.data] token_budget = 512`` changes that field only: the rest of ``data`` keeps the train stage's
    defaults (1% held out for validation, not the loader class's 0), and ``print-config`` prints it nested."""
    from stages.train.command import config_from_cli

    (tmp_path / "cfg.toml").write_text("[train.data]\ntoken_budget = 512\n")
    config = config_from_cli({"cache": "c", "output": str(tmp_path / "run")}, tmp_path / "cfg.toml")
    assert (config.data.token_budget, config.data.validation_fraction) == (512, 0.01)
    assert config.data == TrainConfig.from_dict({"cache": "c", "output": "o", "data": {"token_budget": 512}}).data
    assert config.to_dict()["data"]["token_budget"] == 512 and "token_budget" not in config.to_dict()


def _files(folder):
    return {p.relative_to(folder): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


def test_resume_refused_by_the_data_state_writes_nothing(preempted_run, target, tmp_path):
    # Same taps, other content: the checks on identity pass, restoring the data cursor refuses (after the drafter,
    # optimizer and loaders exist): no metrics record and no TensorBoard events file may appear.
    shutil.copytree(preempted_run, tmp_path / "run")
    before = _files(tmp_path / "run")
    other = build_tiny_cache(tmp_path / "other.zarr", target, num_samples=12, num_shards=1)
    with pytest.raises(CheckpointError):
        run_training(tiny_config(other, tmp_path / "run", max_steps=2, resume=True, validation_fraction=0.0))
    assert _files(tmp_path / "run") == before


def test_an_attempt_killed_after_its_checkpoint_leaves_each_step_once_in_the_metrics(tiny_cache, preempted_run, tmp_path):
    # The preempted run checkpointed step 1; an attempt that logged steps 2 and 3 and died before checkpointing
    # them (simulated by appending its records) must not leave them beside the rerun's own steps 2 and 3.
    shutil.copytree(preempted_run, tmp_path / "run")
    with open(tmp_path / "run" / "metrics.jsonl", "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"kind": "data", "step": 1}) + "\n")
        for step in (2, 3):
            handle.write(json.dumps({"kind": "train", "step": step, "loss": 99.0}) + "\n")
        handle.write('{"kind": "train", "st')  # torn by the kill
    run_training(tiny_config(tiny_cache, tmp_path / "run", max_steps=3, resume=True, validation_fraction=0.0,
                             allow_config_change=True))
    records = read_metrics(tmp_path / "run")
    train_steps = [r["step"] for r in records if r["kind"] == "train"]
    assert train_steps == [1, 2, 3] and all(r["loss"] != 99.0 for r in records if r["kind"] == "train")
    assert [r["step"] for r in records if r["kind"] == "data"] == [0, 1]


def test_cpu_runs_get_cpu_sized_batches_unless_a_setting_says_otherwise(tmp_path):
    """``train`` with its defaults on a CPU host: the GPU-sized token budget and anchors per document are
    replaced by the cpu-small preset's, so the first step is not OOM-killed minutes later; anything set wins, and a
    CUDA run keeps the paper's sizes."""
    from stages.train.command import CPU_SIZED_DEFAULTS, config_from_cli

    paths = {"cache": str(tmp_path / "c"), "output": str(tmp_path / "o")}
    assert not torch.cuda.is_available()  # the CPU-only suite
    sized = config_from_cli({**paths, "device": "cpu"})
    assert (sized.data.token_budget, sized.drafter.max_anchors_per_document) == tuple(CPU_SIZED_DEFAULTS.values())
    assert config_from_cli(paths).data.token_budget == CPU_SIZED_DEFAULTS["data.token_budget"]  # auto without CUDA: CPU
    given = config_from_cli({**paths, "data.token_budget": 4096})
    assert (given.data.token_budget, given.drafter.max_anchors_per_document) == (4096, CPU_SIZED_DEFAULTS["drafter.max_anchors_per_document"])
    (tmp_path / "cfg.toml").write_text("[train.drafter]\nmax_anchors_per_document = 64\n")
    assert config_from_cli(paths, tmp_path / "cfg.toml").drafter.max_anchors_per_document == 64
    gpu = TrainConfig(cache="c", output="o")
    assert (gpu.data.token_budget, gpu.drafter.max_anchors_per_document) == (16384, 512)  # the paper's, kept for CUDA
    assert config_from_cli({**paths, "device": "cuda"}).data.token_budget == 16384


def test_progress_line_spells_out_the_online_feed():
    """The online figures on the progress line say what they are: each side's capacity alone, the ring's fill."""
    from types import SimpleNamespace

    from dflash.training.telemetry import ThroughputWindow
    from stages.train.loop import Trainer

    state = SimpleNamespace(throughput=ThroughputWindow(), counters={"skipped_steps": 0},
                            _feed={"producer_capacity_tokens_per_s": 55.0, "trainer_capacity_tokens_per_s": 28.0,
                                   "ring_ready_mean": 4.0}, _logged_loss=None)
    line = Trainer._status(state, {"loss": 1.5, "lr": 1e-4}, {})
    assert "(inference alone 55 training alone 28 tok/s, ring 4.0 batches ready)" in line
    # The loss shown is the last train record's (final_losses), not the step's: none before the first record.
    assert line.startswith("loss -  lr")
    state._logged_loss = 0.8043
    assert Trainer._status(state, {"loss": 1.226, "lr": 1e-4}, {}).startswith("loss 0.804  lr")


def test_progress_in_a_log_gives_steps_tokens_rate_eta_and_the_loss(tiny_cache, tmp_path, capsys):
    """stdout not a terminal (captured, as a log file): no bar, a line every ``telemetry.progress_interval`` seconds
    with steps, tokens, rates, the ETA and the bar's status (the last train record's loss), and one at the end."""
    from stages.train.launch import run_training

    run_training(tiny_config(tiny_cache, tmp_path / "run", progress=True, progress_interval=0.001, max_steps=4))
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("train: ")]
    step = rf"{COUNT} tokens, {COUNT} tok/s, {COUNT} steps/s"
    assert any(re.match(rf"train: [123]/4 steps, {step}, ETA {DURATION}, loss \d+\.\d{{3}}  lr ", line) for line in lines), lines
    assert re.match(rf"train: 4/4 steps, {step}, done in {DURATION}, loss \d+\.\d{{3}}  lr ", lines[-1]), lines[-1]
    assert "━" not in out


def test_too_few_training_samples_are_refused_before_any_model_loads(tiny_cache, tmp_path, monkeypatch, capsys):
    """The real CLI on a real cache that leaves fewer than --min-train-samples (default 8) samples for training once
    the short ones are excluded and validation holds its share out: exit 2, one error line naming every count and
    the settings that change them, and no run folder (the drafter and the target were never loaded)."""
    from cli_helpers import main_in_process

    from dflash.cache import CacheReader

    reader = CacheReader(tiny_cache)
    counts = sorted(int(c) for shard in reader.shards for c in reader.shard_supervised_counts(shard))
    minimum = counts[-6]  # about six samples keep enough supervised tokens
    excluded = sum(c < minimum for c in counts)
    assert len(counts) - excluded < 8
    config = tiny_config(tiny_cache, tmp_path / "run", min_supervised_tokens=minimum, validation_fraction=0.2).to_dict()
    del config["min_train_samples"]  # the default
    (tmp_path / "config.json").write_text(json.dumps({"train": config}))
    code, err = main_in_process(monkeypatch, capsys, "train", "--config", str(tmp_path / "config.json"))
    assert code == 2, err
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    message = lines[0]
    assert f"has {len(counts)} samples: {excluded} excluded for fewer than {minimum} supervised tokens" in message
    assert "held out for validation (--validation-fraction 0.2)" in message
    assert "training needs at least 8 (--min-train-samples)" in message
    for fix in ("add data", "lower --min-supervised-tokens", "--validation-fraction 0", "lower --min-train-samples"):
        assert fix in message
    assert not (tmp_path / "run").exists()


def test_a_resume_may_change_every_field_declared_runtime_and_no_other():
    """The fields a resume may change are the run's identity plus those declared ``runtime`` in their metadata (the
    progress lines' interval among them); a field without it is a trajectory change."""
    from stages.train.resume import trajectory_changes

    saved = TrainConfig(cache="c", output="o").to_dict()
    reporting = TrainConfig(cache="c", output="o", save_every=7, keep_last=1, max_validation_batches=2,
                            telemetry={"progress_interval": 5.0, "log_every": 3, "progress": False},
                            data={"num_read_workers": 2, "prefetch_batches": 1}).to_dict()
    assert trajectory_changes(saved, reporting, saved_world_size=1, world_size=1) == []
    assert trajectory_changes(saved, TrainConfig(cache="c", output="o", optim={"warmup_ratio": 0.1}).to_dict(),
                              saved_world_size=1, world_size=1) == ["optim.warmup_ratio: 0.04 -> 0.1"]
