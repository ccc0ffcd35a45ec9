"""Every stage locks its output before writing anything (``dflash.io.locks``), through the real CLI entry point.

A second real process holds the output's lock (``python -c``, or a real ``dflash-stages train``); the stage command
must exit 2 at once with one ``error:`` line naming the holder's pid and host, and leave the output untouched. A
real ``train`` SIGKILLed mid-run leaves its lock behind; the same command with ``--resume`` takes it over and
resumes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import forked_cli, forked_cli_start, main_in_process
from train_helpers import build_tiny_cache

from dflash.io.locks import lock_path_of
from dflash.training.telemetry import read_metrics

REPO = Path(__file__).resolve().parents[1]
_ENV = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}

_HOLDER = """
import sys, time
from dflash.io.locks import output_lock
output_lock(sys.argv[1], what=sys.argv[2]).acquire()
print("held", flush=True)
time.sleep(120)
"""


@pytest.fixture
def hold(tmp_path):
    """``hold(path)``: a second process holding the lock of ``path`` until the test ends; returns its pid."""
    processes: list[subprocess.Popen] = []

    def start(path: Path, what: str = "output") -> int:
        process = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path), what], stdout=subprocess.PIPE,
                                   text=True, env=_ENV)
        processes.append(process)
        assert process.stdout is not None and process.stdout.readline().strip() == "held"
        return process.pid

    yield start
    for process in processes:
        process.kill()
        process.wait()


@pytest.mark.parametrize("command", ["extract", "train", "prepare", "export", "sweep", "run"])
def test_each_stage_refuses_an_output_another_process_writes(tmp_path, hold, monkeypatch, capsys, command):
    output = tmp_path / "out"
    args = {
        "extract": ["extract", "--corpus", str(tmp_path / "corpus"), "--output", str(output), "--target-processes", "1"],
        "train": ["train", "--cache", str(tmp_path / "cache"), "--output", str(output)],
        "prepare": ["prepare", "default", "--output", str(output)],
        "export": ["export", str(tmp_path / "run"), str(output)],
        "sweep": ["sweep", "--cache", str(tmp_path / "cache"), "--output", str(output), "--grid", "lr=1e-3,2e-3"],
        "run": ["run", "--workdir", str(output)],
    }[command]
    pid = hold(output)
    started = time.perf_counter()
    code, err = main_in_process(monkeypatch, capsys, *args)
    assert code == 2, err
    assert time.perf_counter() - started < 10  # at once: nothing loaded, no waiting
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert f"{output} is being written by pid {pid} on host {socket.gethostname()} since " in lines[0]
    assert str(lock_path_of(output)) in lines[0] and "Traceback" not in err
    assert not output.exists()  # nothing written
    assert json.loads(lock_path_of(output).read_text())["pid"] == pid  # the holder's lock is untouched


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory, target):
    return build_tiny_cache(tmp_path_factory.mktemp("cache") / "tiny.zarr", target)


def _train_command(cache: Path, run: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "stages.cli", "train", "--cache", str(cache), "--output", str(run), "--device", "cpu",
        "--num-draft-layers", "1", "--block-size", "4", "--max-anchors-per-document", "2", "--token-budget", "192",
        "--num-buckets", "2", "--validation-fraction", "0", "--max-steps", "400", "--save-every", "2",
        "--log-every", "1", "--no-progress", *extra,
    ]  # fmt: skip


@pytest.mark.slow
def test_real_train_holds_its_run_and_a_sigkilled_one_is_taken_over_on_resume(tiny_cache, tmp_path, monkeypatch,
                                                                               capsys):
    run = tmp_path / "run"
    # A real train process, forked from one that imported torch once (cli_helpers.forked_cli_start).
    first = forked_cli_start(*_train_command(tiny_cache, run)[3:], cwd=os.getcwd(), env=_ENV)
    try:
        deadline = time.monotonic() + 120
        while not (run / "latest").is_file():
            assert first.poll() is None, first.stderr
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.1)
        # A second real train into the same run folder, while the first trains: refused at once.
        code, err = main_in_process(monkeypatch, capsys, "train", "--output", str(run), "--resume")
        assert code == 2 and f"is being written by pid {first.pid} on host" in err, err
        first.send_signal(signal.SIGKILL)
        first.wait()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert lock_path_of(run).is_file()  # SIGKILL: no cleanup ran
    checkpointed = int((run / "latest").read_text().strip().removeprefix("step_"))
    # The same command with --resume (stopping soon, to keep the test short) takes the stale lock over.
    # In its own process, forked from one that imported torch once (cli_helpers.forked_cli).
    result = forked_cli(*_train_command(tiny_cache, run)[3:], "--resume", "--stop-at-step", str(checkpointed + 2),
                        cwd=os.getcwd(), env=_ENV, timeout=300)
    assert result.returncode == 0, result.stderr
    logged = " ".join((result.stdout + result.stderr).split())  # the log handler writes to stdout
    assert f"took over the stale lock of {run}: pid {first.pid}" in logged, logged[-2000:]
    assert not lock_path_of(run).exists()
    steps = [r["step"] for r in read_metrics(run, kind="train")]
    assert steps == list(range(1, checkpointed + 3))  # resumed from the checkpoint; each step once
