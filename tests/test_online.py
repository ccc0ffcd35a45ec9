"""The online mode on the real SmolLM2 target (CPU): same batches as extract + train, exact resume, end to end.

The corpus is short stdlib snippets tokenized by the target's tokenizer, with an unsupervised "prompt" prefix.
Producers run in-process (a thread executor) where the test is about the plan or the trainer, and as Dask worker
processes (``dflash-stages online --target-processes 1``) end to end.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console

from dflash.batches.online import BatchProducer, OnlineBatches
from dflash.batches.source import StreamConfig
from dflash.batches.stream import StreamingLoader
from dflash.cache import CacheReader
from dflash.corpus.format import CorpusLengths, CorpusWriter, open_corpus
from dflash.io.shm import list_segments, segment_owner
from dflash.target.runner import TargetRunner
from tests.train_helpers import TINY_LAYER_IDS, stdlib_snippets

WIDTH_TAPS = len(TINY_LAYER_IDS)


@pytest.fixture
def own_processes():
    """The pids of this process and of every process it starts during the test (its descendants, polled every
    0.2 s until the test ends): the creators whose segments are the test's own. Other runs on the machine make
    segments, and leave those of their killed processes, at any time."""
    import os

    import psutil

    pids = {os.getpid()}
    done = threading.Event()

    def poll() -> None:
        me = psutil.Process()
        while True:
            try:
                pids.update(child.pid for child in me.children(recursive=True))
            except psutil.Error:
                pass
            if done.wait(0.2):
                return

    thread = threading.Thread(target=poll, name="own-processes", daemon=True)
    thread.start()
    yield pids
    done.set()
    thread.join()


def _leaked(before: set[str], creators: set[int]) -> set[str]:
    """Segments made since ``before`` by ``creators`` (``own_processes``: this process and the trainer processes
    or spawned ranks it started) that are still there although their creator has ended, or is this process: the
    leaks."""
    import os

    import psutil

    return {name for name in set(list_segments()) - before
            if (owner := segment_owner(name)) in creators and (owner == os.getpid() or not psutil.pid_exists(owner))}


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("online") / "corpus"
    with CorpusWriter(path) as writer:
        for index, text in enumerate(stdlib_snippets(24)):
            ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"][:96], dtype=np.int32)
            mask = np.ones(len(ids), dtype=np.uint8)
            mask[: max(1, len(ids) // 4)] = 0
            writer.add(ids, mask, f"snippet-{index}")
        writer.commit({"target_spec": "default"})
    return path


@pytest.fixture(scope="module")
def offline_cache(tmp_path_factory, corpus_dir, target_path, target):
    """``extract`` of the corpus (its prepare + shard tasks, in this process): 3 shards."""
    import os

    from stages.extract.command import ExtractConfig, prepare_cache
    from stages.extract.worker import ShardExtractor, ShardSpec

    output = tmp_path_factory.mktemp("online-offline") / "cache"
    config = ExtractConfig(corpus=str(corpus_dir), output=str(output), target=str(target_path),
                           target_layer_ids=TINY_LAYER_IDS, shard_size=600, target_processes=1, write_processes=0)
    _, corpus, shard_rows, _ = prepare_cache(config, Console(file=open(os.devnull, "w")))  # noqa: SIM115
    assert len(shard_rows) >= 3
    extractor = ShardExtractor(TargetRunner(target.model, TINY_LAYER_IDS, "cpu", token_budget=256), write_processes=0)
    for shard, (start, stop) in enumerate(shard_rows):
        extractor.process(ShardSpec(shard_id=shard, row_start=start, row_stop=stop, num_tokens=0,
                                    cache_path=str(output), corpus_path=str(corpus_dir)))
    extractor.close()
    return output


def _stream_config(split: str) -> StreamConfig:
    return StreamConfig(token_budget=192, num_buckets=2, seed=3, shuffle=split == "train", split=split,
                        validation_fraction=0.2, min_supervised_tokens=8, prefetch_batches=2)


def _collect(source, epochs: int) -> list[dict]:
    out = []
    for _ in range(epochs):
        for batch in source:
            digest = hashlib.sha256(repr(batch.corpus_rows).encode() + batch.input_ids.numpy().tobytes()
                                    + batch.loss_mask.numpy().tobytes()).hexdigest()
            out.append({"digest": digest, "rows": list(batch.corpus_rows), "bucket": batch.bucket_id,
                        "hidden": batch.hidden.clone(), "epoch": source.epoch})
    return out


@pytest.mark.parametrize("split", ["train", "validation"])
def test_online_batches_hold_the_same_samples_in_the_same_batches_as_offline(offline_cache, corpus_dir, target,
                                                                              split):
    producer = BatchProducer(TargetRunner(target.model, TINY_LAYER_IDS, "cpu", token_budget=256),
                             open_corpus(corpus_dir))
    width = WIDTH_TAPS * int(target.model.config.hidden_size)
    with ThreadPoolExecutor(1) as pool, StreamingLoader(CacheReader(offline_cache), _stream_config(split)) as offline, \
            OnlineBatches(CorpusLengths(open_corpus(corpus_dir)), _stream_config(split),
                          submit=lambda task: pool.submit(producer.produce, task), width=width, num_slots=3) as online:
        assert online.boundaries == offline.boundaries and len(online) == len(offline)
        expected, got = _collect(offline, 2), _collect(online, 2)
    producer.close()
    assert len(got) == len(expected) >= 4
    assert [b["digest"] for b in got] == [b["digest"] for b in expected]  # same samples, tokens, masks, order
    assert [b["bucket"] for b in got] == [b["bucket"] for b in expected]
    if split == "train":
        assert got[0]["rows"] != got[len(got) // 2]["rows"]  # the second epoch reshuffled (like offline)
    for online_batch, offline_batch in zip(got, expected, strict=True):
        assert online_batch["hidden"].dtype == torch.bfloat16
        torch.testing.assert_close(online_batch["hidden"].float(), offline_batch["hidden"].float(), rtol=1.6e-2,
                                   atol=2e-2)  # fmt: skip


def test_a_producer_running_several_tasks_at_once_delivers_the_same_bytes(corpus_dir, target):
    """Tasks overlap on one producer (as a Dask worker runs them once each has queued its forwards): the trainer
    gets the same batches with bit-identical hidden states as from one task at a time, each batch computed once."""
    from dflash.batches.online import BatchTask

    producer = BatchProducer(TargetRunner(target.model, TINY_LAYER_IDS, "cpu", token_budget=64),
                             open_corpus(corpus_dir))
    width = WIDTH_TAPS * int(target.model.config.hidden_size)
    state = {"running": 0, "most": 0, "batches": [], "run": 0}
    lock = threading.Lock()

    def produce(task: BatchTask) -> dict:
        with lock:
            state["running"] += 1
            state["most"] = max(state["most"], state["running"])
            state["batches"].append((state["run"], task.epoch, task.batch_index))
        try:
            return producer.produce(task)
        finally:
            with lock:
                state["running"] -= 1

    runs = []
    for run, threads in enumerate((1, 3)):
        state["run"] = run
        with ThreadPoolExecutor(threads) as pool, \
                OnlineBatches(CorpusLengths(open_corpus(corpus_dir)), _stream_config("train"), width=width,
                              submit=lambda task, pool=pool: pool.submit(produce, task), num_slots=4) as online:
            runs.append(_collect(online, 1))
    producer.close()
    assert state["most"] >= 2  # the second run did overlap its tasks
    assert len(runs[0]) == len(runs[1]) >= 4
    assert [b["digest"] for b in runs[1]] == [b["digest"] for b in runs[0]]
    assert all(torch.equal(a["hidden"], b["hidden"]) for a, b in zip(runs[0], runs[1], strict=True))
    assert len(set(state["batches"])) == len(state["batches"])  # no batch computed twice (read-ahead included)
    assert {(run, 0, b) for run in (0, 1) for b in range(len(runs[0]))} <= set(state["batches"])


def _batch_fields(batch) -> dict:
    """Every tensor of a packed batch (copied), its corpus rows and bucket: what a bit-exact comparison compares."""
    from dflash.batches.packed import PackedBatch

    return {name: getattr(batch, name).clone() for name in PackedBatch._TENSOR_FIELDS} | {
        "corpus_rows": list(batch.corpus_rows), "bucket": batch.bucket_id, "real": batch.num_real_tokens}


def _assert_same_batches(got: list[dict], expected: list[dict]) -> None:
    assert len(got) == len(expected)
    for index, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        assert mine.keys() == theirs.keys()
        for key, value in theirs.items():
            same = torch.equal(mine[key], value) if isinstance(value, torch.Tensor) else mine[key] == value
            assert same, f"batch {index}: {key} differs"


def test_read_ahead_yields_the_serial_batches_bit_for_bit_and_a_consumer_stopped_mid_epoch_resumes_to_them(
        corpus_dir, target, own_processes):
    """The same producer and plan through a ring of 3 slots, read on the consumer's thread (``read_ahead=0``) and
    on the background reader (2 batches ahead): the same packed batches, every tensor bit for bit, in the same
    order over two epochs, each batch computed once. A consumer that goes away mid-epoch with reads in flight gives
    every slot back, and a new source resumed from its cursor yields exactly the remaining batches."""
    from concurrent.futures import wait

    producer = BatchProducer(TargetRunner(target.model, TINY_LAYER_IDS, "cpu", token_budget=256),
                             open_corpus(corpus_dir))
    width = WIDTH_TAPS * int(target.model.config.hidden_size)
    tasks: list[tuple[str, int, int]] = []
    futures: list = []
    before = set(list_segments())

    def source(pool: ThreadPoolExecutor, read_ahead: int) -> OnlineBatches:
        def submit(task):
            tasks.append((task.ring_name, task.epoch, task.batch_index))
            futures.append(pool.submit(producer.produce, task))
            return futures[-1]

        return OnlineBatches(CorpusLengths(open_corpus(corpus_dir)), _stream_config("train"), width=width,
                             submit=submit, num_slots=3, read_ahead=read_ahead)  # fmt: skip

    def epochs(online: OnlineBatches, count: int) -> list[dict]:
        out = []
        for _ in range(count):
            for batch in online:
                out.append(_batch_fields(batch))
        return out

    with ThreadPoolExecutor(2) as pool:
        with source(pool, 0) as serial:
            expected = epochs(serial, 2)
        with source(pool, 2) as ahead:
            assert ahead.read_ahead == 2
            got = epochs(ahead, 2)
            readers = [thread.name for thread in threading.enumerate() if thread.name.startswith("dflash-online-read")]
            ahead_ring = ahead.ring.name
        _assert_same_batches(got, expected)
        assert readers  # the reads ran on the background thread
        per_ring = [task for task in tasks if task[0] == ahead_ring]
        assert len(set(per_ring)) == len(per_ring) >= len(expected)  # read-ahead included: each batch once

        per_epoch = len(expected) // 2
        assert per_epoch >= 6 and expected[0]["corpus_rows"] != expected[per_epoch]["corpus_rows"]
        stop_at = per_epoch // 2
        with source(pool, 2) as first:
            batches = iter(first)
            head = [_batch_fields(next(batches)) for _ in range(stop_at)]
            state = first.state_dict()
            batches.close()  # the consumer goes away; producers and reads of the batches after it were in flight
            wait(futures)
            assert first.ring.num_free == 3  # every slot came back, none twice (release asserts that)
        assert state["epoch"] == 0 and state["step_in_epoch"] == stop_at
        with source(pool, 2) as resumed:
            resumed.load_state_dict(state)
            rest = epochs(resumed, 2)
    producer.close()
    _assert_same_batches(head + rest, expected)
    assert not _leaked(before, own_processes)


def _online_config(corpus_dir, target_path, output, ring_slots=3, **train_overrides):
    """An online run's config on the test corpus; 3 ring slots: one planned batch per producer task (a group holds
    at most half the slots)."""
    from pipelines.online import ONLINE_CACHE_PREFIX, OnlineConfig
    from tests.train_helpers import tiny_config

    train = tiny_config(Path(f"{ONLINE_CACHE_PREFIX}{corpus_dir}"), output, **train_overrides)
    train.cache = f"{ONLINE_CACHE_PREFIX}{corpus_dir}"
    return OnlineConfig(corpus=str(corpus_dir), train=train, target=str(target_path), target_layer_ids=TINY_LAYER_IDS,
                        ring_slots=ring_slots)


def _train_online_in_process(config, target, tasks: list | None = None) -> dict:
    """``run_online`` with the producer in a thread of this process instead of a Dask worker; the tasks submitted
    are appended to ``tasks``."""
    from pipelines.online import online_training_data
    from stages.train.loop import Trainer

    producer = BatchProducer(TargetRunner(target.model, TINY_LAYER_IDS, "cpu", token_budget=256),
                             open_corpus(config.corpus))
    with ThreadPoolExecutor(1) as pool:
        def submit(task):
            if tasks is not None:
                tasks.append(task)
            return pool.submit(producer.produce, task)

        data = online_training_data(config, submit=submit, device=torch.device("cpu"))
        trainer = Trainer(config.train, device=torch.device("cpu"), data=data)
        try:
            return trainer.fit()
        finally:
            trainer.close()
            producer.close()


def test_producer_packing_packs_the_producers_forwards_and_delivers_the_padded_batches(corpus_dir, target_path,
                                                                                       target, tmp_path):
    """``online --producer-packing`` (off by default, ``--set online.producer_packing=true`` too): the plugin every
    producer loads builds a packing runner, and the batches it delivers through the ring hold the padded
    producer's samples, tokens and masks in the same order, hidden states within bf16 tolerance."""
    from pipelines.online import config_from_cli, online_metadata, producer_plugin

    paths = ({"corpus": str(corpus_dir)}, {"output": str(tmp_path / "run")})
    assert config_from_cli(*paths, "online-cpu").producer_packing is False
    assert config_from_cli(*paths, "online-cpu", None, ["online.producer_packing=true"]).producer_packing is True
    config = _online_config(corpus_dir, target_path, tmp_path / "run")
    config.producer_packing = True
    plugin = producer_plugin(config, online_metadata(config)[1])
    plugin.build(target, torch.device("cpu"))
    assert plugin.producer.runner.packing and plugin.producer.runner.token_budget == 192
    padded = BatchProducer(TargetRunner(target.model, TINY_LAYER_IDS, "cpu", token_budget=192),
                           open_corpus(corpus_dir))
    width = WIDTH_TAPS * int(target.model.config.hidden_size)
    runs = []
    for producer in (padded, plugin.producer):
        with ThreadPoolExecutor(1) as pool, \
                OnlineBatches(CorpusLengths(open_corpus(corpus_dir)), _stream_config("train"), width=width,
                              submit=lambda task, pool=pool, producer=producer: pool.submit(producer.produce, task),
                              num_slots=3) as online:
            runs.append(_collect(online, 1))
        producer.close()
    assert len(runs[0]) == len(runs[1]) >= 4
    assert [b["digest"] for b in runs[1]] == [b["digest"] for b in runs[0]]
    for packed, reference in zip(runs[1], runs[0], strict=True):
        torch.testing.assert_close(packed["hidden"].float(), reference["hidden"].float(), rtol=1.6e-2, atol=2e-2)


