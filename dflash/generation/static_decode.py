"""Batched decoding over transformers' static KV cache with the decode step replayed as one CUDA graph.

Why not ``model.generate``: for a small target at a large batch, transformers' generation loop spends far more time in
Python per token (logits processors, stopping criteria, mask rebuilding, cache bookkeeping) than the GPU spends on the
forward; SmolLM2-135M at batch 512 ran at ~4,900 generated tokens/s on an H200 through it (docs/generate.md). This
loop keeps every per-step input in fixed device buffers (the token column, the positions, the additive attention mask
over the whole cache, the cache itself), so the forward of one decode step is captured once per shape with
``torch.cuda.CUDAGraph`` and replayed; what runs in Python per token is the replay, the choice of the next token and
a few in-place buffer updates, and the host waits on the device only every ``check_every`` steps.

:meth:`StaticDecoder.decode_stream` keeps the rows busy across many prompts (continuous batching): where every
attention layer runs the fused forward (:mod:`dflash.generation.fused_decode`, which writes each row's key and value
at that row's own position), a row whose reply has ended takes the next prompt, prefilled into its cache row from
position 0, while the others decode on; the decode step keeps its shape and its graph.

The model is the target's own transformers module, called through its public forward: a 4-D additive attention mask
(which transformers passes to the attention as it is), explicit ``position_ids`` (left padding), ``logits_to_keep=1``
and a ``transformers.StaticCache`` (which advances its own write position, on the device). The forward argument that
takes the cache is ``cache`` from transformers 5.2x and ``past_key_values`` before; both are handled.

Sampling (temperature > 0) draws each row's token with the Gumbel-max trick from noise that is a hash of (seed,
request id, step, token id): the same request gives the same tokens whatever batch or replica it ran in. Top-p keeps
the smallest prefix of the sorted distribution whose mass reaches ``top_p`` (the top token always).

Greedy output equals ``model.generate(do_sample=False)`` for the same prompt up to floating-point ties (padding and
batch composition change the summation order); tests/test_static_decode.py checks it token for token.

Source followed: PyTorch's CUDA graphs notes (warm-up on a side stream, capture with ``torch.cuda.graph``, replay
after in-place updates of the captured inputs); transformers' ``StaticCache`` and its 4-D mask pass-through
(``masking_utils``).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash.errors import ConfigError
from dflash.generation.ranged_attention import RANGES_KWARG
from dflash.target.forwards import is_mlp_or_norm, own_forward, replace_forwards, restore_forwards
from dflash.target.graphs import capture_graph

__all__ = ["StaticDecoder", "gumbel_noise", "grouped_decode_attention", "deterministic_decode_attention",
           "ranged_attention", "ATTENTION_NAME", "DETERMINISTIC_ATTENTION_NAME", "RANGED_ATTENTION_NAME",
           "RANGES_KWARG"]

#: The name under which :func:`grouped_decode_attention` is registered with transformers' ``AttentionInterface``.
ATTENTION_NAME = "grouped_decode_gqa"  # no "flash" in it: transformers reads that as a flash-attention kernel request
#: The name of :func:`deterministic_decode_attention` (``StaticDecoder(deterministic=True)``).
DETERMINISTIC_ATTENTION_NAME = "grouped_decode_gqa_repeatable"
#: The name of :func:`ranged_attention` (the default on CUDA with Triton).
RANGED_ATTENTION_NAME = "grouped_decode_ranged"

log = logging.getLogger(__name__)

# Odd 64-bit constants of splitmix64 (Steele, Lea, Flood 2014), as signed int64 (torch has no uint64 arithmetic).
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    x = x + _GOLDEN
    x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * _MIX1
    x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * _MIX2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def gumbel_noise(keys: torch.Tensor, step: int | torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise, a pure function of (row key, step, token id).

    Args:
        keys: (rows,) int64, one key per row (``seed * 2**32 + request_id``).
        step: the decode step (0 for the first generated token), or (rows,) int64, one per row.
        vocab_size: columns.

    Returns:
        (rows, vocab_size) float32 samples of Gumbel(0, 1); ``argmax(logits / T + noise)`` samples softmax(logits / T).
    """
    tokens = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    x = _splitmix(_splitmix(keys * 1_000_003 + step)[:, None] + tokens[None, :])
    uniform = ((x >> 11) & ((1 << 53) - 1)).double().add_(0.5).mul_(2.0 ** -53)  # in (0, 1)
    return (-torch.log(-torch.log(uniform))).float()


