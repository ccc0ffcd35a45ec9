"""Online mode throughput: achieved training rate against the producer-alone rate I and the trainer-alone rate T.

Four measurements in one run, on the same corpus, plan and drafter config (the real target, default SmolLM2):

* extract: extract's forward loop on the same target and corpus (``TargetRunner.iter_batches`` shard by shard with
  extract's default shard size and the same forward budget, the taps copied to host, as the extract task runs it;
  its cache writes run in other processes there and are left out): the target's rate the producers aim at (the aim:
  producer alone >= 0.9x this).
* I, producer alone: the online batch source (a :class:`dflash.batches.online.BatchProducer` run by as many threads
  as the ring has slots, as a Dask worker runs its tasks, one queuing its forwards at a time; the ring, checks and
  packing) iterated without training: real tokens per second the target side can supply. The ring has the
  ``online`` command's default 8 slots here (producer tasks of up to 4 planned batches), and the rate is timed
  from the 9th batch on (after the read-ahead), over ``--steps`` batches but at least 25, both ends at the last
  batch of a task. Its phases, in milliseconds per batch over the same batches (one line
  per repeat, ``phases_ms_per_batch`` in the JSON; wall-clock timers around the calls): the producer's
  ``forwards`` (queuing them), ``copies`` (waiting until its device-to-host copies landed in the slot: on CUDA the
  forwards' device time too) and ``commit`` (CRC-32C and header), which overlap between the producer's tasks; the
  reader's ``slot_wait`` (for the next batch's producer), ``read`` (copy out of the slot and CRC-32C) and ``pack``
  (into the training batch), on the batch source's background reader, one batch after another; and the
  consumer's ``consumer_wait`` (for the reader: what a trainer would wait). On CUDA a second, synchronized pass
  (each forward waits for the device, so ``forwards`` is their device time and ``copies`` the copies alone; the
  producers' overlap is lost) gives the ``synchronized`` phases; it is not timed for I.
* T, trainer alone: the training loop (``stages.train.loop.Trainer``) on the online batch source whose producer
  REPLAYS hidden states computed beforehand (a memcpy into the slot): tokens per second the drafter side can take.
* achieved: the same training loop fed by the real producer through the ring.

Rates are real (unpadded) tokens per second; the trainer's figures are its throughput window (``real_tokens_per_s``
of the last logged step over the whole run but its first step: setup excluded; a 2-slot ring and the batch
source's one batch of read-ahead, so read-ahead does not flatter a short run). Printed against ``min(I, T)`` (separate devices) and ``1/(1/I + 1/T)``
(one device shared by producer and trainer, e.g. a CPU host or a single GPU: the issue's target is achieved >=
0.9 x that). With ``--repeats N`` the three are measured N times, interleaved, and the medians are reported (the
ratios are of medians). Producers run as threads of this process here (on one GPU: the target and the drafter
share it); the multi-GPU layouts go through ``dflash-stages online --target-gpus ... --drafter-gpus ...``, whose
metrics JSONL logs the same three figures per interval (``producer_capacity_tokens_per_s``,
``trainer_capacity_tokens_per_s``, ``achieved_tokens_per_s``: ``dflash.training.telemetry.FeedMeter``).

Targets: ``default`` (SmolLM2-135M-Instruct, stdlib snippets), or random weights with a real shape and random
token ids of 256-2048 tokens (the forward cost does not depend on them; the trainer reads the embedding and LM
head from a folder written beside the corpus): ``smollm2-random`` (SmolLM2's: no GGUF needed) or
``qwen3-8b-random`` (Qwen3-8B's). On CUDA the drafter is the paper's (5 layers,
block 16, 512 anchors per document, 16,384-token batches) unless options say otherwise.

CPU smoke run (tens of seconds)::

    python benchmarks/online.py --smoke
    python benchmarks/online.py --smoke --target qwen3-8b-random      # the same family, tiny

``--forward-tokens N`` sets the padded tokens per target forward of extract (default: the training token budget,
extract's own default 16,384 at the default budget; ``run --preset h200-smollm2`` extracts with 32768),
``--producer-forward-tokens N`` the producers' (default: what ``online`` gives them,
``OnlineConfig.producer_forward_tokens``: twice the token budget, so that a planned batch is one forward).
A producer task batches the documents of one planned batch (a length bucket's mix), or with
``producer_group_tokens`` (``--producer-group-tokens N``, default ``online``'s; 0: a task per planned batch) of a
group of consecutive planned batches (at most half the ring's slots), where extract sorts a 65,536-token shard by
length; the report prints the padding share of both one's forwards and how many forwards each runs per planned
batch or shard (``forward padding``; the producers' also as counted while they ran). ``--compare-producer-group-tokens
N`` also measures the producer alone with groups of N tokens in every repeat (0: a task per planned batch), e.g.::

    python benchmarks/online.py --device cuda --target smollm2-random --forward-tokens 32768 --repeats 3 \
        --steps 8 --compare-producer-group-tokens 0

The producer-alone runs use ``online``'s default ring slots (8: tasks of up to 4 planned batches); the trainer runs
(T, achieved) use 2 slots, hence a task per planned batch there. ``--compare-producer-forward-tokens N`` also measures the producer alone with
forwards of N padded tokens in every repeat (its own synchronized pass included on CUDA), e.g. the token budget,
the producers' forward budget before it was doubled: both shapes side by side in one run.
``--producer-packing`` runs the producers' forwards packed instead (``TargetRunner`` ``packing``, its default
kernel: varlen on CUDA), as ``online --producer-packing`` does: what packing gains there.

Where the producer's time goes beside extract's (docs/online-queue.md, "Where the grouped producer's time goes"):
on CUDA each repeat prints the caching allocator's counters over the timed batches of the producer alone and of
extract's loop (``torch.cuda.memory_stats()``: ``cudaMalloc`` and ``cudaFree`` calls, retries, waits for all
streams, peak allocated and reserved bytes; each side from an emptied cache), on CPU that they are CUDA's.
``--producer-forwards-in-flight N`` bounds every producer's forwards in flight per task
(``BatchProducer(forwards_in_flight=N)``: 2 is extract's loop), ``--compare-producer-forwards-in-flight N`` also
measures the producer alone with that bound in every repeat. ``--profile`` runs, after the repeats, one task of
the producer-alone runs alone (and again with the compared bound) and extract's loop over the same documents,
timed and under torch.profiler (``benchmarks/profiling.py``), and prints them side by side: milliseconds per
planned batch (beside the producer-alone runs' figure), kernels (on CPU operators) by time, the CUDA runtime calls
(``cudaMalloc``, ``cudaMemcpyAsync``, ``cudaStreamSynchronize``, ``cudaEventSynchronize``, ...) per side, the
``aten::`` operator calls per forward inside ``TargetRunner.forward`` and per planned batch outside it (top-level
and all, the copies, the calls that make a CUDA host wait for the device, the wall milliseconds outside the
forwards), and the operators called outside the forwards whose counts differ between the sides (the same Python
code calls the same operators on CPU and CUDA, so CPU shows what a GPU host issues). Where extract's forward budget
differs from the producers', extract's loop also runs at theirs: the task's own forwards, so that only what
surrounds them differs. Last, the task again while another thread computes the CRC-32C of its planned batches'
hidden states twice each (the commit's and the reader's, which hold the GIL piece by piece, as in the
producer-alone runs' process). ``--target-layers N`` gives a random target N layers (``--smoke --target
smollm2-random --target-layers 30 --layer-ids 1,8,14,20,27``: SmolLM2's 1,513 operators per forward at the smoke's
width, whose CPU forwards are bound by issuing them, as SmolLM2's are on an H200)::

    python benchmarks/online.py --device cuda --target smollm2-random --forward-tokens 32768 --repeats 3 \
        --steps 8 --compare-producer-forwards-in-flight 2 --profile
    python benchmarks/online.py --smoke --compare-producer-forwards-in-flight 2 --profile     # CPU: runs every path
    python benchmarks/online.py --smoke --target smollm2-random --target-layers 30 --layer-ids 1,8,14,20,27 \
        --repeats 3 --profile --compare-producer-forwards-in-flight 2    # CPU: SmolLM2's operator counts

One GPU::

    python benchmarks/online.py --device cuda --repeats 3 --json-out smollm2.json
    python benchmarks/online.py --device cuda --target qwen3-8b-random --token-budget 8192 --anchors 256 \
        --repeats 3 --steps 6      # ~6 minutes on one H200; 16,384 / 512 runs out of its memory
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from dflash.batches.online import BatchProducer, BatchTask, GroupTask
from dflash.batches.ring import Ring, RingGeometry
from dflash.corpus.format import CorpusWriter, open_corpus
from dflash.target.load import load_target
from dflash.target.runner import TargetRunner
from dflash.training.telemetry import TelemetryConfig, read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
from extract import RANDOM_TARGETS, build_target, time_runner_with_copies  # noqa: E402  (the benchmarks' shared helpers)
from extract import write_corpus as write_random_corpus  # noqa: E402
from profiling import (  # noqa: E402  (the benchmarks' shared device instrumentation)
    allocator_counters,
    allocator_line,
    allocator_window,
    marked,
    operator_counts,
    profiled,
    reset_allocator_peaks,
    start_profiler_here,
    summarize,
)

MODULES = ("textwrap", "shlex", "fnmatch", "colorsys", "bisect", "heapq", "argparse", "inspect")


def write_corpus(path: Path, tokenizer, num_rows: int, max_tokens: int) -> Path:
    """Stdlib source snippets, the first quarter of each unsupervised (a prompt)."""
    lines = [line for name in MODULES for line in inspect.getsource(importlib.import_module(name)).splitlines()
             if line.strip()]  # fmt: skip
    with CorpusWriter(path) as writer:
        for row in range(num_rows):
            text = "\n".join(lines[row * 7 : row * 7 + 4 + row % 9])
            ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens], dtype=np.int32)
            mask = np.ones(len(ids), dtype=np.uint8)
            mask[: max(1, len(ids) // 4)] = 0
            writer.add(ids, mask, f"bench-{row}")
        writer.commit({"target_spec": "default"})
    return path


class ReplayProducer(BatchProducer):
    """A producer that writes hidden states computed beforehand (trainer-alone rate)."""

    def __init__(self, runner, corpus) -> None:
        super().__init__(runner, corpus)
        self.memo: dict[tuple[int, ...], list[torch.Tensor]] = {}

    def produce(self, task: BatchTask) -> dict:
        rows = [self.corpus.row(int(r)) for r in task.corpus_rows]
        hidden = self.memo.get(task.corpus_rows)
        if hidden is None:  # copied: run() returns views of the runner's reusable host buffers
            with self._device_lock:  # tasks run in several threads; one forward on the model at a time
                hidden = [h.clone() for h in self.runner.run([row.input_ids for row in rows])]
            self.memo[task.corpus_rows] = hidden
        self._ring(task.ring_name).write_batch(
            task.slot, task.ticket, epoch=task.epoch, batch_index=task.batch_index, bucket=task.bucket,
            corpus_rows=np.asarray(task.corpus_rows), input_ids=[r.input_ids for r in rows],
            loss_mask=[r.loss_mask for r in rows], hidden=hidden,
        )  # fmt: skip
        return {"compute_seconds": 0.0}


def task_rows(task: BatchTask | GroupTask) -> list[int]:
    """The corpus rows a producer task runs through the target (a group's: its lead rows and every batch's)."""
    if isinstance(task, GroupTask):
        return [*task.lead_rows, *(row for member in task.batches for row in member.corpus_rows)]
    return list(task.corpus_rows)


def forward_padding(runner: TargetRunner, row_groups: list[list[int]], corpus,
                    per: int | None = None) -> tuple[float, float]:  # fmt: skip
    """``(padding share of the padded tokens, forwards per group)`` of ``runner``'s forwards when it runs each
    group of corpus rows on its own (a producer task, a shard for extract); ``per``: divide the forwards by this
    many instead (the planned batches of the producer's tasks)."""
    from dflash.target.runner import plan_batches, plan_packed_batches

    real = padded = forwards = 0
    for rows in row_groups:
        lengths = np.asarray([len(corpus.row(int(r)).input_ids) for r in rows])
        if runner.packing:
            plan = plan_packed_batches(lengths, runner.token_budget)
            fill = runner.packed_attention == "flex_attention"  # rows filled to the budget (one compiled shape)
            padded += sum(max(runner.token_budget, int(lengths[i].sum())) if fill else int(lengths[i].sum())
                          for i in plan)  # fmt: skip
        else:
            plan = plan_batches(lengths, runner.token_budget)
            padded += sum(len(i) * int(lengths[i].max()) for i in plan)
        real += int(lengths.sum())
        forwards += len(plan)
    return 1.0 - real / padded, forwards / (per or len(row_groups))


#: The per-batch phases of the producer-alone run (``--json-out``'s ``phases_ms_per_batch``): the producer's
#: (:meth:`BatchProducer.produce`'s ``phases``) and the consumer's (:class:`dflash.batches.online.OnlineStats`).
PHASES = ("forwards", "copies", "commit", "slot_wait", "read", "pack", "consumer_wait")


def _phase_totals(stats) -> dict[str, float]:
    """Seconds so far per phase of :data:`PHASES` (cumulative, from the batch source's stats)."""
    return {**{phase: stats.producer_phases.get(phase, 0.0) for phase in ("forwards", "copies", "commit")},
            "slot_wait": stats.slot_wait_seconds, "read": stats.read_seconds, "pack": stats.pack_seconds,
            "consumer_wait": stats.wait_seconds}


def synchronized_forwards(runner: TargetRunner) -> TargetRunner:
    """Instrumentation only: ``runner.forward`` waits for the device before it returns, so a producer's
    ``forwards`` phase holds the forwards' device time and ``copies`` only the device-to-host copies (on CUDA,
    where both are otherwise asynchronous). The producers' overlap is lost: not for the rate."""
    forward = runner.forward

    def synchronized(*args, **kwargs):
        hidden = forward(*args, **kwargs)
        torch.cuda.synchronize(runner.device)
        return hidden

    runner.forward = synchronized
    return runner


class ProducerRun(NamedTuple):
    """What :func:`producer_rate` measured."""

    rate: float
    """Real tokens/s."""
    phases: dict[str, float]
    """Milliseconds per batch of each phase (:data:`PHASES`)."""
    forwards: float
    """Target forwards per planned batch."""
    allocator: dict[str, int] | None
    """The CUDA caching allocator's counters over the timed batches (``profiling.allocator_window``); None off
    CUDA."""


def producer_rate(producer: BatchProducer, config, batches: int, device: torch.device,
                  tasks: list | None = None) -> ProducerRun:  # fmt: skip
    """The online batch source alone (producer tasks in ``ring_slots`` threads, the ring, checks and packing; no
    training): real tokens/s from batch ``ring_slots`` (the read-ahead consumed) to the last of ``batches``, each
    end moved to the last batch of a task (a group of planned batches arrives at once), the
    milliseconds per batch of each phase (:data:`PHASES`) over the same batches (wall-clock timers around the
    calls: the producers' phases overlap each other, the reader's run one batch after another), the target
    forwards per planned batch the producers ran for the batches consumed (``OnlineStats.producer_forwards``), and
    on CUDA the caching allocator's counters over the same batches, its peaks since the warm-up (the run starts
    from an emptied cache, as a producer process does). The tasks submitted are appended to ``tasks``."""
    from pipelines.online import online_training_data

    if device.type == "cuda":  # blocks cached by the earlier measurements would serve this one's allocations
        torch.cuda.empty_cache()
    producer.runner.run([producer.corpus.row(0).input_ids])  # warm-up, untimed (first forward allocates)
    reset_allocator_peaks(device)
    skip = min(config.ring_slots, batches - 2)
    submitted: list = []

    def submit(task):
        submitted.append(task)
        if tasks is not None:
            tasks.append(task)
        return pool.submit(producer.produce, task)

    with ThreadPoolExecutor(config.ring_slots) as pool:
        data = online_training_data(config, submit=submit, device=device)
        times, tokens, totals, counters = [], [], [], []
        try:
            while len(times) < batches:
                for batch in data.train:
                    times.append(time.perf_counter())
                    tokens.append(batch.num_real_tokens)
                    totals.append(_phase_totals(data.train.stats))
                    counters.append(allocator_counters(device))
                    if len(times) == batches:
                        break
            forwards = data.train.stats.producer_forwards / data.train.stats.batches
        finally:
            data.close()
    producer.close()
    # The window starts and ends at the last batch of a task: a task's batches arrive together, so a window that
    # opened inside a task would count batches whose compute it did not time.
    ends = [int(end) - 1 for end in np.cumsum([len(t.batches) if isinstance(t, GroupTask) else 1 for t in submitted])]
    start = next((end for end in ends if skip <= end < batches - 1), skip)
    stop = max((end for end in ends if start < end < batches), default=batches - 1)
    phases = {phase: 1e3 * (totals[stop][phase] - totals[start][phase]) / (stop - start) for phase in PHASES}
    return ProducerRun(sum(tokens[start + 1 : stop + 1]) / (times[stop] - times[start]), phases, forwards,
                       allocator_window(counters[start], counters[stop], device))  # fmt: skip


def phases_line(phases: dict[str, float]) -> str:
    """``forwards 1.2, copies 80.1, ... ms/batch`` (:data:`PHASES`)."""
    return ", ".join(f"{phase} {phases[phase]:.1f}" for phase in PHASES) + " ms/batch"


def extract_rate(runner: TargetRunner, corpus, device: torch.device) -> tuple[float, dict[str, int] | None]:
    """Extract's forward loop over the whole corpus (``benchmarks/extract.py``'s runner-with-copies phase: shards of
    extract's default size, each batched by the runner, taps copied to host): real tokens/s, and on CUDA the
    caching allocator's counters over the timed loop (from an emptied cache, as an extract process starts; peaks
    from the end of the warm-up). Run in a thread of its own, as the producers' tasks and extract's Dask tasks run:
    on a loaded CPU host, torch's intra-op threads started from the main thread ran the same forward several times
    slower than from another thread."""
    from dflash.target.runner import plan_batches
    from stages.extract.command import ExtractConfig, plan_shards

    rows = [corpus.row(index).input_ids for index in range(len(corpus))]
    lengths = np.asarray([len(ids) for ids in rows])
    shard_size = ExtractConfig.__dataclass_fields__["shard_size"].default
    if device.type == "cuda":  # blocks cached by the earlier measurements would serve this one's allocations
        torch.cuda.empty_cache()
    before: list = []

    def on_start() -> None:
        reset_allocator_peaks(device)
        before.append(allocator_counters(device))

    with ThreadPoolExecutor(1) as pool:
        seconds = pool.submit(time_runner_with_copies, runner, rows, plan_batches(lengths, runner.token_budget),
                              plan_shards(lengths, shard_size), device, on_start).result()  # fmt: skip
    return float(lengths.sum()) / seconds, allocator_window(before[0], allocator_counters(device), device)


def trainer_rate(config, producer: BatchProducer, device: torch.device) -> float:
    """Trains ``config`` with ``producer`` in a thread; the last logged real tokens/s."""
    from pipelines.online import online_training_data
    from stages.train.loop import Trainer

    with ThreadPoolExecutor(config.ring_slots) as pool:
        data = online_training_data(config, submit=lambda task: pool.submit(producer.produce, task),
                                    device=device)  # fmt: skip
        trainer = Trainer(config.train, device=device, data=data)
        try:
            trainer.fit()
        finally:
            trainer.close()
    rate = float(read_metrics(config.train.output, kind="train")[-1]["real_tokens_per_s"])
    shutil.rmtree(Path(config.train.output) / "checkpoints", ignore_errors=True)  # an 8B-shaped drafter's are GBs
    return rate


def producer_task_run(producer: BatchProducer, task: BatchTask | GroupTask, geometry: RingGeometry):
    """``(run, ring)``: ``run()`` computes ``task``'s planned batches through ``producer.produce`` into slots of
    ``ring`` (a ring of its own, with ``geometry``; the caller closes it), fresh slots and tickets each call, no
    staging, and returns the target forwards it ran: one producer task alone, without the run's other tasks and
    reader."""
    members = task.batches if isinstance(task, GroupTask) else (task,)
    ring = Ring.create(dataclasses.replace(geometry, num_slots=max(2, len(members))))

    def run() -> int:
        claims = [ring.acquire(timeout=0) for _ in members]
        fresh = tuple(dataclasses.replace(member, ring_name=ring.name, slot=slot, ticket=ticket, staging=None,
                                          stage_name="")
                      for member, (slot, ticket) in zip(members, claims, strict=True))  # fmt: skip
        try:
            result = producer.produce(GroupTask(batches=fresh) if isinstance(task, GroupTask) else fresh[0])
        finally:
            for slot, _ in claims:
                ring.release(slot)
        return round(result["forwards"])

    return run, ring


def extract_loop_run(runner: TargetRunner, rows: list[np.ndarray]):
    """``run()``: extract's loop (``iter_batches``, taps copied to host, buffers released) over ``rows`` as one
    shard; returns the forwards it ran."""

    def run() -> int:
        forwards = 0
        for batch in runner.iter_batches(rows):
            batch.release()
            forwards += 1
        return forwards

    return run


#: The ``record_function`` label around every ``TargetRunner.forward`` of a profiled side (:func:`timed_forwards`).
FORWARD_LABEL = "TargetRunner.forward"


def timed_forwards(runner: TargetRunner) -> list[float]:
    """Instrumentation only: ``runner.forward`` inside a ``record_function`` range (:data:`FORWARD_LABEL`, for
    ``profiling.operator_counts``) and timed; returns the list its wall seconds go into, one per call."""
    forward, spent = marked(runner.forward, FORWARD_LABEL), []

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - started)

    runner.forward = timed
    return spent


