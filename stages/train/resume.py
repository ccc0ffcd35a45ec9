"""Resume policy: which changes of a run's configuration a ``--resume`` refuses, warns about or accepts.

Exact resume reproduces the straight run bit for bit on CPU, so a change of the training trajectory (learning rate,
batch, seed, schedule length...) is refused unless ``--allow-config-change``; a change of the batch plan is refused
whatever that flag says (the saved data cursor cannot continue on another plan)."""


from __future__ import annotations

import logging
from dataclasses import fields
from pathlib import Path
from typing import Any

from dflash.batches.source import LoaderConfig, StreamConfig
from dflash.errors import CheckpointError
from stages.config.check import deep_merge, leaf_paths
from stages.train.config import ABSENT_IN_OLD_RUNS, RUNTIME_FIELDS, TrainConfig, default_leaves

__all__ = ["trajectory_changes", "check_resume_changes", "refuse_changed_resume"]

log = logging.getLogger(__name__)


def trajectory_changes(saved: dict[str, Any], current: dict[str, Any], *, saved_world_size: int, world_size: int) -> list[str]:
    """What differs between a checkpoint's config and the resuming one, in ways that change the trajectory.

    The cache path and the target spec may change (the cache's content and the target's identity are checked
    separately); the global batch is ``world_size * grad_accum_steps`` micro-batches, so a different world size
    with the same product keeps the batches but not bit-exactness (different float summation order).
    """

    # A field missing from an older checkpoint had its default then (fields are only ever added with defaults),
    # except where ABSENT_IN_OLD_RUNS says otherwise.

    defaults = default_leaves()
    saved = leaf_paths(deep_merge(ABSENT_IN_OLD_RUNS, saved))
    current = leaf_paths(current)
    changes = []
    for name in sorted(set(saved) | set(current)):
        if name in RUNTIME_FIELDS or name == "grad_accum_steps":
            continue
        before, after = saved.get(name, defaults.get(name)), current.get(name, defaults.get(name))
        if isinstance(before, tuple | list) and isinstance(after, tuple | list):
            before, after = list(before), list(after)
        if before != after:
            changes.append(f"{name}: {before!r} -> {after!r}")
    saved_batches = saved_world_size * int(saved.get("grad_accum_steps", 1))
    current_batches = world_size * int(current.get("grad_accum_steps", 1))
    if saved_batches != current_batches:
        changes.append(
            f"global batch (world_size x grad_accum_steps): {saved_world_size} x {saved.get('grad_accum_steps')} -> "
            f"{world_size} x {current.get('grad_accum_steps')}"
        )
    elif saved_world_size != world_size:
        log.warning(
            "resuming with world size %d instead of %d: same batches, but sums run in another order, so the result "
            "matches a straight run within float tolerance, not bit for bit", world_size, saved_world_size,
        )
    return changes


def _cursor_fields() -> frozenset[str]:
    """TrainConfig paths that make the loaders' batch plan: ``StreamConfig.plan_fields`` that come from
    ``train.data``, plus the train fields ``stages.train.data.stream_config`` derives the others from (``seed``,
    ``compile`` -> ``pad_to_budget``, ``min_supervised_tokens``). A checkpoint's data cursor refuses to continue on
    another value, so a resume refuses them up front."""
    loader = {f.name for f in fields(LoaderConfig)}
    return frozenset({f"data.{key}" for key in StreamConfig().plan_fields() if key in loader}
                     | {"seed", "compile", "min_supervised_tokens"})


def check_resume_changes(checkpoint_path: Path, trainer_state: dict[str, Any], config: TrainConfig,
                         world_size: int) -> None:
    """A resume of ``checkpoint_path`` (its ``trainer_state.json`` as ``trainer_state``) with ``config`` on
    ``world_size`` ranks: :func:`trajectory_changes` refused, or only warned with ``allow_config_change``.

    Raises:
        CheckpointError: the changes, and the fix (restore them or pass ``--allow-config-change``).
    """
    changes = trajectory_changes(trainer_state.get("config", {}), config.to_dict(),
                                 saved_world_size=int(trainer_state.get("world_size", 1)), world_size=world_size)
    if not changes:
        return
    plan = _cursor_fields()
    cursor = [change for change in changes if change.split(":", 1)[0] in plan]
    if cursor:  # the data cursor cannot continue on another plan: refused whatever --allow-config-change says
        raise CheckpointError(
            f"resuming {checkpoint_path}: " + "; ".join(cursor) + ". These decide the batch plan, so the saved data "
            "cursor cannot continue on the new one (--allow-config-change does not cover them); restore those "
            "values, or start a new run in a new --output")
    message = (f"resuming {checkpoint_path} with a changed config breaks exact resume (the run will not equal a "
               "straight run): " + "; ".join(changes))
    if not config.allow_config_change:
        raise CheckpointError(message + ". Restore those values, or pass --allow-config-change to go on anyway")
    log.warning("%s (--allow-config-change given)", message)


def refuse_changed_resume(config: TrainConfig) -> None:
    """Before ranks are spawned: :func:`check_resume_changes` against the ``latest`` checkpoint, from its
    ``trainer_state.json`` alone (each rank's trainer checks again when it loads the checkpoint)."""
    from dflash.training.checkpoint import read_trainer_state, resolve_checkpoint

    run = Path(config.output)
    if not config.resume or config.allow_config_change or not (run / "latest").is_file():
        return
    folder = resolve_checkpoint(run)
    try:
        state = read_trainer_state(folder)
    except OSError:
        return  # unreadable: the rank's own load names the file
    check_resume_changes(folder, state, config, config.world_size)
