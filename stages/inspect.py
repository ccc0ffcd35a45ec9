"""``dflash-stages inspect PATH``: print everything recorded about a run, a checkpoint or an export.

PATH is a run folder (``run.json``, ``latest``, ``checkpoints/``), a checkpoint folder (``drafter_config.json``,
``model.safetensors``, ``target.json``...) or a serving-format export (``config.json`` with
``architectures: ["DFlashDraftModel"]``, ``dflash_export.json``).

    dflash-stages inspect runs/smol                       # resolved config, target, checkpoints, weights
    dflash-stages inspect runs/smol --diff exports/smol   # = dflash-stages diff runs/smol exports/smol (stages/diff.py)
    dflash-stages inspect runs/smol --scan                # = dflash-stages scan runs/smol (stages/scan.py)
    dflash-stages inspect runs/smol --json > smol.json    # the same facts, checks and per-tensor statistics as JSON

Every artefact is reduced to flat ``section.key -> value`` facts (sections: ``drafter`` = the DFlashConfig fields,
``target``, ``run``, ``trainer``, ``serving``, ``provenance``, ``weights``); the diff compares the sections both sides
have, so a checkpoint and its export compare by drafter config and target.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import typer

__all__ = ["register", "inspect_command", "Artefact", "describe", "diff_facts", "scan_tensors", "flatten",
           "tensor_statistics", "parameter_groups"]

ArtefactKind = Literal["run", "checkpoint", "export"]


def flatten(data: Any, prefix: str) -> dict[str, Any]:
    """Nested mappings -> ``{"prefix.a.b": value}``; lists and scalars are leaves."""
    if isinstance(data, Mapping):
        flat: dict[str, Any] = {}
        for key, value in data.items():
            flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: data}


@dataclass(slots=True)
class Artefact:
    """What ``inspect`` knows about one path: its kind, flat facts, the weight files to scan, loader verdicts."""

    path: Path
    kind: ArtefactKind
    facts: dict[str, Any] = field(default_factory=dict)
    weight_files: list[Path] = field(default_factory=list)
    checks: dict[str, str] = field(default_factory=dict)  # name -> "ok" or the error message
    notes: list[str] = field(default_factory=list)
    #: The safetensors file of the drafter's weights (checkpoint or export), for per-tensor statistics.
    model_file: Path | None = None

    def to_dict(self, tensors: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """JSON form (``inspect --json``): facts by key, checks, notes, parameter counts, per-tensor statistics."""
        data: dict[str, Any] = {"path": str(self.path), "kind": self.kind, "facts": self.facts, "checks": self.checks,
                                "notes": self.notes, "model_file": str(self.model_file) if self.model_file else None}
        if tensors is not None:
            data["parameters"] = parameter_groups(tensors)
            data["tensors"] = tensors
        return data


def tensor_statistics(path: Path) -> list[dict[str, Any]]:
    """Per tensor of a safetensors (or format-1 torch) file, streamed in row chunks (bounded memory).

    Returns:
        One dict per tensor, in file order: ``name``, ``dtype``, ``shape``, ``numel``; for floating-point tensors
        also ``min``, ``max``, ``mean``, ``std`` (population), ``abs_max`` over the finite values (float64
        accumulation; None when no value is finite) and ``nonfinite`` (NaN + Inf count).
    """
    import torch

    from stages.scan import file_tensors

    rows = []
    for name, dtype, shape, chunks in file_tensors(path):
        count = nonfinite = 0
        total = squares = 0.0
        low, high = float("inf"), float("-inf")
        numel = 0
        floating = False
        for chunk in chunks:
            numel += chunk.numel()
            if not chunk.is_floating_point() or chunk.numel() == 0:
                continue
            floating = True
            values = chunk.double().flatten()
            finite = torch.isfinite(values)
            nonfinite += int((~finite).sum())
            values = values[finite]
            if values.numel():
                count += values.numel()
                total += float(values.sum())
                squares += float((values * values).sum())
                low, high = min(low, float(values.min())), max(high, float(values.max()))
        row: dict[str, Any] = {"name": name, "dtype": dtype, "shape": [int(n) for n in shape], "numel": numel}
        if floating:
            mean = total / count if count else None
            row.update(min=low if count else None, max=high if count else None, mean=mean,
                       std=max(0.0, squares / count - mean * mean) ** 0.5 if count else None,
                       abs_max=max(abs(low), abs(high)) if count else None, nonfinite=nonfinite)
        rows.append(row)
    return rows


def parameter_groups(tensors: list[dict[str, Any]]) -> dict[str, Any]:
    """Parameter counts: ``total`` and per group (``layers.N`` per draft layer, else the name's first part)."""
    groups: dict[str, int] = {}
    for row in tensors:
        parts = row["name"].split(".")
        key = ".".join(parts[:2]) if len(parts) > 2 and parts[1].isdigit() else parts[0]
        groups[key] = groups.get(key, 0) + int(row["numel"])
    return {"total": sum(groups.values()), "groups": groups}


def _read_json(path: Path) -> Any:
    from dflash.errors import CheckpointError

    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: unreadable JSON ({error})") from None


def _weights_summary(path: Path) -> dict[str, Any]:
    """Tensor count, parameters, dtypes and bytes of a safetensors file (header only, no data read)."""
    from dflash.weights_io import open_safetensors

    count, parameters, dtypes = 0, 0, set()
    with open_safetensors(path) as handle:
        for name in handle.keys():
            tensor_slice = handle.get_slice(name)
            numel = 1
            for size in tensor_slice.get_shape():
                numel *= int(size)
            count += 1
            parameters += numel
            dtypes.add(str(tensor_slice.get_dtype()))
    return {"file": path.name, "tensors": count, "parameters": parameters, "dtypes": sorted(dtypes), "bytes": path.stat().st_size}


def _shapes(path: Path) -> dict[str, tuple[int, ...]]:
    from dflash.weights_io import open_safetensors

    with open_safetensors(path) as handle:
        return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}


