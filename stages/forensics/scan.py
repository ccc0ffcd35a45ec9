"""``dflash-stages scan PATH...``: every tensor of every checkpoint checked for NaN, Inf and extreme values.

PATH is a run folder (every checkpoint under ``checkpoints/`` is scanned, oldest first, and named), a checkpoint
folder or a serving-format export. Per checkpoint, ``model.safetensors`` and the optimizer state
(``optimizer.safetensors``) are read one tensor at a time through
safetensors' ``safe_open`` (large tensors in row chunks), so memory stays bounded by one chunk whatever the file's
size. Optimizer state is named by parameter (``layers.0.mlp.up_proj.weight.exp_avg``, stored as
``state.7.exp_avg``): the index -> name map is the one the checkpoint recorded (``dflash_param_names`` in the
file's metadata, :func:`dflash.training.checkpoint.optimizer_param_names`).

    dflash-stages scan runs/smol                         # every checkpoint of the run
    dflash-stages scan runs/a runs/b/checkpoints/step_00000100 --max-abs 1e3 --json

Also checked: the step recorded in the folder name, ``trainer_state.json`` and the weights' and optimizer's
metadata agree, and a training checkpoint reads back as ``train --resume`` reads it (:func:`resume_problem`: every
file resume loads, the RNG state included, through the same :func:`dflash.training.checkpoint.load_checkpoint`; this check
holds one checkpoint in memory, as resuming does). Exit codes: 0 all clean; 1 a NaN/Inf/extreme value or a step mismatch was found; 2 a PATH is not a
run, checkpoint or export (one ``error:`` line). ``inspect PATH --scan`` runs the same scan.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import typer

from dflash.errors import CheckpointError, DFlashError
from stages.config.exit_status import ExitCode, print_error
from stages.forensics.runs import describe, file_tensors, resume_problem, run_of_workdir, step_problems

__all__ = ["register", "scan_command", "TensorFinding", "CheckpointScan", "checkpoints_to_scan", "scan_checkpoint",
           "resume_problem", "scan_paths", "print_scans", "DEFAULT_MAX_ABS"]

#: Finite values above this magnitude count as extreme (drafter weights and Adam moments stay far below it).
DEFAULT_MAX_ABS = 1e4
#: Tensors read whole up to this many elements; larger ones in row chunks of about this size.
_STATE_NAME = re.compile(r"^state\.(\d+)\.(.+)$")


@dataclass(slots=True)
class TensorFinding:
    """One tensor with NaN, Inf or extreme values."""

    file: str
    tensor: str  # the parameter-based name (optimizer state: ``<parameter>.<state key>``)
    stored_as: str  # the name in the file
    dtype: str
    shape: list[int]
    nan: int
    inf: int
    extreme: int
    max_abs: float  # over the finite values


@dataclass(slots=True)
class CheckpointScan:
    """What one checkpoint (or export) folder's scan read and found."""

    path: Path
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    values: int = 0
    findings: list[TensorFinding] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # step disagreements, what resume would refuse
    notes: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.findings and not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "files": self.files, "tensors": self.tensors, "values": self.values,
                "findings": [asdict(f) for f in self.findings], "problems": self.problems, "notes": self.notes}


def checkpoints_to_scan(path: str | Path) -> list[Path]:
    """The checkpoint/export folders ``path`` stands for: all of a run's checkpoints (oldest first; a pipeline work
    folder's run, :func:`stages.forensics.runs.run_of_workdir`), or itself.

    Raises:
        CheckpointError: ``path`` is no run, checkpoint or export, or a run without any checkpoint.
    """
    folder = run_of_workdir(Path(path).expanduser())
    if (folder / "checkpoints").is_dir() and not (folder / "model.safetensors").is_file():
        # A run: listed directly, so a damaged run (a dangling `latest`, a broken run.json) is still scanned.
        folders = sorted(p for p in (folder / "checkpoints").glob("step_*") if p.is_dir())
        if not folders:
            raise CheckpointError(f"run folder {folder} has no checkpoint under checkpoints/; nothing to scan")
        return folders
    artefact = describe(folder)  # raises for a folder that is none of the three
    if artefact.kind == "run":
        raise CheckpointError(f"run folder {folder} has no checkpoint under checkpoints/; nothing to scan")
    return [artefact.path]


def _param_names(optimizer_file: Path, scan: CheckpointScan) -> list[str] | None:
    """Parameter name per optimizer index, as recorded in the file's metadata (None, and a note, when it is not)."""
    from dflash.io.weights import open_safetensors
    from dflash.training.checkpoint import PARAM_NAMES_KEY

    with open_safetensors(optimizer_file) as handle:
        recorded = (handle.metadata() or {}).get(PARAM_NAMES_KEY)
    if recorded:
        return list(json.loads(recorded))
    scan.notes.append(f"{optimizer_file.name}: no parameter names recorded; optimizer state is named by index")
    return None


def _readable_name(stored: str, names: list[str] | None) -> str:
    match = _STATE_NAME.match(stored)
    if names is None or match is None or int(match.group(1)) >= len(names):
        return stored
    return f"{names[int(match.group(1))]}.{match.group(2)}"