def profile_sides(sides: dict[str, tuple[Callable[[], int], TargetRunner]], device: torch.device) -> dict[str, dict]:
    """Each of ``sides`` (label: a ``run()`` returning its forwards, and the runner it calls) once to warm up (the
    allocator, the ring's page-locking and pinned buffers), once timed, then once under torch.profiler
    (``profiling.profiled``), in a thread of its own, one after another: per label the profile's summary
    (``profiling.summarize``), its ``aten::`` operator calls inside and outside the forwards
    (``profiling.operator_counts``), the wall milliseconds of the timed call (``plain_ms``) and of them outside
    ``TargetRunner.forward`` (``outside_forward_ms``: on CPU the host's own work around the forwards, on CUDA also
    its waits for the device there), of the profiled call (the profiler's overhead included), its forwards and, on
    CUDA, the caching allocator's counters over the profiled call."""
    results = {}
    start_profiler_here(device)
    with ThreadPoolExecutor(1) as pool:
        for label, (run, runner) in sides.items():
            spent = timed_forwards(runner)
            pool.submit(run).result()
            spent.clear()
            started = time.perf_counter()
            pool.submit(run).result()
            plain_ms = 1e3 * (time.perf_counter() - started)
            outside_ms = plain_ms - 1e3 * sum(spent)
            reset_allocator_peaks(device)
            before = allocator_counters(device)
            started = time.perf_counter()
            forwards, prof = pool.submit(profiled, run, device).result()
            wall_ms = 1e3 * (time.perf_counter() - started)
            results[label] = summarize(prof, on_device=device.type == "cuda", top=8) | {
                "plain_ms": plain_ms, "outside_forward_ms": outside_ms, "wall_ms": wall_ms, "forwards": forwards,
                "operators": operator_counts(prof, FORWARD_LABEL),
                "allocator": allocator_window(before, allocator_counters(device), device)}  # fmt: skip
    return results


