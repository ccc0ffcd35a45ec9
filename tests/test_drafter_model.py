"""DFlashDrafter: no leak from the future / other blocks / other documents, serving path == training path."""

from __future__ import annotations

import pytest
import torch
from drafter_fixtures import packed_batch, random_anchors, tiny_drafter

from dflash.drafter import DFlashConfig, DFlashDrafter
from dflash.errors import ConfigError, MismatchError

SERVING_NAMES = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
    f"layers.{{i}}.{name}.weight" for name in (
        "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
        "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
}


def _expected_names(num_layers: int) -> set[str]:
    names = set()
    for name in SERVING_NAMES:
        names |= {name.format(i=i) for i in range(num_layers)} if "{i}" in name else {name}
    return names


def test_parameter_names_are_the_serving_names_and_target_tensors_are_not_saved():
    drafter = tiny_drafter(num_hidden_layers=3)
    assert {n for n, _ in drafter.named_parameters()} == _expected_names(3)
    assert set(drafter.state_dict()) == _expected_names(3)
    hashes = drafter.target_weight_hashes()
    assert hashes["embed_tokens"].startswith("sha256:") and hashes["lm_head"] != hashes["embed_tokens"]


def test_attach_target_checks_shapes_and_tied_head():
    drafter = DFlashDrafter(tiny_drafter().config)
    batch = packed_batch([12], width=64, vocab=97, dtype=torch.float32)
    with pytest.raises(ConfigError, match="attach_target"):
        drafter.forward_train(batch, torch.tensor([2]))
    with pytest.raises(MismatchError, match="vocab_size, hidden_size"):
        drafter.attach_target(torch.zeros(50, 32))
    embedding = torch.randn(97, 32)
    drafter.attach_target(embedding)  # tied
    assert drafter.lm_head_weight is drafter.embed_weight
    hashes = drafter.target_weight_hashes()
    assert hashes["lm_head"] == hashes["embed_tokens"]


def _perturbed(lengths, seed, padding, forbidden, value=None, keep_ids=None):
    batch = packed_batch(lengths, width=64, vocab=97, seed=seed, padding=padding)
    noise = torch.randn_like(batch.hidden) * 5 if value is None else torch.full_like(batch.hidden, value)
    batch.hidden[forbidden] = noise[forbidden]
    if keep_ids is not None:  # change every token id except these (other blocks' inputs and all targets)
        batch.input_ids = torch.where(keep_ids, batch.input_ids, (batch.input_ids + 7) % 96)
    return batch


@pytest.mark.parametrize("seed", range(5))
def test_block_output_depends_only_on_its_own_context_and_block(seed):
    """Random packed documents, random anchors (adjacent allowed): perturbing what a block must not see (context
    at/after its anchor, other documents, other blocks' tokens) leaves its output bit-identical, also with future
    states set to 1e4; perturbing what it must see changes it (the test is not vacuous)."""
    generator = torch.Generator().manual_seed(100 + seed)
    num_documents = int(torch.randint(1, 4, (1,), generator=generator))
    lengths = torch.randint(6, 40, (num_documents,), generator=generator).tolist()
    padding = (seed % 3) * 5
    drafter = tiny_drafter(seed)
    block_size = drafter.config.block_size
    batch = packed_batch(lengths, width=64, vocab=97, seed=seed, padding=padding)
    anchors = random_anchors(batch, block_size, count=12, seed=seed)
    assert anchors.numel() > 0
    positions = torch.arange(batch.num_tokens)
    anchor_documents = batch.document_ids[anchors]
    with torch.no_grad():
        reference = drafter.forward_train(batch, anchors)
        # Other documents (and padding): blocks of document d ignore everything outside d.
        for document in anchor_documents.unique().tolist():
            out = drafter.forward_train(_perturbed(lengths, seed, padding, batch.document_ids != document), anchors)
            rows = anchor_documents == document
            assert torch.equal(out[rows], reference[rows]), (lengths, anchors.tolist(), document)
        # Context at/after the anchor (random noise, then 1e4) and every other token id.
        for j in torch.randperm(anchors.numel(), generator=generator)[:4].tolist():
            anchor = int(anchors[j])
            future = (batch.document_ids == batch.document_ids[anchor]) & (positions >= anchor)
            for value in (None, 1e4):
                perturbed = _perturbed(lengths, seed, padding, future, value, keep_ids=positions == anchor)
                out = drafter.forward_train(perturbed, anchors)
                assert torch.equal(out[j], reference[j]), (lengths, anchors.tolist(), anchor, value)
        # Visible context is used: nudging the state just before each anchor changes that block.
        nudged = packed_batch(lengths, width=64, vocab=97, seed=seed, padding=padding)
        has_context = batch.position_ids[anchors] > 0
        nudged.hidden[(anchors - 1)[has_context]] += 3.0
        out = drafter.forward_train(nudged, anchors)
    for j in torch.nonzero(has_context).squeeze(1).tolist():
        assert not torch.allclose(out[j], reference[j])