def test_a_producer_runs_each_planned_batch_as_one_forward_by_default(corpus_dir, target_path, target, tmp_path):
    """The plugin every producer loads gets a forward budget of twice the token budget (``runner_token_budget``
    unset), so each planned batch is one target forward; at the token budget (set explicitly) some batches take two.
    Both deliver the same samples, tokens and masks, hidden states within bf16 tolerance."""
    from pipelines.online import online_metadata, producer_plugin

    config = _online_config(corpus_dir, target_path, tmp_path / "run")
    token_budget = config.train.data.token_budget
    metadata = online_metadata(config)[1]
    plugins = {}
    for budget in (None, token_budget):
        config.runner_token_budget = budget
        plugins[budget] = producer_plugin(config, metadata)
        plugins[budget].build(target, torch.device("cpu"))
    assert plugins[None].producer.runner.token_budget == 2 * token_budget
    assert plugins[token_budget].producer.runner.token_budget == token_budget
    forwards = [0]  # target forwards so far: each runs decoder layer 0 once
    hook = target.model.get_decoder().layers[0].register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    width = WIDTH_TAPS * int(target.model.config.hidden_size)
    runs, per_batch = [], []
    try:
        for plugin in plugins.values():
            counted: dict[tuple[int, int], int] = {}

            def produce(task, producer=plugin.producer, counted=counted):  # one pool thread: tasks run one by one
                before = forwards[0]
                result = producer.produce(task)
                counted[(task.epoch, task.batch_index)] = forwards[0] - before
                return result

            with ThreadPoolExecutor(1) as pool, \
                    OnlineBatches(CorpusLengths(open_corpus(corpus_dir)), _stream_config("train"), width=width,
                                  submit=lambda task, pool=pool, produce=produce: pool.submit(produce, task),
                                  num_slots=3) as online:
                assert online.config.token_budget == token_budget
                runs.append(_collect(online, 1))
            plugin.producer.close()
            per_batch.append([counted[(0, index)] for index in range(len(runs[-1]))])
    finally:
        hook.remove()
    assert len(runs[0]) == len(runs[1]) >= 4
    assert per_batch[0] == [1] * len(runs[0])
    assert sum(per_batch[1]) > len(runs[1])
    assert [b["digest"] for b in runs[0]] == [b["digest"] for b in runs[1]]
    for one_forward, reference in zip(runs[0], runs[1], strict=True):
        torch.testing.assert_close(one_forward["hidden"].float(), reference["hidden"].float(), rtol=1.6e-2, atol=2e-2)


