"""Speculative decoding with a DFlash drafter and a transformers target: greedy and sampled, both lossless.

One draft-verify cycle, as the serving engines run it (docs/dflash.md, "Inference"; z-lab/dflash
``spec_generate``, vLLM ``qwen3_dflash.py``, SGLang ``models/dflash.py``; arXiv 2602.06036 section 3):

1. Prefill: the target runs the prompt with a KV cache (transformers ``DynamicCache``); forward hooks on the tapped
   decoder layers keep their outputs (tap ``l`` = output of decoder layer ``l`` = ``hidden_states[l + 1]``). The
   prompt's last logits give the first new token.
2. Draft: the drafter runs ONE block ``[last committed token, MASK x (B-1)]`` at positions ``a .. a+B-1`` (``a`` =
   position of the last committed token, the anchor) over the tapped states of every position ``< a``, without a
   mask, and proposes ``B - 1`` tokens: argmax (greedy) or a sample from ``softmax(logits / T)``.
3. Verify: the target runs ``[last, d_1 .. d_{B-1}]`` in one forward on its KV cache. Greedy: accept the longest
   prefix where ``d_k`` equals the target's argmax, then commit one bonus token (the target's argmax after the
   accepted prefix). Sampled: standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023): accept
   ``d_k`` with probability ``min(1, p(d_k) / q(d_k))``; on the first rejection commit a token drawn from
   ``norm(max(p - q, 0))``; if all are accepted commit a bonus from ``p``. The KV cache is cropped to the
   committed tokens and the tapped states of the committed positions join the drafter's context.

Acceptance length ``tau`` = tokens committed per cycle, bonus included, in ``[1, B]``; it is recorded from the
verification itself, before the output is cut at ``max_new_tokens`` or a stop token (the z-lab reference counts
the same way). Block size 1 is plain target decoding through the same loop (no drafter call, no taps kept): the
baseline the speedup is measured against. :func:`target_generate` is the other reference: the target's own
transformers ``generate()`` with its KV cache, plain decoding as users run it.

Shapes: P = prompt tokens, B = block size, V = vocab size, n = tapped layers, H = target hidden size.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
import torch

from dflash.errors import ConfigError, MismatchError

__all__ = [
    "BlockDrafter",
    "SpeculativeConfig",
    "GenerationResult",
    "AcceptanceStats",
    "TappedTarget",
    "speculative_generate",
    "target_generate",
    "verify_greedy",
    "verify_sampled",
    "first_divergence",
]


class BlockDrafter(Protocol):
    """What the loop needs from a drafter (``dflash.drafter.DFlashDrafter`` implements it).

    ``draft_block(context_hidden [Lc, n*H], context_positions [Lc] int64, block_input_ids [B] int64,
    block_start: int) -> [B, V]`` logits; block position ``k`` predicts the token at ``block_start + k``.
    """

    config: Any

    def draft_block(
        self,
        context_hidden: torch.Tensor,
        context_positions: torch.Tensor,
        block_input_ids: torch.Tensor,
        block_start: int,
    ) -> torch.Tensor: ...


@dataclass(kw_only=True, slots=True)
class SpeculativeConfig:
    """Settings of one generation.

    Fields:
        block_size: B, tokens per draft block (the anchor + B - 1 drafted tokens); 1 = plain target decoding.
        max_new_tokens: new tokens to produce (the output is cut there; the last cycle's tau is not).
        temperature: 0 = greedy verification; > 0 = lossless speculative sampling at this temperature.
        stop_token_ids: generation ends after committing one of these (e.g. the tokenizer's EOS / end of turn).
        mask_token_id: the drafter's MASK token (required when ``block_size > 1``).
    """

    block_size: int
    max_new_tokens: int = 128
    temperature: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    mask_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0.0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.block_size > 1 and self.mask_token_id is None:
            raise ConfigError("mask_token_id is required when block_size > 1 (take it from the drafter config)")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)

    @property
    def mode(self) -> Literal["greedy", "sampled"]:
        return "greedy" if self.temperature == 0.0 else "sampled"


@dataclass(kw_only=True, slots=True)
class GenerationResult:
    """One prompt's generation.

    Fields:
        prompt_ids: the prompt (P token ids).
        output_ids: the new tokens (at most ``max_new_tokens``; ends with a stop token if one was committed).
        acceptance_lengths: tau of every draft-verify cycle, in ``[1, B]`` (the first token, from the prefill
            logits, belongs to no cycle).
        block_size: B used.
        prefill_seconds / decode_seconds: wall time of the prefill and of the cycles (device synchronized).
        finish_reason: ``"length"`` or ``"stop"``.
    """

    prompt_ids: list[int]
    output_ids: list[int]
    acceptance_lengths: list[int]
    block_size: int
    prefill_seconds: float
    decode_seconds: float
    finish_reason: Literal["length", "stop"]

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def num_cycles(self) -> int:
        return len(self.acceptance_lengths)


@dataclass(kw_only=True, slots=True)
class AcceptanceStats:
    """Acceptance accounting over many cycles of block size B.

    Fields:
        block_size: B.
        num_cycles: draft-verify cycles counted.
        mean_tau: mean tokens committed per cycle (bonus included), in ``[1, B]``.
        histogram: ``histogram[t - 1]`` = cycles that committed ``t`` tokens, for t in 1..B.
        acceptance_per_position: for draft position k = 1..B-1, the fraction of cycles that reached position k
            (accepted all of 1..k-1) and accepted it: the conditional rate ``acc_k`` of
            ``tau = 1 + sum_k prod_{i<=k} acc_i``.
        reach_per_position: for k = 1..B-1, the fraction of all cycles that accepted at least k drafted tokens.
    """

    block_size: int
    num_cycles: int
    mean_tau: float
    histogram: list[int]
    acceptance_per_position: list[float | None]
    reach_per_position: list[float]

    @classmethod
    def from_lengths(cls, acceptance_lengths: Sequence[int], block_size: int) -> AcceptanceStats:
        """Aggregate tau values (each in ``[1, block_size]``).

        Raises:
            ValueError: a tau outside ``[1, block_size]`` (an accounting bug, never user input).
        """
        lengths = np.asarray(list(acceptance_lengths), dtype=np.int64)
        if lengths.size and (lengths.min() < 1 or lengths.max() > block_size):
            raise ValueError(f"acceptance lengths must lie in [1, {block_size}], got {lengths.min()}..{lengths.max()}")
        histogram = np.bincount(lengths - 1, minlength=block_size)[:block_size] if lengths.size else np.zeros(block_size, np.int64)
        accepted = lengths - 1
        conditional: list[float | None] = []
        reach: list[float] = []
        for k in range(1, block_size):
            reached = int((accepted >= k - 1).sum())
            passed = int((accepted >= k).sum())
            conditional.append(passed / reached if reached else None)
            reach.append(passed / lengths.size if lengths.size else 0.0)
        return cls(
            block_size=block_size,
            num_cycles=int(lengths.size),
            mean_tau=float(lengths.mean()) if lengths.size else float("nan"),
            histogram=[int(c) for c in histogram],
            acceptance_per_position=conditional,
            reach_per_position=reach,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "num_cycles": self.num_cycles,
            "mean_tau": self.mean_tau,
            "histogram": {str(t + 1): c for t, c in enumerate(self.histogram)},
            "acceptance_per_position": self.acceptance_per_position,
            "reach_per_position": self.reach_per_position,
        }


def _decoder_layers(model: torch.nn.Module) -> Sequence[torch.nn.Module]:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise MismatchError(f"cannot find the decoder layers of {type(model).__name__} (expected .get_decoder().layers)")
    return layers


class TappedTarget:
    """A transformers causal LM with forward hooks on the tapped decoder layers, run with a KV cache.

    ``forward(input_ids [k], start, cache) -> (logits [k, V] float32, taps [k, n*H] | None)``; taps are the
    outputs of decoder layers ``target_layer_ids`` (= ``hidden_states[l + 1]``) concatenated in id order, kept
    only while ``capture`` is true. Call :meth:`close` (or use ``with``) to remove the hooks.

    Raises:
        MismatchError: a tapped id is outside the model's decoder layers.
    """

    def __init__(self, model: torch.nn.Module, target_layer_ids: Sequence[int]) -> None:
        self.model = model
        self.target_layer_ids = [int(i) for i in target_layer_ids]
        self.capture = True
        layers = _decoder_layers(model)
        self._captured: dict[int, torch.Tensor] = {}
        # transformers renamed ``past_key_values`` to ``cache`` (5.2x); use whichever this version's forward takes.
        self._cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._handles = []
        for layer_id in self.target_layer_ids:
            if not 0 <= layer_id < len(layers) - 1:
                raise MismatchError(
                    f"target layer id {layer_id} is outside [0, {len(layers) - 2}] for this {len(layers)}-layer target; "
                    "the drafter was trained for another target"
                )
            self._handles.append(layers[layer_id].register_forward_hook(self._hook(layer_id)))

    def _hook(self, layer_id: int):
        def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
            if self.capture:
                self._captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def new_cache(self, capacity: int = 0) -> Any:
        """A KV cache for one generation of at most ``capacity`` positions (a dynamic cache grows as it goes, so
        ``capacity`` is not needed here; :class:`dflash.decoding.static_target.StaticTappedTarget` sizes by it)."""
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def forward(self, input_ids: torch.Tensor, start: int, cache: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``input_ids`` [k] at positions ``start .. start+k-1`` on top of ``cache`` (which must hold ``start``
        positions); returns float32 logits [k, V] and, when capturing, the taps [k, n*H]."""
        self._captured.clear()
        positions = torch.arange(start, start + input_ids.numel(), device=input_ids.device)
        output = self.model(
            input_ids=input_ids[None], position_ids=positions[None], use_cache=True, **{self._cache_argument: cache}
        )
        taps = None
        if self.capture:
            taps = torch.cat([self._captured[i][0] for i in self.target_layer_ids], dim=-1)
            self._captured.clear()
        return output.logits[0].float(), taps

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> TappedTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Greedy verification of ``k`` drafted tokens.

    Args:
        draft_tokens: [k] int64, the drafted tokens d_1..d_k.
        target_logits: [k + 1, V], the target's logits at the anchor and after each drafted token.

    Returns:
        ``(accepted, next_token)``: the longest prefix of drafts equal to the target's argmax, and the target's
        argmax right after it (the bonus / correction token).
    """
    targets = target_logits.argmax(dim=-1).tolist()
    accepted = _accepted_prefix(draft_tokens.tolist(), targets)
    return accepted, targets[accepted]


def _accepted_prefix(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """Greedy acceptance on the host: how many of ``drafts`` (d_1..d_k) equal the target's argmax ``targets`` at the
    anchor and after each draft (``k + 1`` ids), counted from the first until one differs."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return accepted


def verify_sampled(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Lossless speculative sampling of ``k`` drafted tokens (Leviathan et al. 2023, algorithm 1; Chen et al. 2023).

    Draft ``d_i`` (drawn from ``q_i``) is accepted with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first
    rejection the committed token is drawn from ``norm(max(p_i - q_i, 0))``; after ``k`` acceptances a bonus token
    is drawn from ``p_k``. The committed tokens are then distributed exactly as the target's own samples.

    Args:
        draft_tokens: [k] int64.
        draft_probs: [k, V] float, the drafter's distributions the drafts were drawn from.
        target_probs: [k + 1, V] float, the target's distributions at the anchor and after each draft.
        generator: random source (on the tensors' device).

    Returns:
        ``(accepted, next_token)``.
    """
    k = draft_tokens.numel()
    if k:
        index = torch.arange(k, device=draft_tokens.device)
        p = target_probs[index, draft_tokens]
        q = draft_probs[index, draft_tokens]
        uniform = torch.rand(k, generator=generator, device=draft_tokens.device, dtype=p.dtype)
        # u < p/q without dividing (q > 0 for every sampled draft).
        accept = (uniform * q < p).to(torch.int64)
        accepted = int(accept.cumprod(dim=0).sum().item())
    else:
        accepted = 0
    if accepted == k:
        distribution = target_probs[k]
    else:
        distribution = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0.0)
        if float(distribution.sum()) <= 0.0:  # p == q up to rounding: a rejection is (almost) impossible
            distribution = target_probs[accepted]
    next_token = torch.multinomial(distribution / distribution.sum(), 1, generator=generator)
    return accepted, int(next_token.item())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    if temperature == 0.0:
        return int(logits.argmax().item())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


@torch.inference_mode()
def speculative_generate(
    tapped: TappedTarget,
    drafter: BlockDrafter | None,
    prompt_ids: Sequence[int] | torch.Tensor,
    config: SpeculativeConfig,
    *,
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """Generate up to ``config.max_new_tokens`` tokens after ``prompt_ids`` with draft-verify cycles.

    Args:
        tapped: the target with hooks on the drafter's tapped layers (:class:`TappedTarget`).
        drafter: the block drafter; ignored (may be ``None``) when ``config.block_size == 1``.
        prompt_ids: P >= 1 token ids.
        config: block size, temperature, limits.
        generator: random source for sampled mode (on the target's device).

    Returns:
        :class:`GenerationResult` with the new tokens and one tau per cycle.

    Raises:
        ConfigError: empty prompt, or ``block_size > 1`` without a drafter.
    """
    device = tapped.device
    block_size = config.block_size
    prompt = torch.as_tensor(list(prompt_ids) if not torch.is_tensor(prompt_ids) else prompt_ids, dtype=torch.int64)
    prompt = prompt.reshape(-1).to(device)
    if prompt.numel() == 0:
        raise ConfigError("prompt_ids is empty; a prompt needs at least one token")
    if block_size > 1 and drafter is None:
        raise ConfigError(f"block_size={block_size} needs a drafter; pass one or use block_size=1 for plain decoding")
    stop = set(config.stop_token_ids)
    drafting = block_size > 1
    tapped.capture = drafting
    cache = tapped.new_cache(prompt.numel() + config.max_new_tokens + block_size)

    _synchronize(device)
    started = time.perf_counter()
    logits, taps = tapped.forward(prompt, 0, cache)
    output = [_pick(logits[-1], config.temperature, generator)]
    _synchronize(device)
    prefill_seconds = time.perf_counter() - started

    position = prompt.numel()  # position of output[-1], the next anchor; the target has run every position before it
    greedy = config.temperature == 0.0
    # A cycle's token ids live in device buffers written in place, so no cycle makes a tensor from host values
    # and a greedy cycle reads the device once: row 0 of ``tokens`` is the verify block [anchor, d_1 .. d_{B-1}],
    # row 1 the target's argmax after each of its tokens; the drafter's block is [anchor, MASK x (B-1)].
    tokens = torch.zeros((2, block_size), dtype=torch.int64, device=device)
    verify_ids, target_tokens = tokens[0], tokens[1]
    anchor_slot, draft_slots = verify_ids[:1], verify_ids[1:]
    context_hidden = context_positions = block_input_ids = block_anchor = None
    if drafting:
        drafter_dtype = next(drafter.parameters()).dtype if isinstance(drafter, torch.nn.Module) else taps.dtype
        capacity = position + config.max_new_tokens + block_size
        context_hidden = torch.empty(capacity, taps.shape[-1], dtype=drafter_dtype, device=device)
        context_hidden[:position] = taps
        context_positions = torch.arange(capacity, device=device)
        block_input_ids = torch.full((block_size,), int(config.mask_token_id), dtype=torch.int64, device=device)
        block_anchor = block_input_ids[:1]

    acceptance_lengths: list[int] = []
    finish_reason: Literal["length", "stop"] = "stop" if output[-1] in stop else "length"
    started = time.perf_counter()
    while len(output) < config.max_new_tokens and finish_reason != "stop":
        anchor_slot.fill_(output[-1])  # a fill takes the host's value as an argument: no copy, no wait
        draft_probs = None
        if drafting:
            block_anchor.fill_(output[-1])
            draft_logits = drafter.draft_block(
                context_hidden[:position], context_positions[:position], block_input_ids, position
            )[1:]
            if greedy:  # no float32 upcast: an exact one could not move the argmax
                torch.argmax(draft_logits, dim=-1, out=draft_slots)
            else:
                draft_probs = torch.softmax(draft_logits.float() / config.temperature, dim=-1)
                draft_slots.copy_(torch.multinomial(draft_probs, 1, generator=generator).reshape(-1))
        target_logits, taps = tapped.forward(verify_ids, position, cache)
        if greedy:
            # verify_greedy from the cycle's one read of the device; the committed tokens are the target's argmax
            # at the anchor and at every accepted draft.
            torch.argmax(target_logits, dim=-1, out=target_tokens)
            drafted, targets = tokens.tolist()
            accepted = _accepted_prefix(drafted[1:], targets)
            committed = targets[: accepted + 1]
        else:
            target_probs = torch.softmax(target_logits / config.temperature, dim=-1)
            if draft_probs is None:
                draft_probs = target_probs[:0]
            accepted, next_token = verify_sampled(draft_slots, draft_probs, target_probs, generator)
            committed = [*draft_slots[:accepted].tolist(), next_token]
        rejected = block_size - 1 - accepted
        if rejected:
            cache.crop(-rejected)  # negative = tokens to remove, in every transformers 5.x
        if drafting:
            context_hidden[position : position + accepted + 1] = taps[: accepted + 1]
        position += accepted + 1
        acceptance_lengths.append(accepted + 1)
        for token in committed:
            output.append(int(token))
            if token in stop:
                finish_reason = "stop"
                break
            if len(output) >= config.max_new_tokens:
                break
    _synchronize(device)
    decode_seconds = time.perf_counter() - started
    tapped.capture = True
    return GenerationResult(
        prompt_ids=prompt.tolist(),
        output_ids=output[: config.max_new_tokens],
        acceptance_lengths=acceptance_lengths,
        block_size=block_size,
        prefill_seconds=prefill_seconds,
        decode_seconds=decode_seconds,
        finish_reason=finish_reason,
    )


@torch.inference_mode()
def target_generate(
    model: torch.nn.Module, prompt_ids: Sequence[int] | torch.Tensor, config: SpeculativeConfig, *, seed: int = 0
) -> GenerationResult:
    """The target's own decoding of one prompt: ``model.generate(input_ids, max_new_tokens=..., do_sample=False,
    use_cache=True)`` (transformers' default dynamic KV cache), as users run it; the reference a speculative
    loop's speed and greedy output are compared with.

    The settings are those of ``config`` (``block_size`` and ``mask_token_id`` are not used): the same
    ``max_new_tokens`` and stop tokens as :func:`speculative_generate` (an empty ``stop_token_ids`` ignores the end
    of sequence, as ``eos_token_id=[]`` does in ``generate()``). Sampled mode (``temperature > 0``) samples the
    full softmax at that temperature (``top_k=0``, ``top_p=1.0``: no truncation, like the speculative loop) from
    torch's generator seeded with ``seed`` (restored afterwards).

    Returns:
        :class:`GenerationResult` without cycles (``acceptance_lengths`` empty, ``block_size`` 1); the wall time of
        the whole call, prefill included (``generate()`` does not time the two apart), is in ``decode_seconds``,
        ``prefill_seconds`` is 0. Device synchronized around the call on CUDA.

    Raises:
        ConfigError: empty prompt.
    """
    device = next(model.parameters()).device
    prompt = torch.as_tensor(list(prompt_ids) if not torch.is_tensor(prompt_ids) else prompt_ids, dtype=torch.int64)
    prompt = prompt.reshape(1, -1).to(device)
    if prompt.numel() == 0:
        raise ConfigError("prompt_ids is empty; a prompt needs at least one token")
    stop = list(config.stop_token_ids)
    pad = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    sampling: dict[str, Any] = (
        {"do_sample": True, "temperature": config.temperature, "top_k": 0, "top_p": 1.0}
        if config.mode == "sampled" else {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
    )
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        _synchronize(device)
        started = time.perf_counter()
        sequences = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=config.max_new_tokens, use_cache=True,
            eos_token_id=stop, pad_token_id=pad if pad is not None else (stop[0] if stop else 0), **sampling,
        )
        _synchronize(device)
        seconds = time.perf_counter() - started
    output = sequences[0, prompt.shape[1] :].tolist()
    return GenerationResult(
        prompt_ids=prompt[0].tolist(),
        output_ids=output,
        acceptance_lengths=[],
        block_size=1,
        prefill_seconds=0.0,
        decode_seconds=seconds,
        finish_reason="stop" if output and output[-1] in config.stop_token_ids else "length",
    )


def first_divergence(candidate: Sequence[int], reference: Sequence[int]) -> int | None:
    """Index of the first token where ``candidate`` and ``reference`` differ (a length difference counts at the
    shorter length); ``None`` when they are identical."""
    for index, (a, b) in enumerate(zip(candidate, reference, strict=False)):
        if a != b:
            return index
    if len(candidate) != len(reference):
        return min(len(candidate), len(reference))
    return None

