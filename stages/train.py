"""Stage 2, ``train``: stream a hidden-state cache into DFlash drafter training (DDP, exact resume).

Run::

    dflash-stages train --cache CACHE --output RUN                      # one process (GPU 0, or CPU)
    dflash-stages train --cache CACHE --output RUN --drafter-gpus 5,6,7 # DDP, one process per listed GPU
    torchrun --nproc-per-node 3 -m stages.train --cache CACHE --output RUN   # same, launched by torchrun
    dflash-stages train --cache CACHE --output RUN --resume             # continue RUN from its latest checkpoint

With ``--drafter-gpus`` listing several GPUs (or ``--drafter-processes N`` on CPU, gloo backend) the command launches
its own workers through ``torch.distributed.run``'s elastic launcher (what ``torchrun --standalone`` does); under
``torchrun`` it joins the process group that torchrun set up (nccl on GPU, gloo on CPU).

Exit status: 0 when the schedule (or ``--stop-at-step``) is done; 130 after SIGTERM or a first Ctrl-C, which stop
after the current step with a checkpoint (the run is resumable; a second Ctrl-C aborts at once); 2 for bad options.

Resume: ``--resume`` starts from the saved configuration of RUN; options given on the command line override it.
An override that changes the training trajectory (learning rate, batch, seed, schedule length...) is refused,
naming the fields, unless ``--allow-config-change``: exact resume reproduces the straight run bit for bit on CPU.
More steps or epochs on resume extend the lr schedule: the added steps re-warm to the peak lr and decay again
(``dflash.optim.extend_schedule``; docs/training.md, Resume), never train on at the finished schedule's floor.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal

import typer

from dflash.batch_source import LoaderConfig
from dflash.config_check import nested_config
from dflash.drafter.config import DrafterTrainingConfig
from dflash.errors import ConfigError, ConfigPathNotFoundError, DFlashError
from dflash.optim import OptimConfig
from dflash.telemetry import TelemetryConfig

__all__ = ["TrainConfig", "RUNTIME_FIELDS", "trajectory_changes", "check_resume_changes", "run_training", "exit_if_interrupted", "register"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything the ``train`` stage needs; saved resolved in ``RUN/run.json`` and in every checkpoint."""

    # -- inputs and outputs
    cache: str
    """Hidden-state cache (local folder or fsspec URL) written by ``extract``."""
    output: str
    """Run folder: run.json, metrics.jsonl, tb/, checkpoints/, latest, best."""
    target: str | None = None
    """Target spec (folder, .gguf, or 'default'); default: the ``target_spec`` recorded in the cache."""
    resume: bool = False
    """Continue the run in ``output`` from its ``latest`` checkpoint."""
    allow_config_change: bool = False
    """Resume even when trajectory fields changed (the result then differs from a straight run)."""
    break_lock: bool = False
    """Take over the run folder's lock although its owner record names another host (that run must be known
    dead; ``dflash.locks``). A same-host stale lock (a killed run) is taken over without it."""
    allow_incomplete: bool = False
    """Train on a cache whose planned shards are not all committed (the run then logs how many samples of how many
    planned rows it trains on); without it such a cache is refused before step 1."""
    # -- drafter and objective
    drafter: DrafterTrainingConfig = field(default_factory=DrafterTrainingConfig)
    """The drafter and objective (``dflash.drafter.config.DrafterTrainingConfig``: num_draft_layers, block_size,
    mask_token_id, target_layer_ids, gamma, max_anchors_per_document); ``[train.drafter]`` in a config file,
    ``--set train.drafter.block_size=8``."""
    # -- data
    data: LoaderConfig = field(default_factory=lambda: dataclasses.replace(_TRAIN_DATA_DEFAULTS))
    """What the run reads and how (``dflash.batch_source.LoaderConfig``: token_budget, boundaries, num_buckets,
    max_documents_per_batch, validation_fraction, validation_split_by, prefetch_batches, num_read_workers,
    shard_window); ``[train.data]`` in a config file, ``--set train.data.token_budget=8192``. The train stage holds out 1% of the
    source documents by default (``validation_fraction`` 0.01, ``validation_split_by`` ``"document"``; rows of a
    cache without document keys; 0 disables validation and best-checkpoint tracking)."""
    max_validation_batches: int | None = 50
    """Validation batches per rank per evaluation (None: the whole held-out split)."""
    min_supervised_tokens: int | None = None
    """Samples with fewer supervised (loss_mask = 1) tokens are excluded, counted and reported (run.json, metrics,
    log); default ``2 * drafter.block_size`` (DFLASH.md: shorter samples give no useful anchors); 0 keeps every sample."""
    # -- optimization (defaults: the paper's recipe; betas from SpecForge, see dflash.optim)
    epochs: float = 6.0
    """Passes over the training split (paper: 6); ignored when ``max_steps`` is set."""
    max_steps: int | None = None
    """Optimizer steps of the whole schedule (overrides ``epochs``)."""
    grad_accum_steps: int = 1
    """Micro-batches per rank per optimizer step."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer, lr schedule and clipping (``dflash.optim.OptimConfig``: lr, betas, eps, weight_decay,
    warmup_ratio, min_lr_ratio, grad_clip); ``[train.optim]`` in a config file, ``--set train.optim.lr=3e-4``."""
    seed: int = 0
    """Seed of initial weights, data order and anchors."""
    mixed_precision: Literal["bf16", "none"] = "bf16"
    """bf16 autocast on GPU (CPU always runs fp32)."""
    residual_dtype: Literal["compute", "float32"] = "compute"
    """Residual stream of the block tokens: ``compute`` = the autocast dtype (bf16, as serving runs the drafter and
    Megatron-LM trains), ``float32`` = the parameter dtype. Only matters with mixed precision."""
    compile: bool = False
    """torch.compile the draft layers on the fixed-shape path: every micro-batch padded to ``token_budget`` and
    ``anchor_slots`` anchor slots, so one graph serves every step (eager, dynamic shapes, is the default)."""
    anchor_slots: int | None = None
    """Anchors per micro-batch on the fixed-shape path; default ``drafter.max_anchors_per_document x
    data.max_documents_per_batch`` capped at ``data.token_budget``. More valid anchors: a uniform random subset is kept."""
    # -- runtime (never changes the trajectory)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the drafter trains; auto: CUDA when available."""
    drafter_gpus: list[int] | None = None
    """GPU ids for the drafter; several: DDP, one process per GPU."""
    drafter_processes: int = 1
    """Data-parallel processes on CPU (gloo), for tests and debugging."""
    stop_at_step: int | None = None
    """Stop after this step with a checkpoint, as a preemption would (the schedule still spans ``max_steps``)."""
    save_every: int = 500
    """Checkpoint every N optimizer steps (and at the end)."""
    keep_last: int = 3
    """Checkpoints kept besides the best by validation loss."""
    eval_every: int | None = None
    """Validate every N steps (default: ``save_every``, so each checkpoint has a validation loss)."""
    # save_every, eval_every and keep_last stay here rather than in a nested config: the cadence of checkpoints and
    # validation is the trainer's own loop (which steps save, which validate, eval_every defaulting to save_every so
    # that the best-by-validation checkpoint has a loss at each one); the checkpointer only takes keep_last, and
    # ``dflash.checkpoint`` loads torch, which a config declared there would load for every CLI call.
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    """What the run reports and how often (``dflash.telemetry.TelemetryConfig``: log_every, throughput_window,
    progress, report_to); ``[train.telemetry]`` in a config file, ``--set train.telemetry.log_every=50``."""
    attention_backend: Literal["auto", "flash", "triton"] | None = None
    """Kernels of the drafter's FlexAttention on GPU (``dflash.drafter.attention_kernels``): ``auto`` (flash-attn-4's
    where installed and usable, else Triton's), ``flash`` or ``triton``; ``None``: ``$DFLASH_ATTENTION_BACKEND``, else
    ``auto``. Every rank applies it (and sets the variable for the processes it starts)."""
    ce_kernel: Literal["auto", "triton", "inductor", "eager"] | None = None
    """Per-chunk softmax/cross-entropy implementation of the loss on GPU (``dflash.drafter.loss``): ``auto`` (Triton
    where it runs, else the compiled chunk), ``triton``, ``inductor`` or ``eager``; ``None``: ``$DFLASH_CE_KERNEL``,
    else ``auto``. For benchmarking; every rank applies it."""

    def __post_init__(self) -> None:
        if not self.cache:
            raise ConfigError("cache: give the hidden-state cache path (--cache)")
        if not self.output:
            raise ConfigError("output: give the run folder (--output)")
        if self.drafter_gpus is not None:
            self.drafter_gpus = [int(i) for i in self.drafter_gpus]
            if (not self.drafter_gpus or len(set(self.drafter_gpus)) != len(self.drafter_gpus)
                    or any(g < 0 for g in self.drafter_gpus)):
                raise ConfigError(f"drafter_gpus must list distinct GPU ids >= 0, got {self.drafter_gpus}")
        self.optim = nested_config(OptimConfig(), self.optim, "optim")
        self.data = nested_config(_TRAIN_DATA_DEFAULTS, self.data, "data")
        self.drafter = nested_config(DrafterTrainingConfig(), self.drafter, "drafter")
        self.telemetry = nested_config(TelemetryConfig(), self.telemetry, "telemetry")
        positive = ("grad_accum_steps", "save_every", "keep_last", "drafter_processes")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("max_steps", "eval_every", "max_validation_batches", "stop_at_step", "anchor_slots"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be a positive integer or None, got {value!r}")
        from dflash.config_check import check_seed, dtype_spelling, finite_number

        if not finite_number(self.epochs) or (self.max_steps is None and not self.epochs > 0):
            raise ConfigError(f"epochs must be a finite number > 0 (or give max_steps), got {str(self.epochs)[:40]}")
        check_seed("seed", self.seed)

        self.mixed_precision = dtype_spelling(self.mixed_precision, ("bf16", "none"))
        if self.mixed_precision not in ("bf16", "none"):
            raise ConfigError(f"mixed_precision must be 'bf16' or 'none', got {self.mixed_precision!r}")
        if self.residual_dtype not in ("compute", "float32"):
            raise ConfigError(f"residual_dtype must be 'compute' or 'float32', got {self.residual_dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.drafter_gpus is not None and self.device == "cpu":
            raise ConfigError("drafter_gpus lists GPUs but device is 'cpu'; drop one of them")
        if self.drafter_gpus is not None and self.drafter_processes > 1:
            raise ConfigError("drafter_processes > 1 is for CPU runs; with drafter_gpus the world size is their count")
        if self.min_supervised_tokens is not None and (
            not isinstance(self.min_supervised_tokens, int) or isinstance(self.min_supervised_tokens, bool)
            or self.min_supervised_tokens < 0
        ):
            raise ConfigError(f"min_supervised_tokens must be an integer >= 0 or None, got {self.min_supervised_tokens!r}")
        if self.compile and self.anchor_slots is None and self.data.max_documents_per_batch is None:
            raise ConfigError(
                "anchor_slots: --compile needs a fixed anchor count; give anchor_slots, or data.max_documents_per_batch "
                "(anchor_slots then defaults to drafter.max_anchors_per_document x data.max_documents_per_batch)"
            )
        if self.eval_every is None:
            self.eval_every = self.save_every
        from dflash.drafter import CE_KERNELS, attention_backend, ce_kernel
        from dflash.drafter.attention_kernels import ATTENTION_BACKENDS

        for name, choices, from_env in (("attention_backend", ATTENTION_BACKENDS, attention_backend),
                                        ("ce_kernel", CE_KERNELS, ce_kernel)):
            value = getattr(self, name)
            if value is None:
                from_env()  # a bad environment variable is refused before any work too (ConfigError naming it)
            elif not isinstance(value, str) or value.strip().lower() not in choices:
                raise ConfigError(f"{name} must be one of {', '.join(choices)} (or None: the environment's), got "
                                  f"{value!r}")
            else:
                setattr(self, name, value.strip().lower())

    def apply_kernel_choices(self) -> None:
        """Make ``attention_backend`` and ``ce_kernel`` this process's choice (where set; unset fields leave the
        environment variables' choice), for it and the processes it starts."""
        from dflash.drafter import set_attention_backend, set_ce_kernel

        if self.attention_backend is not None:
            set_attention_backend(self.attention_backend)
        if self.ce_kernel is not None:
            set_ce_kernel(self.ce_kernel)

    def resolved_anchor_slots(self) -> int | None:
        """Fixed anchors per micro-batch with ``compile``; None on the dynamic (eager) path."""
        if not self.compile:
            return None
        if self.anchor_slots is not None:
            return self.anchor_slots
        assert self.data.max_documents_per_batch is not None
        return min(self.data.token_budget, self.drafter.max_anchors_per_document * self.data.max_documents_per_batch)

    def resolved_min_supervised_tokens(self) -> int:
        """Samples with fewer supervised tokens are excluded: ``min_supervised_tokens``, default ``2 *
        drafter.block_size``."""
        if self.min_supervised_tokens is not None:
            return self.min_supervised_tokens
        return 2 * self.drafter.block_size

    def resolved_gamma(self) -> float:
        """``drafter.gamma``, or the default for ``drafter.block_size``."""
        return self.drafter.resolved_gamma()

    @property
    def world_size(self) -> int:
        """Processes this config asks for (under torchrun the launcher's WORLD_SIZE rules)."""
        return len(self.drafter_gpus) if self.drafter_gpus else self.drafter_processes

    def to_dict(self) -> dict[str, Any]:
        """The config as JSON-ready nested dicts (``{"optim": {"lr": ...}, ...}``), which :meth:`from_dict` reads."""

        def plain(value: Any) -> Any:
            if isinstance(value, dict):
                return {key: plain(item) for key, item in value.items()}
            return list(value) if isinstance(value, tuple) else value

        return plain(asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Build from :meth:`to_dict`'s form; the flat keys of runs saved before the nesting (``lr`` for
        ``optim.lr``, ``dflash.config_check.MOVED_KEYS``) are read at their new paths."""
        from dflash.config_check import migrate_renamed

        data = migrate_renamed("train", data, saved=True)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown train config fields {unknown}; known: {sorted(known)}")
        for required in ("cache", "output"):
            if data.get(required) is None:
                raise ConfigError(
                    f"{required}: missing; pass --{required} (or --resume with --output of an existing run, which "
                    "reuses its saved configuration)"
                )
        return cls(**data)

    @classmethod
    def field_types(cls) -> dict[str, str]:
        """Dotted field path -> annotation string, nested configs' leaves included (``optim.lr``), for ``sweep
        --grid name=v1,v2`` parsing."""
        import typing

        def walk(klass: type, prefix: str) -> dict[str, str]:
            hints = typing.get_type_hints(klass)
            types: dict[str, str] = {}
            for f in fields(klass):
                hint = hints.get(f.name, f.type)
                if isinstance(hint, type) and is_dataclass(hint):
                    types.update(walk(hint, f"{prefix}{f.name}."))
                else:
                    types[f"{prefix}{f.name}"] = str(f.type)
            return types

        return walk(cls, "")


#: The train stage's loader defaults: :class:`LoaderConfig`'s, with 1% of the rows held out for validation.
_TRAIN_DATA_DEFAULTS = LoaderConfig(validation_fraction=0.01)


#: Fields that never change what is computed: a resume may change them freely (a nested config's field by its
#: dotted path, ``data.prefetch_batches``).
RUNTIME_FIELDS = frozenset({
    "cache", "output", "target", "resume", "allow_config_change", "break_lock", "allow_incomplete", "device", "drafter_gpus", "drafter_processes",
    "stop_at_step", "save_every", "keep_last", "eval_every", "telemetry.log_every", "telemetry.throughput_window",
    "telemetry.progress", "data.prefetch_batches", "data.num_read_workers", "max_validation_batches", "telemetry.report_to", "attention_backend",
    "ce_kernel",
})  # fmt: skip


#: Fields added after runs already existed whose absence in a saved config means something other than today's
#: default (runs saved before ``residual_dtype`` existed kept the residual stream in float32; runs saved before
#: ``data.validation_split_by`` existed held out validation rows, not documents). Nested like the config; merged
#: under a saved config with ``deep_merge``.
ABSENT_IN_OLD_RUNS: dict[str, Any] = {"residual_dtype": "float32", "data": {"validation_split_by": "row"}}


def _default_leaves() -> dict[str, Any]:
    """Dotted path -> default of every field with one (nested configs' leaves: ``optim.lr``, from the default
    instance the field makes: ``data.validation_fraction`` is train's 0.01, not the loader's 0.0)."""
    from dflash.config_check import MISSING_DEFAULT, field_default, leaf_paths

    values: dict[str, Any] = {}
    for f in fields(TrainConfig):
        default = field_default(f)
        if default is not MISSING_DEFAULT:
            values[f.name] = asdict(default) if is_dataclass(default) else default
    return leaf_paths(values)


def trajectory_changes(saved: dict[str, Any], current: dict[str, Any], *, saved_world_size: int, world_size: int) -> list[str]:
    """What differs between a checkpoint's config and the resuming one, in ways that change the trajectory.

    The cache path and the target spec may change (the cache's content and the target's identity are checked
    separately); the global batch is ``world_size * grad_accum_steps`` micro-batches, so a different world size
    with the same product keeps the batches but not bit-exactness (different float summation order).
    """

    # A field missing from an older checkpoint had its default then (fields are only ever added with defaults),
    # except where ABSENT_IN_OLD_RUNS says otherwise.
    from dflash.config_check import deep_merge, leaf_paths, migrate_renamed

    defaults = _default_leaves()
    saved = leaf_paths(deep_merge(ABSENT_IN_OLD_RUNS, migrate_renamed("train", saved, saved=True)))
    current = leaf_paths(migrate_renamed("train", current, saved=True))
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


# ====================================================================== running (one process or a launcher)


def _pick_device(config: TrainConfig, local_rank: int):
    import torch

    use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("device='cuda' but CUDA is not available here; use --device cpu")
    gpu = config.drafter_gpus[local_rank] if config.drafter_gpus else local_rank
    if os.environ.get("DFLASH_GPUS_REMAPPED"):  # the launcher already narrowed CUDA_VISIBLE_DEVICES to the list
        gpu = local_rank
    torch.cuda.set_device(gpu)
    return torch.device("cuda", gpu)


def _train_worker(config_dict: dict[str, Any], data_factory: Any = None) -> dict[str, Any]:
    """One rank: join the process group (if any), train, close. Picklable entry point of the launcher.

    ``data_factory(config, rank=, world_size=, device=) -> stages.trainer.TrainingData`` builds the rank's batch
    sources (picklable: it travels to spawned ranks); ``None``: the cache's (:func:`stages.trainer.open_cache_data`).
    ``pipelines/online.py`` passes the online queue's."""
    import torch
    import torch.distributed as dist

    from stages.trainer import Trainer, open_cache_data

    config = TrainConfig.from_dict(config_dict)
    config.apply_kernel_choices()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _pick_device(config, local_rank)
    initialized_here = False
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None)
        initialized_here = True
    if device.type == "cpu" and world_size > 1:
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    trainer = None
    try:
        # The trainer gets its batch sources (STYLE.md 16): the cache's, or (pipelines/online.py) the queue's.
        data = (data_factory or open_cache_data)(config, rank=rank, world_size=world_size, device=device)
        trainer = Trainer(config, rank=rank, world_size=world_size, device=device, data=data)
        return trainer.fit()
    finally:
        if trainer is not None:
            trainer.close()
        if initialized_here:
            dist.destroy_process_group()


def run_training(config: TrainConfig) -> dict[str, Any]:
    """Run the train stage: in this process, under an existing ``torchrun``, or by launching one process per
    rank (``torch.distributed.run``'s elastic launcher, spawn start method). Returns rank 0's summary.

    The run folder's lock (``dflash.locks``) is held for the whole run by this process (the launcher, or rank 0
    under ``torchrun``), taken before anything is read or written. A run that creates its folder and fails with a
    :class:`DFlashError` before its first checkpoint (a cache chunk that fails to decode) removes that folder.

    Raises:
        ConfigError: ``output`` exists and is not a folder.
        LockError: another process trains into ``config.output``; the message names it.
    """
    from dflash.locks import output_lock

    output = Path(config.output)
    if output.exists() and not output.is_dir():
        raise ConfigError(
            f"output: {output} exists and is not a folder (a run folder is expected); pass --output a new or existing "
            "run folder"
        )
    if "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("RANK", "0")) != 0:
        return _run_training(config)  # under torchrun: rank 0 holds the lock for the run
    with output_lock(config.output, what="run", break_lock=config.break_lock):
        created = not output.exists()
        try:
            return _run_training(config)
        except DFlashError:
            # Refused input found once the run had started (a chunk that fails to decode): a folder this run
            # created and left without a checkpoint holds nothing to resume, so it goes; anything else is kept.
            if created and output.is_dir() and not (output / "latest").exists():
                import shutil

                shutil.rmtree(output, ignore_errors=True)
            raise


def _cursor_fields() -> frozenset[str]:
    """TrainConfig paths that make the loaders' batch plan: ``StreamConfig.plan_fields`` that come from
    ``train.data``, plus the train fields ``stages.trainer.stream_config`` derives the others from (``seed``,
    ``compile`` -> ``pad_to_budget``, ``min_supervised_tokens``). A checkpoint's data cursor refuses to continue on
    another value, so a resume refuses them up front."""
    from dflash.batch_source import StreamConfig

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
    from dflash.errors import CheckpointError

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


def _refuse_changed_resume(config: TrainConfig) -> None:
    """Before ranks are spawned: :func:`check_resume_changes` against the ``latest`` checkpoint, from its
    ``trainer_state.json`` alone (each rank's trainer checks again when it loads the checkpoint)."""
    from dflash.checkpoint import read_trainer_state, resolve_checkpoint

    run = Path(config.output)
    if not config.resume or config.allow_config_change or not (run / "latest").is_file():
        return
    folder = resolve_checkpoint(run)
    try:
        state = read_trainer_state(folder)
    except OSError:
        return  # unreadable: the rank's own load names the file
    check_resume_changes(folder, state, config, config.world_size)


def _run_training(config: TrainConfig, data_factory: Any = None) -> dict[str, Any]:
    """The ranks of a run (the caller holds the run folder's lock): this process alone, or one spawned process per
    rank. ``data_factory``: see :func:`_train_worker`."""
    config_dict = config.to_dict()
    if "TORCHELASTIC_RUN_ID" in os.environ or config.world_size == 1:
        return _train_worker(config_dict, data_factory)
    _refuse_changed_resume(config)  # here, not in each rank: one error: line instead of a failed launch per rank
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    previous = {key: os.environ.get(key) for key in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "DFLASH_GPUS_REMAPPED")}
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does for several processes per node
    if config.drafter_gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in config.drafter_gpus)
        os.environ["DFLASH_GPUS_REMAPPED"] = "1"
    launch = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=config.world_size,
        run_id=f"dflash-train-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        results = elastic_launch(launch, _train_worker)(config_dict, data_factory)
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return results[0]


