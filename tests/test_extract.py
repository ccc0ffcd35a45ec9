"""The extract stage on the real SmolLM2-135M-Instruct (CPU) and a tiny corpus of stdlib docstrings.

Dask runs use real LocalCluster worker processes; the SIGKILL test kills the whole ``dflash-stages extract``
process mid-run and checks that the rerun leaves an exactly-once cache.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from cli_helpers import COUNT, DURATION
from rich.console import Console

from dflash.cache import CacheReader, HiddenStateCache, verify_cache
from dflash.corpus.format import CorpusWriter, open_corpus
from dflash.errors import CacheError, ConfigError, CorpusError
from dflash.target.runner import TargetRunner
from dflash.target.taps import default_target_layer_ids
from stages.extract import command as extract_stage
from stages.extract.command import ExtractConfig, plan_shards, prepare_cache, run_extract
from stages.extract.worker import ShardExtractor, ShardSpec, default_write_processes
from stages.replicas.cluster import security_of, start_cluster

TEXTS = [
    json.dumps.__doc__[:50],
    textwrap.dedent.__doc__[:40],
    random.shuffle.__doc__,
    os.path.join.__doc__[:45],
    "import os\nprint(os.getcwd())",
    str.split.__doc__[:40],
    "def double(x):",
    list.append.__doc__,
]


def _write_corpus(path: Path, tokenizer, texts=TEXTS) -> Path:
    with CorpusWriter(path) as writer:
        for index, text in enumerate(texts):
            input_ids = np.asarray(tokenizer(text)["input_ids"], dtype=np.int32)
            loss_mask = np.zeros(len(input_ids), dtype=np.uint8)
            loss_mask[len(input_ids) // 2 :] = 1
            writer.add(input_ids, loss_mask, f"doc-{index}")
        writer.commit({"target_spec": "default"})
    return path


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory, tokenizer):
    return _write_corpus(tmp_path_factory.mktemp("extract") / "corpus", tokenizer)


@pytest.fixture(scope="module")
def layer_ids(target):
    return default_target_layer_ids(target.model.config.num_hidden_layers, 5)


@pytest.fixture(scope="module")
def reference(target, corpus_dir, layer_ids):
    """Each corpus row's taps from a forward of that row alone, in this process."""
    corpus = open_corpus(corpus_dir)
    runner = TargetRunner(target.model, layer_ids, "cpu", token_budget=1)
    return runner.run([corpus.row(i).input_ids for i in range(len(corpus))])


def _quiet() -> Console:
    return Console(file=open(os.devnull, "w"), width=120)  # noqa: SIM115 (closed with the process)


def _assert_cache_matches(output: Path, corpus_dir: Path, reference, *, missing_rows=()) -> None:
    report = verify_cache(output, require_complete=True)
    corpus = open_corpus(corpus_dir)
    assert report["num_samples"] == len(corpus) - len(missing_rows)
    reader = CacheReader(output)
    seen = []
    for shard in reader.shards:
        for sample in reader.read_shard(shard):
            row = corpus.row(sample.corpus_row)
            assert np.array_equal(sample.input_ids.numpy(), row.input_ids)
            assert np.array_equal(sample.loss_mask.numpy(), row.loss_mask)
            torch.testing.assert_close(sample.hidden.float(), reference[sample.corpus_row].float(), rtol=1.6e-2, atol=2e-2)
            seen.append(sample.corpus_row)
    assert sorted(seen) == sorted(set(range(len(corpus))) - set(missing_rows))  # no duplicate, no missing row


def test_plan_shards_is_contiguous_and_bounded():
    lengths = np.array([5, 9, 3, 30, 2, 2, 7])
    shards = plan_shards(lengths, 10)
    assert shards[0][0] == 0 and shards[-1][1] == len(lengths)
    assert all(a[1] == b[0] for a, b in zip(shards, shards[1:], strict=False))
    for start, stop in shards:
        assert stop - start == 1 or lengths[start:stop].sum() <= 10


@pytest.mark.slow
def test_sigkill_mid_run_then_rerun_is_exactly_once(tmp_path, corpus_dir, reference):
    """SIGKILL of the whole ``extract`` process after its first commit; the rerun (with a write process) commits
    the rest exactly once."""
    from cli_helpers import forked_cli_start

    output = tmp_path / "cache"
    command = [
        "extract", "--corpus", str(corpus_dir), "--output", str(output),
        "--target-processes", "1", "--shard-size", "1", "--dashboard-address", ":0",
    ]  # fmt: skip
    # Its own process, forked from one that imported torch and transformers once (cli_helpers.forked_cli_start).
    process = forked_cli_start(*command, cwd=os.getcwd())
    commits = output / "commits"
    deadline = time.monotonic() + 240
    while not (commits.is_dir() and any(commits.glob("shard-*.json"))):
        assert process.poll() is None, "extract exited before committing a shard"
        assert time.monotonic() < deadline, "no shard committed in time"
        time.sleep(0.05)
    children = psutil.Process(process.pid).children(recursive=True)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    # Worker processes die with the driver (no orphan keeps writing a shard the rerun redoes).
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"orphan worker processes {[p.pid for p in alive]}"
    committed_at_kill = HiddenStateCache.open(output).committed_shards()
    planned = CacheReader(output).metadata.num_shards
    assert 1 <= len(committed_at_kill) < planned, "the kill did not land mid-run"

    # The rerun goes through the whole stage with a write process (the non-daemonic Dask worker spawns it).
    config = ExtractConfig(corpus=str(corpus_dir), output=str(output), target_processes=1, shard_size=1, dashboard_address=":0",
                           write_processes=1, write_threads=1)  # fmt: skip
    summary = run_extract(config, _quiet())
    assert summary["skipped_committed"] == len(committed_at_kill)
    assert summary["committed_shards"] == planned
    _assert_cache_matches(output, corpus_dir, reference)