def _describe_checkpoint(folder: Path, artefact: Artefact) -> None:
    from dflash.errors import DFlashError
    from dflash.export import CHECKPOINT_CONFIG_FILE, CHECKPOINT_TARGET_FILE, WEIGHTS_FILE, check_state_dict

    config = _read_json(folder / CHECKPOINT_CONFIG_FILE)
    artefact.facts.update(flatten(config, "drafter"))
    if (folder / CHECKPOINT_TARGET_FILE).is_file():
        artefact.facts.update(flatten(_read_json(folder / CHECKPOINT_TARGET_FILE), "target"))
    else:
        artefact.notes.append(f"{folder / CHECKPOINT_TARGET_FILE} is missing: the target cannot be checked")
    if (folder / "trainer_state.json").is_file():
        artefact.facts.update(flatten(_read_json(folder / "trainer_state.json"), "trainer"))
    weights = folder / WEIGHTS_FILE
    if weights.is_file():
        artefact.weight_files.append(weights)
        artefact.model_file = weights
        artefact.facts.update(flatten(_weights_summary(weights), "weights"))
        try:
            check_state_dict(_shapes(weights), config, where=str(weights))
            artefact.checks["weight names and shapes"] = "ok"
        except (DFlashError, KeyError) as error:
            artefact.checks["weight names and shapes"] = str(error)
    else:
        artefact.checks["weights"] = f"{weights} is missing"
    for state_file in ("optimizer.safetensors", "optimizer.pt", "rng.safetensors"):  # format 2, or format 1's file
        if (folder / state_file).is_file() and state_file != "rng.safetensors":
            artefact.weight_files.append(folder / state_file)
    from stages.scan import resume_problem, step_problems

    recorded = [folder / name for name in (WEIGHTS_FILE, "optimizer.safetensors", "rng.safetensors")
                if (folder / name).is_file()]
    problems = step_problems(folder, recorded)
    artefact.checks["steps agree (folder, trainer state, weights, optimizer, RNG)"] = "; ".join(problems) or "ok"
    artefact.checks["resumable (every file train --resume reads, read as it reads them)"] = resume_problem(folder) or "ok"