# ====================================================================== CLI


def _csv_ints(text: str | None) -> list[int] | None:
    if text is None or text == "":
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from error


def config_from_cli(overrides: dict[str, Any], config_file: Path | None = None, *, preset: str | None = None,
                    sets: Sequence[str] = (), announce: bool = True) -> TrainConfig:
    """Build the config, lowest first: the saved run config (with --resume) < the preset's ``train`` section < the
    --config file (its ``train`` section, or its top level: a run.json too) < the options given < ``--set``
    (``stages.stage_config``). Every layer is checked before anything runs.

    Raises:
        ConfigError: an unknown key, a wrong type or a refused value, named with its source; --resume of a folder
            that holds no run.
    """
    from dflash.config_check import (
        MOVED_KEYS,
        check_fields,
        deep_merge,
        leaf_paths,
        migrate_renamed,
        read_config_file,
    )
    from stages.stage_config import nested, parse_sets, section_of, without_key

    known = {f.name for f in fields(TrainConfig)}
    base: dict[str, Any] = {}
    origin: dict[str, str] = {}  # key -> where its value came from, for the messages
    if preset is not None:
        from pipelines.offline import load_preset

        base = section_of(load_preset(preset), "train", known, f"preset {preset}")
        check_fields(TrainConfig, base, section="train", source=lambda key: f"preset {preset}")
        origin.update({key: f"preset {preset}" for key in leaf_paths(base)})
    if config_file is not None:
        from_file = section_of(read_config_file(config_file), "train", known, f"--config {config_file}")
        check_fields(TrainConfig, from_file, section="train", source=lambda key: f"--config {config_file}")
        base = deep_merge(base, from_file)
        origin.update({key: f"--config {config_file}" for key in leaf_paths(from_file)})
    parsed_sets = parse_sets(sets, "train")
    for key, value, source in parsed_sets:
        check_fields(TrainConfig, nested(key, value), section="train", source=lambda _key, s=source: s)
    given: dict[str, Any] = {}  # the options given, at their field paths (``lr`` -> ``optim.lr``)
    for key, value in overrides.items():
        if value is not None:  # a caller's flat key (code, not a user file) at its nested path, without a warning
            given = deep_merge(given, nested(MOVED_KEYS["train"].get(key, key), value))
    output = overrides.get("output") or base.get("output")
    run_json = Path(output) / "run.json" if output else None
    if overrides.get("resume") and run_json is not None and not run_json.is_file() and not overrides.get("cache") \
            and not base.get("cache"):
        raise ConfigPathNotFoundError(
            f"--resume: {output} holds no run (no run.json); point --output at an existing run, or start a new run "
            "with --cache"
        )
    if overrides.get("resume") and run_json is not None and run_json.is_file():
        from dflash.checkpoint import read_run_record

        try:
            saved = read_run_record(run_json.parent)["config"]
            if not isinstance(saved, dict):
                raise TypeError("config is not an object")
            # A run saved before a setting was renamed or moved into a nested config (flat ``lr``): read as today's.
            saved = migrate_renamed("train", saved, str(run_json), saved=True)
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
            raise ConfigError(f"--resume: {run_json} is not a readable run record ({error}); it is damaged: restore "
                              "it, or start a new run in another --output") from None
        origin.update({key: f"the saved run {run_json}" for key in leaf_paths(saved) if key not in origin})
        for one_off in ("stop_at_step", "allow_config_change", "break_lock"):  # they applied to the earlier invocation only
            saved.pop(one_off, None)
        base = deep_merge(deep_merge(ABSENT_IN_OLD_RUNS, saved), base)
    merged = deep_merge(base, given)
    for key, value, _ in parsed_sets:
        merged = deep_merge(merged, nested(key, value))
    merged.setdefault("resume", False)
    sized = _size_defaults_for_cpu(merged)
    origin.update({key: OPTION_SPELLINGS.get(key, "--" + key.rsplit(".", 1)[-1].replace("_", "-"))
                   for key in leaf_paths(given)})
    origin.update({key: source for key, _, source in parsed_sets})
    try:
        config = TrainConfig.from_dict(merged)
    except ConfigError as error:  # a refused value: name its key and where it came from
        message = str(error)
        key = next((k for k in sorted(origin, key=len, reverse=True) if message.startswith((k + " ", k + ":"))), None)
        if key is None:
            raise
        raise ConfigError(f"train.{key} ({origin[key]}): {without_key(message, key)}") from None
    if sized and announce:
        log.info("training on CPU: %s (the GPU-sized defaults would need tens of GB per step here; set them to "
                 "override)", ", ".join(f"{key} {value}" for key, value in sized.items()))
    return config


