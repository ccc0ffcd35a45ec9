"""Training state without pickle: optimizer and RNG states round-trip exactly through safetensors; nothing a load
path reads can run code (a planted pickle in either state file of a checkpoint is refused with one line naming the
file)."""

from __future__ import annotations

import os
import random
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from dflash.errors import CheckpointError
from dflash.training.checkpoint import capture_rng_state, load_checkpoint, restore_rng_state
from dflash.training.state_files import load_state_tree, save_state_tree


class _Planted:
    """Unpickling this runs ``touch MARKER``: a pickle attack on a checkpoint's state file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _trained_adamw_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, bias=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(2):
        model(torch.randn(5, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_optimizer_state_round_trips_exactly_and_loads_into_a_fresh_optimizer(tmp_path):
    model, optimizer = _trained_adamw_state()
    state = optimizer.state_dict()
    save_state_tree(state, tmp_path / "optimizer.safetensors")
    loaded = load_state_tree(tmp_path / "optimizer.safetensors")
    assert set(loaded["state"]) == {0, 1, 2}  # parameter indices stay ints
    for index, entry in state["state"].items():
        for key, value in entry.items():
            assert loaded["state"][index][key].dtype == value.dtype
            assert torch.equal(loaded["state"][index][key], value), (index, key)
    fresh = torch.optim.AdamW(model.parameters(), lr=5.0)
    fresh.load_state_dict(loaded)
    assert fresh.param_groups[0]["lr"] == 1e-3 and tuple(fresh.param_groups[0]["betas"]) == (0.9, 0.95)
    assert fresh.state_dict()["param_groups"] == state["param_groups"]


def test_rng_state_round_trips_and_restores_every_generator(tmp_path):
    generator = torch.Generator().manual_seed(7)
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    state = capture_rng_state(anchors=generator)
    expected = (torch.rand(3), np.random.rand(3), random.random(), torch.rand(2, generator=generator))
    save_state_tree(state, tmp_path / "rng.safetensors")
    torch.manual_seed(99), np.random.seed(99), random.seed(99), generator.manual_seed(99)
    loaded = load_state_tree(tmp_path / "rng.safetensors")
    assert loaded["numpy"][1].dtype == np.uint32 and isinstance(loaded["python"], tuple)
    restore_rng_state(loaded, anchors=generator)
    again = (torch.rand(3), np.random.rand(3), random.random(), torch.rand(2, generator=generator))
    assert torch.equal(again[0], expected[0]) and np.array_equal(again[1], expected[1])
    assert again[2] == expected[2] and torch.equal(again[3], expected[3])


def test_plain_values_keep_their_types(tmp_path):
    tree = {"a": (1, 2.5, None, True), "b": [float("nan"), float("inf"), "x"], 3: {"nested": torch.arange(3)}}
    save_state_tree(tree, tmp_path / "s.safetensors")
    loaded = load_state_tree(tmp_path / "s.safetensors")
    assert loaded["a"] == (1, 2.5, None, True) and np.isnan(loaded["b"][0]) and loaded["b"][1:] == [float("inf"), "x"]
    assert torch.equal(loaded[3]["nested"], torch.arange(3))
    with pytest.raises(TypeError, match="not storable without pickle"):
        save_state_tree({"bad": object()}, tmp_path / "bad.safetensors")


def test_state_file_that_is_not_ours_or_truncated_is_one_line_naming_it(tmp_path):
    foreign = tmp_path / "rng.safetensors"
    save_file({"x": torch.zeros(2)}, str(foreign))
    with pytest.raises(CheckpointError, match="rng.safetensors holds no 'dflash_state_tree'"):
        load_state_tree(foreign)
    save_state_tree({"x": torch.zeros(1000)}, foreign)
    foreign.write_bytes(foreign.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"cannot read .*rng.safetensors") as error:
        load_state_tree(foreign)
    assert "\n" not in str(error.value)


@pytest.fixture(scope="module")
def run_b8(tmp_path_factory, target):
    """A real short training run (tiny drafter on a tiny real cache) whose checkpoint the tests tamper with."""
    from train_helpers import build_tiny_cache, tiny_config

    from stages.train.launch import run_training

    root = tmp_path_factory.mktemp("state_files")
    cache = build_tiny_cache(root / "cache.zarr", target, num_samples=8, num_shards=1)
    run = root / "run"
    run_training(tiny_config(cache, run, max_steps=2, validation_fraction=0.0))
    return run


@pytest.mark.parametrize("name", ["rng.safetensors", "optimizer.safetensors"])
def test_planted_pickle_under_a_format_2_name_does_not_run(run_b8, tmp_path, name):
    folder = tmp_path / "step"
    shutil.copytree(load_checkpoint(run_b8).path, folder)
    marker = tmp_path / "pwned"
    torch.save({"torch": _Planted(marker)}, folder / name)  # a pickle renamed to .safetensors
    with pytest.raises(CheckpointError, match=f"cannot read {folder / name}"):
        load_checkpoint(folder)
    assert not marker.exists()


def test_train_resume_with_a_planted_rng_file_exits_2_and_runs_nothing(run_b8, tmp_path):
    """A pickle attack on the rng state end to end: `train --resume` on a run whose rng state was replaced by a pickle."""
    run = tmp_path / "run"
    shutil.copytree(run_b8, run)
    checkpoint = load_checkpoint(run).path
    marker = tmp_path / "pwned"
    torch.save({"torch": _Planted(marker)}, checkpoint / "rng.safetensors")  # a pickle under the state file's name
    config = (run / "run.json").read_text()
    import json

    cache = json.loads(config)["config"]["cache"]
    from cli_helpers import forked_cli

    result = forked_cli(  # the console script in its own process, forked from one that imported torch once
        "train", "--cache", cache, "--output", str(run), "--resume",
        "--max-steps", "2", "--num-draft-layers", "1", "--block-size", "4", "--device", "cpu",
        cwd=os.getcwd(), timeout=300, env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert not marker.exists()
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and "rng.safetensors" in error_lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