def crc_contention(run: Callable[[], int], nbytes: int, count: int, seconds: float) -> tuple[float, list[float]]:
    """``(run()'s wall seconds, the CRCs' own seconds)`` while another thread of this process computes the ring's
    CRC-32C (``dflash.batches.ring._crc32c``, as a producer's commit and the batch source's reader do; it lets the
    GIL go while it reads) of ``nbytes`` bytes ``count`` times, spread evenly over ``seconds`` (one at the middle of
    each ``seconds / count``). Each operator ``run`` calls lets the GIL go and takes it back."""
    from dflash.batches.ring import _crc32c

    buffer = np.ones(nbytes, dtype=np.uint8)  # its pages faulted in beforehand, as a slot's are
    stop, crcs = threading.Event(), []
    period = seconds / count

    def checksums(started: float) -> None:
        for index in range(count):
            if stop.wait(max(0.0, started + (index + 0.5) * period - time.perf_counter())):
                return
            begun = time.perf_counter()
            _crc32c(buffer)
            crcs.append(time.perf_counter() - begun)

    with ThreadPoolExecutor(1) as pool:
        started = time.perf_counter()
        thread = threading.Thread(target=checksums, args=(started,), name="crc")
        thread.start()
        try:
            pool.submit(run).result()
            wall = time.perf_counter() - started
        finally:
            stop.set()
            thread.join()
    return wall, crcs


