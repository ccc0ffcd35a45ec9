"""The attention of one decode step with its rotary embedding and KV-cache write fused into one kernel.

A decode step of a small target at a large batch is hundreds of tiny kernels: in transformers' attention module the
rotary embedding of the query and key is about ten elementwise kernels per layer (``rotate_half``'s slices,
negation and concatenation on non-contiguous views, two products and a sum for each), and the static cache's
``index_copy_`` two more. On an H200 those were about a third of SmolLM2's decode step at batch 1024
(docs/generate.md). :func:`fused_decode_forward` replaces the attention module's forward while the static decoder
is open: the query, key and value projections as the module has them (with Qwen3's per-head query and key norms),
then one Triton kernel (:func:`rope_and_write`) that rotates the query into a contiguous buffer and writes the
rotated key and the value into the cache at the step's position, then the ranged decode attention over each row's
own key range, then the output projection. The prefill runs the same kernel over all its tokens and attends through
SDPA over the positions it wrote; a call without the decoder's buffers (and a slot's first prefill, which lets the
static cache allocate itself) goes to the module's own forward.

The kernel rounds like transformers' bf16 (or float32) code: each product ``x * cos`` and ``rotate_half(x) * sin``
is rounded to the model's dtype before their sum is, so the rotated values are the ones the module would compute.

Only attention modules known to apply full-width rotary embedding with ``rotate_half`` (:data:`FUSABLE_ATTENTIONS`)
are replaced; other architectures decode through their own forward.

Source followed: transformers' ``apply_rotary_pos_emb``/``rotate_half`` and ``StaticLayer.update`` (the cache
layout ``(batch, kv_heads, length, head_dim)``), which this kernel computes in one pass.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface

from dflash.generation.ranged_attention import RANGES_KWARG, launch_device, ranged_decode_attention, triton

__all__ = ["FUSABLE_ATTENTIONS", "WRITE_KWARG", "ROWS_KWARG", "fusable", "fused_decode_forward", "rope_and_write"]

#: Attention classes whose forward is projections, optional per-head q/k norms, full-width ``rotate_half`` rotary
#: embedding, a cache update and attention over the cache, then ``o_proj``: what :func:`fused_decode_forward` computes.
FUSABLE_ATTENTIONS = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention")
#: The forward keyword that carries the cache position the call's first key and value per row are written to: (1,)
#: int64, the same for every row, or (batch,) int64, one per row (continuous batching: rows at different lengths).
WRITE_KWARG = "dflash_decode_write"
#: The forward keyword that carries the cache row each batch row is written to ((batch,) int64; default: row b is
#: cache row b): a prefill of a few new requests into the rows of finished ones.
ROWS_KWARG = "dflash_decode_rows"

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _rotate(low, high, cos_low, cos_high, sin_low, sin_high):
        """The two halves of ``x * cos + rotate_half(x) * sin``, each product rounded to x's dtype first."""
        dtype = low.dtype
        low, high = low.to(tl.float32), high.to(tl.float32)
        a = (low * cos_low).to(dtype).to(tl.float32)
        b = (high * sin_low).to(dtype).to(tl.float32)
        c = (high * cos_high).to(dtype).to(tl.float32)
        d = (low * sin_high).to(dtype).to(tl.float32)
        return (a - b).to(dtype), (c + d).to(dtype)

    @triton.jit
    def _rope_write_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, key_ptr, value_ptr, position_ptr,
                           position_stride, rows_ptr, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt,
                           stride_kh, stride_vb, stride_vt, stride_vh, stride_cos_b, stride_cos_t, stride_sin_b, stride_sin_t,
                           stride_cb, stride_ch, stride_cl, stride_db, stride_dh, stride_dl, tokens,
                           q_heads: tl.constexpr, kv_heads: tl.constexpr, q_pad: tl.constexpr, kv_pad: tl.constexpr,
                           half: tl.constexpr, has_rows: tl.constexpr):
        program = tl.program_id(0)  # one program per (row, token): all its heads
        row = program // tokens
        token = program % tokens
        dims = tl.arange(0, half)[None, :]
        cos = cos_ptr + row * stride_cos_b + token * stride_cos_t + dims
        sin = sin_ptr + row * stride_sin_b + token * stride_sin_t + dims
        cos_low = tl.load(cos).to(tl.float32)
        cos_high = tl.load(cos + half).to(tl.float32)
        sin_low = tl.load(sin).to(tl.float32)
        sin_high = tl.load(sin + half).to(tl.float32)

        heads = tl.arange(0, q_pad)[:, None]
        ok = heads < q_heads
        source = q_ptr + row * stride_qb + token * stride_qt + heads * stride_qh + dims
        low, high = _rotate(tl.load(source, mask=ok), tl.load(source + half, mask=ok), cos_low, cos_high, sin_low,
                            sin_high)
        out = q_out_ptr + ((row * q_heads + heads) * tokens + token) * 2 * half + dims
        tl.store(out, low, mask=ok)
        tl.store(out + half, high, mask=ok)

        position = tl.load(position_ptr + row * position_stride) + token
        cache_row = row
        if has_rows:
            cache_row = tl.load(rows_ptr + row)
        heads = tl.arange(0, kv_pad)[:, None]
        ok = heads < kv_heads
        source = k_ptr + row * stride_kb + token * stride_kt + heads * stride_kh + dims
        low, high = _rotate(tl.load(source, mask=ok), tl.load(source + half, mask=ok), cos_low, cos_high, sin_low,
                            sin_high)
        out = key_ptr + cache_row * stride_cb + heads * stride_ch + position * stride_cl + dims
        tl.store(out, low, mask=ok)
        tl.store(out + half, high, mask=ok)
        source = v_ptr + row * stride_vb + token * stride_vt + heads * stride_vh + dims
        out = value_ptr + cache_row * stride_db + heads * stride_dh + position * stride_dl + dims
        tl.store(out, tl.load(source, mask=ok), mask=ok)
        tl.store(out + half, tl.load(source + half, mask=ok), mask=ok)


