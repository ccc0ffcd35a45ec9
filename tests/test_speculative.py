"""Speculative decoding loop (dflash/speculative.py) with the real SmolLM2 target.

Drafters here: an oracle stand-in that proposes the target's own greedy continuation (proves the acceptance
accounting: tau == B), a "wrong at position j" oracle (tau == j exactly), and the real ``DFlashDrafter`` with random
weights (proves greedy verification is lossless whatever the drafter proposes).
"""

from __future__ import annotations

import pytest
import torch

from dflash.decoding.speculative import (
    AcceptanceStats,
    SpeculativeConfig,
    TappedTarget,
    first_divergence,
    speculative_generate,
    target_generate,
    verify_greedy,
    verify_sampled,
)
from dflash.decoding.static_target import StaticTappedTarget
from dflash.errors import ConfigError

TAPS = [1, 14, 27]
BLOCK = 4
MASK = 0  # <|endoftext|> row: an existing embedding row, as docs/dflash.md requires


# Token-by-token decoding gains nothing from a second thread (conftest's one_torch_thread).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _prompt(tokenizer, text="Write a Python function that returns the factorial of n."):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


class OracleDrafter(torch.nn.Module):
    """Proposes ``reference[block_start + k]`` at block position k; optionally wrong at one position.

    Also checks what the loop hands it: the context holds exactly the positions before the anchor, the anchor
    is the last committed token, and every context row equals the target's ``hidden_states[l + 1]``.
    """

    def __init__(self, reference, vocab_size, *, wrong_at=None, full_states=None, strict=True):
        super().__init__()
        self.anchor_param = torch.nn.Parameter(torch.zeros(1))  # gives the loop a dtype
        self.reference = list(reference)
        self.vocab_size = vocab_size
        self.wrong_at = wrong_at
        self.full_states = full_states
        self.strict = strict
        self.calls = 0

    def draft_block(self, context_hidden, context_positions, block_input_ids, block_start):
        self.calls += 1
        assert context_hidden.shape[0] == block_start == context_positions.shape[0]
        assert torch.equal(context_positions, torch.arange(block_start))
        assert int(block_input_ids[0]) == self.reference[block_start] or not self.strict
        assert (block_input_ids[1:] == MASK).all()
        if self.full_states is not None:
            torch.testing.assert_close(context_hidden, self.full_states[:block_start], atol=2e-4, rtol=1e-4)
        logits = torch.full((block_input_ids.numel(), self.vocab_size), -1e4)
        for k in range(block_input_ids.numel()):
            token = self.reference[block_start + k] if block_start + k < len(self.reference) else 0
            if k == self.wrong_at:
                token = (token + 1) % self.vocab_size
            logits[k, token] = 0.0
        return logits


@pytest.fixture(scope="module", params=["dynamic", "static"])
def tapped(target, request):
    """The target with its taps, on transformers' dynamic KV cache and on the static cache
    (dflash/decoding/static_target.py; eager on CPU): the tests of what the cache decides (tokens, acceptance,
    the drafter's context) run through both."""
    kind = TappedTarget if request.param == "dynamic" else StaticTappedTarget
    with kind(target.model, TAPS) as wrapped:
        yield wrapped


@pytest.fixture(scope="module")
def dynamic_tapped(target):
    """The target with its taps on transformers' dynamic KV cache only (tests of what the cache does not decide)."""
    with TappedTarget(target.model, TAPS) as wrapped:
        yield wrapped


@pytest.fixture(scope="module")
def greedy_reference(target, tokenizer):
    """The target's own greedy continuation, from transformers' generate (no stop token, 24 new tokens)."""
    prompt = _prompt(tokenizer)
    ids = torch.tensor([prompt])
    generated = target.model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, eos_token_id=None,
        pad_token_id=tokenizer.eos_token_id,
    )
    return prompt, generated[0, len(prompt):].tolist()


def test_block_size_one_is_the_targets_own_greedy_decoding(tapped, greedy_reference):
    prompt, reference = greedy_reference
    result = speculative_generate(tapped, None, prompt, SpeculativeConfig(block_size=1, max_new_tokens=24))
    assert result.output_ids == reference
    assert result.acceptance_lengths == [1] * 23  # the first token comes from the prefill, not a cycle


