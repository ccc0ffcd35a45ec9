"""Export in the serving format, the strict loader, and serving-style drafting against the training forward.

A small drafter (2 layers, block 8) on the real SmolLM2-135M target is trained for one step on the target's own
hidden states of real stdlib text, checkpointed with the trainer's Checkpointer, exported with
``dflash-stages export``, reloaded with the strict loader, and used to draft blocks the way vLLM/SGLang do (full
context, no mask). Its logits must equal the training forward's for the same blocks.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
import typer
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from dflash.batches.packed import PackedBatch
from dflash.drafter import DFlashConfig, DFlashDrafter
from dflash.errors import ExportError, MismatchError
from dflash.serving.export import (
    CONFIG_FILE,
    PROVENANCE_FILE,
    WEIGHTS_FILE,
    export_checkpoint,
    export_drafter,
    load_exported,
    load_exported_drafter,
    sha256_file,
)
from dflash.target.load import resolve_target_path

NUM_DRAFT_LAYERS = 2
BLOCK_SIZE = 8
ANCHORS = [1, 20, 47, 80]  # anchor positions in the 96-token context (spacing down to 1 block is not needed here)
FP32_ATOL = 2e-4  # logits are ~60 in magnitude; fp32 reassociation between the two paths gives ~2e-5


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def drafter_config(target) -> DFlashConfig:
    return DFlashConfig.from_target_config(
        target.model.config, tokenizer=target.tokenizer, num_draft_layers=NUM_DRAFT_LAYERS, block_size=BLOCK_SIZE
    )


def _attach(drafter: DFlashDrafter, target) -> DFlashDrafter:
    model = target.model
    drafter.attach_target(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    return drafter


@pytest.fixture(scope="module")
def context(target, drafter_config):
    """96 tokens of real text (the json module's docstring) and the target's tapped states for them."""
    text = textwrap.dedent(json.__doc__)
    input_ids = target.tokenizer(text, return_tensors="pt").input_ids[0][:96].long()
    with torch.no_grad():
        output = target.model(input_ids[None], output_hidden_states=True)
    hidden = torch.cat([output.hidden_states[layer + 1][0] for layer in drafter_config.target_layer_ids], dim=-1)
    length = input_ids.shape[0]
    batch = PackedBatch(
        input_ids=input_ids,
        loss_mask=torch.ones(length, dtype=torch.uint8),
        hidden=hidden,
        position_ids=torch.arange(length),
        document_ids=torch.zeros(length, dtype=torch.int64),
        cu_seqlens=torch.tensor([0, length]),
        num_real_tokens=length,
    )
    return batch


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, target, drafter_config, context):
    """A run folder written by the trainer's Checkpointer after one AdamW step on the real batch."""
    from dflash.drafter import dflash_loss
    from dflash.training.checkpoint import Checkpointer, capture_rng_state, target_weight_record

    torch.manual_seed(0)
    drafter = _attach(DFlashDrafter(drafter_config), target)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    loss = dflash_loss(drafter, context, torch.tensor(ANCHORS), gamma=4.0)
    (loss.weighted_ce_sum / loss.weight_sum).backward()
    optimizer.step()
    run = tmp_path_factory.mktemp("run")
    checkpointer = Checkpointer(run)
    try:
        snapshot = checkpointer.snapshot(
            step=1,
            model=drafter,
            optimizer=optimizer,
            trainer_state={"epoch": 0},
            rng_state=capture_rng_state(),
            drafter_config=drafter_config.to_dict(),
            # What the trainer records: hashes as attached (fp32 here) and bf16-rounded (dflash.training.checkpoint).
            target_info={
                **target.identity.to_dict(), "target_spec": "default",
                **target_weight_record(target.model.get_input_embeddings().weight, target.model.get_output_embeddings().weight),
            },
        )
        checkpointer.save(snapshot)
    finally:
        checkpointer.close()
    return run


@pytest.fixture(scope="module")
def trained(run_dir, target, drafter_config) -> DFlashDrafter:
    """The checkpoint's drafter in float32, as training left it."""
    drafter = DFlashDrafter(drafter_config)
    drafter.load_state_dict(load_file(str(run_dir / "checkpoints" / "step_00000001" / WEIGHTS_FILE)))
    return _attach(drafter, target).eval()


@pytest.fixture(scope="module")
def exported(run_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("exports") / "smol-dflash"
    destination, provenance = export_checkpoint(run_dir, out)
    return destination


@pytest.fixture(scope="module")
def reloaded(exported, target) -> DFlashDrafter:
    config, state_dict = load_exported(exported)
    drafter = DFlashDrafter(config)
    drafter.load_state_dict(state_dict, strict=True)
    return _attach(drafter, target).eval()


@pytest.fixture(scope="module")
def training_logits(trained, context) -> torch.Tensor:
    """``[A, B, V]`` logits of the training forward (fp32 checkpoint weights) for the blocks at ANCHORS."""
    return _training_logits(trained, context)


@pytest.fixture(scope="module")
def serving_json(exported) -> dict:
    return json.loads((exported / CONFIG_FILE).read_text())


def _training_logits(drafter: DFlashDrafter, batch: PackedBatch) -> torch.Tensor:
    with torch.no_grad():
        hidden = drafter.forward_train(batch, torch.tensor(ANCHORS))  # [A, B, H]
        return (hidden @ drafter.lm_head_weight.T).float()  # [A, B, V]


def _serving_logits(drafter: DFlashDrafter, batch: PackedBatch, anchor: int, *, context_end: int | None = None,
                    block_start: int | None = None) -> torch.Tensor:
    """vLLM/SGLang-style drafting: context = every state before the anchor, block [x_a, MASK...], no mask."""
    context_end = anchor if context_end is None else context_end
    block = torch.full((BLOCK_SIZE,), drafter.config.mask_token_id, dtype=torch.int64)
    block[0] = batch.input_ids[anchor]
    return drafter.draft_block(
        batch.hidden[:context_end], torch.arange(context_end), block, anchor if block_start is None else block_start
    )


def _rewrite(export: Path, *, config: dict | None = None, tensors: dict | None = None) -> None:
    """Write a modified export and re-record its hashes, as a buggy exporter would (so only the format rules fire)."""
    if config is not None:
        (export / CONFIG_FILE).write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, str(export / WEIGHTS_FILE), metadata={"format": "pt"})
    provenance = json.loads((export / PROVENANCE_FILE).read_text())
    for name in provenance["files"]:
        provenance["files"][name]["sha256"] = sha256_file(export / name)
    (export / PROVENANCE_FILE).write_text(json.dumps(provenance))


@pytest.fixture
def broken_export(exported, tmp_path):
    """A fresh copy of the export to break."""
    copy = tmp_path / "copy"
    shutil.copytree(exported, copy)
    return copy


# ------------------------------------------------------------------- serving-style drafting == training forward


def test_reloaded_export_drafts_the_training_logits_within_bf16(training_logits, reloaded, context):
    training = training_logits
    for index, anchor in enumerate(ANCHORS):
        serving = _serving_logits(reloaded, context, anchor)
        scale = training[index].abs().max()
        assert (serving - training[index]).abs().max() < 0.01 * scale, f"anchor {anchor}"
        agreement = (serving.argmax(-1) == training[index].argmax(-1)).float().mean()
        assert agreement >= 0.875, f"anchor {anchor}: argmax agrees on {agreement:.0%} of the block"


def test_reloaded_export_in_bf16_compute_drafts_the_training_logits(exported, training_logits, context, target):
    """As the engines run it: bf16 weights, bf16 target states, bf16 activations."""
    config, state_dict = load_exported(exported)
    drafter = DFlashDrafter(config)
    drafter.load_state_dict(state_dict, strict=True)
    drafter = drafter.to(torch.bfloat16).eval()
    model = target.model
    drafter.attach_target(
        model.get_input_embeddings().weight.to(torch.bfloat16), model.get_output_embeddings().weight.to(torch.bfloat16)
    )
    bf16_context = dataclasses.replace(context, hidden=context.hidden.to(torch.bfloat16))
    for index, anchor in enumerate(ANCHORS):
        serving = _serving_logits(drafter, bf16_context, anchor)
        scale = training_logits[index].abs().max()
        assert (serving - training_logits[index]).abs().max() < 0.02 * scale, f"anchor {anchor}"


def test_serving_path_equals_training_forward_in_fp32(trained, training_logits, context):
    """Before any cast: the same fp32 weights give the same logits on both paths."""
    training = training_logits
    for index, anchor in enumerate(ANCHORS):
        torch.testing.assert_close(_serving_logits(trained, context, anchor), training[index], rtol=0, atol=FP32_ATOL)


def test_export_is_lossless_beyond_the_bf16_cast(trained, reloaded, context, drafter_config, target):
    """Training forward with the bf16-rounded checkpoint weights == serving drafting of the reloaded export, in fp32."""
    rounded = DFlashDrafter(drafter_config)
    rounded.load_state_dict({name: t.to(torch.bfloat16) for name, t in trained.state_dict().items()})
    training = _training_logits(_attach(rounded, target).eval(), context)
    for index, anchor in enumerate(ANCHORS):
        torch.testing.assert_close(_serving_logits(reloaded, context, anchor), training[index], rtol=0, atol=FP32_ATOL)


@pytest.mark.parametrize("mistake", ["anchor state visible", "block one position late"])
def test_equality_check_catches_context_leak_and_position_shift(trained, training_logits, context, mistake):
    """The comparison above is sensitive: showing the anchor's own state, or shifting RoPE by one, changes logits."""
    training = training_logits
    for index, anchor in enumerate(ANCHORS):
        if mistake == "anchor state visible":
            wrong = _serving_logits(trained, context, anchor, context_end=anchor + 1)
        else:
            wrong = _serving_logits(trained, context, anchor, block_start=anchor + 1)
        assert (wrong - training[index]).abs().max() > 100 * FP32_ATOL, f"anchor {anchor}"


def test_strict_loader_returns_the_training_config(exported, drafter_config):
    config, _ = load_exported(exported)
    assert config == drafter_config


def test_export_files_are_readable_by_other_users(exported):
    # A serving engine often runs as another user than the trainer (safetensors itself writes 0600).
    for name in ("model.safetensors", "config.json", "dflash_export.json"):
        assert (exported / name).stat().st_mode & 0o044 == 0o044, name


def test_exported_tensors_equal_the_bf16_cast_of_the_checkpoint(exported, trained):
    _, state_dict = load_exported(exported)
    expected = trained.state_dict()
    assert sorted(state_dict) == sorted(expected)
    for name, tensor in state_dict.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, expected[name].to(torch.bfloat16)), name