#: What a CPU host trains with where nothing (option, file, preset, saved run) sets these: the paper's GPU sizes
#: (16,384-token micro-batches, 512 anchors per document) make a step of the dense-mask CPU path need tens of GB
#: (the attention mask and scores grow with (anchors x block size) x (tokens + anchors x block size)), which a CPU
#: host runs out of minutes later; these are the cpu-small preset's.
CPU_SIZED_DEFAULTS = {"data.token_budget": 1024, "drafter.max_anchors_per_document": 32}


def _size_defaults_for_cpu(merged: dict[str, Any]) -> dict[str, Any]:
    """Fill :data:`CPU_SIZED_DEFAULTS` into ``merged`` (in place) when the run will train on CPU and the keys are
    unset; returns what was filled (logged by the caller once the config is valid, and not under ``--print-config``,
    whose stdout is the config)."""
    device = str(merged.get("device", "auto"))
    if merged.get("drafter_gpus") or device.startswith("cuda"):
        return {}
    if device == "auto":
        import torch

        if torch.cuda.is_available():
            return {}
    from dflash.config_check import get_path, set_path

    absent = object()
    sized = {path: value for path, value in CPU_SIZED_DEFAULTS.items() if get_path(merged, path, absent) is absent}
    for path, value in sized.items():
        set_path(merged, path, value)
    return sized


