"""``train.drafter.init = "target"``: draft layers start as copies of the real SmolLM2 target's decoder layers."""

from __future__ import annotations

import json

import pytest
import torch
from train_helpers import build_tiny_cache, tiny_config

from dflash.errors import ConfigError
from stages.train.launch import run_training

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory, target):
    return build_tiny_cache(tmp_path_factory.mktemp("cache") / "tiny.zarr", target, num_samples=12, num_shards=1)


def _checkpoint_state(run_dir, step):
    from dflash.training.checkpoint import load_checkpoint

    return load_checkpoint(run_dir / "checkpoints" / f"step_{step:08d}").model_state


def _close(actual, expected, atol=1e-6):
    return torch.allclose(actual.float(), expected.detach().float(), rtol=0.0, atol=atol)


def test_target_init_copies_the_named_target_layers_and_final_norm(tiny_cache, target, tmp_path):
    # lr 1e-7: one AdamW step moves each weight by ~1e-7, so the step-1 checkpoint holds the initial weights
    # within 1e-6 (target weights and random-init ones differ by ~1e-2).
    common = dict(max_steps=1, save_every=1, lr=1e-7, warmup_ratio=0.0, validation_fraction=0.0, num_draft_layers=2)
    run_training(tiny_config(tiny_cache, tmp_path / "t", drafter={"init": "target", "init_target_layers": [29, 4]}, **common))
    run_training(tiny_config(tiny_cache, tmp_path / "r", **common))
    copied, random = _checkpoint_state(tmp_path / "t", 1), _checkpoint_state(tmp_path / "r", 1)
    layers = target.model.model.layers  # the transformers model, not the safetensors reader the trainer uses
    for draft_index, target_index in enumerate([29, 4]):
        source = layers[target_index]
        for name, tensor in [("self_attn.q_proj.weight", source.self_attn.q_proj.weight),
                             ("self_attn.o_proj.weight", source.self_attn.o_proj.weight),
                             ("mlp.down_proj.weight", source.mlp.down_proj.weight),
                             ("input_layernorm.weight", source.input_layernorm.weight),
                             ("post_attention_layernorm.weight", source.post_attention_layernorm.weight)]:
            assert _close(copied[f"layers.{draft_index}.{name}"], tensor), (draft_index, name)
        # Llama has no q_norm/k_norm: the drafter's stay at ones.
        assert _close(copied[f"layers.{draft_index}.self_attn.q_norm.weight"], torch.ones(64))
    assert _close(copied["norm.weight"], target.model.model.norm.weight)
    # What has no target counterpart keeps the seeded random init of a random-init run.
    assert _close(copied["fc.weight"], random["fc.weight"])
    assert not _close(copied["layers.0.self_attn.q_proj.weight"], random["layers.0.self_attn.q_proj.weight"], atol=1e-3)
    record = json.loads((tmp_path / "t" / "run.json").read_text())["resolved"]["drafter_init"]
    assert record["init"] == "target" and record["layers"] == [29, 4] and record["final_norm"] is True
    assert record["tensors"] == 2 * 9 + 1  # 9 per layer, and the final norm
    assert record["not_in_target"] == [f"layers.{j}.self_attn.{n}_norm.weight" for j in (0, 1) for n in ("k", "q")]
    assert json.loads((tmp_path / "r" / "run.json").read_text())["resolved"]["drafter_init"] == {"init": "random"}

    # A resumed run keeps its record (the weights come from the checkpoint).
    run_training(tiny_config(tiny_cache, tmp_path / "t", drafter={"init": "target", "init_target_layers": [29, 4]},
                             resume=True, allow_config_change=True, **(common | {"max_steps": 2})))
    record = json.loads((tmp_path / "t" / "run.json").read_text())["resolved"]["drafter_init"]
    assert record["layers"] == [29, 4]


def test_default_target_layers_are_the_last_ones(tiny_cache, target, tmp_path):
    run_training(tiny_config(tiny_cache, tmp_path / "t", drafter={"init": "target"}, max_steps=1, save_every=1,
                             lr=1e-7, warmup_ratio=0.0, validation_fraction=0.0, num_draft_layers=2))
    state = _checkpoint_state(tmp_path / "t", 1)
    for draft_index, target_index in enumerate([28, 29]):
        expected = target.model.model.layers[target_index].mlp.up_proj.weight.float()
        assert _close(state[f"layers.{draft_index}.mlp.up_proj.weight"], expected)


@pytest.mark.parametrize(("drafter", "match"), [
    ({"init": "target", "init_target_layers": [3]}, r"init_target_layers has 1 layers, num_draft_layers is 2"),
    ({"init_target_layers": [3, 4]}, r"init is 'random'"),
    ({"init": "copy"}, r"init.*random\|target"),
])
def test_bad_init_settings_are_refused_with_their_names(tmp_path, drafter, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config(tmp_path / "cache.zarr", tmp_path / "run", drafter=drafter, num_draft_layers=2)


def test_a_target_layer_out_of_range_is_refused_before_step_1(tiny_cache, tmp_path):
    with pytest.raises(ConfigError, match=r"init_target_layers \[30\] out of range: the target has layers 0\.\.29"):
        run_training(tiny_config(tiny_cache, tmp_path / "run", drafter={"init": "target", "init_target_layers": [1, 30]},
                                 num_draft_layers=2, validation_fraction=0.0))
    assert not (tmp_path / "run" / "checkpoints").exists()