def test_load_exported_drafter_checks_the_target_hashes(exported, target, trained):
    drafter, config, target_info = load_exported_drafter(exported, target=target)
    assert target_info["content_hash"] == target.identity.content_hash
    assert config == trained.config

    class OtherTarget:  # same shapes, another embedding: a different target
        def __init__(self, model):
            self.embedding = torch.nn.Embedding.from_pretrained(model.get_input_embeddings().weight * 1.01)

        def get_input_embeddings(self):
            return self.embedding

        def get_output_embeddings(self):
            return self.embedding

    with pytest.raises(MismatchError, match="embed_tokens"):
        load_exported_drafter(exported, target=OtherTarget(target.model))


class _TargetInDtype:
    """The target's embedding / LM head as another process would load them (e.g. bf16 on a GPU host)."""

    def __init__(self, model, dtype: torch.dtype, scale: float = 1.0) -> None:
        weight = model.get_input_embeddings().weight.detach()
        self.embedding = torch.nn.Embedding.from_pretrained((weight * scale).to(dtype))

    def get_input_embeddings(self):
        return self.embedding

    def get_output_embeddings(self):
        return self.embedding  # tied, as SmolLM2's


def test_export_trained_with_an_fp32_target_loads_with_the_target_in_bf16(exported, target, trained):
    assert target.model.get_input_embeddings().weight.dtype == torch.float32  # trained/exported with fp32
    drafter, config, target_info = load_exported_drafter(exported, target=_TargetInDtype(target.model, torch.bfloat16))
    assert target_info["weight_dtype"] == "float32" and config == trained.config
    assert drafter.embed_weight.dtype == torch.bfloat16
    # Another target loaded in bf16 is still refused.
    with pytest.raises(MismatchError, match="embed_tokens"):
        load_exported_drafter(exported, target=_TargetInDtype(target.model, torch.bfloat16, scale=1.01))