def test_producer_groups_keep_within_their_token_budget_and_half_the_ring():
    """Consecutive planned batches join a group while its real tokens fit the budget and it holds at most half the
    ring's slots; a batch over the budget stands alone; without a budget, or with fewer than 4 slots, every batch is
    its own task."""
    from dflash.batches.online import max_group_batches, plan_groups

    tokens = [100, 100, 100, 300, 50, 50, 50, 50, 50]
    assert [max_group_batches(slots) for slots in (2, 3, 4, 8, 9)] == [1, 1, 2, 4, 4]
    assert plan_groups(tokens, 250, 4) == [0, 2, 3, 4, 8]  # 100+100 | 100 | 300 alone | 4 x 50 (the cap) | 50
    assert plan_groups(tokens, 1000, 2) == [0, 2, 4, 6, 8]
    assert plan_groups(tokens, None, 4) == plan_groups(tokens, 1000, 1) == list(range(len(tokens)))
    assert plan_groups([], 1000, 4) == []


def test_grouped_producer_tasks_run_fewer_forwards_and_fill_each_slot_as_one_task_per_batch(corpus_dir, target):
    """Producer tasks over groups of consecutive planned batches (``group_tokens``, at most half the ring's slots)
    run the rows of several planned batches through shared forwards of the same budget: fewer target forwards
    (counted on decoder layer 0, and as the batch source's stats count them) than one task per planned batch on the
    same plan, while the trainer gets the same batches in the same order over two epochs, each from its own slot,
    hidden states within bf16 tolerance. A source resumed inside a group recomputes the group's forwards (the
    batches before its cursor as lead rows) and yields the unbroken grouped run's remaining batches bit for bit."""
    from dflash.batches.online import BatchTask, GroupTask

    token_budget = _stream_config("train").token_budget
    producer = BatchProducer(TargetRunner(target.model, TINY_LAYER_IDS, "cpu", token_budget=2 * token_budget),
                             open_corpus(corpus_dir))  # the online command's default forward budget
    width = WIDTH_TAPS * int(target.model.config.hidden_size)
    forwards = [0]  # target forwards so far: each runs decoder layer 0 once
    hook = target.model.get_decoder().layers[0].register_forward_pre_hook(
        lambda *_: forwards.__setitem__(0, forwards[0] + 1))

    def produce(task, counted):  # one pool thread: tasks run one by one
        before = forwards[0]
        result = producer.produce(task)
        counted[task.epoch] = counted.get(task.epoch, 0) + forwards[0] - before
        return result

    def run(group_tokens, tasks, state=None, stop_after=None):
        counted: dict[int, int] = {}  # forwards per epoch
        with ThreadPoolExecutor(1) as pool, \
                OnlineBatches(CorpusLengths(open_corpus(corpus_dir)), _stream_config("train"), width=width,
                              submit=lambda task: tasks.append(task) or pool.submit(produce, task, counted),
                              num_slots=8, group_tokens=group_tokens) as online:  # fmt: skip
            if state is not None:
                online.load_state_dict(state)
            if stop_after is not None:
                batches = iter(online)
                head = [_batch_fields(next(batches)) for _ in range(stop_after)]
                batches.close()
                return head, online.state_dict(), online
            got = [_batch_fields(batch) for _ in range(2) for batch in online]
            stats = online.stats.producer_forwards
        consumed = counted[0] + counted[1]  # the producers ran ahead into epoch 2
        assert stats == pytest.approx(consumed)  # the batch source counts what ran for the batches it yielded
        return got, consumed, online

    try:
        single_tasks: list = []
        single, single_forwards, _ = run(None, single_tasks)
        group_tasks: list = []
        grouped, grouped_forwards, online = run(4 * token_budget, group_tasks)
        assert online.max_group_batches == 4  # half of the 8 slots
        resumed_tasks: list = []
        head, state, _ = run(4 * token_budget, [], stop_after=1)
        rest, _, _ = run(4 * token_budget, resumed_tasks, state=state)
    finally:
        hook.remove()
        producer.close()
    assert all(isinstance(task, BatchTask) for task in single_tasks)
    group_tasks = [task for task in group_tasks if task.epoch < 2]  # the producers ran ahead into epoch 2
    sizes = [len(task.batches) if isinstance(task, GroupTask) else 1 for task in group_tasks]
    assert max(sizes) > 1 and max(sizes) <= 4 and sum(sizes) == len(grouped) == len(single) >= 12
    for task in group_tasks:
        if isinstance(task, GroupTask):  # consecutive batches of one epoch, each with its own slot
            indices = [member.batch_index for member in task.batches]
            assert indices == list(range(indices[0], indices[0] + len(indices))) and not task.lead_rows
            assert len({member.slot for member in task.batches}) == len(indices)
    assert grouped_forwards < single_forwards
    _assert_same_batches([{k: v for k, v in b.items() if k != "hidden"} for b in grouped],
                         [{k: v for k, v in b.items() if k != "hidden"} for b in single])  # same batches, same order
    for mine, theirs in zip(grouped, single, strict=True):
        torch.testing.assert_close(mine["hidden"].float(), theirs["hidden"].float(), rtol=1.6e-2, atol=2e-2)
    first = resumed_tasks[0]  # the dispatcher resumed at step 1, inside the first group
    assert isinstance(first, GroupTask) and first.lead_rows == tuple(grouped[0]["corpus_rows"])
    _assert_same_batches(head + rest, grouped)


