"""``dflash-stages diff A B``: what differs between two runs (or checkpoints, exports) and what it did to speed.

A and B are run folders, checkpoint folders or serving-format exports. Three comparisons, each key once:

- config: the train config (``run.json`` ``config``, or a checkpoint's ``trainer_state.json``), the drafter config,
  the target and the resolved values (``resolved.*``: gamma, anchor slots, attention, buckets...). A change is
  listed under the first section that has it (``config.block_size``, not again as ``drafter.block_size``); left
  out: the output folder (the path being compared), the bucket table's batch counts (a consequence of the batch
  settings) and the cache metadata (its fingerprint is in the environment).
- environment (``run.json`` ``environment``, :func:`dflash.training.checkpoint.collect_environment`): Python, library
  versions, CUDA build, GPUs and driver, CPU model and thread counts, behaviour-changing environment variables,
  code commit / dirty flag / diff hash, cache and corpus fingerprints, compile. The command line is not compared
  (the config is what it resolved to).
- performance, from the ``train`` records of each run's ``metrics.jsonl`` (the first record, holding start-up, is
  left out when there are three or more): medians of real/padded/supervised tokens/s, of the step time and its
  split (data wait / forward / backward / optimizer), and per length bucket.

- quality: the evaluated tau of a run (:func:`stages.forensics.runs.evaluated_tau`), the final validation and train
  loss (:func:`dflash.training.telemetry.final_losses`; a checkpoint's up to its step).

The last line is a verdict pointing at the largest change and the quality beside it, e.g. ``B is 41% slower (real
tokens/s 9,800 -> 5,780); forward +58%; bucket 3 forward +70%; quality: evaluated tau 1.106 -> 1.214 (better),
validation loss 4.100 -> 3.910 (better); environment: versions.torch 2.11.0+cu130 -> 2.11.0+cu128``.

    dflash-stages diff runs/last-week runs/today
    dflash-stages diff runs/a/checkpoints/step_00000100 exports/a --json

Exit codes: 0 config and environment agree; 1 they differ; 2 A or B is not a run, checkpoint or export.
``inspect A --diff B`` prints the same.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer

from dflash.errors import DFlashError
from dflash.training.telemetry import final_losses, read_metrics
from stages.config.exit_status import ExitCode, print_error
from stages.forensics.runs import add_key_column, describe, evaluated_tau, flatten, format_value, read_json

__all__ = ["register", "diff_command", "Side", "Comparison", "load_side", "compare", "print_comparison",
           "PERFORMANCE_KEYS", "QUALITY_KEYS"]

#: Config-like sections in the order a change is attributed to them (a key is listed under the first).
_CONFIG_SECTIONS = ("config", "drafter", "target", "resolved", "serving", "provenance")
#: Never compared: the path under comparison itself, what always differs between two exports, the command line (the
#: config is what it resolved to), the epoch's batch counts (a consequence of the batch settings, listed instead)
#: and the cache metadata (``environment.cache_fingerprint`` stands for it).
_IGNORED = {"config.output", "provenance.created_at", "environment.argv", "resolved.bucket_table",
            "resolved.cache_metadata"}
#: The performance figures compared (medians over the train records), higher-is-better ones first.
PERFORMANCE_KEYS = ("real_tokens_per_s", "padded_tokens_per_s", "supervised_tokens_per_s", "steps_per_s",
                    "time_step_s", "time_data_wait_s", "time_forward_s", "time_backward_s", "time_optimizer_s",
                    "time_data_wait_fraction")
#: The quality figures compared: evaluated tau (higher is better), final validation and train loss (lower is better).
QUALITY_KEYS = ("evaluated_tau", "val_loss", "train_loss")
_PER_BUCKET = ("bucket_real_tokens_per_s", "bucket_step_s", "bucket_forward_s")
_PHASES = ("data_wait", "forward", "backward", "optimizer")
#: Environment keys in the order the verdict names them (most often the cause of a speed change first).
_ENV_PRIORITY = ("versions.torch", "cuda", "versions.triton", "versions.flash-attn", "versions.flash-attn-4",
                 "cuda_devices", "cuda_device_count", "gpu_driver", "compile", "torch_threads", "env.",
                 "cpu_model", "cpu_affinity", "git_diff_sha256", "git_commit", "git_dirty")
_ABSENT = "<absent>"


@dataclass(slots=True)
class Side:
    """One side of a diff: its kind, flat facts per section and its train-metrics medians."""

    path: Path
    kind: str
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)  # section -> {key: value}
    performance: dict[str, float] = field(default_factory=dict)  # PERFORMANCE_KEYS and "<bucket key>.<id>"
    records: int = 0
    #: QUALITY_KEYS: final losses (:func:`dflash.training.telemetry.final_losses`) and the evaluated tau
    #: (:func:`stages.forensics.runs.evaluated_tau`); a key is absent when the side does not have it.
    quality: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class Comparison:
    """``compare(a, b)``: rows ``(key, a value, b value)`` per part, and the verdict line."""

    left: Side
    right: Side
    config: list[tuple[str, Any, Any]]
    environment: list[tuple[str, Any, Any]]
    performance: list[tuple[str, float | None, float | None, float | None]]  # key, a, b, relative change b/a - 1
    skipped: list[str]
    verdict: str
    quality: list[tuple[str, float | None, float | None]] = field(default_factory=list)  # key, a, b

    @property
    def differs(self) -> bool:
        return bool(self.config or self.environment)

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": str(self.left.path), "b": str(self.right.path),
            "config": [{"key": k, "a": a, "b": b} for k, a, b in self.config],
            "environment": [{"key": k, "a": a, "b": b} for k, a, b in self.environment],
            "quality": [{"key": k, "a": a, "b": b} for k, a, b in self.quality],
            "performance": [{"key": k, "a": a, "b": b, "change": c} for k, a, b, c in self.performance],
            "not_compared": self.skipped, "verdict": self.verdict,
        }


def _median_performance(records: list[dict[str, Any]]) -> dict[str, float]:
    if len(records) >= 3:
        records = records[1:]  # the first window holds start-up (allocation, first-touch, compilation)
    values: dict[str, list[float]] = {}
    for record in records:
        for key in PERFORMANCE_KEYS:
            if isinstance(record.get(key), int | float):
                values.setdefault(key, []).append(float(record[key]))
        for key in _PER_BUCKET:
            for bucket, value in (record.get(key) or {}).items():
                values.setdefault(f"{key}.{bucket}", []).append(float(value))
    return {key: statistics.median(items) for key, items in values.items()}


def _metrics_of(folder: Path, up_to_step: int | None) -> list[dict[str, Any]]:
    """The train and val records of ``folder``'s metrics up to ``up_to_step``."""
    if not (folder / "metrics.jsonl").is_file():
        return []
    records = [r for r in read_metrics(folder) if r.get("kind") in ("train", "val")]
    return [r for r in records if up_to_step is None or int(r["step"]) <= up_to_step]