# ------------------------------------------------------------------- config facts of docs/dflash.md, one per key


def _facts(target, config: DFlashConfig) -> dict[str, object]:
    target_config = target.model.config
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_act": "silu",
        "hidden_size": target_config.hidden_size,
        "vocab_size": target_config.vocab_size,
        "num_hidden_layers": NUM_DRAFT_LAYERS,
        "num_attention_heads": target_config.num_attention_heads,
        "num_key_value_heads": target_config.num_key_value_heads,
        "head_dim": target_config.head_dim,
        "intermediate_size": target_config.intermediate_size,
        "rms_norm_eps": target_config.rms_norm_eps,
        "attention_bias": False,
        "max_position_embeddings": target_config.max_position_embeddings,
        "block_size": BLOCK_SIZE,
        "num_target_layers": target_config.num_hidden_layers,
        "layer_types": ["full_attention"] * NUM_DRAFT_LAYERS,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "rope_theta": target_config.rope_parameters["rope_theta"],
        "rope_scaling": None,  # the target uses plain RoPE
        "rope_parameters": dict(target_config.rope_parameters),
        "dflash_config.mask_token_id": config.mask_token_id,
        "dflash_config.target_layer_ids": [1, 27],  # round(1 + i * (30 - 4) / (2 - 1))
    }