def test_nonfinite_sample_is_quarantined_and_the_rest_written(tmp_path, target, corpus_dir, layer_ids, reference):
    output = tmp_path / "cache"
    config = ExtractConfig(corpus=str(corpus_dir), output=str(output), target_processes=1, shard_size=10_000)
    cache, corpus, shard_rows, _ = prepare_cache(config, _quiet())
    poisoned_row = 3
    marker = int(corpus.row(poisoned_row).input_ids[0])
    assert all(int(corpus.row(i).input_ids[0]) != marker for i in range(len(corpus)) if i != poisoned_row)
    decoder = target.model.get_decoder()
    current_ids = {}

    def remember_ids(module, args, kwargs):
        current_ids["ids"] = kwargs["input_ids"]

    def poison(module, args, output):  # an overflow inside layer 10 for the poisoned row only
        rows = current_ids["ids"][:, 0] == marker
        output = output.clone()
        output[rows, 1] = float("nan")
        return output

    handles = [
        decoder.register_forward_pre_hook(remember_ids, with_kwargs=True),
        decoder.layers[10].register_forward_hook(poison),
    ]
    extractor = ShardExtractor(TargetRunner(target.model, layer_ids, "cpu", token_budget=64))
    try:
        for shard_id, (start, stop) in enumerate(shard_rows):
            spec = ShardSpec(shard_id=shard_id, row_start=start, row_stop=stop, num_tokens=0,
                             cache_path=str(output), corpus_path=str(corpus_dir))  # fmt: skip
            result = extractor.process(spec)
        writes = extractor.close()
    finally:
        for handle in handles:
            handle.remove()
    # The shard's last batch is checked by its write (ShardExtractor.process): the quarantine is in the commit.
    assert "error" not in writes[0] and writes[0]["num_quarantined"] == 1
    assert [entry["corpus_row"] for entry in writes[0]["quarantined"]] == [poisoned_row]
    assert writes[0]["quarantined"][0]["sample_id"] == f"doc-{poisoned_row}"
    assert writes[0]["quarantined"][0]["layers"] == [i for i in layer_ids if i > 10]
    assert 0 <= result["write_wait_seconds"] and 0 < result["compute_seconds"]
    assert 0 < writes[0]["hidden_seconds"] <= writes[0]["write_seconds"]  # write telemetry in the commit record
    assert [entry["corpus_row"] for entry in CacheReader(output).quarantined()] == [poisoned_row]
    _assert_cache_matches(output, corpus_dir, reference, missing_rows=[poisoned_row])


def test_refuses_when_the_estimate_exceeds_free_space(tmp_path, corpus_dir, monkeypatch):
    monkeypatch.setattr(extract_stage, "_free_bytes", lambda output: 1000)
    config = ExtractConfig(corpus=str(corpus_dir), output=str(tmp_path / "cache"), target_processes=1)
    with pytest.raises(CacheError, match="--force-space"):
        run_extract(config, _quiet())
    assert not (tmp_path / "cache").exists()


def test_corpus_outside_the_vocab_fails_before_any_worker_starts(tmp_path, tokenizer):
    corpus_dir = tmp_path / "corpus"
    with CorpusWriter(corpus_dir) as writer:
        writer.add(np.array([1, 2, 3], np.int32), np.array([0, 1, 1], np.uint8), "ok")
        writer.add(np.array([1, 60_000, 3], np.int32), np.array([0, 1, 1], np.uint8), "bad")
        writer.commit({})
    config = ExtractConfig(corpus=str(corpus_dir), output=str(tmp_path / "cache"), target_processes=1)
    with pytest.raises(CorpusError, match="60000"):
        run_extract(config, _quiet())
    assert not (tmp_path / "cache").exists()


def test_a_corpus_edited_after_prepare_fails_before_any_worker_starts(tmp_path, corpus_dir):
    """One token id changed in the corpus's Arrow file: extract recomputes the fingerprint and refuses the corpus
    instead of recording the new one; nothing is written."""
    from test_corpus import edit_one_token

    edited = tmp_path / "corpus"
    shutil.copytree(corpus_dir, edited)
    edit_one_token(edited / "corpus.arrow")
    config = ExtractConfig(corpus=str(edited), output=str(tmp_path / "cache"), target_processes=1)
    with pytest.raises(CorpusError, match=f"corpus {edited}: its data \\(corpus.arrow\\) has fingerprint .* but "
                                          f"{edited / 'corpus.json'} records .*: the data was changed"):
        run_extract(config, _quiet())
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_worker_sigkill_mid_run_is_redone_exactly_once(tmp_path, corpus_dir, reference):
    config = ExtractConfig(corpus=str(corpus_dir), output=str(tmp_path / "cache"), target_processes=2, shard_size=1,
                           dashboard_address=":0")  # fmt: skip

    def kill_a_worker() -> None:
        from distributed import default_client

        workers = sorted(default_client().run(os.getpid).values())  # run_extract's client: its workers' pids
        assert len(workers) == 2, "no Dask worker process found"
        psutil.Process(workers[0]).kill()  # the task it ran and its pending write are lost; the driver must redo them

    summary = _kill_mid_extract(config, kill_a_worker, corpus_dir, reference)
    # Two workers wrote the same cache as one process (checked above against the per-row reference). Telemetry:
    # the workers' compute and write-wait time add up to at most their share of the wall time.
    assert 0 < summary["compute_seconds"] and 0 <= summary["write_wait_seconds"]
    assert summary["compute_seconds"] + summary["write_wait_seconds"] <= 2 * summary["seconds"] + 1e-6
    # A rerun finds every shard committed and does nothing but remove what a write killed before its rename left
    # (a zarr temporary: here of finalize's root metadata), which verify reported.
    output = Path(config.output)
    (output / "zarr.0123abcd.partial").write_text("{")
    assert verify_cache(output)["partial_files"] == ["zarr.0123abcd.partial"]
    assert run_extract(config, _quiet())["skipped_committed"] == summary["planned_shards"]
    assert not list(output.rglob("*.partial")) and verify_cache(output)["partial_files"] == []
    assert not (output.parent / "cache.lock").exists()  # the lock is gone with the run


