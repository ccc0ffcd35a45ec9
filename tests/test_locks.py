"""``dflash.io.locks``: one writer per output, with real processes contending.

A holder is a real second Python process (``python -c``) that takes the lock and waits; the contender is this
process (or a real ``dflash-stages`` command in ``test_stage_locks.py``). Covered: refusal at once naming the holder,
a SIGKILLed holder taken over with a warning, release on error and on normal exit, a record of another host needing
``--break-lock``, a live holder never broken, object-store URLs warned about, re-entrance in one process.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash.errors import DFlashError, LockError
from dflash.io.locks import lock_path_of, output_lock

REPO = Path(__file__).resolve().parents[1]

_HOLDER = """
import sys, time
from dflash.io.locks import output_lock
lock = output_lock(sys.argv[1], what="cache").acquire()
print("held", flush=True)
time.sleep(120)
"""


def _start_holder(output: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    process = subprocess.Popen([sys.executable, "-c", _HOLDER, str(output)], stdout=subprocess.PIPE, text=True, env=env)
    assert process.stdout is not None and process.stdout.readline().strip() == "held"
    return process


@pytest.fixture
def holder(tmp_path):
    process = _start_holder(tmp_path / "cache")
    yield process
    if process.poll() is None:
        process.kill()
        process.wait()


def test_second_writer_is_refused_at_once_naming_the_holder(tmp_path, holder):
    started = time.perf_counter()
    with pytest.raises(LockError) as caught:
        output_lock(tmp_path / "cache", what="cache").acquire()
    assert time.perf_counter() - started < 1.0  # at once, no waiting
    message = str(caught.value)
    assert f"pid {holder.pid} on host {socket.gethostname()} since 20" in message
    assert str(lock_path_of(tmp_path / "cache")) in message and "choose another output" in message
    assert isinstance(caught.value, DFlashError) and "\n" not in message
    # The refused contender changed nothing: the holder's record is intact.
    record = json.loads(lock_path_of(tmp_path / "cache").read_text())
    assert record["pid"] == holder.pid and record["what"] == "cache"


def test_sigkilled_holder_is_taken_over_with_a_warning(tmp_path, holder, caplog):
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert lock_path_of(tmp_path / "cache").exists()  # a SIGKILL leaves the record behind
    with caplog.at_level(logging.WARNING, logger="dflash.io.locks"):
        with output_lock(tmp_path / "cache") as lock:
            assert lock.held
            assert json.loads(lock_path_of(tmp_path / "cache").read_text())["pid"] == os.getpid()
    assert f"took over the stale lock of {tmp_path / 'cache'}: pid {holder.pid}" in caplog.text
    assert not lock_path_of(tmp_path / "cache").exists()


def test_lock_is_released_on_error_and_on_exit(tmp_path):
    with pytest.raises(ZeroDivisionError):
        with output_lock(tmp_path / "run"):
            raise ZeroDivisionError("boom")
    assert not lock_path_of(tmp_path / "run").exists()
    # A real process that takes the lock and exits normally (no release call) leaves nothing that blocks.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    code = "import sys; from dflash.io.locks import output_lock; output_lock(sys.argv[1]).acquire()"
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], check=True, env=env)
    with output_lock(tmp_path / "run"):
        pass


def test_record_of_another_host_needs_break_lock(tmp_path, caplog):
    lock_file = lock_path_of(tmp_path / "run")
    record = {"pid": 4242, "host": "gpu-node-7", "started_at": "2026-01-01T00:00:00Z", "command": "dflash-stages train"}
    lock_file.write_text(json.dumps(record))
    with pytest.raises(LockError, match=r"pid 4242 on host gpu-node-7 since 2026-01-01T00:00:00Z .*--break-lock"):
        output_lock(tmp_path / "run").acquire()
    with caplog.at_level(logging.WARNING, logger="dflash.io.locks"):
        with output_lock(tmp_path / "run", break_lock=True):
            assert json.loads(lock_file.read_text())["host"] == socket.gethostname()
    assert "was broken by --break-lock" in caplog.text


def test_a_damaged_record_is_described_as_damaged_and_a_device_or_fifo_is_refused(tmp_path, caplog):
    """A lock file whose record is garbage, nested 100k deep, huge, or has fields of the wrong type is called
    damaged (not another host's) with how to clear it; ``--break-lock`` takes it over. A lock file that is a device
    (a link to ``/dev/zero``, which would be read forever) or a FIFO is refused, naming it, without reading it."""
    lock_file = lock_path_of(tmp_path / "run")
    host = socket.gethostname()
    for text in ("garbage", "[" * 100_000 + "]" * 100_000, "", json.dumps({"pid": "12", "host": host}),
                 json.dumps({"pid": True, "host": host}), json.dumps({"pid": 12, "host": ["h"]}),
                 json.dumps({"pid": 12, "host": host, "process_started": "yesterday"}),
                 json.dumps({"pid": 12, "host": host, "command": "x" * 70_000})):
        lock_file.write_text(text)
        with pytest.raises(LockError) as refused:
            output_lock(tmp_path / "run").acquire()
        message = str(refused.value)
        assert message.startswith(f"the lock file {lock_file} of ") and "is damaged" in message, (text[:40], message)
        assert f"rm {lock_file}" in message and "--break-lock" in message and "a lock from another host" not in message
    with caplog.at_level(logging.WARNING, logger="dflash.io.locks"):
        with output_lock(tmp_path / "run", break_lock=True):
            assert json.loads(lock_file.read_text())["pid"] == os.getpid()
    assert "an unreadable owner record" in caplog.text and not lock_file.exists()
    lock_file.symlink_to("/dev/zero")
    with pytest.raises(LockError, match=rf"^the lock file {lock_file} of .* is not a regular file .*rm {lock_file}"):
        output_lock(tmp_path / "run", break_lock=True).acquire()
    lock_file.unlink()
    os.mkfifo(lock_file)
    with pytest.raises(LockError, match="is not a regular file"):
        output_lock(tmp_path / "run").acquire()


def test_break_lock_never_breaks_a_live_holder(tmp_path, holder):
    with pytest.raises(LockError, match=f"pid {holder.pid}"):
        output_lock(tmp_path / "cache", break_lock=True).acquire()


def test_nested_lock_in_one_process_is_granted(tmp_path):
    with output_lock(tmp_path / "out") as outer:
        with output_lock(tmp_path / "out"):
            assert outer.held
        assert lock_path_of(tmp_path / "out").exists()  # the inner release keeps the outer lock
    assert not lock_path_of(tmp_path / "out").exists()


def test_object_store_urls_are_not_locked_and_say_so(caplog):
    with caplog.at_level(logging.WARNING, logger="dflash.io.locks"):
        with output_lock("s3://bucket/cache") as lock:
            assert not lock.held
    assert "no lock is possible" in caplog.text



def test_a_lock_file_that_cannot_be_created_is_a_lock_error_naming_it(tmp_path):
    (tmp_path / "notes.txt").write_text("a file, not a folder")
    with pytest.raises(LockError, match=r"cannot create the lock file .*notes.txt/out.lock of .*; choose an output"):
        output_lock(tmp_path / "notes.txt" / "out").acquire()