def grouped_decode_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention for one query token per row that reads each KV head once (grouped-query attention without
    ``repeat_kv``); longer queries (prefill) go to transformers' own ``sdpa`` function.

    transformers' sdpa path expands the KV heads to the query heads whenever a mask is given (``repeat_kv``), which
    at decode time writes and re-reads ``query_heads / kv_heads`` copies of the whole cache every layer and step: the
    cost that bounded SmolLM2 at ~9K generated tokens/s at batch 512 on an H200 (docs/generate.md). Here the query
    goes to ``torch.nn.functional.scaled_dot_product_attention`` with ``enable_gqa=True`` and the KV heads as stored:
    its kernels map each query head to its KV head without copies. On an H200 that is 2-3x faster than the earlier
    grouped matmuls of this function (SmolLM2's shape, 512 rows, cache length 384-1024: 48-103 vs 161-178 us per
    layer; docs/generate.md).

    Args:
        module: the attention module (``is_causal`` is irrelevant for one query).
        query: (batch, query_heads, 1, head_dim); key, value: (batch, kv_heads, kv_length, head_dim), same dtype.
        attention_mask: (batch, 1, 1, kv_length), additive (0 = attend) or boolean (True = attend), or None.
        scaling: the softmax scale (default ``head_dim ** -0.5``).

    Returns:
        (batch, 1, query_heads, head_dim) in the query's dtype, and no weights.

    Source followed: transformers' ``repeat_kv`` (query head h reads KV head ``h // (query_heads / kv_heads)``, the
    mapping ``enable_gqa`` uses too) and its attention-function interface (``AttentionInterface``).
    """
    if query.shape[2] != 1 or dropout:
        from transformers import AttentionInterface

        return AttentionInterface()["sdpa"](module, query, key, value, attention_mask, dropout=dropout,
                                            scaling=scaling, **kwargs)
    mask = None if attention_mask is None else attention_mask[:, :, -1:, : key.shape[-2]]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(query.dtype)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                                           enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def deterministic_decode_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                   attention_mask: torch.Tensor | None, dropout: float = 0.0,
                                   scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """:func:`grouped_decode_attention` with bitwise-repeatable kernels: the query heads of a group form the rows of
    one matmul against their shared KV head (scores and softmax in float32). Same arguments, shapes and result.

    Why it exists: the SDPA kernel that ``enable_gqa`` reaches on an H200 (cuDNN attention) does not give the same
    bits from one call to the next, so two greedy runs of the same bf16 batch can break near-ties differently (on
    SmolLM2, 2,048 replies of 256 tokens: 36-39% of replies differed somewhere between two identical passes). This
    variant repeats exactly; it was 1.32x slower in the decode loop (docs/generate.md).
    """
    if query.shape[2] != 1 or dropout:
        return grouped_decode_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                        **kwargs)
    batch, query_heads, _, head_dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.reshape(batch, kv_heads, query_heads // kv_heads, head_dim)
    scores = torch.matmul(grouped, key.transpose(-1, -2)).float()  # (batch, kv_heads, group, kv_length)
    scores.mul_(scaling if scaling is not None else head_dim ** -0.5)
    if attention_mask is not None:
        mask = attention_mask[:, :, -1:, : key.shape[-2]]
        if mask.dtype == torch.bool:  # transformers' sdpa-style mask: True = attend
            scores.masked_fill_(~mask, float("-inf"))
        else:
            scores.add_(mask.float())
    probs = scores.softmax(-1).to(value.dtype)
    out = torch.matmul(probs, value)  # (batch, kv_heads, group, head_dim)
    return out.reshape(batch, query_heads, 1, head_dim).transpose(1, 2).contiguous(), None


def ranged_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Decode attention that reads only each row's own key range
    (:func:`dflash.generation.ranged_attention.ranged_decode_attention`), given as ``(starts, ends)`` in the forward
    keyword :data:`RANGES_KWARG`; the mask is then not read. Prefill, and calls without ranges, go to
    :func:`grouped_decode_attention`. Same arguments, shapes and result as that function.
    """
    ranges = kwargs.pop(RANGES_KWARG, None)
    if query.shape[2] != 1 or dropout or ranges is None:
        return grouped_decode_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                        **kwargs)
    from dflash.generation.ranged_attention import ranged_decode_attention

    starts, ends = ranges
    return ranged_decode_attention(query, key, value, starts, ends, scale=scaling), None


def _reply(tokens: list[int], limit: int, stops: set[int]) -> list[int]:
    """A row's generated tokens: its first ``limit``, up to and including the first stop token."""
    tokens = tokens[:limit]
    end = next((k for k, token in enumerate(tokens) if token in stops), None)
    return tokens if end is None else tokens[: end + 1]


def _rewind(slot: _Slot) -> None:
    """Let the static cache of ``slot`` write from position 0 again (its next update through the model's own
    attention forward)."""
    for layer in slot.cache.layers:
        if getattr(layer, "is_initialized", False):
            layer.cumulative_length.zero_()


def _compiled_forward(module: torch.nn.Module, decode: Any, prefill: Any, hidden: torch.Tensor, *args: Any,
                      **kwargs: Any) -> Any:
    """A compiled part's forward: the static-shape graph for one token per row, the shape-generic one (or the
    class's eager forward, when ``prefill`` is None) for more."""
    if hidden.shape[1] == 1:
        return decode(hidden, *args, **kwargs)
    if prefill is None:
        return type(module).forward(module, hidden, *args, **kwargs)
    return prefill(module, hidden, *args, **kwargs)


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, grouped_decode_attention)
    AttentionInterface.register(DETERMINISTIC_ATTENTION_NAME, deterministic_decode_attention)
    AttentionInterface.register(RANGED_ATTENTION_NAME, ranged_attention)


@dataclass
class _Slot:
    """One cache length: the static cache, the captured decode step and its fixed input/output buffers."""

    cache: Any
    tokens: torch.Tensor  # (rows, 1) int64: the token each row feeds this step
    positions: torch.Tensor  # (rows, 1) int64: its position id (left padding excluded)
    mask: torch.Tensor  # (rows, 1, 1, length) model dtype: 0 where a row may attend, dtype min elsewhere
    starts: torch.Tensor  # (rows,) int32: first cache position each row attends (ranged attention)
    ends: torch.Tensor  # (rows,) int32: one past the last; equal to starts for a finished row
    write: torch.Tensor  # (1,) int64: the cache position of the token fed this step; (rows,) one per row (stream)
    logits: torch.Tensor | None = None  # (rows, vocab) the captured step's output
    graph: torch.cuda.CUDAGraph | None = None
    graph_failed: bool = False


