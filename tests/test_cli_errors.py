"""The console script's one exit-status scheme (``stages.cli.ExitCode``): 0 success, 1 the checked thing is bad,
2 a user's input to fix (one ``error:`` line, no traceback), 3 a bug (traceback), 130 interrupted after cleanup
(train: with a checkpoint); ``--help`` piped is laid out wide; tests never write into the real dflash home;
``prepare --overwrite`` never deletes a folder that is not a corpus."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dflash.corpus.format import CorpusWriter
from dflash.errors import CorpusError


def _cli(*args: str, cwd, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The console script in its own process (forked from one that imported torch and transformers once; see
    cli_helpers.ForkedCli); test_version starts a whole interpreter (``python -m stages.cli``)."""
    from cli_helpers import forked_cli

    return forked_cli(*args, cwd=cwd, env=env)


def _main_in_process(monkeypatch, *args: str) -> int:
    """Run the real entry point ``stages.cli.main`` here (no interpreter start-up); returns its exit status."""
    import signal

    from stages.cli import main

    monkeypatch.setattr(sys, "argv", ["dflash-stages", *args])
    monkeypatch.setenv("COLUMNS", "200")  # main() would set it for a piped stdout; keep this process's env clean
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        main()
    except SystemExit as exit_:
        return int(exit_.code or 0)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    return 0


@pytest.mark.parametrize("args, expected", [
    (("train", "--cache", "no-such-cache", "--output", "run"), "no cache at no-such-cache"),
    (("train", "--output", "no-such-run", "--resume"), "--resume: no-such-run holds no run"),
    (("train", "--cache", "c", "--output", "run", "--attention-backend", "fa3"), "train.attention_backend (--attention-backend): must be one of auto, flash, triton"),
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

    from cli_helpers import forked_cli_start

    process = forked_cli_start("prepare", "--output", "corpus", cwd=tmp_path)  # forked as _cli's commands are
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".corpus.tmp-*")):  # wait until the writer's staging folder exists
        assert process.poll() is None and time.monotonic() < deadline, "prepare ended before writing anything"
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 130  # interrupted (same as Ctrl-C), after the cleanup below
    assert list(tmp_path.iterdir()) == []  # neither a half corpus nor its staging folder
    assert process.stderr.strip().splitlines()[-1].startswith("interrupted by SIGTERM; what was committed before it")


