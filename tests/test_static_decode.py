"""The static-cache decode loop (generate's default engine on CUDA) against transformers' own ``generate()``, on the
real SmolLM2 target in float32 on CPU (the same loop without CUDA graphs)."""

from __future__ import annotations

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
    requests = [GenerationRequest(request_id=i, prompt_ids=p, max_new_tokens=10) for i, p in enumerate(prompts)]
    settings = SamplingSettings(max_new_tokens=10)
    results = {}
    for cache in ("static", "dynamic"):
        engine = TransformersEngine(target.model, target.tokenizer, batch_size=3, cache=cache, prompt_bucket=8)
        results[cache] = [(r.request_id, r.token_ids, r.finish_reason) for r in engine.generate(requests, settings)]
        assert engine.decode_step == ("eager" if cache == "static" else "generate()")
        engine.close()
    assert results["static"] == results["dynamic"]
    assert all(len(tokens) == 10 or reason == "stop" for _, tokens, reason in results["static"])


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager_decoding_and_generate():
    """On CUDA: the captured decode step gives the tokens the eager loop gives, and transformers' greedy
    ``generate()`` gives, on a random GQA Llama in float32 (large init: peaked logits, no near-ties)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).cuda().eval()
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
