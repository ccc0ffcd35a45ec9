"""Triton kernels for one chunk of the DFlash loss: weighted cross-entropy, argmax hits and ``d loss / d logits``.

Same function as :func:`dflash.drafter.loss._ce_chunk_fusable` (the ``torch.compile``'d chunk), in the minimum
number of passes over the ``[C, V]`` logits (the online-softmax scheme of Milakov & Gimelshein 2018, as in
Liger-Kernel's cross-entropy and Apple's cut-cross-entropy):

1. ``_ce_stats_kernel``, one program per row: one read of the row in ``BLOCK_V`` tiles; float32 running max (one
   block reduction per tile) and per-lane sums of exponentials rescaled to it (-> ``lse``), the argmax (first index
   of the max, like ``torch.argmax``; searched only in tiles that raise the running max), the target's logit.
   Writes ``lse [C]``, ``w * (lse - x[target]) [C]`` and the hit flag.
2. ``_ce_grad_kernel``, one program per ``(row, BLOCK_V tile)``: reads the tile again and writes
   ``grad = (exp(x - lse) - [v == target]) * w`` in the logits dtype, optionally over the logits themselves
   (``inplace=True``: the chunk then needs no second ``[C, V]`` buffer).

Bytes moved: ``3 * C * V * itemsize`` (read, read, write); the total is summed by torch from the per-row values
(deterministic; no atomics).

Special values (documented contract, checked by tests/test_ce_triton.py):
    * ``rows_w == 0``: the row's gradient is exactly 0 and it adds exactly 0 to the total, even when its logits are
      not finite (its logits are then not read in pass 2). Weights may be any nonnegative float.
    * A row holding NaN or +inf gets a NaN loss (so the total is NaN, as with torch, where +inf gives inf or NaN),
      a NaN gradient (if its weight is nonzero) and ``correct = False`` (torch's argmax would name the first NaN).
    * ``-inf`` logits are fine (they get probability 0); a row that is entirely ``-inf`` has ``lse = -inf`` and a
      NaN loss, argmax 0 (as torch).
    * A target outside ``[0, V)`` is not read: its row loss is NaN (torch's gather would raise; here raising would
      need a host sync).

Only basic ``triton.language`` calls (load/store/max/min/sum/exp/log/where/full/zeros/arange/program_id/constexpr,
a ``for`` over ``range`` and an ``if`` on a scalar) are used so the kernels build with the Triton bundled with torch
2.11 and older ones. The module imports without Triton (CPU CI): :func:`triton_available` says whether the kernels
exist. ``TRITON_INTERPRET=1`` (set before importing Triton) runs them on CPU tensors through Triton's interpreter,
slowly; used only to check the math (the interpreter truncates float32 -> bfloat16 where GPUs round to nearest).
"""

from __future__ import annotations

import contextlib
import os

import torch

from dflash.errors import ConfigError

try:  # optional: absent on CPU-only installs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

__all__ = ["triton_available", "ce_chunk_triton", "STATS_CONFIGS", "DEFAULT_GRAD_CONFIG"]

#: ``(BLOCK_V, num_warps)`` candidates for the row-statistics kernel, autotuned once per (V, dtype) per process.
STATS_CONFIGS = ((2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16))
#: ``(BLOCK_V, num_warps)`` of the gradient kernel: elementwise, 16 bf16 values (two 16-byte vectors) per thread.
#: Not autotuned: benchmarking a kernel that overwrites its input would corrupt the logits.
DEFAULT_GRAD_CONFIG = (2048, 4)

