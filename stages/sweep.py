"""``dflash-stages sweep``: train one drafter per hyperparameter combination over one cache; compare them.

Run::

    dflash-stages sweep --cache CACHE --output SWEEP --set lr=3e-4,6e-4 --set gamma=4,7
    dflash-stages sweep --cache CACHE --output SWEEP --set lr=3e-4,6e-4 --set max_steps=2000 --gpus 0,1,2,3

Each ``--set FIELD=V1,V2,...`` names a :class:`stages.train.TrainConfig` field and its values; a single value
fixes the field for every run. The runs are the cartesian product of the swept values, in the order given; run
``k`` trains into ``SWEEP/<field>=<value>_...``. Without ``--gpus`` runs go one after the other in this process
(CPU, or GPU 0); with ``--gpus`` one run per listed GPU at a time, each in its own ``dflash-stages train``
process (its log in ``RUN/train.log``). List-valued fields take ``:`` between items (``--set betas=0.9:0.95``).

At the end a table compares final train loss, validation loss and implied acceptance length, best validation
loss, steps, skipped steps and throughput; it is also written to ``SWEEP/sweep.json``. A failed run is reported
in the table (and the exit code is 1) without stopping the others. ``--resume`` continues unfinished runs.

The sweep folder is locked for the whole sweep (``dflash.locks``: a second sweep into it is refused at once) and
each run's folder by its own ``train`` (in this process or its subprocess).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import queue
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer

from dflash.checkpoint import atomic_write_text
from dflash.errors import ConfigError
from dflash.telemetry import read_metrics
from stages.train import TrainConfig, run_training

__all__ = ["SweepRun", "parse_set_options", "plan_sweep", "run_sweep", "summarize_run", "register"]

log = logging.getLogger(__name__)


def _parse_value(name: str, text: str, annotation: str) -> Any:
    """Parse one value of field ``name`` from its annotation string (``int | None``, ``list[int] | None``...)."""
    text = text.strip()
    if text.lower() in ("none", "null") and "None" in annotation:
        return None
    try:
        if annotation.startswith(("list[", "tuple[")):
            item_type = float if "float" in annotation else int
            return [item_type(part) for part in text.split(":") if part]
        if annotation.startswith("bool"):
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return text.lower() in ("true", "1", "yes")
        if annotation.startswith("int"):
            return int(text)
        if annotation.startswith("float"):
            return float(text)
    except ValueError as error:
        raise ConfigError(f"--set {name}: cannot read {text!r} as {annotation}") from error
    return text


def parse_set_options(options: list[str]) -> dict[str, list[Any]]:
    """``["lr=3e-4,6e-4", "gamma=4"]`` -> ``{"lr": [3e-4, 6e-4], "gamma": [4.0]}`` (typed by TrainConfig).

    Raises:
        ConfigError: malformed option, unknown field (with the known ones), or a field set twice.
    """
    types = TrainConfig.field_types()
    values: dict[str, list[Any]] = {}
    for option in options:
        name, separator, raw = option.partition("=")
        name = name.strip().replace("-", "_")
        if not separator or not raw:
            raise ConfigError(f"--set expects FIELD=V1,V2,..., got {option!r}")
        if name not in types:
            raise ConfigError(f"--set {name}: not a train config field; known fields: {', '.join(sorted(types))}")
        if name in ("cache", "output", "resume"):
            raise ConfigError(f"--set {name}: give it as the sweep's own --{name} option")
        if name in values:
            raise ConfigError(f"--set {name} given twice; list all its values in one option: {name}=V1,V2")
        values[name] = [_parse_value(name, part, types[name]) for part in raw.split(",")]
    return values


@dataclass(kw_only=True)
class SweepRun:
    """One combination: its name, the swept values and the full train config."""

    name: str
    swept: dict[str, Any]
    config: TrainConfig
    summary: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    interrupted: bool = False


def _run_name(swept: dict[str, Any]) -> str:
    if not swept:
        return "run"
    parts = []
    for name, value in swept.items():
        text = ":".join(str(v) for v in value) if isinstance(value, list | tuple) else str(value)
        parts.append(f"{name}={text}")
    return re.sub(r"[^A-Za-z0-9_.=:+-]", "_", "_".join(parts))


def plan_sweep(cache: str, output: str | Path, values: dict[str, list[Any]], *, resume: bool = False) -> list[SweepRun]:
    """The runs of a sweep: the cartesian product of the multi-valued fields, single values fixed for all.

    Raises:
        ConfigError: an invalid combination (the TrainConfig error, prefixed by the run's name).
    """
    fixed = {name: options[0] for name, options in values.items() if len(options) == 1}
    swept_names = [name for name, options in values.items() if len(options) > 1]
    runs = []
    for combination in itertools.product(*(values[name] for name in swept_names)):
        swept = dict(zip(swept_names, combination, strict=True))
        name = _run_name(swept)
        try:
            config = TrainConfig(cache=cache, output=str(Path(output) / name), resume=resume, **fixed, **swept)
        except (ConfigError, TypeError) as error:
            raise ConfigError(f"sweep run {name}: {error}") from error
        runs.append(SweepRun(name=name, swept=swept, config=config))
    return runs


def summarize_run(run_dir: str | Path) -> dict[str, Any]:
    """Final figures of a run folder: last train record, last validation record, best checkpoint."""
    run_dir = Path(run_dir)
    summary: dict[str, Any] = {}
    if (run_dir / "metrics.jsonl").is_file():
        train = read_metrics(run_dir, kind="train")
        val = read_metrics(run_dir, kind="val")
        if train:
            last = train[-1]
            summary.update(
                step=last["step"], train_loss=last["loss"], train_tau=last["expected_acceptance_length"],
                skipped_steps=last["skipped_steps"], tokens_per_s=last.get("real_tokens_per_s"),
            )
        if val:
            summary.update(val_loss=val[-1]["loss"], val_tau=val[-1]["expected_acceptance_length"])
    if (run_dir / "best.json").is_file():
        summary["best_val_loss"] = json.loads((run_dir / "best.json").read_text())["val_loss"]
    return summary


def _run_in_subprocess(run: SweepRun, gpus: queue.Queue[int]) -> None:
    gpu = gpus.get()
    try:
        run_dir = Path(run.config.output)
        run_dir.mkdir(parents=True, exist_ok=True)
        config = run.config.to_dict() | {"drafter_gpus": [gpu], "device": "cuda", "progress": False}
        config_file = run_dir / "sweep_config.json"
        atomic_write_text(config_file, json.dumps(config, indent=2))
        command = [sys.executable, "-m", "stages.cli", "train", "--config", str(config_file)]
        with open(run_dir / "train.log", "a", encoding="utf-8") as log_file:
            result = subprocess.run(command, stdout=log_file, stderr=subprocess.STDOUT, check=False)
        if result.returncode != 0:
            run.error = f"exit code {result.returncode} on GPU {gpu}; see {run_dir / 'train.log'}"
    finally:
        gpus.put(gpu)


def run_sweep(runs: list[SweepRun], *, gpus: list[int] | None = None) -> list[SweepRun]:
    """Train every run (sequentially here, or one per GPU in parallel); fill ``summary`` / ``error``."""
    if gpus:
        free: queue.Queue[int] = queue.Queue()
        for gpu in gpus:
            free.put(gpu)
        with ThreadPoolExecutor(max_workers=len(gpus), thread_name_prefix="sweep") as pool:
            futures = [pool.submit(_run_in_subprocess, run, free) for run in runs]
            for future in futures:
                future.result()
    else:
        for index, run in enumerate(runs):
            log.info("sweep run %d/%d: %s", index + 1, len(runs), run.name)
            try:
                result = run_training(run.config)
            except Exception as error:  # one failed combination must not stop the sweep
                log.exception("sweep run %s failed", run.name)
                run.error = f"{type(error).__name__}: {error}"
                continue
            if result.get("stopped_by_signal"):  # SIGTERM / first Ctrl-C: checkpoint saved; start no further run
                run.error = f"interrupted at step {result.get('step')} (checkpoint saved; rerun the sweep with --resume)"
                run.interrupted = True
                break
    for run in runs:
        run.summary = summarize_run(run.config.output)
    return runs


def comparison_table(runs: list[SweepRun]):
    """A rich table of the runs, best validation loss first (train loss when there is no validation)."""
    from rich.table import Table

    def key(run: SweepRun) -> tuple[int, float]:
        s = run.summary
        value = s.get("best_val_loss", s.get("val_loss", s.get("train_loss")))
        return (run.error is not None or value is None, value if value is not None else 0.0)

    swept_names = list(runs[0].swept) if runs else []
    table = Table(title="sweep")
    for name in ["run", *swept_names, "step", "train loss", "val loss", "val tau", "best val", "skipped", "tok/s"]:
        table.add_column(name, justify="left" if name == "run" else "right")

    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for run in sorted(runs, key=key):
        s = run.summary
        cells = [run.name, *(str(run.swept[name]) for name in swept_names)]
        if run.error:
            cells += [str(s.get("step", "-")), f"[red]failed: {run.error}"] + ["-"] * 5
        else:
            cells += [
                str(s.get("step", "-")), fmt(s.get("train_loss"), ".4f"), fmt(s.get("val_loss"), ".4f"),
                fmt(s.get("val_tau"), ".3f"), fmt(s.get("best_val_loss"), ".4f"), str(s.get("skipped_steps", "-")),
                fmt(s.get("tokens_per_s"), ",.0f"),
            ]
        table.add_row(*cells)
    return table


def register(app: typer.Typer) -> None:
    """Add the ``sweep`` command to the ``dflash-stages`` app."""
    @app.command("sweep")
    def sweep_command(
        cache: str = typer.Option(..., "--cache", help="Hidden-state cache shared by every run."),
        output: Path = typer.Option(
            None, "--output", "-o", help="Sweep folder, one run folder per combination (default: ./sweep-<time>)."
        ),
        set_options: list[str] = typer.Option(
            [], "--set", help="FIELD=V1,V2,... (a TrainConfig field; one value fixes it). Repeatable."
        ),
        gpus: str = typer.Option(None, "--gpus", help="GPU ids; one run per GPU at a time (default: sequential)."),
        resume: bool = typer.Option(False, "--resume", help="Continue unfinished runs of an earlier sweep."),
        break_lock: bool = typer.Option(
            False, "--break-lock", help="Take over locks of the sweep and its runs left on another host known dead."),
    ) -> None:
        """Train one drafter per combination of --set values over one cache and compare them."""
        from dflash.locks import output_lock

        values = parse_set_options(set_options)
        if output is None:
            output = Path(time.strftime("sweep-%Y%m%d-%H%M%S"))
        runs = plan_sweep(cache, output, values, resume=resume)
        if break_lock:
            for run in runs:
                run.config = dataclasses.replace(run.config, break_lock=True)
        with output_lock(output, what="sweep", break_lock=break_lock):
            _sweep(runs, output, gpus)

    def _sweep(runs: list[SweepRun], output: Path, gpus: str | None) -> None:
        from rich.console import Console

        gpu_ids = [int(g) for g in gpus.split(",")] if gpus else None
        Console(stderr=True).print(f"sweep: {len(runs)} runs into {output}" + (f" on GPUs {gpu_ids}" if gpu_ids else ""))
        run_sweep(runs, gpus=gpu_ids)
        rows = [{"name": r.name, "swept": r.swept, "summary": r.summary, "error": r.error} for r in runs]
        Path(output).mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(output) / "sweep.json", json.dumps({"runs": rows}, indent=2, default=str))
        Console().print(comparison_table(runs))
        if any(r.interrupted for r in runs):
            from stages.cli import ExitCode

            raise typer.Exit(code=ExitCode.INTERRUPTED)  # a stopped sweep is not a finished one
        if any(r.error for r in runs):
            raise typer.Exit(code=1)