def load_side(path: str | Path) -> Side:
    """Facts and performance of a run, checkpoint or export folder.

    Raises:
        CheckpointError: ``path`` is none of the three.
    """
    artefact = describe(path)
    side = Side(path=artefact.path, kind=artefact.kind)
    for key, value in artefact.facts.items():  # drafter/target/serving/provenance as ``inspect`` reads them
        section, _, rest = key.partition(".")
        if section in ("drafter", "target", "serving", "provenance"):
            side.sections.setdefault(section, {})[rest] = value
    recorded: dict[str, Any] = {}
    metrics_folder, up_to = None, None
    if artefact.kind == "run" and (artefact.path / "run.json").is_file():
        recorded = read_json(artefact.path / "run.json")
        metrics_folder = artefact.path
    elif artefact.kind == "checkpoint" and (artefact.path / "trainer_state.json").is_file():
        recorded = read_json(artefact.path / "trainer_state.json")
        if artefact.path.parent.name == "checkpoints":  # inside its run: that run's metrics up to this step
            metrics_folder, up_to = artefact.path.parent.parent, int(recorded.get("step", 0))
    for section in ("config", "resolved", "environment"):
        if isinstance(recorded.get(section), dict):
            content = dict(recorded[section])
            if section == "resolved":
                content.pop("drafter_config", None)  # the drafter section has it
            side.sections[section] = flatten(content, "")
    if metrics_folder is not None:
        records = _metrics_of(metrics_folder, up_to)
        train = [r for r in records if r.get("kind") == "train"]
        side.records = len(train)
        side.performance = _median_performance(train)
        final = final_losses(records)
        side.quality = {key: final[key] for key in ("val_loss", "train_loss") if final[key] is not None}
    if artefact.kind == "run":  # the evaluated tau is the final drafter's: a run's, not an earlier checkpoint's
        tau = evaluated_tau(artefact.path)["tau"]
        if tau is not None:
            side.quality["evaluated_tau"] = tau
    return side