def print_profile(results: dict[str, dict], heading: str, planned: int) -> None:
    """The sides of :func:`profile_sides` in columns: wall and busy milliseconds, kernels (operator calls on
    CPU), the CUDA runtime calls counted, the ``aten::`` operator calls per forward inside ``TargetRunner.forward``
    and per planned batch (of ``planned``) outside it, the operators called outside whose counts differ between
    the sides, then each side's most expensive kernels (operators)."""
    on_device = next(iter(results.values()))["on_device"]
    width = max(16, *(len(label) + 2 for label in results))
    print(heading)
    print(f"{'':>46}" + "".join(f"{label:>{width}}" for label in results))

    def ops(r):
        return r["operators"]

    rows = [("forwards", lambda r: f"{r['forwards']}"), ("wall ms", lambda r: f"{r['plain_ms']:.1f}"),
            ("wall ms (profiled)", lambda r: f"{r['wall_ms']:.1f}"),
            ("device busy ms" if on_device else "operators' own ms", lambda r: f"{r['busy_ms']:.1f}"),
            ("kernels and copies" if on_device else "operator calls", lambda r: f"{r['calls']:,}"),
            ("aten calls per forward, top-level", lambda r: f"{sum(ops(r)['inside'].values()) / r['forwards']:,.1f}"),
            ("aten calls per forward, all", lambda r: f"{ops(r)['inside_all'] / r['forwards']:,.1f}"),
            ("host-device syncs per forward", lambda r: f"{ops(r)['syncs_inside'] / r['forwards']:.2f}"),
            ("outside the forwards, per planned batch:", lambda r: ""),
            ("aten calls, top-level", lambda r: f"{sum(ops(r)['outside'].values()) / planned:,.1f}"),
            ("aten calls, all", lambda r: f"{ops(r)['outside_all'] / planned:,.1f}"),
            ("aten::copy_ calls, top-level", lambda r: f"{ops(r)['outside'].get('aten::copy_', 0) / planned:,.2f}"),
            ("host-device syncs", lambda r: f"{ops(r)['syncs_outside'] / planned:.2f}"),
            ("wall ms outside TargetRunner.forward", lambda r: f"{r['outside_forward_ms'] / planned:.2f}")]  # fmt: skip
    if on_device:
        names = next(iter(results.values()))["runtime_calls"]  # profiling.RUNTIME_CALLS, in its order
        rows += [(name, lambda r, name=name: f"{r['runtime_calls'][name]:,}") for name in names]
        rows += [(f"allocator {key}", lambda r, key=key: f"{r['allocator'][key]:,}")
                 for key in ("num_device_alloc", "num_alloc_retries", "num_sync_all_streams")]
    for name, cell in rows:
        print(f"{name:>46}" + "".join(f"{cell(result):>{width}}" for result in results.values()))
    if not on_device:
        print(f"{'CUDA runtime calls':>46}: CUDA only (none on this device; a device-to-host copy is one more "
              "cudaMemcpyAsync per aten::copy_ there)")
    names = sorted({name for result in results.values() for name in result["operators"]["outside"]})
    differ = [(name, [result["operators"]["outside"].get(name, 0) for result in results.values()]) for name in names]
    differ = [(name, counts) for name, counts in differ if len(set(counts)) > 1]
    print("  top-level aten calls outside the forwards that differ between the sides (per task, "
          + " / ".join(results) + "): "
          + ("; ".join(f"{name} {' / '.join(map(str, counts))}" for name, counts in differ) or "none"))
    for label, result in results.items():
        print(f"  most {'device' if on_device else 'operator'} time, {label}: "
              + "; ".join(f"{name[:60]} x{count} {ms:.2f} ms" for name, count, ms in result["top"]))