def test_a_producer_bounding_its_forwards_in_flight_delivers_the_same_bytes(corpus_dir, target):
    """``forwards_in_flight=2``: a task of several forwards finishes forward k before it queues forward k+2 (the
    runner never holds more than two unfinished), where the default queues every forward of the task first; the
    trainer gets the same batches, every tensor bit for bit (the first group of two planned batches)."""
    from dflash.errors import ConfigError

    runner = TargetRunner(target.model, TINY_LAYER_IDS, "cpu", token_budget=96)  # several forwards per task
    width = WIDTH_TAPS * int(target.model.config.hidden_size)
    launch, finish = runner._launch, runner._finish
    counts = {"unfinished": 0, "most": 0}

    def counted_launch(*args, **kwargs):
        counts["unfinished"] += 1
        counts["most"] = max(counts["most"], counts["unfinished"])
        return launch(*args, **kwargs)

    def counted_finish(flight):
        counts["unfinished"] -= 1
        return finish(flight)

    runner._launch, runner._finish = counted_launch, counted_finish
    runs, most = [], []
    for bound in (None, 2):
        producer = BatchProducer(runner, open_corpus(corpus_dir), forwards_in_flight=bound)
        counts["most"] = 0
        with ThreadPoolExecutor(1) as pool, \
                OnlineBatches(CorpusLengths(open_corpus(corpus_dir)), _stream_config("train"), width=width,
                              submit=lambda task, producer=producer: pool.submit(producer.produce, task),
                              num_slots=4, group_tokens=2 * _stream_config("train").token_budget) as online:
            batches = iter(online)
            runs.append([_batch_fields(next(batches)) for _ in range(2)])  # the first task: a group of two
            batches.close()
        producer.close()
        most.append(counts["most"])
    assert counts["unfinished"] == 0
    assert most[0] >= 3 and most[1] == 2  # the default queued 3 or more forwards of a task at once
    _assert_same_batches(runs[1], runs[0])
    with pytest.raises(ConfigError, match="forwards_in_flight must be >= 2"):
        BatchProducer(runner, open_corpus(corpus_dir), forwards_in_flight=1)