FACT_KEYS = [
    "architectures", "model_type", "hidden_act", "hidden_size", "vocab_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps", "attention_bias",
    "max_position_embeddings", "block_size", "num_target_layers", "layer_types", "sliding_window",
    "use_sliding_window", "tie_word_embeddings", "dtype", "rope_theta", "rope_scaling", "rope_parameters",
    "dflash_config.mask_token_id", "dflash_config.target_layer_ids",
]


@pytest.mark.parametrize("key", FACT_KEYS)
def test_serving_config_key(serving_json, target, drafter_config, key):
    value = serving_json
    for part in key.split("."):
        assert part in value, f"config.json lacks {key}"
        value = value[part]
    assert value == _facts(target, drafter_config)[key]


def test_no_eagle_aux_hidden_state_layer_ids(serving_json):
    assert "eagle_aux_hidden_state_layer_ids" not in serving_json


def test_mask_token_is_an_existing_unused_special_token(serving_json, target):
    dflash_config = serving_json["dflash_config"]
    mask_id = dflash_config["mask_token_id"]
    assert 0 <= mask_id < serving_json["vocab_size"]
    assert mask_id < len(target.tokenizer)
    # SGLang versions that resolve the mask token by string must find the same row.
    assert target.tokenizer.convert_tokens_to_ids(dflash_config["mask_token"]) == mask_id
    assert mask_id in target.tokenizer.added_tokens_decoder


def test_weights_are_bf16_without_prefix_embedding_or_lm_head(exported):
    with safe_open(str(exported / WEIGHTS_FILE), framework="pt") as handle:
        names = list(handle.keys())
        dtypes = {str(handle.get_slice(name).get_dtype()) for name in names}
    assert dtypes == {"BF16"}
    assert not [n for n in names if n.startswith("model.") or "embed_tokens" in n or "lm_head" in n]
    assert "fc.weight" in names and "hidden_norm.weight" in names and "norm.weight" in names
    assert f"layers.{NUM_DRAFT_LAYERS - 1}.self_attn.k_norm.weight" in names


