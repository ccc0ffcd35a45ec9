"""A tapped target on a static KV cache whose draft-verify forwards replay as CUDA graphs.

At batch 1 a small target's forward is launch-bound: SmolLM2-135M's 30 layers issue ~1,500 kernels whose
arithmetic takes microseconds, so an eager forward of one token or of a 16-token block costs the host's ~23 ms of
launches on an H200 whatever the GPU (docs/benchmarks.md, "Evaluate"). :class:`StaticTappedTarget` runs the same
model, the same hooks and the same :func:`dflash.decoding.speculative.speculative_generate` loop, but keeps the keys
and values in one transformers ``StaticCache`` and, on CUDA, captures the forward of each query length the loop
uses (the verify block of B tokens, and one token for plain decoding) once as a CUDA graph: later cycles copy their
tokens and start position into the graph's input buffers and replay it.

What makes one graph serve every cycle: the start position lives in a device tensor; inside the graph it sets
every layer's cache write position, the tokens' position ids and the attention mask (query ``i`` attends cache
positions ``<= start + i``). A rejected draft therefore needs no crop: the next cycle starts at the first
uncommitted position and overwrites what lies beyond it, and the mask hides anything further. The prefill (a
prompt's length changes from prompt to prompt) runs eagerly into the same cache. Without CUDA (or where a capture
fails) the forwards run eagerly through the same code, which the tests compare with the dynamic-cache
:class:`~dflash.decoding.speculative.TappedTarget` token for token.

Source followed: transformers' ``StaticCache`` (its layers write at ``cumulative_length``, a device tensor) and
PyTorch's CUDA graph capture (warm-up on a side stream, then ``torch.cuda.graph``), as
:class:`dflash.generation.static_decode.StaticDecoder` uses them for batched decoding.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash.decoding.speculative import TappedTarget
from dflash.errors import ConfigError
from dflash.target.graphs import capture_graph

__all__ = ["StaticTappedTarget", "static_cache_supported"]

log = logging.getLogger(__name__)

#: Attention implementations that take the 4-D additive mask the static cache needs.
MASKED_ATTENTIONS = ("sdpa", "eager")


def static_cache_supported(model: torch.nn.Module) -> bool:
    """Whether ``model`` can decode through :class:`StaticTappedTarget`: its attention takes a 4-D mask (``sdpa`` or
    ``eager``) and every layer keeps plain full-attention keys and values (no sliding window, no recurrent state of
    linear attention or state-space layers, no indexer)."""
    if getattr(model.config, "_attn_implementation", None) not in MASKED_ATTENTIONS:
        return False
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    # The cache transformers builds for this config says what each layer keeps (its layers allocate lazily). Only
    # plain key/value layers can be rewritten from any start position, which a rejected draft needs.
    return all(type(layer) is StaticLayer for layer in StaticCache(config=model.config, max_cache_len=8).layers)


@dataclass
class _Graph:
    """One query length's forward after a prompt: its input buffers, and where it is captured its outputs (valid
    until the next replay) and the graph (None where it runs eagerly)."""

    tokens: torch.Tensor  # (1, q) int64
    position: torch.Tensor  # () int64: the cache position of tokens[0, 0]
    logits: torch.Tensor | None = None  # (q, V) float32
    taps: torch.Tensor | None = None  # (q, n*H) or None when the taps were off at capture
    graph: torch.cuda.CUDAGraph | None = None


class _StaticSession:
    """What :meth:`StaticTappedTarget.new_cache` returns for one generation: the loop's cache handle (the cache
    itself is the target's one static cache)."""

    def crop(self, tokens_to_remove: int) -> None:
        """Nothing to remove: every forward writes at the start position it is given and the mask hides the cache
        beyond each query, so a rejected draft's keys are overwritten by the next cycle."""