@pytest.mark.parametrize("ring_slots", [8], ids=["grouped"])  # one batch per task: the killed-producer test
def test_online_resume_reproduces_the_straight_online_run_bit_exactly(corpus_dir, target_path, target, tmp_path,
                                                                      own_processes, ring_slots):
    """Stopped at step 2 and resumed, the run equals the straight one bit for bit; with 8 slots the producers run
    groups of 4 planned batches (``producer_group_tokens``' default, half the slots), and the resume at micro-batch
    6 starts inside a group."""
    from dflash.training.checkpoint import load_checkpoint

    before = set(list_segments())
    # 12 micro-batches: crosses an epoch (9)
    common = dict(max_steps=4, grad_accum_steps=3, save_every=2, ring_slots=ring_slots)
    straight = _train_online_in_process(_online_config(corpus_dir, target_path, tmp_path / "straight", **common), target)
    first = _train_online_in_process(
        _online_config(corpus_dir, target_path, tmp_path / "resumed", stop_at_step=2, **common), target)
    assert first["step"] == 2
    tasks: list = []
    resumed = _train_online_in_process(
        _online_config(corpus_dir, target_path, tmp_path / "resumed", resume=True, **common), target, tasks)
    from dflash.batches.online import GroupTask

    if ring_slots == 8:  # the resumed dispatcher started inside the group of micro-batches 4-7
        assert isinstance(tasks[0], GroupTask) and len(tasks[0].batches) == 2 and tasks[0].lead_rows
    assert resumed["step"] == straight["step"] == 4 and resumed["data_digest"] == straight["data_digest"]
    a = load_checkpoint(tmp_path / "straight" / "checkpoints" / "step_00000004")
    b = load_checkpoint(tmp_path / "resumed" / "checkpoints" / "step_00000004")
    for name in a.model_state:
        assert torch.equal(a.model_state[name], b.model_state[name]), name
    assert a.trainer_state["data"] == b.trainer_state["data"] and a.trainer_state["data"]["epoch"] >= 1
    assert a.trainer_state["counters"] == b.trainer_state["counters"]
    assert resumed["val"]["loss"] == straight["val"]["loss"]
    run = json.loads((tmp_path / "straight" / "run.json").read_text())
    assert run["resolved"]["data_source"]["kind"] == "online"
    assert run["resolved"]["train_loader"]["queue"]["num_slots"] == ring_slots
    from dflash.training.telemetry import read_metrics

    last = read_metrics(tmp_path / "straight", kind="train")[-1]
    assert last["data_wait_total_s"] >= 0 and last["queue_full_wait_total_s"] >= 0  # both waits measured
    # Each side's capacity over the log interval (one step of 3 micro-batches): the producer's tokens per compute
    # second, the trainer's tokens per second of not waiting; the achieved rate cannot beat the trainer's.
    assert last["producer_capacity_tokens_per_s"] > 0
    assert 0 < last["achieved_tokens_per_s"] <= last["trainer_capacity_tokens_per_s"]
    assert 0 <= last["interval_data_wait_fraction"] <= 1
    assert 0 <= last["ring_ready_mean"] <= last["ring_taken_mean"] <= ring_slots + 1  # 1 batch read ahead
    assert not _leaked(before, own_processes)  # every ring removed


def _expected_rows(config, steps: int, world_size: int) -> tuple[str, int]:
    """Rank 0's data digest (the trainer chains the corpus rows of every batch it trained on) and the global token
    count of the first ``steps`` steps of the plan, ``world_size`` ranks taking disjoint batches of each step."""
    from dflash.batches.source import PlannedCursor
    from stages.train.data import stream_config

    lengths = CorpusLengths(open_corpus(config.corpus))
    cursors = [PlannedCursor(lengths, stream_config(config.train, "train", torch.device("cpu")), rank=rank,
                             world_size=world_size) for rank in range(world_size)]  # fmt: skip
    digest, tokens = "", 0
    for step in range(steps):
        rows = [int(r) for r in cursors[0].sample_row[cursors[0].planned_batch(0, step).samples]]
        digest = hashlib.sha256((digest + repr(rows)).encode()).hexdigest()
        tokens += sum(cursor.planned_batch(0, step).num_tokens for cursor in cursors)
    return digest, tokens


def test_online_trains_end_to_end_with_ddp_on_exactly_the_planned_batches(corpus_dir, target_path, target, tmp_path,
                                                                          own_processes):
    """``run_online`` with one Dask producer process and 2 drafter DDP ranks (gloo, spawned by the train stage's
    launcher; each rank connects to the producers' scheduler and hands out its own batches through its own rings):
    the ranks train on exactly the first 4 global steps of the plan, disjoint batches, validate through the queue,
    log each side's capacity, and leave no ring behind."""
    from dflash.training.telemetry import read_metrics
    from pipelines.online import run_online

    run = tmp_path / "run"
    config = _online_config(corpus_dir, target_path, run, max_steps=4, save_every=2, drafter_processes=2)
    expected_digest, expected_tokens = _expected_rows(config, 4, world_size=2)
    before = set(list_segments())
    summary = run_online(config)
    assert summary["step"] == 4 and summary["data_digest"] == expected_digest  # rank 0's batches, in plan order
    assert summary["tokens_seen"] == expected_tokens  # both ranks' batches, none twice
    assert (run / "latest").read_text().strip() == "step_00000004"
    records = read_metrics(run, kind="train")
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records[-1]["producer_capacity_tokens_per_s"] > 0
    assert read_metrics(run, kind="val")  # validation batches came through the queue too
    assert json.loads((run / "run.json").read_text())["resolved"]["train_loader"]["world_size"] == 2
    assert not _leaked(before, own_processes)  # no ring left behind by either rank


