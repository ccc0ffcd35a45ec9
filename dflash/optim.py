"""Optimizer and learning-rate schedule of drafter training: AdamW with a warmup-then-cosine schedule.

Recipe (DFLASH.md, paper arXiv 2602.06036 section 4.2 / appendix A.1): AdamW, lr 6e-4, gradient clipping at 1.0,
cosine schedule with 4% linear warmup. The paper does not state AdamW's betas, epsilon or weight decay; the
defaults here are those of SGLang's SpecForge trainer (``specforge/optimizer.py: BF16Optimizer``, which trains
DFlash and EAGLE-3 drafters): ``torch.optim.AdamW`` with its own defaults ``betas=(0.9, 0.999)``, ``eps=1e-8``,
and ``weight_decay=0.0`` (SpecForge copies that from EAGLE-3's ``traineagle3/ds_config.json``).

The schedule is a :class:`torch.optim.lr_scheduler.LambdaLR` over a picklable multiplier, so its
``state_dict()`` round-trips exactly and a resumed run gets the same learning rate as a straight one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dflash.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch

__all__ = [
    "DEFAULT_BETAS",
    "OptimConfig",
    "WarmupCosine",
    "build_optimizer",
    "build_scheduler",
    "clip_grad_norm",
]

#: AdamW betas used when none are given: torch's defaults, as SpecForge's DFlash trainer uses them.
DEFAULT_BETAS: tuple[float, float] = (0.9, 0.999)


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """Optimizer, schedule and clipping settings (defaults: the DFlash paper's recipe, see module docstring)."""

    lr: float = 6e-4
    """Peak learning rate (paper: 6e-4)."""
    betas: tuple[float, float] = field(default=DEFAULT_BETAS)
    """AdamW (beta1, beta2); default (0.9, 0.999), torch's AdamW defaults as used by SpecForge."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay (SpecForge/EAGLE-3: 0.0)."""
    warmup_ratio: float = 0.04
    """Fraction of the total optimizer steps spent in linear warmup (paper: 4%)."""
    min_lr_ratio: float = 0.0
    """The cosine decays from ``lr`` to ``lr * min_lr_ratio``."""
    grad_clip: float = 1.0
    """Max global L2 norm of the gradient; 0 disables clipping (the norm is still measured). Paper: 1.0."""

    def __post_init__(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"lr must be a positive finite number, got {self.lr}")
        betas = tuple(float(b) for b in self.betas)
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ConfigError(f"betas must be two numbers in [0, 1), got {self.betas}")
        self.betas = betas  # type: ignore[assignment]
        if not self.eps > 0:
            raise ConfigError(f"eps must be > 0, got {self.eps}")
        if not self.weight_decay >= 0:
            raise ConfigError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ConfigError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not self.grad_clip >= 0:
            raise ConfigError(f"grad_clip must be >= 0 (0 disables clipping), got {self.grad_clip}")


def build_optimizer(parameters: Iterable[torch.nn.Parameter], config: OptimConfig) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over the trainable parameters (fp32 master weights; autocast handles bf16).

    On CUDA the fused implementation (the same AdamW update in fewer, larger kernels; ``benchmarks/drafter_step.py``
    measures its step with it: 8.7 ms per step for the 1B-parameter 8B-target drafter on an H200, the trainer's
    foreach path was not timed); elsewhere torch's default (``foreach``). Resuming a checkpoint restores the
    implementation it was saved with (``load_state_dict`` restores the param groups' flags).
    """
    import torch

    params = [p for p in parameters if p.requires_grad]
    if not params:
        raise ConfigError("the drafter has no trainable parameter; nothing to optimize")
    fused = all(p.is_cuda and p.is_floating_point() for p in params)
    return torch.optim.AdamW(
        params, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay,
        fused=True if fused else None,
    )


@dataclass(frozen=True)
class WarmupCosine:
    """LR multiplier at optimizer step ``s`` (0-based): linear warmup over ``warmup_steps`` (from 1/(w+1) to 1),
    then cosine from 1 down to ``min_lr_ratio`` at ``total_steps``; constant afterwards.

    A frozen dataclass (not a closure, and without ``__slots__``): ``LambdaLR.state_dict()`` saves a callable
    object's ``__dict__``, so the schedule's settings travel with the checkpoint and show in ``repr``.
    """

    total_steps: int
    warmup_steps: int
    min_lr_ratio: float

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: OptimConfig, *, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Warmup-then-cosine schedule over ``total_steps`` optimizer steps (warmup = ``round(ratio * total)``).

    Raises:
        ConfigError: ``total_steps < 1``.
    """
    import torch

    if total_steps < 1:
        raise ConfigError(f"total_steps must be >= 1, got {total_steps}")
    warmup_steps = round(config.warmup_ratio * total_steps)
    multiplier = WarmupCosine(total_steps=total_steps, warmup_steps=warmup_steps, min_lr_ratio=config.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global L2 norm of the gradients (fp32 scalar tensor), clipped in place to ``max_norm`` when it is > 0.

    Non-finite norms are returned as they are (no clipping applied) so the caller can skip the step.
    """
    import torch

    params = [p for p in parameters if p.grad is not None]
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, error_if_nonfinite=False)
    return torch.nn.utils.get_total_norm([p.grad for p in params], error_if_nonfinite=False)