def test_transformers_reads_the_targets_rope_from_the_export(exported, target):
    """transformers 5 (what z-lab's loader and vLLM build on) reads the same RoPE the target uses."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(exported)
    assert type(config).__name__ == "Qwen3Config"
    assert config.rope_parameters == target.model.config.rope_parameters
    assert config.dflash_config["target_layer_ids"] == [1, 27]


def test_provenance_records_target_and_hashes(exported, target, run_dir):
    provenance = json.loads((exported / PROVENANCE_FILE).read_text())
    assert provenance["target"]["content_hash"] == target.identity.content_hash
    assert provenance["target"]["target_spec"] == "default"
    assert set(provenance["target"]["weight_hashes"]) == {"embed_tokens", "lm_head"}
    assert provenance["layer_id_convention"] == "decoder_layer_output"
    assert provenance["source"]["step"] == 1
    assert provenance["source"]["checkpoint"] == str((run_dir / "checkpoints" / "step_00000001").absolute())
    assert provenance["files"][WEIGHTS_FILE]["sha256"] == sha256_file(exported / WEIGHTS_FILE)


def test_rope_scaling_round_trips_through_legacy_and_new_keys(trained, tmp_path):
    """A target with llama3 scaling: legacy rope_scaling, rope_parameters and the reloaded config all agree."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    config = dataclasses.replace(trained.config, rope_theta=500000.0, rope_scaling=scaling)
    out = export_drafter(trained.state_dict(), config, tmp_path / "llama3")
    written = json.loads((out / CONFIG_FILE).read_text())
    assert written["rope_theta"] == 500000.0
    assert written["rope_scaling"] == scaling
    assert written["rope_parameters"] == {**scaling, "rope_theta": 500000.0}
    reloaded_config, _ = load_exported(out)
    assert reloaded_config == config


# ------------------------------------------------------------------- the strict loader rejects broken exports


def _weights(export: Path) -> dict[str, torch.Tensor]:
    return load_file(str(export / WEIGHTS_FILE))


