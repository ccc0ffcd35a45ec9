"""Fault injection: what a crash, a full disk or a tampered file does to caches and runs, kept green by every change.

Kills and full disks come from the ``DFLASH_FAULT`` hook (``dflash/faults.py``) at named points; tampering is done
on the files. Each test asserts that nothing is lost or duplicated (a rerun gives a bit-identical cache, a resumed
run the straight run's state bit for bit), what the user is told (one ``error:`` line, exit status 2, the path and
the fix), and that nothing half-written is left. Concurrent writers are covered with the output locks; malicious
pickles with the checkpoint format. Real assets: the tiny SmolLM2 cache of ``train_helpers``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from cli_helpers import forked_cli, forked_python, main_in_process
from train_helpers import build_tiny_cache, tiny_config

from dflash import faults
from dflash.cache import CacheReader, HiddenStateCache, verify_cache
from dflash.errors import CacheError
from dflash.training.checkpoint import load_checkpoint
from stages.train.launch import run_training

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TESTS_DIR = Path(__file__).parent
#: Commit-record fields that describe the write (time, host:pid, seconds), not the data.
TELEMETRY = ("written_at", "writer", "write_seconds", "hidden_seconds")
#: Steps of the fault runs: checkpoints at 2 and 4.
RUN = dict(max_steps=4, save_every=2)


@pytest.fixture(scope="module")
def cache(tmp_path_factory, target):
    """Tiny real cache, 2 shards of 12 samples, hidden chunks of 32 tokens (several same-shaped chunks a shard)."""
    return build_tiny_cache(tmp_path_factory.mktemp("faults") / "cache", target, chunk_tokens=32)


@pytest.fixture(scope="module")
def straight_run(cache, tmp_path_factory):
    """The uninterrupted run every interrupted one must reproduce."""
    output = tmp_path_factory.mktemp("straight") / "run"
    run_training(tiny_config(cache, output, **RUN))
    return output


@pytest.fixture
def fault(monkeypatch):
    """``fault("point@N=action")`` sets ``DFLASH_FAULT`` for this process (and its children) until the test ends."""

    def set_fault(spec: str | None) -> None:
        if spec is None:
            monkeypatch.delenv(faults.ENV, raising=False)
        else:
            monkeypatch.setenv(faults.ENV, spec)
        faults.reload()

    yield set_fault
    monkeypatch.delenv(faults.ENV, raising=False)
    faults.reload()


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def _assert_same_run_state(a: Path, b: Path, step: int) -> None:
    first = load_checkpoint(a / "checkpoints" / f"step_{step:08d}")
    second = load_checkpoint(b / "checkpoints" / f"step_{step:08d}")
    assert first.model_state.keys() == second.model_state.keys()
    for name, tensor in first.model_state.items():
        assert torch.equal(tensor, second.model_state[name]), name
    for index, state in first.optimizer_state["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], second.optimizer_state["state"][index][key]), (index, key)
    for key in ("scheduler", "data", "counters"):  # counters: the data digest over every batch's corpus rows
        assert first.trainer_state[key] == second.trainer_state[key], key


def _assert_bit_identical_caches(a: Path, b: Path) -> None:
    files = sorted(p.relative_to(a) for p in (a / "shards").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in (b / "shards").rglob("*") if p.is_file())
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    commits = sorted(p.name for p in (a / "commits").iterdir())
    assert commits == sorted(p.name for p in (b / "commits").iterdir())
    for name in commits:
        records = [json.loads((root / "commits" / name).read_text()) for root in (a, b)]
        for record in records:
            for key in TELEMETRY:
                record.pop(key)
        assert records[0] == records[1], name


# ---------------------------------------------------------------------------------------------- cache writes


def write_missing_shards(source: str, output: str) -> None:
    """What extract does with a cache: open (or create) it with the plan, write every uncommitted shard. The
    samples come from ``source`` (a cache), so a subprocess needs no target model."""
    from dflash.cache.store import remove_partial_files

    reader = CacheReader(source)
    remove_partial_files(output)  # as extract does under its lock: a killed writer's zarr *.partial temporaries
    cache = HiddenStateCache.create(output, reader.metadata)
    for shard in sorted(set(range(reader.metadata.num_shards)) - cache.committed_shards()):
        cache.write_shard(shard, reader.read_shard(shard))


@pytest.mark.parametrize("point, committed_at_kill", [
    ("cache.chunk-write@3", []),  # mid-shard: some hidden chunks of shard 0 stored
    ("cache.before-commit@2", [0]),  # mid-commit: shard 1's arrays written, its record not
    ("cache.after-commit@1", [0]),  # after one shard committed
])  # fmt: skip
def test_sigkill_while_writing_a_cache_then_rerun_gives_a_bit_identical_cache(cache, tmp_path, point, committed_at_kill):
    output = tmp_path / "cache"
    script = f"import sys; sys.path.insert(0, {str(TESTS_DIR)!r}); import test_faults; test_faults.write_missing_shards(*sys.argv[1:])"
    # python -c in its own process, forked from one that imported torch once (cli_helpers.forked_python).
    killed = forked_python(script, str(cache), str(output), env={**os.environ, faults.ENV: point})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert sorted(HiddenStateCache.open(output).committed_shards()) == committed_at_kill
    write_missing_shards(str(cache), str(output))  # the rerun (no fault)
    assert verify_cache(output, require_complete=True)["num_samples"] == 24
    _assert_bit_identical_caches(cache, output)


def test_full_disk_mid_shard_leaves_it_uncommitted_and_the_rerun_bit_identical(cache, tmp_path, fault):
    output = tmp_path / "cache"
    fault("cache.chunk-write@2=enospc")  # the 2nd hidden chunk and every later one: the disk stays full
    with pytest.raises(CacheError, match=r"shard 0 of .*: writing its arrays failed \(\[Errno 28\] No space left on "
                                         r"device: .*shards/000000/hidden/c/1/0'\); the shard stays uncommitted"):
        write_missing_shards(str(cache), str(output))
    assert HiddenStateCache.open(output).committed_shards() == set()
    fault(None)  # space freed
    write_missing_shards(str(cache), str(output))
    _assert_bit_identical_caches(cache, output)


def _extract_three_shards(tmp_path: Path, tokenizer, fault: str | None):
    """``extract`` of a 3-row corpus into 3 one-row shards (one Dask CPU worker, --force-space), the console script
    in its own process (forked from one that imported torch once: ``cli_helpers.forked_cli``), with ``DFLASH_FAULT``
    set to ``fault``. Returns the finished process and the cache path."""
    import numpy as np

    from dflash.corpus.format import CorpusWriter

    corpus = tmp_path / "corpus"
    if not corpus.exists():
        with CorpusWriter(corpus) as writer:
            for index, text in enumerate(["def add(a, b):", "import os", "x = [1, 2, 3]"]):
                input_ids = np.asarray(tokenizer(text)["input_ids"], dtype=np.int32)
                writer.add(input_ids, np.ones(len(input_ids), dtype=np.uint8), f"doc-{index}")
            writer.commit({"target_spec": "default"})
    output = tmp_path / "cache"
    command = ["extract", "--corpus", str(corpus), "--output", str(output),
               "--target-processes", "1", "--shard-size", "1", "--dashboard-address", ":0", "--force-space"]  # fmt: skip
    env = {key: value for key, value in os.environ.items() if key != faults.ENV}
    return forked_cli(*command, cwd=os.getcwd(), timeout=240,
                      env={**env, **({faults.ENV: fault} if fault else {}), "COLUMNS": "400"}), output  # fmt: skip


def test_user_errors_under_extract_stop_it_cleanly_keeping_the_committed_shards_and_the_rerun_resumes(tmp_path,
                                                                                                      tokenizer):
    """The real stage (Dask worker, --force-space), two runs. A user's error raised inside a shard's Dask task itself
    (permission denied reading the corpus, from the 2nd task on) is that error's one line, exit 2, without the
    worker's "Compute Failed" log and its traceback, and without a retry round; the shard committed before it
    stays. The rerun resumes there and meets a full disk at its 2nd shard's commit record (outside the arrays'
    writes, which report a full disk as a CacheError): one error line with the counts and the space the rest
    needs, exit 2, no writer traceback, no retry round; the committed shards are sound."""
    denied, output = _extract_three_shards(tmp_path, tokenizer, "extract.shard@2=eacces")
    assert denied.returncode == 2, denied.stderr
    line = _one_error_line(denied.stderr)
    assert line == (f"error: Permission denied (EACCES) at {tmp_path / 'corpus'}; give this user access to it, or "
                    "choose another path"), denied.stderr
    assert "Compute Failed" not in denied.stderr and "retrying" not in denied.stdout, denied.stderr
    assert verify_cache(output)["committed_shards"] == 1

    full, _ = _extract_three_shards(tmp_path, tokenizer, "cache.before-commit@2=enospc")
    assert full.returncode == 2, full.stderr
    assert "resuming: 1 shards already committed, 2 to do" in full.stdout
    line = _one_error_line(full.stderr)
    assert line.startswith(f"error: no space left at {output}: 2 of 3 shards are committed and kept; the other 1 "
                           "(first: [2]) need about ")
    assert "free space (or use --storage-dtype fp8) and rerun the same command" in line
    assert "retrying" not in full.stdout
    assert verify_cache(output)["committed_shards"] == 2  # sound; the rerun redoes the rest (tested on the writer
    # above, where it is cheap: the same write_shard redoes uncommitted shards bit for bit)


# ---------------------------------------------------------------------------------------------- tampered caches


def _train_args(cache: Path, output: Path, *extra: str) -> list[str]:
    return ["train", "--cache", str(cache), "--output", str(output), "--num-draft-layers", "1", "--block-size", "4",
            "--max-anchors-per-document", "2", "--token-budget", "192", "--num-buckets", "2", "--validation-fraction",
            "0.2", "--max-steps", "2", "--save-every", "2", "--no-progress", "--device", "cpu", *extra]  # fmt: skip


def _swap(a: Path, b: Path) -> None:
    parked = a.with_name(a.name + ".parked")
    a.rename(parked)
    b.rename(a)
    parked.rename(b)


def _edit_json(path: Path, edit) -> None:
    document = json.loads(path.read_text())
    edit(document)
    path.write_text(json.dumps(document))


@pytest.mark.parametrize("tamper, message", [
    ("swap-shards", "shard 0 of {cache}: its commit record is shard 1's (corpus rows [12, 24]), but the plan gives "
                    "shard 0 the rows [0, 12]: shard folders or commit records were moved or swapped"),
    ("zarr-shape", "shard 1 of {cache}: shards/000001/hidden/zarr.json has shape [{rows}, 1152], but the commit record "
                   "and the cache's root metadata give [{recorded}, 1152]: the array's metadata was edited"),
    ("zarr-codec", "shard 1 of {cache}: shards/000001/hidden/zarr.json has codecs "),
    ("zarr-dtype", "shard 0 of {cache}: shards/000000/input_ids/zarr.json has data_type \"uint32\", but the commit "
                   "record and the cache's root metadata give \"int32\""),
])
def test_swapped_shards_or_edited_array_metadata_are_refused_before_step_1(cache, tmp_path, monkeypatch, capsys,
                                                                           tamper, message):
    """Shard folders swapped together with their commit records (every checksum still valid), or a shard array's
    zarr.json with another shape, codec or dtype: what `cache verify` calls corrupt, train refuses before step 1
    (exit 2, one line naming the shard and the file), writing no run folder."""
    tampered = tmp_path / "cache"
    shutil.copytree(cache, tampered)
    recorded = json.loads((tampered / "commits" / "shard-000001.json").read_text())["arrays"]["hidden"]["shape"][0]
    if tamper == "swap-shards":
        _swap(tampered / "shards" / "000000", tampered / "shards" / "000001")
        _swap(tampered / "commits" / "shard-000000.json", tampered / "commits" / "shard-000001.json")
    elif tamper == "zarr-shape":
        _edit_json(tampered / "shards" / "000001" / "hidden" / "zarr.json", lambda d: d["shape"].__setitem__(0, recorded - 1))
    elif tamper == "zarr-codec":
        _edit_json(tampered / "shards" / "000001" / "hidden" / "zarr.json", lambda d: d["codecs"].pop(1))
    else:
        _edit_json(tampered / "shards" / "000000" / "input_ids" / "zarr.json", lambda d: d.__setitem__("data_type", "uint32"))
    code, stderr = main_in_process(monkeypatch, capsys, *_train_args(tampered, tmp_path / "run"))
    line = _one_error_line(stderr)
    assert code == 2
    assert message.format(cache=tampered, rows=recorded - 1, recorded=recorded) in line, line
    assert line.endswith("withdraw the shard (`dflash-stages cache verify CACHE --uncommit-corrupt`) and rerun extract")
    assert not (tmp_path / "run").exists()
    with pytest.raises(CacheError, match="moved or swapped" if tamper == "swap-shards" else "metadata was edited"):
        verify_cache(tampered)


def test_a_bit_flip_found_during_training_leaves_no_run_folder(cache, tmp_path, monkeypatch, capsys):
    """A bit flipped inside a hidden chunk keeps its trailer (the check before step 1 passes); the reader's decode
    refuses it once training reads it: exit 2, one line naming the chunk, and the run folder this run created (no
    checkpoint in it) is removed."""
    tampered = tmp_path / "cache"
    shutil.copytree(cache, tampered)
    chunk = tampered / "shards" / "000001" / "hidden" / "c" / "2" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 1
    chunk.write_bytes(bytes(data))
    code, stderr = main_in_process(monkeypatch, capsys, *_train_args(tampered, tmp_path / "run"))
    line = _one_error_line(stderr)
    assert code == 2
    assert f"shard 1 of {tampered}: array 'hidden' chunk 2 (c/2/0, rows 64..96) fails its crc32c checksum" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("tamper", ["swap", "truncate"])
def test_swapped_or_truncated_chunk_is_refused_before_step_1(cache, tmp_path, monkeypatch, capsys, tamper):
    """A chunk of the other shard copied over one of shard 1 (valid crc32c, valid codec frame, wrong data: it trains
    silently without the check) or a truncated chunk: exit 2 naming shard and chunk, no run folder written."""
    tampered = tmp_path / "cache"
    shutil.copytree(cache, tampered)
    chunk = tampered / "shards" / "000001" / "hidden" / "c" / "2" / "0"
    if tamper == "swap":
        shutil.copyfile(tampered / "shards" / "000000" / "hidden" / "c" / "2" / "0", chunk)
    else:
        chunk.write_bytes(chunk.read_bytes()[:-100])
    code, stderr = main_in_process(monkeypatch, capsys, *_train_args(tampered, tmp_path / "run"))
    line = _one_error_line(stderr)
    assert code == 2
    assert f"shard 1 of {tampered}: array 'hidden' chunk 2 (c/2/0, rows 64..96) ends with crc32c" in line
    assert "the chunk was swapped, replaced or truncated: withdraw the shard (`dflash-stages cache verify CACHE --uncommit-corrupt`)" in line
    assert not (tmp_path / "run").exists()


def test_deleted_commit_record_is_refused_unless_allow_incomplete(cache, tmp_path, monkeypatch, capsys, caplog):
    partial = tmp_path / "cache"
    shutil.copytree(cache, partial)
    (partial / "commits" / "shard-000001.json").unlink()
    code, stderr = main_in_process(monkeypatch, capsys, *_train_args(partial, tmp_path / "run"))
    assert code == 2
    assert (f"error: {partial} is incomplete: 1 of 2 planned shards have no commit record (first: [1]; 12 of 24 corpus "
            "rows), so training would see 12 samples instead of about 24") in _one_error_line(stderr)
    assert not (tmp_path / "run").exists()
    code, stderr = main_in_process(monkeypatch, capsys, *_train_args(partial, tmp_path / "run", "--allow-incomplete"))
    assert code == 0, stderr
    assert "--allow-incomplete: training on 12 samples of 24 planned corpus rows (1 of 2 shards committed" in caplog.text
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["resolved"]["cache_integrity"]["num_samples"] == 12
    assert run["resolved"]["cache_integrity"]["uncommitted_shards"] == [1]


# ---------------------------------------------------------------------------------------------- runs


def test_sigkill_mid_checkpoint_write_then_resume_is_bit_exact(cache, straight_run, tmp_path):
    output = tmp_path / "run"
    config = tiny_config(cache, output, **RUN)
    script = ("import json, sys, torch; torch.set_num_threads(1); from stages.train.config import TrainConfig; from stages.train.launch import run_training; "
              "run_training(TrainConfig.from_dict(json.loads(sys.argv[1])))")  # one thread, as here: same float sums
    killed = forked_python(script, json.dumps(config.to_dict()), timeout=240,
                           env={**os.environ, faults.ENV: "checkpoint.write@2"})  # as above
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (output / "latest").read_text().strip() == "step_00000002"  # the half-written step 4 does not count
    assert [p.name for p in (output / "checkpoints").glob(".tmp-step_00000004-*")]
    run_training(tiny_config(cache, output, resume=True, **RUN))
    assert not list((output / "checkpoints").glob(".tmp-*"))
    _assert_same_run_state(straight_run, output, 4)


@pytest.mark.parametrize("spec", [
    "checkpoint.write@2=enospc",  # between the weights and the state files of step 4
    "safetensors.write@4=enospc",  # step 4's model.safetensors (3 safetensors files a checkpoint)
    "safetensors.write@6=enospc",  # step 4's rng.safetensors (through dflash.training.state_files)
])  # fmt: skip
def test_full_disk_at_a_checkpoint_is_one_error_line_and_the_resume_is_bit_exact(cache, straight_run, tmp_path,
                                                                                   monkeypatch, capsys, fault, spec):  # fmt: skip
    output = tmp_path / "run"
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(tiny_config(cache, output, **RUN).to_dict()))
    fault(spec)
    code, stderr = main_in_process(monkeypatch, capsys, "train", "--config", str(config_file))
    assert code == 2
    line = _one_error_line(stderr)
    assert line.startswith("error: No space left on device (ENOSPC) at ")
    assert f"{output}/checkpoints/.tmp-step_00000004-" in line and "free space there" in line
    assert (output / "latest").read_text().strip() == "step_00000002"
    assert not list((output / "checkpoints").glob(".tmp-*"))  # nothing half-written left
    fault(None)
    code, stderr = main_in_process(monkeypatch, capsys, "train", "--config", str(config_file), "--resume")
    assert code == 0, stderr
    _assert_same_run_state(straight_run, output, 4)


def test_full_disk_under_export_is_one_error_line_and_leaves_nothing(straight_run, tmp_path, monkeypatch, capsys, fault):
    out = tmp_path / "export"
    fault("safetensors.write=enospc")
    code, stderr = main_in_process(monkeypatch, capsys, "export", str(straight_run), str(out))
    assert code == 2
    line = _one_error_line(stderr)
    assert line.startswith(f"error: No space left on device (ENOSPC) at {tmp_path}/.export.")
    assert line.endswith("/model.safetensors; free space there (or write elsewhere) and rerun the same command; "
                         "committed work is kept")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no export, no staging folder, no lock file
    fault(None)
    code, stderr = main_in_process(monkeypatch, capsys, "export", str(straight_run), str(out))
    assert code == 0, stderr
    assert (out / "model.safetensors").is_file()


@pytest.mark.parametrize("command", ["inspect", "inspect --scan", "export", "evaluate", "train --resume"])
def test_truncated_weights_are_one_error_line_naming_the_file(straight_run, tmp_path, monkeypatch, capsys, command):
    run = tmp_path / "run"
    shutil.copytree(straight_run, run)
    weights = run / "checkpoints" / "step_00000004" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\n")
    args = {
        "inspect": ["inspect", str(run)],
        "inspect --scan": ["inspect", str(run), "--scan"],
        "export": ["export", str(run), str(tmp_path / "export")],
        "evaluate": ["evaluate", "--drafter", str(run), "--prompts", str(prompts)],
        "train --resume": ["train", "--output", str(run), "--resume", "--no-progress"],
    }[command]
    code, stderr = main_in_process(monkeypatch, capsys, *args)
    assert code == 2
    line = _one_error_line(stderr)
    assert f"{weights} (1,000 bytes) is not a readable safetensors file" in line
    assert "the file is truncated or overwritten: restore it, or use another checkpoint" in line
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize("stage", ["train", "extract"])
def test_output_that_is_a_file_is_refused(cache, tmp_path, monkeypatch, capsys, stage):
    target = tmp_path / "taken"
    target.write_text("not a folder")
    args = _train_args(cache, target) if stage == "train" else ["extract", "--corpus", str(tmp_path / "corpus"),
                                                                  "--output", str(target)]  # fmt: skip
    code, stderr = main_in_process(monkeypatch, capsys, *args)
    assert code == 2
    assert f"output: {target} exists and is not a folder" in _one_error_line(stderr)
    assert target.read_text() == "not a folder"
