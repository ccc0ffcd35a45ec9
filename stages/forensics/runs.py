"""One reader of the artefacts the forensics commands look at: run folders, checkpoint folders and exports.

:func:`describe` reduces each to an :class:`Artefact` of flat ``section.key -> value`` facts and checks; :func:`file_tensors` streams the tensors of a weights or optimizer file in bounded chunks. ``inspect``,
``scan``, ``diff`` and ``report`` read through these.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dflash.errors import CheckpointError, DFlashError
from dflash.io.files import load_json
from dflash.serving.export import (
    CHECKPOINT_CONFIG_FILE,
    CHECKPOINT_TARGET_FILE,
    CONFIG_FILE,
    PROVENANCE_FILE,
    WEIGHTS_FILE,
    check_state_dict,
    drafter_config_dict_from_serving,
    read_exported,
)

__all__ = ["Artefact", "describe", "flatten", "tensor_statistics", "parameter_groups",
           "file_tensors", "resume_problem", "evaluated_tau", "run_of_workdir", "step_problems", "read_json", "format_value", "add_key_column"]

#: Elements per chunk when a large tensor is streamed.
_CHUNK_ELEMENTS = 1 << 24

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
    """What ``inspect`` knows about one path: its kind, flat facts, loader verdicts."""

    path: Path
    kind: ArtefactKind
    facts: dict[str, Any] = field(default_factory=dict)
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
    """Per tensor of a safetensors file, streamed in row chunks (bounded memory).

    Returns:
        One dict per tensor, in file order: ``name``, ``dtype``, ``shape``, ``numel``; for floating-point tensors
        also ``min``, ``max``, ``mean``, ``std`` (population), ``abs_max`` over the finite values (float64
        accumulation; None when no value is finite) and ``nonfinite`` (NaN + Inf count).
    """
    import torch

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


def read_json(path: Path) -> Any:
    try:
        return load_json(path, error=CheckpointError, fix="the file is damaged or was edited", expect=None)
    except OSError as error:
        raise CheckpointError(f"{path}: unreadable ({error.strerror or error})") from None


def _weights_summary(path: Path) -> dict[str, Any]:
    """Tensor count, parameters, dtypes and bytes of a safetensors file (header only, no data read)."""
    from dflash.io.weights import open_safetensors

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
    from dflash.io.weights import open_safetensors

    with open_safetensors(path) as handle:
        return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}


def _describe_checkpoint(folder: Path, artefact: Artefact) -> None:
    config = read_json(folder / CHECKPOINT_CONFIG_FILE)
    artefact.facts.update(flatten(config, "drafter"))
    if (folder / CHECKPOINT_TARGET_FILE).is_file():
        artefact.facts.update(flatten(read_json(folder / CHECKPOINT_TARGET_FILE), "target"))
    else:
        artefact.notes.append(f"{folder / CHECKPOINT_TARGET_FILE} is missing: the target cannot be checked")
    if (folder / "trainer_state.json").is_file():
        artefact.facts.update(flatten(read_json(folder / "trainer_state.json"), "trainer"))
    weights = folder / WEIGHTS_FILE
    if weights.is_file():
        artefact.model_file = weights
        artefact.facts.update(flatten(_weights_summary(weights), "weights"))
        try:
            check_state_dict(_shapes(weights), config, where=str(weights))
            artefact.checks["weight names and shapes"] = "ok"
        except (DFlashError, KeyError) as error:
            artefact.checks["weight names and shapes"] = str(error)
    else:
        artefact.checks["weights"] = f"{weights} is missing"
    recorded = [folder / name for name in (WEIGHTS_FILE, "optimizer.safetensors", "rng.safetensors")
                if (folder / name).is_file()]
    problems = step_problems(folder, recorded)
    artefact.checks["steps agree (folder, trainer state, weights, optimizer, RNG)"] = "; ".join(problems) or "ok"
    artefact.checks["resumable (every file train --resume reads, read as it reads them)"] = resume_problem(folder) or "ok"


def _describe_export(folder: Path, artefact: Artefact) -> None:
    config = read_json(folder / CONFIG_FILE)
    artefact.facts.update(flatten(config, "serving"))
    try:
        artefact.facts.update(flatten(drafter_config_dict_from_serving(config), "drafter"))
    except (KeyError, TypeError) as error:
        artefact.notes.append(f"config.json does not map onto a drafter config: missing {error}")
    if (folder / PROVENANCE_FILE).is_file():
        provenance = read_json(folder / PROVENANCE_FILE)
        target = provenance.pop("target", None) or {}
        provenance.pop("drafter_config", None)  # same facts as drafter.* above
        artefact.facts.update(flatten(target, "target"))
        artefact.facts.update(flatten(provenance, "provenance"))
    else:
        artefact.notes.append(f"no {PROVENANCE_FILE}: target and source are unknown")
    weights = folder / WEIGHTS_FILE
    if weights.is_file():
        artefact.model_file = weights
        artefact.facts.update(flatten(_weights_summary(weights), "weights"))
    try:
        read_exported(folder, check_finite=False)
        artefact.checks["strict serving-format loader"] = "ok"
    except DFlashError as error:
        artefact.checks["strict serving-format loader"] = str(error)


def run_of_workdir(folder: Path) -> Path:
    """``WORKDIR/run`` for a pipeline work folder (``pipeline.json`` beside a ``run`` folder: what
    ``dflash-stages run`` writes), else ``folder`` itself."""
    return folder / "run" if (folder / "pipeline.json").is_file() and (folder / "run").is_dir() else folder


def describe(path: str | Path) -> Artefact:
    """Facts about a run, checkpoint or export folder (a pipeline work folder: its run, :func:`run_of_workdir`).

    Raises:
        CheckpointError: the path is none of the three, or a recorded pointer/JSON file is broken.
    """
    from dflash.training.checkpoint import resolve_checkpoint

    folder = run_of_workdir(Path(path).expanduser())
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder; pass a run, checkpoint or export folder")
    if (folder / CHECKPOINT_CONFIG_FILE).is_file():
        artefact = Artefact(path=folder, kind="checkpoint")
        _describe_checkpoint(folder, artefact)
        return artefact
    config_path = folder / CONFIG_FILE
    if (folder / PROVENANCE_FILE).is_file() or (
        config_path.is_file() and "DFlashDraftModel" in (read_json(config_path).get("architectures") or [])
    ):
        artefact = Artefact(path=folder, kind="export")
        _describe_export(folder, artefact)
        return artefact
    if (folder / "run.json").is_file() or (folder / "latest").is_file() or (folder / "checkpoints").is_dir():
        artefact = Artefact(path=folder, kind="run")
        if (folder / "run.json").is_file():
            artefact.facts.update(flatten(read_json(folder / "run.json"), "run"))
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
        f"{folder} is not a run (run.json/latest), checkpoint ({CHECKPOINT_CONFIG_FILE}), export "
        f"({CONFIG_FILE} with architectures DFlashDraftModel) or pipeline work folder (pipeline.json and run/)"
    )


def _eval_folder(run: Path) -> Path | None:
    """Where the evaluation reports of ``run`` are: ``WORKDIR/eval`` for a pipeline's run (``WORKDIR/run`` beside
    ``WORKDIR/pipeline.json``), else ``RUN/eval`` (``evaluate --json-file RUN/eval/final.json``)."""
    for folder in ((run.parent / "eval") if (run.parent / "pipeline.json").is_file() else None, run / "eval"):
        if folder is not None and folder.is_dir():
            return folder
    return None


def _tau_of(path: Path) -> float | None:
    try:
        report = read_json(path)
    except CheckpointError:
        return None
    tau = report.get("tau") if isinstance(report, dict) else None
    return float(tau) if isinstance(tau, int | float) and not isinstance(tau, bool) else None


def evaluated_tau(run: str | Path) -> dict[str, Any]:
    """The tau ``evaluate`` measured on held-out prompts for the drafters of ``run``, the one definition ``report``,
    ``diff`` and ``inspect`` show as "evaluated tau" (the mean accepted tokens per draft-verify cycle, not the tau
    the training accuracies imply).

    Returns:
        ``{"tau", "source", "epochs", "also"}``: ``tau`` is the final drafter's (``eval/final.json``), else the last
        per-epoch report's, None when nothing was evaluated; ``source`` the report file it came from; ``epochs`` the
        per-epoch measurements ``[{"epoch", "step", "tau"}]`` the pipeline recorded in ``pipeline.json``; ``also``
        ``{"tau", "source"}`` of a pipeline's run's own ``RUN/eval/final.json`` (where ``evaluate --drafter RUN``
        writes), None without one.
    """
    run = Path(run)
    epochs: list[dict[str, Any]] = []
    pipeline = run.parent / "pipeline.json"
    if pipeline.is_file():
        try:
            recorded = read_json(pipeline).get("epochs") or []
        except (CheckpointError, AttributeError):
            recorded = []
        epochs = [e for e in recorded if isinstance(e, dict) and isinstance(e.get("tau"), int | float)]
    out: dict[str, Any] = {"tau": None, "source": None, "epochs": epochs, "also": None}
    folder = _eval_folder(run)
    if folder is None:
        return out
    own = run / "eval" / "final.json"
    if folder != own.parent and own.is_file() and (tau := _tau_of(own)) is not None:
        out["also"] = {"tau": tau, "source": str(own)}
    numbered = sorted((int(m.group(1)), p) for p in folder.glob("epoch_*.json")
                      if (m := re.fullmatch(r"epoch_(\d+)\.json", p.name)))
    for path in [folder / "final.json", *(p for _, p in reversed(numbered))]:
        if path.is_file() and (tau := _tau_of(path)) is not None:
            out.update(tau=tau, source=str(path))
            break
    return out


def format_value(value: Any) -> str:
    """A fact as table text, with rich markup escaped (``hidden_states[l + 1]`` must print as is)."""
    from rich.markup import escape

    return escape(value if isinstance(value, str) else json.dumps(value))


#: Narrowest a value column gets before long keys are shortened (with an ellipsis) on a narrow terminal.
_VALUE_MIN_WIDTH = 10


def add_key_column(table: Any, console: Any, keys: list[str], value_columns: int) -> None:
    """The key column: each key on one line, never split mid-word (a folded ``..._samples`` / ``_train`` read like
    two keys). It is as wide as the longest key; the value columns fold into the rest. Only a terminal too narrow
    to leave ``_VALUE_MIN_WIDTH`` columns per value shortens keys, with an ellipsis."""
    borders_and_padding = (value_columns + 2) + 2 * (value_columns + 1)
    room = console.width - borders_and_padding - value_columns * _VALUE_MIN_WIDTH
    longest = max((len(key) for key in keys), default=3)
    table.add_column("key", style="bold", no_wrap=True, overflow="ellipsis", width=max(8, min(longest, room)))


def _chunks(handle: Any, name: str) -> Iterator[Any]:
    """A safetensors tensor as row chunks of about ``_CHUNK_ELEMENTS`` elements (whole when small or 0-d)."""
    tensor_slice = handle.get_slice(name)
    shape = [int(size) for size in tensor_slice.get_shape()]
    numel = 1
    for size in shape:
        numel *= size
    if not shape or numel <= _CHUNK_ELEMENTS or shape[0] <= 1:
        yield handle.get_tensor(name)
        return
    rows = max(1, _CHUNK_ELEMENTS // max(1, numel // shape[0]))
    for start in range(0, shape[0], rows):
        yield tensor_slice[start : start + rows]


def file_tensors(path: Path) -> Iterator[tuple[str, str, list[int], Iterator[Any]]]:
    """``(stored name, dtype, shape, chunks)`` of every tensor of a safetensors file."""
    from dflash.io.weights import open_safetensors

    with open_safetensors(path) as handle:
        for name in handle.keys():
            tensor_slice = handle.get_slice(name)
            yield name, str(tensor_slice.get_dtype()), list(tensor_slice.get_shape()), _chunks(handle, name)


def step_problems(folder: Path, files: list[Path]) -> list[str]:
    """Disagreements between the steps a checkpoint records (folder name, trainer state, files' metadata)."""
    from dflash.io.weights import open_safetensors

    steps: dict[str, int] = {}
    match = re.fullmatch(r"step_(\d+)", folder.name)
    if match:
        steps["folder name"] = int(match.group(1))
    if (folder / "trainer_state.json").is_file():
        recorded = read_json(folder / "trainer_state.json").get("step")
        if recorded is not None:
            steps["trainer_state.json"] = int(recorded)
    for path in files:
        if path.suffix == ".safetensors":
            with open_safetensors(path) as handle:
                recorded = (handle.metadata() or {}).get("step")
            if recorded is not None:
                steps[path.name] = int(recorded)
    if len(set(steps.values())) <= 1:
        return []
    return ["steps disagree: " + ", ".join(f"{where} {step}" for where, step in steps.items())]


def resume_problem(folder: Path) -> str | None:
    """Why ``train --resume`` would refuse the training checkpoint ``folder``, or None: the read resume does
    (:func:`dflash.training.checkpoint.load_checkpoint`: weights, JSON files, optimizer and RNG state, never
    unpickled)."""
    from dflash.training.checkpoint import load_checkpoint  # loads torch

    try:
        load_checkpoint(folder)
    except DFlashError as error:
        return f"train --resume would refuse it: {error}"
    return None
