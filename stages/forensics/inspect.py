"""``dflash-stages inspect PATH``: print everything recorded about a run, a checkpoint or an export.

PATH is a run folder (``run.json``, ``latest``, ``checkpoints/``; a pipeline work folder, ``pipeline.json`` beside
``run/``, stands for its run), a checkpoint folder (``drafter_config.json``, ``model.safetensors``, ``target.json``...)
or a serving-format export (``config.json`` with ``architectures: ["DFlashDraftModel"]``, ``dflash_export.json``).

    dflash-stages inspect runs/smol                       # resolved config, target, checkpoints, weights
    dflash-stages inspect runs/smol --diff exports/smol   # = dflash-stages diff runs/smol exports/smol (stages/diff.py)
    dflash-stages inspect runs/smol --scan                # = dflash-stages scan runs/smol (stages/scan.py)
    dflash-stages inspect runs/smol --json > smol.json    # the same facts, checks and per-tensor statistics as JSON

The output leads with a summary (what the path is, its target, steps, final validation and train loss, evaluated
tau, the checks' verdicts; :func:`summary`), then the details. Every artefact is reduced to flat
``section.key -> value`` facts (sections: ``drafter`` = the DFlashConfig fields,
``target``, ``run``, ``trainer``, ``serving``, ``provenance``, ``weights``); the diff compares the sections both sides
have, so a checkpoint and its export compare by drafter config and target.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from dflash.errors import DFlashError
from stages.config.exit_status import ExitCode, print_error
from stages.forensics.diff import compare, load_side, print_comparison
from stages.forensics.runs import (
    Artefact,
    add_key_column,
    describe,
    evaluated_tau,
    format_value,
    parameter_groups,
    tensor_statistics,
)
from stages.forensics.scan import DEFAULT_MAX_ABS, print_scans, scan_paths

__all__ = ["register", "inspect_command", "summary"]


def summary(artefact: Artefact) -> list[tuple[str, str]]:
    """What ``inspect`` says first, one line each: what the path is, its target, its steps, its final losses
    (:func:`dflash.training.telemetry.final_losses`; a checkpoint's up to its step), the evaluated tau
    (:func:`stages.forensics.runs.evaluated_tau`, a run's) and the checks' verdicts."""
    from dflash.training.telemetry import final_losses, read_metrics

    facts = artefact.facts
    rows = [("what", f"{artefact.kind} {artefact.path}")]
    target = facts.get("target.identity.name") or facts.get("target.target_spec")
    rows.append(("target", str(target) if target is not None else "unknown (not recorded)"))
    step, total = facts.get("trainer.step"), facts.get("trainer.total_steps")
    if step is not None:
        rows.append(("steps", f"{step} of {total}" if total is not None else str(step)))
    run = artefact.path if artefact.kind == "run" else (
        artefact.path.parent.parent if artefact.kind == "checkpoint" and artefact.path.parent.name == "checkpoints"
        else None)
    if run is not None and (run / "metrics.jsonl").is_file():
        records = read_metrics(run)
        if artefact.kind == "checkpoint" and step is not None:
            records = [r for r in records if int(r.get("step", 0)) <= int(step)]
        final = final_losses(records)

        def loss(name: str) -> str:
            value = final[f"{name}_loss"]
            return "-" if value is None else f"{value:.4f} (step {final[f'{name}_step']})"

        rows.append(("final loss", f"validation {loss('val')}, train {loss('train')} (last log interval)"))
    if artefact.kind == "run":
        evaluated = evaluated_tau(artefact.path)
        also = evaluated["also"]  # a pipeline's run evaluated again on its own: both reports, each named
        rows.append(("evaluated tau", (f"{evaluated['tau']:.3f} ({evaluated['source']})" if evaluated["tau"] is not None
                                       else "not evaluated (no eval/final.json)")
                     + (f"; also {also['tau']:.3f} in {also['source']} (evaluate --drafter {artefact.path})"
                        if also else "")))
    failed = [name for name, verdict in artefact.checks.items() if verdict != "ok"]
    rows.append(("checks", f"{len(artefact.checks) - len(failed)} of {len(artefact.checks)} ok"
                 + (f"; FAILED: {', '.join(failed)}" if failed else "")))
    return rows


def _print_summary(console: Any, artefact: Artefact) -> None:
    for name, value in summary(artefact):
        console.print(f"[bold]{name}:[/] {format_value(value)}")
    console.print("details follow: every recorded fact, then the checks and notes"
                  + (", then per-tensor statistics" if artefact.model_file is not None else ""), style="dim")


def _print_artefact(console: Any, artefact: Artefact) -> None:
    from rich.table import Table

    table = Table(title=f"{artefact.kind} {artefact.path}", show_lines=False)
    add_key_column(table, console, list(artefact.facts), value_columns=1)
    table.add_column("value", overflow="fold")
    previous_section = None
    for key in sorted(artefact.facts, key=lambda k: (k.split(".", 1)[0] != "drafter", k)):
        section = key.split(".", 1)[0]
        if previous_section is not None and section != previous_section:
            table.add_section()
        previous_section = section
        table.add_row(format_value(key), format_value(artefact.facts[key]))
    console.print(table)
    for name, verdict in artefact.checks.items():
        console.print(f"{name}: " + ("[green]ok[/]" if verdict == "ok" else f"[red]FAILED[/] {format_value(verdict)}"))
    for note in artefact.notes:
        console.print(f"[yellow]note:[/] {format_value(note)}")


def _print_tensors(console: Any, tensors: list[dict[str, Any]], source: Path) -> None:
    from rich.table import Table

    groups = parameter_groups(tensors)
    table = Table(title=f"tensors of {source} ({groups['total']:,} parameters)")
    table.add_column("tensor", style="bold", overflow="fold")  # folds on a narrow terminal, never an ellipsis
    for column in ("dtype", "shape", "min", "max", "mean", "std", "abs max", "non-finite"):
        table.add_column(column, justify="left" if column in ("dtype", "shape") else "right", overflow="fold")

    def number(value: Any) -> str:
        return "-" if value is None else f"{value:.4g}"

    for row in tensors:
        table.add_row(format_value(row["name"]), row["dtype"], "x".join(map(str, row["shape"])) or "scalar",
                      number(row.get("min")), number(row.get("max")), number(row.get("mean")), number(row.get("std")),
                      number(row.get("abs_max")), str(row.get("nonfinite", "-")))
    console.print(table)
    counts = Table(title="parameters by group")
    counts.add_column("group")
    counts.add_column("parameters", justify="right")
    for name, count in groups["groups"].items():
        counts.add_row(format_value(name), f"{count:,}")
    counts.add_row("[bold]total[/]", f"[bold]{groups['total']:,}[/]")
    console.print(counts)


def inspect_command(
    path: Path = typer.Argument(..., metavar="PATH", help="A run folder (or a pipeline work folder: its run), a checkpoint folder or a serving-format export folder."),
    diff: Path | None = typer.Option(
        None, "--diff", help="Alias of `dflash-stages diff PATH OTHER`: config, environment and performance "
        "differences with a verdict (exit code 1 if config or environment differ)."
    ),
    scan: bool = typer.Option(
        False, "--scan", help="Alias of `dflash-stages scan PATH`: every checkpoint's tensors (weights and optimizer state) "
        "checked for NaN/Inf/extreme values (exit code 1 if any)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (facts, checks, notes, parameter "
                                 "counts, per-tensor statistics) instead of tables."),
    tensors: bool = typer.Option(True, "--tensors/--no-tensors", help="Per-tensor shape, dtype and statistics of "
                                 "the drafter's weights (min, max, mean, std, abs max, non-finite; streamed)."),
) -> None:
    """Print the full config and provenance of a run, checkpoint or export; optionally diff or scan it.

    Exit codes: 0 all good; 1 a format check failed, configs differ (--diff) or a tensor holds NaN/Inf (--scan);
    2 PATH is not a run, checkpoint or export.
    """
    from rich.console import Console

    console = Console()
    try:
        artefact = describe(path)
        other = describe(diff) if diff is not None else None  # both refused here, before any output
    except DFlashError as error:
        print_error(error)
        raise typer.Exit(code=ExitCode.USAGE) from None

    if as_json and (other is not None or scan):
        print_error("--json prints one artefact: use it without --diff and --scan (`dflash-stages diff` and "
                    "`dflash-stages scan` have their own --json)")
        raise typer.Exit(code=ExitCode.USAGE)
    failed = False
    statistics = tensor_statistics(artefact.model_file) if tensors and artefact.model_file is not None else None
    if as_json:
        print(json.dumps({"summary": dict(summary(artefact)), **artefact.to_dict(statistics)}, indent=2, default=str))
        if any(verdict != "ok" for verdict in artefact.checks.values()):
            raise typer.Exit(code=1)
        return
    if other is None:
        _print_summary(console, artefact)
        _print_artefact(console, artefact)
        if statistics is not None and artefact.model_file is not None:
            _print_tensors(console, statistics, artefact.model_file)
        failed = any(verdict != "ok" for verdict in artefact.checks.values())
    else:  # the same comparison as ``dflash-stages diff PATH OTHER``
        comparison = compare(load_side(path), load_side(diff))
        print_comparison(console, comparison)
        failed = comparison.differs

    if scan:  # the same scan as ``dflash-stages scan PATH`` (every checkpoint of a run)
        scans = scan_paths([path], max_abs=DEFAULT_MAX_ABS)
        print_scans(console, scans, max_abs=DEFAULT_MAX_ABS)
        failed = failed or not all(item.clean for item in scans)
    if failed:
        raise typer.Exit(code=1)


def register(app: typer.Typer) -> None:
    """Add the ``inspect`` command to the CLI."""
    app.command("inspect")(inspect_command)
