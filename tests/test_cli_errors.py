"""The console script turns errors on a user's input into one ``error:`` line and exit status 2 (no traceback),
and ``prepare --overwrite`` never deletes a folder that is not a corpus."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dflash.corpus import CorpusWriter
from dflash.errors import CorpusError


def _cli(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from stages.cli import main; main()", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, expected", [
    (("train", "--cache", "no-such-cache", "--output", "run"), "no cache at no-such-cache"),
    (("train", "--output", "no-such-run", "--resume"), "--resume: no-such-run holds no run"),
])
def test_user_errors_exit_2_with_one_error_line(tmp_path, args, expected):
    result = _cli(*args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr
    assert "Traceback" not in result.stderr and "╭" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_overwrite_refuses_a_folder_that_is_not_a_corpus(tmp_path):
    folder = tmp_path / "userdata"
    folder.mkdir()
    (folder / "important.txt").write_text("keep me")
    with pytest.raises(CorpusError, match="not a dflash corpus"):
        CorpusWriter(folder, overwrite=True)
    assert (folder / "important.txt").read_text() == "keep me"
    CorpusWriter(tmp_path / "empty", overwrite=True).abort()  # an absent or empty folder is fine


def test_sigterm_during_prepare_leaves_no_temporary_folder(tmp_path):
    import signal
    import time

    process = subprocess.Popen(
        [sys.executable, "-c", "from stages.cli import main; main()", "prepare", "--output", "corpus"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".corpus.tmp-*")):  # wait until the writer's staging folder exists
        assert process.poll() is None and time.monotonic() < deadline, "prepare ended before writing anything"
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []  # neither a half corpus nor its staging folder


def test_empty_or_malformed_jsonl_is_named_with_its_position(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    result = _cli("prepare", "empty.jsonl", "-o", "out", "--assistant-mask", "prefix-diff", cwd=tmp_path)
    assert result.returncode == 2 and "empty.jsonl: no JSON rows (the file is empty)" in result.stderr
    bad = '{"messages": [{"role": "user", "content": "hi"}'  # the closing brace is missing: error at its end
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n' + bad + "\n")
    result = _cli("prepare", "bad.jsonl", "-o", "out", "--assistant-mask", "prefix-diff", cwd=tmp_path)
    assert result.returncode == 2 and "bad.jsonl line 2: not valid JSON" in result.stderr
    assert f"at column {len(bad)})" in result.stderr
    assert not (tmp_path / "out").exists()



def test_session_uses_a_temporary_dflash_home(dflash_home, target_path, tmp_path):
    """Identity memos and conversions go to the session's temporary home; the real one only lends its target."""
    import json
    import os
    from pathlib import Path

    from dflash.target import dflash_home as current_home
    from dflash.target import target_identity

    assert current_home() == dflash_home.path and os.environ["DFLASH_STAGES_HOME"] == str(dflash_home.path)
    assert dflash_home.path.parent == tmp_path.parent  # in pytest's temporary folder of this session
    assert target_path.parent == dflash_home.path / "targets"  # the converted default, reached through the link
    # A transformers folder without a recorded identity gets a memo: it must land in the temporary home.
    folder = tmp_path / "other-target"
    folder.mkdir()
    (folder / "config.json").write_text((target_path / "config.json").read_text())
    (folder / "model.safetensors").write_bytes(b"weights stand-in: only hashed, never loaded")
    identity = target_identity(folder)
    assert identity.name == "other-target" and identity.num_hidden_layers == 30
    memos = list((dflash_home.path / "identity").glob("*.json"))
    assert any(json.loads(p.read_text())["name"] == "other-target" for p in memos)
    real_now = {p for p in Path(dflash_home.real_home).rglob("*") if p.is_file()}
    assert real_now <= dflash_home.real_files  # nothing new in the real home
