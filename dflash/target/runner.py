"""Run a target causal LM only as far as its last tapped layer and collect the tapped hidden states.

Tap convention (docs/dflash.md, :data:`dflash.target.taps.LAYER_ID_CONVENTION`): tapped id ``l`` is the OUTPUT of decoder
layer ``l`` (0-based), i.e. transformers' ``hidden_states[l + 1]``; the same offset vLLM ``qwen3_dflash.py`` and
SGLang ``models/dflash.py`` add when they read ``target_layer_ids``.

With ``final_tap`` the forward runs the whole decoder instead, and its output after the final norm (transformers'
``hidden_states[-1]``, the input of the LM head; the LM head itself never runs) becomes one more slot after the
taps: rows are ``(n+1)*H`` wide (``dflash.cache.CacheMetadata.final_tap``).

How the truncation works, without relying on transformers internals that move between releases (5.17 on the
GPU host, 5.24 here): forward hooks on the tapped decoder layers record their outputs, and the hook of the last
tapped layer raises a private exception that ends the forward. Layers after it, the final norm and the LM head
never run. The base model (``model.get_decoder()``) is called with ``use_cache=False``, explicit position ids and NO
attention mask: with right padding and causal attention a real token never attends to the padding on its right,
so its output is exact without a mask, and SDPA keeps its ``is_causal`` flash kernel (an explicit mask forces the
slower memory-efficient/math kernels).

Batching: samples are sorted by length (longest first) and grouped greedily into token-budget batches
(``rows x longest <= token_budget``), right-padded. Under causal attention a real token never sees a padding
token on its right, and position ids are ``0..L-1`` for every row, so a sample's output equals its solo forward
up to kernel rounding (bf16 tolerance), whatever batch it lands in.

Packed batches (``packing=True``): samples are concatenated into one row of at most ``token_budget`` tokens
(first-fit decreasing; a longer sample gets a row of its own), with position ids restarting at 0 for each sample
and no attention mask: transformers reads the restarts as its packed-sequence format
(``masking_utils.find_packed_sequence_indices``) and confines attention to each sample. Which kernel does that is
``packed_attention``: ``"flex_attention"`` builds a document ``BlockMask``, so FlexAttention skips
every block outside a sample's causal triangle; the row is filled up to ``token_budget`` with a padding "sample"
of its own (its outputs are dropped) so that the compiled kernel sees one shape. ``"sdpa"`` gets a materialized
block-diagonal causal mask (SDPA's masked kernels: half the speed of the ``is_causal`` flash kernel on an H200,
docs/benchmarks.md). ``"varlen"`` (CUDA only) calls torch's FlashAttention varlen kernel
(``torch.nn.attention.varlen.varlen_attn``, torch >= 2.10) with each sample's start in ``cu_seq_lens``: the
row holds exactly the real tokens (no fill, no compile), every sample attends causally to itself only (where
that kernel has no native grouped-query attention, torch 2.10-2.11, a GQA target's samples of
:data:`VARLEN_SOLO_MIN_LENGTH` tokens or more run alone through SDPA's ``is_causal`` kernel instead). It is
registered as the transformers attention implementation :data:`VARLEN_IMPLEMENTATION` (``AttentionInterface``;
transformers then builds no mask) and gets the sample boundaries as transformers' ``FlashAttentionKwargs``
(``cu_seq_lens_q``/``cu_seq_lens_k``, ``max_length_q``/``max_length_k``) through the decoder's ``**kwargs``. The runner switches the model to that implementation (``set_attn_implementation``) for the
packed forward only and back afterwards, so a model may be shared with a padded runner. A sample's output again
equals its solo forward within bf16 tolerance, whatever it is packed with. ``"auto"`` (the default) is ``"varlen"``
on CUDA where torch has it, else ``"flex_attention"`` on CUDA and ``"sdpa"`` on CPU (:func:`resolve_packed_attention`):
on an H200, Qwen3-8B shape, varlen ran a long-tailed corpus at 1.13x FlexAttention and fixed 2,048-token rows at
0.99x, in one run, and with the split of long samples (:data:`VARLEN_SOLO_MIN_LENGTH`) a long-tailed corpus at
1.04x of padded batches (docs/benchmarks.md). What packing saves is the padding of
length-grouped batches (long-tailed corpora); ``benchmarks/extract.py --compare-packing`` measures both.

On CUDA the taps are copied on a side stream (non-blocking, ordered by an event) into pinned host buffers that
are allocated once and reused: a consumer hands a batch's buffer back with :meth:`RunnerBatch.release` once it no
longer needs ``hidden`` (a batch never released is simply garbage-collected and a new buffer is allocated).
``iter_batches`` queues the next batch's forward before it waits for the previous batch's copy. A caller that has
its own host memory for the results (the online producer: the ring slot itself) passes ``out``, one ``[L, n*H]``
view per sample, and each sample's real tokens are copied straight there (on CUDA, on the same side stream: pinned
``out`` memory keeps the copies asynchronous); no pooled buffer is used then.
Shapes: b = rows in a batch, P = padded length, L = one sample's length, n = number of taps, H = target hidden size.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dflash.errors import ConfigError, TargetError
from dflash.target.forwards import is_mlp_or_norm, own_forward, replace_forwards, restore_forwards
from dflash.target.load import PACKED_ATTENTION
from dflash.target.taps import LAYER_ID_CONVENTION, validate_target_layer_ids

__all__ = ["TargetRunner", "RunnerBatch", "PendingBatch", "plan_batches", "plan_packed_batches", "find_decoder_layers",
           "resolve_packed_attention",
           "PACKED_ATTENTION", "VARLEN_IMPLEMENTATION"]

log = logging.getLogger(__name__)


#: The transformers attention implementation name under which ``packed_attention="varlen"`` is registered (no
#: "flash" in it: transformers treats any such name as a flash-attn package to import).
VARLEN_IMPLEMENTATION = "torch_varlen"


@functools.cache
def _varlen_parameters() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _flash_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_lens: torch.Tensor,
                  max_length: int, scale: float) -> torch.Tensor:  # fmt: skip
    """Causal attention of each sample to itself: ``query [T, Hq, D]``, ``key``/``value`` ``[T, Hkv, D]`` (``Hq`` a
    multiple of ``Hkv``), ``cu_seq_lens [N+1]`` int32 sample starts, ``max_length`` the longest sample. Returns
    ``[T, Hq, D]``. Calls ``torch.nn.attention.varlen.varlen_attn`` under either signature torch has shipped
    (2.10-2.11: ``is_causal``, equal head counts; later: ``window_size``, ``enable_gqa``, ``scale``)."""
    from torch.nn.attention.varlen import varlen_attn

    parameters = _varlen_parameters()
    kwargs: dict[str, Any] = {}
    if key.shape[1] != query.shape[1]:
        if "enable_gqa" in parameters:
            kwargs["enable_gqa"] = True
        else:  # grouped-query attention by repeating each key/value head for its query heads
            groups = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    if "window_size" in parameters:
        kwargs["window_size"] = (-1, 0)  # causal
    else:
        kwargs["is_causal"] = True
    default_scale = query.shape[-1] ** -0.5
    if "scale" in parameters:
        kwargs["scale"] = scale
    elif abs(scale - default_scale) > 1e-12 * default_scale:
        query = query * (scale / default_scale)
    return varlen_attn(query, key, value, cu_seq_lens, cu_seq_lens, max_length, max_length, **kwargs)


#: Packed varlen rows on a grouped-query target whose varlen kernel has no native GQA (torch 2.10-2.11): samples of
#: at least this many tokens run one by one through SDPA with ``is_causal=True, enable_gqa=True`` (whatever kernel
#: SDPA picks for it, as for padded batches; on an H200 with torch 2.11 not FlashAttention, which is slower there:
#: docs/benchmarks.md), no repeated key/value heads; the shorter ones together through the varlen kernel. On an H200
#: (Qwen3-8B shape, torch 2.11) the varlen kernel with repeated heads ran fixed 2,048-token rows at 0.977x of SDPA's,
#: and with this split a long-tailed corpus ran at 0.988-0.989x the fixed-row rate against 0.938x without it (two
#: machines). 1,024 is the only threshold measured; short samples stay in one varlen call because one call per
#: sample would launch many small kernels (below ~512 tokens one sample's 32 heads x 128-token blocks no longer
#: fill the GPU's 132 SMs).
VARLEN_SOLO_MIN_LENGTH = 1024

#: The attention kwarg through which the runner hands ``(solo_min_length, sample lengths)`` (host ints) of a packed
#: row to :func:`_varlen_attention_forward`, so that it can split the row without reading ``cu_seq_lens`` back from
#: the GPU (a synchronization per layer).
VARLEN_SPLIT_KWARG = "dflash_varlen_split"


def _solo_min_length(requested: int | None, num_query_heads: int, num_kv_heads: int) -> int | None:
    """The sample length from which a packed varlen row's samples run alone through SDPA (``requested``, the
    runner's ``varlen_solo_min_length``), or ``None`` (every sample through the varlen kernel) where it is ``None``
    or the varlen kernel needs no repeated heads: equal head counts, or a torch whose ``varlen_attn`` takes
    ``enable_gqa``."""
    if requested is None or num_query_heads == num_kv_heads or "enable_gqa" in _varlen_parameters():
        return None
    return requested


def _packed_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_lens: torch.Tensor,
                             lengths: Sequence[int], scale: float, solo_min_length: int) -> torch.Tensor:  # fmt: skip
    """Causal attention of each sample of one packed row to itself, the long samples through SDPA alone and each
    run of consecutive short samples through one varlen call (:data:`VARLEN_SOLO_MIN_LENGTH`).

    Args:
        query: ``[1, Hq, T, D]`` (transformers' layout), ``key``/``value`` ``[1, Hkv, T, D]``, ``Hq`` a multiple of
            ``Hkv``.
        cu_seq_lens: int32 ``[N+1]`` sample starts, on the device.
        lengths: the N sample lengths on the host (they sum to ``T``).
        scale: the softmax scale.
        solo_min_length: samples of at least this many tokens run alone through SDPA.

    Returns:
        ``[T, Hq, D]``, the same values as :func:`_flash_varlen` over the whole row up to kernel rounding.
    """
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])
    ends = np.cumsum([0, *lengths]).tolist()
    first = 0  # the first sample of the current run of short samples
    for sample in range(len(lengths) + 1):
        if sample < len(lengths) and lengths[sample] < solo_min_length:
            continue
        if first < sample:  # samples first..sample-1: short, consecutive, one varlen call on their slice of the row
            start, stop = ends[first], ends[sample]
            starts = cu_seq_lens[first : sample + 1] - start
            out[start:stop] = _flash_varlen(*(t[0, :, start:stop].transpose(0, 1) for t in (query, key, value)),
                                            starts, max(lengths[first:sample]), scale)  # fmt: skip
        if sample < len(lengths):  # a long sample alone: SDPA's causal attention, native GQA
            start, stop = ends[sample], ends[sample + 1]
            solo = torch.nn.functional.scaled_dot_product_attention(
                query[:, :, start:stop], key[:, :, start:stop], value[:, :, start:stop], is_causal=True, scale=scale,
                enable_gqa=True)  # [1, Hq, L, D]
            out[start:stop] = solo[0].transpose(0, 1)
        first = sample + 1
    return out


def _varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                              **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
    """The transformers attention function of :data:`VARLEN_IMPLEMENTATION`: ``query [1, Hq, T, D]``,
    ``key``/``value`` ``[1, Hkv, T, D]`` of one packed row, the sample starts in ``kwargs["cu_seq_lens_q"]``.
    Returns ``([1, T, Hq, D], None)`` like transformers' own attention functions. With ``(solo_min_length,
    sample lengths)`` on the host in ``kwargs[VARLEN_SPLIT_KWARG]`` (the runner passes them) and a varlen kernel
    without native GQA (:func:`_solo_min_length`), samples of at least ``solo_min_length`` tokens run alone through
    SDPA (:func:`_packed_causal_attention`).

    Raises:
        TargetError: called without ``cu_seq_lens_q``/``max_length_q`` or on more than one row (only the runner's
            packed forward passes them).
    """
    del attention_mask, dropout  # causal within each sample; inference only
    cu_seq_lens, max_length = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu_seq_lens is None or max_length is None or query.shape[0] != 1:
        raise TargetError(f"attention implementation {VARLEN_IMPLEMENTATION!r} needs one packed row with "
                          "cu_seq_lens_q and max_length_q (TargetRunner's packed forward passes them; a model whose "
                          "decoder drops its attention kwargs cannot use it: packed_attention=flex_attention)")
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    requested, lengths = kwargs.get(VARLEN_SPLIT_KWARG, (None, ()))
    solo_min_length = _solo_min_length(requested, query.shape[1], key.shape[1])
    if solo_min_length is not None and max(lengths) >= solo_min_length:
        return _packed_causal_attention(query, key, value, cu_seq_lens, lengths, scale, solo_min_length)[None], None
    out = _flash_varlen(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu_seq_lens,
                        int(max_length), scale)  # fmt: skip
    return out[None], None


def _varlen_import_error() -> ImportError | None:
    """Why this torch has no FlashAttention varlen kernel (``torch.nn.attention.varlen``, torch >= 2.10); ``None``
    when it has one."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError as error:
        return error
    return None