def _attention_shape(config: Any) -> tuple[Any, int, int, int]:
    """The text model's config, its query heads, key/value heads and head width."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return text, heads, kv_heads, getattr(text, "head_dim", None) or text.hidden_size // heads


def kv_cache_bytes(config: Any, rows: int, length: int, dtype: torch.dtype) -> int:
    """Bytes of a transformers ``StaticCache`` of ``rows`` x ``length`` positions for a full-attention model: a key
    and a value tensor ``[rows, kv_heads, length, head_dim]`` per layer."""
    text, _, kv_heads, head_dim = _attention_shape(config)
    itemsize = dtype.itemsize
    return 2 * text.num_hidden_layers * rows * kv_heads * length * head_dim * itemsize


def _mlp_width(text: Any) -> int:
    """The widest MLP activation of one token: the dense MLP's (``intermediate_size``; GPT-2-style configs:
    ``n_inner``, where None is 4x the hidden size) or, in a mixture of experts, its routed experts' together
    (``num_experts_per_tok`` x ``moe_intermediate_size``), whichever is wider."""
    dense = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * text.hidden_size
    if isinstance(dense, (list, tuple)):  # one width per layer
        dense = max(dense)
    experts = (getattr(text, "moe_intermediate_size", None) or 0) * (getattr(text, "num_experts_per_tok", None) or 1)
    return max(int(dense), int(experts))


def forward_activation_bytes(config: Any, tokens: int, rows: int, width: int, dtype: torch.dtype,
                             columns: int | None = None) -> int:
    """An estimate, on the safe side, of the memory a forward of ``tokens`` tokens (``rows`` prompts left-padded to
    ``width``) holds at its peak beyond the weights and the KV cache: one layer's activations (residual stream,
    normed input, query/key/value/output projections, the MLP's gate, up and product: :func:`_mlp_width`), the
    prefill's 4-D additive mask (``width`` queries over ``columns`` key columns: the prompt's, default, or the
    whole cache's where the prefill writes a fresh cache) and the last position's float32 logits; a quarter more for
    the allocator's fragmentation, and 1 GiB for workspaces (cuBLAS, the captured graphs' pools)."""
    text, heads, kv_heads, head_dim = _attention_shape(config)
    itemsize = dtype.itemsize
    per_token = 4 * text.hidden_size + 2 * (heads + 2 * kv_heads) * head_dim + 3 * _mlp_width(text)
    mask = rows * width * (width if columns is None else columns) * itemsize
    logits = rows * text.vocab_size * 4
    return (tokens * per_token * itemsize + mask + logits) * 5 // 4 + 2**30


class StaticDecoder:
    """Decode batches of left-padded prompts with a static KV cache (and CUDA graphs on CUDA).

    Args:
        model: a transformers causal LM (decoder-only, full attention), eval mode, on its device.
        rows: most rows per batch; with CUDA graphs every batch has exactly this many (shorter ones are filled with
            one-token filler rows: fixed graph shapes), eagerly a batch has only its own rows.
        pad_token_id: the token of padding and filler rows.
        stop_token_ids: tokens that end a row (kept as its last token).
        cuda_graphs: capture the decode step (CUDA only); False runs the same loop eagerly.
        length_bucket: cache lengths (prompt width + new tokens) are rounded up to a multiple of this.
        max_slots: cache lengths kept allocated at once (least recently used freed first).
        check_every: decode steps between checks that every row has stopped (each check waits on the device).
        grouped_attention: while this decoder is open, the model's attention is :func:`grouped_decode_attention`
            (registered with transformers; the previous implementation comes back on :meth:`close`). Only models on
            ``sdpa`` or ``eager`` attention are switched.
        deterministic: with ``grouped_attention``, decode with :func:`deterministic_decode_attention` (bitwise
            repeatable from run to run, slower) instead of SDPA's grouped-query kernel.
        ranged: with ``grouped_attention`` and not ``deterministic``, decode with :func:`ranged_attention`, which
            reads only the cache positions each row attends (its prompt and its tokens so far; nothing once it has
            stopped) instead of the whole padded cache. None: where it can run (CUDA with Triton).
        compile_parts: while this decoder is open, the model's MLP and RMSNorm modules (what touches no KV cache)
            run through ``torch.compile``, which fuses their elementwise kernels: a decode step of a small target is
            hundreds of tiny kernels. Their forwards come back on :meth:`close`. None: on CUDA with Triton.
        compile_prefill: with ``compile_parts``, the prefill's MLP and RMSNorm run compiled too, through one
            shape-generic graph each (``dynamic=True``: prompt widths change from batch to batch); False runs them
            eagerly in the prefill. None: with ``compile_parts``.
        compile_backend: the ``torch.compile`` backend of ``compile_parts`` (``"inductor"``; tests use ``"eager"``).
        fused: with ``ranged``, the attention modules of the architectures in
            :data:`dflash.generation.fused_decode.FUSABLE_ATTENTIONS` decode through
            :func:`dflash.generation.fused_decode.fused_decode_forward` (rotary embedding and cache write in one
            kernel) while this decoder is open. None: wherever ``ranged`` runs.
        kv_memory: bytes the decoder's KV caches and its largest forward's activations may take (the caches it
            holds count against it, as they would against a device's free memory). A call whose ``rows`` would not
            fit decodes fewer rows at a time (:meth:`rows_that_fit`; a warning says how many), so a large target or
            long prompts never run the device out of memory at the configured batch size. The rows of a cache length
            are counted when its cache is allocated beside others or its forward is wider than counted before; the
            caches of other lengths are freed first where the rows would not fit beside them. None: on CUDA, the
            device's free memory (plus what PyTorch's allocator holds unused); elsewhere no limit.

    Raises:
        ConfigError: the model runs another attention (e.g. flash-attention, which takes no 4-D mask).
        ValueError: (at the first batch) the model has sliding-window layers.
    """

    def __init__(self, model: Any, *, rows: int, pad_token_id: int, stop_token_ids: Sequence[int],
                 cuda_graphs: bool = True, length_bucket: int = 128, max_slots: int = 2, check_every: int = 16,
                 grouped_attention: bool = True, deterministic: bool = False, ranged: bool | None = None,
                 compile_parts: bool | None = None, compile_backend: str = "inductor",
                 compile_prefill: bool | None = None, fused: bool | None = None,
                 kv_memory: int | None = None) -> None:
        self.model = model
        self.rows = rows
        self.kv_memory = kv_memory
        #: Rows the last :meth:`decode` or :meth:`decode_stream` call decoded at a time (``rows`` unless memory capped).
        self.last_rows = rows
        #: (cache length, stream) -> the rows that fit, counted beside a forward of so many tokens, so wide
        self._fits: dict[tuple[int, bool], tuple[int, int, int]] = {}
        self.pad_token_id = int(pad_token_id)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self.length_bucket = max(1, length_bucket)
        self.max_slots = max(1, max_slots)
        self.check_every = max(1, check_every)
        self.stops = torch.tensor(sorted(set(int(t) for t in stop_token_ids)), dtype=torch.long, device=self.device)
        params = inspect.signature(model.forward).parameters
        self._cache_argument = "cache" if "cache" in params else "past_key_values"
        self._slots: OrderedDict[tuple[int, int, bool], _Slot] = OrderedDict()  # (rows, length, stream)
        self._min = torch.finfo(self.dtype).min
        #: How the last batch's decode steps ran: "graph" or "eager" (benchmarks and the stage report it).
        self.last_mode = "eager"
        #: Decode steps (forwards of one token per row) of the last :meth:`decode` or :meth:`decode_stream` call.
        self.last_steps = 0
        #: Row-steps decoded since this decoder was made: each decode step's forward adds its cache rows (finished,
        #: free and filler rows included), so the tokens those steps chose / row_steps is how busy the rows were.
        self.row_steps = 0
        #: KV caches allocated since this decoder was made (a new batch shape or cache length; on CUDA each one's
        #: decode step is captured again at its first step): a fixed cost per cache, paid again where calls change
        #: their cache length.
        self.caches_made = 0
        self._restore_attention: str | None = None
        previous = getattr(model.config, "_attn_implementation", None)
        if previous not in ("sdpa", "eager", ATTENTION_NAME, DETERMINISTIC_ATTENTION_NAME, RANGED_ATTENTION_NAME, None):
            raise ConfigError(f"the static decoder passes a 4-D padding mask, which attention {previous!r} does not "
                              "take; load the target with attn_implementation='sdpa' or use kv_cache=dynamic")
        self.ranged = False
        if grouped_attention and previous in ("sdpa", "eager"):
            from dflash.generation.ranged_attention import ranged_attention_available

            available = ranged_attention_available(self.device)
            if ranged and not available:
                raise ConfigError(f"ranged decode attention needs CUDA and Triton; the target is on {self.device}")
            self.ranged = not deterministic and (available if ranged is None else bool(ranged))
            _register_attention()
            model.set_attn_implementation(DETERMINISTIC_ATTENTION_NAME if deterministic
                                          else RANGED_ATTENTION_NAME if self.ranged else ATTENTION_NAME)
            self._restore_attention = previous
        from dflash.generation.ranged_attention import ranged_attention_available

        if compile_parts is None:
            compile_parts = self.device.type == "cuda" and ranged_attention_available(self.device)
        #: The modules whose forward runs compiled while the decoder is open: a static-shape graph each for the
        #: decode step, one shape-generic graph per class for the prefill (its own frame, apart from the decode's).
        self._compiled: list[torch.nn.Module] = []
        if compile_parts:
            prefill = (torch.compile(own_forward, dynamic=True, backend=compile_backend)
                       if compile_prefill is None or compile_prefill else None)
            self._compiled = replace_forwards(model, is_mlp_or_norm, lambda module: functools.partial(
                _compiled_forward, module, torch.compile(module.forward, dynamic=False, backend=compile_backend),
                prefill))
        #: The attention modules whose forward is :func:`fused_decode_forward` while the decoder is open.
        self._fused: list[torch.nn.Module] = []
        self._attention_layers = sum(1 for module in model.modules()
                                     if type(module).__name__.endswith("Attention") and hasattr(module, "layer_idx"))
        if self.ranged and (fused is None or fused):
            from dflash.generation.fused_decode import fusable, fused_decode_forward

            self._fused = replace_forwards(model, fusable,
                                           lambda module: functools.partial(fused_decode_forward, module))

    # -- buffers ---------------------------------------------------------------------------------------------------

    def _slot(self, rows: int, length: int, stream: bool = False) -> _Slot:
        slot = self._slots.pop((rows, length, stream), None)
        if slot is None:
            while len(self._slots) >= self.max_slots:
                self._slots.popitem(last=False)
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            from transformers import StaticCache

            cache = StaticCache(config=self.model.config, max_cache_len=length)
            self.caches_made += 1
            if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
                raise ValueError("the static decoder needs full-attention layers; this target has sliding-window ones "
                                 "(use kv_cache=dynamic)")
            slot = _Slot(cache=cache,
                         tokens=torch.full((rows, 1), self.pad_token_id, dtype=torch.long, device=self.device),
                         positions=torch.zeros((rows, 1), dtype=torch.long, device=self.device),
                         mask=torch.full((rows, 1, 1, length), self._min, dtype=self.dtype, device=self.device),
                         starts=torch.zeros(rows, dtype=torch.int32, device=self.device),
                         ends=torch.zeros(rows, dtype=torch.int32, device=self.device),
                         write=torch.zeros(rows if stream else 1, dtype=torch.long, device=self.device))
        self._slots[(rows, length, stream)] = slot
        return slot

    def _forward(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any,
                 ranges: tuple[torch.Tensor, torch.Tensor] | None = None,
                 write: torch.Tensor | None = None, cache_rows: torch.Tensor | None = None) -> torch.Tensor:
        extra: dict[str, Any] = {RANGES_KWARG: ranges} if ranges is not None and self.ranged else {}
        if self._fused and write is not None:
            from dflash.generation.fused_decode import ROWS_KWARG, WRITE_KWARG

            extra[WRITE_KWARG] = write
            if cache_rows is not None:
                extra[ROWS_KWARG] = cache_rows
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1, **{self._cache_argument: cache}, **extra)
        return out.logits[:, -1]

    def _prefill_inputs(self, prompts: Sequence[Sequence[int]], rows: int, width: int,
                        columns: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prefill of ``prompts`` left-padded to ``width``, plus filler rows up to ``rows`` (one visible pad
        token each, output discarded), on the device: input ids (rows, width) int64, which positions hold prompt
        tokens (rows, width) bool, the additive mask (rows, 1, width, columns) in the model dtype (causal over the
        prompt tokens; a padding query sees itself only, so no softmax row is all masked; columns past ``width``
        masked) and the position ids (rows, width) int64 (left padding excluded)."""
        input_ids = torch.full((rows, width), self.pad_token_id, dtype=torch.long)
        valid = torch.zeros((rows, width), dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.as_tensor(list(prompt), dtype=torch.long)
            valid[row, width - len(prompt):] = True
        valid[len(prompts):, -1] = True
        input_ids, valid = input_ids.to(self.device), valid.to(self.device)
        causal = torch.ones((width, width), dtype=torch.bool, device=self.device).tril_()
        allowed = causal[None] & valid[:, None, :]
        allowed |= torch.eye(width, dtype=torch.bool, device=self.device)[None]
        mask = torch.full((rows, 1, width, columns), self._min, dtype=self.dtype, device=self.device)
        mask[:, 0, :, :width].masked_fill_(allowed, 0.0)
        positions = (valid.long().cumsum(-1) - 1).clamp_(min=0)
        return input_ids, valid, mask, positions

    def _step(self, slot: _Slot) -> torch.Tensor:
        return self._forward(slot.tokens, slot.mask, slot.positions, slot.cache, (slot.starts, slot.ends), slot.write)

    def _run_step(self, slot: _Slot, use_graph: bool) -> tuple[torch.Tensor, bool]:
        """One decode step of ``slot``: its captured graph (captured at the first step that uses it) or eagerly.
        Returns the logits and whether the graph runs (False from then on where the capture failed)."""
        if use_graph and slot.graph is None:
            self._capture(slot)
            use_graph = slot.graph is not None
        if use_graph:
            slot.graph.replay()
            return slot.logits, True
        return self._step(slot), False

    def _capture(self, slot: _Slot) -> None:
        """Capture the decode step of ``slot`` on the model's GPU (:func:`dflash.target.graphs.capture_graph`); on
        failure (an op that cannot be captured) fall back to eager."""
        layers = slot.cache.layers
        saved = [layer.cumulative_length.clone() for layer in layers]
        try:
            slot.graph, slot.logits = capture_graph(self.device, lambda: self._step(slot))
        except RuntimeError as exc:  # pragma: no cover - depends on the model's ops and the CUDA build
            log.warning("CUDA graph capture of the decode step failed (%s); decoding eagerly", exc)
            slot.graph, slot.logits, slot.graph_failed = None, None, True
            torch.cuda.synchronize(self.device)
        for layer, value in zip(layers, saved, strict=True):  # the warm-up advanced the write position: rewind
            layer.cumulative_length.copy_(value)

    def _free_slots(self) -> None:
        """Free every cache (and its captured graph)."""
        self._slots.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _held_bytes(self) -> int:
        """Bytes of the KV caches and decode masks this decoder holds."""
        return sum(t.numel() * t.element_size() for slot in self._slots.values()
                   for t in [slot.mask] + [tensor for layer in slot.cache.layers if getattr(layer, "is_initialized", False)
                                           for tensor in (layer.keys, layer.values)])

    def _room(self, length: int, tokens: int, width: int) -> tuple[int, int, int, int] | None:
        """Rows of ``length`` cache positions that fit now beside the caches held and a forward of ``tokens`` tokens
        ``width`` wide (below 1 where none does), with the budget, per-row and forward bytes counted; None where
        nothing limits the memory (no ``kv_memory``, not CUDA)."""
        budget = self.kv_memory
        if budget is None:
            if self.device.type != "cuda":
                return None
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free + torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        else:
            budget -= self._held_bytes()
        config = self.model.config
        per_row = kv_cache_bytes(config, 1, length, self.dtype) + length * self.dtype.itemsize  # + the step's mask row
        reserve = forward_activation_bytes(config, tokens, min(self.rows, max(1, tokens // max(width, 1))), width,
                                           self.dtype, columns=length)  # a fresh cache's prefill masks every column
        return (budget - reserve) // per_row, budget, per_row, reserve

    def _count_rows(self, length: int, tokens: int, width: int, stream: bool) -> int:
        """The rows a call with a cache of ``length`` positions decodes at once, its largest forward ``tokens``
        tokens ``width`` wide: as counted before for that length where the forward is no larger and its cache is
        held; else all ``rows`` where they fit beside the caches held, or else counted against the memory with
        every cache freed (:meth:`rows_that_fit`)."""
        key = (length, stream)
        counted = self._fits.get(key)
        held = any(slot[1:] == key for slot in self._slots)
        if counted is not None and held and tokens <= counted[1] and width <= counted[2]:
            return counted[0]
        fit = None
        if self._slots:  # every row beside the caches held, or else counted with them freed
            room = self._room(length, tokens, width)
            if room is None or room[0] >= self.rows:
                fit = self.rows
            else:
                self._free_slots()
        if fit is None:
            fit = self.rows_that_fit(length, tokens, width)
        self._fits[key] = (fit, tokens, width)
        return fit

    def rows_that_fit(self, length: int, tokens: int, width: int) -> int:
        """How many of ``rows`` rows a call can decode at once with a cache of ``length`` positions per row, its
        largest forward being ``tokens`` tokens of prompts ``width`` wide: the KV cache (:func:`kv_cache_bytes`) and
        the per-row decode buffers must fit in the memory free now (``kv_memory`` less the caches held, or the
        device's free memory) beside that forward's activations (:func:`forward_activation_bytes`).

        Raises:
            ConfigError: not even one row fits.
        """
        room = self._room(length, tokens, width)
        if room is None:
            return self.rows
        fit, budget, per_row, reserve = room
        if fit < 1:
            raise ConfigError(
                f"one row of {length:,} cache positions needs {per_row / 2**30:.2f} GiB of KV cache beside "
                f"{reserve / 2**30:.2f} GiB for a forward of {tokens:,} tokens, and {budget / 2**30:.2f} GiB are free "
                f"on {self.device}: lower generate.max_length, generate.max_new_tokens or generate.prefill_tokens")
        fit = min(self.rows, int(fit))
        if fit < self.rows:
            log.warning("%d rows x %d cache positions need %.1f GiB of KV cache, more than the %.1f GiB free on %s "
                        "beside %.1f GiB for the prefill: decoding %d rows at a time (a lower generate.batch_size "
                        "chooses the rows; a lower max_length, max_new_tokens or prefill_tokens fits more)", self.rows, length,
                        self.rows * per_row / 2**30, budget / 2**30, self.device, reserve / 2**30, fit)
        return fit

    # -- decoding --------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def decode(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int], *, temperature: float = 0.0,
               top_p: float = 1.0, row_keys: Sequence[int] | None = None, width: int | None = None,
               progress: Callable[[int], None] | None = None) -> list[list[int]]:
        """Generate for up to ``rows`` prompts at once.

        Args:
            prompts: token ids per row (at least one each).
            max_new_tokens: per row, most tokens to generate (the stop token included).
            temperature: 0 = greedy (argmax over float32 logits); else sampled, see the module docstring.
            top_p: nucleus mass, (0, 1].
            row_keys: per row, the sampling key (``seed * 2**32 + request_id``); needed when temperature > 0.
            width: prompt width to left-pad to (>= the longest prompt; default the longest).
            progress: called at each check of the rows (every ``check_every`` steps, where the host reads the device
                anyway) with the tokens the rows have chosen so far: a row still decoding counts every token to that
                check, a row that has ended those it had at the last check that saw it decoding (an estimate; the
                replies returned are exact).

        Returns:
            Per row, the generated token ids: up to and including the first stop token, else ``max_new_tokens`` ids.

        Raises:
            ValueError: more prompts than ``rows``, an empty prompt, ``width`` below the longest prompt, or (sampling)
                not one row key per prompt.
        """
        count = len(prompts)
        if not 0 < count <= self.rows:
            raise ValueError(f"decode takes 1 to {self.rows} prompts, got {count}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        longest = max(len(p) for p in prompts)
        width = longest if width is None else width
        if width < longest:
            raise ValueError(f"width {width} is below the longest prompt ({longest} tokens)")
        if temperature > 0 and (row_keys is None or len(row_keys) != count):  # before the prompts are cut in chunks
            raise ValueError("sampling needs one row key per prompt")
        steps = max(max_new_tokens)
        length = -(-(width + steps) // self.length_bucket) * self.length_bucket
        fit = self.last_rows = self._count_rows(length, self.rows * width, width, stream=False)
        replies: list[list[int]] = []
        steps = 0
        for first in range(0, count, fit):  # one chunk unless the memory holds fewer rows than prompts
            part = slice(first, first + fit)
            before = sum(len(reply) for reply in replies)  # the earlier chunks' replies, final
            chunk = None if progress is None else lambda tokens, before=before: progress(before + tokens)
            replies += self._decode_rows(prompts[part], max_new_tokens[part], temperature, top_p,
                                         None if row_keys is None else row_keys[part], width, length, fit, chunk)
            steps += self.last_steps
        self.last_steps = steps  # every chunk's
        return replies

    def _decode_rows(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int], temperature: float,
                     top_p: float, row_keys: Sequence[int] | None, width: int, length: int,
                     fit: int, progress: Callable[[int], None] | None = None) -> list[list[int]]:
        """:meth:`decode` of at most ``fit`` prompts on a cache of ``fit`` rows (with graphs) x ``length``."""
        count = len(prompts)
        steps = max(max_new_tokens)
        rows = fit if self.cuda_graphs else count  # fixed shapes only where a graph is captured
        if (rows, length, False) not in self._slots and self._slots:  # a cache to allocate beside those held
            room = self._room(length, fit * width, width)
            if room is not None and room[0] < rows:
                self._free_slots()
        slot = self._slot(rows, length)

        input_ids, valid, prefill_mask, positions = self._prefill_inputs(prompts, rows, width, length)
        _rewind(slot)  # reuse the cache: write from position 0 again (stale entries stay masked)
        slot.write.zero_()  # the prefill writes the cache from position 0
        logits = self._forward(input_ids, prefill_mask, positions, slot.cache, write=slot.write)
        del prefill_mask

        slot.mask.fill_(self._min)
        slot.mask[:, 0, 0, :width].masked_fill_(valid, 0.0)
        slot.positions.copy_(positions[:, -1:])
        slot.starts.copy_(width - valid.sum(-1))  # left padding: a row's prompt ends at width - 1
        limits = torch.tensor(list(max_new_tokens) + [1] * (rows - count), dtype=torch.long, device=self.device)
        done = torch.zeros(rows, dtype=torch.bool, device=self.device)
        done[count:] = True
        out = torch.full((rows, steps), self.pad_token_id, dtype=torch.long, device=self.device)
        keys = None
        if temperature > 0:
            assert row_keys is not None and len(row_keys) == count
            keys = torch.tensor(list(row_keys) + [0] * (rows - count), dtype=torch.long, device=self.device)
        write = slot.write
        write.fill_(width)

        use_graph = self.cuda_graphs and not slot.graph_failed
        self.last_steps = 0
        chosen_so_far = [0] * count  # per row, its tokens at the last check that saw it decoding (progress)
        for step in range(steps):
            chosen = self._choose(logits, temperature, top_p, keys, step)
            chosen = torch.where(done, self.pad_token_id, chosen)
            out[:, step] = chosen
            done |= torch.isin(chosen, self.stops) | (limits <= step + 1)
            if step + 1 == steps:
                break
            if (step + 1) % self.check_every == 0:  # the host's one read of the device between checks
                ended = done[:count].tolist()  # filler rows are always done
                if all(ended):
                    break
                if progress is not None:
                    for row, flag in enumerate(ended):
                        if not flag:
                            chosen_so_far[row] = step + 1
                    progress(sum(chosen_so_far))
            slot.tokens.copy_(chosen[:, None])
            slot.positions.add_(1)
            if step:
                write.add_(1)  # the position the token fed this step is written to
            slot.mask.index_fill_(3, write, 0.0)  # the fed token's own key becomes visible
            if self.ranged:  # a row reads up to the fed token; a finished row reads nothing
                torch.where(done, slot.starts, (write + 1).to(torch.int32), out=slot.ends)
            logits, use_graph = self._run_step(slot, use_graph)
            self.last_steps = step + 1
            self.row_steps += rows
        self.last_mode = "graph" if use_graph else "eager"

        stops = set(self.stops.tolist())
        return [_reply(tokens, limit, stops) for tokens, limit in zip(out[:count].cpu().tolist(), max_new_tokens,
                                                                       strict=True)]

    @property
    def streams(self) -> bool:
        """Whether :meth:`decode_stream` runs here: every attention layer of the model decodes through the fused
        forward (:mod:`dflash.generation.fused_decode`), which writes each row at its own cache position."""
        return bool(self._fused) and len(self._fused) == self._attention_layers

    @torch.inference_mode()
    def decode_stream(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int], *,
                      temperature: float = 0.0, top_p: float = 1.0, row_keys: Sequence[int] | None = None,
                      prompt_bucket: int = 1, prefill_tokens: int | None = None, refill_rows: int | None = None,
                      progress: Callable[[list[int], list[list[int]], int], None] | None = None) -> list[list[int]]:
        """Generate for any number of prompts through ``rows`` rows, each row taking the next prompt as soon as its
        reply has ended (continuous batching) instead of waiting for the longest reply of its batch.

        Each row owns its cache row: a new prompt is prefilled into the cache rows of finished ones from position 0
        (its key range starts at its left padding), and every row writes its step's key and value at its own
        position. The decode step's shapes stay fixed (one captured graph for the whole call); the host looks at which
        rows have finished every ``check_every`` steps and refills them, a group of new prompts in one prefill.

        Args:
            prompts, max_new_tokens, temperature, top_p, row_keys: as :meth:`decode`, for any number of prompts;
                they are taken in the order given (pass them sorted by length: a refill's prompts are left-padded to
                its longest).
            prompt_bucket: a refill's prompts are left-padded to a multiple of this many tokens.
            prefill_tokens: most padded prompt tokens per refill (default: no limit beyond ``rows``).
            refill_rows: refill once at least this many rows are free (default ``rows // 16``, at least 1; any
                number once no row is decoding).
            progress: called at each check of the rows (every ``check_every`` steps, where the host reads the device
                anyway) with (prompt indices, their token ids) of the replies collected then (none, often) and the
                tokens chosen so far by the replies still decoding (known on the host: one per step since each
                row's prefill).

        Returns:
            Per prompt, in the given order, its generated token ids (as :meth:`decode`).

        Raises:
            ValueError: an empty prompt, mismatched argument lengths, or a model this cannot run on (see
                :attr:`streams`).
        """
        count = len(prompts)
        if not self.streams:
            raise ValueError("decode_stream needs every attention layer on the fused forward (CUDA with Triton, "
                             "a Llama/Mistral/Qwen2/Qwen3 attention)")
        if len(max_new_tokens) != count or any(len(p) == 0 for p in prompts) or min(max_new_tokens, default=1) < 1:
            raise ValueError("every prompt needs at least one token and a max_new_tokens of at least 1")
        if temperature > 0 and (row_keys is None or len(row_keys) != count):
            raise ValueError("sampling needs one row key per prompt")
        if count == 0:
            return []
        bucket = max(1, prompt_bucket)

        def width_of(lengths: Sequence[int]) -> int:  # at least 2: one token per row would be a decode step
            return max(2, -(-max(lengths) // bucket) * bucket)

        steps = max(max_new_tokens)
        widest = width_of([len(p) for p in prompts])
        length = -(-(widest + steps) // self.length_bucket) * self.length_bucket
        device = self.device
        refills = prefill_tokens if prefill_tokens is not None else self.rows * widest
        tokens = max(refills, self.rows * width_of([len(prompts[0])]))  # the first prefill fills every row
        counted = self._fits.get((length, True))
        if counted is None or (counted[0], length, True) not in self._slots:  # a stream's cache is the largest:
            self._free_slots()                                                # keep no other next to it
        rows = self._count_rows(length, tokens, widest, stream=True)  # beside no cache but its own
        self.last_rows = rows
        slot = self._slot(rows, length, stream=True)
        budget = prefill_tokens if prefill_tokens is not None else rows * widest
        refill_at = max(1, rows // 16) if refill_rows is None else max(1, refill_rows)
        zero = torch.zeros(1, dtype=torch.long, device=device)
        fresh = not all(getattr(layer, "is_initialized", False) for layer in slot.cache.layers)

        out = torch.full((rows, steps + 1), self.pad_token_id, dtype=torch.long, device=device)
        age = torch.zeros(rows, dtype=torch.long, device=device)  # tokens chosen so far for the row's prompt
        limits = torch.ones(rows, dtype=torch.long, device=device)
        done = torch.ones(rows, dtype=torch.bool, device=device)  # a free row counts as finished
        keys = torch.zeros(rows, dtype=torch.long, device=device) if temperature > 0 else None
        write, starts, ends = slot.write, slot.starts, slot.ends
        for buffer in (write, starts, ends, slot.positions):
            buffer.zero_()
        slot.tokens.fill_(self.pad_token_id)
        owner = [-1] * rows  # the prompt each row decodes (-1: free)
        admitted = [0] * rows  # the decode step at which the row's prompt was prefilled (its first token chosen)
        results: list[list[int] | None] = [None] * count
        stops = set(self.stops.tolist())
        queued = 0  # prompts taken so far
        step = 0  # decode steps run
        latest = 0  # the step by which every admitted row has ended (at its limit), known on the host

        def admit(free: list[int]) -> None:
            """Prefill the next prompts into the cache rows ``free`` and choose their first tokens."""
            nonlocal queued, fresh, latest
            take, longest = 0, 0
            while take < min(len(free), count - queued):  # as many as the prefill budget takes, at least one
                wider = max(longest, len(prompts[queued + take]))
                if take and (take + 1) * width_of([wider]) > budget:
                    break
                take, longest = take + 1, wider
            chosen_rows, indices = free[:take], list(range(queued, queued + take))
            latest = max(latest, step + max(max_new_tokens[i] for i in indices) - 1)
            queued += take
            lengths = [len(prompts[i]) for i in indices]
            if fresh:  # the static cache allocates itself in its first update: every row, through the model's own
                chosen_rows = list(range(rows))  # attention forward, from position 0 (filler rows: one pad token)
                lengths += [1] * (rows - take)
            width = width_of(lengths)
            batch = len(chosen_rows)
            input_ids, _, mask, positions = self._prefill_inputs([prompts[i] for i in indices], batch, width,
                                                                 length if fresh else width)
            index = torch.tensor(chosen_rows, dtype=torch.long, device=device)
            if fresh:
                _rewind(slot)
            logits = self._forward(input_ids, mask, positions, slot.cache, write=zero,
                                   cache_rows=None if fresh else index)
            fresh = False
            del mask
            real = torch.tensor(lengths, dtype=torch.long, device=device)
            request_limits = torch.tensor([max_new_tokens[i] for i in indices] + [1] * (batch - take),
                                          dtype=torch.long, device=device)
            request_keys = None
            if keys is not None:
                request_keys = torch.tensor([row_keys[i] for i in indices] + [0] * (batch - take),
                                            dtype=torch.long, device=device)
                keys[index] = request_keys
            first = self._choose(logits, temperature, top_p, request_keys, torch.zeros_like(real))
            filler = torch.arange(batch, device=device) >= take
            first = torch.where(filler, self.pad_token_id, first)
            out[index, 0] = first
            age[index] = 1
            limits[index] = request_limits
            done[index] = filler | torch.isin(first, self.stops) | (request_limits <= 1)
            slot.tokens[index, 0] = first
            slot.positions[index, 0] = real  # the first new token's position id (prompt positions 0..len-1)
            write[index] = width  # ... and its cache position
            starts[index] = (width - real).to(torch.int32)
            for row, prompt in zip(chosen_rows, indices, strict=False):
                owner[row] = prompt
                admitted[row] = step

        def collect() -> list[int]:
            """Store the replies of finished rows; return every free row."""
            finished_rows = [row for row, flag in enumerate(done.tolist()) if flag]
            ready = [row for row in finished_rows if owner[row] >= 0]
            collected: list[int] = []
            if ready:
                index = torch.tensor(ready, dtype=torch.long, device=device)
                token_rows, ages = out[index].cpu().tolist(), age[index].tolist()
                for row, tokens, size in zip(ready, token_rows, ages, strict=True):
                    prompt = owner[row]
                    results[prompt] = _reply(tokens, min(size, max_new_tokens[prompt]), stops)
                    collected.append(prompt)
                    owner[row] = -1
            if progress is not None:  # a row still decoding has chosen a token at every step since its prefill's
                decoding = sum(1 + step - admitted[row] for row in range(rows) if owner[row] >= 0)
                progress(collected, [results[i] for i in collected], decoding)  # type: ignore[misc]
            return finished_rows

        def refill() -> bool:
            """Collect finished rows and admit prompts into free ones; False once nothing is left to decode."""
            while True:
                free = collect()
                if queued < count and (len(free) >= refill_at or len(free) == rows):
                    admit(free)
                    if not bool(done.all()):
                        return True
                    continue  # every admitted row ended at its first token (a stop token, or a limit of 1)
                return len(free) < rows

        use_graph = self.cuda_graphs and not slot.graph_failed
        decoding = refill()
        while decoding:
            torch.where(done, starts, (write + 1).to(torch.int32), out=ends)
            logits, use_graph = self._run_step(slot, use_graph)
            step += 1
            self.row_steps += rows
            active = ~done
            chosen = torch.where(done, self.pad_token_id, self._choose(logits, temperature, top_p, keys, age))
            out.scatter_(1, age[:, None], chosen[:, None])
            age.add_(active)
            done |= active & (torch.isin(chosen, self.stops) | (limits <= age))
            active = ~done
            slot.tokens.copy_(chosen[:, None])
            slot.positions.add_(active[:, None])
            write.add_(active)
            if step % self.check_every == 0 or step >= latest:
                decoding = refill()
        self.last_mode = "graph" if use_graph else "eager"
        self.last_steps = step
        assert all(result is not None for result in results)
        return results  # type: ignore[return-value]

    @staticmethod
    def _choose(logits: torch.Tensor, temperature: float, top_p: float, keys: torch.Tensor | None,
                step: int | torch.Tensor) -> torch.Tensor:
        scores = logits.float()
        if temperature <= 0:
            return scores.argmax(-1)
        assert keys is not None
        scores = scores / temperature
        if top_p < 1.0:
            sorted_scores, order = scores.sort(dim=-1, descending=True)
            mass = sorted_scores.softmax(-1).cumsum(-1)
            drop_sorted = (mass - sorted_scores.softmax(-1)) >= top_p  # mass before this token already reaches top_p
            drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
            scores = scores.masked_fill(drop, float("-inf"))
        return (scores + gumbel_noise(keys, step, scores.shape[-1])).argmax(-1)

    def close(self) -> None:
        """Free the caches and graphs; give the model its previous attention implementation and its modules' own
        forwards back."""
        self._slots.clear()
        restore_forwards(self._compiled + self._fused)
        self._compiled, self._fused = [], []
        if self.model is not None and self._restore_attention is not None:
            self.model.set_attn_implementation(self._restore_attention)
        self._restore_attention = None
        self.model = None