class StaticTappedTarget(TappedTarget):
    """:class:`~dflash.decoding.speculative.TappedTarget` on a static KV cache, with CUDA graphs on CUDA.

    Same ``forward(input_ids [k], start, cache) -> (logits [k, V] float32, taps [k, n*H] | None)`` and hooks; the
    cache :meth:`new_cache` returns is a handle on the one static cache this target keeps (one generation at a
    time). A returned logits/taps pair of a replayed graph is overwritten by the next forward of the same length.

    Args:
        model: a transformers causal LM whose attention takes a 4-D mask (:func:`static_cache_supported`), on its
            device, eval mode.
        target_layer_ids: the drafter's tapped layers.
        cuda_graphs: capture each query length's forward once and replay it (CUDA only); False runs the same
            forwards eagerly.
        length_bucket: the cache length (prompt + new tokens + one block) is rounded up to a multiple of this;
            a longer generation reallocates it (and recaptures).

    Raises:
        ConfigError: the model's attention takes no 4-D mask, or it has layers other than full attention.
    """

    def __init__(self, model: torch.nn.Module, target_layer_ids: Sequence[int], *, cuda_graphs: bool = True,
                 length_bucket: int = 256) -> None:
        if not static_cache_supported(model):
            attention = getattr(model.config, "_attn_implementation", None)
            if attention not in MASKED_ATTENTIONS:
                raise ConfigError(
                    f"the static-cache target needs an attention that takes a 4-D mask ({' or '.join(MASKED_ATTENTIONS)}); "
                    f"this target runs {attention!r}: load it with attn_implementation='sdpa'")
            raise ConfigError(
                "the static-cache target needs plain full-attention layers; this target has sliding-window, "
                "linear-attention or other stateful layers: decode it with the dynamic KV cache (--kv-cache dynamic)")
        super().__init__(model, target_layer_ids)
        self.cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self.length_bucket = max(1, int(length_bucket))
        self._dtype = next(model.parameters()).dtype
        self._min = torch.finfo(self._dtype).min
        self._cache: Any = None
        self._length = 0
        self._key_index: torch.Tensor | None = None
        self._graphs: dict[tuple[int, bool], _Graph] = {}
        self._failed: set[tuple[int, bool]] = set()
        #: Forwards replayed from a graph and run eagerly since this target was made (benchmarks report them).
        self.replays = 0
        self.eager_forwards = 0

    def reserve(self, tokens: int) -> None:
        """Make the cache hold ``tokens`` positions (prompt + new tokens + one block) before the timed decoding, so no
        generation reallocates it or recaptures a graph."""
        if tokens > self._length:
            from transformers import StaticCache

            self._length = -(-int(tokens) // self.length_bucket) * self.length_bucket
            self._cache = StaticCache(config=self.model.config, max_cache_len=self._length)
            self._key_index = torch.arange(self._length, device=self.device)
            self._graphs.clear()
            self._failed.clear()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def new_cache(self, capacity: int = 0) -> _StaticSession:
        self.reserve(max(int(capacity), 1))
        return _StaticSession()

    def forward(self, input_ids: torch.Tensor, start: int, cache: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``input_ids`` [k] at positions ``start .. start+k-1`` on the static cache (which holds the generation's
        positions before ``start``); returns float32 logits [k, V] and, when capturing, the taps [k, n*H]. The
        first forward of a generation (``start`` 0, the prompt) and any forward a graph cannot serve run eagerly.

        Raises:
            ValueError: the positions run past the cache (``new_cache`` was given too small a capacity).
        """
        q = int(input_ids.numel())
        if start + q > self._length:
            raise ValueError(f"positions {start}..{start + q - 1} run past the static cache of {self._length}; "
                             "give new_cache the generation's capacity")
        if start == 0:  # a prompt: its length changes from prompt to prompt, so it never has a graph
            buffers = _Graph(tokens=input_ids.reshape(1, q),
                             position=torch.tensor(start, dtype=torch.int64, device=self.device))
            self.eager_forwards += 1
            return self._body(buffers)
        # Every later forward goes through its query length's input buffers, replayed or not: without CUDA the
        # same copies run as with it, then the same body eagerly.
        key = (q, self.capture)
        entry = self._graphs.get(key)
        if entry is None:
            with torch.inference_mode(False):  # plain tensors: written in place in and out of inference mode
                entry = self._graphs[key] = _Graph(tokens=torch.zeros((1, q), dtype=torch.int64, device=self.device),
                                                   position=torch.zeros((), dtype=torch.int64, device=self.device))
        entry.tokens.copy_(input_ids)  # [q] into (1, q): copy_ broadcasts
        entry.position.fill_(start)
        if entry.graph is None and not (self.cuda_graphs and key not in self._failed and self._capture(key, entry)):
            self.eager_forwards += 1
            return self._body(entry)
        entry.graph.replay()
        self.replays += 1
        return entry.logits, entry.taps

    def _body(self, buffers: _Graph) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward of ``buffers.tokens`` at ``buffers.position``: what a graph records and what runs eagerly."""
        q = buffers.tokens.shape[1]
        for layer in self._cache.layers:  # every layer writes the new keys from the start position on
            layer.cumulative_length.copy_(buffers.position)
        positions = buffers.position + self._key_index[:q]
        allowed = self._key_index[None, :] <= positions[:, None]
        mask = torch.zeros((q, self._length), dtype=self._dtype, device=self.device).masked_fill_(~allowed, self._min)
        self._captured.clear()
        output = self.model(input_ids=buffers.tokens, attention_mask=mask[None, None], position_ids=positions[None],
                            use_cache=True, **{self._cache_argument: self._cache})
        taps = None
        if self.capture:
            taps = torch.cat([self._captured[i][0] for i in self.target_layer_ids], dim=-1)
        self._captured.clear()
        return output.logits[0].float(), taps

    def _capture(self, key: tuple[int, bool], entry: _Graph) -> bool:
        """Capture ``entry``'s forward (its buffers already hold this call's inputs); False where it cannot be
        captured, and that length then runs eagerly."""
        try:  # the warm-up forwards write this call's keys, as the replay that follows does
            graph, (entry.logits, entry.taps) = capture_graph(self.device, lambda: self._body(entry))
        except RuntimeError as exc:  # pragma: no cover - depends on the model's ops and the CUDA build
            log.warning("CUDA graph capture of the %d-token target forward failed (%s); running it eagerly", key[0], exc)
            self._failed.add(key)
            torch.cuda.synchronize(self.device)
            return False
        entry.graph = graph
        return True

    def close(self) -> None:
        super().close()
        self._graphs.clear()
        self._cache = None
        self._length = 0
