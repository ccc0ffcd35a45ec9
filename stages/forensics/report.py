"""``dflash-stages report RUN [RUN...]``: PNG plots of training runs and one self-contained HTML page.

Reads each run's ``metrics.jsonl`` (``dflash.training.telemetry``: ``train``, ``val`` and ``checkpoint`` records) and
the tau ``evaluate`` measured (:func:`stages.forensics.runs.evaluated_tau`: ``WORKDIR/eval/final.json`` when the run
is a pipeline's, ``WORKDIR/run`` beside ``WORKDIR/pipeline.json`` or the WORKDIR itself, with the per-epoch taus of
``pipeline.json``; else ``RUN/eval/final.json``). Final losses are :func:`dflash.training.telemetry.final_losses`'s. Several runs are overlaid, one colour each. Plots (``--output``, default
``RUN/report``):

- ``loss.png``: train loss (solid) and validation loss (dashed) per step, checkpoint saves marked (dotted lines,
  so a loss cliff after a save shows);
- ``accuracy.png``: per-position accuracy of the last validation (else train) record;
- ``tau.png``: implied acceptance length (``expected_acceptance_length`` from the per-position accuracies; train
  solid, validation dashed), the evaluated tau per epoch (squares) where the pipeline measured it and the final
  drafter's evaluated tau (a star at the last step);
- ``throughput.png``: real (solid) and supervised (dashed) tokens/s over the throughput window;
- ``time_split.png``: median step time split into data wait / forward / backward / optimizer, per run;
- ``data_wait.png``: data-wait share of the step time per step;
- ``buckets.png``: share of batches per length bucket over the whole run (the last record's cumulative counts).

``report.html`` embeds every image (base64) with a summary table per run, so it can be mailed or attached as is.

The output folder holds only what ``report`` writes (:func:`check_report_output`): it is refused when it is a
symbolic link, a file, or a folder holding anything else (a run, a cache, an export, the user's files) or a link
in place of one of the report's files; a report folder is rewritten in place. It is locked while it is written
(``dflash.io.locks``, as every stage's output), and each file is replaced atomically without following links
(``dflash.io.files``), so nothing is ever written outside the named folder.

    dflash-stages report runs/smol
    dflash-stages report runs/last-week runs/today --output /tmp/compare

Exit codes: 0 written; 2 a RUN has no ``metrics.jsonl``, or the output is refused (one ``error:`` line).
"""

from __future__ import annotations

import base64
import html
import io
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer

from dflash.errors import CheckpointError, ConfigError, DFlashError
from dflash.io.files import atomic_write_bytes, atomic_write_text
from dflash.io.locks import output_lock
from dflash.training.telemetry import final_losses, read_metrics, record_number
from stages.config.exit_status import ExitCode, print_error
from stages.forensics.runs import evaluated_tau, run_of_workdir

__all__ = ["register", "report_command", "RunSeries", "load_series", "write_report", "check_report_output", "PLOTS",
           "REPORT_FILES"]

#: File names of the plots, in the order the HTML page shows them.
PLOTS = ("loss", "accuracy", "tau", "throughput", "time_split", "data_wait", "buckets")
#: Everything a report folder holds.
REPORT_FILES = (*(f"{name}.png" for name in PLOTS), "report.html")
_PHASES = ("data_wait", "forward", "backward", "optimizer")


@dataclass(slots=True)
class RunSeries:
    """What one run's metrics hold, as lists per record kind."""

    path: Path
    label: str
    train: list[dict[str, Any]] = field(default_factory=list)
    val: list[dict[str, Any]] = field(default_factory=list)
    saves: list[int] = field(default_factory=list)  # steps of checkpoint records
    evaluated: list[dict[str, Any]] = field(default_factory=list)  # pipeline.json epochs: {epoch, step, tau}
    #: :func:`stages.forensics.runs.evaluated_tau`: the final drafter's evaluated tau and its report file.
    evaluated_tau: float | None = None
    evaluated_source: str | None = None
    #: :func:`dflash.training.telemetry.final_losses` of the run's records.
    final: dict[str, Any] = field(default_factory=dict)


