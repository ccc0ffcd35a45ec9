"""``dflash-stages sweep``: train one drafter per hyperparameter combination over one cache; compare them.

Run::

    dflash-stages sweep --cache CACHE --output SWEEP --grid lr=3e-4,6e-4 --grid gamma=4,7
    dflash-stages sweep --cache CACHE --output SWEEP --grid lr=3e-4,6e-4 --set train.max_steps=2000 --run-gpus 0,1,2,3
    dflash-stages sweep --config sweep.toml --print-config

Each ``--grid FIELD=V1,V2,...`` names a :class:`stages.train.config.TrainConfig` field and its values (list-valued
fields take ``:`` between items: ``--grid betas=0.9:0.95,0.9:0.99``). The runs are the cartesian product of the
grid, in the order given; run ``k`` trains into ``SWEEP/<field>=<value>_...``. ``--set train.FIELD=VALUE`` (or
``FIELD=VALUE``) fixes a train field for every run, ``--set sweep.FIELD=VALUE`` sets one of the sweep's own fields
(:class:`SweepConfig`), with the one ``--set`` grammar of every stage (the value is JSON, else a string).

Settings, lowest first: defaults < ``--preset NAME`` (its ``train`` section fixes train fields for every run) <
``--config FILE`` (a ``[sweep]`` section: cache, output, grid, run_gpus...; a ``[train]`` section: the fixed train
fields) < the options given < ``--set``. Everything is checked before any run starts (unknown fields with a
did-you-mean, types, each run's whole TrainConfig); ``--print-config`` prints ``{"sweep": ..., "train": ...}``,
which ``--config`` reads back.

Without ``--run-gpus`` runs go one after the other in this process (CPU, or GPU 0); with ``--run-gpus`` one run per listed
GPU at a time, each in its own ``dflash-stages train`` process (its log in ``RUN/train.log``).

At the end a table compares final train loss, validation loss and implied acceptance length, best validation
loss, steps, skipped steps and throughput; it is also written to ``SWEEP/sweep.json``. A failed run is reported
in the table (and the exit code is 1) without stopping the others. ``--resume`` continues unfinished runs.

The sweep folder is locked for the whole sweep (``dflash.io.locks``: a second sweep into it is refused at once) and
each run's folder by its own ``train`` (in this process or its subprocess).
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import json
import logging
import queue
import re
import subprocess
import sys
import time
import typing
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer

from dflash.errors import ConfigError
from dflash.io.files import atomic_write_text
from dflash.io.locks import output_lock
from dflash.training.telemetry import final_losses, read_metrics
from stages.config.check import check_fields, deep_merge, leaf_paths, matches_type, read_config_file, set_path
from stages.config.exit_status import ExitCode
from stages.config.options import CommandSettings, config_options, setting
from stages.config.presets import load_preset
from stages.config.resolve import nested, parse_sets, printable, resolve_stage_config
from stages.train.config import TrainConfig
from stages.train.launch import run_training

__all__ = ["SweepConfig", "SweepRun", "grid_path", "parse_grid", "plan_sweep", "resolve_sweep", "run_sweep", "summarize_run",
           "register"]

log = logging.getLogger(__name__)


def _parse_value(name: str, text: str, annotation: str) -> Any:
    """Parse one value of field ``name`` from its annotation string (``int | None``, ``list[int] | None``...)."""
    text = text.strip()
    if text.lower() in ("none", "null") and "None" in annotation:
        return None
    try:
        if annotation.startswith(("list[", "tuple[")):
            item = annotation.partition("[")[2]
            item_type = float if item.startswith("float") else str if item.startswith("str") else int
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
        raise ConfigError(f"--grid {name}: cannot read {text!r} as {annotation}") from error
    return text


#: TrainConfig fields a sweep sets itself for every run (its own ``cache``, ``output`` per run, ``resume``).
SWEEP_OWNED = ("cache", "output", "resume")


def parse_grid(options: list[str]) -> dict[str, list[Any]]:
    """``--grid`` items: ``["lr=3e-4,6e-4", "gamma=4"]`` -> ``{"lr": [3e-4, 6e-4], "gamma": [4.0]}`` (typed by
    TrainConfig's annotations).

    Raises:
        ConfigError: malformed item, unknown field (with a did-you-mean), a field the sweep sets itself, or a field
            given twice.
    """
    types = TrainConfig.field_types()
    values: dict[str, list[Any]] = {}
    for option in options:
        name, separator, raw = option.partition("=")
        name = name.strip().replace("-", "_")
        if name.startswith("train."):
            name = name[len("train."):]
        if not separator or not raw:
            raise ConfigError(f"--grid {option!r}: expected FIELD=V1,V2,..., e.g. --grid lr=3e-4,6e-4")
        path = grid_path(name)
        if path is None:
            names = sorted(set(types) | {p.rsplit(".", 1)[-1] for p in types})
            close = difflib.get_close_matches(name, names, n=1)
            raise ConfigError(f"--grid {name}: not a train config field; "
                              + (f"did you mean {close[0]}?" if close else f"known fields: {', '.join(sorted(types))}"))
        if name in SWEEP_OWNED:
            raise ConfigError(f"--grid {name}: the sweep sets it itself; give it as the sweep's own --{name}")
        if name in values:
            raise ConfigError(f"--grid {name} given twice; list all its values in one option: {name}=V1,V2")
        values[name] = _grid_values(name, raw, types[path])
    return values


def _grid_values(name: str, raw: str, annotation: str) -> list[Any]:
    """The values of one ``--grid`` item: ``V1,V2`` (lists written ``256:512``), or a JSON array of values, the
    ``--set`` syntax (``[[256, 512], [1024, 2048]]``, ``[3e-4, 6e-4]``), each checked against the field's type.

    Raises:
        ConfigError: an unreadable value, a JSON value that is not a non-empty array, or a value of the wrong type.
    """
    if not raw.lstrip().startswith("["):
        return [_parse_value(name, part, annotation) for part in raw.split(",")]

    try:
        items = json.loads(raw)
    except json.JSONDecodeError as error:
        raise ConfigError(f"--grid {name}: invalid JSON array {raw!r} ({error.msg}); write V1,V2 or a JSON array "
                          "such as [[256, 512], [1024, 2048]]") from None
    if not isinstance(items, list) or not items:
        raise ConfigError(f"--grid {name}: expected a non-empty JSON array of values, got {raw!r}")
    hint = _field_hint(grid_path(name))
    for item in items:
        if not matches_type(item, hint):
            raise ConfigError(f"--grid {name}: cannot read {json.dumps(item)} as {annotation}")
    return items


def _field_hint(path: str) -> Any:
    """The type annotation of the :class:`TrainConfig` field at dotted ``path`` (``optim.lr`` -> ``float``)."""
    klass: Any = TrainConfig
    *parents, leaf = path.split(".")
    for part in parents:
        klass = typing.get_type_hints(klass)[part]
    return typing.get_type_hints(klass)[leaf]


def grid_path(name: str) -> str | None:
    """The :class:`TrainConfig` field a grid key names: its dotted path (``optim.lr``), or a field's last part where
    only one field ends so (``lr``: the run folders keep the key as written, ``lr=0.0003``); None if none does."""
    types = TrainConfig.field_types()
    if name in types:
        return name
    matches = [path for path in types if path.rsplit(".", 1)[-1] == name]
    return matches[0] if len(matches) == 1 else None


@dataclass(kw_only=True)
class SweepConfig:
    """The sweep's own settings (``[sweep]`` of a config file, ``--set sweep.FIELD=VALUE``). Each field's help is its
    one description (``--help``, docs/config-reference.md)."""

    cache: str | None = setting(None, help="Hidden-state cache shared by every run. Required (here or in "
                                "--config/--set).")
    output: str | None = setting(None, short="-o", help="Sweep folder, one run folder per combination (default: "
                                 "./sweep-<time>).")
    grid: dict[str, list[Any]] = setting(
        default_factory=dict, parse=parse_grid, repeat=True,
        help="FIELD=V1,V2,... (a TrainConfig field and its values; one value fixes it; lists as 256:512), or "
             "FIELD=JSON-ARRAY of the values ('boundaries=[[256,512],[1024]]'). Repeatable.")
    run_gpus: list[int] | None = setting(None, help="GPU ids the runs share, e.g. 0,1,2: one run per GPU at a time, "
                                         "each training on its one GPU (default: one run after the other).")
    resume: bool = setting(False, option="--resume", help="Continue unfinished runs of an earlier sweep.")
    break_lock: bool = setting(False, option="--break-lock", help="Take over locks of the sweep and its runs left on "
                               "another host known dead.")

    def __post_init__(self) -> None:
        for name, values in self.grid.items():
            if not isinstance(values, list) or not values:
                raise ConfigError(f"grid: {name} needs a non-empty list of values, got {values!r}")
        if self.run_gpus is not None and (not self.run_gpus or any(g < 0 for g in self.run_gpus)
                                          or len(set(self.run_gpus)) != len(self.run_gpus)):
            raise ConfigError(f"run_gpus: expected a non-empty list of distinct GPU ids >= 0, got {self.run_gpus!r}")


def _split_sets(overrides: list[str]) -> tuple[list[str], list[str]]:
    """``--set`` items -> (``sweep.X=V`` items, the others: train fields fixed for every run). A train item of
    several comma-separated values is refused (a grid's job)."""
    sweep_items = [item for item in overrides if item.strip().startswith("sweep.")]
    train_items = [item for item in overrides if item not in sweep_items]
    for key, value, source in parse_sets(train_items, "train"):
        if isinstance(value, str) and "," in value and key in TrainConfig.field_types():  # key: a field's path
            written = source.partition(" ")[2].partition("=")[0]  # the key as the user wrote it (lr or optim.lr)
            raise ConfigError(f"{source}: --set fixes one value; sweep several with --grid {written}={value}")
    return sweep_items, train_items


def _not_owned(fixed: dict[str, Any]) -> dict[str, Any]:
    """The train fields fixed for every run, refusing those the sweep sets per run (:data:`SWEEP_OWNED`).

    Raises:
        ConfigError: ``KEY: the sweep sets it ...`` (``resolve_stage_config`` adds the key's source).
    """
    owned = sorted(set(fixed) & set(SWEEP_OWNED))
    if owned:
        raise ConfigError(f"{owned[0]}: the sweep sets it for every run; give it as sweep.{owned[0]} (--{owned[0]})")
    return fixed


def _preset_without_owned(name: str) -> dict[str, Any]:
    """A pipeline preset whose train section never names the sweep's folders (its cache and output are the
    pipeline's, not the sweep's)."""
    data = dict(load_preset(name))
    if isinstance(data.get("train"), dict):
        data["train"] = {k: v for k, v in data["train"].items() if k not in SWEEP_OWNED}
    return data


def resolve_sweep(given: dict[str, Any], *, config_file: str | None, preset: str | None, overrides: list[str],
                  option_names: dict[str, str] | None = None) -> tuple[SweepConfig, dict[str, Any]]:
    """The sweep's config and the train fields fixed for every run, each resolved by ``resolve_stage_config``
    (precedence in the module docstring). ``given``: the sweep options given.

    Raises:
        ConfigError: an unknown or mistyped key (named with its source), a missing cache, or a combination
            TrainConfig refuses.
    """
    sweep_sets, train_sets = _split_sets(overrides)
    config = resolve_stage_config(SweepConfig, "sweep", given=given, config_file=config_file, preset=preset,
                                  overrides=sweep_sets, required=("cache",), option_names=option_names)
    data = read_config_file(config_file) if config_file is not None else {}
    for name, what in (("train", "train fields fixed for every run"), ("sweep", "sweep fields")):
        if name in data and not isinstance(data[name], dict):
            raise ConfigError(f"{name} (--config {config_file}): expected a table of {what}, got "
                              f"{type(data[name]).__name__}")
    sectioned = any(isinstance(data.get(name), dict) for name in ("train", "sweep"))  # a flat file: sweep fields
    fixed = resolve_stage_config(TrainConfig, "train", config_file=config_file if sectioned else None, preset=preset,
                                 overrides=train_sets, read_preset=_preset_without_owned, build=_not_owned)
    for name, options in config.grid.items():
        path = grid_path(name)
        if path is None:
            raise ConfigError(f"sweep.grid.{name}: not a train config field; see --grid in --help")
        source = f"sweep.grid.{name}"
        if path in SWEEP_OWNED:
            raise ConfigError(f"train.{path} ({source}): the sweep sets it for every run; give it as sweep.{path} "
                              f"(--{path})")
        for option in options:
            check_fields(TrainConfig, nested(path, option), section="train", source=lambda _key, s=source: s)
    given_fixed = {key: source for key, _, source in parse_sets(train_sets, "train")}
    if isinstance(data.get("train"), dict):
        given_fixed.update({key: f"--config {config_file}" for key in leaf_paths(data["train"])})
    for name in config.grid:
        if grid_path(name) in given_fixed:
            raise ConfigError(f"train.{name} is both swept (sweep.grid) and fixed ({given_fixed[grid_path(name)]}); keep one")
    return config, fixed


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


def plan_sweep(cache: str, output: str | Path, values: dict[str, list[Any]], *, resume: bool = False,
               fixed: dict[str, Any] | None = None) -> list[SweepRun]:
    """The runs of a sweep: the cartesian product of the multi-valued fields of ``values`` (the grid), its single
    values and ``fixed`` (train field -> value) the same for all.

    Raises:
        ConfigError: an invalid combination (the TrainConfig error, prefixed by the run's name).
    """
    fixed = deep_merge(fixed or {}, {})  # train fields (nested, as to_dict writes them) the same for every run
    for name, options in values.items():
        if len(options) == 1:
            set_path(fixed, grid_path(name) or name, options[0])
    swept_names = [name for name, options in values.items() if len(options) > 1]
    runs = []
    for combination in itertools.product(*(values[name] for name in swept_names)):
        swept = dict(zip(swept_names, combination, strict=True))
        name = _run_name(swept)
        try:
            data = deep_merge(fixed, {"cache": cache, "output": str(Path(output) / name), "resume": resume})
            for key, value in swept.items():
                set_path(data, grid_path(key) or key, value)
            config = TrainConfig.from_dict(data)
        except (ConfigError, TypeError) as error:
            raise ConfigError(f"sweep run {name}: {error}") from error
        if any(run.name == name for run in runs):
            raise ConfigError(f"sweep: two runs would share the folder {Path(output) / name} (the grid repeats a "
                              f"value: {swept}); list each value once")
        runs.append(SweepRun(name=name, swept=swept, config=config))
    return runs


def summarize_run(run_dir: str | Path) -> dict[str, Any]:
    """Final figures of a run folder: the final train and validation losses (:func:`final_losses`), the last train
    record's step, skips and throughput, the best checkpoint."""
    run_dir = Path(run_dir)
    summary: dict[str, Any] = {}
    if (run_dir / "metrics.jsonl").is_file():
        records = read_metrics(run_dir)
        train = [r for r in records if r.get("kind") == "train"]
        final = final_losses(records)
        if train:
            last = train[-1]
            summary.update(step=final["train_step"], train_loss=final["train_loss"], train_tau=final["train_tau"],
                           skipped_steps=last["skipped_steps"], tokens_per_s=last.get("real_tokens_per_s"))
        if final["val_loss"] is not None:
            summary.update(val_loss=final["val_loss"], val_tau=final["val_tau"])
    if (run_dir / "best.json").is_file():
        from dflash.training.checkpoint import read_best_record  # loads torch

        summary["best_val_loss"] = read_best_record(run_dir).get("val_loss")
    return summary


def _run_in_subprocess(run: SweepRun, gpus: queue.Queue[int]) -> None:
    gpu = gpus.get()
    try:
        run_dir = Path(run.config.output)
        run_dir.mkdir(parents=True, exist_ok=True)
        config = run.config.to_dict() | {"drafter_gpus": [gpu], "device": "cuda"}
        config["telemetry"]["progress"] = False
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
    @config_options(SweepConfig, "sweep", shared_help={
        "config": "Settings in a .toml, .yaml or .json file: a \\[sweep] section (cache, output, grid, run_gpus...) "
                  "and a \\[train] section (train fields fixed for every run). Options given override it.",
        "preset": "A pipeline preset of `run` or a .json file of sections: its train section fixes train fields for "
                  "every run.",
        "set": "train.FIELD=VALUE (or FIELD=VALUE) fixes a train field for every run; sweep.FIELD=VALUE sets a sweep "
               "field (JSON value, else a string). Repeatable.",
        "print_config": "Print the resolved config as JSON ({sweep, train}, which --config reads back) and exit "
                        "without doing anything."})
    def sweep_command(settings: CommandSettings) -> None:
        """Train one drafter per combination of --grid values over one cache and compare them."""
        config, fixed = resolve_sweep(settings.given, config_file=settings.config_file, preset=settings.preset,
                                      overrides=settings.sets, option_names=settings.spellings)
        folder = Path(config.output) if config.output else Path(time.strftime("sweep-%Y%m%d-%H%M%S"))
        runs = plan_sweep(config.cache, folder, config.grid, resume=config.resume, fixed=fixed)
        if settings.print_config:
            printed = json.loads(printable("sweep", config))
            printed["sweep"]["output"] = str(folder)
            print(json.dumps({**printed, "train": fixed}, indent=2, default=str))
            raise typer.Exit(0)
        if config.break_lock:
            for run in runs:
                run.config = dataclasses.replace(run.config, break_lock=True)
        with output_lock(folder, what="sweep", break_lock=config.break_lock):
            _preflight(config, runs, folder)  # under the lock, as train checks its cache under its run's lock
            _sweep(runs, folder, config.run_gpus)

    def _preflight(config: SweepConfig, runs: list[SweepRun], folder: Path) -> None:
        """What would make every run fail, refused before the first one starts (one error line, nothing written)."""
        from dflash.cache import CacheReader

        if folder.exists() and not folder.is_dir():
            raise ConfigError(f"sweep.output: {folder} exists and is not a folder; choose another --output")
        CacheReader(config.cache)  # CacheError (exit 2): no cache there, or not one
        wants_cuda = config.run_gpus is not None or any(run.config.device == "cuda" for run in runs)
        if wants_cuda:
            import torch

            visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if not visible:
                raise ConfigError("sweep: the runs need CUDA (--run-gpus, or device cuda), which is not available here")
            if config.run_gpus is not None and max(config.run_gpus) >= visible:
                raise ConfigError(f"sweep.run_gpus: {config.run_gpus} names a GPU this host does not have ({visible} "
                                  f"visible: 0..{visible - 1})")

    def _sweep(runs: list[SweepRun], output: Path, gpu_ids: list[int] | None) -> None:
        from rich.console import Console

        Console(stderr=True).print(f"sweep: {len(runs)} runs into {output}" + (f" on GPUs {gpu_ids}" if gpu_ids else ""))
        run_sweep(runs, gpus=gpu_ids)
        rows = [{"name": r.name, "swept": r.swept, "summary": r.summary, "error": r.error} for r in runs]
        Path(output).mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(output) / "sweep.json", json.dumps({"runs": rows}, indent=2, default=str))
        Console().print(comparison_table(runs))
        if any(r.interrupted for r in runs):
            raise typer.Exit(code=ExitCode.INTERRUPTED)  # a stopped sweep is not a finished one
        if any(r.error for r in runs):
            raise typer.Exit(code=1)