def _rows(left: dict[str, Any], right: dict[str, Any], section: str) -> list[tuple[str, Any, Any]]:
    rows = []
    for key in sorted(set(left) | set(right)):
        a, b = left.get(key, _ABSENT), right.get(key, _ABSENT)
        if a != b and f"{section}.{key}" not in _IGNORED:
            rows.append((f"{section}.{key}", a, b))
    return rows


def _change(a: float | None, b: float | None) -> float | None:
    return b / a - 1.0 if a and b is not None else None


def _verdict(comparison: Comparison) -> str:
    left, right = comparison.left.performance, comparison.right.performance
    parts: list[str] = []
    speed_key = next((k for k in ("real_tokens_per_s", "steps_per_s") if k in left and k in right), None)
    if speed_key is not None:
        change = _change(left[speed_key], right[speed_key]) or 0.0
        word = "slower" if change < 0 else "faster"
        parts.append(f"B is {abs(change):.0%} {word} ({speed_key.replace('_', ' ')} {left[speed_key]:,.0f} -> "
                     f"{right[speed_key]:,.0f})")
        # The phase (and bucket) that moved most, in the direction of the verdict: a slower B is explained by
        # what grew (seconds per step), a faster one by what shrank.
        sign = 1.0 if change < 0 else -1.0
        phases = [(sign * (right[f"time_{p}_s"] - left[f"time_{p}_s"]), p) for p in _PHASES
                  if f"time_{p}_s" in left and f"time_{p}_s" in right]
        if phases:
            _, phase = max(phases)
            parts.append(f"{phase} {_change(left[f'time_{phase}_s'], right[f'time_{phase}_s']) or 0.0:+.0%}")
        buckets = [(sign * (_change(left[k], right[k]) or 0.0), k) for k in left
                   if k.startswith(("bucket_step_s.", "bucket_forward_s.")) and k in right]
        if buckets:
            _, key = max(buckets)
            name, bucket = key.rsplit(".", 1)
            what = "forward" if name == "bucket_forward_s" else "step"
            parts.append(f"bucket {bucket} {what} {_change(left[key], right[key]) or 0.0:+.0%}")
    else:
        parts.append("no throughput to compare (no train records on one side)")
    if comparison.quality:
        parts.append(_quality_verdict(comparison.quality))
    environment = {key.removeprefix("environment."): (a, b) for key, a, b in comparison.environment}
    ranked = sorted(environment, key=lambda k: next((i for i, p in enumerate(_ENV_PRIORITY) if k.startswith(p)),
                                                   len(_ENV_PRIORITY)))
    if ranked:
        shown = [f"{key} {_short(environment[key][0])} -> {_short(environment[key][1])}" for key in ranked[:2]]
        more = f" (+{len(ranked) - 2} more)" if len(ranked) > 2 else ""
        parts.append("environment: " + ", ".join(shown) + more)
    if comparison.config:
        key, a, b = comparison.config[0]
        more = f" (+{len(comparison.config) - 1} more)" if len(comparison.config) > 1 else ""
        parts.append(f"config: {key} {_short(a)} -> {_short(b)}{more}")
    if not comparison.differs:
        parts.append("no config or environment differences in the compared sections")
    return "; ".join(parts)


def _quality_verdict(rows: list[tuple[str, float | None, float | None]]) -> str:
    """``quality: evaluated tau 1.106 -> 1.214 (better), validation loss 4.10 -> 3.91 (better)``; the train loss
    only where neither has a validation loss."""
    names = {"evaluated_tau": "evaluated tau", "val_loss": "validation loss", "train_loss": "final train loss"}
    shown = []
    for key, a, b in rows:
        if key == "train_loss" and any(k == "val_loss" and (x is not None or y is not None) for k, x, y in rows):
            continue
        text = f"{names[key]} {'-' if a is None else f'{a:.3f}'} -> {'-' if b is None else f'{b:.3f}'}"
        if a is not None and b is not None and a != b:
            better = b > a if key == "evaluated_tau" else b < a
            text += " (better)" if better else " (worse)"
        shown.append(text)
    if not any(key == "evaluated_tau" for key, _, _ in rows):
        shown.append("evaluated tau unknown (no eval report)")
    return "quality: " + ", ".join(shown)


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 24 else text[:12] + "..." + text[-8:]