def test_empty_or_malformed_jsonl_is_named_with_its_position(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    result = _cli("prepare", "empty.jsonl", "-o", "out", "--assistant-mask", "prefix-diff", cwd=tmp_path)
    assert result.returncode == 2 and "empty.jsonl: no JSON rows (the file is empty)" in result.stderr
    bad = '{"messages": [{"role": "user", "content": "hi"}'  # the closing brace is missing: error at its end
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n' + bad + "\n")
    result = _cli("prepare", "bad.jsonl", "-o", "out", "--assistant-mask", "prefix-diff", cwd=tmp_path)
    assert result.returncode == 2 and "bad.jsonl line 2: not valid JSON" in result.stderr
    assert f"at line 1 column {len(bad) + 1} (" in result.stderr  # where the parser wanted more
    assert not (tmp_path / "out").exists()


def test_input_errors_of_export_and_cache_exit_2(tmp_path):
    """Export and cache commands used to exit 1 here; a wrong path is the user's to fix: 2, one line, no traceback."""
    for args, expected in ((("export", "no-such-run", "out"), "no-such-run is not a folder"),
                           (("cache", "verify", "no-such-cache"), "no cache at no-such-cache")):
        result = _cli(*args, cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        assert expected in result.stderr and len(result.stderr.strip().splitlines()) == 1
        assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_cache_verify_exits_0_when_sound_and_1_when_corrupt(tmp_path, target, monkeypatch, capsys):
    from train_helpers import build_tiny_cache

    cache = build_tiny_cache(tmp_path / "tiny.zarr", target, num_samples=6)
    assert _main_in_process(monkeypatch, "cache", "verify", str(cache)) == 0
    chunk = max((p for p in (cache / "shards" / "000001" / "hidden").rglob("*") if p.is_file() and p.name != "zarr.json"),
                key=lambda p: p.stat().st_size)  # the largest chunk of shard 1's hidden states
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x04
    chunk.write_bytes(bytes(data))
    capsys.readouterr()
    assert _main_in_process(monkeypatch, "cache", "verify", str(cache)) == 1
    out = capsys.readouterr().out
    assert "CORRUPT: shard 1 of" in out and "array 'hidden' chunk" in out
    assert "--uncommit-corrupt" in out  # the repair is spelled out: withdraw, then rerun extract
    assert _main_in_process(monkeypatch, "cache", "verify", str(cache), "--uncommit-corrupt") == 1
    assert "withdrew 1 corrupt shard(s)" in capsys.readouterr().out
    assert _main_in_process(monkeypatch, "cache", "verify", str(cache), "--allow-incomplete") == 0


def test_a_bug_exits_3_with_its_traceback(monkeypatch, capsys):
    import stages.cache_cmd

    def broken(path):
        raise RuntimeError("an internal invariant broke")

    monkeypatch.setattr(stages.cache_cmd, "cache_info", broken)
    assert _main_in_process(monkeypatch, "cache", "info", "anything") == 3
    err = capsys.readouterr().err
    assert "RuntimeError" in err and "an internal invariant broke" in err and "Traceback" in err


def test_train_stopped_by_sigterm_exits_130_with_a_resumable_checkpoint(tmp_path, target, monkeypatch, capsys):
    """The real CLI and trainer: SIGTERM in step 2 -> checkpoint of step 2, resume hint, exit 130 (not 0)."""
    import json
    import os
    import signal

    from train_helpers import build_tiny_cache, tiny_config

    import stages.train.loop as trainer_module

    cache = build_tiny_cache(tmp_path / "tiny.zarr", target, num_samples=12)
    real_loss = trainer_module.dflash_loss
    calls = {"n": 0}

    def preempted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's preemption notice in the middle of step 2
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "dflash_loss", preempted)
    config = tiny_config(cache, tmp_path / "run", max_steps=4, save_every=10, validation_fraction=0.0)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    assert _main_in_process(monkeypatch, "train", "--config", str(tmp_path / "config.json")) == 130
    err = capsys.readouterr().err
    assert "interrupted at step 2 of 4" in err and f"--output {tmp_path / 'run'} --resume" in err
    assert (tmp_path / "run" / "latest").read_text().strip() == "step_00000002"
    assert not (tmp_path / "run.lock").exists()  # the run folder's lock went with the interrupted run


def test_piped_help_is_wide_lists_exit_status_and_cuts_no_description(tmp_path):
    import os
    import re

    import typer
    from rich.text import Text

    from stages.cli import NON_TTY_COLUMNS, _register_all, app

    env = {key: value for key, value in os.environ.items() if key not in ("COLUMNS", "TERMINAL_WIDTH")}
    result = _cli("extract", "--help", cwd=tmp_path, env=env)  # stdout is a pipe, as in `| cat`
    assert result.returncode == 0, result.stderr
    assert max(len(line) for line in result.stdout.splitlines()) == NON_TTY_COLUMNS
    # Every option's description appears whole (words wrapped across lines are rejoined; nothing cut or elided).
    flat = " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.stdout).split())
    _register_all()
    extract = typer.main.get_command(app).commands["extract"]
    for param in extract.params:
        if getattr(param, "help", None):
            assert " ".join(Text.from_markup(param.help).plain.split()) in flat, param.name  # help is rich markup
    assert "…" not in result.stdout

    result = _cli("--help", cwd=tmp_path, env={**env, "COLUMNS": "100"})  # an explicit width wins
    assert result.returncode == 0 and max(len(line) for line in result.stdout.splitlines()) == 100
    lines = [line.strip() for line in result.stdout.splitlines()]
    status = lines[lines.index("Exit status (every command):") + 1:]
    for code in ("0", "1", "2", "3", "130"):
        assert any(line.startswith(code + " ") for line in status), code


def test_session_uses_a_temporary_dflash_home(dflash_home, target_path, tmp_path):
    """Identity memos and conversions go to the session's temporary home; the real one only lends its target."""
    import json
    import os
    from pathlib import Path

    from dflash.target.load import dflash_home as current_home
    from dflash.target.load import target_identity

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


def test_local_dask_workers_leave_ctrl_c_to_the_main_process():
    """The CLI preloads ``stages.cli`` into the workers of a local cluster: they ignore SIGINT (the main process
    cancels and closes them, so an interrupted extract prints no worker KeyboardInterrupt tracebacks) and drop the
    "ended with CancelledError" warnings of the tasks that shutdown cancels."""
    import logging
    import signal

    import dask.config
    from distributed import Client, LocalCluster

    from stages.cli import _preload_quiet_dask_workers

    def worker_state():
        logger = logging.getLogger("distributed.worker.state_machine")
        record = logger.makeRecord(logger.name, logging.WARNING, __file__, 0, "Async instruction for %s ended with "
                                   "CancelledError", ("task",), None)
        other = logger.makeRecord(logger.name, logging.WARNING, __file__, 0, "another warning", (), None)
        return signal.getsignal(signal.SIGINT) == signal.SIG_IGN, logger.filter(record), logger.filter(other)

    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when the suite itself runs in a background job
    with dask.config.set({"distributed.worker.preload": ["dask_preload_of_the_user"]}):
        _preload_quiet_dask_workers()
        assert dask.config.get("distributed.worker.preload") == ["dask_preload_of_the_user", "stages.cli"]
    with dask.config.set({"distributed.worker.preload": []}):
        _preload_quiet_dask_workers()
        with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
                Client(cluster) as client:
            (ignores_sigint, keeps_cancelled, keeps_other), = client.run(worker_state).values()
    assert ignores_sigint and not keeps_cancelled and keeps_other
    assert signal.getsignal(signal.SIGINT) is before  # this process's Ctrl-C handling is untouched


def test_help_renders_flags_without_a_type_placeholder():
    """Flags take no value, so ``--help`` shows no ``<bool>`` after them; options that take one keep their type."""
    from typer.testing import CliRunner

    from stages.cli import _register_all, app

    _register_all()
    runner = CliRunner()
    for args in (["--help"], ["extract", "--help"], ["prepare", "--help"]):
        result = runner.invoke(app, args, env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        assert "<bool>" not in result.output, args
        help_line = next(line for line in result.output.splitlines() if "--help" in line)
        assert " ".join(help_line.strip("│ ").split()) == "--help -h Show this message and exit."
    verbose = next(line for line in runner.invoke(app, ["--help"], env={"COLUMNS": "200"}).output.splitlines()
                   if "--verbose" in line)
    assert " ".join(verbose.strip("│ ").split()) == "--verbose -v Log debug messages (anywhere on the line)."
    extract = runner.invoke(app, ["extract", "--help"], env={"COLUMNS": "200"}).output
    assert any("--target-processes" in line and "<int>" in line for line in extract.splitlines())


@pytest.mark.parametrize("code, exit_status, expected", [
    ("EACCES", 2, "error: Permission denied (EACCES) at /data/cache/zarr.json; give this user access to it"),
    ("EROFS", 2, "error: Read-only file system (EROFS) at /data/cache/zarr.json; the filesystem is mounted read-only"),
    ("ENOSPC", 2, "error: No space left on device (ENOSPC) at /data/cache/zarr.json; free space there"),
    ("ECONNRESET", 3, "Traceback"),  # not the machine's answer to the user: a bug until shown otherwise
])  # fmt: skip
def test_os_errors_the_user_must_fix_are_one_line_exit_2(monkeypatch, capsys, code, exit_status, expected):
    """The one mapping in stages.cli.main: OSErrors of USER_ERRNOS name the path and the fix; others stay bugs."""
    import errno
    import os

    import dflash.cache.reader

    number = getattr(errno, code)

    def refuse(path, mode):
        raise OSError(number, os.strerror(number), "/data/cache/zarr.json")

    monkeypatch.setattr(dflash.cache.reader, "open_cache_store", refuse)
    assert _main_in_process(monkeypatch, "cache", "info", "/data/cache") == exit_status
    stderr = capsys.readouterr().err
    assert expected in stderr
    if exit_status == 2:
        assert stderr.count("error:") == 1 and "Traceback" not in stderr


@pytest.mark.parametrize(("text", "suffix", "message"), [
    ('[optim]\nlr = "fast"\n', ".toml", "train.optim.lr (--config {path}): expected float, got 'fast'"),
    ("lr = = 3\n", ".toml", "--config {path}: invalid TOML (Invalid value (at line 1, column 6))"),
    ('{"lrr": 3}', ".json", "train.lrr (--config {path}): unknown key; did you mean train.optim.lr?"),
    ('{"lr": 3,}', ".json", "--config {path}: invalid JSON at line 1 column 10"),
    ("lr: [3\n", ".yaml", "--config {path}: invalid YAML at line 2 column 1 (expected ',' or ']'"),
    ("optim:\n  lr: fast\n", ".yml", "train.optim.lr (--config {path}): expected float, got 'fast'"),
    ('!!python/object/apply:os.system ["touch {path}.pwned"]\n', ".yaml",
     "--config {path}: invalid YAML at line 1 column 1 (could not determine a constructor"),  # never code
    ("lr = 3\n", ".ini", "--config {path}: expected a .toml, .yaml or .json file, got '.ini'"),
    (None, ".toml", "--config {path}: no such file"),
])
def test_train_config_file_errors_name_the_key_or_position_and_the_file(tmp_path, monkeypatch, capsys, text, suffix,
                                                                         message):
    from cli_helpers import main_in_process

    path = tmp_path / f"train{suffix}"
    if text is not None:
        path.write_text(text)
    code, err = main_in_process(monkeypatch, capsys, "train", "--config", str(path), "--cache", str(tmp_path / "c"),
                                "--output", str(tmp_path / "run"))
    assert code == 2, err
    assert err.startswith("error: ") and message.format(path=path) in " ".join(err.split())
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("name", "text"), [
    ("train.toml", '[drafter]\nblock_size = 8\ntarget_layer_ids = [1, 2]\n[optim]\nlr = 3e-4\nbetas = [0.9, 0.95]\n'),
    ("train.yaml", "optim:\n  lr: 3e-4\n  betas: [0.9, 0.95]\ndrafter:\n  block_size: 8\n  target_layer_ids: [1, 2]\n"),  # 3e-4: a float
])
def test_a_toml_or_yaml_train_config_is_read(tmp_path, name, text):
    from stages.train.command import config_from_cli

    path = tmp_path / name
    path.write_text(text)
    config = config_from_cli({"cache": "c", "output": "o"}, path)
    assert (config.optim.lr, config.drafter.block_size, config.optim.betas, config.drafter.target_layer_ids) == \
        (3e-4, 8, (0.9, 0.95), [1, 2])


def test_version_prints_the_package_and_library_versions():
    import importlib.metadata

    result = subprocess.run([sys.executable, "-m", "stages.cli", "--version"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"dflash-stages {importlib.metadata.version('dflash-stages')} (torch ")


def test_train_print_config_round_trips_through_config(tmp_path):
    """``train --print-config`` prints the resolved config; fed back with ``--config`` it resolves to the same one,
    and options still override it. Nothing is trained or written."""
    import typer
    from typer.testing import CliRunner

    from stages.train.command import register

    app = typer.Typer()
    app.callback()(lambda: None)
    register(app)
    run = tmp_path / "run"
    first = CliRunner().invoke(app, ["train", "--cache", str(tmp_path / "c"), "--output", str(run), "--lr", "3e-4",
                                     "--block-size", "8", "--betas", "0.9,0.95", "--print-config"])
    assert first.exit_code == 0, first.output
    printed = json.loads(first.output)
    assert list(printed) == ["train"]  # {"train": {...}}, as every stage prints
    train = printed["train"]
    assert (train["optim"]["lr"], train["drafter"]["block_size"], train["optim"]["betas"]) == (3e-4, 8, [0.9, 0.95])
    (tmp_path / "resolved.json").write_text(first.output)
    again = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "resolved.json"), "--print-config"])
    assert again.exit_code == 0 and json.loads(again.output) == printed
    changed = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "resolved.json"), "--lr", "1e-3",
                                       "--print-config"])
    assert json.loads(changed.output) == {"train": {**train, "optim": {**train["optim"], "lr": 1e-3}}}
    assert not run.exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_extract_on_gpus_without_cuda_is_refused_before_any_file_exists(tmp_path, monkeypatch, capsys):
    from cli_helpers import main_in_process

    code, err = main_in_process(monkeypatch, capsys, "extract", "--corpus", str(tmp_path / "corpus"), "--output",
                                str(tmp_path / "cache"), "--target-gpus", "0")  # fmt: skip
    assert code == 2 and "CUDA is not available" in err and err.count("error:") == 1
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(("args", "expected"), [
    (["train", "--lrr", "3"], "error: dflash-stages train: No such option: --lrr (Possible options: --lr) "
                              "(see 'dflash-stages train --help')"),
    (["train", "--token-budget", "abc"], "error: dflash-stages train: Invalid value for '--token-budget':"),
    (["trian"], "error: dflash-stages: No such command 'trian'. Did you mean 'train'? (see 'dflash-stages --help')"),
    (["cache", "info"], "error: dflash-stages cache info: Missing argument 'CACHE'. "
                        "(see 'dflash-stages cache info --help')"),
    (["extract", "--length-policy"], "error: dflash-stages extract: Option '--length-policy' requires an argument."),
])  # fmt: skip
def test_click_usage_errors_are_one_error_line_naming_the_fix(args, expected, monkeypatch, capsys):
    from tests.cli_helpers import main_in_process_out

    code, out, err = main_in_process_out(monkeypatch, capsys, *args)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith(expected), err
    assert "╭" not in err and "Usage:" not in err


def test_help_and_a_group_without_its_subcommand_still_print_the_help(monkeypatch, capsys):
    from tests.cli_helpers import main_in_process_out

    code, out, _ = main_in_process_out(monkeypatch, capsys, "train", "--help")
    assert code == 0 and "--drafter-gpus" in out
    code, out, _ = main_in_process_out(monkeypatch, capsys, "cache")
    assert code == 2 and "verify" in out