def test_target_generate_is_transformers_generate_with_the_loops_stop_tokens(target, tokenizer, dynamic_tapped):
    """The evaluation's second reference: ``generate()`` stops where the loop stops (same stop tokens, same greedy
    tokens), and an empty stop list ignores the end of sequence as ``--ignore-eos`` does in the loop."""
    prompt = _prompt(tokenizer, "Answer with one word: is the sky blue?")
    stopping = SpeculativeConfig(block_size=1, max_new_tokens=16, stop_token_ids=(tokenizer.eos_token_id,))
    generated = target_generate(target.model, prompt, stopping)
    loop = speculative_generate(dynamic_tapped, None, prompt, stopping)
    assert generated.output_ids == loop.output_ids
    assert generated.finish_reason == loop.finish_reason == "stop" and len(generated.output_ids) < 12
    assert generated.output_ids[-1] == tokenizer.eos_token_id
    assert generated.acceptance_lengths == [] and generated.prompt_ids == prompt and generated.seconds > 0
    ignoring = SpeculativeConfig(block_size=1, max_new_tokens=12)
    longer = target_generate(target.model, prompt, ignoring)  # the loop's --ignore-eos twin: tests/test_evaluate.py
    assert len(longer.output_ids) == 12 and longer.finish_reason == "length"
    assert longer.output_ids[: len(generated.output_ids)] == generated.output_ids  # went on past the EOS
    sampled = SpeculativeConfig(block_size=1, max_new_tokens=4, temperature=0.8)
    assert target_generate(target.model, prompt, sampled, seed=3).output_ids == target_generate(
        target.model, prompt, sampled, seed=3).output_ids


def test_oracle_drafter_reaches_tau_equal_block_size(target, tapped, greedy_reference):
    prompt, reference = greedy_reference
    full = prompt + reference
    with torch.no_grad():
        hidden = target.model(torch.tensor([full]), output_hidden_states=True).hidden_states
    full_states = torch.cat([hidden[layer + 1][0] for layer in TAPS], dim=-1)
    oracle = OracleDrafter(full, target.model.config.vocab_size, full_states=full_states)
    # 1 token from the prefill + 5 cycles of B tokens: every cycle must accept all B - 1 drafts.
    config = SpeculativeConfig(block_size=BLOCK, max_new_tokens=1 + 5 * BLOCK, mask_token_id=MASK)
    result = speculative_generate(tapped, oracle, prompt, config)
    assert result.output_ids == reference[: 1 + 5 * BLOCK]
    assert result.acceptance_lengths == [BLOCK] * 5
    assert oracle.calls == 5


@pytest.mark.parametrize("wrong_at", [1, 2, 3])
def test_first_wrong_draft_position_sets_tau(target, tapped, greedy_reference, wrong_at):
    prompt, reference = greedy_reference
    oracle = OracleDrafter(prompt + reference, target.model.config.vocab_size, wrong_at=wrong_at)
    config = SpeculativeConfig(block_size=BLOCK, max_new_tokens=16, mask_token_id=MASK)
    result = speculative_generate(tapped, oracle, prompt, config)
    # Drafts 1..wrong_at-1 accepted, then the target's correction: tau == wrong_at every cycle.
    assert set(result.acceptance_lengths) == {wrong_at}
    assert result.output_ids == reference[:16]
    stats = AcceptanceStats.from_lengths(result.acceptance_lengths, BLOCK)
    expected = [1.0 if k < wrong_at else (0.0 if k == wrong_at else None) for k in range(1, BLOCK)]
    assert stats.acceptance_per_position == expected