def profile_one_task(tasks: list, corpus, producer: Callable[..., BatchProducer], extract_runner: TargetRunner,
                     compare_in_flight: int | None, device: torch.device, geometry: RingGeometry,
                     rate_i: float) -> dict:  # fmt: skip
    """``--profile``: one producer task of the producer-alone runs (the first with the most planned batches) alone,
    again with ``compare_in_flight`` forwards in flight when given, and extract's loop over the same documents as
    one shard (at extract's forward budget, and at the producers' where it differs: the same forwards as the
    task's, so that what differs is around them), side by side (:func:`profile_sides`, :func:`print_profile`),
    the milliseconds per planned batch of each timed call against what the producer-alone runs' rate ``rate_i``
    gives for the task's tokens, and the task again while another thread computes the CRC-32C of its slots twice
    per planned batch (the commit's and the reader's, as in the producer-alone runs' process:
    :func:`crc_contention`). Returns the figures (for the JSON)."""
    task = max((task for task in tasks if not (isinstance(task, GroupTask) and task.lead_rows)),
               key=lambda task: len(task.batches) if isinstance(task, GroupTask) else 1)  # fmt: skip
    rows = [corpus.row(int(row)).input_ids for row in task_rows(task)]
    producers = [producer()] + ([producer(in_flight=compare_in_flight)] if compare_in_flight is not None else [])
    labels = ["producer task"] + ([f"producer, {compare_in_flight} in flight"] if compare_in_flight is not None else [])
    budget = producers[0].runner.token_budget
    sides, rings = {}, []
    planned = len(task.batches) if isinstance(task, GroupTask) else 1
    tokens = sum(len(ids) for ids in rows)
    try:
        for label, made in zip(labels, producers, strict=True):
            run, ring = producer_task_run(made, task, geometry)
            sides[label], rings = (run, made.runner), [*rings, ring]
        sides["extract loop"] = (extract_loop_run(extract_runner, rows), extract_runner)
        if extract_runner.token_budget != budget:  # the task's own forwards by extract's loop (padded: not with packing)
            same = TargetRunner(extract_runner.model, extract_runner.target_layer_ids, device, token_budget=budget)
            sides[f"extract loop at {budget:,}"] = (extract_loop_run(same, rows), same)
        results = profile_sides(sides, device)
        task_run = sides["producer task"][0]
        count = 2 * planned
        contended, crcs = crc_contention(task_run, tokens * extract_runner.feature_size * 2 // planned, count,
                                         results["producer task"]["plain_ms"] / 1e3)  # fmt: skip
    finally:
        for made in producers:
            made.close()
        for ring in rings:
            ring.close()
    print_profile(results, f"profile: one producer task of the producer-alone runs ({planned} planned batches, "
                           f"{tokens:,} real tokens in {len(rows)} documents; forwards of "
                           f"{budget:,} padded tokens) and extract's loop over the same documents as one shard (forwards of "
                           f"{extract_runner.token_budget:,}); each side warmed, timed, then run under "
                           "torch.profiler, alone in a thread:", planned)  # fmt: skip
    in_runs = 1e3 * tokens / planned / rate_i
    print("  ms per planned batch, timed alone: " + ", ".join(f"{label} {result['plain_ms'] / planned:.1f}"
                                                            for label, result in results.items())
          + f"; in the producer-alone runs (I at {tokens / planned:,.0f} real tokens per planned batch): {in_runs:.1f}")
    crc_ms = 1e3 * sum(crcs) / max(1, len(crcs))
    print(f"  the producer task while another thread computes the CRC-32C of a planned batch's hidden states "
          f"({tokens * extract_runner.feature_size * 2 // planned / 2**20:,.1f} MiB, the ring's own CRC-32C, "
          f"GIL released) {len(crcs)} times ({crc_ms:.1f} ms each): {1e3 * contended / planned:.1f} ms per planned batch, "
          f"against {results['producer task']['plain_ms'] / planned:.1f} alone")  # fmt: skip
    return {"planned_batches": planned, "real_tokens": tokens, "documents": len(rows), "sides": results,
            "ms_per_planned_batch_in_runs": in_runs,
            "crc_contention": {"crcs": len(crcs), "crc_ms": crc_ms, "crc_bytes": tokens * extract_runner.feature_size * 2 // planned,
                               "ms_per_planned_batch": 1e3 * contended / planned,
                               "ms_per_planned_batch_alone": results["producer task"]["plain_ms"] / planned}}


