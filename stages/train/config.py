"""The train command's configuration: :class:`TrainConfig`, its fields, and which of them a resume may change
(:data:`RUNTIME_FIELDS`)."""


from __future__ import annotations

import dataclasses
import logging
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any, Literal

from dflash.batches.source import LoaderConfig
from dflash.drafter.config import DrafterTrainingConfig
from dflash.errors import ConfigError
from dflash.training.optim import OptimConfig
from dflash.training.telemetry import TelemetryConfig
from dflash.values import check_seed, finite_number
from stages.config.check import (
    MISSING_DEFAULT,
    dtype_spelling,
    field_default,
    leaf_paths,
    nested_config,
    runtime_paths,
)
from stages.config.options import setting

__all__ = ["TrainConfig", "RUNTIME_FIELDS", "ABSENT_IN_OLD_RUNS", "default_leaves"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything the ``train`` stage needs; saved resolved in ``RUN/run.json`` and in every checkpoint."""

    # -- inputs and outputs
    cache: str = setting(help="Hidden-state cache written by extract (local folder or fsspec URL). Required for a new run (here or in --config/--preset/--set).")
    output: str = setting(help="Run folder: run.json, metrics.jsonl, tb/, checkpoints/, latest, best. Required (here or in --config/--preset/--set).", short="-o")
    target: str | None = setting(None, help="Target spec: 'default', a transformers folder or a .gguf file (default: the target_spec recorded in the cache).")
    resume: bool = setting(False, help="Continue the run in --output from its latest checkpoint.")
    allow_config_change: bool = setting(False, runtime=True, help="Resume even when settings that change the trajectory differ from the saved run's (the result then differs from a straight run).", option="--allow-config-change")
    break_lock: bool = setting(False, runtime=True, help="Take over the run folder's lock although its owner record names another host (that run must be known dead; docs/training.md). A same-host stale lock (a killed run) is taken over without it.", option="--break-lock")
    allow_incomplete: bool = setting(False, runtime=True, help="Train on the committed shards of a cache whose planned shards are not all committed (the run logs how many samples of how many planned rows it trains on); without it such a cache is refused before step 1.", option="--allow-incomplete")
    # -- drafter and objective
    #: The drafter and objective (``dflash.drafter.config.DrafterTrainingConfig``: num_draft_layers, block_size,
    #: mask_token_id, target_layer_ids, gamma, max_anchors_per_document); ``[train.drafter]`` in a config file,
    #: ``--set train.drafter.block_size=8``.
    drafter: DrafterTrainingConfig = field(default_factory=DrafterTrainingConfig)
    # -- data
    #: What the run reads and how (``dflash.batches.source.LoaderConfig``: token_budget, boundaries, num_buckets,
    #: max_documents_per_batch, validation_fraction, validation_split_by, prefetch_batches, num_read_workers,
    #: shard_window); ``[train.data]`` in a config file, ``--set train.data.token_budget=8192``. The train stage holds
    #: out 1% of the source documents by default (``validation_fraction`` 0.01, ``validation_split_by``
    #: ``"document"``; rows of a cache without document keys; 0 disables validation and best-checkpoint tracking).
    data: LoaderConfig = field(default_factory=lambda: dataclasses.replace(_TRAIN_DATA_DEFAULTS))
    #: Validation batches per rank per evaluation (None: the whole held-out split).
    max_validation_batches: int | None = field(default=50, metadata={"runtime": True})
    min_supervised_tokens: int | None = setting(None, help="Exclude samples with fewer supervised (loss_mask = 1) tokens; they are counted and reported (run.json, metrics, log). Default: 2 x drafter.block_size (shorter samples give no useful anchors; docs/dflash.md); 0 keeps every sample.")
    min_train_samples: int = field(default=8, metadata={"help": (
        "Refuse to train (before any model loads) when fewer samples than this are left for training, after the "
        "samples excluded by min_supervised_tokens and those held out for validation.")})
    # -- optimization (defaults: the paper's recipe; betas from SpecForge, see dflash.training.optim)
    epochs: float = setting(6.0, help="Passes over the training split (the paper's recipe: 6); ignored when --max-steps is set.")
    max_steps: int | None = setting(None, help="Optimizer steps of the whole schedule (overrides --epochs).")
    grad_accum_steps: int = setting(1, help="Micro-batches per rank per optimizer step.")
    #: Optimizer, lr schedule and clipping (``dflash.training.optim.OptimConfig``: lr, betas, eps, weight_decay,
    #: warmup_ratio, min_lr_ratio, grad_clip); ``[train.optim]`` in a config file, ``--set train.optim.lr=3e-4``.
    optim: OptimConfig = field(default_factory=OptimConfig)
    seed: int = setting(0, help="Seed of the initial weights, the data order and the anchors.")
    mixed_precision: Literal["bf16", "none"] = setting("bf16", help="bf16 autocast on GPU | none (CPU always runs fp32).")
    residual_dtype: Literal["compute", "float32"] = setting("compute", help="Residual stream of the block tokens: compute (the autocast dtype, bf16, as serving runs the drafter) | float32 (the parameter dtype). Only matters with mixed precision.")
    compile: bool = setting(False, help="torch.compile the draft layers on the fixed-shape path: every micro-batch padded to data.token_budget and --anchor-slots anchor slots, so one graph serves every step (default: eager, dynamic shapes).")
    anchor_slots: int | None = setting(None, help="Anchors per micro-batch with --compile (default: drafter.max_anchors_per_document x data.max_documents_per_batch, capped at data.token_budget); of more valid anchors a uniform random subset is kept.")
    # -- runtime (never changes the trajectory)
    device: Literal["auto", "cpu", "cuda"] = setting("auto", runtime=True, help="Where the drafter trains: auto (CUDA when available) | cpu | cuda.")
    drafter_gpus: list[int] | None = setting(None, runtime=True, help="Drafter GPU ids, e.g. 5,6,7; several: DDP, one process per GPU.")
    drafter_processes: int = setting(1, runtime=True, help="Data-parallel drafter processes on CPU (gloo), for tests and debugging.")
    stop_at_step: int | None = setting(None, runtime=True, help="Stop after this step with a checkpoint, as a preemption would (the schedule still spans --max-steps).")
    save_every: int = setting(500, runtime=True, help="Checkpoint every N optimizer steps (and at the end).")
    keep_last: int = setting(3, runtime=True, help="Checkpoints kept besides the best by validation loss.")
    eval_every: int | None = setting(None, runtime=True, help="Validate every N steps (default: --save-every, so each checkpoint has a validation loss).")
    # save_every, eval_every and keep_last stay here rather than in a nested config: the cadence of checkpoints and
    # validation is the trainer's own loop (which steps save, which validate, eval_every defaulting to save_every so
    # that the best-by-validation checkpoint has a loss at each one); the checkpointer only takes keep_last, and
    # ``dflash.training.checkpoint`` loads torch, which a config declared there would load for every CLI call.
    #: What the run reports and how often (``dflash.training.telemetry.TelemetryConfig``: log_every,
    #: throughput_window, progress, report_to); ``[train.telemetry]`` in a config file,
    #: ``--set train.telemetry.log_every=50``.
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    attention_backend: Literal["auto", "flash", "triton"] | None = setting(None, runtime=True, help="Kernels of the drafter's FlexAttention (GPU only): auto (flash-attn-4's where installed and usable, else Triton's) | flash | triton (default: $DFLASH_ATTENTION_BACKEND, else auto). Every rank applies it (and sets the variable for the processes it starts). A resume may change it.")
    ce_kernel: Literal["auto", "triton", "inductor", "eager"] | None = setting(None, runtime=True, help="Per-chunk softmax/cross-entropy kernel of the loss (GPU only): auto (Triton where it runs, else the compiled chunk) | triton | inductor | eager (default: $DFLASH_CE_KERNEL, else auto). For benchmarking; every rank applies it. A resume may change it.")

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
        if not isinstance(self.min_train_samples, int) or isinstance(self.min_train_samples, bool) \
                or self.min_train_samples < 1:
            raise ConfigError(f"min_train_samples must be an integer >= 1, got {self.min_train_samples!r}")
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
        """Build from :meth:`to_dict`'s form."""
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


#: Fields a resume may change freely (a nested config's field by its dotted path, ``data.prefetch_batches``): the
#: run's identity (its cache, output and target are checked on their own) and the fields declared ``runtime``, which
#: never change what is computed (``stages.config.check.runtime_paths``).
RUNTIME_FIELDS = frozenset({"cache", "output", "target", "resume"}) | runtime_paths(TrainConfig)


#: Fields added after runs already existed whose absence in a saved config means something other than today's
#: default (runs saved before ``residual_dtype`` existed kept the residual stream in float32; runs saved before
#: ``data.validation_split_by`` existed held out validation rows, not documents). Nested like the config; merged
#: under a saved config with ``deep_merge``.
ABSENT_IN_OLD_RUNS: dict[str, Any] = {"residual_dtype": "float32", "data": {"validation_split_by": "row"}}


def default_leaves() -> dict[str, Any]:
    """Dotted path -> default of every field with one (nested configs' leaves: ``optim.lr``, from the default
    instance the field makes: ``data.validation_fraction`` is train's 0.01, not the loader's 0.0)."""
    values: dict[str, Any] = {}
    for f in fields(TrainConfig):
        default = field_default(f)
        if default is not MISSING_DEFAULT:
            values[f.name] = asdict(default) if is_dataclass(default) else default
    return leaf_paths(values)