def exit_if_interrupted(summary: dict[str, Any], config: TrainConfig, command: str = "train") -> None:
    """End a run that stopped on SIGTERM or a first Ctrl-C with exit status 130 (``stages.cli.ExitCode``), after
    the trainer saved its checkpoint: to a scheduler an interrupted run is not a finished one. Prints the exact
    command that continues it (on rank 0): ``dflash-stages COMMAND --output RUN --resume``.

    Raises:
        typer.Exit: code 130 when ``summary["stopped_by_signal"]``; returns otherwise.
    """
    from stages.exit_status import ExitCode

    if not summary.get("stopped_by_signal"):
        return
    if int(os.environ.get("RANK", "0")) == 0:
        from rich.console import Console
        from rich.text import Text

        Console(stderr=True).print(
            Text("interrupted", style="bold yellow")
            + Text(f" at step {summary.get('step')} of {summary.get('total_steps')}; the checkpoint is saved. "
                   f"Continue with: dflash-stages {command} --output {config.output} --resume"),
            soft_wrap=True,
        )
    raise typer.Exit(ExitCode.INTERRUPTED)


#: ``train`` option parameter -> the :class:`TrainConfig` field (dotted path) it sets, where the names differ.
OPTION_FIELDS = {
    "max_anchors": "drafter.max_anchors_per_document", "compile_layers": "compile",
    **{name: f"drafter.{name}" for name in ("num_draft_layers", "block_size", "mask_token_id", "target_layer_ids",
                                            "gamma")},
    "lr": "optim.lr", "betas": "optim.betas", "weight_decay": "optim.weight_decay",
    "warmup_ratio": "optim.warmup_ratio", "grad_clip": "optim.grad_clip", "token_budget": "data.token_budget",
    "num_buckets": "data.num_buckets", "bucket_boundaries": "data.boundaries",
    "validation_fraction": "data.validation_fraction", "validation_split_by": "data.validation_split_by",
    "max_documents": "data.max_documents_per_batch",
    "log_every": "telemetry.log_every", "progress": "telemetry.progress", "report_to": "telemetry.report_to",
}  # fmt: skip

