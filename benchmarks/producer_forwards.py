"""The online producer's target forwards against extract's, on CPU: how many forwards each runs over
``benchmarks/online.py``'s corpus, what one forward issues, and what a competing thread does to the issuing.

Three measurements, none needing a GPU (docs/online-queue.md, "The producer's forward against extract's"):

* forward plans: ``benchmarks/online.py``'s corpus for a GPU run (random token ids, lengths 256-2,048, enough
  tokens for its default 8 steps; ``--token-budget`` real tokens per planned batch, 2 length buckets, epoch 0 of the
  online plan): the producers' forwards (``plan_batches`` over each task's rows, as ``TargetRunner`` runs a task)
  at each ``--producer-forward-tokens``, with a task per planned batch and with the online dispatcher's groups of
  consecutive planned batches (``dflash.batches.online.plan_groups``: ``producer_group_tokens``, at most half the
  ring slots, for 4 slots and for online's default), and extract's (over each shard of ``--shard-size``: its default
  65,536 tokens and the h200-smollm2 preset's 262,144) at each ``--forward-tokens``: forwards, per planned batch,
  per 100K real tokens, real tokens per forward, padding.
* operations: the top-level aten operations of one ``TargetRunner.forward`` of the real SmolLM2 through its last tap
  (taps 1, 8, 14, 20, 27), and of extract's loop (``iter_batches``) and the producer's (``iter_pending`` with ``out``,
  one tensor per document) over the same rows (``torch.profiler``).
* issuing under a competing thread: host time of a forward of 1 x 8 tokens (little arithmetic), alone, while
  another thread of the process computes CRC-32Cs of a 94 MB buffer (a SmolLM2 batch) as the ring's commit and
  read do (``dflash.batches.ring._crc32c``: 8 MB pieces), and while another process does (the same load on the
  cores, no shared GIL: on a machine with cores to spare it costs nothing, so the thread's excess over it is the
  GIL's), medians of ``--repeats``.

    python benchmarks/producer_forwards.py
    python benchmarks/producer_forwards.py --skip-model        # the forward plans only
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from extract import write_corpus  # noqa: E402  (the benchmarks' shared helper, as benchmarks/online.py uses it)

#: Taps of benchmarks/online.py on CUDA for SmolLM2 (5 draft layers, DFlash's rule).
TAPS = [1, 8, 14, 20, 27]


def forward_stats(lengths: np.ndarray, groups: list[list[int]], forward_tokens: int) -> dict:
    """Forwards, real tokens per forward and padding when each group of corpus rows is run on its own."""
    from dflash.target.runner import plan_batches

    real = padded = forwards = 0
    for rows in groups:
        group = lengths[np.asarray(rows)]
        for indices in plan_batches(group, forward_tokens):
            forwards += 1
            real += int(group[indices].sum())
            padded += len(indices) * int(group[indices].max())
    return {"groups": len(groups), "forwards": forwards, "real_tokens": real, "padded_tokens": padded,
            "padding": 1 - real / padded, "real_per_forward": real / forwards}  # fmt: skip


def forward_plans(args: argparse.Namespace, work: Path) -> None:
    from dflash.batches.online import max_group_batches, plan_groups
    from dflash.batches.source import LoaderConfig, PlannedCursor
    from dflash.corpus.format import CorpusLengths, open_corpus
    from pipelines.online import OnlineConfig
    from stages.extract.command import plan_shards
    from stages.train.config import TrainConfig
    from stages.train.data import stream_config

    budget = args.token_budget
    write_corpus(work / "corpus", budget * (8 + 4) * 5 // 4, 256, 2048, 49152, seed=0)  # benchmarks/online.py's
    corpus = open_corpus(work / "corpus")
    lengths = np.asarray(corpus.lengths)
    train = TrainConfig(cache="online:", output=str(work / "run"), min_supervised_tokens=0,
                        data=LoaderConfig(token_budget=budget, num_buckets=2, validation_fraction=0.0))
    cursor = PlannedCursor(CorpusLengths(corpus), stream_config(train, "train", torch.device("cpu")))
    plan = cursor.plan(0)
    batches = [[int(r) for r in cursor.sample_row[plan.batch(step, 0).samples]] for step in range(plan.num_steps)]
    tokens = [plan.batch(step, 0).num_tokens for step in range(plan.num_steps)]
    group_tokens = args.producer_group_tokens
    if group_tokens is None:
        group_tokens = OnlineConfig.__dataclass_fields__["producer_group_tokens"].default
    default_slots = OnlineConfig.__dataclass_fields__["ring_slots"].default

    def groups(ring_slots: int) -> list[list[int]]:  # the online dispatcher's groups (dflash.batches.online)
        starts = plan_groups(tokens, group_tokens, max_group_batches(ring_slots))
        return [sum(batches[start:stop], []) for start, stop in zip(starts, [*starts[1:], len(batches)], strict=True)]

    print(f"corpus: {len(lengths)} rows, {int(lengths.sum()):,} tokens; {len(batches)} planned batches of at most "
          f"{budget:,} real tokens (epoch 0 of the online plan)")
    rows = [(f"producer, a task per planned batch, {tokens_:,}", batches, tokens_)
            for tokens_ in args.producer_forward_tokens]
    for ring_slots in sorted({4, default_slots}):
        grouped = groups(ring_slots)
        rows += [(f"producer, tasks of <= {max_group_batches(ring_slots)} batches / {group_tokens:,} tokens "
                  f"({len(grouped)} tasks, ring_slots {ring_slots}), {tokens_:,}", grouped, tokens_)
                 for tokens_ in args.producer_forward_tokens]
    for shard_size in args.shard_size:
        shards = [list(range(start, stop)) for start, stop in plan_shards(lengths, shard_size)]
        rows += [(f"extract, {len(shards)} shard{'s' if len(shards) != 1 else ''} of ~{shard_size:,}, {tokens_:,}", shards, tokens_)
                 for tokens_ in args.forward_tokens]
    print(f"  {'plan, forward budget (padded tokens)':>74}  forwards  per planned batch  per 100K tokens  "
          "real tokens per forward  padding")
    for name, row_groups, forward_tokens in rows:
        stats = forward_stats(lengths, row_groups, forward_tokens)
        print(f"  {name:>74}  {stats['forwards']:8d}  {stats['forwards'] / len(batches):17.2f}  "
              f"{1e5 * stats['forwards'] / stats['real_tokens']:15.2f}  {stats['real_per_forward']:23,.0f}  "
              f"{stats['padding']:7.1%}")


def top_level_operations(fn) -> int:
    """Top-level aten operations ``fn()`` issues (after one untimed call)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = [event for event in prof.events() if event.name.startswith("aten::")]
    return sum(1 for event in events if event.cpu_parent is None or not event.cpu_parent.name.startswith("aten::"))