def resolve_packed_attention(packed_attention: str, device: str | torch.device) -> str:
    """The packed-attention kernel a runner on ``device`` uses for ``packed_attention`` (one of
    :data:`PACKED_ATTENTION`): ``"auto"`` gives ``"varlen"`` on CUDA where this torch has
    ``torch.nn.attention.varlen`` (torch >= 2.10), ``"flex_attention"`` on CUDA without it, and ``"sdpa"`` off CUDA
    (on 2 CPU cores, SmolLM2, 1,263 tokens: extract took 4.5 s with sdpa, 271.5 s with flex_attention, whose
    compiled mask and kernel dominate there); any other name is returned as it is.

    Raises:
        ConfigError: ``packed_attention`` is not one of :data:`PACKED_ATTENTION`.
    """
    if packed_attention not in PACKED_ATTENTION:
        raise ConfigError(f"packed_attention must be one of {', '.join(PACKED_ATTENTION)}, got {packed_attention!r}")
    if packed_attention != "auto":
        return packed_attention
    if torch.device(device).type != "cuda":
        return "sdpa"
    return "varlen" if _varlen_import_error() is None else "flex_attention"


def _check_varlen(device: torch.device) -> None:
    """Refuse ``packed_attention="varlen"`` where it cannot run (ConfigError naming the fix); register it with
    transformers otherwise."""
    error = _varlen_import_error()
    if error is not None:
        raise ConfigError(f"packed_attention=varlen needs torch.nn.attention.varlen (torch >= 2.10), which torch "
                          f"{torch.__version__} lacks ({error}); use packed_attention=flex_attention") from error
    if device.type != "cuda":
        raise ConfigError(f"packed_attention=varlen runs FlashAttention, CUDA only (the runner is on {device}); "
                          "use packed_attention=flex_attention or sdpa")
    _register_varlen()


