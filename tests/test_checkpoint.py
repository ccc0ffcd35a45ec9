"""Checkpoints: a snapshot written in the background while training goes on loads back exactly as taken; writes
are atomic with ``latest`` last; retention keeps the last K and the best; load_drafter; the optimizer schedule."""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest
import torch
from train_helpers import TINY_LAYER_IDS, build_tiny_cache

from dflash.batches.stream import StreamConfig, StreamingLoader
from dflash.cache import CacheReader
from dflash.drafter import DFlashConfig, DFlashDrafter, dflash_loss, sample_anchors
from dflash.errors import CheckpointError, ConfigError, MismatchError
from dflash.serving.export import load_drafter
from dflash.training.checkpoint import (
    Checkpointer,
    atomic_write_text,
    capture_rng_state,
    load_checkpoint,
    resolve_checkpoint,
    target_weight_record,
)
from dflash.training.optim import (
    DEFAULT_BETAS,
    LRMultiplier,
    OptimConfig,
    build_optimizer,
    build_scheduler,
    extend_schedule,
    restore_scheduler,
    schedule_segments,
)


class _Training:
    """A real tiny drafter training on real cache batches, stepped by hand."""

    def __init__(self, target, cache):
        config = DFlashConfig.from_target_config(
            target.model.config, tokenizer=target.tokenizer, num_draft_layers=1, block_size=4,
            target_layer_ids=TINY_LAYER_IDS,
        )
        torch.manual_seed(0)
        self.config = config
        self.drafter = DFlashDrafter(config)
        embed = target.model.get_input_embeddings().weight
        self.drafter.attach_target(embed)
        self.target_info = {"target_spec": "default", **target_weight_record(embed, None)}
        self.optimizer = build_optimizer(self.drafter.parameters(), OptimConfig(lr=1e-3))
        self.scheduler = build_scheduler(self.optimizer, OptimConfig(lr=1e-3), total_steps=10)
        loader = StreamingLoader(CacheReader(cache), StreamConfig(token_budget=128, seed=0, prefetch_batches=1))
        self.batches = list(loader)[:3]
        self.step = 0

    def train_step(self):
        batch = self.batches[self.step % len(self.batches)]
        anchors = sample_anchors(batch, 4, 2, torch.Generator().manual_seed(self.step))
        out = dflash_loss(self.drafter, batch, anchors)
        out.loss().backward()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        self.step += 1

    def snapshot(self, checkpointer):
        return checkpointer.snapshot(
            step=self.step, model=self.drafter, optimizer=self.optimizer,
            trainer_state={"scheduler": self.scheduler.state_dict(), "epoch": 0},
            rng_state=capture_rng_state(), drafter_config=self.config.to_dict(), target_info=self.target_info,
        )


@pytest.fixture(scope="module")
def cache(tmp_path_factory, target):
    return build_tiny_cache(tmp_path_factory.mktemp("cache") / "tiny.zarr", target, num_samples=8, num_shards=1)


@pytest.fixture
def training(target, cache):
    return _Training(target, cache)


def test_snapshot_written_while_training_continues_loads_back_exactly(training, tmp_path, monkeypatch):
    import safetensors.torch

    training.train_step()
    checkpointer = Checkpointer(tmp_path / "run", keep_last=2)
    snapshot = training.snapshot(checkpointer)
    expected_model = {k: v.clone() for k, v in training.drafter.state_dict().items()}
    expected_optimizer = {i: {k: v.clone() for k, v in s.items()} for i, s in training.optimizer.state_dict()["state"].items()}
    expected_lr = training.scheduler.get_last_lr()

    # Hold the background writer inside its first file write until training has moved on.
    writing, release = threading.Event(), threading.Event()
    real_save_file = safetensors.torch.save_file

    def slow_save_file(*args, **kwargs):
        writing.set()
        assert release.wait(timeout=60)
        return real_save_file(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", slow_save_file)
    future = checkpointer.save(snapshot)
    assert writing.wait(timeout=60)
    training.train_step()  # parameters and optimizer moments change in place while the write is in flight
    training.train_step()
    assert not torch.equal(training.drafter.fc.weight.detach(), expected_model["fc.weight"])
    assert not (tmp_path / "run" / "latest").exists()  # nothing visible before the write completes
    assert not (tmp_path / "run" / "checkpoints" / "step_00000001").exists()
    release.set()
    checkpointer.close()
    assert future.result().name == "step_00000001"

    loaded = load_checkpoint(tmp_path / "run")
    assert loaded.step == 1 and loaded.path.name == "step_00000001"
    assert loaded.model_state.keys() == expected_model.keys()
    for name, value in expected_model.items():
        assert torch.equal(loaded.model_state[name], value), name
    for index, state in expected_optimizer.items():
        for key, value in state.items():
            assert torch.equal(loaded.optimizer_state["state"][index][key], value), (index, key)
    assert loaded.trainer_state["scheduler"]["_last_lr"] == expected_lr
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))


