"""The static-cache decode loop (generate's default engine on CUDA) against transformers' own ``generate()``, on the
real SmolLM2 target in float32 on CPU (the same loop without CUDA graphs)."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import weakref

import pytest
import torch

from dflash.generation.engine import GenerationRequest, SamplingSettings
from dflash.generation.static_decode import StaticDecoder, gumbel_noise
from dflash.generation.transformers_engine import TransformersEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXTS = [
    "def fibonacci(n):",
    'import os\nimport sys\n\ndef main(argv):\n    """Parse the command line and',
    "class Stack:\n    def __init__(self):",
    "# A",
    "The quick brown fox",
]


@pytest.fixture(scope="module")
def prompts(target):
    return [target.tokenizer(text)["input_ids"] for text in TEXTS]


def reference(target, prompt, max_new_tokens, stops):
    output = target.model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                   eos_token_id=stops, pad_token_id=0)
    return output[0, len(prompt):].tolist()


def test_greedy_equals_transformers_generate_per_prompt(target, prompts):
    stops = [target.tokenizer.eos_token_id]
    limits = [10, 10, 6, 10, 4]
    decoder = StaticDecoder(target.model, rows=6, pad_token_id=0, stop_token_ids=stops, length_bucket=32)
    got = decoder.decode(prompts, limits)
    for prompt, tokens, limit in zip(prompts, got, limits, strict=True):
        assert tokens == reference(target, prompt, limit, stops)
    # The same requests in another batch composition and width (the cache slot is reused, stale entries masked).
    again = decoder.decode(prompts[::-1][:3], limits[::-1][:3], width=40)
    assert again == got[::-1][:3]
    assert decoder.last_mode == "eager"  # no CUDA graphs on CPU
    decoder.close()
    assert target.model.config._attn_implementation == "sdpa"  # the model's own attention is back


def test_kv_cache_bytes_are_what_the_static_cache_allocates(target, prompts):
    from transformers import StaticCache

    from dflash.generation.static_decode import kv_cache_bytes

    cache = StaticCache(config=target.model.config, max_cache_len=48)
    ids = torch.tensor([p[:4] for p in prompts[:3]])
    argument = "cache" if "cache" in inspect.signature(target.model.forward).parameters else "past_key_values"
    target.model(input_ids=ids, use_cache=True, **{argument: cache})  # the layers allocate at their first write
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert held == kv_cache_bytes(target.model.config, 3, 48, torch.float32) > 0


