"""TargetRunner on the real SmolLM2-135M-Instruct (CPU): taps equal a plain transformers forward, whatever the batch."""

from __future__ import annotations

import json
import random
import textwrap

import numpy as np
import pytest
import torch

from dflash.errors import ConfigError, TargetError
from dflash.target.runner import TargetRunner, plan_batches, plan_packed_batches
from dflash.target.taps import default_target_layer_ids

# Short real stdlib text of mixed lengths (5-16 tokens): enough to exercise padding, cheap on 2 CPU cores.
SNIPPETS = [
    json.dumps.__doc__[:60],
    textwrap.dedent.__doc__[:30],
    random.shuffle.__doc__,
    "import os\nprint(os.getcwd())",
    "def double(x):",
]


@pytest.fixture(scope="module")
def samples(tokenizer):
    return [np.asarray(tokenizer(text)["input_ids"], dtype=np.int32) for text in SNIPPETS]


@pytest.fixture(scope="module")
def layer_ids(target):
    return default_target_layer_ids(target.model.config.num_hidden_layers, 5)


def _plain_forward(model, input_ids, layer_ids):
    with torch.inference_mode():
        ids = torch.as_tensor(input_ids, dtype=torch.int64, device=next(model.parameters()).device)[None]
        outputs = model(ids, output_hidden_states=True)
    return torch.cat([outputs.hidden_states[layer_id + 1][0] for layer_id in layer_ids], dim=-1).to(torch.bfloat16)


def _assert_bf16_close(actual, expected):
    assert actual.dtype == torch.bfloat16 and actual.shape == expected.shape
    # Different padding/batching changes float32 summation order, then bf16 rounding: at most ~1 bf16 ulp.
    torch.testing.assert_close(actual.float(), expected.float(), rtol=1.6e-2, atol=2e-2)


@pytest.fixture(scope="module")
def solo(target, samples, layer_ids):
    """Each sample run alone (token_budget=1 puts every sample in its own batch)."""
    return TargetRunner(target.model, layer_ids, "cpu", token_budget=1).run(samples)


def test_runner_equals_plain_transformers_forward(target, samples, layer_ids, solo):
    assert len(solo) == len(samples)
    for input_ids, hidden in zip(samples, solo, strict=True):
        assert hidden.shape == (len(input_ids), len(layer_ids) * target.model.config.hidden_size)
        _assert_bf16_close(hidden, _plain_forward(target.model, input_ids, layer_ids))


def test_solo_vs_shuffled_mixed_batch_vs_repeat(target, samples, layer_ids, solo):
    order = list(range(len(samples)))
    random.Random(0).shuffle(order)
    shuffled = [samples[i] for i in order]
    batched_runner = TargetRunner(target.model, layer_ids, "cpu", token_budget=4096)  # one padded batch
    assert len(plan_batches([len(s) for s in shuffled], 4096)) == 1
    first = batched_runner.run(shuffled)
    second = batched_runner.run(shuffled)
    for position, index in enumerate(order):
        _assert_bf16_close(first[position], solo[index])
        assert torch.equal(first[position], second[position])  # a repeated call is bit-identical


def _reference_varlen(query, key, value, cu_seq_lens, max_length, scale):
    """What FlashAttention's varlen kernel computes (``dflash.target.runner._flash_varlen``'s contract), one sample at
    a time through SDPA's causal attention: ``[T, Hq, D]`` from ``[T, H, D]`` inputs and int32 sample starts."""
    bounds = cu_seq_lens.tolist()
    assert cu_seq_lens.dtype == torch.int32 and bounds[0] == 0 and bounds[-1] == query.shape[0]
    assert max_length == max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    groups = query.shape[1] // key.shape[1]
    out = torch.empty_like(query)
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        q, k, v = (t[start:stop].transpose(0, 1)[None] for t in (query, key, value))
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out[start:stop] = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)[0].transpose(0, 1)
    return out


@pytest.mark.parametrize(("token_budget", "packed_attention"),
                         [(4096, "sdpa"), (24, "sdpa"), (256, "flex_attention"), (4096, "varlen"), (24, "varlen"),
                          (4096, "varlen-solo")])