_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available() -> bool:
    """True when Triton imported, i.e. :func:`ce_chunk_triton` can run (on CUDA tensors, or on CPU tensors under
    ``TRITON_INTERPRET=1``)."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _ce_stats_kernel(logits_ptr, target_ptr, weight_ptr, loss_ptr, lse_ptr, correct_ptr, V, stride_row,
                         BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # row * stride_row overflows int32 at C * V > 2**31
        row_ptr = logits_ptr + row * stride_row
        cols = tl.arange(0, BLOCK_V)
        run_max = float("-inf")
        # Per-lane partial sums, rescaled by the scalar running max: one block reduction (the max) per tile.
        run_sum = tl.zeros([BLOCK_V], dtype=tl.float32)
        argmax = 0
        tile = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf"))
        for start in range(0, V, BLOCK_V):
            offs = start + cols
            # Issue the next tile's loads before reducing this one (no pipelining of plain loads in Triton):
            # its latency overlaps this tile's math; past the row end the loads are masked off and move no bytes.
            next_offs = offs + BLOCK_V
            next_tile = tl.load(row_ptr + next_offs, mask=next_offs < V, other=float("-inf"))
            x = tile.to(tl.float32)
            tile = next_tile
            tile_max = tl.max(x, axis=0)
            if tile_max > run_max:  # strict: a tie in a later tile keeps the earlier index (torch.argmax)
                argmax = tl.min(tl.where(x == tile_max, offs, V), axis=0)  # first index of the max in the tile
            new_max = tl.maximum(run_max, tile_max)
            # All -inf so far: shift by 0 instead of -inf so exp() gives 0, not exp(-inf - -inf) = NaN.
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            run_sum = run_sum * tl.exp(run_max - shift) + tl.exp(x - shift)
            run_max = new_max
        lse = run_max + tl.log(tl.sum(run_sum, axis=0))
        target = tl.load(target_ptr + row)
        weight = tl.load(weight_ptr + row)
        valid = (target >= 0) & (target < V)
        target_logit = tl.load(row_ptr + target, mask=valid, other=float("nan")).to(tl.float32)
        loss = tl.where(weight != 0.0, (lse - target_logit) * weight, 0.0)
        tl.store(loss_ptr + row, loss)
        tl.store(lse_ptr + row, lse)
        hit = (argmax.to(tl.int64) == target) & (lse == lse)  # lse is NaN when the row holds NaN or +inf
        tl.store(correct_ptr + row, hit.to(tl.int8))

    @triton.jit
    def _ce_grad_kernel(logits_ptr, grad_ptr, target_ptr, weight_ptr, lse_ptr, V, stride_row, grad_stride_row,
                        num_col_blocks, BLOCK_V: tl.constexpr):
        pid = tl.program_id(0)
        row = (pid // num_col_blocks).to(tl.int64)
        offs = (pid % num_col_blocks) * BLOCK_V + tl.arange(0, BLOCK_V)
        in_row = offs < V
        weight = tl.load(weight_ptr + row)
        lse = tl.load(lse_ptr + row)
        target = tl.load(target_ptr + row)
        # Zero-weight rows are not read at all (masked loads move no bytes).
        read_limit = tl.where(weight != 0.0, V, 0)
        x = tl.load(logits_ptr + row * stride_row + offs, mask=offs < read_limit, other=float("-inf")).to(tl.float32)
        grad = (tl.exp(x - lse) - tl.where(offs == target, 1.0, 0.0)) * weight
        grad = tl.where(weight != 0.0, grad, 0.0)
        tl.store(grad_ptr + row * grad_stride_row + offs, grad.to(grad_ptr.dtype.element_ty), mask=in_row)

    _ce_stats_kernel_tuned = triton.autotune(
        configs=[triton.Config({"BLOCK_V": block}, num_warps=warps) for block, warps in STATS_CONFIGS],
        key=["V"],
    )(_ce_stats_kernel)


def _check_inputs(logits: torch.Tensor, target: torch.Tensor, rows_w: torch.Tensor) -> None:
    if triton is None:
        raise ConfigError("ce_chunk_triton needs the 'triton' package (bundled with CUDA builds of torch); "
                          "got none: use dflash.drafter.loss._ce_chunk_fusable, or install torch with CUDA")
    if logits.dim() != 2 or logits.dtype not in _SUPPORTED_DTYPES:
        raise ConfigError(f"logits must be a 2-D bfloat16/float16/float32 tensor [C, V], got shape "
                          f"{tuple(logits.shape)} dtype {logits.dtype}")
    if not logits.is_cuda and not _interpreting():
        raise ConfigError(f"logits must be on a CUDA device (or set TRITON_INTERPRET=1 to run the kernels on CPU), "
                          f"got device {logits.device}")
    num_rows = logits.shape[0]
    if tuple(target.shape) != (num_rows,) or target.dtype != torch.int64:
        raise ConfigError(f"target must be int64 [C={num_rows}], got shape {tuple(target.shape)} dtype {target.dtype}")
    if tuple(rows_w.shape) != (num_rows,) or rows_w.dtype != torch.float32:
        raise ConfigError(f"rows_w must be float32 [C={num_rows}], got shape {tuple(rows_w.shape)} "
                          f"dtype {rows_w.dtype}")
    if target.device != logits.device or rows_w.device != logits.device:
        raise ConfigError(f"target ({target.device}) and rows_w ({rows_w.device}) must be on the logits' device "
                          f"({logits.device})")


def ce_chunk_triton(
    logits: torch.Tensor,
    target: torch.Tensor,
    rows_w: torch.Tensor,
    *,
    need_grad: bool = True,
    inplace: bool = False,
    stats_config: tuple[int, int] | None = None,
    grad_config: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Weighted CE, argmax hits and ``d loss / d logits`` of one chunk, in two Triton kernels.

    Args:
        logits: ``[C, V]`` bfloat16/float16/float32 on CUDA, unit stride along V (rows may be strided).
        target: ``[C]`` int64 token ids in ``[0, V)``.
        rows_w: ``[C]`` float32 nonnegative row weights (0 = row not supervised).
        need_grad: compute the gradient (else only pass 1 runs and ``grad`` is None).
        inplace: write the gradient over ``logits`` (which must not be needed afterwards) instead of a new tensor.
        stats_config: ``(BLOCK_V, num_warps)`` for pass 1 instead of autotuning over :data:`STATS_CONFIGS`.
        grad_config: ``(BLOCK_V, num_warps)`` for pass 2 (default :data:`DEFAULT_GRAD_CONFIG`). BLOCK_V: power of 2.

    Returns:
        ``(total, correct, grad)``: ``total`` scalar float32 ``sum_i w_i * (logsumexp(x_i) - x_i[target_i])``;
        ``correct`` ``[C]`` bool, ``argmax(x_i) == target_i`` (first index on ties); ``grad`` ``[C, V]`` in the
        logits dtype, ``(softmax(x_i) - onehot(target_i)) * w_i`` computed in float32 (``logits`` itself when
        ``inplace``), or None. Special values: see the module docstring.

    Raises:
        ConfigError: Triton missing, or an argument of the wrong shape, dtype or device.
    """
    _check_inputs(logits, target, rows_w)
    if logits.stride(1) != 1:
        if inplace:
            raise ConfigError(f"inplace needs logits with unit stride along V, got strides {logits.stride()}")
        logits = logits.contiguous()
    target, rows_w = target.contiguous(), rows_w.contiguous()  # the kernels index them by row
    num_rows, vocab = logits.shape
    device = logits.device
    row_loss = torch.empty(num_rows, dtype=torch.float32, device=device)
    lse = torch.empty(num_rows, dtype=torch.float32, device=device)
    correct = torch.empty(num_rows, dtype=torch.int8, device=device)
    if num_rows == 0:
        grad = (logits if inplace else torch.empty_like(logits)) if need_grad else None
        return row_loss.sum(), correct.view(torch.bool), grad
    stats_args = (logits, target, rows_w, row_loss, lse, correct, vocab, logits.stride(0))
    with torch.cuda.device(device) if logits.is_cuda else contextlib.nullcontext():
        if stats_config is None and not _interpreting():
            _ce_stats_kernel_tuned[(num_rows,)](*stats_args)
        else:
            block, warps = stats_config or STATS_CONFIGS[2]
            _ce_stats_kernel[(num_rows,)](*stats_args, BLOCK_V=block, num_warps=warps)
        grad = None
        if need_grad:
            grad = logits if inplace else torch.empty_like(logits, memory_format=torch.contiguous_format)
            block, warps = grad_config or DEFAULT_GRAD_CONFIG
            num_col_blocks = triton.cdiv(vocab, block)
            _ce_grad_kernel[(num_rows * num_col_blocks,)](
                logits, grad, target, rows_w, lse, vocab, logits.stride(0), grad.stride(0), num_col_blocks,
                BLOCK_V=block, num_warps=warps)
    return row_loss.sum(), correct.view(torch.bool), grad