def load_series(path: str | Path) -> RunSeries:
    """A run folder's (or a pipeline work folder's ``run/``) metrics.

    Raises:
        CheckpointError: no ``metrics.jsonl`` there.
    """
    folder = Path(path).expanduser()
    run = run_of_workdir(folder)
    if not (run / "metrics.jsonl").is_file():
        raise CheckpointError(f"{run} has no metrics.jsonl: pass a run folder written by `dflash-stages train` "
                              "(or a pipeline work folder)")
    records = read_metrics(run)
    series = RunSeries(path=run, label=run.name if run.name != "run" else run.parent.name)
    series.train = [r for r in records if r.get("kind") == "train"]
    series.val = [r for r in records if r.get("kind") == "val"]
    series.saves = sorted({int(r["step"]) for r in records if r.get("kind") == "checkpoint"})
    evaluated = evaluated_tau(run)
    series.evaluated = evaluated["epochs"]
    series.evaluated_tau, series.evaluated_source = evaluated["tau"], evaluated["source"]
    series.final = final_losses(records)
    return series


_number = record_number


def _xy(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(int(r["step"]), _number(r.get(key))) for r in records]
    points = [(s, v) for s, v in points if v is not None]
    return [s for s, _ in points], [v for _, v in points]


def _figure(title: str, xlabel: str, ylabel: str) -> tuple[Any, Any]:
    from matplotlib.figure import Figure  # the object API: no pyplot state, renders with Agg
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(8, 4.5), dpi=100, layout="constrained")
    axes = figure.add_subplot()
    if xlabel != "run":
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps, positions and buckets are whole numbers
    axes.set_title(title)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.grid(True, alpha=0.3)
    return figure, axes


def _colors(count: int) -> list[Any]:
    from matplotlib import colormaps

    palette = colormaps["tab10"]
    return [palette(index % 10) for index in range(count)]


def _plot_loss(runs: list[RunSeries], colors: list[Any]) -> Any:
    figure, axes = _figure("loss (train solid, validation dashed; dotted: checkpoint saves)", "step", "loss")
    for run, color in zip(runs, colors, strict=True):
        axes.plot(*_xy(run.train, "loss"), color=color, label=f"{run.label} train")
        if run.val:
            axes.plot(*_xy(run.val, "loss"), color=color, linestyle="--", marker="o", label=f"{run.label} val")
        for index, step in enumerate(run.saves):
            axes.axvline(step, color=color, linestyle=":", alpha=0.7, label=f"{run.label} save" if index == 0 else None)
    axes.legend(fontsize="small")
    return figure


def _plot_accuracy(runs: list[RunSeries], colors: list[Any]) -> Any:
    figure, axes = _figure("per-position accuracy (last validation record, else last train record)",
                           "block position k", "accuracy")
    for run, color in zip(runs, colors, strict=True):
        source, kind = (run.val, "val") if run.val else (run.train, "train")
        if not source or not source[-1].get("accuracy_per_position"):
            continue
        accuracy = [_number(a) or 0.0 for a in source[-1]["accuracy_per_position"]]
        axes.plot(range(1, len(accuracy) + 1), accuracy, color=color, marker="o",
                  label=f"{run.label} ({kind}, step {source[-1]['step']})")
    axes.set_ylim(0, 1)
    axes.legend(fontsize="small")
    return figure


def _plot_tau(runs: list[RunSeries], colors: list[Any]) -> Any:
    figure, axes = _figure("tau: implied by accuracies (train solid, val dashed); evaluated (squares, star: final)",
                           "step", "tau (tokens per draft-verify cycle)")
    for run, color in zip(runs, colors, strict=True):
        axes.plot(*_xy(run.train, "expected_acceptance_length"), color=color, label=f"{run.label} implied (train)")
        if run.val:
            axes.plot(*_xy(run.val, "expected_acceptance_length"), color=color, linestyle="--", marker="o",
                      label=f"{run.label} implied (val)")
        if run.evaluated:
            axes.plot([int(e.get("step", 0)) for e in run.evaluated], [float(e["tau"]) for e in run.evaluated],
                      color=color, marker="s", markersize=8, linestyle="-.", label=f"{run.label} evaluated per epoch")
        if run.evaluated_tau is not None and run.train:  # the final drafter's: the run's last step
            axes.plot([int(run.train[-1]["step"])], [run.evaluated_tau], color=color, marker="*", markersize=14,
                      linestyle="none", label=f"{run.label} evaluated (final) {run.evaluated_tau:.3f}")
    axes.legend(fontsize="small")
    return figure