def test_packed_batches_equal_each_sample_alone_whatever_they_are_packed_with(target, samples, layer_ids, solo,
                                                                             token_budget, packed_attention,
                                                                             monkeypatch):  # fmt: skip
    """``packing=True``: samples back to back in one row (positions restarting, attention confined to each sample by
    transformers' packed-sequence mask: SDPA's block-diagonal mask or FlexAttention's document BlockMask, or by the
    sample boundaries handed to the varlen kernel); each sample's taps equal its solo forward within bf16, in one
    row or several (24), and a repeated call is bit-identical. SDPA and varlen rows hold no padding; FlexAttention
    rows are filled to the budget (one compiled shape on a GPU) unless one sample is longer. The model's
    own attention implementation is back after every forward. FlashAttention's varlen kernel is CUDA only: here the
    runner's whole varlen path (registration with transformers, sample boundaries through the decoder's kwargs,
    head layout, GQA, scale) runs with the kernel swapped for :func:`_reference_varlen`; the GPU host checks the
    kernel itself (``docs/results/extract_packing_check_h200.py``). ``varlen-solo``: the split a varlen kernel
    without native GQA gets (torch 2.10-2.11), here from 8 tokens on, so that the row's longer samples (9-16 tokens)
    run alone through SDPA and its shorter ones (5-8) through the kernel."""
    import dflash.target.runner as target_runner

    request = packed_attention
    if packed_attention.startswith("varlen"):
        monkeypatch.setattr(target_runner, "_check_varlen", lambda device: target_runner._register_varlen())
        monkeypatch.setattr(target_runner, "_flash_varlen", _reference_varlen)
        solo_calls = []
        if packed_attention == "varlen-solo":
            packed = target_runner._packed_causal_attention
            monkeypatch.setattr(target_runner, "_varlen_parameters", lambda: frozenset({"is_causal"}))  # torch 2.11
            monkeypatch.setattr(target_runner, "_packed_causal_attention",
                                lambda *args: solo_calls.append(args[4]) or packed(*args))
        packed_attention = "varlen"
    if packed_attention == "flex_attention":
        # transformers compiles both the document BlockMask's construction and the FlexAttention kernel: about 50 s
        # of cold inductor C++ on 2 CPU cores. Here both run eagerly: the same mask and the same attention (compiling
        # changes only speed and rounding); the compiled kernel's numerics are checked on the GPU host
        # (docs/results/extract_packing_check_h200.py, extract_packing_varlen_check_h200.py).
        import transformers.integrations.flex_attention as flex_integration
        import transformers.masking_utils as masking_utils
        from torch.nn.attention.flex_attention import flex_attention

        build = masking_utils.create_block_mask
        monkeypatch.setattr(masking_utils, "create_block_mask",
                            lambda *args, **kwargs: build(*args, **{**kwargs, "_compile": False}))
        monkeypatch.setattr(flex_integration.WrappedFlexAttention, "__call__", lambda self: flex_attention)
    order = list(range(len(samples)))
    random.Random(1).shuffle(order)
    shuffled = [samples[i] for i in order]
    before = target.model.config._attn_implementation
    runner = TargetRunner(target.model, layer_ids, "cpu", token_budget=token_budget, packing=True,
                          packed_attention=packed_attention,
                          varlen_solo_min_length=8 if request == "varlen-solo" else None)  # fmt: skip
    rows = plan_packed_batches([len(s) for s in shuffled], token_budget)
    assert (len(rows) == 1) == (token_budget > 24)
    batches = list(runner.iter_batches(shuffled))
    for batch in batches:
        if packed_attention in ("sdpa", "varlen"):
            assert batch.num_padded_tokens == batch.num_tokens  # nothing padded
        else:
            assert batch.num_padded_tokens == max(token_budget, batch.num_tokens)
    assert target.model.config._attn_implementation == before
    first = runner.run(shuffled)
    second = runner.run(shuffled)
    for position, index in enumerate(order):
        _assert_bf16_close(first[position], solo[index])
        assert torch.equal(first[position], second[position])
    if packed_attention == "varlen":
        lengths = sorted((len(s) for s in samples), reverse=True)
        assert min(lengths) < 8 <= max(lengths)  # the split has both kinds of samples to route
        # One split call per decoder layer run, in each of the three forwards, with the row's lengths longest first.
        assert solo_calls in ([], [tuple(lengths)] * (3 * (max(layer_ids) + 1)))
        assert (solo_calls != []) == (token_budget == 4096 and request == "varlen-solo")


