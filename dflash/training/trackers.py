"""Experiment trackers the training metrics are mirrored to, besides ``metrics.jsonl``: TensorBoard, W&B, MLflow,
Trackio (``train --report-to tensorboard,wandb``).

Each tracker receives the same numeric fields as the JSONL record (``<kind>/<field>``; lists as
``<kind>/<field>/<i>``, dicts as ``<kind>/<field>/<key>``), at the record's step. They work with no network:

- ``tensorboard``: event files under ``RUN/tb`` (the default; purged past the resumed step on resume);
- ``wandb``: ``wandb.init(mode="offline")`` under ``RUN`` unless ``WANDB_MODE`` says otherwise (``wandb sync`` uploads);
- ``mlflow``: a file store at ``RUN/mlruns`` unless ``MLFLOW_TRACKING_URI`` is set;
- ``trackio``: its local store (``TRACKIO_DIR``; no Space unless ``TRACKIO_SPACE_ID`` is set).

W&B, MLflow and Trackio are optional (``pip install wandb`` / ``mlflow`` / ``trackio``): an absent package is skipped
with one warning naming the install command, and training goes on with the others.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

from dflash.errors import ConfigError

__all__ = ["TRACKERS", "TrackerName", "Tracker", "open_trackers", "numeric_fields"]

TrackerName = Literal["tensorboard", "wandb", "mlflow", "trackio"]
#: The names ``--report-to`` accepts (``none``: only ``metrics.jsonl``).
TRACKERS: tuple[str, ...] = ("tensorboard", "wandb", "mlflow", "trackio")
_PROJECT = "dflash-stages"
log = logging.getLogger(__name__)


class Tracker(Protocol):
    """One tracker: scalars per step, optional text, close."""

    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def log_text(self, tag: str, text: str, step: int) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def numeric_fields(kind: str, record: Mapping[str, Any]) -> dict[str, float]:
    """``{"<kind>/<field>": value}`` for the numeric fields of a record (bools as 0/1; lists and dicts of numbers
    expanded by index / key)."""
    scalars: dict[str, float] = {}
    for name, value in record.items():
        if name in ("kind", "step", "time"):
            continue
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, int | float):
            scalars[f"{kind}/{name}"] = float(value)
        elif isinstance(value, list) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
            scalars.update({f"{kind}/{name}/{index}": float(v) for index, v in enumerate(value)})
        elif isinstance(value, dict) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value.values()):
            scalars.update({f"{kind}/{name}/{key}": float(v) for key, v in value.items()})
    return scalars


class _TensorBoard:
    def __init__(self, run_dir: Path, start_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge = None if start_step is None else start_step + 1
        self._writer = SummaryWriter(log_dir=str(run_dir / "tb"), purge_step=purge)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for name, value in scalars.items():
            self._writer.add_scalar(name, value, step)

    def log_text(self, tag: str, text: str, step: int) -> None:
        self._writer.add_text(tag, text, step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class _ScalarsOnly:
    """Trackers that take scalars only: text records are dropped, and the library flushes on its own."""

    def log_text(self, tag: str, text: str, step: int) -> None:
        return None

    def flush(self) -> None:
        return None


class _Wandb(_ScalarsOnly):
    def __init__(self, run_dir: Path, config: Mapping[str, Any]) -> None:
        import wandb

        self._run = wandb.init(project=_PROJECT, name=run_dir.name, dir=str(run_dir), config=dict(config),
                               mode=os.environ.get("WANDB_MODE", "offline"))

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log(dict(scalars), step=step)

    def close(self) -> None:
        self._run.finish()


class _Mlflow(_ScalarsOnly):
    def __init__(self, run_dir: Path, config: Mapping[str, Any]) -> None:
        import mlflow

        if not os.environ.get("MLFLOW_TRACKING_URI"):
            mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(_PROJECT)
        self._mlflow = mlflow
        self._run = mlflow.start_run(run_name=run_dir.name)
        mlflow.log_params({key: str(value)[:250] for key, value in config.items()})  # MLflow caps param values

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self._mlflow.log_metrics(dict(scalars), step=step)

    def close(self) -> None:
        self._mlflow.end_run()


class _Trackio(_ScalarsOnly):
    def __init__(self, run_dir: Path, config: Mapping[str, Any]) -> None:
        import trackio

        self._trackio = trackio
        trackio.init(project=_PROJECT, name=run_dir.name, config=dict(config), resume="allow")

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self._trackio.log(dict(scalars), step=step)

    def close(self) -> None:
        self._trackio.finish()


def open_trackers(names: Sequence[str], run_dir: str | Path, *, start_step: int | None = None,
                  config: Mapping[str, Any] | None = None) -> list[Tracker]:
    """The trackers named (``TRACKERS``), opened for ``run_dir``; absent optional packages skipped with a warning.

    Raises:
        ConfigError: an unknown name.
    """
    run_dir = Path(run_dir)
    trackers: list[Tracker] = []
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"report_to: unknown tracker {name!r}; expected some of {', '.join(TRACKERS)} or none")
        package = name  # each tracker's package has the tracker's name
        if importlib.util.find_spec(package) is None:
            log.warning("--report-to %s skipped: the %s package is not installed (pip install %s); metrics.jsonl and "
                        "the other trackers still get every record", name, package, package)
            continue
        if name == "tensorboard":
            trackers.append(_TensorBoard(run_dir, start_step))
        elif name == "wandb":
            trackers.append(_Wandb(run_dir, config or {}))
        elif name == "mlflow":
            trackers.append(_Mlflow(run_dir, config or {}))
        else:
            trackers.append(_Trackio(run_dir, config or {}))
    return trackers