def test_online_command_refuses_bad_options_with_one_error_line(tmp_path):
    from cli_helpers import forked_cli

    # The console script in its own process, forked from one that imported torch once.
    result = forked_cli("online", "--corpus", str(tmp_path), "--output", str(tmp_path / "run"), "--target-processes",
                        "1", "--ring-slots", "1", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 2
    assert "error: online.ring_slots (--ring-slots): expected an integer >= 2" in result.stderr
    result = forked_cli("online", "--corpus", str(tmp_path), "--output", str(tmp_path / "run"),
                        "--producer-group-tokens", "-1", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "error: online.producer_group_tokens (--producer-group-tokens): expected an integer >= 0" in result.stderr


@pytest.mark.parametrize(("ring_slots", "fault", "lost"), [
    (3, "online.produce@3=kill", "batch 2 of epoch 0"),  # a task per planned batch: its 3rd is batch 2
    (4, "online.produce@2=kill", "batches 2-3 of epoch 0"),  # tasks of 2 batches: its 2nd is batches 2-3
], ids=["one-batch-per-task", "grouped"])
def test_a_producer_killed_mid_batch_stops_the_run_and_the_resume_recomputes_lost_batches(
        corpus_dir, target_path, target, tmp_path, monkeypatch, own_processes, ring_slots, fault, lost):
    """Every producer process is SIGKILLed at its Nth task, after computing it and before writing its slots (as the
    OOM killer would; Dask's nanny starts a new one, which loads the target again). ``stop``: the run stops with one
    error naming the task's batches and keeps its step-2 checkpoint. ``--resume --on-producer-death recompute`` (the
    config otherwise from run.json, as the command reads it), with producers still dying at their Nth task: the lost
    tasks (a group as a whole) are rerun on the new producers and the run ends on exactly the planned batches."""
    from dflash.errors import ProducerError
    from pipelines.online import config_from_cli, run_online

    monkeypatch.setenv("DFLASH_FAULT", fault)  # read by each new producer process at import
    run = tmp_path / "run"
    config = _online_config(corpus_dir, target_path, run, ring_slots, max_steps=5, save_every=2,
                            validation_fraction=0.0)  # fmt: skip
    config.on_producer_death = "stop"
    expected_digest, expected_tokens = _expected_rows(config, 5, world_size=1)
    before = set(list_segments())
    with pytest.raises(ProducerError, match=rf"producer lost: the process computing {lost} died "
                                            r"\(on_producer_death=stop"):
        run_online(config)
    assert (run / "latest").read_text().strip() == "step_00000002"
    assert not _leaked(before, own_processes)
    resumed = config_from_cli({"on_producer_death": "recompute"}, {"output": str(run), "resume": True})
    assert resumed.corpus == config.corpus and resumed.on_producer_death == "recompute"
    assert resumed.train.max_steps == 5 and resumed.target_layer_ids == config.target_layer_ids
    summary = run_online(resumed)  # batches 2 to 4: the first new producer dies at its Nth task, which is rerun
    assert summary["step"] == 5 and summary["data_digest"] == expected_digest
    assert summary["tokens_seen"] == expected_tokens
    assert not _leaked(before, own_processes)


def test_cache_to_writes_while_training_the_cache_extract_would_and_train_reuses_it(corpus_dir, target_path, target,
                                                                                    offline_cache, tmp_path, own_processes):
    """``online --cache-to`` over one epoch (and one full validation pass): every shard of extract's plan is
    committed from the staged batches, ``cache verify`` accepts it, it holds what ``extract`` stores for the same
    rows (tokens and masks exactly, hidden states within bf16 tolerance) and records the rows the run never
    computes (too few supervised tokens) as skipped; staging is empty after; ``train --cache`` trains on it. With 8
    ring slots the producers' tasks hold up to 4 planned batches, each staged on its own."""
    from dflash.cache import verify_cache
    from pipelines.online import run_online
    from stages.train.launch import run_training
    from tests.train_helpers import tiny_config

    cache = tmp_path / "cache"
    config = _online_config(corpus_dir, target_path, tmp_path / "run", 8, max_steps=5, grad_accum_steps=2,
                            max_validation_batches=None, min_supervised_tokens=40)  # fmt: skip
    config.cache_to, config.cache_shard_size = str(cache), 600  # the shard plan of the offline_cache fixture
    before = set(list_segments())
    summary = run_online(config)
    assert summary["cache_to"]["pending_shards"] == [] and summary["cache_to"]["committed_shards"] >= 3
    assert not _leaked(before, own_processes)
    assert not (cache / "staging").exists()  # every staged batch went into a committed shard
    assert verify_cache(cache, require_complete=True)["ok"]  # checksums, digests, every row of every range
    online, offline = CacheReader(cache), CacheReader(offline_cache)
    assert online.metadata.shard_rows == offline.metadata.shard_rows
    skipped = 0
    for shard in range(online.metadata.num_shards):
        got = {s.corpus_row: s for s in online.read_shard(shard)}
        recorded = {entry["corpus_row"] for entry in online.commit_record(shard)["skipped"]}
        for sample in offline.read_shard(shard):
            if sample.corpus_row not in got:
                skipped += 1
                assert int(sample.loss_mask.sum()) < 40 and sample.corpus_row in recorded  # excluded, and said so
                continue
            mine = got[sample.corpus_row]
            assert torch.equal(mine.input_ids, sample.input_ids) and torch.equal(mine.loss_mask, sample.loss_mask)
            torch.testing.assert_close(mine.hidden.float(), sample.hidden.float(), rtol=1.6e-2, atol=2e-2)
        assert len(got) + len(recorded) == online.metadata.shard_rows[shard][1] - online.metadata.shard_rows[shard][0]
    assert skipped > 0
    trained = run_training(tiny_config(cache, tmp_path / "offline-run", max_steps=1, min_supervised_tokens=40))
    assert trained["step"] == 1


def test_a_run_whose_producers_are_all_gone_fails_instead_of_waiting_forever(corpus_dir):
    """No Dask worker alive (every producer died and its nanny gave up): the health check names it after the grace
    period, and the trainer's wait for the next batch ends with ProducerError instead of hanging."""
    from concurrent.futures import Future

    from distributed import Client, LocalCluster

    from dflash.errors import ProducerError
    from pipelines.online import dask_health

    with LocalCluster(n_workers=0, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
        health = dask_health(client, grace=0.3)
        assert health() is None  # within the grace period
        import time

        time.sleep(0.4)
        problem = health()
    assert problem is not None and problem.startswith("no producer is alive")

    never: list[Future] = []
    with OnlineBatches(CorpusLengths(open_corpus(corpus_dir)), _stream_config("train"),
                       submit=lambda task: never.append(Future()) or never[-1], width=8, num_slots=2,
                       health_check=lambda: problem, health_interval=0.05) as source:  # fmt: skip
        with pytest.raises(ProducerError, match="no producer is alive"):
            next(iter(source))


def test_online_presets_give_each_layout_and_options_override_them(tmp_path):
    """Every shipped layout loads into a valid config (producer GPUs, drafter ranks); an option given wins over the
    preset; a preset key that is no setting is refused naming it."""
    from dflash.errors import ConfigError
    from pipelines.online import ONLINE_PRESETS, config_from_cli

    layouts = {}
    for name in ONLINE_PRESETS:
        config = config_from_cli({"corpus": str(tmp_path)}, {"output": str(tmp_path / name)}, name)
        layouts[name] = (config.target_processes, config.target_gpus, config.train.drafter_gpus, config.train.world_size)
    assert layouts == {"online-cpu": (1, None, None, 1), "online-1gpu": (None, [0], [0], 1),
                       "online-2gpu": (None, [0], [1], 1), "online-8gpu": (None, [0, 1, 2, 3, 4], [5, 6, 7], 3)}
    config = config_from_cli({"corpus": str(tmp_path), "ring_slots": 6},
                             {"output": str(tmp_path / "o"), "data.token_budget": 2048}, "online-cpu")  # fmt: skip
    assert config.ring_slots == 6 and config.train.data.token_budget == 2048 and config.train.drafter.block_size == 4
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"online": {"ring_slot": 3}}))
    with pytest.raises(ConfigError, match=r"online\.ring_slot \(preset .*bad\.json\): unknown key; did you mean "
                                          r"online\.ring_slots\?"):
        config_from_cli({"corpus": str(tmp_path)}, {"output": str(tmp_path / "b")}, str(bad))