def _kill_mid_extract(config: ExtractConfig, kill, corpus_dir: Path, reference) -> dict:
    """Run ``extract`` in a thread, call ``kill()`` once its first shard is committed, and check the run still
    commits every planned shard exactly once with the reference's contents; returns the run's summary."""
    output = Path(config.output)
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["summary"] = run_extract(config, _quiet())
        except BaseException as error:  # surfaced by the assertion below
            outcome["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    commits = output / "commits"
    deadline = time.monotonic() + 240
    while not (commits.is_dir() and any(commits.glob("shard-*.json"))):
        assert thread.is_alive(), outcome
        assert time.monotonic() < deadline, "no shard committed in time"
        time.sleep(0.05)
    kill()
    committed_at_kill = len(list(commits.glob("shard-*.json")))
    thread.join(timeout=300)
    assert not thread.is_alive() and "error" not in outcome, outcome
    assert committed_at_kill < outcome["summary"]["planned_shards"], "the kill did not land mid-run"
    assert outcome["summary"]["committed_shards"] == outcome["summary"]["planned_shards"]
    _assert_cache_matches(output, corpus_dir, reference)
    return outcome["summary"]


def test_external_cluster_of_dask_cli_processes_survives_a_killed_worker_exactly_once(tmp_path, corpus_dir, reference):
    """The multi-node way (docs/cache-format.md): a scheduler and two workers started with the ``dask scheduler`` /
    ``dask worker`` commands a user runs on each node (each worker declaring ``--resources GPU=1``, on CPU here),
    ``extract --scheduler-address``; one worker (its nanny and worker processes, as when a node dies) is SIGKILLed
    after the first commit. The other finishes: every shard committed once, the cache equals the per-row reference."""
    dask_cli = Path(sys.executable).with_name("dask")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")]),
           "DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD": "spawn"}  # dask's default, as on a user's node  # fmt: skip
    scheduler_file = tmp_path / "scheduler.json"
    started = [subprocess.Popen([str(dask_cli), "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                                 "--scheduler-file", str(scheduler_file)], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)]  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not scheduler_file.is_file():
            assert time.monotonic() < deadline and started[0].poll() is None, "the dask scheduler did not start"
            time.sleep(0.1)
        for name in ("node-a", "node-b"):
            started.append(subprocess.Popen(
                [str(dask_cli), "worker", "--scheduler-file", str(scheduler_file), "--name", name, "--nworkers", "1",
                 "--nthreads", "1", "--resources", "GPU=1", "--memory-limit", "0", "--no-dashboard",
                 "--local-directory", str(tmp_path / name)],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
        address = json.loads(scheduler_file.read_text())["address"]
        from distributed import Client

        with Client(address) as client:
            client.wait_for_workers(2, timeout=120)
        config = ExtractConfig(corpus=str(corpus_dir), output=str(tmp_path / "cache"), scheduler_address=address,
                               shard_size=1, write_processes=0)  # fmt: skip

        def kill_node_a() -> None:
            node_a = psutil.Process(started[1].pid)
            for process in [*node_a.children(recursive=True), node_a]:
                process.kill()

        _kill_mid_extract(config, kill_node_a, corpus_dir, reference)
    finally:
        for process in started:
            for child in (psutil.Process(process.pid).children(recursive=True) if process.poll() is None else []):
                child.kill()
            process.kill()
            process.wait(timeout=30)


def _shard_specs(output: Path, corpus_dir: Path) -> list[ShardSpec]:
    """The prepared cache's shard tasks (40-token shards of the test corpus), as the extract driver plans them."""
    config = ExtractConfig(corpus=str(corpus_dir), output=str(output), target_processes=1, shard_size=40)
    _, _, shard_rows, _ = prepare_cache(config, _quiet())
    return [ShardSpec(shard_id=shard_id, row_start=start, row_stop=stop, num_tokens=0, cache_path=str(output),
                      corpus_path=str(corpus_dir)) for shard_id, (start, stop) in enumerate(shard_rows)]  # fmt: skip


@pytest.mark.parametrize("write_processes", [0, 1])
def test_a_shards_last_batch_is_finished_by_its_write_after_process_returns(tmp_path, target, corpus_dir, layer_ids,
                                                                           reference, write_processes):  # fmt: skip
    """``process`` must not wait for its shard's last batch (so the next shard's first forward is queued behind it and
    the GPU does not idle between shards): each last batch's ``finish`` is held until ``process`` has returned, and
    then runs in a writer thread; every shard still commits exactly the per-row reference, in threads or through a
    write process."""
    output = tmp_path / "cache"
    specs = _shard_specs(output, corpus_dir)
    runner = TargetRunner(target.model, layer_ids, "cpu", token_budget=64)
    iter_pending = runner.iter_pending
    returned = threading.Event()
    finished_last: list[tuple[str, bool]] = []  # (thread, whether process had returned) per last batch

    class HeldLast:  # the last PendingBatch, its finish held until process has returned
        def __init__(self, pending):
            self.last, self.num_padded_tokens, self._pending = True, pending.num_padded_tokens, pending

        def finish(self):
            had_returned = returned.wait(timeout=60)  # never set if process waited for this batch itself
            finished_last.append((threading.current_thread().name, had_returned))
            return self._pending.finish()

    def held_iter_pending(input_ids_list):
        for pending in iter_pending(input_ids_list):
            yield HeldLast(pending) if pending.last else pending

    runner.iter_pending = held_iter_pending
    extractor = ShardExtractor(runner, write_processes=write_processes, write_threads=1)
    writes = []
    try:
        for spec in specs:
            returned.clear()
            result = extractor.process(spec)
            returned.set()
            writes += result["committed"]
        writes += extractor.close()
    finally:
        returned.set()
    assert len(finished_last) == len(specs)
    assert all(name.startswith("dflash-writer") and had_returned for name, had_returned in finished_last), finished_last
    assert len(writes) == len(specs) and not [w for w in writes if "error" in w]
    _assert_cache_matches(output, corpus_dir, reference)


def test_write_processes_write_the_same_cache_from_shared_buffers(tmp_path, target, corpus_dir, layer_ids, reference):
    """``write_processes=1``: the runner's host buffers are shared memory and the shard writes run in a spawned
    process that maps them (no copy); the cache equals the per-row reference like the in-process writer's, and the
    shared buffers are freed at close."""
    from dflash.cache.process_writer import shared_location

    output = tmp_path / "cache"
    specs = _shard_specs(output, corpus_dir)
    runner = TargetRunner(target.model, layer_ids, "cpu", token_budget=64)
    extractor = ShardExtractor(runner, write_processes=1, write_threads=1)
    writes = [record for spec in specs for record in extractor.process(spec)["committed"]]
    assert runner.shared_host_buffers and runner._shared
    buffer = runner._shared[0].tensor
    assert shared_location(buffer[10:20]) == (runner._shared[0].name, 20)
    writes += extractor.close()
    assert not runner._shared  # closed with the extractor
    assert len(writes) == len(specs) and not [w for w in writes if "error" in w]
    _assert_cache_matches(output, corpus_dir, reference)


def test_packed_batches_write_the_same_cache_through_write_processes(tmp_path, target, corpus_dir, layer_ids,
                                                                     reference):
    """``packing=True`` (extract --packing): samples packed back to back without padding; the cache written from the
    packed rows' shared buffers by a write process equals the per-row reference (each row alone)."""
    output = tmp_path / "cache"
    specs = _shard_specs(output, corpus_dir)
    # SDPA's packed mask: this test is about packed rows through write processes (FlexAttention is checked in
    # tests/test_target_runner.py; its CPU compile would add ~10 s here).
    runner = TargetRunner(target.model, layer_ids, "cpu", token_budget=64, packing=True, packed_attention="sdpa")
    extractor = ShardExtractor(runner, write_processes=1, write_threads=1)
    results = [extractor.process(spec) for spec in specs]
    assert {result["batching"] for result in results} == {"packed (sdpa)"}  # the kernel each task reports
    writes = [record for result in results for record in result["committed"]]
    writes += extractor.close()
    assert len(writes) == len(specs) and not [w for w in writes if "error" in w]
    _assert_cache_matches(output, corpus_dir, reference)


def test_process_writer_refuses_hidden_states_outside_shared_memory(tmp_path):
    from dflash.cache import HiddenSample
    from dflash.cache.process_writer import ProcessShardWriter, SharedHostBuffer

    writer = ProcessShardWriter(1, write_threads=1)
    shared = SharedHostBuffer(64, pin=False)
    try:
        inside = HiddenSample(corpus_row=0, input_ids=torch.zeros(4, dtype=torch.int32),
                              loss_mask=torch.ones(4, dtype=torch.uint8), hidden=shared.tensor[:32].view(4, 8))  # fmt: skip
        outside = HiddenSample(corpus_row=1, input_ids=torch.zeros(4, dtype=torch.int32),
                               loss_mask=torch.ones(4, dtype=torch.uint8), hidden=torch.zeros(4, 8, dtype=torch.bfloat16))  # fmt: skip
        with pytest.raises(ValueError, match="shard 3, corpus row 1: hidden states are not in a SharedHostBuffer"):
            writer.submit(str(tmp_path / "none"), 3, [inside, outside])
    finally:
        writer.shutdown()
        del inside
        shared.close()


def test_write_processes_must_not_be_negative(tmp_path, corpus_dir):
    with pytest.raises(ConfigError, match="write_processes: expected >= 0"):
        ExtractConfig(corpus=str(corpus_dir), output=str(tmp_path / "cache"), write_processes=-1)


def _write_processes_in_daemon(queue) -> None:
    queue.put(default_write_processes("cuda"))


def test_default_write_processes_by_device_and_daemon_status():
    """Default: 2 write processes for a CUDA runner, threads (0) on CPU and in a daemonic process, which may not
    start children (it would fail at the first shard otherwise)."""
    import multiprocessing

    assert default_write_processes("cpu") == 0
    assert default_write_processes(torch.device("cuda", 1)) == 2
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_write_processes_in_daemon, args=(queue,), daemon=True)
    child.start()
    assert queue.get(timeout=60) == 0
    child.join(timeout=60)


def _busy_write_process_owner(queue) -> None:
    """Extract-worker stand-in: a shared host buffer and a ProcessShardWriter whose write process is busy (a 60 s
    task), then waits."""
    from dflash.cache.process_writer import ProcessShardWriter, SharedHostBuffer

    buffer = SharedHostBuffer(1024, pin=False)
    writer = ProcessShardWriter(1, write_threads=1)
    writer.warm_up()
    writer._pool.submit(time.sleep, 60)  # noqa: SLF001  a shard write that would outlive its worker
    queue.put((list(writer._pool._processes), buffer.name))  # noqa: SLF001
    time.sleep(120)


def test_write_process_ends_when_its_worker_is_killed():
    """SIGKILL of the process owning the write processes (an extract worker) ends a write process at once even
    mid-write, so it cannot go on writing a shard that the rerun on another worker is rewriting (exactly once);
    on its way out it removes the dead worker's shared host buffers from /dev/shm."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    owner = context.Process(target=_busy_write_process_owner, args=(queue,))
    owner.start()
    try:
        (write_pid,), segment = queue.get(timeout=120)
        assert psutil.pid_exists(write_pid) and os.path.exists(f"/dev/shm/{segment}")
        os.kill(owner.pid, signal.SIGKILL)
        owner.join(timeout=30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if psutil.Process(write_pid).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.1)
        else:
            psutil.Process(write_pid).kill()
            pytest.fail(f"write process {write_pid} still running 20 s after its worker was killed")
        assert not os.path.exists(f"/dev/shm/{segment}")
    finally:
        if owner.is_alive():
            owner.kill()


def test_full_shared_memory_falls_back_to_private_buffers_and_thread_writes(tmp_path, target, corpus_dir, layer_ids,
                                                                             reference, monkeypatch):
    """A /dev/shm too small for a host buffer (a container's default is 64 MB): the buffer's pages cannot be
    reserved, SharedHostBuffer raises SharedMemoryFull naming the fix and leaves no segment behind; an extractor
    with write processes then uses private buffers and writes those shards in threads: same, complete cache."""
    import errno

    from dflash.cache.process_writer import SharedHostBuffer, SharedMemoryFull
    from dflash.io.shm import list_segments, segment_owner

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def mine() -> set[str]:  # this process's segments (other runs on the machine make and remove their own)
        return {name for name in list_segments() if segment_owner(name) == os.getpid()}

    before = mine()
    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(SharedMemoryFull, match="--shm-size.*--write-processes 0"):
        SharedHostBuffer(1 << 20, pin=False)
    assert mine() == before

    output = tmp_path / "cache"
    specs = _shard_specs(output, corpus_dir)
    runner = TargetRunner(target.model, layer_ids, "cpu", token_budget=64)
    extractor = ShardExtractor(runner, write_processes=1, write_threads=1)
    writes = [record for spec in specs for record in extractor.process(spec)["committed"]]
    writes += extractor.close()
    assert not runner.shared_host_buffers and not runner._shared
    assert len(writes) == len(specs) and not [w for w in writes if "error" in w]
    _assert_cache_matches(output, corpus_dir, reference)


def test_dead_write_process_does_not_fail_later_shards(tmp_path, target, corpus_dir, layer_ids, reference):
    """A write process dies (OOM killer): the broken pool's next shard is written in a thread, the pool is
    restarted for the shards after it, and the finished cache is complete and equal to the per-row reference."""
    output = tmp_path / "cache"
    specs = _shard_specs(output, corpus_dir)
    assert len(specs) >= 3
    runner = TargetRunner(target.model, layer_ids, "cpu", token_budget=64)
    extractor = ShardExtractor(runner, write_processes=1, write_threads=1)
    writes = []
    for spec in specs:
        if spec.shard_id == 1:
            writes += extractor.flush()
            pool = extractor._processes._pool  # noqa: SLF001
            (pid,) = list(pool._processes)  # noqa: SLF001
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while not pool._broken and time.monotonic() < deadline:  # noqa: SLF001
                time.sleep(0.05)
            assert pool._broken  # noqa: SLF001
        writes += extractor.process(spec)["committed"]
    writes += extractor.flush()  # the last batch of a shard is finished and submitted by its write job
    restarted = extractor._processes._pool  # noqa: SLF001
    writes += extractor.close()
    assert restarted is not pool
    assert sorted(w["shard"] for w in writes) == list(range(len(specs))) and not [w for w in writes if "error" in w]
    _assert_cache_matches(output, corpus_dir, reference)


def test_orphaned_segments_of_dead_workers_are_removed():
    """Segments named after a process that no longer exists are unlinked (a new write pool sweeps them at start);
    those of live processes (this one) stay."""
    from dflash.cache.process_writer import SEGMENT_PREFIX, SharedHostBuffer, remove_orphaned_segments

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = f"/dev/shm/{SEGMENT_PREFIX}{dead.pid}_test"
    mine = SharedHostBuffer(64, pin=False)
    try:
        # Made just before the sweep: any other run on the machine starting a write pool sweeps orphans too.
        Path(orphan).write_bytes(b"x" * 64)
        assert remove_orphaned_segments() >= 1
        assert not os.path.exists(orphan) and os.path.exists(f"/dev/shm/{mine.name}")
    finally:
        mine.close()
        Path(orphan).unlink(missing_ok=True)


def test_local_cluster_listens_on_localhost_only_and_prints_its_dashboard(tmp_path):
    # The default, and a bare ":0" (what distributed would bind on every interface).
    for address in (ExtractConfig.__dataclass_fields__["dashboard_address"].default, ":0"):
        config = ExtractConfig(corpus=str(tmp_path), output=str(tmp_path / "cache"), target_processes=1, write_processes=0,
                               dashboard_address=address)
        client, cluster, _ = start_cluster(config)
        try:
            listening = [c.laddr for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
            dashboard_port = cluster.scheduler.http_server.port
            assert dashboard_port in {laddr.port for laddr in listening}
            assert {laddr.ip for laddr in listening} <= {"127.0.0.1"}, listening
            assert client.dashboard_link.startswith(f"http://127.0.0.1:{dashboard_port}/")
        finally:
            client.close()
            cluster.close()


def test_default_dashboard_takes_a_free_port_without_a_warning_when_8787_is_busy(tmp_path):
    import socket
    import warnings

    busy = socket.socket()
    try:
        busy.bind(("127.0.0.1", 8787))  # already taken by someone else is just as good
        busy.listen()
    except OSError:
        pass
    config = ExtractConfig(corpus=str(tmp_path), output=str(tmp_path / "cache"), target_processes=1, write_processes=0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            client, cluster, _ = start_cluster(config)
        try:
            assert cluster.scheduler.http_server.port != 8787
            assert not [w for w in caught if "already in use" in str(w.message)], [str(w.message) for w in caught]
        finally:
            client.close()
            cluster.close()
    finally:
        busy.close()


def test_tls_options_build_a_security_for_the_scheduler_and_are_checked(tmp_path):
    files = {name: tmp_path / f"{name}.pem" for name in ("ca", "cert", "key")}
    for path in files.values():
        path.write_text("-----BEGIN CERTIFICATE-----\n")
    config = ExtractConfig(corpus="c", output="o", scheduler_address="tls://scheduler:8786", tls_ca_file=str(files["ca"]),
                           tls_cert=str(files["cert"]), tls_key=str(files["key"]))
    security = security_of(config)
    assert security.require_encryption and security.tls_ca_file == str(files["ca"])
    assert security.tls_client_cert == str(files["cert"]) and security.tls_client_key == str(files["key"])
    assert security_of(ExtractConfig(corpus="c", output="o", scheduler_address="tcp://h:8786")) is None
    with pytest.raises(ConfigError, match=r"^tls_cert: TLS needs --tls-ca-file, --tls-cert and --tls-key together"):
        ExtractConfig(corpus="c", output="o", scheduler_address="tls://h:8786", tls_ca_file=str(files["ca"]))
    with pytest.raises(ConfigError, match=r"^tls_ca_file: TLS options apply to --scheduler-address only"):
        ExtractConfig(corpus="c", output="o", target_processes=1, tls_ca_file=str(files["ca"]), tls_cert=str(files["cert"]),
                      tls_key=str(files["key"]))
    with pytest.raises(ConfigError, match=r"^tls_key: .*missing.pem is not a file"):
        ExtractConfig(corpus="c", output="o", scheduler_address="tls://h:8786", tls_ca_file=str(files["ca"]),
                      tls_cert=str(files["cert"]), tls_key=str(tmp_path / "missing.pem"))


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_local_workers_start_by_the_configured_method_with_this_process_environment(tmp_path, monkeypatch, method):
    """distributed's default (spawn) and the forkserver this suite runs with (stages.replicas.cluster.worker_process_options):
    either way a worker sees a variable set here after the fork server started (the session started it) and
    distributed's own pre-spawn settings (OMP_NUM_THREADS=1 by default), and its process started by that method."""
    import dask

    from stages.replicas.cluster import FORKSERVER_PRELOAD, worker_process_options

    monkeypatch.setenv("DFLASH_TEST_WORKER_MARKER", f"set-after-start-{method}")
    config = ExtractConfig(corpus=str(tmp_path), output=str(tmp_path / "cache"), target_processes=1, write_processes=0,
                           dashboard_address=":0")  # fmt: skip
    with dask.config.set({"distributed.worker.multiprocessing-method": method}):
        options = worker_process_options()
        client, cluster, _ = start_cluster(config)
    try:
        seen = client.run(lambda: (os.environ.get("DFLASH_TEST_WORKER_MARKER"), os.environ.get("OMP_NUM_THREADS"),
                                   psutil.Process().cmdline(), psutil.Process().parent().cmdline()))  # fmt: skip
    finally:
        client.close()
        cluster.close()
    ((marker, omp_threads, cmdline, parent_cmdline),) = seen.values()
    assert marker == f"set-after-start-{method}" and omp_threads == "1"
    if method == "spawn":
        assert options == {} and "spawn_main" in " ".join(cmdline)
    else:
        assert options["env"]["DFLASH_TEST_WORKER_MARKER"] == marker and "OMP_NUM_THREADS" not in options["env"]
        assert "forkserver" in " ".join(parent_cmdline)  # forked from the fork server
        import multiprocessing.forkserver

        assert multiprocessing.forkserver._forkserver._preload_modules == list(FORKSERVER_PRELOAD)


# ----------------------------------------------------------------------------- codec "auto"
@pytest.fixture(scope="module")
def short_corpus_dir(tmp_path_factory, tokenizer):
    """Three short rows (few forwards: this suite's CPU forwards are slow when the cores are shared)."""
    return _write_corpus(tmp_path_factory.mktemp("codec-auto") / "corpus", tokenizer, texts=TEXTS[4:7])


def _recorded_console() -> Console:
    import io

    return Console(file=io.StringIO(), width=400)


def _same_batches_bit_exact(output: Path, target, token_budget: int) -> None:
    """The cache reads back bit for bit what the runner computes for each shard, batched as the extract task
    batches it (each shard on its own, the same token budget and CPU threads as a local CPU worker)."""
    reader = CacheReader(output)
    corpus = open_corpus(reader.metadata.corpus_path)
    runner = TargetRunner(target.model, reader.metadata.target_layer_ids, "cpu", token_budget=token_budget)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, os.cpu_count() or 1))  # stages.replicas.cluster gives a lone CPU worker every core
    try:
        for shard in reader.shards:
            start, stop = reader.metadata.shard_rows[shard]
            expected = runner.run([corpus.row(row).input_ids for row in range(start, stop)])
            for sample in reader.read_shard(shard):
                assert torch.equal(sample.hidden, expected[sample.corpus_row - start]), (shard, sample.corpus_row)
    finally:
        torch.set_num_threads(threads)


def test_codec_auto_on_a_cpu_runner_is_the_default_unmeasured_and_a_resume_keeps_it(tmp_path, short_corpus_dir):
    """The default ``codec "auto"`` on CPU workers: the default codec without a calibration forward, recorded with
    its reason. A resume with ``auto`` (calibration even forced) keeps the cache's codec and measures nothing; an
    explicit other codec is refused as a config change, before any worker starts."""
    from dataclasses import replace

    from dflash.cache import DEFAULT_CODEC, codec_config
    from dflash.cache.codec_choice import CPU_RUNNER_REASON

    output = tmp_path / "cache"
    config = ExtractConfig(corpus=str(short_corpus_dir), output=str(output), target_processes=1, shard_size=12,
                           dashboard_address=":0")  # fmt: skip
    assert (config.codec, config.codec_calibration) == ("auto", "auto")  # the defaults
    console = _recorded_console()
    summary = run_extract(config, console)
    metadata = CacheReader(output).metadata
    expected = {"requested": "auto", "chosen": DEFAULT_CODEC, "reason": CPU_RUNNER_REASON}
    assert metadata.codec == codec_config(DEFAULT_CODEC) and metadata.extra["codec_choice"] == expected
    assert summary["codec"] == DEFAULT_CODEC and summary["codec_choice"] == expected
    assert f"codec auto -> {DEFAULT_CODEC} ({CPU_RUNNER_REASON})" in console.file.getvalue()
    # Not a terminal: no bar; progress lines (dflash.progress.LogProgress), the last one where it ended.
    assert re.search(rf"^extract: ([\d,]+)/\1 tokens, {COUNT} tokens/s, done in {DURATION}, (\d+)/\2 shards computed$",
                     console.file.getvalue(), re.M), console.file.getvalue()
    from tests.test_cache import _cli

    shown = _cli(["cache", "info", str(output)])
    assert shown.exit_code == 0 and "codec choice" in shown.stdout and f"auto -> {DEFAULT_CODEC}:" in shown.stdout, \
        shown.stdout  # the table (wrapped at 80 columns) shows the choice beside the codec
    planned = summary["planned_shards"]
    assert planned >= 2

    (output / "commits" / "shard-000001.json").unlink()  # an unfinished cache: one shard to redo
    console = _recorded_console()
    summary = run_extract(replace(config, codec_calibration="always"), console)
    assert (summary["skipped_committed"], summary["committed_shards"]) == (planned - 1, planned)
    assert f"keeps its codec {DEFAULT_CODEC} (no calibration); chosen when it was created: {CPU_RUNNER_REASON}" in console.file.getvalue()
    assert "hidden states produced" not in console.file.getvalue()  # nothing measured, nothing chosen again
    assert "codec auto ->" not in console.file.getvalue()
    assert CacheReader(output).metadata.extra["codec_choice"] == expected
    assert verify_cache(output, require_complete=True)["num_samples"] == 3

    (output / "commits" / "shard-000000.json").unlink()
    with pytest.raises(CacheError, match=r"its codec is 'blosc-zstd1-shuffle' but this run wants 'none'; pass --codec auto"):
        run_extract(replace(config, codec="none"), _quiet())
    assert not (output / "commits" / "shard-000000.json").exists()  # refused before anything ran


def test_codec_calibration_always_measures_on_a_cpu_worker_and_the_cache_reads_back_bit_exact(
        tmp_path, target, short_corpus_dir, monkeypatch, capsys):
    """``codec_calibration="always"`` runs the calibration on the CPU worker before the cache exists: the metadata
    records each candidate's measured rate and ratio and the choice; the cache verifies (``cache verify``) and
    reads back bit-exact."""
    from dflash.cache import codec_config
    from dflash.cache.codec_choice import (
        CODEC_CANDIDATES,
        KEEP_UP_MARGIN,
        calibration_row_count,
        describe_choice,
    )
    from tests.cli_helpers import main_in_process

    output = tmp_path / "cache"
    config = ExtractConfig(corpus=str(short_corpus_dir), output=str(output), target_processes=1, shard_size=12,
                           forward_tokens=64, codec_calibration="always", dashboard_address=":0")  # fmt: skip
    console = _recorded_console()
    summary = run_extract(config, console)
    metadata = CacheReader(output).metadata
    choice = metadata.extra["codec_choice"]
    assert choice["requested"] == "auto" and choice["chosen"] in CODEC_CANDIDATES and choice["margin"] == KEEP_UP_MARGIN
    assert metadata.codec == codec_config(choice["chosen"]) and summary["codec"] == choice["chosen"]
    ((worker, production),) = choice["production_bytes_per_s"].items()
    calibration = choice["workers"][worker]
    assert production > 0 and calibration["device"] == "cpu" and calibration["write_threads"] >= 1
    # One forward batch of the first rows of the pending shards (here every shard, and the shards are smaller
    # than a batch: the rows of several).
    lengths = open_corpus(short_corpus_dir).lengths
    assert calibration["tokens"] == lengths[: calibration_row_count(lengths, 64, packing=False)].sum() > lengths[0]
    for name in CODEC_CANDIDATES:
        figures = choice["candidates"][name]
        assert figures["encode_bytes_per_s"] > 0 and figures["ratio"] > 0 and isinstance(figures["keeps_up"], bool)
        assert figures["keeps_up"] == (figures["encode_bytes_per_s"] >= KEEP_UP_MARGIN * production)
    assert choice["candidates"]["none"]["ratio"] == pytest.approx(1.0, abs=1e-4)
    assert describe_choice(choice) in console.file.getvalue()
    code, err = main_in_process(monkeypatch, capsys, "cache", "verify", str(output))
    assert code == 0, err
    _same_batches_bit_exact(output, target, config.forward_tokens)


def test_a_chosen_codec_is_applied_to_the_new_cache_and_reads_back_bit_exact(tmp_path, target, short_corpus_dir):
    """``plan_cache`` creates nothing; ``create_cache`` with a choice that is not the default (lz4: zstd too slow)
    makes the cache with that codec and records the choice; shards written with it read back bit for bit."""
    from dflash.cache import codec_config
    from dflash.cache.codec_choice import CODEC_CANDIDATES, choose_codec
    from stages.extract.command import create_cache, plan_cache

    output = tmp_path / "cache"
    config = ExtractConfig(corpus=str(short_corpus_dir), output=str(output), target_processes=1, shard_size=1000)
    plan = plan_cache(config, _quiet())
    assert plan.cache is None and not output.exists()  # nothing is made before the codec is known
    rates = dict(zip(CODEC_CANDIDATES, (1e9, 3e9, 9e9), strict=True))
    choice = choose_codec({"w0": {"production_bytes_per_s": 2e9, "candidates": {
        name: {"encode_bytes_per_s": rate, "ratio": 1.0} for name, rate in rates.items()}}})  # fmt: skip
    assert choice["chosen"] == "blosc-lz4-shuffle"
    cache = create_cache(config, plan, choice)
    assert CacheReader(output).metadata.codec == codec_config("blosc-lz4-shuffle")
    assert CacheReader(output).metadata.extra["codec_choice"]["chosen"] == "blosc-lz4-shuffle"
    runner = TargetRunner(target.model, plan.metadata.target_layer_ids, "cpu", token_budget=64)
    extractor = ShardExtractor(runner, write_threads=1)
    start, stop = plan.shard_rows[0]
    extractor.process(ShardSpec(shard_id=0, row_start=start, row_stop=stop, num_tokens=0, cache_path=str(output),
                                corpus_path=str(short_corpus_dir)))  # fmt: skip
    assert not [w for w in extractor.close() if "error" in w]
    assert cache.committed_shards() == {0} and verify_cache(output)["corrupt_shards"] == {}
    expected = runner.run([plan.corpus.row(row).input_ids for row in range(start, stop)])
    for sample in CacheReader(output).read_shard(0):
        assert torch.equal(sample.hidden, expected[sample.corpus_row - start])


def test_final_tap_is_stored_in_fp8_read_only_when_asked_and_kept_on_resume(tmp_path, target, short_corpus_dir):
    """``final_tap``: the cache records it and stores the final normed hidden state as one more slot (fp8 with its
    own per-token scale); a reader without ``final_tap`` sees the taps alone, as for any cache; a resume without
    it is refused as a config change."""
    from dataclasses import replace

    output = tmp_path / "cache"
    config = ExtractConfig(corpus=str(short_corpus_dir), output=str(output), target_processes=1, shard_size=1000,
                           storage_dtype="fp8", final_tap=True, dashboard_address=":0")  # fmt: skip
    run_extract(config, _quiet())
    assert verify_cache(output, require_complete=True)["corrupt_shards"] == {}
    plain, with_final = CacheReader(output), CacheReader(output, final_tap=True)
    metadata = plain.metadata
    assert metadata.final_tap and metadata.stored_taps == metadata.num_taps + 1 and metadata.lossy
    width = metadata.num_taps * metadata.hidden_size
    runner = TargetRunner(target.model, metadata.target_layer_ids, "cpu", token_budget=1, final_tap=True)
    corpus = open_corpus(short_corpus_dir)
    for taps, full in zip(plain.read_shard(0), with_final.read_shard(0), strict=True):
        assert taps.hidden.shape == (len(taps), width) and full.hidden.shape == (len(taps), width + metadata.hidden_size)
        assert torch.equal(full.hidden[:, :width], taps.hidden)
        (expected,) = runner.run([corpus.row(taps.corpus_row).input_ids])
        final, reference = full.hidden[:, width:].float(), expected[:, width:].float()
        assert float((final - reference).norm() / reference.norm()) < 0.05  # fp8: 3 mantissa bits
    with pytest.raises(CacheError, match="its final_tap is True but this run wants False"):
        run_extract(replace(config, final_tap=False), _quiet())


def test_codec_settings_are_checked_and_the_codec_help_states_the_rule(tmp_path):
    import typer

    from dflash.cache.codec_choice import CODEC_CANDIDATES, KEEP_UP_MARGIN
    from stages.cli import _register_all, app

    with pytest.raises(ConfigError, match=r"codec: expected auto or one of none, .*blosc-zstd1-shuffle.*, got 'zstd-9'"):
        ExtractConfig(corpus="corpus", output=str(tmp_path / "cache"), codec="zstd-9")
    with pytest.raises(ConfigError, match=r"codec_calibration: expected one of auto\|always\|never, got 'sometimes'"):
        ExtractConfig(corpus="corpus", output=str(tmp_path / "cache"), codec_calibration="sometimes")
    _register_all()
    params = {param.name: param for param in typer.main.get_command(app).commands["extract"].params}
    help_text = params["codec"].help
    assert f">= {KEEP_UP_MARGIN:g}x" in help_text and all(name in help_text for name in CODEC_CANDIDATES)
    assert "--storage-dtype fp8" in help_text and "online" in help_text


def test_the_cache_records_the_corpus_document_keys_before_any_shard(tmp_path, tokenizer, corpus_dir):
    from dflash.cache import CacheReader

    with_documents = tmp_path / "corpus"
    with CorpusWriter(with_documents) as writer:
        for index, text in enumerate(TEXTS):
            input_ids = np.asarray(tokenizer(text)["input_ids"], dtype=np.int32)
            writer.add(input_ids, np.ones(len(input_ids), np.uint8), f"doc-{index}#0", f"file-{index // 3}")
        writer.commit({})
    config = ExtractConfig(corpus=str(with_documents), output=str(tmp_path / "cache"), shard_size=64)
    cache, corpus, shard_rows, _ = prepare_cache(config, _quiet())
    assert len(shard_rows) > 1 and not cache.committed_shards()
    keys = CacheReader(tmp_path / "cache").document_keys()
    assert keys.tolist() == corpus.document_keys.tolist() and len(set(keys.tolist())) == 3
    prepare_cache(config, _quiet())  # a rerun finds the same keys
    # A corpus without document ids: no keys stored (train splits by row, and says so).
    prepare_cache(ExtractConfig(corpus=str(corpus_dir), output=str(tmp_path / "plain")), _quiet())
    assert CacheReader(tmp_path / "plain").document_keys() is None


def test_an_output_of_other_files_is_refused_before_any_worker_loads_the_target(tmp_path, corpus_dir, target_path,
                                                                                 monkeypatch, capsys):
    """The output is checked before the cluster starts: with a target whose weights cannot load, a folder of
    other files as --output is refused by name (exit 2), no worker started, nothing written into it."""
    from tests.cli_helpers import main_in_process, unloadable_target

    broken = unloadable_target(tmp_path / "target", target_path)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    code, err = main_in_process(monkeypatch, capsys, "extract", "--corpus", str(corpus_dir), "--output",
                                str(tmp_path / "mine"), "--target", str(broken), "--target-processes", "1")
    assert code == 2 and err.count("error:") == 1 and str(tmp_path / "mine") in err, err
    assert "target loaded" not in err and "dashboard" not in err.lower()
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


def test_closing_the_cluster_after_a_run_prints_no_kill_warning(tmp_path, caplog):
    """A worker that takes longer than the nanny's 4 s to stop (here its plugin's teardown) is killed at the end of
    a run without the nanny's ``Worker process still alive`` warning (stages.replicas.cluster.close_cluster)."""
    import logging

    from distributed import WorkerPlugin

    from stages.replicas.cluster import close_cluster

    class SlowToStop(WorkerPlugin):
        name = "slow-to-stop"

        def teardown(self, worker):
            time.sleep(6)

    config = ExtractConfig(corpus=str(tmp_path), output=str(tmp_path / "cache"), target_processes=1, write_processes=0)
    client, cluster, _ = start_cluster(config)
    client.register_plugin(SlowToStop())
    with caplog.at_level(logging.WARNING, logger="distributed"):
        close_cluster(client, cluster)
    assert cluster.status.name == "closed"
    assert not [r for r in caplog.records if "still alive" in r.getMessage()], caplog.text


def test_the_dropped_kill_warning_is_logged_at_debug_level_under_the_cluster_module(caplog):
    """close_cluster's filter (shared by extract, generate and online) logs the nanny's kill warning it drops at debug
    level under its own module's logger, where ``-v`` or a logging config finds it."""
    import logging

    from stages.replicas.cluster import _QuietWorkerKill

    record = logging.LogRecord("distributed.nanny", logging.WARNING, __file__, 1,
                               "Worker process still alive after 4.0 seconds, killing", (), None)
    with caplog.at_level(logging.DEBUG, logger="stages.replicas.cluster"):
        assert _QuietWorkerKill().filter(record) is False
    assert [(r.name, r.levelno) for r in caplog.records] == [("stages.replicas.cluster", logging.DEBUG)]