def _describe_export(folder: Path, artefact: Artefact) -> None:
    from dflash.errors import DFlashError
    from dflash.export import (
        CONFIG_FILE,
        PROVENANCE_FILE,
        WEIGHTS_FILE,
        drafter_config_dict_from_serving,
        read_exported,
    )

    config = _read_json(folder / CONFIG_FILE)
    artefact.facts.update(flatten(config, "serving"))
    try:
        artefact.facts.update(flatten(drafter_config_dict_from_serving(config), "drafter"))
    except (KeyError, TypeError) as error:
        artefact.notes.append(f"config.json does not map onto a drafter config: missing {error}")
    if (folder / PROVENANCE_FILE).is_file():
        provenance = _read_json(folder / PROVENANCE_FILE)
        target = provenance.pop("target", None) or {}
        provenance.pop("drafter_config", None)  # same facts as drafter.* above
        artefact.facts.update(flatten(target, "target"))
        artefact.facts.update(flatten(provenance, "provenance"))
    else:
        artefact.notes.append(f"no {PROVENANCE_FILE}: target and source are unknown")
    weights = folder / WEIGHTS_FILE
    if weights.is_file():
        artefact.weight_files.append(weights)
        artefact.model_file = weights
        artefact.facts.update(flatten(_weights_summary(weights), "weights"))
    try:
        read_exported(folder, check_finite=False)
        artefact.checks["strict serving-format loader"] = "ok"
    except DFlashError as error:
        artefact.checks["strict serving-format loader"] = str(error)


def describe(path: str | Path) -> Artefact:
    """Facts about a run, checkpoint or export folder.

    Raises:
        CheckpointError: the path is none of the three, or a recorded pointer/JSON file is broken.
    """
    from dflash.checkpoint import resolve_checkpoint
    from dflash.errors import CheckpointError
    from dflash.export import CHECKPOINT_CONFIG_FILE, CONFIG_FILE, PROVENANCE_FILE

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder; pass a run, checkpoint or export folder")
    if (folder / CHECKPOINT_CONFIG_FILE).is_file():
        artefact = Artefact(path=folder, kind="checkpoint")
        _describe_checkpoint(folder, artefact)
        return artefact
    config_path = folder / CONFIG_FILE
    if (folder / PROVENANCE_FILE).is_file() or (
        config_path.is_file() and "DFlashDraftModel" in (_read_json(config_path).get("architectures") or [])
    ):
        artefact = Artefact(path=folder, kind="export")
        _describe_export(folder, artefact)
        return artefact
    if (folder / "run.json").is_file() or (folder / "latest").is_file() or (folder / "checkpoints").is_dir():
        artefact = Artefact(path=folder, kind="run")
        if (folder / "run.json").is_file():
            artefact.facts.update(flatten(_read_json(folder / "run.json"), "run"))
        checkpoints = sorted(p.name for p in (folder / "checkpoints").glob("*") if p.is_dir())
        artefact.facts["run.checkpoints"] = checkpoints
        for pointer in ("latest", "best"):
            if (folder / pointer).is_file():
                artefact.facts[f"run.{pointer}"] = (folder / pointer).read_text().strip()
        if (folder / "latest").is_file():
            latest = resolve_checkpoint(folder)
            artefact.notes.append(f"drafter/target/weights facts are from the latest checkpoint {latest}")
            _describe_checkpoint(latest, artefact)
        else:
            artefact.notes.append("no `latest` pointer: the run has no complete checkpoint yet")
        return artefact
    raise CheckpointError(
        f"{folder} is not a run (run.json/latest), checkpoint ({CHECKPOINT_CONFIG_FILE}) or export "
        f"({CONFIG_FILE} with architectures DFlashDraftModel) folder"
    )