def test_online_print_config_reads_back_with_config_and_files_sit_between_preset_and_options(tmp_path, monkeypatch,
                                                                                              capsys):
    """``--print-config`` prints the resolved config; fed back with ``--config`` (JSON, or the same as YAML) it
    resolves to the same config; precedence is preset < file < options; a typo in the file names key and file."""
    from cli_helpers import main_in_process

    from pipelines.online import config_from_cli, printable_config

    args = ["online", "--preset", "online-cpu", "--corpus", str(tmp_path / "c"), "--output", str(tmp_path / "r"),
            "--ring-slots", "5", "--lr", "3e-4", "--print-config"]
    import signal
    import sys

    from stages.cli import main

    monkeypatch.setattr(sys, "argv", ["dflash-stages", *args])
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as exited:
            main()
    finally:  # the entry point installs its own (as cli_helpers.main_in_process restores them)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert exited.value.code in (0, None)
    printed = json.loads(capsys.readouterr().out)
    assert printed["online"]["ring_slots"] == 5 and printed["train"]["optim"]["lr"] == 3e-4
    assert printed["train"]["drafter"]["block_size"] == 4  # from the preset
    (tmp_path / "cfg.json").write_text(json.dumps(printed))
    again = config_from_cli({}, {}, None, tmp_path / "cfg.json")
    assert printable_config(again) == printed
    (tmp_path / "cfg.yaml").write_text("online:\n  ring_slots: 7\ntrain:\n  optim:\n    lr: 1e-3\n  drafter:\n    block_size: 8\n")
    layered = config_from_cli({"corpus": str(tmp_path / "c")}, {"output": str(tmp_path / "r"), "drafter.block_size": 2},
                              "online-cpu", tmp_path / "cfg.yaml")  # fmt: skip
    assert (layered.ring_slots, layered.train.optim.lr, layered.train.drafter.block_size, layered.train.data.token_budget) == \
        (7, 1e-3, 2, 1024)  # file over preset, option over file, preset where neither says
    (tmp_path / "typo.yaml").write_text("train:\n  lrr: 1e-3\n")
    code, err = main_in_process(monkeypatch, capsys, "online", "--corpus", str(tmp_path / "c"), "--output",
                                str(tmp_path / "t"), "--config", str(tmp_path / "typo.yaml"))  # fmt: skip
    assert code == 2 and "train.lrr (--config " in err and "did you mean train.optim.lr?" in err
    assert not (tmp_path / "t").exists()


def test_a_damaged_staged_batch_is_dropped_not_fatal_and_a_restaged_one_commits_the_shard(offline_cache, corpus_dir,
                                                                                           tmp_path):
    """``--cache-to``'s assembler: a truncated staged batch (a full disk, a hand edit) is removed with a warning and
    its shard stays pending (no traceback at the end of a run); staged again, the shard commits with exactly the
    staged hidden states, and staging empties."""
    from dflash.cache import HiddenStateCache
    from dflash.cache.staging import ShardAssembler, stage_batch

    offline = CacheReader(offline_cache)
    cache = HiddenStateCache.create(tmp_path / "cache", offline.metadata)
    assembler = ShardAssembler(cache, open_corpus(corpus_dir), [], reason="test")
    samples = offline.read_shard(0)
    half = len(samples) // 2
    staging = tmp_path / "cache" / "staging"
    assert stage_batch(staging, "train-b0-a", [s.corpus_row for s in samples[:half]], [s.hidden for s in samples[:half]])
    assert stage_batch(staging, "train-b1-b", [s.corpus_row for s in samples[half:]], [s.hidden for s in samples[half:]])
    assert not stage_batch(staging, "train-b1-b", [s.corpus_row for s in samples[half:]], [])  # staged already
    damaged = staging / "train-b1-b" / "hidden.npy"
    damaged.write_bytes(damaged.read_bytes()[:-1000])
    assert assembler.poll() == [] and 0 in assembler.pending_shards()
    assert not (staging / "train-b1-b").exists() and len(assembler.missing_rows(0)) == len(samples) - half
    assert stage_batch(staging, "train-b1-b", [s.corpus_row for s in samples[half:]], [s.hidden for s in samples[half:]])
    assert assembler.poll() == [0]
    stored = {s.corpus_row: s for s in CacheReader(tmp_path / "cache").read_shard(0)}
    for sample in samples:
        assert torch.equal(stored[sample.corpus_row].hidden, sample.hidden)
        assert torch.equal(stored[sample.corpus_row].input_ids, sample.input_ids)
    assert not any(staging.iterdir())  # both staged batches were swept once the shard committed


def test_extract_finishing_a_cache_to_commits_what_was_staged_and_removes_staging(offline_cache, corpus_dir,
                                                                                 target_path, tmp_path):
    """``extract`` over a cache an online ``--cache-to`` run left unfinished: shards whose rows are all staged are
    committed from the staged batches (not recomputed), a shard with a row missing stays pending, and once every
    shard is committed the staging folder is gone and ``cache verify`` passes."""
    import os

    from dflash.cache import verify_cache
    from dflash.cache.staging import commit_staged_shards, stage_batch
    from stages.extract.command import ExtractConfig, prepare_cache, run_extract

    config = ExtractConfig(corpus=str(corpus_dir), output=str(tmp_path / "cache"), target=str(target_path),
                           target_layer_ids=TINY_LAYER_IDS, shard_size=600, target_processes=1, write_processes=0)
    quiet = Console(file=open(os.devnull, "w"))  # noqa: SIM115
    cache, corpus, shard_rows, _ = prepare_cache(config, quiet)
    offline = CacheReader(offline_cache)
    staging = tmp_path / "cache" / "staging"
    last = max(range(len(shard_rows)), key=lambda k: len(offline.read_shard(k)))  # one row of it left unstaged
    for shard in range(len(shard_rows)):
        samples = offline.read_shard(shard)
        kept = samples[:-1] if shard == last else samples
        assert stage_batch(staging, f"train-b{shard}-x", [s.corpus_row for s in kept], [s.hidden for s in kept])
    others = [k for k in range(len(shard_rows)) if k != last]
    assert commit_staged_shards(cache, corpus) == others
    assert cache.committed_shards() == set(others) and staging.is_dir()
    final = offline.read_shard(last)
    assert stage_batch(staging, "val-b0-y", [final[-1].corpus_row], [final[-1].hidden])
    summary = run_extract(config, quiet)  # the last shard from staging too: no worker starts
    assert summary["from_staging"] == 1 and summary["skipped_committed"] == len(others)
    assert not staging.exists()
    assert verify_cache(tmp_path / "cache", require_complete=True)["committed_shards"] == len(shard_rows)
    for shard in range(len(shard_rows)):
        stored = {s.corpus_row: s for s in CacheReader(tmp_path / "cache").read_shard(shard)}
        for sample in offline.read_shard(shard):
            assert torch.equal(stored[sample.corpus_row].hidden, sample.hidden)


