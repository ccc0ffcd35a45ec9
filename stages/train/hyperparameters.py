"""The effective hyperparameters of a training run, printed at its start, with the documented conventions beside them.

``train`` prints one table (main rank, stderr) of what the run will actually use: learning rate and schedule, AdamW
betas / epsilon / weight decay, gradient clipping, loss decay gamma, block size, anchors, token budget per
micro-batch and per optimizer step, length buckets, compile and the attention backend. Where docs/dflash.md (the paper's
recipe, arXiv 2602.06036) documents a convention, it is shown, and departures that silently cost acceptance length
are logged as warnings (:func:`convention_warnings`): gamma other than the paper's for B = 16 / 10 / 8 (7 / 5 / 4),
betas other than the documented default (torch's AdamW defaults, as SpecForge trains DFlash: ``dflash.training.optim``), and
an anchor budget whose blocks cannot cover the longest documents (``max_anchors_per_document * block_size`` below
the longest sample; the paper's 512 anchors x 16 at length 3072 cover it 2.7 times). Other departures from the
paper's recipe (lr 6e-4, clip 1.0, 4% warmup) are marked in the table, not warned about: they are usual choices.
The warnings are also recorded in ``run.json`` (``resolved.convention_warnings``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dflash.drafter.config import PAPER_GAMMA, default_gamma
from dflash.training.optim import DEFAULT_BETAS

__all__ = ["HyperparameterRow", "hyperparameter_rows", "convention_warnings", "render_hyperparameters"]

#: The paper's recipe (docs/dflash.md, "Training examples") for the values it states.
_PAPER = {"lr": 6e-4, "grad_clip": 1.0, "warmup_ratio": 0.04, "max_anchors_per_document": 512, "block_size": 16}


@dataclass(slots=True)
class HyperparameterRow:
    """One setting: its effective value, the documented convention (or ``""``), and whether it departs from it."""

    name: str
    value: str
    convention: str = ""
    departs: bool = False


def convention_warnings(*, block_size: int, gamma: float, betas: tuple[float, float], max_anchors_per_document: int,
                        longest_sample: int | None) -> list[str]:
    """Departures from the method's conventions (docs/dflash.md) that cap acceptance length without any error (module docstring)."""
    warnings = []
    paper_gamma = PAPER_GAMMA.get(block_size)
    if paper_gamma is not None and gamma != paper_gamma:
        warnings.append(f"gamma {gamma:g} at block size {block_size}: the paper uses {paper_gamma:g} "
                        f"(the paper: 7 for B=16, 5 for B=10, 4 for B=8); omit --gamma to use it")
    elif paper_gamma is None and gamma != default_gamma(block_size):
        warnings.append(f"gamma {gamma:g} at block size {block_size}: no paper value for this size; the default "
                        f"interpolates {default_gamma(block_size):g} (1 + 3B/8)")
    if tuple(float(b) for b in betas) != tuple(DEFAULT_BETAS):
        warnings.append(f"AdamW betas {tuple(betas)}: the documented default is {tuple(DEFAULT_BETAS)} (torch's AdamW "
                        "defaults, as SpecForge trains DFlash; the paper states none)")
    if longest_sample and max_anchors_per_document * block_size < longest_sample:
        warnings.append(
            f"max_anchors_per_document {max_anchors_per_document} x block size {block_size} = "
            f"{max_anchors_per_document * block_size} tokens < the longest sample ({longest_sample} tokens): blocks "
            f"cannot cover long documents in an epoch (paper: 512 anchors x 16 at length 3072, 2.7x coverage)"
        )
    return warnings