def test_random_drafter_greedy_output_equals_target_greedy(target, tokenizer, tapped, greedy_reference):
    drafter_module = pytest.importorskip("dflash.drafter")
    DFlashConfig, DFlashDrafter = drafter_module.DFlashConfig, drafter_module.DFlashDrafter

    prompt, reference = greedy_reference
    config = DFlashConfig.from_target_config(
        target.model.config, tokenizer=tokenizer, num_draft_layers=1, block_size=BLOCK, target_layer_ids=TAPS
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).eval()
    drafter.attach_target(target.model.get_input_embeddings().weight, target.model.get_output_embeddings().weight)
    spec = SpeculativeConfig(block_size=BLOCK, max_new_tokens=24, mask_token_id=config.mask_token_id)
    result = speculative_generate(tapped, drafter, prompt, spec)
    assert result.output_ids == reference
    assert all(1 <= tau <= BLOCK for tau in result.acceptance_lengths)
    assert sum(result.acceptance_lengths) >= 23


def test_sampled_mode_gives_valid_tokens_and_is_reproducible(target, dynamic_tapped, greedy_reference):
    prompt, reference = greedy_reference
    oracle = OracleDrafter(prompt + reference, target.model.config.vocab_size, strict=False)
    config = SpeculativeConfig(block_size=BLOCK, max_new_tokens=20, temperature=0.8, mask_token_id=MASK)
    runs = [
        speculative_generate(dynamic_tapped, oracle, prompt, config, generator=torch.Generator().manual_seed(7))
        for _ in range(2)
    ]
    assert runs[0].output_ids == runs[1].output_ids
    assert len(runs[0].output_ids) == 20
    assert all(0 <= t < target.model.config.vocab_size for t in runs[0].output_ids)
    assert all(1 <= tau <= BLOCK for tau in runs[0].acceptance_lengths)


def test_verify_sampled_is_lossless_on_a_tiny_vocabulary():
    """Two drafted positions over a 5-token vocabulary: the committed tokens follow the target's p exactly."""
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.2, 0.1, 0.15, 0.05], [0.1, 0.1, 0.6, 0.1, 0.1], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([[0.1, 0.6, 0.1, 0.1, 0.1], [0.3, 0.1, 0.3, 0.2, 0.1]])
    trials = 12000  # standard error of a frequency <= 0.005: the bounds below are 3 and 4 of them
    first = torch.zeros(5)
    second = torch.zeros(5)
    seconds_seen = 0
    for _ in range(trials):
        drafts = torch.multinomial(q, 1, generator=generator).reshape(-1)
        accepted, next_token = verify_sampled(drafts, q, p, generator)
        committed = [*drafts[:accepted].tolist(), next_token]
        first[committed[0]] += 1
        if len(committed) > 1:
            second[committed[1]] += 1
            seconds_seen += 1
    torch.testing.assert_close(first / trials, p[0], atol=0.015, rtol=0)
    # p[1] does not depend on the first token here, so the second committed token must follow p[1].
    torch.testing.assert_close(second / seconds_seen, p[1], atol=0.025, rtol=0)


def test_verify_greedy_accepts_longest_matching_prefix():
    logits = torch.full((4, 6), -1.0)
    for row, token in enumerate([2, 3, 4, 5]):
        logits[row, token] = 1.0
    assert verify_greedy(torch.tensor([2, 3, 4]), logits) == (3, 5)
    assert verify_greedy(torch.tensor([2, 0, 4]), logits) == (1, 3)
    assert verify_greedy(torch.tensor([1, 3, 4]), logits) == (0, 2)
    assert verify_greedy(torch.tensor([], dtype=torch.int64), logits[:1]) == (0, 2)


def test_acceptance_stats_histogram_and_positions():
    stats = AcceptanceStats.from_lengths([1, 2, 4, 4, 3], 4)
    assert stats.mean_tau == pytest.approx(14 / 5)
    assert stats.histogram == [1, 1, 1, 2]
    assert stats.acceptance_per_position == pytest.approx([4 / 5, 3 / 4, 2 / 3])
    assert stats.reach_per_position == pytest.approx([4 / 5, 3 / 5, 2 / 5])
    with pytest.raises(ValueError):
        AcceptanceStats.from_lengths([5], 4)


def test_first_divergence_and_config_errors():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 9, 3], [1, 2, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    with pytest.raises(ConfigError, match="mask_token_id"):
        SpeculativeConfig(block_size=4)
    with pytest.raises(ConfigError, match="temperature"):
        SpeculativeConfig(block_size=1, temperature=-1.0)