def test_online_refuses_up_front_what_would_fail_after_the_producers_loaded(tmp_path, monkeypatch, capsys, corpus_dir):
    """Checked before any producer starts or anything is created: a resume into a folder that is no run (a cache,
    the user's files), --cache-to inside the run folder, GPUs on a host without CUDA; an option given replaces what
    it contradicts in the preset."""
    from cli_helpers import main_in_process

    from pipelines.online import config_from_cli

    foreign = tmp_path / "not-a-run"
    foreign.mkdir()
    (foreign / "zarr.json").write_text("{}")
    code, err = main_in_process(monkeypatch, capsys, "online", "--preset", "online-cpu", "--corpus", str(corpus_dir),
                                "--output", str(foreign), "--resume")  # fmt: skip
    assert code == 2 and "holds files that are not a dflash run" in err and err.count("error:") == 1
    assert sorted(p.name for p in foreign.iterdir()) == ["zarr.json"]
    code, err = main_in_process(monkeypatch, capsys, "online", "--preset", "online-cpu", "--corpus", str(corpus_dir),
                                "--output", str(tmp_path / "r"), "--cache-to", str(tmp_path / "r" / "cache"))
    assert code == 2 and "overlap" in err and not (tmp_path / "r").exists()
    if not torch.cuda.is_available():
        code, err = main_in_process(monkeypatch, capsys, "online", "--preset", "online-cpu", "--corpus",
                                    str(corpus_dir), "--output", str(tmp_path / "g"), "--target-gpus", "0")
        assert code == 2 and "CUDA is not available" in err and not (tmp_path / "g").exists()
    config = config_from_cli({"corpus": "c", "target_gpus": [0]}, {"output": "o", "drafter_gpus": [1]}, "online-cpu")
    assert (config.target_processes, config.target_gpus, config.train.drafter_gpus, config.train.device) == (None, [0], [1],
                                                                                                      "auto")
    assert Path(config.corpus).is_absolute()  # saved in run.json: a resume from another folder finds it
    code, err = main_in_process(monkeypatch, capsys, "online", "--preset", "online-cpu", "--corpus", str(corpus_dir),
                                "--output", str(tmp_path / "d"), "--set", "train.drafter.distill=kl")
    assert code == 2 and err.count("error:") == 1 and "online mode trains on the CE alone" in err
    assert not (tmp_path / "d").exists()


def test_online_refuses_a_folder_of_other_files_before_the_target_loads(tmp_path, monkeypatch, capsys, corpus_dir,
                                                                        target_path):
    """With a target whose weights cannot load, a folder of the user's files as --output is refused by name (exit
    2): the check ran before any producer loaded the target."""
    from cli_helpers import main_in_process, unloadable_target

    broken = unloadable_target(tmp_path / "target", target_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    code, err = main_in_process(monkeypatch, capsys, "online", "--preset", "online-cpu", "--corpus", str(corpus_dir),
                                "--target", str(broken), "--output", str(mine))
    assert code == 2 and err.count("error:") == 1 and str(mine) in err and "safetensors" not in err, err
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


def test_online_set_overrides_both_sections_over_options_and_names_bad_ones(tmp_path):
    from dflash.errors import ConfigError
    from pipelines.online import config_from_cli

    paths = ({"corpus": str(tmp_path / "c"), "ring_slots": 5}, {"output": str(tmp_path / "r"), "optim.lr": 1e-3})
    config = config_from_cli(*paths, "online-cpu", None, ["online.ring_slots=9", "train.optim.lr=0.002", "train.drafter.block_size=8"])
    assert (config.ring_slots, config.train.optim.lr, config.train.drafter.block_size) == (9, 0.002, 8)
    for item, needle in (("online.ring_slotz=9", "did you mean online.ring_slots?"),
                         ("lr=9", "expected online.FIELD=VALUE or train.FIELD=VALUE"),
                         ("train.optim.lr=fast", "train.optim.lr (--set train.optim.lr=fast): expected float")):  # fmt: skip
        with pytest.raises(ConfigError, match=re.escape(needle)):
            config_from_cli(*paths, "online-cpu", None, [item])


def test_a_user_error_inside_a_producer_task_is_one_error_line_and_the_checkpoint_stays(corpus_dir, target_path,
                                                                                        tmp_path):
    """A full disk raised inside a producer's Dask task (its 3rd, after computing batch 2) reaches the user as that
    error's one line, exit 2, without the worker's "Compute Failed" log and its traceback; the run keeps the
    checkpoint it saved before (step 2)."""
    import os

    from cli_helpers import forked_cli

    from dflash import faults

    run = tmp_path / "run"
    result = forked_cli(
        "online", "--corpus", str(corpus_dir), "--output", str(run), "--target", str(target_path),
        "--target-layer-ids", ",".join(map(str, TINY_LAYER_IDS)), "--target-processes", "1", "--ring-slots", "3",
        "--num-draft-layers", "1", "--block-size", "4", "--max-anchors-per-document", "2", "--token-budget", "192",
        "--num-buckets", "2", "--validation-fraction", "0", "--max-steps", "5", "--save-every", "2", "--device", "cpu",
        "--no-progress", "--set", "train.min_train_samples=1", cwd=tmp_path, timeout=300,
        env={**os.environ, faults.ENV: "online.produce@3=enospc", "COLUMNS": "400"})  # fmt: skip
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: No space left on device (ENOSPC)"), result.stderr
    assert "Traceback" not in result.stderr and "Compute Failed" not in result.stderr, result.stderr
    assert (run / "latest").read_text().strip() == "step_00000002"
