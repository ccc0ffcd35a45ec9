"""Data parallel on CPU: 2 gloo ranks (launched by the train stage itself through torch.distributed's elastic
launcher) equal one process with gradient accumulation over the same global batch."""

from __future__ import annotations

import pytest
import torch
from train_helpers import build_tiny_cache, tiny_config

from dflash.training.checkpoint import load_checkpoint
from dflash.training.telemetry import read_metrics
from stages.train.launch import run_training


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory, target):
    return build_tiny_cache(tmp_path_factory.mktemp("cache") / "tiny.zarr", target)


def test_two_gloo_ranks_equal_one_process_with_the_same_global_batch(tiny_cache, tmp_path):
    common = dict(max_steps=3, save_every=3, validation_fraction=0.2)
    ddp = run_training(tiny_config(tiny_cache, tmp_path / "ddp", drafter_processes=2, grad_accum_steps=1, **common))
    single = run_training(tiny_config(tiny_cache, tmp_path / "single", grad_accum_steps=2, **common))
    assert ddp["step"] == single["step"] == 3
    assert ddp["tokens_seen"] == single["tokens_seen"]  # global counts: both ranks' batches

    a = load_checkpoint(tmp_path / "ddp" / "checkpoints" / "step_00000003")
    b = load_checkpoint(tmp_path / "single" / "checkpoints" / "step_00000003")
    assert a.model_state.keys() == b.model_state.keys()
    # Float32 summation order differs (all-reduce vs accumulation, and CPU GEMM blocking differs with the thread
    # count): the moments (running gradient statistics) agree to ~1e-5 of each tensor's largest element. Weights
    # agree to within 2% of one step's largest Adam update (lr 1e-3): Adam divides each gradient by its own RMS,
    # so an element whose gradient is ~0 moves on that noise alone.
    for name, value in a.model_state.items():
        torch.testing.assert_close(value, b.model_state[name], rtol=1e-5, atol=2e-5, msg=name)
    for index, state in a.optimizer_state["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            expected = b.optimizer_state["state"][index][key]
            torch.testing.assert_close(state[key], expected, rtol=1e-4, atol=3e-5 * float(expected.abs().max()),
                                       msg=f"{key} of parameter {index}")
    assert a.trainer_state["scheduler"]["_last_lr"] == b.trainer_state["scheduler"]["_last_lr"]
    # Rank 0 of 2 has read half the batches of the single process: epoch position in global batches agrees.
    assert a.trainer_state["data"]["global_batches_in_epoch"] == b.trainer_state["data"]["global_batches_in_epoch"]

    ddp_records = read_metrics(tmp_path / "ddp", kind="train")
    single_records = read_metrics(tmp_path / "single", kind="train")
    assert len(ddp_records) == len(single_records) == 3
    for x, y in zip(ddp_records, single_records, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)  # globally normalized loss, same on both
        assert x["bucket_batches"] == y["bucket_batches"]  # per-bucket counts over all ranks
        assert x["accuracy_per_position"] == pytest.approx(y["accuracy_per_position"])
    assert read_metrics(tmp_path / "ddp", kind="val")[-1]["loss"] == pytest.approx(
        read_metrics(tmp_path / "single", kind="val")[-1]["loss"], rel=1e-5
    )


def test_the_planned_schedule_is_the_one_two_ranks_train(tiny_cache, tmp_path):
    """``planned_total_steps`` (what the pipeline places its epoch ends with, before step 1) counts each rank's share
    of an epoch's batches, as the ranks themselves do."""
    from stages.train.data import planned_total_steps

    config = tiny_config(tiny_cache, tmp_path / "ddp", drafter_processes=2, max_steps=None, epochs=1, save_every=100)
    planned = planned_total_steps(config)
    assert planned != planned_total_steps(config, world_size=1)  # one rank would take about twice the steps
    summary = run_training(config)
    assert summary["step"] == planned
    assert load_checkpoint(tmp_path / "ddp").trainer_state["total_steps"] == planned
