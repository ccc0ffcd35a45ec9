"""DFlash training loss: weighted cross-entropy over block positions 1..B-1 (arXiv 2602.06036 section 4.2).

Block position k predicts ``x_{a+k}`` (no extra shift) with weight ``w_k = exp(-(k - 1) / gamma)`` times the target
token's loss mask. The LM head (the target's, frozen) and the cross-entropy run in row chunks inside one custom
autograd function that also computes the gradient w.r.t. the hidden states chunk by chunk during the forward
(the approach of Liger-Kernel's fused linear cross-entropy and Apple's cut-cross-entropy): the ``[N, V]`` logits of
a 150K+ vocabulary never exist at once, and backward does not recompute the LM head.

The loss returned is a SUM; the trainer divides by the weight sum all-reduced over data-parallel ranks, so the
gradient does not depend on how the global batch is split.

Per-chunk softmax/CE/gradient kernel (``fused=True``, the default on CUDA): the Triton kernels of
:mod:`dflash.drafter.ce_triton` (two passes over the bf16 logits, gradient written over the logits) when Triton is
importable and the logits are bf16/fp16/fp32 on CUDA, else the ``torch.compile``'d :func:`_ce_chunk_fusable`; each
falls back to the next (Triton -> compiled -> eager) with a warning if it fails to build. The environment variable
``DFLASH_CE_KERNEL`` (or ``train.ce_kernel`` / ``train --ce-kernel``, which sets it through :func:`set_ce_kernel`)
forces one, for benchmarking: ``triton`` (an error if Triton cannot run), ``inductor`` (the compiled chunk), ``eager``
(:func:`_ce_chunk_inplace`), or ``auto`` (unset: the choice above). ``fused=False`` always runs the eager chunk. Read
at every chunk, so it can be changed between steps.

Distillation term (``distill="kl"`` or ``"tv"``, :func:`chunked_linear_distill`): against the target's own
next-token distribution ``p = softmax(lm_head(f))``, ``f`` the target's final normed hidden state at the position
before the label (the target's prediction of the token the drafter predicts there; the cache's final tap), with
the drafter's ``q = softmax(lm_head(h))``: forward ``KL(p || q) = sum p (log p - log q)`` or total variation
``TV = 1/2 sum |p - q|``, weighted per row like the CE (position decay times the label's loss mask). Eager
PyTorch, the softmax math in at least float32, in row chunks of at most :data:`DISTILL_CHUNK_ELEMENTS` logits, the gradient w.r.t. the
drafter's hidden states computed in the forward as for the CE (``q - p`` for KL; ``q * (s - sum q s) / 2`` with
``s = sign(q - p)`` for TV). The objective is ``ce_weight * CE + distill_weight * term``, both sums over the same
row weights.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dflash.drafter.ce_triton import ce_chunk_triton, triton_available
from dflash.drafter.config import default_gamma
from dflash.errors import ConfigError, MismatchError

if TYPE_CHECKING:
    from dflash.batches.packed import PackedBatch
    from dflash.drafter.model import DFlashDrafter

__all__ = [
    "DISTILL_CHUNK_ELEMENTS",
    "LossOutput",
    "chunked_linear_distill",
    "default_gamma",
    "position_weights",
    "dflash_loss",
    "chunked_linear_cross_entropy",
    "expected_acceptance_length",
    "CE_KERNELS",
    "ce_kernel",
    "set_ce_kernel",
]

#: Logits budget of one chunk (elements) off CUDA: 2**28 = 1 GiB of float32.
DEFAULT_CHUNK_ELEMENTS = 1 << 28
#: On CUDA: just under 2**31 elements (int32 indexing in the fused kernel), 4 GiB of bf16 logits plus as much for their
#: gradient. Few, large, equal chunks: the grad-hidden GEMM ``[C, V] @ [V, H]`` has only C/128 x H/128 output tiles,
#: so small chunks leave the GPU's last wave mostly idle (C=1766 rows: 448 tiles = 3.4 waves of 132 SMs).
DEFAULT_CUDA_CHUNK_ELEMENTS = (1 << 31) - (1 << 20)
#: Logits per chunk of the distillation term (both devices): 2**27 elements, 512 MiB per float32 buffer; a chunk
#: holds about six such buffers (the drafter's and the target's logits, their log-softmax, the gradient).
DISTILL_CHUNK_ELEMENTS = 1 << 27


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """``[B-1]`` float32 weights ``exp(-(k-1)/gamma)`` for k = 1..B-1."""
    if not (gamma > 0 and math.isfinite(gamma)):
        raise ConfigError(f"gamma must be a positive finite float, got {gamma!r}")
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


@dataclass(kw_only=True)
class LossOutput:
    """Sums over one (micro)batch; combine across ranks by summing every field.

    Attributes:
        weighted_ce_sum: scalar float32 with grad, ``sum w_k * loss_mask * CE``.
        weight_sum: scalar float32, ``sum w_k * loss_mask`` (the normalizer; all-reduce it before dividing).
        correct_per_position: ``[B-1]`` int64, argmax hits at block positions 1..B-1 over supervised targets.
        count_per_position: ``[B-1]`` int64, supervised targets at each position.
        distill_sum: scalar float32 with grad, ``sum w_k * loss_mask * term`` of the distillation term; 0 (no
            grad) without one.
        ce_weight, distill_weight: the objective's weights (:attr:`objective_sum`; distill_weight 0 without a term).
    """

    weighted_ce_sum: torch.Tensor
    weight_sum: torch.Tensor
    correct_per_position: torch.Tensor
    count_per_position: torch.Tensor
    distill_sum: torch.Tensor | None = None
    ce_weight: float = 1.0
    distill_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.distill_sum is None:
            self.distill_sum = torch.zeros((), dtype=torch.float32, device=self.weighted_ce_sum.device)

    @property
    def objective_sum(self) -> torch.Tensor:
        """What the backward runs on: ``ce_weight * weighted_ce_sum + distill_weight * distill_sum``
        (``weighted_ce_sum`` itself with the defaults)."""
        objective = self.weighted_ce_sum if self.ce_weight == 1.0 else self.weighted_ce_sum * self.ce_weight
        if self.distill_weight:
            objective = objective + self.distill_sum * self.distill_weight
        return objective

    def loss(self, global_weight_sum: torch.Tensor | float | None = None) -> torch.Tensor:
        """``weighted_ce_sum / global_weight_sum`` (default: this batch's weight sum); 0 when nothing is supervised."""
        total = self.weight_sum if global_weight_sum is None else global_weight_sum
        if isinstance(total, torch.Tensor):
            total = total.clamp(min=1e-6)
        else:
            total = max(float(total), 1e-6)
        return self.weighted_ce_sum / total

    def accuracy_per_position(self) -> torch.Tensor:
        """``[B-1]`` float64 accuracy (0 where nothing was counted)."""
        return self.correct_per_position.double() / self.count_per_position.clamp(min=1).double()


def expected_acceptance_length(acc_per_position) -> float:
    """Expected tokens per draft-verify cycle implied by per-position accuracies:
    ``tau = 1 + sum_k prod_{i<=k} acc_i`` (k = 1..B-1), in ``[1, B]``."""
    acc = torch.as_tensor(acc_per_position, dtype=torch.float64).nan_to_num(0.0).clamp(0.0, 1.0)
    return float(1.0 + torch.cumprod(acc, 0).sum())


def _ce_chunk_inplace(logits: torch.Tensor, target: torch.Tensor, rows_w: torch.Tensor, need_grad: bool):
    """Eager chunk: ``(weighted CE sum, argmax hits [C], d loss / d logits [C, V] in the logits dtype)``.

    Softmax math in at least float32; in-place on one float32 buffer to keep the memory of one chunk."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    lse = torch.logsumexp(x, dim=-1)
    total = ((lse - x.gather(1, target[:, None]).squeeze(1)) * rows_w).sum()
    correct = x.argmax(dim=-1) == target
    if not need_grad:
        return total, correct, None
    # d CE / d logits = softmax - onehot, scaled by the row weight; reuse the buffer.
    grad = x.sub_(lse[:, None]).exp_()
    grad.scatter_add_(1, target[:, None], torch.full_like(lse[:, None], -1.0))
    grad.mul_(rows_w[:, None])
    return total, correct, grad.to(logits.dtype)


def _ce_chunk_fusable(logits: torch.Tensor, target: torch.Tensor, rows_w: torch.Tensor):
    """Same as :func:`_ce_chunk_inplace` (with grad), written without in-place ops so inductor fuses it into a few
    passes over the bf16 logits instead of ~10 float32 passes."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    row_max = x.amax(dim=-1, keepdim=True)
    lse = (x - row_max).exp().sum(dim=-1, keepdim=True).log() + row_max
    total = ((lse - x.gather(1, target[:, None])).squeeze(1) * rows_w).sum()
    correct = x.argmax(dim=-1) == target
    columns = torch.arange(x.shape[1], device=x.device)
    onehot = (columns[None, :] == target[:, None]).to(x.dtype)
    grad = ((x - lse).exp() - onehot) * rows_w[:, None]
    return total, correct, grad.to(logits.dtype)


_compiled_chunk_failed = False
_triton_chunk_failed = False
#: Environment variable forcing the per-chunk CE implementation (see the module docstring).
CE_KERNEL_ENV = "DFLASH_CE_KERNEL"
#: The choices of the per-chunk CE implementation (module docstring).
CE_KERNELS = ("auto", "triton", "inductor", "eager")
_CE_KERNELS = CE_KERNELS
_TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.cache
def _fused_chunk_fn():
    """The per-chunk softmax/CE/gradient as one ``torch.compile``'d function, compiled once per process."""
    return torch.compile(_ce_chunk_fusable)


def set_ce_kernel(name: str) -> str:
    """Force the per-chunk CE implementation for this process and the processes it starts (sets
    ``DFLASH_CE_KERNEL``); case-insensitive. Returns the previous choice.

    Raises:
        ConfigError: a name not in :data:`CE_KERNELS`.
    """
    choice = str(name).strip().lower()
    if choice not in CE_KERNELS:
        raise ConfigError(f"unknown CE kernel {name!r}; choose one of {', '.join(CE_KERNELS)} (train --ce-kernel or "
                          f"{CE_KERNEL_ENV})")
    previous = _requested_chunk_kernel()
    os.environ[CE_KERNEL_ENV] = choice
    return previous


def ce_kernel() -> str:
    """The current choice (``auto`` when ``DFLASH_CE_KERNEL`` is unset).

    Raises:
        ConfigError: ``DFLASH_CE_KERNEL`` holds an unknown name.
    """
    return _requested_chunk_kernel()


def _requested_chunk_kernel() -> str:
    """``DFLASH_CE_KERNEL`` (default ``auto``); ConfigError naming the variable for any other value."""
    choice = os.environ.get(CE_KERNEL_ENV, "").strip().lower() or "auto"
    if choice not in _CE_KERNELS:
        raise ConfigError(f"{CE_KERNEL_ENV}={os.environ[CE_KERNEL_ENV]!r} is not one of {', '.join(_CE_KERNELS)}; "
                          f"unset it to pick automatically")
    return choice


def _chunk_kernel(logits: torch.Tensor, fused: bool) -> str:
    """Which chunk implementation runs: ``triton``, ``inductor`` or ``eager`` (see the module docstring)."""
    if not fused:
        return "eager"
    choice = _requested_chunk_kernel()
    triton_ok = logits.is_cuda and triton_available() and logits.dtype in _TRITON_DTYPES
    if choice == "triton" and not triton_ok:
        raise ConfigError(f"{CE_KERNEL_ENV}=triton needs Triton and bf16/fp16/fp32 CUDA logits, got "
                          f"triton_available()={triton_available()}, logits {logits.dtype} on {logits.device}; "
                          f"unset {CE_KERNEL_ENV} to fall back to the compiled chunk")
    if choice == "auto":
        return "triton" if triton_ok and not _triton_chunk_failed else "inductor"
    return choice


def _run_chunk(logits, target, rows_w, need_grad: bool, fused: bool):
    global _compiled_chunk_failed, _triton_chunk_failed
    kernel = _chunk_kernel(logits, fused)
    if kernel == "triton":
        try:
            # In place: the caller drops the chunk's logits right after this call, so the gradient reuses them.
            return ce_chunk_triton(logits, target.long(), rows_w.float(), need_grad=need_grad, inplace=True)
        except Exception as error:  # noqa: BLE001  Triton too old/broken: same math, compiled
            if _requested_chunk_kernel() == "triton":
                raise
            _triton_chunk_failed = True
            kernel = "inductor"
            warnings.warn(f"Triton cross-entropy chunk failed ({error!r}); using the torch.compile'd chunk",
                          RuntimeWarning, stacklevel=3)
    if kernel == "inductor" and need_grad and not _compiled_chunk_failed:
        try:
            return _fused_chunk_fn()(logits, target, rows_w)
        except Exception as error:  # noqa: BLE001  compiler missing/broken: same math, eager
            _compiled_chunk_failed = True
            warnings.warn(f"fused (torch.compile) cross-entropy chunk failed ({error!r}); using the eager chunk",
                          RuntimeWarning, stacklevel=3)
    return _ce_chunk_inplace(logits, target, rows_w, need_grad)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_i row_weight_i * CE(hidden_i @ weight.T, target_i), gradient computed in the forward, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, row_weights, chunk_rows, compute_dtype, fused):
        needs_hidden_grad = hidden.requires_grad
        needs_weight_grad = weight.requires_grad
        need_grad = needs_hidden_grad or needs_weight_grad
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.detach().to(compute_dtype)
            h = hidden.detach().to(compute_dtype)
            num_rows = h.shape[0]
            softmax_dtype = torch.promote_types(compute_dtype, torch.float32)  # at least float32
            weights = row_weights.to(softmax_dtype)
            total = torch.zeros((), dtype=softmax_dtype, device=h.device)
            correct = torch.empty(num_rows, dtype=torch.bool, device=h.device)
            grad_hidden = torch.empty_like(hidden) if needs_hidden_grad else None
            grad_weight = (torch.zeros(weight.shape, dtype=softmax_dtype, device=h.device) if needs_weight_grad
                           else None)
            for start in range(0, num_rows, chunk_rows):
                stop = min(start + chunk_rows, num_rows)
                logits = h[start:stop] @ w.T  # [C, V] in the compute dtype
                chunk_total, chunk_correct, grad_logits = _run_chunk(
                    logits, targets[start:stop], weights[start:stop], need_grad, fused)
                del logits
                total += chunk_total
                correct[start:stop] = chunk_correct
                if needs_hidden_grad:
                    grad_hidden[start:stop] = (grad_logits @ w).to(hidden.dtype)
                if needs_weight_grad:
                    grad_weight += (grad_logits.T @ h[start:stop]).to(softmax_dtype)
                del grad_logits
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(correct)
        return total, correct

    @staticmethod
    def backward(ctx, grad_total, grad_correct):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_total.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_total).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    row_weights: torch.Tensor,
    *,
    chunk_rows: int | None = None,
    compute_dtype: torch.dtype | None = None,
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted CE of ``hidden @ weight.T`` without materializing all logits.

    Args:
        hidden: ``[N, H]``. weight: ``[V, H]`` (LM head). targets: ``[N]`` int64. row_weights: ``[N]`` float.
        chunk_rows: rows per chunk (default: at most ``2**28 // V`` rows, ~1 GiB of float32 logits; on CUDA at most
            ``~2**31 // V``, 4 GiB of bf16 logits), split into equal chunks (no small tail chunk).
        compute_dtype: matmul dtype (default: the autocast dtype when autocast is on, else ``hidden.dtype``);
            log-softmax is always at least float32.
        fused: run the per-chunk softmax/CE/gradient as a fused GPU kernel (default: on CUDA): the Triton kernels of
            :mod:`dflash.drafter.ce_triton`, else the ``torch.compile``'d chunk, else eager, with a warning at each
            fallback (module docstring; ``DFLASH_CE_KERNEL`` forces one).

    Returns:
        ``(weighted_ce_sum scalar float32 with grad, correct [N] bool = argmax hits)``.
    """
    if chunk_rows is None:
        budget = DEFAULT_CUDA_CHUNK_ELEMENTS if hidden.is_cuda else DEFAULT_CHUNK_ELEMENTS
        max_rows = max(1, budget // weight.shape[0])
        num_chunks = max(1, -(-hidden.shape[0] // max_rows))
        chunk_rows = max(1, -(-hidden.shape[0] // num_chunks))  # balanced: equal chunks, no small tail
    if compute_dtype is None:
        device_type = hidden.device.type
        compute_dtype = (torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type)
                         else hidden.dtype)
    if fused is None:
        fused = hidden.is_cuda
    # Named range: profilers (benchmarks/drafter_step.py --profile) attribute the LM head + CE kernels to it.
    with torch.profiler.record_function("dflash:lm_head_ce"):
        return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, row_weights, int(chunk_rows),
                                                compute_dtype, bool(fused))


class _ChunkedLinearDistill(torch.autograd.Function):
    """sum_i row_weight_i * D(p_i, q_i), ``q_i = softmax(hidden_i @ weight.T)``, ``p_i = softmax(teacher_i @
    weight.T)`` (a constant), D = forward KL or total variation; the gradient w.r.t. ``hidden`` is computed in the
    forward, chunk by chunk (module docstring). The LM head must be frozen (no gradient for it)."""

    @staticmethod
    def forward(ctx, hidden, weight, teacher, row_weights, chunk_rows, compute_dtype, kind):
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.detach().to(compute_dtype)
            h = hidden.detach().to(compute_dtype)
            f = teacher.detach().to(compute_dtype)
            softmax_dtype = torch.promote_types(compute_dtype, torch.float32)  # at least float32
            weights = row_weights.detach().to(softmax_dtype)
            total = torch.zeros((), dtype=softmax_dtype, device=h.device)
            grad_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
            for start in range(0, h.shape[0], chunk_rows):
                stop = min(start + chunk_rows, h.shape[0])
                log_q = torch.log_softmax((h[start:stop] @ w.T).to(softmax_dtype), dim=-1)  # [C, V] drafter
                log_p = torch.log_softmax((f[start:stop] @ w.T).to(softmax_dtype), dim=-1)  # [C, V] target
                q = log_q.exp()
                p = log_p.exp()
                rows_w = weights[start:stop]
                if kind == "kl":
                    per_row = (p * (log_p - log_q)).sum(-1)
                    del log_p, log_q
                    grad = q.sub_(p) if grad_hidden is not None else None
                else:  # tv
                    del log_p, log_q
                    sign = torch.sign(q - p)
                    per_row = 0.5 * (q - p).abs().sum(-1)
                    grad = (0.5 * q * (sign - (sign * q).sum(-1, keepdim=True))) if grad_hidden is not None else None
                    del sign
                total += (per_row * rows_w).sum()
                del p
                if grad is not None:
                    grad.mul_(rows_w[:, None])
                    grad_hidden[start:stop] = (grad.to(compute_dtype) @ w).to(hidden.dtype)
                del grad, q
        ctx.save_for_backward(grad_hidden)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        (grad_hidden,) = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_total.to(grad_hidden.dtype)
        return grad_hidden, None, None, None, None, None, None


def chunked_linear_distill(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher: torch.Tensor,
    row_weights: torch.Tensor,
    *,
    kind: str,
    chunk_rows: int | None = None,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Weighted distillation term of the drafter's ``hidden @ weight.T`` against the target's ``teacher @
    weight.T`` without materializing all logits (module docstring).

    Args:
        hidden: ``[N, H]`` the drafter's final states (with grad). weight: ``[V, H]`` the frozen LM head.
        teacher: ``[N, H]`` the target's final normed hidden states whose logits give ``p`` (no grad).
        row_weights: ``[N]`` float. kind: ``"kl"`` (forward KL(p || q)) or ``"tv"`` (total variation).
        chunk_rows: rows per chunk (default: at most ``DISTILL_CHUNK_ELEMENTS // V``, equal chunks).
        compute_dtype: matmul dtype (default: the autocast dtype when autocast is on, else ``hidden.dtype``);
            the softmax math is float32.

    Returns:
        ``sum row_weight * D`` scalar float32 with grad w.r.t. ``hidden``.

    Raises:
        ConfigError: an unknown ``kind``, or an LM head that requires grad.
    """
    if kind not in ("kl", "tv"):
        raise ConfigError(f"distill must be kl or tv here, got {kind!r}")
    if weight.requires_grad:
        raise ConfigError("the distillation term needs a frozen LM head (the target's); it has requires_grad set")
    if chunk_rows is None:
        max_rows = max(1, DISTILL_CHUNK_ELEMENTS // weight.shape[0])
        num_chunks = max(1, -(-hidden.shape[0] // max_rows))
        chunk_rows = max(1, -(-hidden.shape[0] // num_chunks))
    if compute_dtype is None:
        device_type = hidden.device.type
        compute_dtype = (torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type)
                         else hidden.dtype)
    with torch.profiler.record_function("dflash:lm_head_distill"):
        return _ChunkedLinearDistill.apply(hidden, weight, teacher, row_weights, int(chunk_rows), compute_dtype, kind)


def dflash_loss(
    drafter: DFlashDrafter,
    batch: PackedBatch,
    anchors: torch.Tensor,
    *,
    gamma: float | None = None,
    chunk_rows: int | None = None,
    mask: object = None,
    fused: bool | None = None,
    distill: str = "none",
    distill_weight: float = 1.0,
    ce_weight: float = 1.0,
) -> LossOutput:
    """Forward + weighted CE (and, with ``distill``, the distillation term) for every block of a packed batch.

    Args:
        drafter: the drafter with the target attached.
        batch: packed batch on the drafter's device.
        anchors: ``[A]`` from :func:`sample_anchors` (``-1`` = padding slot, zero weight).
        gamma: decay (default :func:`default_gamma` of the block size).
        chunk_rows: LM-head chunk rows (see :func:`chunked_linear_cross_entropy`).
        mask: optional precomputed attention mask (:meth:`DFlashDrafter.build_mask`).
        fused: compiled per-chunk CE (see :func:`chunked_linear_cross_entropy`; default on CUDA).
        distill: ``"none"``, ``"kl"`` or ``"tv"`` (module docstring). With a term, ``batch.hidden`` holds the
            final tap after the taps (``[T, (n+1)*H]``, a cache read with ``final_tap=True``).
        distill_weight, ce_weight: the objective's weights (``LossOutput.objective_sum``).

    Returns:
        :class:`LossOutput` (sums; divide by the all-reduced ``weight_sum``).

    Raises:
        MismatchError: ``distill`` is set but ``batch.hidden`` has no final tap after the drafter's taps.
    """
    teacher_states = None
    if distill != "none":
        taps_width = drafter.fc.in_features
        if batch.hidden.shape[-1] != taps_width + drafter.config.hidden_size:
            raise MismatchError(
                f"distill={distill} needs the target's final tap after the {taps_width} tap values of each token "
                f"(width {taps_width + drafter.config.hidden_size}), the batch has width {batch.hidden.shape[-1]}; "
                "read the cache with its final tap (extract --final-tap)"
            )
        teacher_states = batch.hidden[:, taps_width:]
        batch = dataclasses.replace(batch, hidden=batch.hidden[:, :taps_width])
    block_size = drafter.config.block_size
    gamma = default_gamma(block_size) if gamma is None else float(gamma)
    weights_k = position_weights(block_size, gamma, device=anchors.device)  # [B-1]
    if anchors.numel() == 0:
        # No valid anchor in this batch: one padding slot keeps shapes non-empty and the graph connected (loss 0).
        anchors = anchors.new_full((1,), -1)
        mask = None
    hidden = drafter.forward_train(batch, anchors, mask=mask, predictions_only=True)  # [A, B-1, H]
    num_anchors = anchors.shape[0]
    num_tokens = batch.input_ids.shape[0]
    valid = anchors >= 0
    offsets = torch.arange(1, block_size, device=anchors.device)
    target_index = (anchors.clamp(min=0)[:, None] + offsets).clamp(max=num_tokens - 1)  # [A, B-1]
    targets = batch.input_ids[target_index]
    supervised = (batch.loss_mask[target_index] > 0) & valid[:, None]  # [A, B-1]
    row_weights = weights_k[None, :] * supervised.float()
    ce_sum, correct = chunked_linear_cross_entropy(
        hidden.reshape(num_anchors * (block_size - 1), -1),
        drafter.lm_head_weight,
        targets.reshape(-1),
        row_weights.reshape(-1),
        chunk_rows=chunk_rows,
        fused=fused,
    )
    correct = correct.view(num_anchors, block_size - 1) & supervised
    distill_sum = None
    if teacher_states is not None:
        # The target's prediction of x_{a+k} is its output at a+k-1 (>= the anchor, inside the batch).
        teacher = teacher_states[target_index - 1].reshape(num_anchors * (block_size - 1), -1)
        distill_sum = chunked_linear_distill(
            hidden.reshape(num_anchors * (block_size - 1), -1), drafter.lm_head_weight, teacher,
            row_weights.reshape(-1), kind=distill,
        )
    return LossOutput(
        weighted_ce_sum=ce_sum,
        weight_sum=row_weights.sum(),
        correct_per_position=correct.sum(0),
        count_per_position=supervised.sum(0),
        distill_sum=distill_sum,
        ce_weight=float(ce_weight),
        distill_weight=float(distill_weight) if distill_sum is not None else 0.0,
    )
