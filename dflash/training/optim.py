"""Optimizer and learning-rate schedule of drafter training: AdamW with a warmup-then-cosine (default), WSD or
constant schedule.

Recipe (docs/dflash.md, paper arXiv 2602.06036 section 4.2 / appendix A.1): AdamW, lr 6e-4, gradient clipping at 1.0,
cosine schedule with 4% linear warmup. The paper does not state AdamW's betas, epsilon or weight decay; the
defaults here are those of SGLang's SpecForge trainer (``specforge/optimizer.py: BF16Optimizer``, which trains
DFlash and EAGLE-3 drafters): ``torch.optim.AdamW`` with its own defaults ``betas=(0.9, 0.999)``, ``eps=1e-8``,
and ``weight_decay=0.0`` (SpecForge copies that from EAGLE-3's ``traineagle3/ds_config.json``).

The schedule is a :class:`torch.optim.lr_scheduler.LambdaLR` over a picklable multiplier, so its
``state_dict()`` round-trips exactly and a resumed run gets the same learning rate as a straight one.

Extending a run (``train --resume`` with more steps or epochs, :func:`extend_schedule`): the steps already taken
keep their schedule, and the added steps ``[s0, T_new)`` get a new segment of the same shape, the common "re-warm"
practice of continued training (SGDR, Loshchilov & Hutter 2017; Gupta et al. 2023, arXiv 2308.04014; Ibrahim et
al. 2024, arXiv 2403.08763): the lr warms linearly from the lr in effect at ``s0`` to the peak ``lr`` over
``round(warmup_ratio * (T_new - s0))`` steps, then follows the schedule's shape over the segment (cosine to
``lr * min_lr_ratio`` at ``T_new``; WSD: constant, then its decay over the segment's last ``decay_ratio`` share;
constant: constant). A finished run ends at the floor (0 by default), from where a warmup-free decay would stay at
0. The segment is part of the multiplier's state, so a checkpoint of the extended run resumes bit for bit.

Schedules (``OptimConfig.schedule``): ``cosine`` (the paper's); ``wsd`` (warmup-stable-decay, Hu et al. 2024,
arXiv 2404.06395; Hägele et al. 2024, arXiv 2405.18392, whose "1-sqrt" decay shape is ``decay_shape="1-sqrt"``):
the peak lr until the last ``decay_ratio`` share of the steps, then a decay to ``lr * min_lr_ratio``; ``constant``:
the peak lr after the warmup.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dflash.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch

__all__ = [
    "DECAY_SHAPES",
    "DEFAULT_BETAS",
    "SCHEDULES",
    "LRMultiplier",
    "OptimConfig",
    "build_optimizer",
    "build_scheduler",
    "clip_grad_norm",
    "extend_schedule",
    "restore_scheduler",
    "schedule_segments",
]

#: ``OptimConfig.schedule`` choices.
SCHEDULES = ("cosine", "wsd", "constant")
#: ``OptimConfig.decay_shape`` choices (the WSD decay's shape).
DECAY_SHAPES = ("linear", "1-sqrt")

#: AdamW betas used when none are given: torch's defaults, as SpecForge's DFlash trainer uses them.
DEFAULT_BETAS: tuple[float, float] = (0.9, 0.999)


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """Optimizer, schedule and clipping settings (defaults: the DFlash paper's recipe, see module docstring)."""

    lr: float = field(default=6e-4, metadata={"help": "Peak learning rate (the paper's recipe: 6e-4)."})
    betas: tuple[float, float] = field(default=DEFAULT_BETAS, metadata={"help": (
        "AdamW (beta1, beta2), e.g. 0.9,0.999 (the default: torch's AdamW defaults, as SpecForge uses them).")})
    #: AdamW epsilon.
    eps: float = 1e-8
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW decoupled weight decay (SpecForge, EAGLE-3: 0)."})
    warmup_ratio: float = field(default=0.04, metadata={"help": (
        "Share of the total optimizer steps spent in linear warmup (the paper's recipe: 0.04).")})
    #: The cosine (or WSD decay) ends at ``lr * min_lr_ratio``.
    min_lr_ratio: float = 0.0
    schedule: str = field(default="cosine", metadata={"help": (
        "Learning-rate schedule after the warmup: cosine (decay to the floor), wsd (constant, then a decay over the "
        "last decay_ratio share of the steps) or constant.")})
    decay_ratio: float = field(default=0.2, metadata={"help": (
        "Share of the steps the wsd schedule spends decaying (its last steps); other schedules ignore it.")})
    decay_shape: str = field(default="linear", metadata={"help": (
        "Shape of the wsd decay: linear or 1-sqrt (lr falls as 1 - sqrt(progress)).")})
    grad_clip: float = field(default=1.0, metadata={"help": (
        "Largest global L2 norm of the gradient (the paper's recipe: 1.0); 0 disables clipping (the norm is still "
        "measured).")})

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
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if not 0.0 < self.decay_ratio <= 1.0:
            raise ConfigError(f"decay_ratio must be in (0, 1], got {self.decay_ratio}")
        if self.decay_shape not in DECAY_SHAPES:
            raise ConfigError(f"decay_shape must be one of {', '.join(DECAY_SHAPES)}, got {self.decay_shape!r}")


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
class LRMultiplier:
    """LR multiplier at optimizer step ``s`` (0-based): linear warmup over ``warmup_steps`` (from 1/(w+1) to 1),
    then, by ``schedule``: ``cosine`` from 1 down to ``min_lr_ratio`` at ``total_steps``; ``wsd`` 1 until the last
    ``decay_steps`` steps before ``total_steps``, then down to ``min_lr_ratio`` at ``total_steps`` (linearly, or
    as ``1 - sqrt(progress)`` with ``decay_shape="1-sqrt"``); ``constant`` 1. Constant after ``total_steps``.

    ``extensions`` (added by :func:`extend_schedule` when a resumed run gets more steps) are later segments, each a
    dict ``{"start_step", "total_steps", "warmup_steps", "start_ratio"}`` (and ``"decay_steps"`` for wsd): from
    ``start_step`` on, the multiplier warms linearly from ``start_ratio`` to 1 over ``warmup_steps`` steps, then
    follows the schedule's shape down to ``min_lr_ratio`` at that segment's ``total_steps``. The last segment that
    has started applies.

    A frozen dataclass (not a closure, and without ``__slots__``): ``LambdaLR.state_dict()`` saves a callable
    object's ``__dict__``, so the schedule's settings, extensions included, travel with the checkpoint (as JSON:
    a list of dicts after a round trip) and show in ``repr``. A saved state without ``schedule`` is a cosine one
    (:func:`restore_scheduler`).
    """

    total_steps: int
    warmup_steps: int
    min_lr_ratio: float
    extensions: tuple[dict[str, float], ...] = ()
    schedule: str = "cosine"
    decay_steps: int = 0
    decay_shape: str = "linear"

    @property
    def end_step(self) -> int:
        """The step at which the whole schedule (its last extension included) ends its decay."""
        return int(self.extensions[-1]["total_steps"]) if self.extensions else self.total_steps

    def __call__(self, step: int) -> float:
        segment = next((e for e in reversed(self.extensions) if step >= e["start_step"]), None)
        if segment is None:  # the original schedule: no extension reaches this step
            start, total, warmup, start_ratio, decay = 0, self.total_steps, self.warmup_steps, 0.0, self.decay_steps
        else:
            start, total = int(segment["start_step"]), int(segment["total_steps"])
            warmup, start_ratio = int(segment["warmup_steps"]), float(segment["start_ratio"])
            decay = int(segment.get("decay_steps", 0))
        offset = step - start
        if offset < warmup:
            return start_ratio + (1.0 - start_ratio) * (offset + 1) / (warmup + 1)
        span = total - start
        if self.schedule == "constant":
            return 1.0
        if self.schedule == "wsd":
            decay_start = max(warmup, span - decay)
            if offset < decay_start:
                return 1.0
            progress = min(1.0, (offset - decay_start) / max(1, span - decay_start))
            remaining = 1.0 - (math.sqrt(progress) if self.decay_shape == "1-sqrt" else progress)
            return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * remaining
        progress = min(1.0, (offset - warmup) / max(1, span - warmup))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: OptimConfig, *, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """The configured schedule over ``total_steps`` optimizer steps (warmup = ``round(warmup_ratio * total)``;
    wsd's decay = ``round(decay_ratio * total)``).

    Raises:
        ConfigError: ``total_steps < 1``.
    """
    import torch

    if total_steps < 1:
        raise ConfigError(f"total_steps must be >= 1, got {total_steps}")
    warmup_steps = round(config.warmup_ratio * total_steps)
    multiplier = LRMultiplier(
        total_steps=total_steps, warmup_steps=warmup_steps, min_lr_ratio=config.min_lr_ratio,
        schedule=config.schedule, decay_shape=config.decay_shape,
        decay_steps=round(config.decay_ratio * total_steps) if config.schedule == "wsd" else 0,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


def restore_scheduler(scheduler: torch.optim.lr_scheduler.LambdaLR, state: dict) -> None:
    """``scheduler.load_state_dict(state)``, a checkpoint's saved schedule replacing the configured one whole: a
    multiplier state saved without ``schedule`` (before WSD and constant schedules existed) restores as cosine."""
    defaults = {f.name: f.default for f in dataclasses.fields(LRMultiplier) if f.default is not dataclasses.MISSING}
    lambdas = state.get("lr_lambdas") if isinstance(state, dict) else None
    if isinstance(lambdas, list):
        state = {**state, "lr_lambdas": [{**defaults, **saved} if isinstance(saved, dict) else saved
                                         for saved in lambdas]}
    scheduler.load_state_dict(state)


def extend_schedule(
    scheduler: torch.optim.lr_scheduler.LambdaLR, config: OptimConfig, *, total_steps: int
) -> LRMultiplier | None:
    """Give a resumed schedule more steps: a re-warm segment over ``[s0, total_steps)`` (module docstring).

    ``s0`` is the scheduler's position (``last_epoch``, the optimizer steps taken). Nothing changes when
    ``total_steps`` does not exceed the schedule's end (an unchanged config resumes exactly as before). The
    optimizer's current lr is set to the new schedule's value at ``s0``, as ``LambdaLR.step()`` would have.

    Returns:
        The extended multiplier, or ``None`` when the schedule was long enough already.
    """
    multiplier = scheduler.lr_lambdas[0]
    assert isinstance(multiplier, LRMultiplier), f"not an LRMultiplier schedule: {multiplier!r}"
    if total_steps <= multiplier.end_step:
        return None
    start = int(scheduler.last_epoch)
    segment = {
        "start_step": start,
        "total_steps": int(total_steps),
        "warmup_steps": round(config.warmup_ratio * (total_steps - start)),
        "start_ratio": float(multiplier(start)),
    }
    if multiplier.schedule == "wsd":
        segment["decay_steps"] = round(config.decay_ratio * (total_steps - start))
    extended = dataclasses.replace(multiplier, extensions=(*multiplier.extensions, segment))
    scheduler.lr_lambdas = [extended for _ in scheduler.optimizer.param_groups]
    lrs = [base_lr * extended(start) for base_lr in scheduler.base_lrs]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reports for the next step
    return extended


def schedule_segments(scheduler: torch.optim.lr_scheduler.LambdaLR) -> list[dict[str, float]]:
    """The schedule as segments ``{schedule, start_step, total_steps, warmup_steps, decay_steps, start_lr, peak_lr,
    end_lr}`` (first: the original schedule, then one per extension) for logs and the checkpoint's trainer state. ``start_lr`` is
    the lr the linear warmup rises from (0 for the original schedule, the lr in effect at ``start_step`` for an
    extension); the first step of the segment already runs one warmup increment above it."""
    multiplier = scheduler.lr_lambdas[0]
    assert isinstance(multiplier, LRMultiplier), f"not an LRMultiplier schedule: {multiplier!r}"
    peak = float(scheduler.base_lrs[0])
    floor = peak if multiplier.schedule == "constant" else peak * multiplier.min_lr_ratio
    segments = [{"schedule": multiplier.schedule, "start_step": 0, "total_steps": multiplier.total_steps,
                 "warmup_steps": multiplier.warmup_steps, "decay_steps": multiplier.decay_steps,
                 "start_lr": 0.0, "peak_lr": peak, "end_lr": floor}]
    for extension in multiplier.extensions:
        segments.append({"schedule": multiplier.schedule, "start_step": int(extension["start_step"]),
                         "total_steps": int(extension["total_steps"]), "warmup_steps": int(extension["warmup_steps"]),
                         "decay_steps": int(extension.get("decay_steps", 0)),
                         "start_lr": peak * float(extension["start_ratio"]), "peak_lr": peak, "end_lr": floor})
    return segments


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global L2 norm of the gradients (fp32 scalar tensor), clipped in place to ``max_norm`` when it is > 0.

    Non-finite norms are returned as they are (no clipping applied) so the caller can skip the step.
    """
    import torch

    params = [p for p in parameters if p.grad is not None]
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, error_if_nonfinite=False)
    return torch.nn.utils.get_total_norm([p.grad for p in params], error_if_nonfinite=False)