def test_failed_write_keeps_the_previous_checkpoint(training, tmp_path, monkeypatch):
    checkpointer = Checkpointer(tmp_path / "run")
    training.train_step()
    checkpointer.save(training.snapshot(checkpointer))
    checkpointer.wait()
    training.train_step()

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    import dflash.training.checkpoint

    monkeypatch.setattr(dflash.training.checkpoint, "save_state_tree", broken_save)
    checkpointer.save(training.snapshot(checkpointer))
    with pytest.raises(OSError, match="disk full"):
        checkpointer.wait()
    monkeypatch.undo()
    checkpointer.close()
    assert (tmp_path / "run" / "latest").read_text().strip() == "step_00000001"
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_00000001"]
    assert load_checkpoint(tmp_path / "run").step == 1
    # A writer killed mid-write leaves a temporary folder: it never counts, and the next run clears it.
    (tmp_path / "run" / "checkpoints" / ".tmp-step_00000002-999").mkdir()
    Checkpointer(tmp_path / "run").close()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_00000001"]


def test_retention_keeps_last_k_and_the_best(training, tmp_path):
    checkpointer = Checkpointer(tmp_path / "run", keep_last=2)
    training.train_step()
    for step, val_loss in zip(range(1, 6), [5.0, 3.0, 4.0, 3.5, 6.0], strict=True):
        training.step = step  # retention only looks at step numbers and validation losses
        checkpointer.save(training.snapshot(checkpointer))
        checkpointer.report_validation(step, val_loss)
    checkpointer.close()
    run = tmp_path / "run"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002", "step_00000004", "step_00000005"]
    assert (run / "best").read_text().strip() == "step_00000002"
    assert json.loads((run / "best.json").read_text())["val_loss"] == 3.0
    assert (run / "latest").read_text().strip() == "step_00000005"
    # A new checkpointer on the same run (a resume) remembers the best.
    assert Checkpointer(run, keep_last=2).best["step"] == 2


def test_load_drafter_from_run_and_checkpoint_checks_the_target(training, target, tmp_path):
    training.train_step()
    checkpointer = Checkpointer(tmp_path / "run")
    checkpointer.save(training.snapshot(checkpointer))
    checkpointer.close()
    for path in (tmp_path / "run", tmp_path / "run" / "checkpoints" / "step_00000001"):
        drafter, config, info = load_drafter(path, target=target)
        assert config == training.config and info["target_spec"] == "default"
        for name, value in training.drafter.state_dict().items():
            assert torch.equal(drafter.state_dict()[name], value), name
    # The same target loaded in bf16 (as on a GPU) is still recognised.
    bf16_model = type("M", (), {})()
    embedding = torch.nn.Embedding.from_pretrained(target.model.get_input_embeddings().weight.to(torch.bfloat16))
    bf16_model.get_input_embeddings = lambda: embedding
    bf16_model.get_output_embeddings = lambda: embedding
    load_drafter(tmp_path / "run", target=bf16_model)
    # Another target (one embedding row changed) is refused, naming the tensor.
    other = torch.nn.Embedding.from_pretrained(target.model.get_input_embeddings().weight.clone())
    with torch.no_grad():
        other.weight[7] += 1.0
    other_model = type("M", (), {"get_input_embeddings": lambda self: other, "get_output_embeddings": lambda self: other})()
    with pytest.raises(MismatchError, match="embed_tokens"):
        load_drafter(tmp_path / "run", target=other_model)
    drafter, _, _ = load_drafter(tmp_path / "run")  # no target: weights only
    assert isinstance(drafter, DFlashDrafter) and drafter.embed_weight is None