def _plot_throughput(runs: list[RunSeries], colors: list[Any]) -> Any:
    figure, axes = _figure("throughput over the window (real tokens solid, supervised dashed)", "step", "tokens/s")
    for run, color in zip(runs, colors, strict=True):
        axes.plot(*_xy(run.train, "real_tokens_per_s"), color=color, label=f"{run.label} real")
        axes.plot(*_xy(run.train, "supervised_tokens_per_s"), color=color, linestyle="--",
                  label=f"{run.label} supervised")
    axes.set_ylim(bottom=0)
    axes.legend(fontsize="small")
    return figure


def _median(records: list[dict[str, Any]], key: str) -> float:
    values = [v for v in (_number(r.get(key)) for r in records[1:] or records) if v is not None]
    return statistics.median(values) if values else 0.0


def _plot_time_split(runs: list[RunSeries], colors: list[Any]) -> Any:
    figure, axes = _figure("median step time split (first record, holding start-up, left out)", "run", "seconds")
    labels = [run.label for run in runs]
    bottoms = [0.0] * len(runs)
    for phase, color in zip(_PHASES, _colors(len(_PHASES)), strict=True):
        heights = [_median(run.train, f"time_{phase}_s") for run in runs]
        axes.bar(labels, heights, bottom=bottoms, color=color, label=phase)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    axes.legend(fontsize="small")
    return figure


def _plot_data_wait(runs: list[RunSeries], colors: list[Any]) -> Any:
    figure, axes = _figure("data wait share of the step time", "step", "share")
    for run, color in zip(runs, colors, strict=True):
        axes.plot(*_xy(run.train, "time_data_wait_fraction"), color=color, label=run.label)
    axes.set_ylim(bottom=0)
    axes.legend(fontsize="small")
    return figure


def _plot_buckets(runs: list[RunSeries], colors: list[Any]) -> Any:
    figure, axes = _figure("realized share of batches per length bucket (whole run)", "length bucket", "share")
    width = 0.8 / max(1, len(runs))
    shown: set[int] = set()
    for index, (run, color) in enumerate(zip(runs, colors, strict=True)):
        batches = (run.train[-1].get("bucket_batches") or {}) if run.train else {}
        total = sum(batches.values()) or 1
        buckets = sorted(batches, key=int)
        shown.update(int(b) for b in buckets)
        axes.bar([int(b) + (index - (len(runs) - 1) / 2) * width for b in buckets],
                 [batches[b] / total for b in buckets], width=width, color=color, label=run.label)
    axes.set_xticks(sorted(shown))
    axes.legend(fontsize="small")
    return figure


_PLOTTERS = {"loss": _plot_loss, "accuracy": _plot_accuracy, "tau": _plot_tau, "throughput": _plot_throughput,
             "time_split": _plot_time_split, "data_wait": _plot_data_wait, "buckets": _plot_buckets}