def diff_facts(left: Artefact, right: Artefact) -> tuple[list[tuple[str, Any, Any]], list[str]]:
    """Config differences between two artefacts over the sections both have (the ``weights`` summary excluded).

    Returns:
        ``(rows, skipped_sections)``: rows ``(key, left value, right value)`` (``<absent>`` when one side lacks the
        key), sorted by key; and the sections only one side has (not compared).
    """
    absent = "<absent>"

    def sections(facts: Mapping[str, Any]) -> set[str]:
        return {key.split(".", 1)[0] for key in facts}

    # A config diff: the weights summary (dtype, bytes) is not config, and export timestamps always differ.
    common = (sections(left.facts) & sections(right.facts)) - {"weights"}
    skipped = sorted((sections(left.facts) | sections(right.facts)) - common - {"weights"})
    keys = sorted(
        key
        for key in set(left.facts) | set(right.facts)
        if key.split(".", 1)[0] in common and key != "provenance.created_at"
    )
    rows = [
        (key, left.facts.get(key, absent), right.facts.get(key, absent))
        for key in keys
        if left.facts.get(key, absent) != right.facts.get(key, absent)
    ]
    return rows, skipped


def _named_tensors(path: Path) -> Iterator[tuple[str, Any]]:
    """Every tensor in a safetensors file or a ``torch.save`` file (nested dicts/lists walked, named by path)."""
    import torch

    if path.suffix == ".safetensors":
        from dflash.weights_io import open_safetensors

        with open_safetensors(path) as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
        return
    from dflash.state_files import load_legacy_torch_file

    stack: list[tuple[str, Any]] = [("", load_legacy_torch_file(path))]  # a format-1 optimizer.pt: never unpickled
    while stack:
        name, value = stack.pop()
        if isinstance(value, torch.Tensor):
            yield name, value
        elif isinstance(value, Mapping):
            stack.extend((f"{name}.{key}" if name else str(key), item) for key, item in reversed(list(value.items())))
        elif isinstance(value, (list, tuple)):
            stack.extend((f"{name}.{index}" if name else str(index), item) for index, item in reversed(list(enumerate(value))))


def scan_tensors(files: list[Path]) -> tuple[int, int, list[dict[str, Any]]]:
    """Count NaN and Inf values in every floating-point tensor of ``files``, one tensor at a time.

    Returns:
        ``(tensors_scanned, elements_scanned, bad)`` where ``bad`` lists ``{file, tensor, dtype, shape, nan, inf}``.
    """
    import torch

    scanned, elements, bad = 0, 0, []
    for path in files:
        for name, tensor in _named_tensors(path):
            scanned += 1
            elements += tensor.numel()
            if not tensor.is_floating_point():
                continue
            nan = int(torch.isnan(tensor).sum())
            inf = int(torch.isinf(tensor).sum())
            if nan or inf:
                bad.append({"file": path.name, "tensor": name, "dtype": str(tensor.dtype), "shape": list(tensor.shape), "nan": nan, "inf": inf})
    return scanned, elements, bad


def _format(value: Any) -> str:
    """A fact as table text, with rich markup escaped (``hidden_states[l + 1]`` must print as is)."""
    from rich.markup import escape

    return escape(value if isinstance(value, str) else json.dumps(value))


#: Narrowest a value column gets before long keys are shortened (with an ellipsis) on a narrow terminal.
_VALUE_MIN_WIDTH = 10


def _add_key_column(table: Any, console: Any, keys: list[str], value_columns: int) -> None:
    """The key column: each key on one line, never split mid-word (a folded ``..._samples`` / ``_train`` read like
    two keys). It is as wide as the longest key; the value columns fold into the rest. Only a terminal too narrow
    to leave ``_VALUE_MIN_WIDTH`` columns per value shortens keys, with an ellipsis."""
    borders_and_padding = (value_columns + 2) + 2 * (value_columns + 1)
    room = console.width - borders_and_padding - value_columns * _VALUE_MIN_WIDTH
    longest = max((len(key) for key in keys), default=3)
    table.add_column("key", style="bold", no_wrap=True, overflow="ellipsis", width=max(8, min(longest, room)))