def test_padding_anchor_slots_do_not_change_real_blocks():
    drafter = tiny_drafter(3)
    batch = packed_batch([30, 17], width=64, vocab=97, seed=3, padding=9)
    anchors = random_anchors(batch, 4, count=8, seed=3)
    padded = torch.cat([anchors, torch.full((5,), -1)])
    with torch.no_grad():
        a = drafter.forward_train(batch, anchors)
        b = drafter.forward_train(batch, padded)
    torch.testing.assert_close(b[: anchors.numel()], a, rtol=0, atol=1e-12)
    assert torch.isfinite(b).all()


@pytest.mark.parametrize("seed", range(3))
def test_draft_block_equals_training_forward(seed):
    """The serving path (full context, no mask) reproduces the training logits of every block."""
    drafter = tiny_drafter(seed)
    config = drafter.config
    batch = packed_batch([25, 9, 31], width=64, vocab=97, seed=seed)
    anchors = random_anchors(batch, config.block_size, count=10, seed=seed)
    with torch.no_grad():
        hidden = drafter.forward_train(batch, anchors)
        training_logits = hidden @ drafter.lm_head_weight.T  # [A, B, V]
    for j, anchor in enumerate(anchors.tolist()):
        start = anchor - int(batch.position_ids[anchor])
        block = torch.full((config.block_size,), config.mask_token_id)
        block[0] = batch.input_ids[anchor]
        logits = drafter.draft_block(batch.hidden[start:anchor], batch.position_ids[start:anchor], block,
                                     int(batch.position_ids[anchor]))
        torch.testing.assert_close(logits, training_logits[j].float(), rtol=1e-6, atol=1e-6)


def test_rope_follows_target_scaling():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    target_config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=100, max_position_embeddings=131072,
                                rope_parameters={"rope_theta": 500000.0, **scaling})
    config = DFlashConfig.from_target_config(target_config, mask_token_id=5, num_draft_layers=2)
    assert config.rope_theta == 500000.0 and config.rope_scaling["rope_type"] == "llama3"
    drafter = DFlashDrafter(config)
    torch.testing.assert_close(drafter.rotary_emb.inv_freq, LlamaRotaryEmbedding(target_config).inv_freq)
    restored = DFlashConfig.from_dict(config.to_dict())
    assert restored == config