def test_packed_causal_attention_routes_long_samples_alone_and_runs_of_short_ones_together(monkeypatch):
    """The split of a packed row on a varlen kernel without native GQA, in any sample order: samples of at least
    ``solo_min_length`` tokens through SDPA alone (``enable_gqa``, no repeated heads), each run of consecutive
    shorter samples through one varlen call on its own slice of the row (starts rebased to 0); the result equals
    the varlen kernel over the whole row."""
    import dflash.target.runner as target_runner

    calls = []

    def kernel(query, key, value, cu_seq_lens, max_length, scale):
        calls.append((cu_seq_lens.tolist(), max_length))
        return _reference_varlen(query, key, value, cu_seq_lens, max_length, scale)

    monkeypatch.setattr(target_runner, "_flash_varlen", kernel)
    lengths = [3, 9, 2, 2, 12, 4, 1]
    generator = torch.Generator().manual_seed(0)
    total = sum(lengths)
    query = torch.randn(1, 6, total, 8, generator=generator)
    key, value = torch.randn(1, 2, total, 8, generator=generator), torch.randn(1, 2, total, 8, generator=generator)
    cu_seq_lens = torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32)
    out = target_runner._packed_causal_attention(query, key, value, cu_seq_lens, lengths, 0.3, solo_min_length=9)
    assert calls == [([0, 3], 3), ([0, 2, 4], 2), ([0, 4, 5], 4)]  # 3 | 9 alone | 2 2 | 12 alone | 4 1
    calls.clear()
    whole = kernel(*(t[0].transpose(0, 1) for t in (query, key, value)), cu_seq_lens, 12, 0.3)
    torch.testing.assert_close(out, whole)
    # The runner's own order (longest first): two long samples side by side open the row, then the short run.
    lengths = [12, 10, 9, 3, 2]
    query = torch.randn(1, 6, sum(lengths), 8, generator=generator)
    key, value = (torch.randn(1, 2, sum(lengths), 8, generator=generator) for _ in range(2))
    cu_seq_lens = torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32)
    calls.clear()
    out = target_runner._packed_causal_attention(query, key, value, cu_seq_lens, lengths, 0.3, solo_min_length=9)
    assert calls == [([0, 3, 5], 3)]  # 12, 10 and 9 alone; only 3 2 through the varlen kernel
    calls.clear()
    torch.testing.assert_close(out, kernel(*(t[0].transpose(0, 1) for t in (query, key, value)), cu_seq_lens, 12, 0.3))
    monkeypatch.setattr(target_runner, "_varlen_parameters", lambda: frozenset({"is_causal"}))  # torch 2.10-2.11
    assert target_runner._solo_min_length(1024, 32, 8) == 1024
    assert target_runner._solo_min_length(None, 32, 8) is None  # the runner asked for no split
    assert target_runner._solo_min_length(1024, 32, 32) is None  # equal head counts: the varlen kernel repeats nothing
    monkeypatch.setattr(target_runner, "_varlen_parameters", lambda: frozenset({"enable_gqa", "window_size"}))
    assert target_runner._solo_min_length(1024, 32, 8) is None  # native GQA in the varlen kernel (torch >= 2.12)


def test_auto_packed_attention_is_varlen_on_cuda_where_torch_has_it_else_flex_and_sdpa_on_cpu(target, layer_ids, monkeypatch):
    import dflash.target.runner as target_runner
    from dflash.target.runner import resolve_packed_attention

    runner = TargetRunner(target.model, layer_ids, "cpu", packing=True)  # the default is "auto"
    assert runner.packed_attention == "sdpa"  # CPU: no compiled mask or kernel
    flex = TargetRunner(target.model, layer_ids, "cpu", packing=True, packed_attention="flex_attention")
    assert flex.packed_attention == "flex_attention"
    monkeypatch.setattr(target_runner, "_varlen_import_error", lambda: None)
    assert resolve_packed_attention("auto", "cuda:1") == "varlen"
    assert resolve_packed_attention("auto", "cpu") == "sdpa"
    assert resolve_packed_attention("flex_attention", "cuda") == "flex_attention"  # an explicit choice is kept
    monkeypatch.setattr(target_runner, "_varlen_import_error", lambda: ImportError("no varlen"))  # torch < 2.10
    assert resolve_packed_attention("auto", "cuda") == "flex_attention"
    with pytest.raises(ConfigError, match="packed_attention must be one of auto, flex_attention, sdpa, varlen"):
        resolve_packed_attention("flash", "cuda")