def _register_varlen() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_IMPLEMENTATION, _varlen_attention_forward)


class _StopForward(Exception):
    """Raised by the hook of the last tapped layer to end the forward early (never escapes the runner)."""


def find_decoder_layers(model: Any) -> tuple[torch.nn.Module, torch.nn.ModuleList]:
    """The base decoder (embeddings + layers + final norm, no LM head) of a causal LM and its decoder layers.

    Works for the transformers decoder-only families (Llama, Qwen2/3, Mistral, Gemma...): ``get_decoder()`` or
    ``base_model`` holding a ``layers`` ModuleList of ``config.num_hidden_layers`` entries.

    Raises:
        TargetError: no such list is found (the model's class is named in the message).
    """
    candidates = []
    if hasattr(model, "get_decoder"):
        candidates.append(model.get_decoder())
    candidates += [getattr(model, "base_model", None), getattr(model, "model", None), model]
    num_layers = _text_config(model).num_hidden_layers
    for candidate in candidates:
        layers = getattr(candidate, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) == num_layers:
            return candidate, layers
    raise TargetError(
        f"cannot find the {num_layers} decoder layers of {type(model).__name__} (looked for a `layers` ModuleList on "
        "get_decoder(), base_model and model); the target must be a transformers decoder-only causal LM"
    )