def test_real_smollm2_target_draft_block_matches_training(target, tokenizer):
    """Real SmolLM2 embedding/LM head, real hidden states of real text, the default mask token."""
    import inspect

    from dflash.batches.packed import PackedBatch
    from dflash.drafter import DFlashConfig

    config = DFlashConfig.from_target_config(target.model.config, tokenizer=tokenizer, num_draft_layers=1,
                                             block_size=8)
    assert tokenizer.convert_ids_to_tokens(config.mask_token_id) == "<empty_output>"
    torch.manual_seed(0)
    drafter = DFlashDrafter(config)
    embedding = target.model.get_input_embeddings().weight
    drafter.attach_target(embedding, target.model.get_output_embeddings().weight)
    assert "embed_weight" not in drafter.state_dict()
    text = inspect.getdoc(torch.Tensor.view)[:400]
    ids = torch.tensor(tokenizer(text)["input_ids"][:48])
    with torch.no_grad():
        states = target.model(ids[None], output_hidden_states=True).hidden_states
    hidden = torch.cat([states[i + 1][0] for i in config.target_layer_ids], dim=-1)
    n = ids.numel()
    batch = PackedBatch(input_ids=ids, loss_mask=torch.ones(n, dtype=torch.uint8), hidden=hidden,
                        position_ids=torch.arange(n), document_ids=torch.zeros(n, dtype=torch.int64),
                        cu_seqlens=torch.tensor([0, n]), num_real_tokens=n)
    anchors = torch.tensor([0, 1, 17, 30])
    with torch.no_grad():
        training = drafter.forward_train(batch, anchors) @ embedding.T
    for j, anchor in enumerate(anchors.tolist()):
        block = torch.full((8,), config.mask_token_id)
        block[0] = ids[anchor]
        logits = drafter.draft_block(hidden[:anchor], torch.arange(anchor), block, anchor)
        torch.testing.assert_close(logits, training[j], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("seed,num_layers", [(0, 3), (1, 3), (2, 1)])
def test_training_shortcuts_are_exact_rewrites(seed, num_layers):
    """shared_first_layer (layer 0's q/k/v on the A + 1 distinct rows) and skip_anchor_rows (the last layer drops
    block position 0 before o_proj) give the plain forward's outputs at positions 1..B-1 and the same loss and
    gradients; position 0 of the full forward is unchanged by the shared first layer. Packed documents, adjacent
    anchors, padding slots, the MASK id also as a real token, one layer (first = last); and the shortcuts really
    run (row counts seen by layer 0's q_proj and the last layer's o_proj)."""
    from dflash.drafter import dflash_loss
    from dflash.drafter.model import set_train_shortcuts

    lengths = [[23, 17, 9], [40], [12, 30]][seed]
    batch = packed_batch(lengths, width=64, vocab=97, seed=seed, padding=5)
    anchors = torch.cat([random_anchors(batch, 4, 9, seed=seed), torch.full((3,), -1)])
    batch.input_ids[anchors[:3]] = 96  # mask_token_id as a real anchor token
    batch.input_ids[anchors[3:5] + 1] = 96  # and as a target
    num_anchors = anchors.shape[0]
    drafter = tiny_drafter(seed, num_hidden_layers=num_layers).train()
    rows = {}
    hooks = [drafter.layers[0].self_attn.q_proj.register_forward_hook(
                 lambda m, args, out: rows.setdefault("q_proj0", []).append(args[0].shape[0])),
             drafter.layers[-1].self_attn.o_proj.register_forward_hook(
                 lambda m, args, out: rows.setdefault("o_proj_last", []).append(args[0].shape[0]))]
    results = {}
    for name, on in {"plain": False, "shortcuts": True}.items():
        previous = set_train_shortcuts(shared_first_layer=on, skip_anchor_rows=on)
        rows.clear()
        try:
            drafter.zero_grad()
            full = drafter.forward_train(batch, anchors)
            predictions = drafter.forward_train(batch, anchors, predictions_only=True)
            empty = drafter.forward_train(batch, anchors[:0])
            out = dflash_loss(drafter, batch, anchors)
            out.loss().backward()
        finally:
            set_train_shortcuts(**previous)
        queries = num_anchors * 4
        assert rows["q_proj0"][:2] == ([num_anchors + 1] * 2 if on else [queries] * 2)
        assert rows["o_proj_last"][:2] == ([queries, num_anchors * 3] if on else [queries] * 2)
        assert empty.shape == (0, 4, 32)
        assert predictions.shape == (num_anchors, 3, 32)
        torch.testing.assert_close(predictions, full[:, 1:], rtol=1e-10, atol=1e-10)
        results[name] = (full.detach(), out.weighted_ce_sum.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters()})
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(results["plain"][0], results["shortcuts"][0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(results["plain"][1], results["shortcuts"][1], rtol=1e-10, atol=1e-10)
    assert results["plain"][1] > 0
    for name, grad in results["plain"][2].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(results["shortcuts"][2][name], grad, rtol=1e-9, atol=1e-12, msg=name)
    with pytest.raises(ConfigError, match="unknown training shortcut"):
        set_train_shortcuts(dedupe=True)


def test_residual_stream_dtype_under_autocast():
    """Under bf16 autocast the block tokens' residual stream is bf16 by default (as serving runs it) and float32
    with ``residual_in_compute_dtype = False``; both give the float32 reference outputs within bf16 rounding, and
    without autocast the switch changes nothing."""
    drafter = tiny_drafter(4, dtype=torch.float32)
    batch = packed_batch([30, 21], width=64, vocab=97, seed=4, dtype=torch.float32)
    anchors = random_anchors(batch, drafter.config.block_size, count=8, seed=4)
    seen = []
    hook = drafter.layers[0].register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    with torch.no_grad():
        reference = drafter.forward_train(batch, anchors)
        outputs = {}
        for flag in (True, False):
            drafter.residual_in_compute_dtype = flag
            torch.testing.assert_close(drafter.forward_train(batch, anchors), reference, rtol=0, atol=0)
            seen.clear()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outputs[flag] = drafter.forward_train(batch, anchors).float()
            assert seen == [torch.bfloat16 if flag else torch.float32]
    hook.remove()
    scale = reference.abs().max()
    for flag, out in outputs.items():
        assert (out - reference).abs().max() < 0.05 * scale, flag
    assert not torch.equal(outputs[True], outputs[False])  # the switch really changes the arithmetic
