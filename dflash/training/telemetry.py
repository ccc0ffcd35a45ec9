"""Training telemetry: metrics JSONL + experiment trackers (TensorBoard by default), windowed throughput, step-time split, rich progress.

- :class:`MetricsWriter` appends one JSON object per record to ``metrics.jsonl`` (flushed, so ``tail -f`` works and
  a killed run keeps every logged step) and mirrors numeric fields to the trackers of ``--report-to``
  (:mod:`dflash.training.trackers`: TensorBoard ``tb/`` by default; W&B, MLflow, Trackio offline).
- :class:`ThroughputWindow` gives rates over the last ``window`` steps (not cumulative since start, which hides
  slow-downs): real tokens/s (documents' tokens), padded tokens/s (tokens including padding), supervised tokens/s
  (tokens with loss_mask = 1) and drafted block tokens/s (anchors x block_size, what the drafter actually computes).
- :class:`StepTimer` splits each step's wall time into ``data_wait``, ``forward``, ``backward``, ``optimizer``
  (CUDA is synchronized at phase boundaries only when asked, since syncing costs throughput).
- :class:`StepTimeWindow` keeps the last ``window`` steps' timings: the logged ``time_*`` fields are window medians
  (one step's split is noise), and per length bucket (steps whose batches all came from one bucket) the median step
  and forward time and the real tokens/s, so a slowdown can be traced to a bucket (``dflash-stages diff``).
- :class:`BucketCounter` counts batches and tokens per length bucket, cumulatively and over the window, so the
  realized mixing shares can be compared with the corpus shares.
- :class:`FeedMeter` sets, over each log interval, the rate training achieved against what each side could do
  alone: the trainer's capacity T (tokens per second of the time it did not wait for data) and, where the batch
  source reports producer work (the online queue), the producers' capacity I (each producer's tokens per second
  of its compute time, summed over producers) and the ring's occupancy.
- :func:`training_progress` is a rich progress bar with ETA.
- :func:`final_losses` is the one definition of a run's final train and validation loss.
- :class:`TelemetryConfig` holds what a run chooses of all this (``train.telemetry``): the log interval, the
  throughput window, the progress bar and the trackers.

Only rank 0 writes; other ranks construct these with ``enabled=False`` and every call is a no-op.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash.errors import CheckpointError, ConfigError
from dflash.io.files import atomic_write_text, read_json_lines
from dflash.progress import DEFAULT_PROGRESS_INTERVAL, LogProgress, check_progress_interval
from dflash.training.trackers import TRACKERS, numeric_fields, open_trackers

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping, Sequence

    from rich.progress import Progress

__all__ = [
    "TelemetryConfig",
    "MetricsWriter",
    "ThroughputWindow",
    "StepTimer",
    "StepTimeWindow",
    "BucketCounter",
    "FeedMeter",
    "training_progress",
    "read_metrics",
    "drop_records_after",
    "final_losses",
    "record_number",
]

log = logging.getLogger(__name__)

#: The fix named when a run's ``metrics.jsonl`` cannot be read.
_METRICS_FIX = "metrics.jsonl is a run's metrics log, one JSON record a line: restore it or remove the file"



@dataclass(kw_only=True, slots=True)
class TelemetryConfig:
    """What a training run reports and how often (``train.telemetry``; ``[train.telemetry]`` in a config file,
    ``--set train.telemetry.log_every=50``). None of it changes what is computed: a resume may change any field."""

    log_every: int = field(default=10, metadata={"runtime": True, "help": (
        "Log metrics every N steps (metrics.jsonl and the trackers).")})
    #: Steps in the throughput window (:class:`ThroughputWindow`, :class:`StepTimeWindow`).
    throughput_window: int = field(default=20, metadata={"runtime": True})
    progress: bool = field(default=True, metadata={"runtime": True, "help": "Show the rich progress bar (rank 0)."})
    progress_interval: float = field(default=DEFAULT_PROGRESS_INTERVAL, metadata={"runtime": True,
        "help": "Seconds between two progress lines (steps, tokens, rates, ETA, loss) when output is not a terminal; "
                "0: none."})
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"], metadata={"runtime": True,
        "help": "Experiment trackers the metrics also go to (dflash.training.trackers), comma-separated: tensorboard, "
                "wandb, mlflow, trackio (offline modes; an absent package is skipped with a warning), or none "
                "(metrics.jsonl only)."})

    def __post_init__(self) -> None:
        check_progress_interval(self.progress_interval)
        for name in ("log_every", "throughput_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        self.report_to = [] if list(self.report_to) == ["none"] else [str(name) for name in self.report_to]
        unknown = [name for name in self.report_to if name not in TRACKERS]
        if unknown:
            raise ConfigError(f"report_to: unknown tracker(s) {unknown}; expected a comma-separated subset of "
                              f"{', '.join(TRACKERS)}, or none")


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item") and callable(value.item):  # torch / numpy scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them readable rather than invalid
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


class MetricsWriter:
    """Append-only metrics: ``<run>/metrics.jsonl``, mirrored to experiment trackers (:mod:`dflash.training.trackers`;
    TensorBoard under ``<run>/tb`` by default).

    Each record is ``{"kind": ..., "step": ..., "time": unix seconds, **fields}``. Numeric fields go to the trackers
    as ``<kind>/<field>``; list fields (e.g. per-position accuracy) as ``<kind>/<field>/<i>``, dict fields as
    ``<kind>/<field>/<key>``.
    """

    def __init__(
        self, run_dir: str | Path, *, enabled: bool = True, tensorboard: bool = True, start_step: int | None = None,
        trackers: Sequence[str] | None = None, config: Mapping[str, Any] | None = None,
    ) -> None:
        """Open (append to) the run's metrics.

        ``start_step``: the step this process starts from (the resumed checkpoint's, 0 for a fresh start). Records
        a crashed or killed earlier attempt wrote beyond it are dropped first (and TensorBoard purges its events
        from ``start_step + 1`` on), so every step is recorded once; ``None`` keeps the file as is. ``trackers``:
        names of :data:`dflash.training.trackers.TRACKERS` (default: TensorBoard when ``tensorboard``); ``config`` is
        given to the trackers that record one (W&B, MLflow, Trackio).
        """
        self.enabled = enabled
        self._file = None
        self._trackers: list[Any] = []
        if not enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        if start_step is not None:
            drop_records_after(self.path, start_step)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        names = list(trackers) if trackers is not None else (["tensorboard"] if tensorboard else [])
        self._trackers = open_trackers(names, run_dir, start_step=start_step, config=config)

    def log(self, kind: str, step: int, fields: Mapping[str, Any]) -> None:
        """Write one record (no-op when disabled)."""
        if not self.enabled or self._file is None:
            return

        record = {"kind": kind, "step": int(step), "time": time.time(), **_jsonable(dict(fields))}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._trackers:
            scalars = numeric_fields(kind, record)
            for tracker in self._trackers:
                tracker.log(int(step), scalars)

    def log_text(self, tag: str, text: str, step: int = 0) -> None:
        """A text blob for the trackers that keep text (TensorBoard: resolved config, bucket table)."""
        for tracker in self._trackers:
            tracker.log_text(tag, text, step)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
        for tracker in self._trackers:
            tracker.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            tracker.close()


def drop_records_after(path: str | Path, step: int) -> int:
    """Rewrite ``metrics.jsonl`` without the records of an attempt that did not reach a checkpoint: those with a
    step above ``step``, and the start record (``kind`` ``data``) at ``step`` itself, which the new attempt writes
    again. Atomic (temporary file, then rename); a torn last line (a kill mid-write) goes too. Returns how many
    records were dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for _, line, record in read_json_lines(path, error=CheckpointError, fix=_METRICS_FIX):
        if not isinstance(record, dict) or not isinstance(record.get("step", 0), int):
            dropped += 1  # a torn line (a kill mid-write) or one this project did not write
            continue
        record_step = record.get("step", 0)
        if record_step > step or (record_step == step and record.get("kind") == "data"):
            dropped += 1
            continue
        kept.append(line.decode())
    if dropped:
        atomic_write_text(path, "".join(line + "\n" for line in kept))
    return dropped


def read_metrics(path: str | Path, kind: str | None = None) -> list[dict[str, Any]]:
    """Records of a ``metrics.jsonl`` (or of a run folder), optionally only those of one ``kind``; read a bounded
    line at a time. A line that is not a JSON object (a torn last line after a kill) is skipped with a warning.

    Raises:
        CheckpointError: not a regular file, or a line over the per-line limit; naming the file.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    records, skipped = [], []
    for number, _, record in read_json_lines(path, error=CheckpointError, fix=_METRICS_FIX):
        if isinstance(record, dict):
            records.append(record)
        else:
            skipped.append(number)
    if skipped:
        log.warning("%s: skipped %d line(s) that are not JSON records (first: line %d)", path, len(skipped), skipped[0])
    return [r for r in records if kind is None or r.get("kind") == kind]


def record_number(value: Any) -> float | None:
    """A metrics field as a float: non-finite values are stored as strings (``"nan"``) and read back as floats;
    None when absent or not a number."""
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def final_losses(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A run's final losses, the one definition the progress bar, ``report``, ``sweep``, ``diff`` and ``inspect``
    show:

    - ``train_loss``: the ``loss`` of the last ``train`` record, the token-weighted mean training loss over the
      last log interval (``telemetry.log_every`` steps, skipped steps left out), at step ``train_step``, with the
      tau its accuracies imply (``train_tau``);
    - ``val_loss``: the ``loss`` of the last ``val`` record (the whole validation split), at ``val_step``, with its
      implied tau ``val_tau``.

    Keys whose record is absent are None.
    """
    train = [r for r in records if r.get("kind") == "train"]
    val = [r for r in records if r.get("kind") == "val"]
    out: dict[str, Any] = dict.fromkeys(("train_loss", "train_tau", "train_step", "val_loss", "val_tau", "val_step"))
    for name, kept in (("train", train), ("val", val)):
        if kept:
            out[f"{name}_loss"] = record_number(kept[-1].get("loss"))
            out[f"{name}_tau"] = record_number(kept[-1].get("expected_acceptance_length"))
            out[f"{name}_step"] = int(kept[-1]["step"])
    return out


@dataclass(slots=True)
class _StepCounts:
    time: float
    real_tokens: int
    padded_tokens: int
    supervised_tokens: int
    block_tokens: int


class ThroughputWindow:
    """Rates over the last ``window`` steps, in tokens per second of wall time.

    Call :meth:`update` once per optimizer step with that step's totals (summed over micro-batches and, for
    global figures, over ranks). :meth:`rates` returns ``{real,padded,supervised,block}_tokens_per_s``.
    """

    def __init__(self, window: int = 20) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._entries: deque[_StepCounts] = deque(maxlen=window + 1)
        self._entries.append(_StepCounts(time.perf_counter(), 0, 0, 0, 0))

    def reset_clock(self) -> None:
        """Restart the window (e.g. after an evaluation pause, which is not training time)."""
        self._entries.clear()
        self._entries.append(_StepCounts(time.perf_counter(), 0, 0, 0, 0))

    def update(self, *, real_tokens: int, padded_tokens: int, supervised_tokens: int, block_tokens: int) -> None:
        self._entries.append(
            _StepCounts(time.perf_counter(), real_tokens, padded_tokens, supervised_tokens, block_tokens)
        )

    def rates(self) -> dict[str, float]:
        entries = list(self._entries)
        elapsed = entries[-1].time - entries[0].time
        if len(entries) < 2 or elapsed <= 0:
            return {}
        window = entries[1:]  # the first entry only marks the window's start time
        return {
            "real_tokens_per_s": sum(e.real_tokens for e in window) / elapsed,
            "padded_tokens_per_s": sum(e.padded_tokens for e in window) / elapsed,
            "supervised_tokens_per_s": sum(e.supervised_tokens for e in window) / elapsed,
            "block_tokens_per_s": sum(e.block_tokens for e in window) / elapsed,
            "steps_per_s": len(window) / elapsed,
        }


class StepTimer:
    """Wall time of one step split into phases; ``with timer.phase("forward"): ...``.

    Args:
        synchronize: a callable run at each phase boundary (``torch.cuda.synchronize`` to attribute GPU time to
            the right phase); ``None`` measures host time only, which is cheaper.
    """

    PHASES = ("data_wait", "forward", "backward", "optimizer")

    def __init__(self, synchronize: Any = None) -> None:
        self._synchronize = synchronize
        self.seconds: dict[str, float] = dict.fromkeys(self.PHASES, 0.0)
        self._step_start = time.perf_counter()

    def start_step(self) -> None:
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self._step_start = time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in self.seconds:
            raise ValueError(f"unknown phase {name!r}; expected one of {self.PHASES}")
        if self._synchronize is not None:
            self._synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._synchronize is not None:
                self._synchronize()
            self.seconds[name] += time.perf_counter() - start

    def summary(self) -> dict[str, float]:
        """``time/<phase>_s``, ``time/step_s`` and the data-wait share of the step."""
        total = time.perf_counter() - self._step_start
        out = {f"{name}_s": value for name, value in self.seconds.items()}
        out["step_s"] = total
        out["data_wait_fraction"] = self.seconds["data_wait"] / total if total > 0 else 0.0
        return out


@dataclass(slots=True)
class _StepTiming:
    seconds: dict[str, float]  # StepTimer.summary()
    split: bool  # the phases were timed with synchronization (always off CUDA)
    bucket: int | None
    real_tokens: int


class StepTimeWindow:
    """Medians of the step-time split over the last ``window`` steps, overall and per length bucket.

    Call :meth:`update` once per optimizer step. ``split=False`` marks a step whose phases were timed without
    synchronizing CUDA (``StepTimer`` syncs on log steps only, since syncing costs throughput): its total step time
    counts, its phase split does not (kernels still queued would be billed to the wrong phase). ``bucket`` is the
    length bucket of all the step's batches, or ``None`` when they mixed buckets (grad accumulation, DDP).
    """

    def __init__(self, window: int = 20) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._steps: deque[_StepTiming] = deque(maxlen=window)

    def update(self, seconds: Mapping[str, float], *, split: bool = True, bucket: int | None = None,
               real_tokens: int = 0) -> None:
        self._steps.append(_StepTiming(dict(seconds), split, bucket, int(real_tokens)))

    def summary(self) -> dict[str, Any]:
        """``time_<phase>_s`` and ``time_data_wait_fraction`` (medians over the split steps), ``time_step_s``
        (median over all), ``time_window_steps`` / ``time_split_steps`` (how many steps they are medians of), and
        per bucket id (string keys): ``bucket_step_s``, ``bucket_forward_s`` (medians), ``bucket_real_tokens_per_s``
        (tokens / seconds summed over the bucket's steps) and ``bucket_window_steps``."""
        steps = list(self._steps)
        if not steps:
            return {}
        split = [s for s in steps if s.split]
        out: dict[str, Any] = {"time_step_s": statistics.median(s.seconds["step_s"] for s in steps)}
        for name in (*StepTimer.PHASES, "data_wait_fraction"):
            key = name if name.endswith("fraction") else f"{name}_s"
            if split:
                out[f"time_{key}"] = statistics.median(s.seconds[key] for s in split)
        out["time_window_steps"] = len(steps)
        out["time_split_steps"] = len(split)
        by_bucket: dict[int, list[_StepTiming]] = {}
        for step in steps:
            if step.bucket is not None:
                by_bucket.setdefault(step.bucket, []).append(step)
        if by_bucket:
            order = sorted(by_bucket)
            out["bucket_step_s"] = {str(b): statistics.median(s.seconds["step_s"] for s in by_bucket[b]) for b in order}
            out["bucket_forward_s"] = {
                str(b): statistics.median(s.seconds["forward_s"] for s in by_bucket[b] if s.split)
                for b in order if any(s.split for s in by_bucket[b])
            }
            out["bucket_real_tokens_per_s"] = {
                str(b): sum(s.real_tokens for s in by_bucket[b]) / max(1e-12, sum(s.seconds["step_s"] for s in by_bucket[b]))
                for b in order
            }
            out["bucket_window_steps"] = {str(b): len(by_bucket[b]) for b in order}
        return out


class BucketCounter:
    """Batches and real tokens per length bucket: cumulative and over the last ``window`` updates."""

    def __init__(self, window: int = 200) -> None:
        self.total_batches: Counter[int] = Counter()
        self.total_tokens: Counter[int] = Counter()
        self._recent: deque[tuple[int, int]] = deque(maxlen=window)

    def update(self, bucket_id: int, real_tokens: int, batches: int = 1) -> None:
        """Count ``batches`` batches of bucket ``bucket_id`` holding ``real_tokens`` tokens in all."""
        self.total_batches[bucket_id] += batches
        self.total_tokens[bucket_id] += real_tokens
        self._recent.append((bucket_id, real_tokens))

    def window_token_shares(self) -> dict[str, float]:
        """Share of real tokens per bucket over the window (keys are bucket ids as strings, for JSON)."""
        tokens: Counter[int] = Counter()
        for bucket_id, count in self._recent:
            tokens[bucket_id] += count
        total = sum(tokens.values())
        return {str(b): tokens[b] / total for b in sorted(tokens)} if total else {}

    def summary(self) -> dict[str, Any]:
        return {
            "bucket_batches": {str(b): n for b, n in sorted(self.total_batches.items())},
            "bucket_token_share_window": self.window_token_shares(),
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "total_batches": dict(self.total_batches),
            "total_tokens": dict(self.total_tokens),
            "recent": list(self._recent),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.total_batches = Counter({int(k): v for k, v in state["total_batches"].items()})
        self.total_tokens = Counter({int(k): v for k, v in state["total_tokens"].items()})
        self._recent.clear()
        self._recent.extend((int(b), int(n)) for b, n in state["recent"])


@dataclass(frozen=True, slots=True)
class _FeedMark:
    time: float
    tokens: int
    wait_seconds: float
    producer_work: dict[str, tuple[int, float]]
    occupancy: tuple[float, float, int]


class FeedMeter:
    """Achieved rate, trainer capacity T and (online) producer capacity I over log intervals.

    ``stats`` is the training batch source's ``stats``: ``wait_seconds`` (seconds the trainer waited for a batch),
    and optionally ``producer_work`` (``{producer: (tokens, compute_seconds)}``, cumulative) and
    ``occupancy_sums`` (``(sum of ready batches, sum of taken slots, samples)``, cumulative, one sample per batch
    consumed), as :class:`dflash.batches.online.OnlineStats` has. ``tokens`` is the trainer's cumulative real-token count.

    :meth:`interval` returns, since the previous :meth:`mark` or :meth:`interval` (all rates in real tokens per
    second of wall time; a field is absent when its interval holds no data):

    - ``achieved_tokens_per_s``: tokens trained / wall time;
    - ``trainer_capacity_tokens_per_s`` (T): tokens / (wall time - data wait), what the trainer does when fed;
    - ``interval_data_wait_fraction``: data wait / wall time over the whole interval;
    - ``producer_capacity_tokens_per_s`` (I): sum over producers of tokens / compute seconds, what the producers
      supply when never held back (a producer counts once it finished a batch the trainer consumed);
    - ``ring_ready_mean`` / ``ring_taken_mean``: mean batches computed and waiting (in their ring slots or read
      ahead) / batches in flight (ring slots in use plus batches read ahead), seen each time the trainer takes a
      batch (ready near 0: producers are the bottleneck; near the batches in flight: the trainer is).

    Call :meth:`mark` after a pause that is not training (an evaluation), as for :class:`ThroughputWindow`.
    """

    def __init__(self) -> None:
        self._last: _FeedMark | None = None

    @staticmethod
    def _snapshot(tokens: int, stats: Any) -> _FeedMark:
        work = {str(k): (int(v[0]), float(v[1])) for k, v in dict(getattr(stats, "producer_work", None) or {}).items()}
        ready, taken, samples = getattr(stats, "occupancy_sums", None) or (0.0, 0.0, 0)
        return _FeedMark(time.perf_counter(), int(tokens), float(stats.wait_seconds), work,
                         (float(ready), float(taken), int(samples)))  # fmt: skip

    def mark(self, tokens: int, stats: Any) -> None:
        """Start an interval now."""
        self._last = self._snapshot(tokens, stats)

    def interval(self, tokens: int, stats: Any) -> dict[str, float]:
        """The rates since the last mark (see the class docstring); starts the next interval."""
        now = self._snapshot(tokens, stats)
        last, self._last = self._last, now
        if last is None:
            return {}
        elapsed = now.time - last.time
        trained = now.tokens - last.tokens
        waited = max(0.0, now.wait_seconds - last.wait_seconds)
        out: dict[str, float] = {}
        if elapsed > 0 and trained > 0:
            out["achieved_tokens_per_s"] = trained / elapsed
            out["interval_data_wait_fraction"] = min(1.0, waited / elapsed)
            if elapsed - waited > 0:
                out["trainer_capacity_tokens_per_s"] = trained / (elapsed - waited)
        capacity = 0.0
        for producer, (produced, seconds) in now.producer_work.items():
            before = last.producer_work.get(producer, (0, 0.0))
            if seconds - before[1] > 0:
                capacity += (produced - before[0]) / (seconds - before[1])
        if capacity > 0:
            out["producer_capacity_tokens_per_s"] = capacity
        samples = now.occupancy[2] - last.occupancy[2]
        if samples > 0:
            out["ring_ready_mean"] = (now.occupancy[0] - last.occupancy[0]) / samples
            out["ring_taken_mean"] = (now.occupancy[1] - last.occupancy[1]) / samples
        return out


def training_progress(*, enabled: bool = True, interval: float = DEFAULT_PROGRESS_INTERVAL) -> Progress:
    """A rich progress bar for the training loop: steps, rate, elapsed, ETA and a free-text status field; where
    stdout is not a terminal, a line every ``interval`` seconds instead (:class:`dflash.progress.LogProgress`).

    Use ``task = progress.add_task("train", total=num_steps, status="", tokens=0)`` and
    ``progress.update(task, completed=step, tokens=tokens_seen, status="loss 2.31 ...")``.
    """
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return LogProgress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[status]}"),
        disable=not enabled,
        transient=False,
        unit="steps",
        interval=interval if enabled else 0,
    )