def _print_artefact(console: Any, artefact: Artefact) -> None:
    from rich.table import Table

    table = Table(title=f"{artefact.kind} {artefact.path}", show_lines=False)
    _add_key_column(table, console, list(artefact.facts), value_columns=1)
    table.add_column("value", overflow="fold")
    previous_section = None
    for key in sorted(artefact.facts, key=lambda k: (k.split(".", 1)[0] != "drafter", k)):
        section = key.split(".", 1)[0]
        if previous_section is not None and section != previous_section:
            table.add_section()
        previous_section = section
        table.add_row(_format(key), _format(artefact.facts[key]))
    console.print(table)
    for name, verdict in artefact.checks.items():
        console.print(f"{name}: " + ("[green]ok[/]" if verdict == "ok" else f"[red]FAILED[/] {_format(verdict)}"))
    for note in artefact.notes:
        console.print(f"[yellow]note:[/] {_format(note)}")


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
        table.add_row(_format(row["name"]), row["dtype"], "x".join(map(str, row["shape"])) or "scalar",
                      number(row.get("min")), number(row.get("max")), number(row.get("mean")), number(row.get("std")),
                      number(row.get("abs_max")), str(row.get("nonfinite", "-")))
    console.print(table)
    counts = Table(title="parameters by group")
    counts.add_column("group")
    counts.add_column("parameters", justify="right")
    for name, count in groups["groups"].items():
        counts.add_row(_format(name), f"{count:,}")
    counts.add_row("[bold]total[/]", f"[bold]{groups['total']:,}[/]")
    console.print(counts)


def inspect_command(
    path: Path = typer.Argument(..., metavar="PATH", help="A run folder, a checkpoint folder or a serving-format export folder."),
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

    from dflash.errors import DFlashError

    console = Console()
    try:
        artefact = describe(path)
        other = describe(diff) if diff is not None else None  # both refused here, before any output
    except DFlashError as error:
        from stages.exit_status import ExitCode, print_error

        print_error(error)
        raise typer.Exit(code=ExitCode.USAGE) from None

    if as_json and (other is not None or scan):
        from stages.exit_status import ExitCode, print_error

        print_error("--json prints one artefact: use it without --diff and --scan (`dflash-stages diff` and "
                    "`dflash-stages scan` have their own --json)")
        raise typer.Exit(code=ExitCode.USAGE)
    failed = False
    statistics = tensor_statistics(artefact.model_file) if tensors and artefact.model_file is not None else None
    if as_json:
        print(json.dumps(artefact.to_dict(statistics), indent=2, default=str))
        if any(verdict != "ok" for verdict in artefact.checks.values()):
            raise typer.Exit(code=1)
        return
    if other is None:
        _print_artefact(console, artefact)
        if statistics is not None and artefact.model_file is not None:
            _print_tensors(console, statistics, artefact.model_file)
        failed = any(verdict != "ok" for verdict in artefact.checks.values())
    else:  # the same comparison as ``dflash-stages diff PATH OTHER``
        from stages.diff import compare, load_side, print_comparison

        comparison = compare(load_side(path), load_side(diff))
        print_comparison(console, comparison)
        failed = comparison.differs

    if scan:  # the same scan as ``dflash-stages scan PATH`` (every checkpoint of a run)
        from stages.scan import DEFAULT_MAX_ABS, print_scans, scan_paths

        scans = scan_paths([path], max_abs=DEFAULT_MAX_ABS)
        print_scans(console, scans, max_abs=DEFAULT_MAX_ABS)
        failed = failed or not all(item.clean for item in scans)
    if failed:
        raise typer.Exit(code=1)


def register(app: typer.Typer) -> None:
    """Add the ``inspect`` command to the CLI."""
    app.command("inspect")(inspect_command)
