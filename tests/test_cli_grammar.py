"""One CLI grammar (issue 15, item 5): -v/-q anywhere on the line, --version, shell completion."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from stages.cli import hoist_global_flags
from tests.cli_helpers import main_in_process, main_in_process_out


def test_global_flags_move_in_front_of_the_subcommand_but_not_past_a_double_dash():
    assert hoist_global_flags(["extract", "--corpus", "c", "-v"]) == ["-v", "extract", "--corpus", "c"]
    assert hoist_global_flags(["-q", "train", "-o", "r"]) == ["-q", "train", "-o", "r"]
    assert hoist_global_flags(["run", "--", "-v"]) == ["run", "--", "-v"]


def test_verbose_and_quiet_anywhere_and_never_both(tmp_path, monkeypatch, capsys):
    args = ["extract", "--corpus", str(tmp_path / "c"), "-o", str(tmp_path / "o"), "--print-config"]
    for flag in ("-v", "--verbose", "-q", "--quiet"):
        code, out, err = main_in_process_out(monkeypatch, capsys, *args, flag)
        assert code == 0, (flag, err)
        assert json.loads(out)["extract"]["corpus"] == str(tmp_path / "c")
    code, err = main_in_process(monkeypatch, capsys, "-v", *args, "-q")
    assert code == 2 and err.strip() == "error: -v/--verbose and -q/--quiet contradict each other; give one"
    assert not (tmp_path / "o").exists()


def test_version_and_bash_completion_of_commands_and_options(monkeypatch, capsys):
    code, out, _ = main_in_process_out(monkeypatch, capsys, "--version")
    assert code == 0 and out.startswith("dflash-stages ") and "torch " in out
    # What bash's completion function asks the program (the script --show-completion bash prints).
    env = {**os.environ, "_DFLASH_STAGES_COMPLETE": "complete_bash", "COMP_WORDS": "dflash-stages extract --pack",
           "COMP_CWORD": "2"}
    done = subprocess.run([sys.executable, "-c", "import sys; sys.argv[0] = 'dflash-stages'; "
                           "from stages.cli import main; main()"], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["--packing", "--packed-attention"], done.stderr