def compare(left: Side, right: Side) -> Comparison:
    """Config (each change once), environment and performance differences of two sides, with a verdict."""
    common = [s for s in _CONFIG_SECTIONS if s in left.sections and s in right.sections]
    skipped = sorted({*left.sections, *right.sections} - {*common, "environment"})
    config_rows: list[tuple[str, Any, Any]] = []
    seen: set[tuple[str, str, str]] = set()  # (leaf name, a, b) already listed under an earlier section
    for section in common:
        for key, a, b in _rows(left.sections[section], right.sections[section], section):
            leaf = (key.rsplit(".", 1)[-1], json.dumps(a, default=str), json.dumps(b, default=str))
            if leaf in seen:
                continue
            seen.add(leaf)
            config_rows.append((key, a, b))
    environment_rows: list[tuple[str, Any, Any]] = []
    if "environment" in left.sections and "environment" in right.sections:
        environment_rows = _rows(left.sections["environment"], right.sections["environment"], "environment")
    elif "environment" in left.sections or "environment" in right.sections:
        skipped.append("environment")
    keys = [k for k in PERFORMANCE_KEYS if k in left.performance or k in right.performance]
    keys += sorted(k for k in {*left.performance, *right.performance} if k not in PERFORMANCE_KEYS)
    performance = [(k, left.performance.get(k), right.performance.get(k),
                    _change(left.performance.get(k), right.performance.get(k))) for k in keys]
    quality = [(k, left.quality.get(k), right.quality.get(k)) for k in QUALITY_KEYS
               if k in left.quality or k in right.quality]
    comparison = Comparison(left, right, config_rows, environment_rows, performance, skipped, verdict="",
                            quality=quality)
    comparison.verdict = _verdict(comparison)
    return comparison


def print_comparison(console: Any, comparison: Comparison) -> None:
    """The three tables (only non-empty ones) and the verdict line."""
    from rich.table import Table

    left, right = comparison.left, comparison.right
    console.print(f"A = {left.kind} {format_value(str(left.path))}\nB = {right.kind} {format_value(str(right.path))}",
                  soft_wrap=True)
    for title, rows in (("config", comparison.config), ("environment", comparison.environment)):
        if not rows:
            console.print(f"[green]no {title} differences[/]")
            continue
        table = Table(title=f"{title} differences")
        add_key_column(table, console, [key for key, _, _ in rows], value_columns=2)
        table.add_column("A", overflow="fold")
        table.add_column("B", overflow="fold")
        for key, a, b in rows:
            table.add_row(format_value(key), format_value(a), format_value(b))
        console.print(table)
    if comparison.quality:
        table = Table(title="quality (final losses: last train record and last validation; evaluated tau: "
                      "eval/final.json)")
        for column in ("metric", "A", "B"):
            table.add_column(column, justify="left" if column == "metric" else "right")
        for key, a, b in comparison.quality:
            table.add_row(key, "-" if a is None else f"{a:.4f}", "-" if b is None else f"{b:.4f}")
        console.print(table)
    if comparison.performance:
        table = Table(title=f"performance (medians over {left.records} / {right.records} train records)")
        for column in ("metric", "A", "B", "B vs A"):
            table.add_column(column, justify="left" if column == "metric" else "right")
        for key, a, b, change in comparison.performance:
            table.add_row(key, "-" if a is None else f"{a:,.4g}", "-" if b is None else f"{b:,.4g}",
                          "-" if change is None else f"{change:+.1%}")
        console.print(table)
    if comparison.skipped:
        console.print(f"[yellow]not compared[/] (only one side has them): {', '.join(comparison.skipped)}")
    console.print(f"[bold]verdict:[/] {format_value(comparison.verdict)}", soft_wrap=True)


def diff_command(
    a: Path = typer.Argument(..., metavar="A", help="A run folder (or a pipeline work folder: its run), checkpoint folder or serving-format export."),
    b: Path = typer.Argument(..., metavar="B", help="Another run, checkpoint or export to compare A with."),
    as_json: bool = typer.Option(False, "--json", help="Print the comparison as JSON instead of tables."),
) -> None:
    """Config, environment and performance differences of two runs/checkpoints/exports, with a verdict.

    Exit codes: 0 config and environment agree; 1 they differ; 2 A or B is not a run, checkpoint or export.
    """
    from rich.console import Console

    console = Console()
    try:
        comparison = compare(load_side(a), load_side(b))
    except DFlashError as error:
        print_error(error)
        raise typer.Exit(code=ExitCode.USAGE) from None
    if as_json:
        console.print_json(json.dumps(comparison.to_dict(), default=str))
    else:
        print_comparison(console, comparison)
    if comparison.differs:
        raise typer.Exit(code=1)


def register(app: typer.Typer) -> None:
    """Add the ``diff`` command to the CLI."""
    app.command("diff")(diff_command)
