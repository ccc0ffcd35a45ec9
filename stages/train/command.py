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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import typer

from dflash.errors import ConfigError, ConfigPathNotFoundError
from stages.config.check import deep_merge, get_path, set_path
from stages.config.exit_status import ExitCode
from stages.config.options import CommandSettings, config_options
from stages.config.resolve import resolve_stage_config
from stages.train.config import ABSENT_IN_OLD_RUNS, TrainConfig
from stages.train.launch import run_training

__all__ = ["config_from_cli", "exit_if_interrupted", "register"]

log = logging.getLogger(__name__)


# ====================================================================== CLI


def config_from_cli(given: dict[str, Any], config_file: str | Path | None = None, *, preset: str | None = None,
                    sets: Sequence[str] = (), announce: bool = True,
                    option_names: dict[str, str] | None = None,
                    read_preset: Callable[[str], dict[str, Any]] | None = None) -> TrainConfig:
    """Build the config with ``stages.config.resolve.resolve_stage_config``, lowest first: the saved run config
    (with --resume) < the preset's ``train`` section < the --config file (its ``train`` section, or its top level: a
    run.json too) < the options given (``given``: dotted field path -> value, None for an option not given) <
    ``--set``; what none of them sets on a CPU host gets :data:`CPU_SIZED_DEFAULTS`. Every layer is checked before
    anything runs. ``read_preset``: the presets' reader where they are not the pipeline presets (online's).

    Raises:
        ConfigError: an unknown key, a wrong type or a refused value, named with its source; --resume of a folder
            that holds no run.
    """
    given = {key: value for key, value in given.items() if value is not None}
    config, sized = resolve_stage_config(
        TrainConfig, "train", config_file=config_file, preset=preset, overrides=sets, given=given,
        option_names=option_names, base=_saved_run, fill=_size_defaults_for_cpu, build=TrainConfig.from_dict,
        read_preset=read_preset)
    if sized and announce:
        log.info("training on CPU: %s (the GPU-sized defaults would need tens of GB per step here; set them to "
                 "override)", ", ".join(f"{key} {value}" for key, value in sized.items()))
    return config


def _saved_run(upper: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
    """The lowest layer of a ``--resume``: the saved config of the run in ``output`` (the layers above it in
    ``upper``), with what runs saved before a field existed meant (:data:`ABSENT_IN_OLD_RUNS`); None for a new run.

    Raises:
        ConfigError: ``--resume`` of a folder that holds no run and no ``cache`` to start one, or a damaged
            run.json.
    """
    output = upper.get("output")
    if not upper.get("resume") or not output:
        return None
    run_json = Path(output) / "run.json"
    if not run_json.is_file():
        if upper.get("cache"):
            return None
        raise ConfigPathNotFoundError(
            f"--resume: {output} holds no run (no run.json); point --output at an existing run, or start a new run "
            "with --cache"
        )
    from dflash.training.checkpoint import read_run_record  # loads torch: only for a resume

    try:
        saved = read_run_record(run_json.parent)["config"]
        if not isinstance(saved, dict):
            raise TypeError("config is not an object")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"--resume: {run_json} is not a readable run record ({error}); it is damaged: restore "
                          "it, or start a new run in another --output") from None
    for one_off in ("stop_at_step", "allow_config_change", "break_lock"):  # they applied to the earlier invocation only
        saved.pop(one_off, None)
    return deep_merge(ABSENT_IN_OLD_RUNS, saved), f"the saved run {run_json}"


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


def register(app: typer.Typer) -> None:
    """Add the ``train`` command to the ``dflash-stages`` app: its options are :class:`TrainConfig`'s fields
    (``stages.config.options``)."""
    @app.command("train")
    @config_options(TrainConfig, "train", shared_help={
        "config": "TrainConfig fields in a .toml, .yaml or .json file (its train section, or at the top; a run.json "
                  "too) to start from; options given override it.",
        "preset": "A shipped preset (stages/config/presets) or a .json file: its train section, under --config.",
        "print_config": "Print the resolved config (defaults < saved run with --resume < --preset < --config file < "
                        "options < --set) as JSON, which --config reads back, and exit without training."})
    def train_command(settings: CommandSettings) -> None:
        """Train a DFlash drafter on a hidden-state cache (the stage after extract).

        SIGTERM or a first Ctrl-C stops after the current step with a checkpoint and exits 130 (resume with
        --output RUN --resume); a second Ctrl-C aborts at once.
        """
        from rich.console import Console

        config = config_from_cli(settings.given, settings.config_file, preset=settings.preset, sets=settings.sets,
                                 announce=not settings.print_config, option_names=settings.spellings)
        if settings.print_config:
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