def hyperparameter_rows(config: Any, resolved: Mapping[str, Any], *, schedule: list[Mapping[str, Any]],
                        attention_backend: str) -> list[HyperparameterRow]:
    """The table's rows from the ``TrainConfig``, the trainer's ``resolved`` record and the schedule segments."""
    drafter = resolved["drafter_config"]
    block_size = int(drafter["block_size"])
    world = int(resolved.get("world_size", 1))
    first = schedule[0] if schedule else {}
    paper_gamma = PAPER_GAMMA.get(block_size)
    on_cuda = str(resolved.get("device", "")).startswith("cuda")

    def row(name: str, value: Any, convention: Any = None, departs: bool | None = None) -> HyperparameterRow:
        shown = "" if convention is None else str(convention)
        differs = departs if departs is not None else (convention is not None and value != convention)
        return HyperparameterRow(name, str(value), shown, bool(differs))

    shape = first.get("schedule", "cosine")
    floor = f"{config.optim.lr * config.optim.min_lr_ratio:.3g} at step {first.get('total_steps', '?')}"
    schedule_text = f"warmup {first.get('warmup_steps', '?')} steps ({config.optim.warmup_ratio:.0%}), " + (
        f"cosine to {floor}" if shape == "cosine" else "constant" if shape == "constant" else
        f"constant, then {config.optim.decay_shape} decay over the last {first.get('decay_steps', '?')} steps to {floor}")
    if len(schedule) > 1:
        schedule_text += f"; {len(schedule) - 1} extension(s) (resumed with more steps)"
    tokens_per_step = config.data.token_budget * config.grad_accum_steps * world
    boundaries = list(resolved.get("bucket_boundaries") or [])
    validation = resolved.get("validation")
    init = resolved.get("drafter_init") or {}
    return [
        row("lr (peak)", f"{config.optim.lr:.3g}", f"{_PAPER['lr']:.3g}"),
        row("schedule", schedule_text, "4% warmup, cosine", departs=config.optim.warmup_ratio != _PAPER["warmup_ratio"] or shape != "cosine"),
        row("AdamW betas", tuple(config.optim.betas), tuple(DEFAULT_BETAS)),
        row("AdamW eps / weight decay", f"{config.optim.eps:g} / {config.optim.weight_decay:g}"),
        row("grad clip", f"{config.optim.grad_clip:g}", f"{_PAPER['grad_clip']:g}"),
        row("objective", _objective_text(config.drafter), "CE",
            departs=config.drafter.distill != "none" or config.drafter.ce_weight != 1.0),
        row("gamma", f"{resolved['gamma']:g}", f"{paper_gamma:g}" if paper_gamma is not None else
            f"{default_gamma(block_size):g} (no paper value; 1 + 3B/8)",
            departs=float(resolved["gamma"]) != (paper_gamma or default_gamma(block_size))),
        row("block size", block_size, _PAPER["block_size"]),
        row("draft layers", drafter.get("num_hidden_layers", config.drafter.num_draft_layers)),
        row("draft layer init", _init_text(init), "random", departs=init.get("init", "random") != "random"),
        row("anchors per document", config.drafter.max_anchors_per_document, _PAPER["max_anchors_per_document"]),
        row("anchor slots (compile)", resolved.get("anchor_slots") or "dynamic"),
        row("token budget", f"{config.data.token_budget:,} per micro-batch x {config.grad_accum_steps} accum x {world} "
            f"ranks = {tokens_per_step:,} per step"),
        row("length buckets", f"{len(boundaries) + 1 if boundaries else config.data.num_buckets} "
            f"(boundaries {boundaries})"),
        row("validation", f"{validation['samples']:,} samples held out by {validation['split_by']} "
            f"(fraction {config.data.validation_fraction:g})" if validation else "off (no best checkpoint)"),
        row("compile", config.compile),
        row("attention", f"{resolved.get('attention')} (backend {attention_backend})"),
        row("precision", (f"{config.mixed_precision} autocast" if on_cuda and config.mixed_precision == "bf16" else
                          "fp32 (autocast applies on CUDA only)" if not on_cuda else config.mixed_precision)
            + f", residual {config.residual_dtype}"),
        row("total steps", resolved.get("total_steps")),
    ]


def _init_text(record: Mapping[str, Any]) -> str:
    kind = record.get("init", "random")
    if kind == "target":
        return f"target layers {record.get('layers')} ({record.get('tensors')} tensors copied)"
    return str(kind)


def render_hyperparameters(rows: list[HyperparameterRow]) -> Any:
    """A rich table of the rows, departures from the convention in yellow (the trainer logs the warnings)."""
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    table = Table(title="effective hyperparameters")
    table.add_column("setting", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    table.add_column("convention (docs/dflash.md)", overflow="fold")
    for item in rows:
        style = "yellow" if item.departs else ""
        table.add_row(escape(item.name), Text(item.value, style=style), escape(item.convention))
    return table


def _objective_text(drafter: Any) -> str:
    """The loss: ``CE``, or its weighted parts with a distillation term (``dflash.drafter.loss``)."""
    ce = "CE" if drafter.ce_weight == 1.0 else f"{drafter.ce_weight:g} x CE"
    if drafter.distill == "none":
        return ce
    term = "KL(target || drafter)" if drafter.distill == "kl" else "TV(target, drafter)"
    return f"{ce} + {drafter.distill_weight:g} x {term}"
