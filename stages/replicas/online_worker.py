"""Worker side of ``dflash-stages online``: the Dask WorkerPlugin of an online producer and its task.

:class:`OnlineProducerPlugin` is a :class:`stages.replicas.replica.TargetReplicaPlugin` (target loaded once per worker in
``setup``, its GPU pinned; freed in ``teardown``), with a :class:`dflash.batches.online.BatchProducer` on top: the same
:class:`dflash.target.runner.TargetRunner` as ``extract``. A task is pure in Dask's sense: a
:class:`dflash.batches.online.BatchTask` in (a planned batch, a ring slot and its ticket), a small dict out; the hidden
states go into the shared-memory slot, never through Dask (a :class:`dflash.batches.online.GroupTask`: several
planned batches run through the same forwards, each into its own slot). A task whose worker dies is rerun by Dask
on another worker, a group as a whole (same slots and tickets; each slot is rewritten whole). Several tasks run at once on a worker
(:func:`produce_batch`), one queuing its forwards at a time.
"""

from __future__ import annotations

from typing import Any

import torch
from distributed import get_worker, secede

from dflash.batches.online import BatchProducer, BatchTask, GroupTask
from dflash.corpus.format import open_corpus
from dflash.target.runner import TargetRunner
from stages.replicas.replica import TargetReplicaPlugin
from stages.replicas.tasks import returns_user_errors

__all__ = ["OnlineProducerPlugin", "produce_batch", "PLUGIN_NAME"]

PLUGIN_NAME = "dflash-online-producer"


class OnlineProducerPlugin(TargetReplicaPlugin):
    """An online producer: the shared target-replica lifecycle plus a :class:`BatchProducer`.

    Args:
        target_spec, gpu_by_worker, device, torch_threads, die_with_parent: see :class:`TargetReplicaPlugin`.
        target_layer_ids: tapped decoder layers.
        token_budget: padded tokens per forward batch of the runner (with ``packing``, tokens per packed forward).
        corpus_path: the corpus the trainer's plan was made from.
        packing: the runner's forwards are packed (samples back to back, no padding; its automatic kernel).
    """

    name = PLUGIN_NAME
    idempotent = False

    def __init__(self, *, target_spec: str, target_layer_ids: list[int], token_budget: int, corpus_path: str,
                 gpu_by_worker: dict[Any, int] | None = None, device: str = "auto", torch_threads: int | None = None,
                 die_with_parent: bool = False, packing: bool = False) -> None:  # fmt: skip
        super().__init__(target_spec=target_spec, gpu_by_worker=gpu_by_worker, device=device,
                         torch_threads=torch_threads, die_with_parent=die_with_parent)  # fmt: skip
        self.target_layer_ids = list(target_layer_ids)
        self.token_budget = int(token_budget)
        self.corpus_path = corpus_path
        self.packing = bool(packing)
        self.producer: BatchProducer | None = None

    def build(self, loaded: Any, device: torch.device) -> None:
        pad_token_id = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
        runner = TargetRunner(loaded.model, self.target_layer_ids, device, token_budget=self.token_budget,
                              pad_token_id=pad_token_id, packing=self.packing)  # fmt: skip
        self.producer = BatchProducer(runner, open_corpus(self.corpus_path))

    def release(self) -> torch.device | None:
        if self.producer is None:
            return None
        device = self.producer.runner.device
        self.producer.close()
        self.producer = None
        return device


@returns_user_errors
def produce_batch(task: BatchTask | GroupTask) -> dict:
    """Dask task: compute one planned batch (a :class:`GroupTask`: several, each into its own slot) into its ring
    slot on this worker's target replica.

    Once the batch's forwards are queued on the device the task secedes from the worker's thread pool (Dask's
    ``secede``), so the worker starts its next task, whose forwards queue behind these while this one waits for its
    copies and commits the slot: the device does not idle between batches. The tasks in flight are bounded by the
    ring's slots (no task is submitted without one). An error the user must fix (a corpus row with non-finite hidden
    states...) comes back as the task's value (:mod:`stages.replicas.tasks`)."""
    worker = get_worker()
    plugin = worker.plugins.get(PLUGIN_NAME)
    if plugin is None or plugin.producer is None:
        raise RuntimeError(f"worker {worker.address} has no target loaded (plugin {PLUGIN_NAME} missing)")
    return plugin.producer.produce(task, queued=secede) | {"worker": str(worker.name)}