def test_packed_attention_is_checked(target, layer_ids):
    with pytest.raises(ConfigError, match="packed_attention must be one of auto, flex_attention, sdpa, varlen, got 'flash'"):
        TargetRunner(torch.nn.Module(), [0], "cpu", packing=True, packed_attention="flash")
    with pytest.raises(ConfigError, match="packed_attention=varlen runs FlashAttention, CUDA only .* use packed_attention=flex_attention or sdpa"):
        TargetRunner(target.model, layer_ids, "cpu", packing=True, packed_attention="varlen")
    with pytest.raises(ConfigError, match="varlen_solo_min_length must be >= 1 or None, got 0"):
        TargetRunner(target.model, layer_ids, "cpu", packing=True, varlen_solo_min_length=0)


@pytest.mark.parametrize("signature", ["is_causal", "window_size"])
def test_flash_varlen_calls_either_torch_signature(monkeypatch, signature):
    """torch 2.10-2.11's ``varlen_attn`` takes ``is_causal`` and equal head counts; later ones ``window_size``,
    ``enable_gqa`` and ``scale``. ``_flash_varlen`` must give the same causal, grouped-query, scaled attention through
    both (each fake checks what it is called with, then computes the reference)."""
    import torch.nn.attention.varlen as varlen

    import dflash.target.runner as target_runner

    def old(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        assert is_causal and key.shape[1] == query.shape[1] and cu_seq_k is cu_seq_q and max_k == max_q
        return _reference_varlen(query, key, value, cu_seq_q, max_q, query.shape[-1] ** -0.5)

    def new(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
            window_size=(-1, -1), enable_gqa=False):  # fmt: skip
        assert window_size == (-1, 0) and enable_gqa and key.shape[1] < query.shape[1]
        return _reference_varlen(query, key, value, cu_seq_q, max_q, scale)

    monkeypatch.setattr(varlen, "varlen_attn", old if signature == "is_causal" else new)
    target_runner._varlen_parameters.cache_clear()
    try:
        generator = torch.Generator().manual_seed(0)
        query = torch.randn(13, 6, 8, generator=generator)
        key, value = torch.randn(13, 2, 8, generator=generator), torch.randn(13, 2, 8, generator=generator)
        cu_seq_lens = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
        out = target_runner._flash_varlen(query, key, value, cu_seq_lens, 7, 0.2)
    finally:
        target_runner._varlen_parameters.cache_clear()
    torch.testing.assert_close(out, _reference_varlen(query, key, value, cu_seq_lens, 7, 0.2))
    # Attention stays inside each sample: the second sample (one token) attends to itself only, so it is its value.
    torch.testing.assert_close(out[5], value[5].repeat_interleave(3, dim=0))


def test_plan_packed_batches_fills_rows_first_fit_and_covers_every_sample():
    lengths = np.array([5, 70, 12, 12, 3, 40, 200, 9, 30])
    rows = plan_packed_batches(lengths, token_budget=64)
    assert sorted(np.concatenate(rows).tolist()) == list(range(len(lengths)))
    for row in rows:
        assert len(row) == 1 or lengths[row].sum() <= 64
    # First fit decreasing: 200 and 70 alone (over the budget), then 40+12+12 = 64 fills a row, the rest the next.
    assert [lengths[r].tolist() for r in rows] == [[200], [70], [40, 12, 12], [30, 9, 5, 3]]


def test_compiled_parts_give_the_same_hidden_states_and_the_modules_back_on_close(target, samples, layer_ids):
    """``compile_parts``: the MLP and RMSNorm modules run through ``torch.compile`` (here its ``eager`` backend: the
    traced graphs, run op by op) while the runner is open, giving the plain runner's hidden states on a mixed
    batch bit for bit; on close the modules' own forwards are back."""
    plain = TargetRunner(target.model, layer_ids, "cpu", token_budget=256).run(samples)
    runner = TargetRunner(target.model, layer_ids, "cpu", token_budget=256, compile_parts=True,
                          compile_backend="eager")
    config = target.model.config
    assert len(runner._compiled) == 3 * config.num_hidden_layers + 1  # two norms and an MLP per layer, the final norm
    compiled = runner.run(samples)
    runner.close()
    assert all(torch.equal(a, b) for a, b in zip(compiled, plain, strict=True))
    assert not any("forward" in vars(module) for module in target.model.modules())


def test_stops_after_last_tapped_layer(target, samples, layer_ids):
    decoder_layers = target.model.get_decoder().layers
    called = []
    handles = [layer.register_forward_hook(lambda m, a, o, i=i: called.append(i)) for i, layer in enumerate(decoder_layers)]
    norm_calls = []
    handles.append(target.model.get_decoder().norm.register_forward_hook(lambda m, a, o: norm_calls.append(1)))
    try:
        TargetRunner(target.model, [2, 5], "cpu").run(samples[:1])
    finally:
        for handle in handles:
            handle.remove()
    assert called == list(range(6)) and not norm_calls


def test_final_tap_is_the_final_normed_hidden_state_after_the_taps(target, samples, layer_ids):
    """``final_tap``: the whole decoder runs and its output after the final norm (transformers'
    ``hidden_states[-1]``, what the LM head reads) is one more slot after the taps, padded or packed; a
    non-finite one is named by the last layer's id."""
    hidden_size = target.model.config.hidden_size
    runner = TargetRunner(target.model, layer_ids, "cpu", token_budget=64, final_tap=True)
    assert (runner.num_slots, runner.feature_size) == (len(layer_ids) + 1, (len(layer_ids) + 1) * hidden_size)
    packed = TargetRunner(target.model, layer_ids, "cpu", token_budget=64, final_tap=True, packing=True)
    for states in (runner.run(samples[:2]), packed.run(samples[:2])):
        for input_ids, hidden in zip(samples[:2], states, strict=True):
            with torch.inference_mode():
                ids = torch.as_tensor(input_ids, dtype=torch.int64)[None]
                final = target.model(ids, output_hidden_states=True).hidden_states[-1][0].to(torch.bfloat16)
            _assert_bf16_close(hidden[:, : len(layer_ids) * hidden_size], _plain_forward(target.model, input_ids,
                                                                                          layer_ids))
            _assert_bf16_close(hidden[:, len(layer_ids) * hidden_size :], final)

    def poison(module, args, output):
        output = output.clone()
        output[0, 1] = float("inf")
        return output

    handle = target.model.get_decoder().norm.register_forward_hook(poison)
    try:
        batch = next(TargetRunner(target.model, layer_ids, "cpu", token_budget=1, final_tap=True)
                     .iter_batches(samples[:1]))
    finally:
        handle.remove()
    assert batch.nonfinite_layers == [[target.model.config.num_hidden_layers - 1]]


def test_plan_batches_respects_budget_and_covers_every_sample():
    lengths = np.array([5, 70, 12, 12, 3, 40, 200, 9])
    batches = plan_batches(lengths, token_budget=64)
    flat = np.concatenate(batches)
    assert sorted(flat.tolist()) == list(range(len(lengths)))
    for batch in batches:
        longest = lengths[batch].max()
        assert len(batch) == 1 or len(batch) * longest <= 64
        assert list(lengths[batch]) == sorted(lengths[batch], reverse=True)


@pytest.mark.parametrize("packing", [False, True])
def test_out_receives_each_samples_hidden_states_in_place_bit_for_bit(target, samples, layer_ids, packing):
    """``out``: each sample's hidden states are copied straight into the caller's views (e.g. a ring slot), equal bit
    for bit to the runner's own host buffers for the same batches; a view of the wrong shape is refused."""
    runner = TargetRunner(target.model, layer_ids, "cpu", token_budget=24, packing=packing)
    expected = runner.run(samples)
    flat = torch.full((sum(len(s) for s in samples), runner.feature_size), float("nan"), dtype=torch.bfloat16)
    out = list(flat.split([len(s) for s in samples]))
    batches = list(runner.iter_batches(samples, out=out))
    assert len(batches) > 1  # several forwards, each writing its own samples
    assert sorted(index for batch in batches for index in batch.indices) == list(range(len(samples)))
    for batch in batches:
        for index, hidden in zip(batch.indices, batch.hidden, strict=True):
            assert hidden.data_ptr() == out[index].data_ptr()
    for index, hidden in enumerate(expected):
        assert torch.equal(out[index], hidden)
    with pytest.raises(ValueError, match="out: expected a CPU tensor of shape"):
        list(runner.iter_batches(samples, out=[o[:-1] for o in out]))


def test_nonfinite_flags_name_the_tapped_layers(target, samples, layer_ids):
    poisoned_layer = layer_ids[2] - 1  # inf injected before the 3rd tap: taps 3..5 become non-finite

    def poison(module, args, output):
        output = output.clone()
        output[0, 1] = float("inf")
        return output

    handle = target.model.get_decoder().layers[poisoned_layer].register_forward_hook(poison)
    try:
        batch = next(TargetRunner(target.model, layer_ids, "cpu", token_budget=1).iter_batches(samples[:1]))
    finally:
        handle.remove()
    assert batch.nonfinite_layers == [layer_ids[2:]]


def test_rejects_bad_layer_ids_and_budget(target):
    with pytest.raises(TargetError, match="outside"):
        TargetRunner(target.model, [29], "cpu")
    with pytest.raises(ConfigError, match="token_budget"):
        TargetRunner(target.model, [1], "cpu", token_budget=0)


@pytest.mark.gpu
def test_cuda_bf16_runner_matches_plain_forward_and_batches(samples, layer_ids):
    from dflash.target.load import load_target

    loaded = load_target("default", device="cuda")  # bf16 on CUDA
    runner = TargetRunner(loaded.model, layer_ids, "cuda", token_budget=4096)
    batched = runner.run(samples)  # one padded batch, pinned host copies on a side stream
    solo = TargetRunner(loaded.model, layer_ids, "cuda", token_budget=1).run(samples)
    for input_ids, hidden, alone in zip(samples, batched, solo, strict=True):
        assert hidden.device.type == "cpu" and hidden.is_pinned()
        plain = _plain_forward(loaded.model, input_ids, layer_ids).cpu()
        torch.testing.assert_close(alone.float(), plain.float(), rtol=1.6e-2, atol=2e-2)  # same kernels as solo
        # bf16 compute with a padding mask vs without: relative error of the whole tensor stays at bf16 level.
        relative = (hidden.float() - alone.float()).norm() / alone.float().norm()
        assert relative < 2e-2, relative


@pytest.mark.gpu
def test_cuda_out_lands_in_a_page_locked_ring_slot_bit_for_bit(samples, layer_ids):
    """On CUDA, ``out`` views of a ring slot page-locked by the producer's attach receive the same bytes as the
    runner's pooled pinned buffers, for the same batches."""
    from dflash.batches.ring import Ring, RingGeometry
    from dflash.target.load import load_target

    loaded = load_target("default", device="cuda")
    runner = TargetRunner(loaded.model, layer_ids, "cuda", token_budget=24)
    expected = [hidden.clone() for hidden in runner.run(samples)]
    geometry = RingGeometry(num_slots=2, max_tokens=4096, max_documents=16, width=runner.feature_size)
    with Ring.create(geometry) as owner, Ring.attach(owner.name, pin=True) as producer:
        assert producer.pinned
        slot, ticket = owner.acquire()
        write = producer.begin_batch(slot, ticket, epoch=0, batch_index=0, bucket=0,
                                     corpus_rows=np.arange(len(samples)), input_ids=samples,
                                     loss_mask=[np.ones(len(s), dtype=np.uint8) for s in samples])  # fmt: skip
        pending = list(runner.iter_pending(samples, out=write.documents))
        assert len(pending) > 1
        for item in pending:
            item.finish()
        producer.commit_batch(write)
        read = owner.read_batch(slot, ticket, epoch=0, batch_index=0)
    assert torch.equal(read.hidden, torch.cat(expected))
