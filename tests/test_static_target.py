"""The static-cache tapped target (dflash/decoding/static_target.py): the speculative loop through it commits the
tokens and acceptance lengths the dynamic-cache target gives, on one cache reused across generations of other
lengths, eagerly on CPU and through captured graphs on CUDA. tests/test_speculative.py runs its loop tests through
both targets on the real SmolLM2 as well."""

from __future__ import annotations

import pytest
import torch

from dflash.decoding.drafter_cache import GraphedDrafter
from dflash.decoding.speculative import SpeculativeConfig, TappedTarget, speculative_generate
from dflash.decoding.static_target import StaticTappedTarget, static_cache_supported
from dflash.errors import ConfigError

TAPS = [0, 2]
VOCAB = 512


def _llama(device: str = "cpu"):
    """A random GQA Llama in float32, large init: peaked logits, no near-ties."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         initializer_range=0.2, attn_implementation="sdpa")
    return LlamaForCausalLM(config).to(device).eval()


class NoisyOracle(torch.nn.Module):
    """Proposes the target's greedy continuation (``reference``), wrong at seeded random block positions: cycles
    accept 0 .. B-1 drafts, so rejected keys are left in the cache for the next cycle to overwrite."""

    def __init__(self, reference: list[int], seed: int) -> None:
        super().__init__()
        self.anchor_param = torch.nn.Parameter(torch.zeros(1))
        self.reference = reference
        self.generator = torch.Generator().manual_seed(seed)

    def draft_block(self, context_hidden, context_positions, block_input_ids, block_start):
        assert context_hidden.shape[0] == block_start
        logits = torch.full((block_input_ids.numel(), VOCAB), -1e4, device=context_hidden.device)
        wrong = int(torch.randint(1, block_input_ids.numel() + 1, (1,), generator=self.generator))
        for k in range(block_input_ids.numel()):
            index = block_start + k
            token = self.reference[index] if index < len(self.reference) else 0
            logits[k, (token + 1) % VOCAB if k >= wrong else token] = 0.0
        return logits


def _runs(tapped: TappedTarget, model, prompts: list[list[int]], block: int, new: int) -> list[tuple]:
    results = []
    for seed, prompt in enumerate(prompts):
        reference = model.generate(torch.tensor([prompt], device=tapped.device), max_new_tokens=new,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)[0].tolist()
        for size in (1, block):
            config = SpeculativeConfig(block_size=size, max_new_tokens=new, mask_token_id=0)
            drafter = NoisyOracle(reference, seed) if size > 1 else None
            result = speculative_generate(tapped, drafter, prompt, config)
            assert result.output_ids == reference[len(prompt):]  # lossless whatever the drafts
            results.append((result.output_ids, result.acceptance_lengths))
    return results


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    # A long prompt first: the later, shorter generations reuse the cache with stale keys beyond their positions.
    return [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in (70, 5, 33, 1)]


def test_static_cache_commits_what_the_dynamic_cache_commits():
    model = _llama()
    prompts = _prompts()
    with TappedTarget(model, TAPS) as dynamic:
        expected = _runs(dynamic, model, prompts, block=6, new=40)
    with StaticTappedTarget(model, TAPS, length_bucket=64) as static:
        assert _runs(static, model, prompts, block=6, new=40) == expected
        assert static.replays == 0 and static.eager_forwards > 0  # eager on CPU: no graph
        # ... through the input buffers a graph would read: one per query length, as on CUDA.
        assert sorted(static._graphs) == [(1, False), (6, True)]
        assert all(entry.graph is None for entry in static._graphs.values())
    assert any(1 < tau < 6 for _, lengths in expected for tau in lengths)  # partial acceptances happened
    assert any(tau == 1 for _, lengths in expected[1::2] for tau in lengths)


def test_a_greedy_cycle_reads_the_device_once(monkeypatch):
    """Each greedy cycle of the loop (block size 1 and a kept-context drafter's) reads the device once (one
    ``.tolist()``: on CUDA one copy and one wait) and makes no tensor from host values (on CUDA a host-to-device
    copy): the anchor is filled in, acceptance is decided on the host from that one read."""
    model = _llama()
    drafter = GraphedDrafter(_tiny_drafter(model), capacity=64)
    prompt = _prompts()[2]
    reads, made = [], []
    for name in ("tolist", "item"):
        method = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, method=method, name=name: reads.append(name) or method(self))
    make = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *args, **kwargs: ("device" in kwargs and made.append(kwargs["device"]))
                        or make(*args, **kwargs))  # fmt: skip
    with StaticTappedTarget(model, TAPS, length_bucket=64) as static:
        for size, drafting in ((1, None), (6, drafter)):
            reads.clear(), made.clear()
            config = SpeculativeConfig(block_size=size, max_new_tokens=12, mask_token_id=0)
            result = speculative_generate(static, drafting, prompt, config)
            # The prefill's token (.item()), one read per cycle, the prompt returned (.tolist()); the prefill's
            # start position is the only tensor made on the device.
            assert result.num_cycles > 1
            assert reads == ["item", *["tolist"] * result.num_cycles, "tolist"]
            assert made == [static.device]


def test_capacity_and_attention_are_checked():
    model = _llama()
    with StaticTappedTarget(model, TAPS, length_bucket=16) as static:
        cache = static.new_cache(20)
        static.forward(torch.tensor([1, 2, 3]), 0, cache)
        with pytest.raises(ValueError, match="past the static cache of 32"):
            static.forward(torch.arange(1, 6), 30, cache)
        static.new_cache(40)  # grows to the next bucket
        static.forward(torch.arange(1, 6), 30, cache)
    from transformers import MistralConfig, MistralForCausalLM

    sliding = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=1, sliding_window=8,
                                               attn_implementation="sdpa"))
    assert static_cache_supported(model) and not static_cache_supported(sliding)
    with pytest.raises(ConfigError, match="plain full-attention layers.*dynamic KV cache"):
        StaticTappedTarget(sliding, [0])
    # Linear attention keeps a recurrent state that a rejected draft cannot be rewound out of (and no positions).
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    hybrid = Qwen3NextForCausalLM(Qwen3NextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, attn_implementation="sdpa"))
    assert "linear_attention" in hybrid.config.layer_types and not static_cache_supported(hybrid)
    with pytest.raises(ConfigError, match="plain full-attention layers"):
        StaticTappedTarget(hybrid, [0])
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ConfigError, match="4-D mask.*'flash_attention_2'.*attn_implementation='sdpa'"):
        StaticTappedTarget(model, TAPS)


@pytest.mark.gpu
def test_cuda_graph_replays_commit_what_the_dynamic_cache_commits():
    """On CUDA: the verify block and the one-token step are captured once and replayed for every later cycle and
    generation, and commit the dynamic cache's tokens and acceptance lengths (float32, peaked logits)."""
    model = _llama("cuda")
    prompts = _prompts()
    with TappedTarget(model, TAPS) as dynamic:
        expected = _runs(dynamic, model, prompts, block=6, new=40)
    with StaticTappedTarget(model, TAPS, length_bucket=64) as static:
        assert _runs(static, model, prompts, block=6, new=40) == expected
        assert static.replays > 10 * static.eager_forwards > 0
        assert sorted(static._graphs) == [(1, False), (6, True)]


