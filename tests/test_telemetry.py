"""``dflash.telemetry``: the step-time window gives medians (not one step's split) and per-bucket figures."""

from __future__ import annotations

import pytest

from dflash.telemetry import StepTimeWindow


def _seconds(step: float, forward: float) -> dict[str, float]:
    return {"data_wait_s": 0.01, "forward_s": forward, "backward_s": 0.1, "optimizer_s": 0.05, "step_s": step,
            "data_wait_fraction": 0.01 / step}


def test_window_medians_ignore_one_outlier_step_and_unsynchronized_splits():
    window = StepTimeWindow(window=4)
    window.update(_seconds(9.0, 8.0), bucket=0, real_tokens=100)  # falls out of the window
    for step, forward in ((1.0, 0.5), (1.2, 0.6), (50.0, 40.0)):
        window.update(_seconds(step, forward), bucket=1, real_tokens=100)
    window.update(_seconds(1.1, 30.0), split=False, bucket=None, real_tokens=100)  # phases not synchronized
    summary = window.summary()
    assert summary["time_window_steps"] == 4 and summary["time_split_steps"] == 3
    assert summary["time_step_s"] == pytest.approx(1.15)  # median of 1.0, 1.2, 50, 1.1
    assert summary["time_forward_s"] == pytest.approx(0.6)  # median of the synchronized steps only
    assert summary["bucket_step_s"] == {"1": pytest.approx(1.2)}  # mixed-bucket step not attributed
    assert summary["bucket_forward_s"] == {"1": pytest.approx(0.6)}
    assert summary["bucket_real_tokens_per_s"] == {"1": pytest.approx(300 / 52.2)}
    assert summary["bucket_window_steps"] == {"1": 3}


def test_empty_window_reports_nothing():
    assert StepTimeWindow().summary() == {}
    with pytest.raises(ValueError, match="window"):
        StepTimeWindow(window=0)
