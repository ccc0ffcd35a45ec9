"""Decode attention over each row's own key range: one query token per row reads only the cache positions it attends.

The static decoder keeps every batch in one fixed-shape KV cache: prompts are left-padded to the batch's widest and the
cache is as long as that width plus the new tokens. SDPA with a padding mask reads the whole padded cache for every
row and step, although a row attends only ``[width - prompt_length, width + step]`` and a finished row attends nothing
that matters. For a batch of prompts of mixed lengths that is 2-3x the bytes the step needs, and the decode step is
memory-bound. :func:`ranged_decode_attention` takes each row's range as two device tensors (``starts``, ``ends``) and
reads only those positions: a split-KV ("flash-decoding") Triton kernel, one program per (row, KV head, chunk of the
cache) that loads each KV head once for all query heads of its group (padded to the 16 rows of a tensor-core tile), then a second kernel that merges the chunks'
partial softmax sums. Both read their ranges from device memory, so a CUDA graph captured once serves every step.

Source followed: the split-KV decoding scheme of FlashDecoding (Dao et al., 2023) and the online softmax of
FlashAttention; transformers' grouped-query mapping (query head ``h`` reads KV head ``h // (query_heads / kv_heads)``).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

__all__ = ["ranged_decode_attention", "ranged_attention_available", "launch_device", "CHUNK", "RANGES_KWARG"]

#: Cache positions one program of the first kernel covers (a multiple of its tile, 64).
CHUNK = 256
#: The forward keyword that carries each row's key range, ``(starts, ends)``, through the model to the attention.
RANGES_KWARG = "dflash_decode_ranges"

try:  # Triton ships with CUDA builds of torch; CPU-only installs decode through SDPA instead.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def ranged_attention_available(device: torch.device) -> bool:
    """Whether :func:`ranged_decode_attention` can run on ``device``: CUDA with Triton, or any device under Triton's
    interpreter (``TRITON_INTERPRET=1``, set before this module is imported; slow, for tests on CPU)."""
    return triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def launch_device(tensor: torch.Tensor) -> Any:
    """The context to launch a Triton kernel on ``tensor`` in: its CUDA device made current (nothing for a CPU
    tensor under the interpreter).

    Triton launches on the current CUDA device and that device's current stream, not on the device of the tensors it
    is given. The current device is per thread: a thread that never set it (a Dask worker's task thread, whose
    plugin pinned the GPU from another thread) has device 0 current, and a kernel launched there for a model on
    ``cuda:1`` would run on GPU 0 with ``cuda:1`` pointers.
    """
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


if triton is not None:

    @triton.jit
    def _partial_kernel(q_ptr, k_ptr, v_ptr, starts_ptr, ends_ptr, out_ptr, max_ptr, sum_ptr, scale,
                        stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl,
                        num_kv_heads: tl.constexpr, group: tl.constexpr, group_pad: tl.constexpr,
                        num_chunks: tl.constexpr, chunk: tl.constexpr, block: tl.constexpr,
                        head_dim: tl.constexpr, precision: tl.constexpr):
        pid = tl.program_id(0)
        chunk_idx = tl.program_id(1)
        row = pid // num_kv_heads
        kv_head = pid % num_kv_heads
        start = tl.load(starts_ptr + row)
        end = tl.load(ends_ptr + row)
        lo = tl.maximum(start, chunk_idx * chunk)
        hi = tl.minimum(end, (chunk_idx + 1) * chunk)

        heads = tl.arange(0, group_pad)
        dims = tl.arange(0, head_dim)
        head_ok = heads < group
        q_heads = kv_head * group + heads
        q = tl.load(q_ptr + row * stride_qb + q_heads[:, None] * stride_qh + dims[None, :],
                    mask=head_ok[:, None], other=0.0)  # (group_pad, head_dim)

        m = tl.full((group_pad,), float("-inf"), tl.float32)
        total = tl.zeros((group_pad,), tl.float32)
        acc = tl.zeros((group_pad, head_dim), tl.float32)
        k_base = k_ptr + row * stride_kb + kv_head * stride_kh
        v_base = v_ptr + row * stride_vb + kv_head * stride_vh
        for step in range(chunk // block):
            tile = chunk_idx * chunk + step * block
            if (tile < hi) & (tile + block > lo):  # tiles outside the row's range cost nothing
                offs = tile + tl.arange(0, block)
                ok = (offs >= lo) & (offs < hi)
                k = tl.load(k_base + offs[:, None] * stride_kl + dims[None, :], mask=ok[:, None], other=0.0)
                v = tl.load(v_base + offs[:, None] * stride_vl + dims[None, :], mask=ok[:, None], other=0.0)
                scores = tl.dot(q, tl.trans(k), input_precision=precision)
                scores = (scores * scale).to(tl.float32)  # (group_pad, block); scale may be fp64
                scores = tl.where(ok[None, :], scores, float("-inf"))
                new_m = tl.maximum(m, tl.max(scores, axis=1))
                safe_m = tl.where(new_m == float("-inf"), 0.0, new_m)  # a tile before the range: nothing seen yet
                alpha = tl.exp(m - safe_m)
                p = tl.exp(scores - safe_m[:, None])
                total = total * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=precision)
                m = new_m

        slot = (row * num_kv_heads * group + q_heads) * num_chunks + chunk_idx  # (group_pad,)
        tl.store(max_ptr + slot, m, mask=head_ok)
        tl.store(sum_ptr + slot, total, mask=head_ok)
        tl.store(out_ptr + slot[:, None] * head_dim + dims[None, :], acc, mask=head_ok[:, None])

    @triton.jit
    def _merge_kernel(out_ptr, max_ptr, sum_ptr, result_ptr, num_chunks: tl.constexpr, chunks_pad: tl.constexpr,
                      head_dim: tl.constexpr):
        pid = tl.program_id(0)  # row * query_heads + head
        chunks = tl.arange(0, chunks_pad)
        dims = tl.arange(0, head_dim)
        ok = chunks < num_chunks
        m = tl.load(max_ptr + pid * num_chunks + chunks, mask=ok, other=float("-inf"))
        total = tl.load(sum_ptr + pid * num_chunks + chunks, mask=ok, other=0.0)
        acc = tl.load(out_ptr + (pid * num_chunks + chunks)[:, None] * head_dim + dims[None, :], mask=ok[:, None],
                      other=0.0)
        top = tl.max(m, axis=0)
        top = tl.where(top == float("-inf"), 0.0, top)  # an empty range (finished row): all weights 0
        weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
        denominator = tl.sum(total * weight, axis=0)
        merged = tl.sum(acc * weight[:, None], axis=0) / tl.where(denominator > 0, denominator, 1.0)
        tl.store(result_ptr + pid * head_dim + dims, merged.to(result_ptr.dtype.element_ty))


def ranged_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, starts: torch.Tensor,
                            ends: torch.Tensor, scale: float | None = None, *, block: int = 64, num_warps: int = 4,
                            num_stages: int = 2) -> torch.Tensor:
    """Softmax attention of one query token per row over the cache positions ``[starts[b], ends[b])`` of its row.

    Float32 inputs are multiplied in float32 (Triton's float32 dot on NVIDIA GPUs is TF32 unless asked otherwise);
    bf16 and fp16 ones on the tensor cores, summed in float32.

    Args:
        query: (batch, query_heads, 1, head_dim) on CUDA.
        key, value: (batch, kv_heads, cache_length, head_dim), the query's dtype; ``query_heads`` a multiple of
            ``kv_heads`` (grouped-query attention: query head ``h`` reads KV head ``h // (query_heads / kv_heads)``);
            the last dimension contiguous.
        starts, ends: (batch,) int32 on the same device, ``0 <= start <= end <= cache_length``; an empty range gives
            zeros.
        scale: the softmax scale (default ``head_dim ** -0.5``).
        block, num_warps, num_stages: the first kernel's tile of cache positions (a power of two dividing
            :data:`CHUNK`) and its launch settings (``benchmarks/decode_attention.py`` compares them).

    Returns:
        (batch, 1, query_heads, head_dim) in the query's dtype (transformers' attention-function output layout).
    """
    batch, query_heads, query_length, head_dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    assert query_length == 1 and query_heads % kv_heads == 0 and head_dim & (head_dim - 1) == 0
    assert key.stride(-1) == 1 and value.stride(-1) == 1
    group = query_heads // kv_heads
    num_chunks = triton.cdiv(length, CHUNK)
    partial = torch.empty((batch * query_heads * num_chunks, head_dim), dtype=torch.float32, device=query.device)
    maxima = torch.empty((batch * query_heads * num_chunks,), dtype=torch.float32, device=query.device)
    sums = torch.empty_like(maxima)
    query = query.contiguous()
    result = torch.empty((batch, 1, query_heads, head_dim), dtype=query.dtype, device=query.device)
    with launch_device(query):
        _partial_kernel[(batch * kv_heads, num_chunks)](
            query, key, value, starts, ends, partial, maxima, sums, scale if scale is not None else head_dim ** -0.5,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
            value.stride(0), value.stride(1), value.stride(2),
            num_kv_heads=kv_heads, group=group, group_pad=max(16, triton.next_power_of_2(group)),
            num_chunks=num_chunks, chunk=CHUNK, block=block, head_dim=head_dim,
            precision="ieee" if query.dtype == torch.float32 else None, num_warps=num_warps, num_stages=num_stages)
        _merge_kernel[(batch * query_heads,)](partial, maxima, sums, result, num_chunks=num_chunks,
                                              chunks_pad=triton.next_power_of_2(num_chunks), head_dim=head_dim)
    return result