def _tiny_drafter(model, layers: int = 2, block: int = 6):
    from dflash.drafter import DFlashConfig, DFlashDrafter

    config = DFlashConfig.from_target_config(model.config, num_draft_layers=layers, block_size=block, mask_token_id=0,
                                             target_layer_ids=TAPS)
    torch.manual_seed(3)
    drafter = DFlashDrafter(config).to(next(model.parameters()).device)
    drafter.reset_parameters(std=0.2)
    drafter.attach_target(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    return drafter.eval()


def _graphed_against_dynamic(device: str) -> tuple[list, list, StaticTappedTarget, GraphedDrafter]:
    """A real DFlashDrafter (random weights) on the random Llama on ``device``: the loop's results through the
    dynamic-cache target with the plain drafter, and through the static target with the graphed drafter."""
    model = _llama(device)
    drafter = _tiny_drafter(model)
    prompts = _prompts()
    config = SpeculativeConfig(block_size=6, max_new_tokens=40, mask_token_id=0)
    with TappedTarget(model, TAPS) as dynamic:
        expected = [speculative_generate(dynamic, drafter, prompt, config) for prompt in prompts]
    with StaticTappedTarget(model, TAPS, length_bucket=64) as static:
        graphed = GraphedDrafter(drafter, capacity=70 + 40 + 6)
        got = [speculative_generate(static, graphed, prompt, config) for prompt in prompts]
    return expected, got, static, graphed


def _committed(results) -> list[tuple]:
    return [(r.output_ids, r.acceptance_lengths) for r in results]


@pytest.mark.gpu
def test_cuda_graphed_drafter_and_target_commit_what_the_eager_loop_commits():
    """On CUDA: a real DFlashDrafter (random weights) through its captured draft and the target's captured forwards
    commits the tokens and acceptance lengths of the dynamic-cache loop with the plain drafter."""
    expected, got, _, graphed = _graphed_against_dynamic("cuda")
    assert _committed(got) == _committed(expected)
    assert graphed.replays > 0 and graphed.eager_drafts == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_graphs_are_captured_on_the_models_gpu_when_another_is_current():
    """A model on cuda:1 while cuda:0 is the current device (``--device cuda:1``): the captures record the model's
    kernels on its own GPU, so the replays commit the dynamic cache's tokens instead of replaying an empty graph
    and returning the capture's stale logits."""
    torch.cuda.set_device(0)
    expected, got, static, graphed = _graphed_against_dynamic("cuda:1")
    assert static.replays > 0 and graphed.replays > 0 and graphed.eager_drafts == 0
    assert torch.cuda.current_device() == 0
    assert _committed(got) == _committed(expected)


def _graphs_on_and_off(model, drafter, prompts: list[list[int]], config: SpeculativeConfig) -> list[list[tuple]]:
    """The loop's (tokens, acceptance lengths) per prompt through the static target and the graphed drafter, eager
    and then with CUDA graphs, with the same per-prompt seeds."""
    runs = []
    for cuda_graphs in (False, True):
        with StaticTappedTarget(model, TAPS, cuda_graphs=cuda_graphs, length_bucket=64) as static:
            graphed = GraphedDrafter(drafter, capacity=max(map(len, prompts)) + config.max_new_tokens + 6,
                                     cuda_graphs=cuda_graphs)
            results = [speculative_generate(static, graphed, prompt, config,
                                            generator=torch.Generator(static.device).manual_seed(index))
                       for index, prompt in enumerate(prompts)]
            assert (static.replays > 0) == cuda_graphs and (graphed.replays > 0) == cuda_graphs
        runs.append([(r.output_ids, r.acceptance_lengths) for r in results])
    return runs


@pytest.mark.gpu
def test_cuda_graphs_in_sampled_mode_commit_what_the_same_loop_commits_eagerly():
    """Sampled mode reads the replayed draft logits (softmax, multinomial) and the verify logits before the next
    replay overwrites them: with the same seeds, graphs on and off commit the same tokens and acceptance lengths."""
    model = _llama("cuda")
    config = SpeculativeConfig(block_size=6, max_new_tokens=40, temperature=1.0, mask_token_id=0)
    eager, graphed = _graphs_on_and_off(model, _tiny_drafter(model), _prompts(), config)
    assert graphed == eager
    assert any(1 < tau < 6 for _, lengths in eager for tau in lengths)


@pytest.mark.gpu
def test_cuda_graphs_in_bfloat16_commit_what_the_same_loop_commits_eagerly():
    """In bfloat16, the evaluation's dtype on CUDA, the replays compute what the same forwards compute eagerly; the
    prompts come shortest first, so the cache grows (a new one, the graphs captured again) between generations."""
    model = _llama("cuda").to(torch.bfloat16)
    drafter = _tiny_drafter(model).to(torch.bfloat16)
    config = SpeculativeConfig(block_size=6, max_new_tokens=40, mask_token_id=0)
    eager, graphed = _graphs_on_and_off(model, drafter, sorted(_prompts(), key=len), config)
    assert graphed == eager


@pytest.mark.gpu
def test_a_forward_that_cannot_be_captured_runs_eagerly():
    """A dynamic-RoPE target compares a position with its cached length on the host (a sync, which a capture
    refuses): each capture fails, that query length runs eagerly from then on on the caller's stream, and the tokens
    are still the dynamic cache's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         initializer_range=0.2, attn_implementation="sdpa",
                         rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    model = LlamaForCausalLM(config).to("cuda").eval()
    prompts = _prompts()
    with TappedTarget(model, TAPS) as dynamic:
        expected = _runs(dynamic, model, prompts, block=6, new=40)
    stream = torch.cuda.current_stream()
    with StaticTappedTarget(model, TAPS, length_bucket=64) as static:
        assert _runs(static, model, prompts, block=6, new=40) == expected
        assert static.replays == 0 and static._failed == {(1, False), (6, True)}
    assert torch.cuda.current_stream() == stream  # a failed capture leaves the capture stream behind otherwise
