"""``dflash.training.telemetry``: the step-time window gives medians (not one step's split) and per-bucket figures."""

from __future__ import annotations

import pytest

from dflash.training.telemetry import StepTimeWindow


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


def test_report_to_skips_an_absent_tracker_with_a_warning_and_keeps_the_jsonl(tmp_path, caplog):
    import importlib.util
    import logging

    from dflash.training.telemetry import MetricsWriter, read_metrics

    absent = next((name for name in ("wandb", "mlflow", "trackio") if importlib.util.find_spec(name) is None), None)
    if absent is None:
        pytest.skip("wandb, mlflow and trackio are all installed")
    with caplog.at_level(logging.WARNING, logger="dflash.training.trackers"):
        writer = MetricsWriter(tmp_path, trackers=["tensorboard", absent])
    try:
        writer.log("train", 1, {"loss": 2.0, "accuracy_per_position": [0.5, 0.25], "bucket_step_s": {"0": 0.1}})
    finally:
        writer.close()
    assert f"--report-to {absent} skipped" in caplog.text and f"pip install {absent}" in caplog.text
    assert read_metrics(tmp_path, kind="train")[0]["loss"] == 2.0
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))  # the other tracker still got it


def test_report_to_names_are_checked_and_none_means_jsonl_only(tmp_path):
    from dflash.errors import ConfigError
    from dflash.training.telemetry import TelemetryConfig
    from dflash.training.trackers import numeric_fields
    from stages.train.config import RUNTIME_FIELDS, TrainConfig

    assert TrainConfig(cache="c", output="o").telemetry.report_to == ["tensorboard"]
    assert TrainConfig(cache="c", output="o", telemetry={"report_to": ["none"]}).telemetry.report_to == []
    assert TelemetryConfig(report_to=["none"]).report_to == []
    with pytest.raises(ConfigError, match="^telemetry.report_to: unknown tracker"):
        TrainConfig(cache="c", output="o", telemetry={"report_to": ["comet"]})
    with pytest.raises(ConfigError, match="^telemetry.log_every must be a positive integer"):
        TrainConfig(cache="c", output="o", telemetry={"log_every": 0})
    with pytest.raises(ConfigError, match="^throughput_window must be a positive integer"):
        TelemetryConfig(throughput_window=0)
    assert "telemetry.report_to" in RUNTIME_FIELDS  # a resume may change the trackers
    assert numeric_fields("train", {"kind": "train", "step": 3, "loss": 1.5, "skipped": True,
                                    "accuracy_per_position": [0.5], "bucket_step_s": {"1": 0.2}, "data_digest": "ab"}) == {
        "train/loss": 1.5, "train/skipped": 1.0, "train/accuracy_per_position/0": 0.5, "train/bucket_step_s/1": 0.2}


def test_feed_meter_gives_each_side_its_capacity_over_the_interval(monkeypatch):
    """Over 10 s the trainer trained 5,000 tokens and waited 2 s: achieved 500 tok/s, trainer capacity T = 5,000 / 8 s.
    Two producers computed 3,000 tokens in 4 s and 2,000 in 5 s: I = 750 + 400. Ring: 3 samples of (ready, taken)."""
    from types import SimpleNamespace

    from dflash.training import telemetry

    clock = iter([100.0, 110.0, 110.0])
    monkeypatch.setattr(telemetry.time, "perf_counter", lambda: next(clock))
    meter = telemetry.FeedMeter()
    stats = SimpleNamespace(wait_seconds=1.0, producer_work={"w0": (1000, 2.0)}, occupancy_sums=(1.0, 2.0, 1))
    meter.mark(10_000, stats)
    stats.wait_seconds = 3.0
    stats.producer_work = {"w0": (4000, 6.0), "w1": (2000, 5.0)}
    stats.occupancy_sums = (4.0, 11.0, 4)
    rates = meter.interval(15_000, stats)
    assert rates["achieved_tokens_per_s"] == pytest.approx(500.0)
    assert rates["trainer_capacity_tokens_per_s"] == pytest.approx(5000 / 8)
    assert rates["interval_data_wait_fraction"] == pytest.approx(0.2)
    assert rates["producer_capacity_tokens_per_s"] == pytest.approx(3000 / 4 + 2000 / 5)
    assert rates["ring_ready_mean"] == pytest.approx(1.0) and rates["ring_taken_mean"] == pytest.approx(3.0)
    # An offline loader's stats (no producers): achieved and T only; an empty interval gives nothing.
    assert set(meter.interval(15_000, SimpleNamespace(wait_seconds=3.0))) == set()


def test_metrics_are_read_a_bounded_line_at_a_time_and_a_torn_line_is_skipped(tmp_path, caplog):
    """``metrics.jsonl`` through ``dflash.io.files.read_json_lines``: a torn last line (a kill mid-write) is skipped
    by the readers and dropped by ``drop_records``; a device, a FIFO or an endless line is refused naming the file."""
    import os

    from dflash.errors import CheckpointError
    from dflash.training.telemetry import drop_records_after, read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1, "loss": 2.0}\n{"kind": "train", "step": 2, "loss": 1.5}\n'
                    '{"kind": "data", "step": 3}\n{"kind": "train", "ste')
    assert [r["step"] for r in read_metrics(path, "train")] == [1, 2]
    assert "skipped 1 line(s)" in caplog.text
    assert drop_records_after(path, 2) == 2  # the torn line and step 3's record
    assert path.read_text() == '{"kind": "train", "step": 1, "loss": 2.0}\n{"kind": "train", "step": 2, "loss": 1.5}\n'
    for name, make in (("zero", lambda p: p.symlink_to("/dev/zero")), ("fifo", lambda p: os.mkfifo(p))):
        bad = tmp_path / name / "metrics.jsonl"
        bad.parent.mkdir()
        make(bad)
        with pytest.raises(CheckpointError, match=r"not a regular file; metrics.jsonl is a run's metrics log"):
            read_metrics(bad.parent)
    endless = tmp_path / "endless" / "metrics.jsonl"
    endless.parent.mkdir()
    endless.write_bytes(b"9" * (5 * 2**20))
    with pytest.raises(CheckpointError, match=r"line 1 is longer than 4,194,304 bytes"):
        read_metrics(endless)