def test_rejects_an_extra_tensor(broken_export):
    tensors = _weights(broken_export)
    tensors["lm_head.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    _rewrite(broken_export, tensors=tensors)
    with pytest.raises(ExportError, match=r"unknown tensor names \['lm_head.weight'\].*lm_head must not be stored"):
        load_exported(broken_export)


def test_rejects_a_missing_tensor(broken_export):
    tensors = _weights(broken_export)
    del tensors["layers.1.mlp.down_proj.weight"]
    _rewrite(broken_export, tensors=tensors)
    with pytest.raises(ExportError, match=r"missing tensor names \['layers.1.mlp.down_proj.weight'\]"):
        load_exported(broken_export)


def test_rejects_a_misnamed_tensor(broken_export):
    tensors = _weights(broken_export)
    tensors["model.fc.weight"] = tensors.pop("fc.weight")
    _rewrite(broken_export, tensors=tensors)
    with pytest.raises(ExportError, match=r"unknown tensor names \['model.fc.weight'\].*'model.' prefix") as caught:
        load_exported(broken_export)
    assert "missing tensor names ['fc.weight']" in str(caught.value)


def test_rejects_a_wrong_shape(broken_export):
    tensors = _weights(broken_export)
    tensors["fc.weight"] = tensors["fc.weight"].T.contiguous()
    _rewrite(broken_export, tensors=tensors)
    with pytest.raises(ExportError, match=r"fc.weight: expected shape \[576, 1152\], got \[1152, 576\]"):
        load_exported(broken_export)


def test_rejects_float32_weights(broken_export):
    _rewrite(broken_export, tensors={name: t.float() for name, t in _weights(broken_export).items()})
    with pytest.raises(ExportError, match="is torch.float32, the serving format stores bfloat16"):
        load_exported(broken_export)


def test_rejects_nan_weights(broken_export):
    tensors = _weights(broken_export)
    tensors["layers.0.self_attn.q_proj.weight"][3, 5] = float("nan")
    _rewrite(broken_export, tensors=tensors)
    with pytest.raises(ExportError, match=r"'layers.0.self_attn.q_proj.weight' holds NaN/Inf"):
        load_exported(broken_export)


CONFIG_BREAKS = {
    "non-increasing layer ids": (lambda c: c["dflash_config"].update(target_layer_ids=[27, 1]), "strictly increasing"),
    "repeated layer id": (lambda c: c["dflash_config"].update(target_layer_ids=[1, 1]), "strictly increasing"),
    "last layer tapped": (lambda c: c["dflash_config"].update(target_layer_ids=[1, 29]), r"29 is outside \[0, 28\]"),
    "layer id out of range": (lambda c: c["dflash_config"].update(target_layer_ids=[1, 30]), r"30 is outside \[0, 28\]"),
    "negative layer id": (lambda c: c["dflash_config"].update(target_layer_ids=[-1, 27]), r"-1 is outside"),
    "rope_theta disagrees": (lambda c: c.update(rope_theta=10000.0), "RoPE keys disagree"),
    "rope_scaling disagrees": (lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": 2.0}), "RoPE keys disagree"),
    "rope_parameters missing": (lambda c: c.pop("rope_parameters"), "missing 'rope_parameters'"),
    "legacy rope_theta missing": (lambda c: c.pop("rope_theta"), "missing 'rope_theta'"),
    "eagle aux ids present": (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 28]), "applies no \\+1"),
    "mask token outside vocab": (lambda c: c["dflash_config"].update(mask_token_id=49152), r"not a row of the target embedding"),
    "sliding window": (lambda c: c.update(layer_types=["sliding_attention"] * 2), "layer_types must be 2 x 'full_attention'"),
    "tied embeddings": (lambda c: c.update(tie_word_embeddings=True), "tie_word_embeddings is True, expected False"),
    "wrong architecture": (lambda c: c.update(architectures=["Qwen3ForCausalLM"]), "architectures is"),
    "float32 dtype": (lambda c: c.update(dtype="float32"), "dtype is 'float32', expected 'bfloat16'"),
    "block sizes disagree": (lambda c: c["dflash_config"].update(block_size=16), "disagrees with block_size 8"),
    "fewer draft layers than weights": (lambda c: c.update(num_hidden_layers=1, layer_types=["full_attention"]), r"unknown tensor names \['layers.1"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_BREAKS))
def test_rejects_a_broken_config(broken_export, case):
    edit, message = CONFIG_BREAKS[case]
    config = json.loads((broken_export / CONFIG_FILE).read_text())
    edit(config)
    _rewrite(broken_export, config=config)
    with pytest.raises(ExportError, match=message):
        load_exported(broken_export)


def test_rejects_a_file_changed_after_export(broken_export):
    config = json.loads((broken_export / CONFIG_FILE).read_text())
    config["block_size"] = 16
    (broken_export / CONFIG_FILE).write_text(json.dumps(config))  # hashes not re-recorded
    with pytest.raises(ExportError, match="config.json: sha256 .* differs"):
        load_exported(broken_export)


def test_rejects_an_export_for_another_target(exported, target):
    other = {**target.identity.to_dict(), "name": "other", "content_hash": "sha256:" + "0" * 64}
    with pytest.raises(MismatchError, match="exported for target"):
        load_exported(exported, expected_target=other)


# ------------------------------------------------------------------- writing


