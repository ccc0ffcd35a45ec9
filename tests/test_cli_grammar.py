"""One CLI grammar: -v/-q anywhere on the line, --version, shell completion."""

from __future__ import annotations

import json
import os

import pytest

from stages.cli import hoist_global_flags
from tests.cli_helpers import main_in_process, main_in_process_out


@pytest.fixture(autouse=True)
def _in_a_folder_with_a_prompts_file(tmp_path, monkeypatch):
    """Each test runs in its own folder holding ``p.jsonl``: ``evaluate --prompts p.jsonl`` is checked up front
    (the file must exist), and relative paths such as ``-o x`` land there, not in the checkout."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text('{"prompt": "Write a haiku."}\n')


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

    checks = {"lossless": {"checked": True, "passed": True}, "lossless_vs_generate": {"checked": False}}
    report = {"tau": 2.5, **checks, "prompts": {"source": "p.jsonl", "count": 1},
              "prompt_sets": [{"name": "p", "tau": 2.5, **checks}]}
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
        (["train", "--cache", "c", "-o", str(tmp_path / "o"), "--mixed-precision", "bfloat16"], "train",
         "mixed_precision", "bf16"),
    ]
    for args, section, field, stored in cases:
        code, out, err = main_in_process_out(monkeypatch, capsys, *args, "--print-config")
        assert code == 0, (args, err)
        printed = json.loads(out)
        assert printed[section][field] == stored, args
    code, err = main_in_process(monkeypatch, capsys, "evaluate", "--drafter", "d", "--prompts", "p.jsonl",
                                "--dtype", "bf17")
    assert code == 2 and "evaluate.dtype (--dtype)" in err


#: GPUs and CPU processes are named by role, one spelling per role in every command (README, "Usage").
PLACEMENT_OPTIONS = {"--target-gpus", "--target-processes", "--drafter-gpus", "--drafter-processes", "--run-gpus"}


def _visible_options():
    """(command path, option name, parameter name) of every option ``--help`` shows, in every (sub)command."""
    import typer

    from stages.cli import _register_all, app

    _register_all()

    def walk(command, path):  # by duck type: typer may bundle a click of its own, whose classes are not click's
        if hasattr(command, "commands"):
            for name, sub in command.commands.items():
                yield from walk(sub, (*path, name))
            return
        for param in command.params:
            if param.param_type_name == "option" and not param.hidden:
                for name in (*param.opts, *param.secondary_opts):
                    yield " ".join(path), name, param.name

    return list(walk(typer.main.get_command(app), ()))


def test_gpu_lists_and_cpu_processes_have_one_spelling_per_role_in_every_command():
    options = _visible_options()
    for command, name, param in options:
        if name.endswith(("-gpus", "-gpu", "-workers")) or (name.endswith("-processes") and name != "--write-processes"):
            assert name in PLACEMENT_OPTIONS, (command, name)
        if name in PLACEMENT_OPTIONS:  # the config field is named as the option
            assert param == name[2:].replace("-", "_"), (command, name, param)
    by_command: dict[str, set[str]] = {}
    for command, name, _ in options:
        by_command.setdefault(command, set()).add(name)
    for command in ("generate", "extract", "online"):
        assert {"--target-gpus", "--target-processes"} <= by_command[command], command
    for command in ("train", "online"):
        assert {"--drafter-gpus", "--drafter-processes"} <= by_command[command], command
    # sweep's GPUs each train a whole run, not a DDP rank of one: another role, another name
    assert "--run-gpus" in by_command["sweep"] and "--drafter-gpus" not in by_command["sweep"]
    assert {command for command, names in by_command.items() if "--drafter-gpus" in names} == {"train", "online"}


def test_kernel_environment_variables_are_also_train_config_fields(tmp_path, monkeypatch, capsys):
    """DFLASH_ATTENTION_BACKEND and DFLASH_CE_KERNEL are train.attention_backend / train.ce_kernel too (options,
    --set, files, --print-config); the variable is the default where the field is unset, and both are checked
    before any work."""
    from dflash.drafter import attention_kernels
    from dflash.drafter.loss import CE_KERNEL_ENV
    from stages.train.config import TrainConfig
    from stages.train.resume import trajectory_changes

    monkeypatch.delenv(CE_KERNEL_ENV, raising=False)
    monkeypatch.setenv(attention_kernels.ENV_VAR, attention_kernels.attention_backend())
    base = ["train", "--cache", str(tmp_path / "cache"), "-o", str(tmp_path / "run"), "--print-config"]
    code, out, err = main_in_process_out(monkeypatch, capsys, *base, "--attention-backend", "TRITON", "--set",
                                         "train.ce_kernel=eager")
    assert code == 0, err
    assert (json.loads(out)["train"]["attention_backend"], json.loads(out)["train"]["ce_kernel"]) == ("triton", "eager")
    code, out, err = main_in_process_out(monkeypatch, capsys, *base)
    assert code == 0 and (json.loads(out)["train"]["attention_backend"], json.loads(out)["train"]["ce_kernel"]) == \
        (None, None), err
    code, _, err = main_in_process_out(monkeypatch, capsys, *base, "--ce-kernel", "fast")
    assert code == 2 and err.startswith("error: train.ce_kernel (--ce-kernel): must be one of auto,"), err
    monkeypatch.setenv(CE_KERNEL_ENV, "fast")
    code, _, err = main_in_process_out(monkeypatch, capsys, *base)
    assert code == 2 and "DFLASH_CE_KERNEL='fast' is not one of" in err, err
    code, out, err = main_in_process_out(monkeypatch, capsys, *base, "--ce-kernel", "inductor")  # the field wins
    assert code == 0 and json.loads(out)["train"]["ce_kernel"] == "inductor", err
    monkeypatch.delenv(CE_KERNEL_ENV)

    previous = attention_kernels.attention_backend()
    try:
        TrainConfig(cache="c", output="o", attention_backend="flash", ce_kernel="eager").apply_kernel_choices()
        assert attention_kernels.attention_backend() == "flash"
        assert os.environ[attention_kernels.ENV_VAR] == "flash" and os.environ[CE_KERNEL_ENV] == "eager"
    finally:
        attention_kernels.set_attention_backend(previous)
    saved = TrainConfig(cache="c", output="o", attention_backend="flash").to_dict()
    current = TrainConfig(cache="c", output="o", ce_kernel="eager").to_dict()
    assert trajectory_changes(saved, current, saved_world_size=1, world_size=1) == []  # a resume may change them


def test_combined_short_flags_vv_and_vq(tmp_path, monkeypatch, capsys):
    assert hoist_global_flags(["extract", "-vv", "--corpus", "c"]) == ["-v", "-v", "extract", "--corpus", "c"]
    args = ["extract", "--corpus", str(tmp_path / "c"), "-o", str(tmp_path / "o"), "--print-config"]
    code, out, err = main_in_process_out(monkeypatch, capsys, *args, "-vv")
    assert code == 0 and json.loads(out)["extract"]["corpus"] == str(tmp_path / "c"), err
    code, err = main_in_process(monkeypatch, capsys, *args, "-vq")
    assert code == 2 and err.strip() == "error: -v/--verbose and -q/--quiet contradict each other; give one"


def test_empty_paths_are_refused_naming_the_key(tmp_path, monkeypatch, capsys):
    cases = [
        (["export", str(tmp_path / "ckpt"), "--set", "out=", "--print-config"], "error: export.out (--set out=): "),
        (["extract", "--corpus", "c", "-o", "", "--print-config"], "error: -o: "),
        (["extract", "--corpus", " ", "-o", "x", "--print-config"], "error: --corpus: "),
        (["sweep", "--cache", "c", "--grid", "lr=1e-3", "--output=", "--print-config"], "error: --output: "),  # Path
        (["evaluate", "--drafter", "", "--prompts", "p.jsonl", "--print-config"], "error: --drafter: "),  # Path
        (["extract", "--corpus", "c", "-o", "x", "--set", "extract.corpus= ", "--print-config"],
         "error: extract.corpus (--set extract.corpus= ): "),
    ]
    for args, start in cases:
        code, err = main_in_process(monkeypatch, capsys, *args)
        assert code == 2 and err.startswith(start) and "empty path" in err, (args, err)
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"extract": {"corpus": "c", "output": ""}}))
    code, err = main_in_process(monkeypatch, capsys, "extract", "--config", str(config), "--print-config")
    assert code == 2 and err.startswith(f"error: extract.output (--config {config}): empty path"), err


def test_refusals_name_the_key_once(tmp_path, monkeypatch, capsys):
    code, err = main_in_process(monkeypatch, capsys, "sweep", "--cache", "c", "--grid", "lr=1e-3", "--run-gpus",
                                "0,0", "--print-config")
    assert code == 2 and err.strip() == ("error: sweep.run_gpus (--run-gpus): expected a non-empty list of "
                                         "distinct GPU ids >= 0, got [0, 0]"), err
    code, err = main_in_process(monkeypatch, capsys, "train", "--cache", "c", "-o", str(tmp_path / "r"), "--lr", "-1",
                                "--print-config")
    assert code == 2 and err.startswith("error: train.optim.lr (--lr): must be"), err


def test_a_higher_layer_replaces_the_placement_a_lower_one_chose(tmp_path, monkeypatch, capsys):
    extract = ["extract", "--corpus", str(tmp_path / "c"), "-o", str(tmp_path / "o"), "--print-config"]
    code, out, err = main_in_process_out(monkeypatch, capsys, *extract, "--preset", "cpu-small", "--target-gpus", "0")
    assert code == 0, err
    assert json.loads(out)["extract"]["target_gpus"] == [0] and json.loads(out)["extract"]["target_processes"] is None
    code, out, err = main_in_process_out(monkeypatch, capsys, "run", "--set", "extract.target_gpus=[0]",
                                         "--print-config")
    assert code == 0, err
    assert json.loads(out)["extract"]["target_gpus"] == [0] and "target_processes" not in json.loads(out)["extract"]
    # One layer naming two choices is still a contradiction.
    code, err = main_in_process(monkeypatch, capsys, *extract, "--target-gpus", "0", "--target-processes", "2")
    assert code == 2 and "give only one of" in err, err
    # A removed pre-release spelling is an unknown key, named with the file.
    config = tmp_path / "old.toml"
    config.write_text("workers = 2\n")
    code, err = main_in_process(monkeypatch, capsys, *extract, "--config", str(config))
    assert code == 2 and "workers" in err and str(config) in err, err
    code, err = main_in_process(monkeypatch, capsys, *extract, "--workers", "2")
    assert code == 2 and "--workers" in err, err


def test_run_print_config_reads_back_with_config_over_the_default_preset(tmp_path, monkeypatch, capsys):
    code, printed, err = main_in_process_out(monkeypatch, capsys, "run", "--preset", "h200-smollm2", "--print-config")
    assert code == 0, err
    saved = tmp_path / "pipeline.json"
    saved.write_text(printed)
    for option in ("--config", "--preset"):
        code, again, err = main_in_process_out(monkeypatch, capsys, "run", option, str(saved), "--print-config")
        assert code == 0, err
        assert json.loads(again) == json.loads(printed), option


def test_devices_and_gpu_ids_are_checked_before_any_work(tmp_path, monkeypatch, capsys):
    import torch

    for args, needle in [
        (["evaluate", "--drafter", str(tmp_path / "d"), "--prompts", "p.jsonl", "--device", "banana", "--print-config"],
         "must be auto, cpu, cuda or cuda:N"),
        (["evaluate", "--drafter", str(tmp_path / "d"), "--prompts", "p.jsonl", "--device", "cuda:x", "--print-config"],
         "must be auto, cpu, cuda or cuda:N"),
        (["extract", "--corpus", "c", "-o", "x", "--target-gpus=-1", "--print-config"], "GPU indices >= 0"),
        (["train", "--cache", "c", "-o", "x", "--drafter-gpus=-1", "--print-config"], "GPU ids >= 0"),
        (["export", str(tmp_path / "run"), ""], "argument 3 is empty"),
    ]:
        code, err = main_in_process(monkeypatch, capsys, *args)
        assert code == 2 and err.startswith("error: ") and needle in err, (args, err)
    if not torch.cuda.is_available():
        output = tmp_path / "gen"
        code, err = main_in_process(monkeypatch, capsys, "generate", "-o", str(output), "--target-gpus", "0")
        assert code == 2 and "CUDA is not available" in err, err
        assert not output.exists()


def test_h_is_help_in_every_command(monkeypatch, capsys):
    for args in (["-h"], ["train", "-h"], ["cache", "verify", "-h"], ["generate", "-h"]):
        code, out, err = main_in_process_out(monkeypatch, capsys, *args)
        assert code == 0 and "Usage: dflash-stages" in out, (args, err)


@pytest.mark.parametrize(("verbose", "shown"), [(False, False), (True, True)])
def test_matplotlib_font_cache_message_only_with_verbose(tmp_path, verbose, shown):
    """A fresh matplotlib font cache (first run, empty MPLCONFIGDIR) logs "generated new fontManager" at INFO; the
    CLI's logging keeps it out of a run's log unless --verbose asks for debug output."""
    import subprocess
    import sys

    code = (f"from stages.cli import _root; _root(verbose={verbose}, quiet=False, version=False); "
            "import matplotlib.font_manager")
    env = {**os.environ, "MPLCONFIGDIR": str(tmp_path / "mpl")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert ("generated new fontManager" in done.stderr) is shown