def _memory_of(config, prompts, new_tokens: int) -> tuple[int, int]:
    """What a 6-row float32 decoder (length bucket 32) counts for ``prompts`` and ``new_tokens``: the first forward's
    reserve and one row's cache."""
    from dflash.generation.static_decode import forward_activation_bytes, kv_cache_bytes

    width = max(map(len, prompts))
    length = -(-(width + new_tokens) // 32) * 32
    return (forward_activation_bytes(config, 6 * width, 6, width, torch.float32, columns=length),
            kv_cache_bytes(config, 1, length, torch.float32) + 4 * length)


def test_rows_beyond_the_memory_decode_fewer_at_a_time_to_the_same_tokens(target, prompts, caplog):
    """A memory budget that holds 2 of 6 rows: the 5 prompts decode 2 at a time (a warning names the setting), to
    the tokens of the uncapped decoder; a budget below one row is refused, naming what to lower."""
    from dflash.errors import ConfigError

    stops = [target.tokenizer.eos_token_id]
    limits = [10, 10, 6, 10, 4]
    free = StaticDecoder(target.model, rows=6, pad_token_id=0, stop_token_ids=stops, length_bucket=32)
    expected = free.decode(prompts, limits)
    assert free.last_rows == 6
    free.close()
    reserve, per_row = _memory_of(target.model.config, prompts, 10)
    capped = StaticDecoder(target.model, rows=6, pad_token_id=0, stop_token_ids=stops, length_bucket=32,
                           kv_memory=reserve + 2 * per_row + per_row // 2)
    with caplog.at_level("WARNING", logger="dflash.generation.static_decode"):
        assert capped.decode(prompts, limits) == expected
    assert capped.last_rows == 2 and "decoding 2 rows at a time" in caplog.text and "generate.batch_size" in caplog.text
    capped.close()
    starved = StaticDecoder(target.model, rows=6, pad_token_id=0, stop_token_ids=stops, length_bucket=32,
                            kv_memory=reserve + per_row // 2)
    with pytest.raises(ConfigError, match="lower generate.max_length"):
        starved.decode(prompts, limits)
    starved.close()


def test_rows_beyond_the_memory_sample_each_request_as_the_whole_batch_does(target, prompts):
    """Sampled decoding over a memory budget of 2 rows: each chunk takes its own requests' keys (the tokens of the
    uncapped decoder); keys that do not match the prompts are refused as the uncapped decoder refuses them, before
    any chunk decodes."""

    stops = [target.tokenizer.eos_token_id]
    limits, keys = [6, 6, 4, 6, 3], [11, 12, 13, 14, 15]
    free = StaticDecoder(target.model, rows=6, pad_token_id=0, stop_token_ids=stops, length_bucket=32)
    expected = free.decode(prompts, limits, temperature=0.9, row_keys=keys)
    with pytest.raises(ValueError, match="one row key per prompt"):
        free.decode(prompts[:4], limits[:4], temperature=0.9, row_keys=keys)
    free.close()
    reserve, per_row = _memory_of(target.model.config, prompts, 6)
    capped = StaticDecoder(target.model, rows=6, pad_token_id=0, stop_token_ids=stops, length_bucket=32,
                           kv_memory=reserve + 2 * per_row + per_row // 2)
    assert capped.decode(prompts, limits, temperature=0.9, row_keys=keys) == expected and capped.last_rows == 2
    for count, wrong in ((4, keys), (5, keys[:4]), (5, None)):  # 4 prompts: two whole chunks of 2
        with pytest.raises(ValueError, match="one row key per prompt"):
            capped.decode(prompts[:count], limits[:count], temperature=0.9, row_keys=wrong)
    capped.close()


def test_rows_are_counted_again_for_a_wider_forward_and_without_the_caches_of_other_lengths(target, prompts):
    """The rows of a cache length are counted for the widest forward seen at that length: a later call at the same
    length with wider prompts decodes fewer rows at a time where the wider prefill leaves room for fewer. The caches
    held count against ``kv_memory`` as against a device's free memory; a new length whose rows do not fit beside
    them frees them first and is counted against the whole budget (not refused, not squeezed)."""
    from dflash.generation.static_decode import forward_activation_bytes, kv_cache_bytes

    config = target.model.config
    stops = [target.tokenizer.eos_token_id]
    limits = [4, 4, 3, 4, 2]
    longest = max(map(len, prompts))
    per_row = kv_cache_bytes(config, 1, 64, torch.float32) + 4 * 64
    narrow = forward_activation_bytes(config, 6 * longest, 6, longest, torch.float32, columns=64)
    wide = forward_activation_bytes(config, 6 * 56, 6, 56, torch.float32, columns=64)
    budget = narrow + 5 * per_row + per_row // 2
    decoder = StaticDecoder(target.model, rows=6, pad_token_id=0, stop_token_ids=stops, length_bucket=64,
                            kv_memory=budget)
    expected = decoder.decode(prompts, limits)
    assert decoder.last_rows == 5
    fewer = (budget - wide) // per_row
    assert 1 <= fewer < 5
    assert decoder.decode(prompts, limits, width=56) == expected and decoder.last_rows == fewer
    # A longer cache (128 positions): counted alone, the 64-position caches freed first.
    per_long = kv_cache_bytes(config, 1, 128, torch.float32) + 4 * 128
    alone = (budget - forward_activation_bytes(config, 6 * longest, 6, longest, torch.float32, columns=128)) // per_long
    assert 1 <= alone < 5
    decoder.decode(prompts, [66 - longest, 4, 3, 4, 2])  # the widest prompt and its tokens pass 64 positions
    assert decoder.last_rows == alone and {length for _, length, _ in decoder._slots} == {128}
    decoder.close()


def test_the_memory_count_holds_the_prefill_mask_over_every_cache_column(target, prompts):
    """The prefill's additive mask spans the whole cache (prompt columns and the new tokens' columns): a budget
    that holds one row beside a mask over the prompt columns only, but not beside the mask the prefill builds, fits
    no row."""
    from dflash.errors import ConfigError
    from dflash.generation.static_decode import forward_activation_bytes, kv_cache_bytes

    config = target.model.config
    decoder = StaticDecoder(target.model, rows=6, pad_token_id=0, stop_token_ids=[0], length_bucket=32)
    _, _, mask, _ = decoder._prefill_inputs(prompts, 6, 20, 64)
    narrow = forward_activation_bytes(config, 6 * 20, 6, 20, torch.float32)
    wide = forward_activation_bytes(config, 6 * 20, 6, 20, torch.float32, columns=64)
    assert wide - narrow == (mask.numel() - 6 * 20 * 20) * mask.element_size() * 5 // 4
    per_row = kv_cache_bytes(config, 1, 64, torch.float32) + 4 * 64
    decoder.kv_memory = wide + per_row - 1
    with pytest.raises(ConfigError, match="lower generate.max_length"):
        decoder.rows_that_fit(64, 6 * 20, 20)
    decoder.kv_memory = wide + per_row
    assert decoder.rows_that_fit(64, 6 * 20, 20) == 1
    decoder.close()


def test_the_memory_count_of_configs_without_intermediate_size_or_head_dim():
    """Configs that name their MLP width otherwise (GPT-2's ``n_inner``, None: 4x the hidden size) or route tokens
    through experts (``moe_intermediate_size`` per routed expert) are counted, not an AttributeError; the wider MLP
    counts."""
    from types import SimpleNamespace

    from dflash.generation.static_decode import forward_activation_bytes, kv_cache_bytes

    base = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=100)
    gpt2 = SimpleNamespace(**base, n_inner=None)
    dense = SimpleNamespace(**base, num_key_value_heads=4, head_dim=16, intermediate_size=256)
    assert kv_cache_bytes(gpt2, 3, 10, torch.float32) == kv_cache_bytes(dense, 3, 10, torch.float32) == 2 * 2 * 3 * 4 * 10 * 16 * 4
    assert forward_activation_bytes(gpt2, 8, 1, 8, torch.float32) == forward_activation_bytes(dense, 8, 1, 8, torch.float32)
    moe = SimpleNamespace(**base, moe_intermediate_size=96, num_experts_per_tok=4)
    wider = SimpleNamespace(**base, intermediate_size=4 * 96)
    assert forward_activation_bytes(moe, 8, 1, 8, torch.bfloat16) == forward_activation_bytes(wider, 8, 1, 8, torch.bfloat16)
    both = SimpleNamespace(**base, intermediate_size=128, moe_intermediate_size=96, num_experts_per_tok=4)
    assert forward_activation_bytes(both, 8, 1, 8, torch.bfloat16) == forward_activation_bytes(wider, 8, 1, 8, torch.bfloat16)


def test_deterministic_decoder_gives_the_same_greedy_tokens(target, prompts):
    from dflash.generation.static_decode import DETERMINISTIC_ATTENTION_NAME

    stops = [target.tokenizer.eos_token_id]
    limits = [8, 8, 5, 8, 3]
    fast = StaticDecoder(target.model, rows=6, pad_token_id=0, stop_token_ids=stops, length_bucket=32)
    expected = fast.decode(prompts, limits)
    fast.close()
    repeatable = StaticDecoder(target.model, rows=6, pad_token_id=0, stop_token_ids=stops, length_bucket=32,
                               deterministic=True)
    assert target.model.config._attn_implementation == DETERMINISTIC_ATTENTION_NAME
    assert repeatable.decode(prompts, limits) == expected
    repeatable.close()
    assert target.model.config._attn_implementation == "sdpa"


def test_a_stop_token_ends_a_row_and_is_kept(target, prompts):
    first = reference(target, prompts[0], 6, [target.tokenizer.eos_token_id])
    stop = first[3]  # make the 4th greedy token a stop token
    decoder = StaticDecoder(target.model, rows=2, pad_token_id=0, stop_token_ids=[stop], length_bucket=16)
    assert decoder.decode(prompts[:1], [6]) == [first[: first.index(stop) + 1]]
    decoder.close()


def test_sampling_depends_on_the_request_not_on_the_batch(target, prompts):
    decoder = StaticDecoder(target.model, rows=4, pad_token_id=0, stop_token_ids=[target.tokenizer.eos_token_id])
    together = decoder.decode(prompts[:3], [8] * 3, temperature=0.9, top_p=0.95, row_keys=[7, 8, 9])
    apart = decoder.decode([prompts[2], prompts[0]], [8, 8], temperature=0.9, top_p=0.95, row_keys=[9, 7])
    assert apart == [together[2], together[0]]
    other_key = decoder.decode(prompts[:1], [8], temperature=0.9, top_p=0.95, row_keys=[1234])
    assert other_key != together[:1]
    # A nucleus so small that only the top token survives is greedy decoding.
    greedy = decoder.decode(prompts[:2], [6, 6])
    assert decoder.decode(prompts[:2], [6, 6], temperature=1.0, top_p=1e-6, row_keys=[1, 2]) == greedy
    decoder.close()


def test_both_decode_attentions_equal_sdpa_with_either_mask_kind():
    from transformers import AttentionInterface

    from dflash.generation.static_decode import deterministic_decode_attention, grouped_decode_attention

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(3, 6, 1, 8, generator=generator)
    key, value = torch.randn(3, 2, 10, 8, generator=generator), torch.randn(3, 2, 10, 8, generator=generator)
    visible = torch.rand(3, 1, 1, 10, generator=generator) > 0.3
    visible[..., -1] = True
    additive = torch.zeros(3, 1, 1, 10).masked_fill_(~visible, torch.finfo(torch.float32).min)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = 3, True, False
    expected, _ = AttentionInterface()["sdpa"](module, query, key, value, visible, scaling=0.3)
    for function in (grouped_decode_attention, deterministic_decode_attention):
        for mask in (visible, additive):
            got, _ = function(module, query, key, value, mask, scaling=0.3)
            assert got.shape == (3, 1, 6, 8)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_gumbel_max_samples_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    keys = torch.arange(20_000, dtype=torch.long)
    draws = (logits[None] + gumbel_noise(keys, step=3, vocab_size=4)).argmax(-1)
    observed = torch.bincount(draws, minlength=4).double()
    expected = logits.double().softmax(-1) * len(keys)
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 16.3  # 3 degrees of freedom, p = 0.001
    again = (logits[None] + gumbel_noise(keys, step=3, vocab_size=4)).argmax(-1)
    assert torch.equal(draws, again)
    assert not torch.equal(draws, (logits[None] + gumbel_noise(keys, step=4, vocab_size=4)).argmax(-1))


def test_the_engine_static_and_dynamic_caches_agree(target, prompts):
    """The same replies through both caches, reported as each batch decodes: the tokens its rows have chosen so far
    (generate()'s streamer: every step, rows past their own limit not counted; the static decoder: at its checks of
    the rows, here every 2 steps), then the batch's replies and exact tokens."""
    limits = [10, 3, 10, 6, 10]
    requests = [GenerationRequest(request_id=i, prompt_ids=p, max_new_tokens=n)
                for i, (p, n) in enumerate(zip(prompts, limits, strict=True))]
    settings = SamplingSettings(max_new_tokens=10)
    results = {}
    for cache in ("static", "dynamic"):
        engine = TransformersEngine(target.model, target.tokenizer, batch_size=3, cache=cache, prompt_bucket=8)
        if cache == "static":
            engine._decoder.check_every = 2
        reported = []
        engine.progress = lambda *call, seen=reported: seen.append(call)
        results[cache] = [(r.request_id, r.token_ids, r.finish_reason) for r in engine.generate(requests, settings)]
        assert engine.decode_step == ("eager" if cache == "static" else "generate()")
        engine.close()
        finals = [index for index, (replies, _, _) in enumerate(reported) if replies]
        assert [reported[i][0] for i in finals] == [3, 2] and finals[-1] == len(reported) - 1
        assert sum(reported[i][1] for i in finals) == sum(len(tokens) for _, tokens, _ in results[cache])
        start = 0
        for index in finals:
            during = [decoding for replies, tokens, decoding in reported[start:index] if replies == tokens == 0]
            assert len(during) == index - start >= 2 and during == sorted(during) and reported[index][2] == 0
            if cache == "dynamic":  # exact, step by step
                assert during[-1] == reported[index][1]
            else:  # a row that ended since the last check counts the tokens it had then
                assert 0 < during[-1] <= reported[index][1]
            start = index + 1
    assert results["static"] == results["dynamic"]
    assert all(len(tokens) == limits[i] or reason == "stop" for i, tokens, reason in results["static"])


def test_the_engine_reports_the_fewest_rows_any_batch_decoded_at_once(target, prompts):
    """Batch after batch, the engine's ``rows`` is the fewest rows any batch of the call decoded at once: the first
    batch (short prompts, 25 new tokens: a 64-position cache) holds fewer rows than the last (longer prompts, 4 new
    tokens: 32 positions); the replies are the uncapped engine's."""
    from dflash.generation.static_decode import forward_activation_bytes, kv_cache_bytes

    config = target.model.config
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    limits = {i: 25 if rank < 3 else 4 for rank, i in enumerate(order)}
    requests = [GenerationRequest(request_id=i, prompt_ids=p, max_new_tokens=limits[i]) for i, p in enumerate(prompts)]
    settings = SamplingSettings(max_new_tokens=25)
    free = TransformersEngine(target.model, target.tokenizer, batch_size=3, cache="static", prompt_bucket=8)
    expected = [r.token_ids for r in free.generate(requests, settings)]
    assert free.last_stats["rows"] == 3
    free.close()
    engine = TransformersEngine(target.model, target.tokenizer, batch_size=3, cache="static", prompt_bucket=8)
    engine._decoder.length_bucket = 32
    short = -(-max(len(prompts[i]) for i in order[:3]) // 8) * 8
    long = -(-max(len(prompts[i]) for i in order[3:]) // 8) * 8
    per_64, per_32 = (kv_cache_bytes(config, 1, n, torch.float32) + 4 * n for n in (64, 32))
    first = forward_activation_bytes(config, 3 * short, 3, short, torch.float32, columns=64)
    engine._decoder.kv_memory = budget = first + per_64 * 19 // 10
    last = forward_activation_bytes(config, 3 * long, 3, long, torch.float32, columns=32)
    assert (budget - first) // per_64 == 1 < (budget - last) // per_32 < 3
    assert [r.token_ids for r in engine.generate(requests, settings)] == expected
    assert engine._decoder.last_rows == (budget - last) // per_32 and engine.last_stats["rows"] == 1
    engine.close()


def _cuda_llama():
    """A random GQA Llama in float32 on CUDA, large init: peaked logits, no near-ties."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, attn_implementation="sdpa")
    return LlamaForCausalLM(config).cuda().eval()


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager_decoding_and_generate():
    """On CUDA: the captured decode step gives the tokens the eager loop gives, and transformers' greedy
    ``generate()`` gives, on a random GQA Llama in float32 (large init: peaked logits, no near-ties)."""
    model = _cuda_llama()
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 512, (n,), generator=generator).tolist() for n in (5, 17, 9, 30, 2)]
    limits = [24, 24, 13, 24, 7]
    graphs = StaticDecoder(model, rows=8, pad_token_id=0, stop_token_ids=[511], length_bucket=32)
    first = graphs.decode(prompts, limits)
    assert graphs.last_mode == "graph"
    assert graphs.decode(prompts[::-1], limits[::-1]) == first[::-1]  # replayed graph, other rows
    graphs.close()
    eager = StaticDecoder(model, rows=8, pad_token_id=0, stop_token_ids=[511], length_bucket=32, cuda_graphs=False)
    assert eager.decode(prompts, limits) == first
    eager.close()
    for prompt, tokens, limit in zip(prompts, first, limits, strict=True):
        output = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=limit, do_sample=False,
                                eos_token_id=[511], pad_token_id=0)
        assert tokens == output[0, len(prompt):].tolist()


@pytest.mark.gpu
def test_cuda_stream_with_captured_steps_equals_generate_and_the_batches():
    """On CUDA: continuous batching (12 prompts through 4 rows, the decode step one captured graph, a stop token
    that ends some replies early) gives transformers' greedy ``generate()`` tokens for every prompt, and the batch
    decoder's, on a random GQA Llama in float32 (large init: peaked logits, no near-ties)."""
    model = _cuda_llama()
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 512, (n,), generator=generator).tolist() for n in (5, 17, 9, 30, 2, 44, 1, 12, 23,
                                                                                    7, 61, 3)]
    limits = [24, 24, 13, 24, 7, 1, 24, 20, 24, 5, 24, 16]
    batches = StaticDecoder(model, rows=4, pad_token_id=0, stop_token_ids=[511], length_bucket=32,
                            compile_parts=False)
    first = [tokens for k in range(0, 12, 4) for tokens in batches.decode(prompts[k:k + 4], limits[k:k + 4])]
    batches.close()
    stop = first[0][5]  # prompt 0 stops at its 6th token; others stop wherever that token comes
    batches = StaticDecoder(model, rows=4, pad_token_id=0, stop_token_ids=[stop], length_bucket=32,
                            compile_parts=False)
    expected = [tokens for k in range(0, 12, 4) for tokens in batches.decode(prompts[k:k + 4], limits[k:k + 4])]
    batches.close()
    stream = StaticDecoder(model, rows=4, pad_token_id=0, stop_token_ids=[stop], length_bucket=32,
                           compile_parts=False, check_every=4)
    assert stream.streams
    assert stream.decode_stream(prompts, limits, prompt_bucket=8, refill_rows=1) == expected
    assert stream.last_mode == "graph"
    assert stream.decode_stream(prompts[::-1], limits[::-1]) == expected[::-1]  # the allocated cache, refilled rows
    stream.close()
    assert len(expected[0]) == first[0].index(stop) + 1 < limits[0]
    for prompt, tokens, limit in zip(prompts, expected, limits, strict=True):
        output = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=limit, do_sample=False,
                                eos_token_id=[stop], pad_token_id=0)
        assert tokens == output[0, len(prompt):].tolist()


@pytest.mark.gpu
def test_cuda_ranged_attention_of_float32_inputs_is_float32():
    """On CUDA, float32 inputs attend in float32 (Triton's float32 dot is TF32 there unless asked otherwise, about
    1e-3 off): within 1e-5 of float64 softmax attention over each row's own range, ranges across chunks, of one
    position, empty (zeros) and the whole cache."""
    from dflash.generation.ranged_attention import CHUNK, ranged_decode_attention

    generator = torch.Generator().manual_seed(0)
    length = 2 * CHUNK + 88
    query = torch.randn(6, 6, 1, 64, generator=generator)
    key, value = torch.randn(6, 2, length, 64, generator=generator), torch.randn(6, 2, length, 64, generator=generator)
    ranges = [(0, length), (10, 11), (CHUNK - 5, 2 * CHUNK + 3), (300, 300), (5, 200), (260, length)]
    starts = torch.tensor([s for s, _ in ranges], dtype=torch.int32)
    ends = torch.tensor([e for _, e in ranges], dtype=torch.int32)
    got = ranged_decode_attention(query.cuda(), key.cuda(), value.cuda(), starts.cuda(), ends.cuda(), scale=0.125)
    got = got.cpu()
    for row, (start, end) in enumerate(ranges):
        if start == end:
            assert torch.equal(got[row], torch.zeros(1, 6, 64))
            continue
        keys = key[row, :, start:end].double().repeat_interleave(3, 0)
        values = value[row, :, start:end].double().repeat_interleave(3, 0)
        expected = torch.softmax(query[row].double() @ keys.transpose(-1, -2) * 0.125, -1) @ values
        torch.testing.assert_close(got[row, 0], expected[:, 0].float(), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_cuda_stream_in_the_default_configuration_replays_what_it_decodes_eagerly_and_frees_the_last_cache():
    """On CUDA, with the defaults generate runs (MLP and norms through torch.compile's inductor, the fused attention):
    the stream with its decode step captured gives, greedy and sampled, the tokens of the same loop run eagerly
    (12 prompts through 4 rows: refills into the allocated cache while the graph exists); a call of another cache
    length frees the previous call's cache and graph at once (nothing else holds them)."""
    model = _cuda_llama()
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 512, (n,), generator=generator).tolist() for n in (5, 17, 9, 30, 2, 44, 1, 12, 23,
                                                                                    7, 61, 3)]
    limits = [24, 24, 13, 24, 7, 1, 24, 20, 24, 5, 24, 16]
    keys = [7 * 2**32 + i for i in range(12)]
    stream = dict(prompt_bucket=8, refill_rows=1)
    decoder = StaticDecoder(model, rows=4, pad_token_id=0, stop_token_ids=[511], length_bucket=32, check_every=4,
                           cuda_graphs=False)  # eagerly first, then captured: the same compiled parts and refills
    assert decoder.streams and decoder._compiled
    expected = [decoder.decode_stream(prompts, limits, **stream),
                decoder.decode_stream(prompts, limits, temperature=0.8, top_p=0.9, row_keys=keys, **stream)]
    assert decoder.last_mode == "eager"
    decoder.cuda_graphs = True
    assert decoder.decode_stream(prompts, limits, **stream) == expected[0]
    assert decoder.last_mode == "graph"
    assert decoder.decode_stream(prompts, limits, temperature=0.8, top_p=0.9, row_keys=keys, **stream) == expected[1]
    long_prompts = [torch.randint(1, 512, (n,), generator=generator).tolist() for n in (300, 280, 310, 290)]
    decoder.decode_stream(long_prompts, [100] * 4, **stream)
    longer = next(iter(decoder._slots.values()))
    assert longer.graph is not None
    held = [weakref.ref(longer.graph)] + [weakref.ref(t) for layer in longer.cache.layers for t in (layer.keys,
                                                                                                    layer.values)]
    del longer
    assert decoder.decode_stream(prompts, limits, **stream) == expected[0]  # a new cache, captured again
    assert decoder.last_mode == "graph" and len(decoder._slots) == 1
    assert all(ref() is None for ref in held)  # freed when the new length came, without waiting for gc
    decoder.close()


@pytest.mark.gpu
def test_cuda_stream_on_a_second_gpu_from_a_thread_that_never_set_the_device():
    """A Dask worker's task thread has GPU 0 current whatever GPU its replica's model is on (the current device is
    per thread): run from such a thread for a model on ``cuda:1``, the stream (captured step, refills) and the batch
    decoder give transformers' greedy tokens there."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    import threading

    model = _cuda_llama().to("cuda:1")
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 512, (n,), generator=generator).tolist() for n in (5, 17, 9, 30, 2, 44)]
    limits = [24, 24, 13, 24, 7, 16]
    got: dict[str, object] = {}

    def run() -> None:
        try:
            got["current"] = torch.cuda.current_device()
            decoder = StaticDecoder(model, rows=4, pad_token_id=0, stop_token_ids=[511], length_bucket=32,
                                    compile_parts=False)
            got["stream"] = decoder.decode_stream(prompts, limits, prompt_bucket=8, refill_rows=1)
            got["stream_mode"] = decoder.last_mode
            got["batch"] = decoder.decode(prompts[:4], limits[:4])
            got["batch_mode"] = decoder.last_mode
            decoder.close()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test thread below
            got["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in got:
        raise got["error"]  # type: ignore[misc]
    assert got["current"] == 0 and got["stream_mode"] == got["batch_mode"] == "graph"
    expected = [model.generate(torch.tensor([prompt], device="cuda:1"), max_new_tokens=limit, do_sample=False,
                               eos_token_id=[511], pad_token_id=0)[0, len(prompt):].tolist()
                for prompt, limit in zip(prompts, limits, strict=True)]
    assert got["stream"] == expected and got["batch"] == expected[:4]


_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def interpreted_ranged():
    """``dflash.generation.ranged_attention`` with its Triton kernels (the ones CUDA runs) executed by Triton's
    interpreter on the CPU, program by program; the interpreter must be on before Triton is imported, so these
    tests run in the subprocess of :func:`test_the_ranged_kernels_under_tritons_interpreter` (or on CUDA)."""
    if not _INTERPRETING:
        pytest.skip("runs with TRITON_INTERPRET=1 (see test_the_ranged_kernels_under_tritons_interpreter)")
    pytest.importorskip("triton")
    import dflash.generation.ranged_attention as module

    return module


def test_the_ranged_kernels_under_tritons_interpreter():
    """The ``interpreted`` tests below, in a fresh interpreter with ``TRITON_INTERPRET=1`` (Triton on CPU)."""
    pytest.importorskip("triton")
    if _INTERPRETING:
        pytest.skip("this process interprets: the tests ran here")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                             "interpreted"], env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0 and re.search(r"\b9 passed", result.stdout), result.stdout[-4000:] + result.stderr[-2000:]


def test_interpreted_ranged_attention_reads_exactly_each_rows_range(interpreted_ranged):
    """Against softmax attention over the row's own positions: ranges inside one chunk, across the chunk boundary,
    of one position, empty (a finished row: zeros), and the whole cache (two chunks, the second a partial one of
    88 positions: tiles inside and outside each range, a partial tile); 3 query heads per KV head."""
    generator = torch.Generator().manual_seed(0)
    chunk = interpreted_ranged.CHUNK
    length = chunk + 88
    query = torch.randn(6, 6, 1, 16, generator=generator)
    key, value = torch.randn(6, 2, length, 16, generator=generator), torch.randn(6, 2, length, 16, generator=generator)
    key[:, :, 200:260] += 50.0  # outside some rows' ranges: any leak would dominate their softmax
    ranges = [(0, length), (10, 11), (chunk - 5, chunk + 3), (300, 300), (5, 200), (260, length)]
    starts = torch.tensor([s for s, _ in ranges], dtype=torch.int32)
    ends = torch.tensor([e for _, e in ranges], dtype=torch.int32)
    got = interpreted_ranged.ranged_decode_attention(query, key, value, starts, ends, scale=0.3)
    assert got.shape == (6, 1, 6, 16)
    for row, (start, end) in enumerate(ranges):
        if start == end:
            assert torch.equal(got[row], torch.zeros(1, 6, 16))
            continue
        keys = key[row, :, start:end].repeat_interleave(3, 0)
        values = value[row, :, start:end].repeat_interleave(3, 0)
        expected = torch.softmax(query[row] @ keys.transpose(-1, -2) * 0.3, -1) @ values  # (6, 1, 16)
        torch.testing.assert_close(got[row, 0], expected[:, 0], rtol=1e-5, atol=1e-5)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_interpreted_ranged_decoder_gives_the_padded_decoders_tokens(interpreted_ranged, fused):
    """The decode loop with ranged attention (rows of different prompt lengths, one stopping early), through the
    fused attention forward or the attention modules' own, gives the tokens of the loop over the whole padded
    cache."""
    model = _tiny_llama()
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 256, (n,), generator=generator).tolist() for n in (3, 17, 9)]
    limits = [6, 6, 5]
    padded = StaticDecoder(model, rows=4, pad_token_id=0, stop_token_ids=[255], length_bucket=16, ranged=False)
    expected = padded.decode(prompts, limits)
    padded.close()
    stop = expected[1][4]  # row 1 stops at its 5th token, the others run on (or stop where that token comes)
    padded = StaticDecoder(model, rows=4, pad_token_id=0, stop_token_ids=[stop], length_bucket=16, ranged=False)
    expected = padded.decode(prompts, limits)
    padded.close()
    ranged = StaticDecoder(model, rows=4, pad_token_id=0, stop_token_ids=[stop], length_bucket=16, ranged=True,
                           fused=fused)
    assert ranged.ranged and model.config._attn_implementation == "grouped_decode_ranged"
    assert len(ranged._fused) == (2 if fused else 0)
    assert ranged.decode(prompts, limits) == expected
    assert len(expected[1]) == 5
    slot = next(iter(ranged._slots.values()))
    # Each row's range starts at its prompt's first position; a finished row's range is empty.
    assert slot.starts.tolist() == [17 - 3, 0, 17 - 9]  # eagerly a batch has only its own rows (no filler rows)
    assert slot.ends[1] == slot.starts[1] and slot.ends[0] > slot.starts[0]
    ranged.close()
    assert model.config._attn_implementation == "sdpa"


def _tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=256, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         initializer_range=0.2, attn_implementation="sdpa")
    return Qwen3ForCausalLM(config).eval()


def _rotated(x, cos, sin, rounding):
    """``x * cos + rotate_half(x) * sin`` with each product and the sum rounded by ``rounding`` from float32."""
    low, high = x.float().chunk(2, -1)
    cos_low, cos_high = cos.float().chunk(2, -1)
    sin_low, sin_high = sin.float().chunk(2, -1)
    first = rounding(rounding(low * cos_low).float() - rounding(high * sin_low).float())
    second = rounding(rounding(high * cos_high).float() + rounding(low * sin_high).float())
    return torch.cat([first, second], -1)


@pytest.mark.parametrize("tokens", [1, 3], ids=["decode", "prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreted_fused_rotary_and_cache_write_equal_transformers_bit_for_bit(interpreted_ranged, dtype, tokens):
    """:func:`rope_and_write` against transformers' ``apply_rotary_pos_emb`` and the static cache's ``index_copy_``,
    on the strided views the projections give, with the rotary tables of real positions, bit for bit, for one token
    per row (a decode step) and several (a prefill). In bf16, transformers rounds each product and the sum to
    nearest; Triton's interpreter converts float32 to bf16 by truncation (the GPU to nearest), so the kernel is
    checked against the same arithmetic with the interpreter's rounding, and that arithmetic with rounding to nearest
    against transformers."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from dflash.generation.fused_decode import rope_and_write

    generator = torch.Generator().manual_seed(2)
    batch, q_heads, kv_heads, head_dim, length, first = 5, 6, 2, 16, 40, 29
    projected = torch.randn(batch, tokens, (q_heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    query, key, value = projected.view(batch, tokens, -1, head_dim).split([q_heads, kv_heads, kv_heads], dim=2)
    rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=q_heads * head_dim, num_attention_heads=q_heads,
                                              max_position_embeddings=512))
    positions = torch.tensor([3, 17, 0, 250, 41])[:, None] + torch.arange(tokens)
    cos, sin = rotary(projected, positions)  # (batch, tokens, head_dim) in dtype
    key_cache = torch.randn(batch, kv_heads, length, head_dim, generator=generator).to(dtype)
    value_cache = torch.randn(batch, kv_heads, length, head_dim, generator=generator).to(dtype)
    expected_keys, expected_values = key_cache.clone(), value_cache.clone()
    heads_first = [x.transpose(1, 2) for x in (query, key, value)]  # transformers' (batch, heads, tokens, head_dim)
    transformers_query, transformers_key = apply_rotary_pos_emb(heads_first[0], heads_first[1], cos, sin)
    nearest = lambda x: x.to(dtype)  # noqa: E731
    truncated = lambda x: (x.view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)  # noqa: E731
    here = truncated if dtype == torch.bfloat16 and not torch.cuda.is_available() else nearest
    for x, rotated in ((heads_first[0], transformers_query), (heads_first[1], transformers_key)):
        assert torch.equal(_rotated(x, cos[:, None], sin[:, None], nearest), rotated)
    written = torch.arange(first, first + tokens)
    expected_keys.index_copy_(2, written, _rotated(heads_first[1], cos[:, None], sin[:, None], here))
    expected_values.index_copy_(2, written, heads_first[2])

    got = rope_and_write(query, key, value, cos, sin, key_cache, value_cache, torch.tensor([first]))
    assert got.dtype == dtype and got.shape == (batch, q_heads, tokens, head_dim) and got.is_contiguous()
    assert torch.equal(got, _rotated(heads_first[0], cos[:, None], sin[:, None], here))
    assert torch.equal(key_cache, expected_keys) and torch.equal(value_cache, expected_values)


def test_interpreted_fused_qwen3_decode_gives_the_padded_decoders_tokens(interpreted_ranged):
    """Qwen3 (per-head query and key norms before the rotary embedding) through the fused attention forward gives
    the tokens of the loop over the whole padded cache through its own modules, for two batches on one cache; on
    close the attention modules' own forwards are back."""
    model = _tiny_qwen3()
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 256, (n,), generator=generator).tolist() for n in (4, 19, 11)]
    limits = [6, 6, 5]
    padded = StaticDecoder(model, rows=3, pad_token_id=0, stop_token_ids=[255], length_bucket=16, ranged=False)
    first = padded.decode(prompts, limits)
    padded.close()
    stop = first[1][3]
    padded = StaticDecoder(model, rows=3, pad_token_id=0, stop_token_ids=[stop], length_bucket=16, ranged=False)
    expected = [padded.decode(prompts, limits), padded.decode(prompts[::-1], limits[::-1])]
    padded.close()
    fused = StaticDecoder(model, rows=3, pad_token_id=0, stop_token_ids=[stop], length_bucket=16, ranged=True)
    assert len(fused._fused) == 2 and all("forward" in vars(module) for module in fused._fused)
    assert [fused.decode(prompts, limits), fused.decode(prompts[::-1], limits[::-1])] == expected
    assert len(expected[0][1]) == first[1].index(stop) + 1 < limits[1]  # row 1 stopped early
    modules = fused._fused
    fused.close()
    assert not any("forward" in vars(module) for module in modules)