def model_measurements(args: argparse.Namespace) -> None:
    from dflash.batches.ring import _crc32c
    from dflash.target.load import load_target
    from dflash.target.runner import TargetRunner

    torch.set_num_threads(1)
    model = load_target("default", device=torch.device("cpu")).model
    runner = TargetRunner(model, TAPS, torch.device("cpu"), token_budget=64)
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 30000, size=n).astype(np.int32) for n in (16, 12, 9, 7)]  # one forward of 64 tokens
    out = [torch.empty(len(ids), runner.feature_size, dtype=torch.bfloat16) for ids in rows]

    def extract_loop() -> None:
        for batch in runner.iter_batches(rows):
            batch.release()

    def producer_loop() -> None:
        for pending in list(runner.iter_pending(rows, out=out)):
            pending.finish()

    one = top_level_operations(lambda: runner.forward(torch.as_tensor(rows[0][None].astype(np.int64))))
    print(f"operations: one forward through layer {TAPS[-1]}: {one:,}; the same {len(rows)} rows in one forward: "
          f"extract's loop {top_level_operations(extract_loop):,}, the producer's {top_level_operations(producer_loop):,}")

    tiny = torch.as_tensor(rows[0][None, :8].astype(np.int64))

    def host_ms() -> float:
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            runner.forward(tiny)
            times.append(time.perf_counter() - started)
        return 1e3 * statistics.median(times)

    for _ in range(3):
        runner.forward(tiny)
    alone = host_ms()
    payload = np.ones(94 * 2**20, dtype=np.uint8)
    stop = threading.Event()

    def checksums() -> None:
        while not stop.is_set():
            _crc32c(payload)

    thread = threading.Thread(target=checksums, daemon=True)
    thread.start()
    time.sleep(0.2)
    try:
        in_thread = host_ms()
    finally:
        stop.set()
        thread.join()
    context = multiprocessing.get_context("spawn")
    stop_process = context.Event()
    process = context.Process(target=_checksum_process, args=(stop_process,), daemon=True)
    process.start()
    time.sleep(3.0)  # its imports and buffer
    try:
        in_process = host_ms()
    finally:
        stop_process.set()
        process.join()
    print(f"issuing: a forward of 1 x 8 tokens (one torch thread) {alone:.1f} ms alone, {in_thread:.1f} ms "
          f"({in_thread / alone:.1f}x) beside a thread computing CRC-32Cs (dflash.batches.ring._crc32c, 94 MB), "
          f"{in_process:.1f} ms ({in_process / alone:.1f}x) beside a process doing the same; medians of "
          f"{args.repeats}")


def _checksum_process(stop: Any) -> None:
    """A spawned process computing CRC-32Cs of a 94 MB buffer until ``stop`` is set."""
    from dflash.batches.ring import _crc32c

    payload = np.ones(94 * 2**20, dtype=np.uint8)
    while not stop.is_set():
        _crc32c(payload)


def main() -> None:
    from stages.extract.command import ExtractConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--token-budget", type=int, default=16384, help="Real tokens per planned batch")
    parser.add_argument("--producer-forward-tokens", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--forward-tokens", type=int, nargs="+", default=[16384, 32768], help="Extract's")
    parser.add_argument("--shard-size", type=int, nargs="+", default=[
        ExtractConfig.__dataclass_fields__["shard_size"].default, 262144], help="Extract's (default: its default and "
        "the h200-smollm2 preset's)")
    parser.add_argument("--producer-group-tokens", type=int, default=None, help="The producers' group budget "
                        "(default: online's producer_group_tokens)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--skip-model", action="store_true", help="Only the forward plans (no model loaded)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dflash-bench-producer-forwards-") as work:
        forward_plans(args, Path(work))
    if not args.skip_model:
        model_measurements(args)


if __name__ == "__main__":
    main()