def test_incomplete_folders_are_refused_by_name(tmp_path):
    (tmp_path / "run" / "checkpoints" / "step_00000003").mkdir(parents=True)
    (tmp_path / "run" / "run.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no checkpoint yet"):
        resolve_checkpoint(tmp_path / "run")
    atomic_write_text(tmp_path / "run" / "latest", "step_00000003\n")
    with pytest.raises(CheckpointError, match="missing model.safetensors, drafter_config.json"):
        resolve_checkpoint(tmp_path / "run")
    atomic_write_text(tmp_path / "run" / "latest", "step_00000009\n")
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(tmp_path / "run")
    assert not list((tmp_path / "run").glob(".latest.tmp-*"))


def test_warmup_cosine_schedule_and_defaults():
    assert DEFAULT_BETAS == (0.9, 0.999) and OptimConfig().lr == 6e-4 and OptimConfig().warmup_ratio == 0.04
    schedule = LRMultiplier(total_steps=100, warmup_steps=4, min_lr_ratio=0.1)
    assert [schedule(s) for s in range(4)] == [0.2, 0.4, 0.6, 0.8]
    assert schedule(4) == 1.0
    assert schedule(52) == pytest.approx(0.1 + 0.9 * 0.5)
    assert schedule(100) == pytest.approx(0.1) and schedule(150) == pytest.approx(0.1)
    parameter = torch.nn.Parameter(torch.zeros(2))
    optimizer = build_optimizer([parameter], OptimConfig(lr=1.0, warmup_ratio=0.04))
    scheduler = build_scheduler(optimizer, OptimConfig(lr=1.0, warmup_ratio=0.04), total_steps=100)
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.999)
    for _ in range(10):
        optimizer.step()
        scheduler.step()
    state = json.loads(json.dumps(scheduler.state_dict()))  # checkpoints store it as JSON
    fresh_optimizer = build_optimizer([parameter], OptimConfig(lr=1.0))
    fresh = build_scheduler(fresh_optimizer, OptimConfig(lr=1.0, warmup_ratio=0.04), total_steps=100)
    fresh.load_state_dict(state)
    assert fresh.get_last_lr() == scheduler.get_last_lr()
    fresh_optimizer.step()
    fresh.step()
    scheduler.step()
    assert fresh.get_last_lr() == scheduler.get_last_lr()


def test_extended_schedule_rewarms_from_the_current_lr_and_round_trips_as_json():
    """A schedule resumed mid-run (step 6 of 10) with 20 steps: the finished part is unchanged, the added 14 steps
    warm from the lr in effect at step 6 to the peak over round(0.25 * 14) = 4 steps, then cosine to the floor."""
    import math

    config = OptimConfig(lr=1.0, warmup_ratio=0.25, min_lr_ratio=0.1)
    parameter = torch.nn.Parameter(torch.zeros(2))
    optimizer = build_optimizer([parameter], config)
    scheduler = build_scheduler(optimizer, config, total_steps=10)
    original = scheduler.lr_lambdas[0]
    for _ in range(6):
        optimizer.step()
        scheduler.step()
    assert extend_schedule(scheduler, config, total_steps=10) is None  # unchanged length: nothing changes
    assert extend_schedule(scheduler, config, total_steps=8) is None  # shorter: the schedule is kept
    at_resume = original(6)
    extended = extend_schedule(scheduler, config, total_steps=20)
    assert [extended(s) for s in range(6)] == [original(s) for s in range(6)]
    expected = [at_resume + (1 - at_resume) * k / 5 for k in (1, 2, 3, 4)]
    expected += [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 10)) for k in range(11)]
    assert [extended(s) for s in range(6, 21)] == pytest.approx(expected)
    assert extended(25) == pytest.approx(0.1)
    assert scheduler.get_last_lr() == [extended(6)] == [optimizer.param_groups[0]["lr"]]
    assert schedule_segments(scheduler)[-1] == {"schedule": "cosine", "start_step": 6, "total_steps": 20,
                                                "warmup_steps": 4, "decay_steps": 0, "start_lr": at_resume,
                                                "peak_lr": 1.0, "end_lr": 0.1}
    state = json.loads(json.dumps(scheduler.state_dict()))  # as a checkpoint stores it
    fresh = build_scheduler(build_optimizer([parameter], config), config, total_steps=20)
    fresh.load_state_dict(state)
    assert extend_schedule(fresh, config, total_steps=20) is None  # resuming the extended run changes nothing
    assert [fresh.lr_lambdas[0](s) for s in range(25)] == [extended(s) for s in range(25)]