def _step_inputs(slot):
    """The storage of everything a captured decode step of ``slot`` reads: its input buffers and the cache."""
    buffers = [slot.tokens, slot.positions, slot.write, slot.starts, slot.ends, slot.mask]
    buffers += [t for layer in slot.cache.layers for t in (layer.keys, layer.values)]
    return tuple(t.data_ptr() for t in buffers)


def test_interpreted_stream_refills_rows_and_gives_each_prompt_its_own_continuation(interpreted_ranged):
    """Continuous batching through the engine: 5 requests (ids out of order) through 2 rows, each row taking the next
    request once its reply ends (by a stop token or its own limit), refills cut to 10 prefill tokens, give
    transformers' greedy continuation of every prompt, reported as they finish; sampled, on the now allocated cache
    (a refill then prefills into chosen cache rows), the tokens of the batch decoder for the same row keys (the noise
    follows the request and its step, not the row). Every decode step of both calls reads the same storage for its
    inputs and cache, as a captured graph's replays do."""
    from types import SimpleNamespace

    model = _tiny_llama()
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 256, (n,), generator=generator).tolist() for n in (3, 7, 5, 1, 2)]
    limits = [4, 4, 1, 4, 3]
    ids = [40, 3, 17, 8, 25]

    def reference(stop):
        return [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=stop,
                               pad_token_id=0)[0, len(p):].tolist() for p, n in zip(prompts, limits, strict=True)]

    stop = reference(255)[1][1]  # prompt 1 stops at its 2nd token, the others run to their limits (or stop there)
    expected = reference(stop)
    assert len(expected[1]) == 2 and len(expected[0]) == 4
    engine = TransformersEngine(model, SimpleNamespace(pad_token_id=0), batch_size=2, token_budget=10, cache="static",
                                ranged=True, prompt_bucket=4, stop_token_ids=[stop])
    engine._decoder.check_every = 1  # look for finished rows after every step (tiny replies)
    assert engine.streams and engine.describe()["continuous_batching"]
    seen, run_step = [], engine._decoder._run_step

    def observed(slot, use_graph):  # the storage every decode step reads, through refills and both calls
        seen.append(_step_inputs(slot))
        return run_step(slot, use_graph)

    engine._decoder._run_step = observed
    reported = []
    engine.progress = lambda replies, tokens, decoding: reported.append((replies, tokens, decoding))
    requests = [GenerationRequest(request_id=i, prompt_ids=p, max_new_tokens=n)
                for i, p, n in zip(ids, prompts, limits, strict=True)]
    got = engine.generate(requests, SamplingSettings(max_new_tokens=4))
    assert [r.token_ids for r in got] == expected and [r.request_id for r in got] == ids
    assert [r.finish_reason for r in got][:2] == ["length", "stop"]
    assert sum(n for n, _, _ in reported) == 5 and sum(t for _, t, _ in reported) == sum(map(len, expected))
    assert any(decoding for _, _, decoding in reported) and reported[-1][2] == 0  # rows decoding, then none
    settings = SamplingSettings(temperature=0.8, max_new_tokens=4, seed=7)
    sampled = [r.token_ids for r in engine.generate(requests, settings)]
    # A CUDA graph replays the addresses it captured: a buffer or cache rebuilt instead of updated in place would be
    # read stale by the replays on a GPU. Every step of both calls read the same storage.
    assert len(seen) > 10 and len(set(seen)) == 1 and len(engine._decoder._slots) == 1
    engine.close()
    # Memory for one of the two rows: the same replies (of the first 3), one row at a time. The stream's cache is 128
    # positions (8 prompt columns: 7 tokens in buckets of 4, + 4 new, in the decoder's length buckets of 128); its
    # largest forward is a refill of the 10-token budget, one 8-wide row.
    from dflash.generation.static_decode import forward_activation_bytes, kv_cache_bytes

    capped = TransformersEngine(model, SimpleNamespace(pad_token_id=0), batch_size=2, token_budget=10, cache="static",
                                ranged=True, prompt_bucket=4, stop_token_ids=[stop])
    capped._decoder.check_every = 1
    per_row = kv_cache_bytes(model.config, 1, 128, torch.float32) + 4 * 128
    capped._decoder.kv_memory = forward_activation_bytes(model.config, 10, 1, 8, torch.float32,
                                                          columns=128) + per_row * 3 // 2
    assert [r.token_ids for r in capped.generate(requests[:3], SamplingSettings(max_new_tokens=4))] == expected[:3]
    assert capped._decoder.last_rows == 1
    capped.close()
    batch = StaticDecoder(model, rows=5, pad_token_id=0, stop_token_ids=[stop], length_bucket=16, ranged=False)
    keys = [7 * 2**32 + i for i in ids]
    assert sampled == batch.decode(prompts, limits, temperature=0.8, row_keys=keys) != expected
    batch.close()