def _text_config(model: Any) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _checked_lengths(lengths: Sequence[int] | np.ndarray, token_budget: int) -> np.ndarray:
    """``lengths`` as int64, after the checks both batch planners share (see their ``Raises``)."""
    if token_budget < 1:
        raise ConfigError(f"token_budget must be >= 1, got {token_budget}")
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and lengths.min() < 1:
        raise ConfigError(f"sample {int(np.argmin(lengths))} is empty; every sample needs at least one token")
    return lengths


def plan_batches(lengths: Sequence[int] | np.ndarray, token_budget: int) -> list[np.ndarray]:
    """Group samples into right-padded batches of at most ``token_budget`` padded tokens, longest first.

    Args:
        lengths: per-sample token counts (int, > 0).
        token_budget: maximum ``rows x padded length`` of a batch; a sample longer than the budget gets a batch
            of its own.

    Returns:
        Index arrays (int64) into ``lengths``, one per batch, each sorted by decreasing length (stable), so
        padding waste stays small.

    Raises:
        ConfigError: ``token_budget < 1`` or an empty sample.
    """
    lengths = _checked_lengths(lengths, token_budget)
    order = np.argsort(-lengths, kind="stable")
    batches: list[np.ndarray] = []
    start = 0
    while start < len(order):
        longest = int(lengths[order[start]])
        rows = max(1, token_budget // longest)
        batches.append(order[start : start + rows])
        start += rows
    return batches


def plan_packed_batches(lengths: Sequence[int] | np.ndarray, token_budget: int) -> list[np.ndarray]:
    """Group samples into packed rows of at most ``token_budget`` tokens (first-fit decreasing: longest first,
    each into the first row it fits).

    Args:
        lengths: per-sample token counts (int, > 0).
        token_budget: most tokens of one packed row; a longer sample gets a row of its own.

    Returns:
        Index arrays (int64) into ``lengths``, one per row, in the order the samples were placed (longest first).

    Raises:
        ConfigError: ``token_budget < 1`` or an empty sample.
    """
    lengths = _checked_lengths(lengths, token_budget)
    rows: list[list[int]] = []
    room: list[int] = []
    for index in np.argsort(-lengths, kind="stable").tolist():
        length = int(lengths[index])
        target = next((row for row, free in enumerate(room) if free >= length), None)
        if target is None:
            rows.append([index])
            room.append(token_budget - length)
        else:
            rows[target].append(index)
            room[target] -= length
    return [np.asarray(row, dtype=np.int64) for row in rows]


@dataclass(slots=True)
class RunnerBatch:
    """One finished batch of :meth:`TargetRunner.iter_batches`.

    Fields:
        indices: positions of the batch's samples in the input list.
        hidden: per sample, ``Tensor[L, n*H]`` bfloat16 on CPU (taps concatenated in ``target_layer_ids`` order).
        nonfinite_layers: per sample, the tapped layer ids whose output holds a NaN or +-inf (empty if none); the
            final tap is named by the last layer's id.
        num_tokens: real (unpadded) tokens in the batch.
        num_padded_tokens: ``rows x padded length``.
    """

    indices: list[int]
    hidden: list[torch.Tensor]
    nonfinite_layers: list[list[int]]
    num_tokens: int
    num_padded_tokens: int
    _release: Any = None

    def release(self) -> None:
        """Give the batch's pinned host buffer back to the runner for reuse; ``hidden`` must not be read after.

        Idempotent; a no-op on CPU runs."""
        release, self._release = self._release, None
        if release is not None:
            self.hidden = []
            release()


class PendingBatch:
    """A batch of :meth:`TargetRunner.iter_pending` whose forward (and copy to host) is queued on the device.

    Fields:
        last: no batch of the same call is queued behind this one.
        num_padded_tokens: ``rows x padded length`` of the batch (known before it finishes).

    :meth:`finish` waits for the copy and returns the :class:`RunnerBatch` (idempotent; any thread may call it,
    before or after the iteration went on). Holding the last batch unfinished lets a caller queue more device
    work (the next shard's first forward) before it waits.
    """

    __slots__ = ("last", "num_padded_tokens", "_finish", "_flight", "_result")

    def __init__(self, finish: Any, flight: _InFlight, last: bool) -> None:
        self._finish, self._flight, self.last = finish, flight, last
        self.num_padded_tokens = int(flight.padded)
        self._result: RunnerBatch | None = None

    def finish(self) -> RunnerBatch:
        if self._result is None:
            self._result = self._finish(self._flight)
            self._flight = None
        return self._result


@dataclass(slots=True)
class _InFlight:
    indices: list[int]
    lengths: list[int]
    host: torch.Tensor | None  # [b, P, n*H] bf16 (pinned on CUDA); None with ``views``
    nonfinite: torch.Tensor  # [b, n] bool
    event: Any = None
    padded: int = 0
    buffer: torch.Tensor | None = None  # the pooled pinned buffer ``host`` is a view of
    offsets: list[int] | None = None  # packed: each sample's first token in the single row ``host[0]``
    views: list[torch.Tensor] | None = None  # with ``out``: each sample's hidden states, already in the caller's memory


class TargetRunner:
    """Tapped hidden states of a target causal LM, stopping after the last tapped layer.

    Args:
        model: a loaded transformers causal LM (``AutoModelForCausalLM``), eval mode; bf16 on GPU.
        target_layer_ids: tapped decoder layers (0-based, strictly increasing, never the last layer).
        device: where the forward runs (default: the model's device). The model is moved there.
        token_budget: padded tokens per forward batch (``rows x longest``).
        pad_token_id: id written into padding positions (never seen by real tokens).
        packing: packed batches instead of right-padded ones (module docstring).
        packed_attention: the attention implementation of packed forwards, one of :data:`PACKED_ATTENTION`
            (module docstring; ``"auto"``: :func:`resolve_packed_attention`); ignored without ``packing``. The
            attribute ``packed_attention`` holds the kernel resolved for ``device``.
        shared_host_buffers: allocate the reusable host buffers in POSIX shared memory (pinned on CUDA), so that
            write processes read the hidden states without a copy (:mod:`dflash.io.shm`, read by :mod:`dflash.cache.process_writer`); call
            :meth:`close` to free them.
        final_tap: also collect the final normed hidden state, as one more slot after the taps (module docstring).
        compile_parts: while the runner is open (until :meth:`close`), the target's MLP and RMSNorm modules run
            through ``torch.compile`` with shape-generic graphs (``dynamic=True``), which fuses their elementwise
            kernels: a small target's forward is ~1,500 operations issued one by one. Off by default
            (``benchmarks/extract.py --compare-compile-parts`` measures it).
        compile_backend: the ``torch.compile`` backend of ``compile_parts`` (``"inductor"``; tests use ``"eager"``).
        varlen_solo_min_length: packed ``varlen`` rows of a grouped-query target on a varlen kernel without native
            GQA (torch 2.10-2.11): samples of at least this many tokens run alone through SDPA's causal attention
            (``enable_gqa``), the rest through the varlen kernel (:data:`VARLEN_SOLO_MIN_LENGTH`); ``None``: every sample
            through the varlen kernel.

    Raises:
        TargetError: the model has no recognisable decoder layers, or a layer id is out of range.
        ConfigError: ``token_budget < 1`` or ``varlen_solo_min_length < 1``; an unknown ``packed_attention``, or ``flex_attention`` where this
            torch has no FlexAttention; ``varlen`` off CUDA or where this torch has no ``torch.nn.attention.varlen``.

    Source: tap offset as in vLLM ``qwen3_dflash.py`` / SGLang ``models/dflash.py`` (``hidden_states[l + 1]``).
    """

    layer_id_convention = LAYER_ID_CONVENTION

    def __init__(
        self,
        model: Any,
        target_layer_ids: Sequence[int],
        device: str | torch.device | None = None,
        *,
        token_budget: int = 16384,
        pad_token_id: int = 0,
        shared_host_buffers: bool = False,
        packing: bool = False,
        packed_attention: str = PACKED_ATTENTION[0],
        varlen_solo_min_length: int | None = VARLEN_SOLO_MIN_LENGTH,
        final_tap: bool = False,
        compile_parts: bool = False,
        compile_backend: str = "inductor",
    ) -> None:
        if token_budget < 1:
            raise ConfigError(f"token_budget must be >= 1, got {token_budget}")
        if varlen_solo_min_length is not None and varlen_solo_min_length < 1:
            raise ConfigError(f"varlen_solo_min_length must be >= 1 or None, got {varlen_solo_min_length}")
        self.varlen_solo_min_length = varlen_solo_min_length
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        packed_attention = resolve_packed_attention(packed_attention, self.device)
        if packing and packed_attention == "flex_attention":
            try:
                from torch.nn.attention import flex_attention  # noqa: F401  (torch >= 2.5)
            except ImportError as error:
                raise ConfigError(f"packed_attention=flex_attention needs FlexAttention, which this torch "
                                  f"{torch.__version__} lacks ({error}); use packed_attention=sdpa") from error
        config = _text_config(model)
        self.model = model
        self.num_target_layers = int(config.num_hidden_layers)
        self.hidden_size = int(config.hidden_size)
        self.target_layer_ids = validate_target_layer_ids(list(target_layer_ids), self.num_target_layers)
        self.final_tap = bool(final_tap)
        self.token_budget = int(token_budget)
        self.pad_token_id = int(pad_token_id)
        self.packing = bool(packing)
        self.packed_attention = packed_attention
        # The transformers attention implementation of packed forwards.
        self._packed_implementation = VARLEN_IMPLEMENTATION if packed_attention == "varlen" else packed_attention
        if self.packing and packed_attention == "varlen":
            _check_varlen(self.device)
        self._decoder, self._layers = find_decoder_layers(model)
        model.to(self.device)
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # Released pinned host buffers (flat bf16), reused by later batches; list append/pop are atomic under the
        # GIL, so a writer thread may release while the compute thread acquires.
        self._free_buffers: list[torch.Tensor] = []
        # With shared_host_buffers the host buffers are POSIX shared memory (pinned on CUDA), also on CPU, so that
        # write processes can read the hidden states without a copy (dflash.cache.process_writer).
        self.shared_host_buffers = bool(shared_host_buffers)
        self._shared: list[Any] = []
        #: The modules whose forward runs compiled until :meth:`close` (``compile_parts``).
        self._compiled: list[torch.nn.Module] = []
        if compile_parts:
            compiled = torch.compile(own_forward, dynamic=True, backend=compile_backend)
            self._compiled = replace_forwards(self._decoder, is_mlp_or_norm,
                                              lambda module: functools.partial(compiled, module))

    def _acquire_host_buffer(self, numel: int) -> torch.Tensor:
        """A pinned flat bf16 buffer of at least ``numel`` elements: a released one if big enough, else a new one
        of at least ``token_budget x feature_size`` (so one size serves every budget-sized batch)."""
        for position in range(len(self._free_buffers) - 1, -1, -1):
            try:
                buffer = self._free_buffers[position]
            except IndexError:
                continue
            if buffer.numel() >= numel:
                del self._free_buffers[position]
                return buffer
        size = max(numel, self.token_budget * self.feature_size)
        if self.shared_host_buffers:
            from dflash.io.shm import SharedHostBuffer, SharedMemoryFull

            try:
                shared = SharedHostBuffer(size, pin=self.device.type == "cuda")
            except SharedMemoryFull as error:  # private buffers from now on; their shards are written in threads
                log.warning("%s: using private host buffers from now on", error)
                self.shared_host_buffers = False
            else:
                self._shared.append(shared)
                return shared.tensor
        return torch.empty(size, dtype=torch.bfloat16, pin_memory=self.device.type == "cuda")

    def use_shared_host_buffers(self) -> None:
        """From now on allocate host buffers in shared memory (see ``shared_host_buffers``); released private
        buffers are dropped so that every later batch lands in shared memory."""
        self.shared_host_buffers = True
        self._free_buffers.clear()

    def close(self) -> None:
        """Free the shared host buffers (no batch of this runner may be in use any more) and give compiled modules
        their own forward back. Idempotent."""
        restore_forwards(self._compiled)
        self._compiled.clear()
        self._free_buffers.clear()
        for shared in self._shared:
            shared.close()
        self._shared.clear()

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def num_slots(self) -> int:
        """Slots of H values per token: the taps, plus the final normed hidden state with ``final_tap``."""
        return self.num_taps + int(self.final_tap)

    @property
    def slot_layer_ids(self) -> list[int]:
        """The layer id naming each slot (the final tap: the last layer's)."""
        return self.target_layer_ids + ([self.num_target_layers - 1] if self.final_tap else [])

    @property
    def feature_size(self) -> int:
        """``num_slots * H``: width of one token's concatenated taps (and final tap)."""
        return self.num_slots * self.hidden_size

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                position_ids: torch.Tensor | None = None,
                attention_kwargs: dict[str, Any] | None = None) -> torch.Tensor:  # fmt: skip
        """Tapped hidden states of a right-padded (or packed) batch, left on the device.

        Args:
            input_ids: ``Tensor[b, P]`` int64 on ``self.device``.
            attention_mask: accepted for callers that have one (``Tensor[b, P]``, 1 = real token) and ignored: the
                batch must be RIGHT-padded, so causal attention alone keeps real tokens exact (module docstring).
            position_ids: ``Tensor[b, P]`` int64; default ``0..P-1`` per row. Restarting at 0 inside a row packs
                samples (module docstring).
            attention_kwargs: extra keyword arguments of the decoder forward, which transformers hands to the
                attention function (packed ``varlen``: ``cu_seq_lens_q``/``cu_seq_lens_k`` int32 ``[N+1]`` on the
                device, ``max_length_q``/``max_length_k`` ints).

        Returns:
            ``Tensor[b, P, n*H]`` bfloat16 on the device (``[b, P, (n+1)*H]`` with ``final_tap``, the final normed
            hidden state last); padding positions hold unspecified values.
        """
        del attention_mask  # right padding + causal attention: no mask needed, SDPA takes its is_causal kernel
        captured: list[torch.Tensor | None] = [None] * self.num_taps
        last_slot = -1 if self.final_tap else self.num_taps - 1  # with the final tap the whole decoder runs

        def make_hook(slot: int):
            def hook(module, args, output):
                captured[slot] = output[0] if isinstance(output, tuple) else output
                if slot == last_slot:
                    raise _StopForward

            return hook

        handles = [
            self._layers[layer_id].register_forward_hook(make_hook(slot))
            for slot, layer_id in enumerate(self.target_layer_ids)
        ]
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
        previous = None
        if self.packing:  # the packed kernel for this forward only (module docstring)
            previous = getattr(self.model.config, "_attn_implementation", None)
            if previous != self._packed_implementation:
                self.model.set_attn_implementation(self._packed_implementation)
        try:
            with torch.inference_mode():
                output = self._decoder(input_ids=input_ids, attention_mask=None, position_ids=position_ids,
                                       use_cache=False, **(attention_kwargs or {}))  # fmt: skip
            if self.final_tap:  # the decoder's output: after the final norm, what its LM head reads
                captured.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)
        except _StopForward:
            pass
        finally:
            for handle in handles:
                handle.remove()
            if previous is not None and previous != self._packed_implementation:
                self.model.set_attn_implementation(previous)
        if any(tap is None for tap in captured):
            raise TargetError(
                f"the forward of {type(self.model).__name__} did not run every tapped layer {self.target_layer_ids}; "
                "the model's decoder layers are not called in order"
            )
        with torch.inference_mode():
            return torch.cat([tap.to(torch.bfloat16) for tap in captured], dim=-1)

    def _launch(self, input_ids_list: Sequence[Any], indices: np.ndarray,
                out: Sequence[torch.Tensor] | None = None) -> _InFlight:  # fmt: skip
        lengths = [len(input_ids_list[i]) for i in indices]
        on_cuda = self.device.type == "cuda"
        offsets = None
        if self.packing:  # one row: the samples back to back, positions restarting per sample
            offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
            real_tokens = sum(lengths)
            # FlexAttention is compiled: fill the row to the budget (one shape) with a padding sample of its own.
            fill = max(0, self.token_budget - real_tokens) if self.packed_attention == "flex_attention" else 0
            rows, padded_length = 1, real_tokens + fill
            pieces = [torch.as_tensor(np.asarray(input_ids_list[i]), dtype=torch.int64) for i in indices]
            tokens = torch.cat([*pieces, torch.full((fill,), self.pad_token_id, dtype=torch.int64)])[None]
            positions = torch.cat([torch.arange(length) for length in [*lengths, fill]])[None]
            owner = torch.repeat_interleave(torch.arange(len(lengths)), torch.as_tensor(lengths))  # [T] sample of token
            if on_cuda:
                tokens, positions, owner = tokens.pin_memory(), positions.pin_memory(), owner.pin_memory()
            attention_kwargs = None
            if self.packed_attention == "varlen":  # the sample boundaries, as transformers' FlashAttentionKwargs
                cu_seq_lens = torch.as_tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
                if on_cuda:
                    cu_seq_lens = cu_seq_lens.pin_memory()
                cu_seq_lens = cu_seq_lens.to(self.device, non_blocking=True)
                attention_kwargs = {"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens,
                                    "max_length_q": max(lengths), "max_length_k": max(lengths),
                                    VARLEN_SPLIT_KWARG: (self.varlen_solo_min_length, tuple(lengths))}  # fmt: skip
            tokens = tokens.to(self.device, non_blocking=True)
            positions = positions.to(self.device, non_blocking=True)
            owner = owner.to(self.device, non_blocking=True)
            hidden = self.forward(tokens, position_ids=positions, attention_kwargs=attention_kwargs)  # [1, T, n*H]
            with torch.inference_mode():  # [T, n] -> per sample [D, n]
                bad = ~torch.isfinite(hidden[0, :real_tokens].view(real_tokens, self.num_slots, self.hidden_size)).all(-1)
                nonfinite = torch.zeros(len(lengths), self.num_slots, dtype=torch.int32, device=self.device)
                nonfinite = nonfinite.index_add_(0, owner, bad.to(torch.int32)) > 0
        else:
            padded_length = max(lengths)
            rows = len(indices)
            tokens = torch.full((rows, padded_length), self.pad_token_id, dtype=torch.int64)
            for row, index in enumerate(indices):
                tokens[row, : lengths[row]] = torch.as_tensor(np.asarray(input_ids_list[index]), dtype=torch.int64)
            real = torch.arange(padded_length)[None, :] < torch.as_tensor(lengths)[:, None]  # [b, P] bool, real tokens
            if on_cuda:  # pinned sources: the non-blocking copies below never stall on the previous batch
                tokens, real = tokens.pin_memory(), real.pin_memory()
            tokens = tokens.to(self.device, non_blocking=True)
            real = real.to(self.device, non_blocking=True)
            hidden = self.forward(tokens)  # [b, P, n*H]
            with torch.inference_mode():
                # Non-finite check on the stored (bf16) values, real tokens only: [b, P, n] -> [b, n].
                finite = torch.isfinite(hidden.view(rows, padded_length, self.num_slots, self.hidden_size)).all(-1)
                nonfinite = (~finite & real[:, :, None]).any(1)
        if out is not None:
            return self._copy_out(hidden, nonfinite, indices, lengths, offsets, out, padded=rows * padded_length)
        if not on_cuda and not self.shared_host_buffers:
            return _InFlight(list(map(int, indices)), lengths, hidden, nonfinite, padded=rows * padded_length,
                             offsets=offsets)  # fmt: skip
        buffer = self._acquire_host_buffer(hidden.numel())
        if not on_cuda:  # CPU with shared host buffers: a plain copy into the shared memory
            host = buffer[: hidden.numel()].view(hidden.shape)
            host.copy_(hidden)
            return _InFlight(list(map(int, indices)), lengths, host, nonfinite, padded=rows * padded_length,
                             buffer=buffer, offsets=offsets)  # fmt: skip
        host = buffer[: hidden.numel()].view(hidden.shape)
        host_flags = torch.empty(nonfinite.shape, dtype=torch.bool, pin_memory=True)
        assert self._copy_stream is not None
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            host.copy_(hidden, non_blocking=True)
            host_flags.copy_(nonfinite, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        # The device buffers must outlive the copy issued on the side stream.
        hidden.record_stream(self._copy_stream)
        nonfinite.record_stream(self._copy_stream)
        return _InFlight(
            list(map(int, indices)), lengths, host, host_flags, event, padded=rows * padded_length, buffer=buffer,
            offsets=offsets,
        )

    def _copy_out(self, hidden: torch.Tensor, nonfinite: torch.Tensor, indices: np.ndarray, lengths: list[int],
                  offsets: list[int] | None, out: Sequence[torch.Tensor], *, padded: int) -> _InFlight:  # fmt: skip
        """Copy each sample's real tokens of ``hidden`` (``[b, P, n*H]`` on the device) into ``out[index]`` (on CUDA
        on the side stream, non-blocking, ordered by an event)."""
        targets = [out[int(index)] for index in indices]
        for target, length in zip(targets, lengths, strict=True):
            if tuple(target.shape) != (length, self.feature_size) or target.device.type != "cpu":
                raise ValueError(f"out: expected a CPU tensor of shape ({length}, {self.feature_size}), got "
                                 f"{tuple(target.shape)} on {target.device}")
        sources = ([hidden[row, :length] for row, length in enumerate(lengths)] if offsets is None
                   else [hidden[0, start : start + length] for start, length in zip(offsets, lengths, strict=True)])
        if self.device.type != "cuda":
            for target, source in zip(targets, sources, strict=True):
                target.copy_(source)
            return _InFlight(list(map(int, indices)), lengths, None, nonfinite, padded=padded, views=targets)
        host_flags = torch.empty(nonfinite.shape, dtype=torch.bool, pin_memory=True)
        assert self._copy_stream is not None
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            for target, source in zip(targets, sources, strict=True):
                target.copy_(source, non_blocking=True)
            host_flags.copy_(nonfinite, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        hidden.record_stream(self._copy_stream)  # the device buffers must outlive the copies on the side stream
        nonfinite.record_stream(self._copy_stream)
        return _InFlight(list(map(int, indices)), lengths, None, host_flags, event, padded=padded, views=targets)

    def _finish(self, flight: _InFlight) -> RunnerBatch:
        if flight.event is not None:
            flight.event.synchronize()
        flags = flight.nonfinite.tolist()
        return RunnerBatch(
            indices=flight.indices,
            hidden=flight.views if flight.views is not None
            else [flight.host[row, :length] for row, length in enumerate(flight.lengths)] if flight.offsets is None
            else [flight.host[0, start : start + length] for start, length in zip(flight.offsets, flight.lengths,
                                                                                  strict=True)],  # fmt: skip
            nonfinite_layers=[
                [layer_id for layer_id, bad in zip(self.slot_layer_ids, row_flags, strict=True) if bad]
                for row_flags in flags
            ],
            num_tokens=sum(flight.lengths),
            num_padded_tokens=flight.padded,
            _release=None if flight.buffer is None else (lambda buffer=flight.buffer: self._free_buffers.append(buffer)),
        )

    def iter_batches(self, input_ids_list: Sequence[Any],
                     out: Sequence[torch.Tensor] | None = None) -> Iterator[RunnerBatch]:  # fmt: skip
        """Run every sample; yield finished batches (longest first), one batch kept in flight on the device.

        Args:
            input_ids_list: per sample, a 1-D int sequence (numpy int32/int64 array, list or tensor), length >= 1.
            out: optional, per sample, a CPU ``Tensor[L_i, n*H]`` (any dtype the bf16 results convert to) that
                receives its hidden states (module docstring); pinned memory keeps CUDA copies asynchronous.

        Yields:
            :class:`RunnerBatch`; ``hidden[i]`` is ``Tensor[L_i, n*H]`` bf16 on CPU (a view into the batch's
            pinned host buffer, valid until :meth:`RunnerBatch.release`; with ``out``, ``out[i]`` itself). Batch
            k+1's forward is already queued on the device when batch k is yielded.

        Raises:
            ValueError: an ``out`` tensor of another shape than its sample's ``[L_i, n*H]``, or not on the CPU.
        """
        for pending in self.iter_pending(input_ids_list, out):
            yield pending.finish()

    def iter_pending(self, input_ids_list: Sequence[Any],
                     out: Sequence[torch.Tensor] | None = None) -> Iterator[PendingBatch]:  # fmt: skip
        """Like :meth:`iter_batches`, but yields each batch unfinished (:class:`PendingBatch`): batch k is yielded
        once batch k+1's forward is queued; the last one is yielded with ``last`` set and nothing queued behind it,
        so a caller that does not finish it at once keeps the device busy with its own next work
        (``stages.extract.worker.ShardExtractor`` queues the next shard's first forward before it waits for it).
        Finish batch k before asking for batch k+2: at most two batches then hold device and host buffers. With
        ``out`` no host buffer is pooled, so every batch may be queued before any is finished (the online producer
        queues a whole task's forwards, then waits, unless its ``forwards_in_flight`` bounds them)."""
        planner = plan_packed_batches if self.packing else plan_batches
        plan = planner([len(ids) for ids in input_ids_list], self.token_budget)
        if out is not None and len(out) != len(input_ids_list):
            raise ValueError(f"out: expected one tensor per sample ({len(input_ids_list)}), got {len(out)}")
        pending: _InFlight | None = None
        for indices in plan:
            flight = self._launch(input_ids_list, indices, out)
            if pending is not None:
                yield PendingBatch(self._finish, pending, last=False)
            pending = flight
        if pending is not None:
            yield PendingBatch(self._finish, pending, last=True)

    def run(self, input_ids_list: Sequence[Any]) -> list[torch.Tensor]:
        """Tapped hidden states of each sample, in input order: ``Tensor[L_i, n*H]`` bfloat16 on CPU.

        Equal (within bf16 tolerance) to ``torch.cat([model(ids[None], output_hidden_states=True)
        .hidden_states[l + 1][0] for l in target_layer_ids], -1)`` of each sample alone.
        """
        outputs: list[torch.Tensor | None] = [None] * len(input_ids_list)
        for batch in self.iter_batches(input_ids_list):
            for index, hidden in zip(batch.indices, batch.hidden, strict=True):
                outputs[index] = hidden
        return outputs  # type: ignore[return-value]
