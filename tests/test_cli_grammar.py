"""One CLI grammar (issue 15, item 5): -v/-q anywhere on the line, --version, shell completion."""

from __future__ import annotations

import json

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
    from typer.testing import CliRunner

    from stages.cli import app

    env = {"_DFLASH_STAGES_COMPLETE": "complete_bash", "COMP_WORDS": "dflash-stages extract --pack", "COMP_CWORD": "2"}
    done = CliRunner().invoke(app, [], env=env, prog_name="dflash-stages")
    assert done.output.split() == ["--packing", "--packed-attention"], done.output


def test_json_is_a_flag_printing_json_on_stdout_in_every_command_that_has_it(tmp_path, monkeypatch, capsys):
    """``--json`` means the same everywhere (cache info, inspect, diff, scan, evaluate): the command's report as JSON
    on stdout and nothing else there; evaluate writes a report file with ``--json-file``."""
    import stages.evaluate as evaluate

    report = {"tau": 2.5, "lossless": {"checked": True, "passed": True}, "lossless_vs_generate": {"checked": False}}
    monkeypatch.setattr(evaluate, "run_evaluate", lambda config, console: report)
    code, out, err = main_in_process_out(monkeypatch, capsys, "evaluate", "--drafter", str(tmp_path / "d"),
                                         "--prompts", "p.jsonl", "--json")
    assert code == 0, err
    assert json.loads(out) == report and "tau = 2.500" in err
    code, out, err = main_in_process_out(monkeypatch, capsys, "evaluate", "--drafter", str(tmp_path / "d"),
                                         "--prompts", "p.jsonl", "--json-file", str(tmp_path / "r.json"),
                                         "--print-config")
    assert code == 0 and json.loads(out)["evaluate"]["json_path"] == str(tmp_path / "r.json")


def test_dtype_names_are_accepted_in_either_spelling_and_stored_in_one(tmp_path, monkeypatch, capsys):
    cases = [
        (["extract", "--corpus", "c", "-o", str(tmp_path / "o"), "--storage-dtype", "bfloat16"], "extract",
         "storage_dtype", "bf16"),
        (["extract", "--corpus", "c", "-o", str(tmp_path / "o"), "--set", "extract.storage_dtype=float8_e4m3fn"],
         "extract", "storage_dtype", "fp8"),
        (["evaluate", "--drafter", "d", "--prompts", "p.jsonl", "--dtype", "bf16"], "evaluate", "dtype", "bfloat16"),
        (["train", "--cache", "c", "-o", str(tmp_path / "o"), "--mixed-precision", "bfloat16"], None,
         "mixed_precision", "bf16"),
    ]
    for args, section, field, stored in cases:
        code, out, err = main_in_process_out(monkeypatch, capsys, *args, "--print-config")
        assert code == 0, (args, err)
        printed = json.loads(out)
        assert (printed[section] if section else printed)[field] == stored, args
    code, err = main_in_process(monkeypatch, capsys, "evaluate", "--drafter", "d", "--prompts", "p.jsonl",
                                "--dtype", "bf17")
    assert code == 2 and "evaluate.dtype (--dtype)" in err