def _rotary_head_dim(head_dim: int) -> bool:
    """Whether the kernel takes ``head_dim``: two halves whose width is a power of two (Triton's ranges)."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half > 0 and half & (half - 1) == 0


def rope_and_write(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   key_cache: torch.Tensor, value_cache: torch.Tensor, position: torch.Tensor,
                   cache_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate the query and key of ``tokens`` consecutive positions per row; write the key and value into the cache
    from ``position`` on.

    Args:
        query: (batch, tokens, query_heads, head_dim); key, value: (batch, tokens, kv_heads, head_dim); any strides
            with the last dimension contiguous (views of the projections' outputs).
        cos, sin: (batch, tokens, head_dim), the rotary tables at the tokens' positions (last dimension contiguous).
        key_cache, value_cache: (cache_batch, kv_heads, length, head_dim), written in place at ``position + t`` for
            token ``t``.
        position: int64 on the device, the cache position of each row's first token: (1,) the same for every row, or
            (batch,) one per row.
        cache_rows: (batch,) int64 on the device, the cache row of each row (default: row b is cache row b).

    Returns:
        The rotated query, (batch, query_heads, tokens, head_dim), contiguous (the attention functions' layout).
    """
    batch, tokens, query_heads, head_dim = query.shape
    kv_heads = key.shape[2]
    assert _rotary_head_dim(head_dim), "head_dim must be 2 x a power of two"
    for tensor in (query, key, value, cos, sin, key_cache, value_cache):
        assert tensor.stride(-1) == 1
    assert position.numel() in (1, batch) and (cache_rows is None or cache_rows.numel() == batch)
    rotated = torch.empty((batch, query_heads, tokens, head_dim), dtype=query.dtype, device=query.device)
    with launch_device(query):
        _rope_write_kernel[(batch * tokens,)](
            query, key, value, cos, sin, rotated, key_cache, value_cache, position, 0 if position.numel() == 1 else 1,
            position if cache_rows is None else cache_rows, query.stride(0), query.stride(1), query.stride(2),
            key.stride(0), key.stride(1), key.stride(2),
            value.stride(0), value.stride(1), value.stride(2), cos.stride(0), cos.stride(1), sin.stride(0),
            sin.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), tokens,
            q_heads=query_heads, kv_heads=kv_heads, q_pad=triton.next_power_of_2(query_heads),
            kv_pad=triton.next_power_of_2(kv_heads), half=head_dim // 2, has_rows=cache_rows is not None)
    return rotated


def fusable(module: torch.nn.Module) -> bool:
    """Whether :func:`fused_decode_forward` computes what ``module``'s own forward does (see the module docstring)."""
    if type(module).__name__ not in FUSABLE_ATTENTIONS or getattr(module, "sliding_window", None):
        return False
    return (all(hasattr(module, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "layer_idx", "scaling"))
            and _rotary_head_dim(getattr(module, "head_dim", 0)))


def fused_decode_forward(module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention module's forward for the static decoder's prefill and decode steps.

    Runs when the call carries the decoder's write position (:data:`WRITE_KWARG`: the cache position of each row's
    first token of this call) and, for one token per row, its ranges (``RANGES_KWARG``); otherwise the module's own
    forward runs with the same arguments. The cache (``cache`` or ``past_key_values``) must be transformers' static
    cache. A prefill (more than one token per row, written from position 0, into the cache rows :data:`ROWS_KWARG`
    names if given) attends through SDPA with the decoder's 4-D mask over the cache positions it has written; a
    decode step through :func:`ranged_decode_attention`.
    """
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    ranges = kwargs.get(RANGES_KWARG)
    position = kwargs.get(WRITE_KWARG)
    rows = kwargs.pop(ROWS_KWARG, None)
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    layer = None if cache is None else cache.layers[module.layer_idx]
    if (hidden is None or position is None or layer is None or not getattr(layer, "is_initialized", True)
            or (hidden.shape[1] == 1 and ranges is None)):  # a fresh cache allocates itself in its first update
        assert rows is None, "a prefill into chosen cache rows needs an allocated cache"
        kwargs.pop(WRITE_KWARG, None)
        return type(module).forward(module, *args, **kwargs)
    cos, sin = kwargs["position_embeddings"]
    batch, tokens = hidden.shape[:2]
    head_dim = module.head_dim
    query = module.q_proj(hidden).view(batch, tokens, -1, head_dim)
    key = module.k_proj(hidden).view(batch, tokens, -1, head_dim)
    value = module.v_proj(hidden).view(batch, tokens, -1, head_dim)
    if hasattr(module, "q_norm"):
        query = module.q_norm(query)
        key = module.k_norm(key)
    rotated = rope_and_write(query, key, value, cos, sin, layer.keys, layer.values, position, rows)
    if tokens == 1:
        starts, ends = ranges
        out = ranged_decode_attention(rotated, layer.keys, layer.values, starts, ends, scale=module.scaling)
    else:  # the prefill writes positions [0, tokens): later ones are masked out, so they need not be read
        mask = kwargs.get("attention_mask")
        keys, values = layer.keys[:, :, :tokens], layer.values[:, :, :tokens]
        if rows is not None:
            keys, values = keys.index_select(0, rows), values.index_select(0, rows)
        out, _ = AttentionInterface()["sdpa"](module, rotated, keys, values,
                                              None if mask is None else mask[..., :tokens], dropout=0.0,
                                              scaling=module.scaling)
    return module.o_proj(out.reshape(batch, tokens, -1)), None