def _summary_rows(run: RunSeries) -> list[tuple[str, str]]:
    final = run.final

    def figure(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    rows = [("run folder", str(run.path)), ("train records", str(len(run.train))),
            ("last step", str(final.get("train_step") or "-")),
            ("evaluated tau (final drafter)", figure(run.evaluated_tau, ".3f")
             + (f" ({run.evaluated_source})" if run.evaluated_source else " (not evaluated)")),
            ("final validation loss / implied tau", f"{figure(final.get('val_loss'), '.4f')} / "
             f"{figure(final.get('val_tau'), '.3f')}"
             + (f" (step {final['val_step']})" if final.get("val_step") is not None else "")),
            ("final train loss (last log interval)", figure(final.get("train_loss"), ".4f")),
            ("median real tokens/s", f"{_median(run.train, 'real_tokens_per_s'):,.1f}"),
            ("median step time (s)", f"{_median(run.train, 'time_step_s'):.4f}"),
            ("checkpoint saves at steps", ", ".join(map(str, run.saves)) or "-")]
    if run.evaluated:
        rows.append(("evaluated tau per epoch", ", ".join(f"{e.get('epoch')}: {float(e['tau']):.3f}" for e in run.evaluated)))
    return rows


def check_report_output(output: str | Path) -> None:
    """Refuse an output that is not a new folder, an empty one or a report folder: a symbolic link (it would send
    the report elsewhere), a file, a folder holding anything :data:`REPORT_FILES` does not name (a run, a cache,
    the user's files), or a link or folder in place of one of the report's files.

    Raises:
        ConfigError: naming the path, what is there and the fix.
    """
    output = Path(output)
    if output.is_symlink():
        raise ConfigError(f"--output {output} is a symbolic link (to {os.readlink(output)}); the report is written "
                          "only into a real folder: remove the link or pass another --output")
    if not output.exists():
        return
    if not output.is_dir():
        raise ConfigError(f"--output {output} exists and is not a folder; pass a new or empty folder")
    for entry in sorted(output.iterdir()):
        temporary = entry.name.startswith(".") and entry.name.split(".tmp-")[0][1:] in REPORT_FILES
        if entry.name not in REPORT_FILES and not temporary:
            raise ConfigError(
                f"--output {output} exists and holds files that are not a dflash-stages report ({entry.name}; a "
                f"report folder holds only {', '.join(REPORT_FILES)}); pass a new or empty folder"
            )
        if entry.is_symlink() or not entry.is_file():
            what = f"a symbolic link (to {os.readlink(entry)})" if entry.is_symlink() else "not a regular file"
            raise ConfigError(f"--output {output}: {entry.name} is {what}; a report folder holds only the files "
                              "report writes: remove it or pass another --output")


def write_report(runs: list[RunSeries], output: str | Path) -> dict[str, Path]:
    """Write the PNGs and ``report.html`` into ``output`` (each replaced atomically, no link followed); returns
    ``{plot name or "html": path}``. The caller checks ``output`` first (:func:`check_report_output`)."""
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    colors = _colors(len(runs))
    written: dict[str, Path] = {}
    pngs: dict[str, bytes] = {}
    for name in PLOTS:
        figure = _PLOTTERS[name](runs, colors)
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png")
        pngs[name] = buffer.getvalue()
        path = output / f"{name}.png"
        atomic_write_bytes(path, pngs[name])
        written[name] = path
    sections = []
    for run in runs:
        cells = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in _summary_rows(run))
        sections.append(f"<h2>{html.escape(run.label)}</h2><table>{cells}</table>")
    images = "".join(
        f'<figure><img alt="{name}" src="data:image/png;base64,{base64.b64encode(pngs[name]).decode()}">'
        f"<figcaption>{name}.png</figcaption></figure>" for name in PLOTS
    )
    page = ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>dflash-stages report</title><style>"
            "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}th,td{border:1px solid #ccc;"
            "padding:2px 8px;text-align:left}img{max-width:100%}</style></head><body><h1>dflash-stages report</h1>"
            + "".join(sections) + images + "</body></html>")
    html_path = output / "report.html"
    atomic_write_text(html_path, page)
    written["html"] = html_path
    return written


def report_command(
    runs: list[Path] = typer.Argument(..., metavar="RUN", help="Run folders (or pipeline work folders) to plot, overlaid."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Folder for the PNGs and report.html (default: FIRST_RUN/report); a new or empty folder, or an earlier report's."),
) -> None:
    """PNG plots (loss with checkpoint saves, accuracy, tau, throughput, time split, data wait, buckets) and one
    self-contained HTML page for one or more runs.

    Exit codes: 0 written; 2 a RUN has no metrics.jsonl, or the output is a link, a file or a folder holding
    anything but a report.
    """
    from rich.console import Console

    try:
        series = [load_series(run) for run in runs]
        folder = output or series[0].path / "report"
        check_report_output(folder)  # before the lock too: a link would put the lock file where it points
        with output_lock(folder, what="report"):
            check_report_output(folder)
            written = write_report(series, folder)
    except DFlashError as error:
        print_error(error)
        raise typer.Exit(code=ExitCode.USAGE) from None
    Console().print(f"wrote {len(written) - 1} plots and {written['html']}", soft_wrap=True)


def register(app: typer.Typer) -> None:
    """Add the ``report`` command to the CLI."""
    app.command("report")(report_command)
