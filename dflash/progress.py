"""Progress of long work, on a terminal and in a log.

:class:`LogProgress` is a rich :class:`~rich.progress.Progress`: on a terminal it draws its bar as usual; when its
console is not a terminal (output to a log file or a pipe) it draws nothing and instead prints one plain line every
``interval`` seconds, and one when it stops, e.g.::

    generate: 4,096/16,384 prompts, 1.2M tokens, 52K tok/s, 3.2 prompts/s, ETA 3m10s

Rates are over the time since the bar started (what this process did, so work committed by an earlier run does
not inflate them); the ETA is what is left at that rate. A task's ``tokens`` field (``progress.update(task,
tokens=N)``) adds the token count and rate, and its text fields (``status="loss 2.31 ..."``, ``shards="3/8
shards"``) are appended. Every long stage (generate, extract, train, evaluate, online) reports through it.
"""

from __future__ import annotations

import threading
from typing import Any

from rich.progress import Progress, Task

from dflash.errors import ConfigError
from dflash.values import finite_number

__all__ = ["LogProgress", "progress_line", "short_count", "short_duration", "check_progress_interval",
           "DEFAULT_PROGRESS_INTERVAL"]

#: Seconds between two progress lines in a log (the stages' ``progress_interval`` setting defaults to it).
DEFAULT_PROGRESS_INTERVAL = 30.0


def check_progress_interval(value: Any, name: str = "progress_interval") -> None:
    """Refuse a progress interval that is not a finite number of seconds >= 0 (ConfigError naming ``name``)."""
    if not finite_number(value) or value < 0:
        raise ConfigError(f"{name} must be a number of seconds >= 0 (0: no progress lines), got {value!r}")


def short_count(value: float) -> str:
    """``52_000`` -> ``52K``, ``1_234_567`` -> ``1.2M``; below 10,000 the number with thousands separators (two
    significant digits below 100)."""
    for threshold, size, suffix in ((1e9, 1e9, "G"), (1e6, 1e6, "M"), (1e4, 1e3, "K")):
        if abs(value) >= threshold:
            return f"{value / size:.1f}{suffix}" if abs(value) < 10 * size else f"{value / size:,.0f}{suffix}"
    return f"{value:,.0f}" if value == int(value) or abs(value) >= 100 else f"{value:.2g}"


def short_duration(seconds: float) -> str:
    """``190`` -> ``3m10s``, ``4000`` -> ``1h06m``, ``42`` -> ``42s``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def progress_line(task: Task, *, unit: str, started: float, start_completed: float, start_tokens: float,
                  now: float) -> str:
    """One log line for ``task``: done/total in ``unit``, tokens, rates since ``started`` and the ETA."""
    completed, total = float(task.completed), task.total
    elapsed = max(now - started, 1e-9)
    parts = [f"{completed:,.0f}/{total:,.0f} {unit}" if total is not None else f"{completed:,.0f} {unit}"]
    tokens = task.fields.get("tokens")
    if isinstance(tokens, int | float):
        parts.append(f"{short_count(tokens)} tokens")
        parts.append(f"{short_count((tokens - start_tokens) / elapsed)} tok/s")
    rate = (completed - start_completed) / elapsed
    parts.append(f"{short_count(rate)} {unit}/s")
    if total is not None and completed >= total:
        parts.append(f"done in {short_duration(elapsed)}")
    elif total is not None and rate > 0:
        parts.append(f"ETA {short_duration((total - completed) / rate)}")
    else:
        parts.append(f"ETA unknown ({short_duration(elapsed)} so far)")
    parts += [value for value in task.fields.values() if isinstance(value, str) and value]
    return f"{task.description}: " + ", ".join(parts)


class LogProgress(Progress):
    """A rich Progress that prints a plain progress line every ``interval`` seconds where its console is not a
    terminal (module docstring), and draws its bar where it is. ``interval`` 0 turns the lines off.

    Args:
        unit: what the task counts (``prompts``, ``steps``, ``shards``...).
        interval: seconds between two lines in a log.
        Every other argument is rich's.
    """

    def __init__(self, *columns: Any, unit: str, interval: float = DEFAULT_PROGRESS_INTERVAL, **kwargs: Any) -> None:
        super().__init__(*columns, **kwargs)
        self.unit = unit
        self.interval = float(interval)
        self.logging = not self.console.is_terminal
        if self.logging:
            self.disable = True  # no bar (and no blank line where it was) in a log: the lines stand for it
        self._stop_lines = threading.Event()
        self._thread: threading.Thread | None = None
        self._marks: dict[Any, tuple[float, float, float]] = {}  # task -> (start time, completed, tokens)
        self._last_state: list[tuple] = []  # what the last lines printed said, less the clock

    def add_task(self, description: str, *args: Any, **kwargs: Any) -> Any:
        task_id = super().add_task(description, *args, **kwargs)
        task = self._tasks[task_id]
        self._marks[task_id] = (self.get_time(), float(task.completed), float(task.fields.get("tokens") or 0))
        return task_id

    def reset_clock(self, task_id: Any) -> None:
        """Rates and ETA from now on: the work done so far (a target load, a warm-up) is not the task's rate."""
        task = self._tasks[task_id]
        self._marks[task_id] = (self.get_time(), float(task.completed), float(task.fields.get("tokens") or 0))

    def log_lines(self) -> list[str]:
        """The current line of every visible task (what the log gets every ``interval``)."""
        now = self.get_time()
        with self._lock:
            return [progress_line(task, unit=self.unit, started=self._marks[task.id][0],
                                  start_completed=self._marks[task.id][1], start_tokens=self._marks[task.id][2],
                                  now=now)
                    for task in self._tasks.values() if task.visible and task.id in self._marks]

    def _print_lines(self, *, unless_repeated: bool = False) -> None:
        with self._lock:
            state = [(task.id, task.completed, task.total, repr(task.fields)) for task in self._tasks.values()
                     if task.visible and task.id in self._marks]
        if unless_repeated and state == self._last_state:  # the same counts: only the elapsed time would differ
            return
        self._last_state = state
        lines = self.log_lines()
        for line in lines:
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def _run(self) -> None:
        while not self._stop_lines.wait(self.interval):
            self._print_lines()

    def start(self) -> None:
        super().start()
        if self.logging and self.interval > 0 and self._thread is None:
            self._stop_lines.clear()
            self._thread = threading.Thread(target=self._run, name="progress-lines", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop_lines.set()
            self._thread.join()
            self._thread = None
            self._print_lines(unless_repeated=True)  # where it ended (unless the last line just said it)
        super().stop()