#: Field path -> its option's spelling, where it is not ``--`` + the last part (for messages naming the source).
OPTION_SPELLINGS = {"data.boundaries": "--bucket-boundaries"}


def _shown(name: str) -> str:
    """``--help``'s ``[default: ...]`` of a train option: its :class:`TrainConfig` field's default (options default
    to ``None`` so that a saved run, preset or file fills what the command line leaves out). ``name``: the field's
    dotted path (``optim.lr``)."""
    default = _default_leaves()[name]
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, (list, tuple)):
        return ",".join(str(item) for item in default)
    return str(default)


def register(app: typer.Typer) -> None:
    """Add the ``train`` command to the ``dflash-stages`` app."""
    @app.command("train")
    def train_command(
        cache: str = typer.Option(None, "--cache", help="Hidden-state cache (folder or fsspec URL). Required for a new run (here or in --config/--preset/--set)."),
        output: str = typer.Option(None, "--output", "-o", help="Run folder. Required (here or in --config/--preset/--set)."),
        resume: bool = typer.Option(None, "--resume/--no-resume", show_default=_shown("resume"), help="Continue RUN from its latest checkpoint."),
        config_file: Path = typer.Option(None, "--config", help="TrainConfig fields in a .toml, .yaml or .json file (its train section, or at the top; a run.json too) to start from; options given override it."),
        preset: str = typer.Option(None, "--preset", help="A shipped preset (pipelines/presets) or a .json file: its train section, under --config."),
        sets: list[str] = typer.Option([], "--set", help="train.FIELD=VALUE or FIELD=VALUE (JSON value, else a string), over everything else. Repeatable."),
        target: str = typer.Option(None, "--target", help="Target spec; default: the cache's."),
        drafter_gpus: str = typer.Option(None, "--drafter-gpus", help="GPU ids, e.g. 5,6,7 (DDP when several)."),
        drafter_processes: int = typer.Option(None, "--drafter-processes", show_default=_shown("drafter_processes"), help="DDP processes on CPU (gloo)."),
        device: str = typer.Option(None, "--device", show_default=_shown("device"), help="auto | cpu | cuda."),
        num_draft_layers: int = typer.Option(None, "--num-draft-layers", show_default=_shown("drafter.num_draft_layers"), help="Draft decoder layers."),
        block_size: int = typer.Option(None, "--block-size", show_default=_shown("drafter.block_size"), help="Block size B."),
        mask_token_id: int = typer.Option(None, "--mask-token-id", help="Mask token row (default: chosen)."),
        target_layer_ids: str = typer.Option(None, "--target-layer-ids", help="Tapped ids; must equal the cache's."),
        gamma: float = typer.Option(None, "--gamma", help="Loss decay (default by block size)."),
        max_anchors: int = typer.Option(None, "--max-anchors-per-document", show_default=_shown("drafter.max_anchors_per_document"), help=f"Anchors per document (on a CPU host, when nothing sets it: {CPU_SIZED_DEFAULTS['drafter.max_anchors_per_document']})."),
        token_budget: int = typer.Option(None, "--token-budget", show_default=_shown("data.token_budget"), help=f"Real tokens per micro-batch per rank (on a CPU host, when nothing sets it: {CPU_SIZED_DEFAULTS['data.token_budget']})."),
        num_buckets: int = typer.Option(None, "--num-buckets", show_default=_shown("data.num_buckets"), help="Length buckets from quantiles."),
        bucket_boundaries: str = typer.Option(None, "--bucket-boundaries", help="Bucket edges, e.g. 256,1024."),
        validation_fraction: float = typer.Option(None, "--validation-fraction", show_default=_shown("data.validation_fraction"), help="Held-out share (of source documents, or rows with --validation-split-by row)."),
        validation_split_by: str = typer.Option(None, "--validation-split-by", show_default=_shown("data.validation_split_by"), help="document (whole source documents held out; a cache without document keys: rows) | row."),
        epochs: float = typer.Option(None, "--epochs", show_default=_shown("epochs"), help="Epochs."),
        max_steps: int = typer.Option(None, "--max-steps", help="Optimizer steps (overrides --epochs)."),
        stop_at_step: int = typer.Option(None, "--stop-at-step", help="Stop early with a checkpoint."),
        grad_accum_steps: int = typer.Option(None, "--grad-accum-steps", show_default=_shown("grad_accum_steps"), help="Micro-batches per step."),
        lr: float = typer.Option(None, "--lr", show_default=_shown("optim.lr"), help="Peak learning rate."),
        betas: str = typer.Option(None, "--betas", show_default=_shown("optim.betas"), help="AdamW betas, e.g. 0.9,0.999."),
        weight_decay: float = typer.Option(None, "--weight-decay", show_default=_shown("optim.weight_decay"), help="AdamW weight decay."),
        warmup_ratio: float = typer.Option(None, "--warmup-ratio", show_default=_shown("optim.warmup_ratio"), help="Warmup share."),
        grad_clip: float = typer.Option(None, "--grad-clip", show_default=_shown("optim.grad_clip"), help="Clip norm (0 = off)."),
        seed: int = typer.Option(None, "--seed", show_default=_shown("seed"), help="Seed."),
        mixed_precision: str = typer.Option(None, "--mixed-precision", show_default=_shown("mixed_precision"), help="bf16 | none (GPU only)."),
        residual_dtype: str = typer.Option(
            None, "--residual-dtype", show_default=_shown("residual_dtype"), help="Residual stream dtype: compute (bf16 under autocast) | float32."),
        compile_layers: bool = typer.Option(None, "--compile/--no-compile", show_default=_shown("compile"), help="Fixed shapes + torch.compile."),
        attention_backend: str = typer.Option(
            None, "--attention-backend",
            help="Attention kernels (GPU only): auto (flash-attn-4's where installed and usable, else Triton) | "
                 "flash | triton (default: $DFLASH_ATTENTION_BACKEND, else auto). A resume may change it.",
        ),
        ce_kernel: str = typer.Option(
            None, "--ce-kernel",
            help="Per-chunk cross-entropy kernel of the loss (GPU only): auto | triton | inductor | eager (default: "
                 "$DFLASH_CE_KERNEL, else auto). A resume may change it.",
        ),
        anchor_slots: int = typer.Option(None, "--anchor-slots", help="Anchors per micro-batch with --compile."),
        max_documents: int = typer.Option(None, "--max-documents-per-batch", show_default=_shown("data.max_documents_per_batch"), help="Documents per micro-batch cap."),
        min_supervised_tokens: int = typer.Option(
            None, "--min-supervised-tokens",
            help="Exclude (and count) samples with fewer supervised tokens (default 2 x block size; 0 keeps all).",
        ),
        save_every: int = typer.Option(None, "--save-every", show_default=_shown("save_every"), help="Checkpoint every N steps."),
        keep_last: int = typer.Option(None, "--keep-last", show_default=_shown("keep_last"), help="Checkpoints to keep, plus the best."),
        eval_every: int = typer.Option(None, "--eval-every", help="Validate every N steps."),
        log_every: int = typer.Option(None, "--log-every", show_default=_shown("telemetry.log_every"), help="Log every N steps."),
        allow_config_change: bool = typer.Option(None, "--allow-config-change", show_default=_shown("allow_config_change"), help="Resume despite changes."),
        break_lock: bool = typer.Option(
            None, "--break-lock", show_default=_shown("break_lock"), help="Take over RUN's lock left by a run on another host known dead (docs/training.md)."),
        allow_incomplete: bool = typer.Option(
            None, "--allow-incomplete",
            show_default=_shown("allow_incomplete"), help="Train on the committed shards of an unfinished cache (refused otherwise; the run says how many "
                 "samples of how many it trains on).",
        ),
        progress: bool = typer.Option(None, "--progress/--no-progress", show_default=_shown("telemetry.progress"), help="Show the progress bar."),
        print_config: bool = typer.Option(
            False, "--print-config",
            help="Print the resolved config (defaults < saved run with --resume < --preset < --config file < options "
                 "< --set) as JSON, which --config reads back, and exit without training.",
        ),
        report_to: str = typer.Option(
            None, "--report-to",
            show_default=_shown("telemetry.report_to"), help="Trackers the metrics also go to, comma-separated: tensorboard, wandb, mlflow, trackio "
                 "(offline; an absent package is skipped with a warning), or none.",
        ),
    ) -> None:
        """Train a DFlash drafter on a hidden-state cache (the stage after extract).

        SIGTERM or a first Ctrl-C stops after the current step with a checkpoint and exits 130 (resume with
        --output RUN --resume); a second Ctrl-C aborts at once.
        """
        from rich.console import Console

        overrides = {
            "cache": cache, "output": output, "resume": resume, "target": target,
            "drafter_gpus": _csv_ints(drafter_gpus), "drafter_processes": drafter_processes, "device": device,
            "drafter.num_draft_layers": num_draft_layers, "drafter.block_size": block_size,
            "drafter.mask_token_id": mask_token_id, "drafter.target_layer_ids": _csv_ints(target_layer_ids),
            "drafter.gamma": gamma, "drafter.max_anchors_per_document": max_anchors,
            "data.token_budget": token_budget, "data.num_buckets": num_buckets,
            "data.boundaries": _csv_ints(bucket_boundaries), "data.validation_fraction": validation_fraction,
            "data.validation_split_by": validation_split_by, "epochs": epochs, "max_steps": max_steps,
            "stop_at_step": stop_at_step, "grad_accum_steps": grad_accum_steps, "optim.lr": lr,
            "optim.betas": [float(b) for b in betas.split(",")] if betas else None, "optim.weight_decay": weight_decay,
            "optim.warmup_ratio": warmup_ratio, "optim.grad_clip": grad_clip, "seed": seed, "mixed_precision": mixed_precision,
            "residual_dtype": residual_dtype, "compile": compile_layers, "anchor_slots": anchor_slots,
            "data.max_documents_per_batch": max_documents,
            "min_supervised_tokens": min_supervised_tokens,
            "save_every": save_every, "keep_last": keep_last, "eval_every": eval_every, "telemetry.log_every": log_every,
            "allow_config_change": allow_config_change, "break_lock": break_lock, "allow_incomplete": allow_incomplete, "telemetry.progress": progress,
            "telemetry.report_to": report_to.split(",") if report_to else None,
            "attention_backend": attention_backend, "ce_kernel": ce_kernel,
        }  # fmt: skip
        config = config_from_cli(overrides, config_file, preset=preset, sets=sets, announce=not print_config)
        if print_config:
            print(json.dumps({"train": config.to_dict()}, indent=2))
            return
        summary = run_training(config)
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every rank runs this command
            Console().print_json(json.dumps(summary, default=str))
        exit_if_interrupted(summary, config)


def _torchrun_main() -> None:
    """``torchrun ... -m stages.train --cache C --output RUN``: every rank runs the same command."""
    app = typer.Typer(add_completion=False)
    register(app)
    app()


if __name__ == "__main__":
    _torchrun_main()