def test_ranged_attention_where_it_cannot_run_is_refused():
    from dflash.errors import ConfigError
    from dflash.generation.ranged_attention import ranged_attention_available

    if ranged_attention_available(torch.device("cpu")):
        pytest.skip("Triton's interpreter is on in this process")
    with pytest.raises(ConfigError, match="ranged decode attention needs CUDA and Triton"):
        StaticDecoder(_tiny_llama(), rows=2, pad_token_id=0, stop_token_ids=[1], ranged=True)


def test_compiled_parts_are_the_models_own_modules_again_after_close():
    model = _tiny_llama()
    prompts, limits = [[5, 6, 7], [9]], [6, 6]
    plain = StaticDecoder(model, rows=2, pad_token_id=0, stop_token_ids=[255], ranged=False, compile_parts=False)
    expected = plain.decode(prompts, limits)
    plain.close()
    compiled = StaticDecoder(model, rows=2, pad_token_id=0, stop_token_ids=[255], ranged=False, compile_parts=True,
                             compile_backend="eager")
    names = sorted({type(module).__name__ for module in compiled._compiled})
    assert names == ["LlamaMLP", "LlamaRMSNorm"] and len(compiled._compiled) == 2 + 2 * 2 + 1  # MLPs, norms, final
    assert all("forward" in vars(module) for module in compiled._compiled)
    assert compiled.decode(prompts, limits) == expected
    modules = compiled._compiled
    compiled.close()
    assert not any("forward" in vars(module) for module in modules)
