"""Stage 2, ``train``: stream a hidden-state cache into DFlash drafter training (DDP, exact resume).

Run::

    dflash-stages train --cache CACHE --output RUN                      # one process (GPU 0, or CPU)
    dflash-stages train --cache CACHE --output RUN --drafter-gpus 5,6,7 # DDP, one process per listed GPU
    torchrun --nproc-per-node 3 -m stages.train.command --cache CACHE --output RUN   # same, launched by torchrun
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
(``dflash.training.optim.extend_schedule``; docs/training.md, Resume), never train on at the finished schedule's floor.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import typer

from dflash.errors import ConfigError, ConfigPathNotFoundError
from stages.config.check import (
    check_fields,
    deep_merge,
    get_path,
    leaf_paths,
    read_config_file,
    set_path,
)
from stages.config.exit_status import ExitCode
from stages.config.resolve import nested, parse_sets, section_of, without_key
from stages.train.config import ABSENT_IN_OLD_RUNS, TrainConfig, default_leaves
from stages.train.launch import run_training

__all__ = ["config_from_cli", "exit_if_interrupted", "register"]

log = logging.getLogger(__name__)


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
    (``stages.config.resolve``). Every layer is checked before anything runs.

    Raises:
        ConfigError: an unknown key, a wrong type or a refused value, named with its source; --resume of a folder
            that holds no run.
    """
    known = {f.name for f in fields(TrainConfig)}
    base: dict[str, Any] = {}
    origin: dict[str, str] = {}  # key -> where its value came from, for the messages
    if preset is not None:
        from stages.config.presets import load_preset

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
        if value is not None:
            given = deep_merge(given, nested(key, value))
    output = overrides.get("output") or base.get("output")
    run_json = Path(output) / "run.json" if output else None
    if overrides.get("resume") and run_json is not None and not run_json.is_file() and not overrides.get("cache") \
            and not base.get("cache"):
        raise ConfigPathNotFoundError(
            f"--resume: {output} holds no run (no run.json); point --output at an existing run, or start a new run "
            "with --cache"
        )
    if overrides.get("resume") and run_json is not None and run_json.is_file():
        from dflash.training.checkpoint import read_run_record  # loads torch: only for a resume

        try:
            saved = read_run_record(run_json.parent)["config"]
            if not isinstance(saved, dict):
                raise TypeError("config is not an object")
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


def _field_help(name: str) -> str:
    """A TrainConfig field's one line of help (its ``metadata["help"]``)."""
    return next(f.metadata["help"] for f in fields(TrainConfig) if f.name == name)


def _shown(name: str) -> str:
    """``--help``'s ``[default: ...]`` of a train option: its :class:`TrainConfig` field's default (options default
    to ``None`` so that a saved run, preset or file fills what the command line leaves out). ``name``: the field's
    dotted path (``optim.lr``)."""
    default = default_leaves()[name]
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
        min_train_samples: int = typer.Option(None, "--min-train-samples", show_default=_shown("min_train_samples"), help=_field_help("min_train_samples")),
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
            "min_supervised_tokens": min_supervised_tokens, "min_train_samples": min_train_samples,
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
    """``torchrun ... -m stages.train.command --cache C --output RUN``: every rank runs the same command."""
    app = typer.Typer(add_completion=False)
    register(app)
    app()


if __name__ == "__main__":
    _torchrun_main()