def test_export_refuses_to_overwrite_without_flag_and_replaces_with_it(trained, tmp_path):
    out = export_drafter(trained.state_dict(), trained.config, tmp_path / "out")
    with pytest.raises(ExportError, match="already exists; pass --overwrite"):
        export_drafter(trained.state_dict(), trained.config, out)
    export_drafter(trained.state_dict(), trained.config, out, overwrite=True)
    load_exported(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging or old folder left behind


def test_overwrite_never_replaces_a_folder_or_file_that_is_not_an_export(trained, tmp_path):
    notes = tmp_path / "mine"
    notes.mkdir()
    (notes / "notes.txt").write_text("keep me")
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me too")
    for destination in (notes, a_file):
        with pytest.raises(ExportError, match="is not an export of dflash-stages"):
            export_drafter(trained.state_dict(), trained.config, destination, overwrite=True)
    assert (notes / "notes.txt").read_text() == "keep me" and a_file.read_text() == "keep me too"
    empty = tmp_path / "empty"
    empty.mkdir()
    load_exported(export_drafter(trained.state_dict(), trained.config, empty, overwrite=True))


def test_export_refuses_nan_weights_and_leaves_nothing(trained, tmp_path):
    state_dict = {name: t.clone() for name, t in trained.state_dict().items()}
    state_dict["norm.weight"][0] = float("inf")
    with pytest.raises(ExportError, match=r"state_dict\['norm.weight'\] holds NaN/Inf"):
        export_drafter(state_dict, trained.config, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_export_checkpoint_catches_rope_differing_from_the_target(run_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    config_path = run / "checkpoints" / "step_00000001" / "drafter_config.json"
    config = json.loads(config_path.read_text())
    config["rope_theta"] = 10000.0
    config_path.write_text(json.dumps(config))
    with pytest.raises(MismatchError, match="drafter rope_parameters"):
        export_checkpoint(run, tmp_path / "out")


def test_cli_export(run_dir, tmp_path):
    from stages import export as export_stage

    app = typer.Typer()
    app.callback()(lambda: None)
    export_stage.register(app)
    runner = CliRunner()
    out = tmp_path / "cli-export"
    result = runner.invoke(app, ["export", str(run_dir), str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "strict reload" in result.output and "num_speculative_tokens\": 7" in result.output
    spec = json.loads((run_dir / "checkpoints" / "step_00000001" / "target.json").read_text())["target_spec"]
    served = str(resolve_target_path(spec))  # the target it was trained with, named in the serve commands
    assert f"vllm serve {served} " in result.output and f"--model-path {served} " in result.output
    target_row = next(line for line in result.output.splitlines() if " target " in line)
    assert served in target_row and "None" not in target_row and "TARGET" not in result.output
    config, _ = load_exported(out)
    assert config.block_size == BLOCK_SIZE
    again = runner.invoke(app, ["export", str(run_dir), str(out)], env={"COLUMNS": "200"})
    assert again.exit_code == 2 and "already exists" in again.output  # the user's to fix (stages.cli.ExitCode)


def test_export_checkpoint_catches_another_target(run_dir, target_path, tmp_path):
    """A target folder with the same config and tokenizer but other weights has another identity."""
    other = tmp_path / "other-target"
    other.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target_path / name, other / name)
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2)}, str(other / "model.safetensors"))
    with pytest.raises(MismatchError, match="trained on target .* pass --target with the training target"):
        export_checkpoint(run_dir, tmp_path / "out", target=other)


def test_export_checkpoint_warns_when_the_recorded_target_is_unavailable(run_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    target_json = run / "checkpoints" / "step_00000001" / "target.json"
    info = json.loads(target_json.read_text())
    info["target_spec"] = str(tmp_path / "not-on-this-machine")
    target_json.write_text(json.dumps(info))
    with pytest.warns(UserWarning, match="is not available here"):
        out, _ = export_checkpoint(run, tmp_path / "out")
    assert "mask_token" not in json.loads((out / CONFIG_FILE).read_text())["dflash_config"]
    load_exported(out)


def test_checkpoint_load_drafter_reads_exports_through_the_strict_loader(exported, reloaded, target, context):
    from dflash.serving.export import load_drafter

    drafter, config, target_info = load_drafter(exported, target=target)
    assert config == reloaded.config and target_info["content_hash"] == target.identity.content_hash
    torch.testing.assert_close(
        _serving_logits(drafter, context, ANCHORS[1]), _serving_logits(reloaded, context, ANCHORS[1]), rtol=0, atol=0
    )
