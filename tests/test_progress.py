"""dflash.progress: the progress lines long stages print where their output is not a terminal.

The stages' own tests run the real commands with output captured (tests/test_generate.py, test_train.py,
test_extract.py, test_evaluate.py); here the line's figures are checked against a clock the test sets.
"""

from __future__ import annotations

import io
import re

import pytest
from cli_helpers import COUNT, DURATION
from rich.console import Console

from dflash.errors import ConfigError
from dflash.progress import LogProgress, check_progress_interval, short_count, short_duration


def test_a_line_gives_done_total_tokens_rates_eta_and_text_fields_from_when_the_bar_started():
    now = [100.0]
    stream = io.StringIO()
    progress = LogProgress(console=Console(file=stream), get_time=lambda: now[0], unit="prompts", interval=0)
    assert progress.logging and progress.disable  # not a terminal: no bar is drawn
    task = progress.add_task("generate", total=16_384, completed=1_024, tokens=200_000, status="starting")
    now[0] = 110.0
    assert progress.log_lines() == ["generate: 1,024/16,384 prompts, 200K tokens, 0 tok/s, 0 prompts/s, "
                                    "ETA unknown (10s so far), starting"]
    progress.reset_clock(task)  # e.g. once the target is loaded: rates count from here
    now[0] = 170.0
    progress.update(task, completed=4_096, tokens=1_200_000, status="")
    # 3,072 prompts and 1M tokens in 60 s; 12,288 prompts left at 51.2 prompts/s = 240 s
    assert progress.log_lines() == ["generate: 4,096/16,384 prompts, 1.2M tokens, 17K tok/s, 51 prompts/s, ETA 4m00s"]
    progress.update(task, completed=16_384)
    assert progress.log_lines()[0].endswith("prompts/s, done in 1m00s")


def test_the_line_at_stop_is_not_the_last_line_again_a_second_later():
    """A task that finished before the last periodic line gets no second "done in" line at stop (its elapsed time
    alone would differ); one whose counts moved since then gets its final line."""
    now = [0.0]
    stream = io.StringIO()
    with LogProgress(console=Console(file=stream), get_time=lambda: now[0], unit="prompts", interval=3600) as progress:
        task = progress.add_task("generate", total=4, completed=0, tokens=0)
        now[0] = 75.0
        progress.update(task, completed=4, tokens=64)
        progress._print_lines()  # the periodic line (its thread waits an hour here)
        now[0] = 76.0
    assert stream.getvalue().splitlines() == ["generate: 4/4 prompts, 64 tokens, 0.85 tok/s, 0.053 prompts/s, done in 1m15s"]
    stream = io.StringIO()
    with LogProgress(console=Console(file=stream), get_time=lambda: now[0], unit="prompts", interval=3600) as progress:
        task = progress.add_task("generate", total=4, completed=0, tokens=0)
        progress._print_lines()
        progress.update(task, completed=4, tokens=1_098)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and re.fullmatch(rf"generate: 4/4 prompts, {COUNT} tokens, .+, done in 0s", lines[1]), lines


def test_counts_durations_and_the_interval_setting():
    assert [short_count(v) for v in (7, 0.054, 9_999, 52_000, 1_234_567, 250_000_000)] == [
        "7", "0.054", "9,999", "52K", "1.2M", "250M"]
    assert [short_duration(s) for s in (42, 190, 4000)] == ["42s", "3m10s", "1h06m"]
    # The pattern the stages' tests match these durations with.
    assert all(re.fullmatch(DURATION, short_duration(s)) for s in (0, 59.4, 60, 3599, 3600, 86_400 * 3))
    check_progress_interval(0)
    for bad in (-1, "30", True, float("nan")):
        with pytest.raises(ConfigError, match="progress_interval must be a number of seconds >= 0"):
            check_progress_interval(bad)