def head_only_target(model, folder: Path) -> Path:
    """A target folder holding the random model's config and only its embedding and LM head: what the trainer
    reads of a target (``stages.train.target_weights.load_target_embeddings``); the producers use the model in memory."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    tensors = {"model.embed_tokens.weight": model.get_input_embeddings().weight.detach().cpu().contiguous()}
    if not model.config.tie_word_embeddings:
        tensors["lm_head.weight"] = model.get_output_embeddings().weight.detach().cpu().contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="default", help="default (SmolLM2), qwen3-8b-random or smollm2-random (random weights, real shapes)")
    parser.add_argument("--device", default="auto", help="cpu | cuda | auto")
    parser.add_argument("--target-layers", type=int, default=None, help="Random targets: this many decoder layers "
                        "instead of the shape's (e.g. --smoke --target smollm2-random --target-layers 30: SmolLM2's "
                        "depth, so its forward calls as many operators, at the smoke's width)")
    parser.add_argument("--layer-ids", default=None, help="Tapped layers (default: 1,3 on CPU, 5 taps by the "
                        "DFlash rule on CUDA)")
    parser.add_argument("--rows", type=int, default=96, help="CPU corpus rows (CUDA: enough tokens for the steps)")
    parser.add_argument("--token-budget", type=int, default=None, help="Real tokens per batch (CPU 512, CUDA 16384)")
    parser.add_argument("--forward-tokens", type=int, default=None, help="Padded tokens per target forward of "
                        "extract (default: the token budget)")
    parser.add_argument("--producer-forward-tokens", type=int, default=None, help="Padded tokens per target forward "
                        "of the producers (default: the online command's, twice the token budget; packed: the budget)")
    parser.add_argument("--compare-producer-forward-tokens", type=int, default=None, help="Also measure the "
                        "producer alone with this forward budget in every repeat (e.g. the token budget)")
    parser.add_argument("--producer-group-tokens", type=int, default=None, help="Real tokens per producer task "
                        "over consecutive planned batches (default: the online command's producer_group_tokens; 0: "
                        "a task per planned batch)")
    parser.add_argument("--compare-producer-group-tokens", type=int, default=None, help="Also measure the "
                        "producer alone with this group budget in every repeat (0: a task per planned batch)")
    parser.add_argument("--producer-packing", action="store_true", help="Producers run packed forwards "
                        "(TargetRunner packing, its default kernel: varlen on CUDA): no padding within a planned batch")
    parser.add_argument("--num-draft-layers", type=int, default=None, help="(CPU 1, CUDA 5)")
    parser.add_argument("--block-size", type=int, default=None, help="(CPU 4, CUDA 16)")
    parser.add_argument("--anchors", type=int, default=None, help="Anchors per document (CPU 8, CUDA 512)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=1, help="Measure I, T and achieved N times; report medians.")
    parser.add_argument("--producer-forwards-in-flight", type=int, default=None, help="At most N forwards of a "
                        "producer task queued and unfinished (BatchProducer forwards_in_flight, >= 2; default: all "
                        "of the task's forwards queued first)")
    parser.add_argument("--compare-producer-forwards-in-flight", type=int, default=None, help="Also measure the "
                        "producer alone with this bound on its forwards in flight in every repeat (e.g. 2, as "
                        "extract's loop)")
    parser.add_argument("--profile", action="store_true", help="After the repeats, profile one producer task alone "
                        "and extract's loop over the same documents (torch.profiler): kernels, runtime calls")
    parser.add_argument("--smoke", action="store_true", help="Tiny run on CPU.")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    if args.target_layers is not None and (args.target not in RANDOM_TARGETS or args.target_layers < 2):
        parser.error(f"--target-layers: a random target's (--target {' or '.join(RANDOM_TARGETS)}) layer count, at "
                     f"least 2; got {args.target_layers} for --target {args.target}")
    for bound in (args.producer_forwards_in_flight, args.compare_producer_forwards_in_flight):
        if bound is not None and bound < 2:
            parser.error(f"forwards in flight: at least 2 (a task queues its next forward before it finishes one), "
                         f"got {bound}")
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")  # fmt: skip
    if args.smoke:
        device = torch.device("cpu")
        args.rows, args.steps, args.token_budget = 64, 10, args.token_budget or 384
    gpu = device.type == "cuda"
    token_budget = args.token_budget or (16384 if gpu else 512)
    forward_tokens = args.forward_tokens or token_budget
    num_draft_layers = args.num_draft_layers or (5 if gpu else 1)
    block_size = args.block_size or (16 if gpu else 4)
    anchors = args.anchors or (512 if gpu else 8)
    from dflash.batches.source import LoaderConfig
    from dflash.drafter.config import DrafterTrainingConfig
    from dflash.target.taps import default_target_layer_ids
    from pipelines.online import ONLINE_CACHE_PREFIX, OnlineConfig
    from stages.train.config import TrainConfig

    work = Path(tempfile.mkdtemp(prefix="dflash-bench-online-"))
    tokenizer = None
    if args.target in RANDOM_TARGETS:
        model, identity = build_target(args.target, device, args.smoke, seed=0, num_layers=args.target_layers)
    else:
        loaded = load_target(args.target, device=device)
        model, identity, tokenizer = loaded.model, loaded.identity, loaded.tokenizer
    if args.target in RANDOM_TARGETS:
        target_spec = str(head_only_target(model, work / "target"))
        mask_token_id = identity.vocab_size - 1
    else:
        target_spec, mask_token_id = args.target, None
    if args.layer_ids:
        layer_ids = [int(i) for i in args.layer_ids.split(",")]
    else:
        layer_ids = default_target_layer_ids(identity.num_hidden_layers, num_draft_layers) if gpu else [1, 3]
    if args.target in RANDOM_TARGETS or gpu:  # enough rows for every step of every measurement
        write_random_corpus(work / "corpus", token_budget * (args.steps + 4) * 5 // 4, 256 if gpu else 16,
                            2048 if gpu else 64, identity.vocab_size, seed=0)  # fmt: skip
        corpus_path = work / "corpus"
    else:
        corpus_path = write_corpus(work / "corpus", tokenizer, args.rows, token_budget // 4)

    def config(name: str, ring_slots: int = 2, group_tokens: int | None = args.producer_group_tokens) -> OnlineConfig:
        train = TrainConfig(cache=f"{ONLINE_CACHE_PREFIX}{corpus_path}", output=str(work / name),
                            target=target_spec,
                            drafter=DrafterTrainingConfig(num_draft_layers=num_draft_layers, block_size=block_size,
                                                          max_anchors_per_document=anchors,
                                                          mask_token_id=mask_token_id),
                            data=LoaderConfig(token_budget=token_budget, num_buckets=2, validation_fraction=0.0),
                            max_steps=args.steps, save_every=args.steps,
                            telemetry=TelemetryConfig(log_every=1, throughput_window=args.steps + 1, progress=False),
                            device=device.type,
                            min_supervised_tokens=0)  # fmt: skip
        # Training: two slots, so read-ahead cannot cover a short run and the rate is the steady one.
        return OnlineConfig(corpus=str(corpus_path), train=train, target=target_spec, target_layer_ids=layer_ids,
                            ring_slots=ring_slots, runner_token_budget=args.producer_forward_tokens,
                            producer_packing=args.producer_packing,
                            **({} if group_tokens is None else {"producer_group_tokens": group_tokens}))  # fmt: skip

    producer_forward_tokens = config("forward-budget").producer_forward_tokens  # the online command's rule
    producer_group_tokens = config("group-budget").producer_group_tokens
    compare_tokens = args.compare_producer_forward_tokens
    compare_groups = args.compare_producer_group_tokens
    compare_in_flight = args.compare_producer_forwards_in_flight

    def runner(packing: bool = args.producer_packing, budget: int = producer_forward_tokens) -> TargetRunner:
        return TargetRunner(model, layer_ids, device, token_budget=budget, packing=packing)

    def producer(budget: int = producer_forward_tokens, in_flight: int | None = args.producer_forwards_in_flight,
                 synchronized: bool = False) -> BatchProducer:  # fmt: skip
        made = runner(budget=budget)
        return BatchProducer(synchronized_forwards(made) if synchronized else made, corpus,
                             forwards_in_flight=in_flight)  # fmt: skip

    corpus = open_corpus(corpus_path)
    replay = ReplayProducer(runner(), corpus)
    trainer_rate(config("warm-replay"), replay, device)  # fills the replay memo (and warms the trainer up)
    producer_slots = OnlineConfig.__dataclass_fields__["ring_slots"].default  # the online command's default
    producer_batches = max(args.steps, 2 * producer_slots + 9)  # 4 groups of 4 and more after the read-ahead
    extract_runner = runner(packing=False, budget=forward_tokens)  # extract's: padded, length-sorted per shard
    tasks: list = []
    runs: dict[str, list[float]] = {"producer_alone_I": [], "trainer_alone_T": [], "achieved": [], "extract": []}
    phase_runs: dict[str, list[dict[str, float]]] = {"overlapped": [], "synchronized": []}
    forwards_per_batch: dict[str, list[float]] = {"producer": []}
    allocator_runs: dict[str, list] = {"producer": [], "extract": []}  # CUDA: per repeat, over the timed batches
    # The producer-alone variants measured in every repeat: key -> (label, producer()'s options, group budget).
    variants: dict[str, tuple[str, dict, int | None]] = {}
    if compare_tokens:
        variants["compare"] = (f"at {compare_tokens:,} tokens per forward", {"budget": compare_tokens},
                               args.producer_group_tokens)  # fmt: skip
    if compare_groups is not None:
        variants["groups"] = (f"with producer_group_tokens {compare_groups:,}", {}, compare_groups)
    if compare_in_flight is not None:
        variants["in_flight"] = (f"with forwards_in_flight {compare_in_flight}", {"in_flight": compare_in_flight},
                                 args.producer_group_tokens)  # fmt: skip
    for key in variants:
        runs[f"producer_alone_I_{key}"] = []
        phase_runs |= {f"{key}_overlapped": [], f"{key}_synchronized": []}
        forwards_per_batch[f"producer_{key}"] = []
        allocator_runs[f"producer_{key}"] = []
    group_tasks: list = []

    def measure_variant(key: str, repeat: int) -> None:
        """The producer alone with another forward budget, group budget or bound on forwards in flight (``key``:
        its runs' suffix, :data:`variants`), as the default producer is measured."""
        label, options, group_tokens = variants[key]
        measured = producer_rate(producer(**options), config(f"producer-{key}-{repeat}", producer_slots, group_tokens),
                                 producer_batches, device, group_tasks if key == "groups" else None)  # fmt: skip
        runs[f"producer_alone_I_{key}"].append(measured.rate)
        phase_runs[f"{key}_overlapped"].append(measured.phases)
        forwards_per_batch[f"producer_{key}"].append(measured.forwards)
        allocator_runs[f"producer_{key}"].append(measured.allocator)
        line = (f"repeat {repeat} producer alone {label}: {measured.rate:,.0f} real tokens/s, {measured.forwards:.2f} "
                f"forwards per planned batch; phases: {phases_line(measured.phases)}")
        if gpu:
            synced = producer_rate(producer(**options, synchronized=True),
                                   config(f"producer-{key}-sync-{repeat}", producer_slots, group_tokens),
                                   producer_batches, device).phases  # fmt: skip
            phase_runs[f"{key}_synchronized"].append(synced)
            line += f"; synchronized forwards: {phases_line(synced)}"
        print(line, flush=True)

    for repeat in range(args.repeats):
        alone = producer()
        measured = producer_rate(alone, config(f"producer-{repeat}", producer_slots), producer_batches, device, tasks)
        runs["producer_alone_I"].append(measured.rate)
        forwards_per_batch["producer"].append(measured.forwards)
        phase_runs["overlapped"].append(measured.phases)
        allocator_runs["producer"].append(measured.allocator)
        runs["trainer_alone_T"].append(trainer_rate(config(f"trainer-{repeat}"), replay, device))
        runs["achieved"].append(trainer_rate(config(f"achieved-{repeat}"), producer(), device))
        rate_extract, extract_allocator = extract_rate(extract_runner, corpus, device)
        runs["extract"].append(rate_extract)
        allocator_runs["extract"].append(extract_allocator)
        print(f"repeat {repeat}: " + ", ".join(f"{key} {runs[key][-1]:,.0f}" for key in
                                               ("producer_alone_I", "trainer_alone_T", "achieved", "extract")),
              flush=True)  # fmt: skip
        line = (f"repeat {repeat} producer-alone phases (ring slots page-locked: {alone.rings_pinned}): "
                f"{phases_line(measured.phases)}")
        pinned = alone.rings_pinned
        if gpu:  # forwards' device time apart from the copies: a separate, synchronized pass (not for the rate)
            synced = producer_rate(producer(synchronized=True), config(f"producer-sync-{repeat}", producer_slots),
                                   producer_batches, device).phases  # fmt: skip
            phase_runs["synchronized"].append(synced)
            line += f"; synchronized forwards: {phases_line(synced)}"
        print(line, flush=True)
        if gpu:
            print(f"repeat {repeat} allocator over the timed batches: producer alone: "
                  f"{allocator_line(measured.allocator)}; extract's loop: {allocator_line(extract_allocator)}",
                  flush=True)  # fmt: skip
        elif repeat == 0:
            print(f"allocator counters: {allocator_line(None)}, not measured on {device}", flush=True)
        for key in variants:  # the same producer with another forward budget, group budget or bound
            measure_variant(key, repeat)
            if gpu:
                print(f"repeat {repeat} allocator over the timed batches, producer alone {variants[key][0]}: "
                      f"{allocator_line(allocator_runs[f'producer_{key}'][-1])}", flush=True)
    rate_i, rate_t, achieved, rate_extract = (statistics.median(runs[key]) for key in
                                              ("producer_alone_I", "trainer_alone_T", "achieved", "extract"))
    from stages.extract.command import ExtractConfig, plan_shards

    shards = [list(range(start, stop)) for start, stop in
              plan_shards(corpus.lengths, ExtractConfig.__dataclass_fields__["shard_size"].default)]  # fmt: skip
    def planned(tasks_: list) -> int:
        return sum(len(task.batches) if isinstance(task, GroupTask) else 1 for task in tasks_)

    task_groups = [task_rows(task) for task in tasks]
    padding = {"producer": forward_padding(runner(), task_groups, corpus, per=planned(tasks)),
               "extract": forward_padding(extract_runner, shards, corpus)}
    if compare_tokens:
        padding["producer_compare"] = forward_padding(runner(budget=compare_tokens), task_groups, corpus,
                                                      per=planned(tasks))  # fmt: skip
    if compare_groups is not None:
        padding["producer_groups"] = forward_padding(runner(), [task_rows(task) for task in group_tasks], corpus,
                                                     per=planned(group_tasks))  # fmt: skip
    shared = 1.0 / (1.0 / rate_i + 1.0 / rate_t)
    logged = read_metrics(work / f"achieved-{args.repeats - 1}", kind="train")[-1]
    report = {"ring_slots_page_locked": pinned, "producer_alone_I": rate_i, "trainer_alone_T": rate_t, "achieved": achieved,
              "min_I_T": min(rate_i, rate_t), "shared_device_bound": shared,
              "achieved_over_min": achieved / min(rate_i, rate_t), "achieved_over_shared": achieved / shared,
              "extract": rate_extract, "producer_over_extract": rate_i / rate_extract,
              "forward_tokens": forward_tokens, "producer_forward_tokens": producer_forward_tokens,
              "producer_group_tokens": producer_group_tokens,
              "producer_forwards_per_batch_counted": {key: statistics.median(values)
                                                      for key, values in forwards_per_batch.items() if values},
              "producer_ring_slots": producer_slots,
              "producer_batches": producer_batches,
              "producer_packing": args.producer_packing,
              "forward_padding_share": {key: value[0] for key, value in padding.items()},
              "forwards_per_batch_or_shard": {key: value[1] for key, value in padding.items()},
              "runs": runs, "repeats": args.repeats,
              "phases_ms_per_batch": {mode: {phase: statistics.median(run[phase] for run in runs_)
                                             for phase in PHASES}
                                      for mode, runs_ in phase_runs.items() if runs_},
              "phases_ms_per_batch_runs": {mode: runs_ for mode, runs_ in phase_runs.items() if runs_},
              "in_run_telemetry_last_interval": {key: logged.get(key) for key in (
                  "producer_capacity_tokens_per_s", "trainer_capacity_tokens_per_s", "achieved_tokens_per_s",
                  "ring_ready_mean", "ring_taken_mean")},
              "token_budget": token_budget, "steps": args.steps, "target": identity.name, "layer_ids": layer_ids,
              "num_draft_layers": num_draft_layers, "block_size": block_size, "anchors": anchors,
              "device": torch.cuda.get_device_name(device) if gpu else "cpu",
              "torch": torch.__version__, "torch_threads": torch.get_num_threads()}  # fmt: skip
    if compare_tokens:
        rate_compare = statistics.median(runs["producer_alone_I_compare"])
        report |= {"producer_compare_forward_tokens": compare_tokens, "producer_alone_I_compare": rate_compare,
                   "producer_compare_over_extract": rate_compare / rate_extract}
    if compare_groups is not None:
        rate_groups = statistics.median(runs["producer_alone_I_groups"])
        report |= {"producer_compare_group_tokens": compare_groups, "producer_alone_I_groups": rate_groups,
                   "producer_groups_over_extract": rate_groups / rate_extract}
    if compare_in_flight is not None:
        rate_in_flight = statistics.median(runs["producer_alone_I_in_flight"])
        report |= {"producer_compare_forwards_in_flight": compare_in_flight,
                   "producer_alone_I_in_flight": rate_in_flight,
                   "producer_in_flight_over_extract": rate_in_flight / rate_extract}
    report |= {"producer_forwards_in_flight": args.producer_forwards_in_flight,
               "allocator_over_timed_batches": allocator_runs if gpu else None}
    keys = ("extract", "producer_alone_I", *(("producer_alone_I_compare",) if compare_tokens else ()),
            *(("producer_alone_I_groups",) if compare_groups is not None else ()),
            *(("producer_alone_I_in_flight",) if compare_in_flight is not None else ()),
            "trainer_alone_T", "achieved", "min_I_T", "shared_device_bound")
    for key in keys:
        print(f"{key:>22}: {report[key]:10,.0f} real tokens/s   (runs: {', '.join(f'{v:,.0f}' for v in runs.get(key, []))})")
    print(f"{'I / extract':>22}: {report['producer_over_extract']:.2f}  (producer alone at {producer_forward_tokens:,} "
          f"tokens per forward, producer_group_tokens {producer_group_tokens:,}, against extract's forward loop at "
          f"{forward_tokens:,}; the aim: >= 0.9)")
    if compare_groups is not None:
        print(f"{'I_groups / extract':>22}: {report['producer_groups_over_extract']:.2f}  (producer alone with "
              f"producer_group_tokens {compare_groups:,})")
    if compare_tokens:
        print(f"{'I_compare / extract':>22}: {report['producer_compare_over_extract']:.2f}  (producer alone at "
              f"{compare_tokens:,} tokens per forward)")
    if compare_in_flight is not None:
        print(f"{'I_in_flight / extract':>22}: {report['producer_in_flight_over_extract']:.2f}  (producer alone with "
              f"forwards_in_flight {compare_in_flight})")
    packed = ", packed" if args.producer_packing else ""
    print(f"{'forward padding':>22}: producer {padding['producer'][0]:.1%} of padded tokens "
          f"({padding['producer'][1]:.2f} forwards per planned batch{packed}), "
          + (f"at {compare_tokens:,}: {padding['producer_compare'][0]:.1%} "
             f"({padding['producer_compare'][1]:.2f}{packed}), " if compare_tokens else "")
          + (f"with producer_group_tokens {compare_groups:,}: {padding['producer_groups'][0]:.1%} "
             f"({padding['producer_groups'][1]:.2f}{packed}), " if compare_groups is not None else "")
          + f"extract {padding['extract'][0]:.1%} ({padding['extract'][1]:.2f} per shard)")
    print(f"{'forwards counted':>22}: " + ", ".join(f"{key} {value:.2f}" for key, value in
                                                   report["producer_forwards_per_batch_counted"].items())
          + " per planned batch (as the producers ran them)")
    for mode, phases in report["phases_ms_per_batch"].items():
        print(f"{'phases, ' + mode:>22}: {phases_line(phases)}  (producer alone, medians)")
    for side, windows in allocator_runs.items():
        if not gpu:
            print(f"{'allocator counters':>22}: {allocator_line(None)}, not measured on {device}")
            break
        if windows:
            total = {key: sum(window[key] for window in windows) for key in windows[0]} | {
                key: max(window[key] for window in windows) for key in ("peak_allocated_bytes", "peak_reserved_bytes")}
            print(f"{'allocator, ' + side:>22}: {allocator_line(total)}  (timed batches, summed over the repeats; "
                  "peaks: the largest)")
    print(f"{'achieved / min(I, T)':>22}: {report['achieved_over_min']:.2f}")
    print(f"{'achieved / shared':>22}: {report['achieved_over_shared']:.2f}  (1/(1/I+1/T): one device for both)")
    print(f"{'device':>22}: {report['device']}; target {identity.name}, taps {layer_ids}")
    if args.profile:
        report["profile"] = profile_one_task(tasks, corpus, producer, extract_runner, compare_in_flight, device,
                                             RingGeometry(num_slots=2, max_tokens=token_budget, max_documents=token_budget,
                                                          width=extract_runner.feature_size), rate_i)  # fmt: skip
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