def test_wsd_and_constant_schedules_at_their_key_steps():
    """wsd over 100 steps (warmup 4, decay_ratio 0.2): warmup 0.2..0.8, the peak through step 80, then linear (or
    1-sqrt) down to the floor at step 100; constant: the peak after the warmup, whatever min_lr_ratio says."""
    import math

    wsd = OptimConfig(lr=1.0, warmup_ratio=0.04, min_lr_ratio=0.1, schedule="wsd", decay_ratio=0.2)
    parameter = torch.nn.Parameter(torch.zeros(2))
    multiplier = build_scheduler(build_optimizer([parameter], wsd), wsd, total_steps=100).lr_lambdas[0]
    assert (multiplier.schedule, multiplier.warmup_steps, multiplier.decay_steps) == ("wsd", 4, 20)
    assert [multiplier(s) for s in range(4)] == [0.2, 0.4, 0.6, 0.8]
    assert multiplier(4) == multiplier(50) == multiplier(79) == multiplier(80) == 1.0
    assert multiplier(90) == pytest.approx(0.1 + 0.9 * 0.5) and multiplier(95) == pytest.approx(0.1 + 0.9 * 0.25)
    assert multiplier(100) == pytest.approx(0.1) and multiplier(130) == pytest.approx(0.1)
    sqrt = dataclasses.replace(multiplier, decay_shape="1-sqrt")
    assert sqrt(80) == 1.0 and sqrt(85) == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(0.25)))
    assert sqrt(100) == pytest.approx(0.1)
    constant = OptimConfig(lr=1.0, warmup_ratio=0.04, min_lr_ratio=0.1, schedule="constant")
    flat = build_scheduler(build_optimizer([parameter], constant), constant, total_steps=100).lr_lambdas[0]
    assert [flat(s) for s in (0, 3, 4, 50, 99, 100, 200)] == [0.2, 0.8, 1.0, 1.0, 1.0, 1.0, 1.0]
    cosine = build_scheduler(build_optimizer([parameter], OptimConfig()), OptimConfig(), total_steps=100)
    assert cosine.lr_lambdas[0].schedule == "cosine" and cosine.lr_lambdas[0].decay_steps == 0
    for bad, match in (({"schedule": "linear"}, "schedule must be one of cosine, wsd, constant"),
                       ({"decay_ratio": 0.0}, "decay_ratio must be in"), ({"decay_shape": "cos"}, "decay_shape")):
        with pytest.raises(ConfigError, match=match):
            OptimConfig(**bad)


def test_wsd_extension_and_a_saved_state_without_a_schedule_restores_as_cosine():
    """A wsd run of 10 steps extended at step 10 to 20: the added 10 steps re-warm over round(0.2 * 10) = 2 steps,
    hold the peak, and decay over their last round(0.2 * 10) = 2 steps. A scheduler state saved before the
    schedule had a name (no ``schedule`` key) restores as cosine into a scheduler built for wsd."""
    config = OptimConfig(lr=1.0, warmup_ratio=0.2, schedule="wsd", decay_ratio=0.2)
    parameter = torch.nn.Parameter(torch.zeros(2))
    optimizer = build_optimizer([parameter], config)
    scheduler = build_scheduler(optimizer, config, total_steps=10)
    for _ in range(10):
        optimizer.step()
        scheduler.step()
    assert scheduler.get_last_lr() == [0.0]
    extended = extend_schedule(scheduler, config, total_steps=20)
    assert [extended(s) for s in range(10, 21)] == pytest.approx([1 / 3, 2 / 3, 1, 1, 1, 1, 1, 1, 1, 0.5, 0.0])
    state = json.loads(json.dumps(scheduler.state_dict()))
    fresh = build_scheduler(build_optimizer([parameter], config), config, total_steps=20)
    restore_scheduler(fresh, state)
    assert [fresh.lr_lambdas[0](s) for s in range(25)] == [extended(s) for s in range(25)]

    cosine = OptimConfig(lr=1.0, warmup_ratio=0.2)
    old = build_scheduler(build_optimizer([parameter], cosine), cosine, total_steps=10)
    old_state = json.loads(json.dumps(old.state_dict()))
    for key in ("schedule", "decay_steps", "decay_shape"):
        del old_state["lr_lambdas"][0][key]
    into_wsd = build_scheduler(build_optimizer([parameter], config), config, total_steps=10)
    restore_scheduler(into_wsd, old_state)
    assert into_wsd.lr_lambdas[0].schedule == "cosine"
    assert [into_wsd.lr_lambdas[0](s) for s in range(12)] == [old.lr_lambdas[0](s) for s in range(12)]