def _scan_file(path: Path, names: list[str] | None, max_abs: float, scan: CheckpointScan) -> None:
    import torch

    for stored, dtype, shape, chunks in file_tensors(path):
        scan.tensors += 1
        nan = inf = extreme = 0
        largest = 0.0
        counter = stored.rsplit(".", 1)[-1] == "step"  # Adam's step count: a counter, not a value to bound
        for chunk in chunks:
            scan.values += chunk.numel()
            if not chunk.is_floating_point() or chunk.numel() == 0:
                continue
            chunk = chunk.float() if chunk.dtype in (torch.float16, torch.bfloat16) else chunk
            finite = torch.isfinite(chunk)
            nan += int(torch.isnan(chunk).sum())
            inf += int(torch.isinf(chunk).sum())
            magnitudes = chunk.abs().masked_fill(~finite, 0)
            largest = max(largest, float(magnitudes.max()))
            if not counter:
                extreme += int((magnitudes > max_abs).sum())
        if nan or inf or extreme:
            scan.findings.append(TensorFinding(
                file=path.name, tensor=_readable_name(stored, names), stored_as=stored, dtype=dtype, shape=shape,
                nan=nan, inf=inf, extreme=extreme, max_abs=largest,
            ))


def scan_checkpoint(folder: str | Path, *, max_abs: float = DEFAULT_MAX_ABS) -> CheckpointScan:
    """Scan one checkpoint or export folder: weights and optimizer state, one tensor (chunk) at a time."""
    folder = Path(folder)
    scan = CheckpointScan(path=folder)
    files = [folder / "model.safetensors"] if (folder / "model.safetensors").is_file() else []
    optimizer = folder / "optimizer.safetensors" if (folder / "optimizer.safetensors").is_file() else None
    if not files:
        scan.problems.append(f"{folder / 'model.safetensors'} is missing")
    for path in files:
        _scan_file(path, None, max_abs, scan)
    if optimizer is not None:
        files.append(optimizer)
        _scan_file(optimizer, _param_names(optimizer, scan), max_abs, scan)
    scan.files = [path.name for path in files]
    scan.problems.extend(step_problems(folder, files))
    if (folder / "trainer_state.json").is_file() or (folder / "drafter_config.json").is_file():  # not an export
        problem = resume_problem(folder)
        if problem is not None:
            scan.problems.append(problem)
    return scan


def scan_paths(paths: list[Path], *, max_abs: float = DEFAULT_MAX_ABS) -> list[CheckpointScan]:
    """Every checkpoint the ``paths`` stand for (:func:`checkpoints_to_scan`), scanned in order."""
    folders = [folder for path in paths for folder in checkpoints_to_scan(path)]  # all paths checked before reading
    return [scan_checkpoint(folder, max_abs=max_abs) for folder in folders]


def print_scans(console: Any, scans: list[CheckpointScan], *, max_abs: float) -> None:
    """One line per checkpoint saying what was read, a table of its bad tensors, then a one-line total."""
    from rich.markup import escape
    from rich.table import Table

    columns = ("file", "tensor", "stored as", "dtype", "shape", "nan", "inf", f"|x|>{max_abs:g}", "max |x|")
    for scan in scans:
        verdict = "[green]clean[/]" if scan.clean else f"[red]{len(scan.findings)} bad tensors[/]"
        console.print(f"{escape(str(scan.path))}: scanned {scan.tensors} tensors ({scan.values:,} values) in "
                      f"{', '.join(scan.files) or 'no files'}: {verdict}", soft_wrap=True)
        if scan.findings:
            table = Table(title=f"tensors with NaN/Inf/extreme values in {escape(str(scan.path))}")
            for column in columns:
                table.add_column(column, overflow="fold")
            for f in scan.findings:
                table.add_row(f.file, escape(f.tensor), escape(f.stored_as), f.dtype, str(f.shape), str(f.nan),
                              str(f.inf), str(f.extreme), f"{f.max_abs:.3g}")
            console.print(table)
        for problem in scan.problems:
            console.print(f"  [red]problem:[/] {escape(problem)}")
        for note in scan.notes:
            console.print(f"  [yellow]note:[/] {escape(note)}")
    bad = [scan for scan in scans if not scan.clean]
    summary = f"[red]{len(bad)} of {len(scans)} with problems[/]" if bad else "[green]all clean[/]"
    console.print(f"{len(scans)} checkpoint(s) scanned: {summary}")


def scan_command(
    paths: list[Path] = typer.Argument(..., metavar="PATH", help="Run folders (every checkpoint; a pipeline work folder: its run), checkpoint or export folders."),
    max_abs: float = typer.Option(DEFAULT_MAX_ABS, "--max-abs", help="Finite values above this magnitude count as extreme."),
    as_json: bool = typer.Option(False, "--json", help="Print the findings as JSON instead of tables."),
) -> None:
    """Check every tensor (weights and optimizer state) of every checkpoint for NaN/Inf/extreme values.

    Exit codes: 0 clean; 1 something was found (a bad tensor or disagreeing steps); 2 a PATH is not a run,
    checkpoint or export.
    """
    from rich.console import Console

    console = Console()
    try:
        scans = scan_paths(paths, max_abs=max_abs)
    except DFlashError as error:
        print_error(error)
        raise typer.Exit(code=ExitCode.USAGE) from None
    if as_json:
        console.print_json(json.dumps([scan.to_dict() for scan in scans]))
    else:
        print_scans(console, scans, max_abs=max_abs)
    if not all(scan.clean for scan in scans):
        raise typer.Exit(code=1)


def register(app: typer.Typer) -> None:
    """Add the ``scan`` command to the CLI."""
    app.command("scan")(scan_command)
