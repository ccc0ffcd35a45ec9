"""Online mode throughput: achieved training rate against the producer-alone rate I and the trainer-alone rate T.

Three measurements in one run, on the same corpus, plan and drafter config (the real target, default SmolLM2):

* I, producer alone: the online batch source (a :class:`dflash.online.BatchProducer` thread, the ring, checks and
  packing) iterated without training: real tokens per second the target side can supply.
* T, trainer alone: the training loop (``stages.trainer.Trainer``) on the online batch source whose producer
  REPLAYS hidden states computed beforehand (a memcpy into the slot): tokens per second the drafter side can take.
* achieved: the same training loop fed by the real producer through the ring.

Rates are real (unpadded) tokens per second; the trainer's figures are its throughput window (``real_tokens_per_s``
of the last logged step over the whole run but its first step: setup excluded; a 2-slot ring, so read-ahead
does not flatter a short run). Printed against ``min(I, T)`` (separate devices) and ``1/(1/I + 1/T)``
(one device shared by producer and trainer, e.g. a CPU host or a single GPU: the issue's target is achieved >=
0.9 x that). Producers run as threads of this process here; the multi-GPU layouts go through
``dflash-stages online --target-gpus ... --drafter-gpus ...`` (not measured by this script yet).

CPU smoke run (tens of seconds)::

    python benchmarks/online.py --smoke
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from dflash.corpus import CorpusWriter, open_corpus
from dflash.online import BatchProducer, BatchTask
from dflash.target import load_target
from dflash.target_runner import TargetRunner
from dflash.telemetry import read_metrics

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
        if hidden is None:
            hidden = self.memo[task.corpus_rows] = self.runner.run([row.input_ids for row in rows])
        self._ring(task.ring_name).write_batch(
            task.slot, task.ticket, epoch=task.epoch, batch_index=task.batch_index, bucket=task.bucket,
            corpus_rows=np.asarray(task.corpus_rows), input_ids=[r.input_ids for r in rows],
            loss_mask=[r.loss_mask for r in rows], hidden=hidden,
        )  # fmt: skip
        return {"compute_seconds": 0.0}


def producer_rate(producer: BatchProducer, config, batches: int) -> float:
    """The online batch source alone (producer in a thread, the ring, checks and packing; no training): real
    tokens/s between the first and the last of ``batches`` batches (same window rule as the trainer's rates)."""
    from pipelines.online import online_training_data

    producer.runner.run([producer.corpus.row(0).input_ids])  # warm-up, untimed (first forward allocates)
    with ThreadPoolExecutor(1) as pool:
        data = online_training_data(config, submit=lambda task: pool.submit(producer.produce, task),
                                    device=torch.device("cpu"))  # fmt: skip
        times, tokens = [], []
        try:
            while len(times) < batches:
                for batch in data.train:
                    times.append(time.perf_counter())
                    tokens.append(batch.num_real_tokens)
                    if len(times) == batches:
                        break
        finally:
            data.close()
    producer.close()
    return sum(tokens[1:]) / (times[-1] - times[0])


def trainer_rate(config, producer: BatchProducer) -> float:
    """Trains ``config`` with ``producer`` in a thread; the last logged real tokens/s."""
    from pipelines.online import online_training_data
    from stages.trainer import Trainer

    with ThreadPoolExecutor(1) as pool:
        data = online_training_data(config, submit=lambda task: pool.submit(producer.produce, task),
                                    device=torch.device("cpu"))  # fmt: skip
        trainer = Trainer(config.train, device=torch.device("cpu"), data=data)
        try:
            trainer.fit()
        finally:
            trainer.close()
    return float(read_metrics(config.train.output, kind="train")[-1]["real_tokens_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--layer-ids", default="1,3", help="Tapped layers (few low ones keep a CPU run short).")
    parser.add_argument("--rows", type=int, default=96)
    parser.add_argument("--token-budget", type=int, default=512)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--smoke", action="store_true", help="Tiny run on CPU.")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.steps, args.token_budget = 64, 10, 384
    from pipelines.online import ONLINE_CACHE_PREFIX, OnlineConfig
    from stages.train import TrainConfig

    layer_ids = [int(i) for i in args.layer_ids.split(",")]
    loaded = load_target(args.target)
    work = Path(tempfile.mkdtemp(prefix="dflash-bench-online-"))
    corpus_path = write_corpus(work / "corpus", loaded.tokenizer, args.rows, args.token_budget // 4)

    def config(name: str) -> OnlineConfig:
        train = TrainConfig(cache=f"{ONLINE_CACHE_PREFIX}{corpus_path}", output=str(work / name), num_draft_layers=1,
                            block_size=4, max_anchors_per_document=8, token_budget=args.token_budget,
                            num_buckets=2, validation_fraction=0.0, max_steps=args.steps, save_every=args.steps,
                            log_every=1, throughput_window=args.steps + 1, progress=False, device="cpu",
                            min_supervised_tokens=0)  # fmt: skip
        # Two slots: read-ahead cannot cover a short run, so the rate is the steady one.
        return OnlineConfig(corpus=str(corpus_path), train=train, target=args.target, target_layer_ids=layer_ids,
                            ring_slots=2)

    def runner() -> TargetRunner:
        return TargetRunner(loaded.model, layer_ids, "cpu", token_budget=args.token_budget)

    corpus = open_corpus(corpus_path)
    rate_i = producer_rate(BatchProducer(runner(), corpus), config("producer"), args.steps)
    replay = ReplayProducer(runner(), corpus)
    trainer_rate(config("warm-replay"), replay)  # fills the replay memo
    rate_t = trainer_rate(config("trainer"), replay)
    achieved = trainer_rate(config("achieved"), BatchProducer(runner(), corpus))
    shared = 1.0 / (1.0 / rate_i + 1.0 / rate_t)
    report = {"producer_alone_I": rate_i, "trainer_alone_T": rate_t, "achieved": achieved,
              "min_I_T": min(rate_i, rate_t), "shared_device_bound": shared,
              "achieved_over_min": achieved / min(rate_i, rate_t), "achieved_over_shared": achieved / shared,
              "token_budget": args.token_budget, "steps": args.steps, "target": args.target,
              "layer_ids": layer_ids, "device": "cpu", "torch_threads": torch.get_num_threads()}  # fmt: skip
    for key in ("producer_alone_I", "trainer_alone_T", "achieved", "min_I_T", "shared_device_bound"):
        print(f"{key:>22}: {report[key]:10,.0f} real tokens/s")
    print(f"{'achieved / min(I, T)':>22}: {report['achieved_over_min']:.2f}")
    print(f"{'achieved / shared':>22}: {report['achieved_over_shared']:.2f}  (1/(1/I+1/T): one device for both)")
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