def test_damaged_json_records_of_a_checkpoint_are_refused_naming_the_file_and_key(training, tmp_path):
    """``trainer_state.json``, ``drafter_config.json``, ``best.json``, ``latest`` and ``run.json`` are read through
    ``dflash.io.files`` (bounded, regular files only) and their fields type-checked: a damaged one is a
    ``CheckpointError`` naming the file and the key, never a ``RecursionError``/``TypeError`` later."""
    import os

    from dflash.io.files import load_json
    from dflash.training.checkpoint import read_run_record

    run = tmp_path / "run"
    checkpointer = Checkpointer(run, keep_last=2)
    training.train_step()
    training.step = 1
    checkpointer.save(training.snapshot(checkpointer))
    checkpointer.report_validation(1, 2.5)
    checkpointer.close()
    folder = resolve_checkpoint(run)
    state_file = folder / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert load_checkpoint(run, with_training_state=False).step == 1
    for damaged, needle in (
        ({**state, "step": "1"}, "'step' is \"1\", expected an integer >= 0"),
        ({**state, "step": True}, "'step' is true"),
        ({**state, "step": -1}, "'step' is -1"),
        ({**state, "scheduler": [1]}, "'scheduler' is [1], expected an object"),
        ({k: v for k, v in state.items() if k != "step"}, "no 'step' field"),
        ([state], "expected a JSON object at the top, got list"),
    ):
        state_file.write_text(json.dumps(damaged))
        with pytest.raises(CheckpointError, match="^" + str(state_file) + ": ") as refused:
            load_checkpoint(run, with_training_state=False)
        assert needle in str(refused.value) and "resume from another checkpoint" in str(refused.value)
    state_file.write_text('{"step": ' * 100_000)
    with pytest.raises(CheckpointError, match="nested more than 64 levels deep|not valid JSON"):
        load_checkpoint(run, with_training_state=False)
    state_file.write_text(json.dumps(state))
    (folder / "drafter_config.json").unlink()
    (folder / "drafter_config.json").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match="missing drafter_config.json"):  # not a regular file: never read
        load_checkpoint(run, with_training_state=False)
    with pytest.raises(CheckpointError, match="drafter_config.json: is a device, not a regular file"):
        load_json(folder / "drafter_config.json", error=CheckpointError, fix="")
    (folder / "drafter_config.json").unlink()
    (folder / "drafter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="drafter_config.json: nested more than 64 levels deep"):
        load_checkpoint(run, with_training_state=False)
    (run / "best.json").write_text('{"checkpoint": "step_00000001", "step": 1, "val_loss": "low"}')
    with pytest.raises(CheckpointError, match=r"best.json: 'val_loss' is \"low\", expected an integer >= 0 or a number"):
        Checkpointer(run)
    (run / "latest").write_text("step_00000001" * 1000)
    with pytest.raises(CheckpointError, match="latest: is 13,000 bytes, over the 4,096-byte limit"):
        resolve_checkpoint(run)
    (run / "run.json").write_text('{"config": 5}')
    with pytest.raises(CheckpointError, match=r"run.json: 'config' is 5, expected an object"):
        read_run_record(run)
    os.unlink(run / "run.json")
    os.mkfifo(run / "run.json")
    with pytest.raises(CheckpointError, match="run.json: is a FIFO"):
        read_run_record(run)


def test_the_main_jobs_work_folder_and_its_lock_leave_a_checkout_clean(tmp_path):
    """``dflash-stages run`` in a fresh clone writes ``dflash-work/`` and, while it runs, the lock ``dflash-work.lock``
    beside it (in the checkout): the repository's .gitignore covers both, so the runs it trains record
    ``git_dirty: false`` (``code_version``)."""
    import shutil
    import subprocess
    from pathlib import Path

    from dflash.io.locks import lock_path_of
    from dflash.training.checkpoint import code_version

    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    shutil.copy(Path(__file__).resolve().parents[1] / ".gitignore", checkout / ".gitignore")
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", ".gitignore"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "init"], check=True)
    assert code_version(checkout)["git_dirty"] is False
    work = checkout / "dflash-work"  # run's default --workdir
    (work / "eval").mkdir(parents=True)
    (work / "eval" / "final.json").write_text("{}\n")
    lock_path_of(work).write_text("{}\n")
    assert code_version(checkout) == {**code_version(checkout), "git_dirty": False, "git_untracked": 0}
    (checkout / "notes.txt").write_text("an untracked file is seen\n")
    assert code_version(checkout)["git_untracked"] == 1
