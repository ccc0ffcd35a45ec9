"""Online batches: the trainer's batch source fed by target replicas through the shared-memory ring.

:class:`OnlineBatches` is a :class:`dflash.batches.source.BatchSource`. Its epoch plan is the offline one
(:class:`dflash.batches.source.PlannedCursor` over :class:`dflash.corpus.format.CorpusLengths`: same lengths, split (the
corpus's document keys, which extract stores in a cache), buckets, token budget and seed as a cache of the same
corpus), so it yields the same samples in the same batches in the same
order as ``extract`` then ``train``; only the hidden states come from producers instead of the cache (equal within
the runner's tolerance, since a sample's forward batch differs).

Flow (one rank)::

    dispatcher thread:  for each group of planned batches from the cursor, in plan order (plan_groups; without
                        group_tokens each planned batch is a group of one):
                            slots = [ring.acquire() per batch] # blocks while the ring is full (backpressure)
                            future = submit(BatchTask(...))    # a producer computes it into the slot
                                  or submit(GroupTask(...))    #   (a group: shared forwards, a slot per batch)
                            in_order.put(future) per batch
    reader thread:      future = in_order.get()                # one at a time, in plan order, read_ahead batches
                            future.result()                    #   ahead of the consumer (waits while not ready)
                            batch = ring.read_batch(..., out=private)   # copy into a reused buffer, CRC-32C checked
                            ring.release(slot); packed = pack(batch)
    consumer (__iter__): yield the next packed batch           # waits while the reader is behind (measured)

The reader is a one-thread ``concurrent.futures`` executor: while the trainer trains on one batch, the next is
copied out, checked and packed (the copies and the CRC-32C run without the GIL). ``read_ahead=0`` reads on the
consumer's thread instead, when it asks for the batch.

``submit`` is anything returning a future (``concurrent.futures`` or Dask's ``Client.submit``, as
``pipelines/online.py`` wires it); the producers run :class:`BatchProducer` (the same
:class:`dflash.target.runner.TargetRunner` as extract). Slots are handed out in plan order, so the batch the
consumer needs next always holds a slot: the reorder window is the ring, never a deadlock (a group holds at most
half the slots, and takes them once the batches before it have been read).

Resume: the cursor (``state_dict``) is the offline one; after ``load_state_dict`` the dispatcher starts at the
cursor and producers recompute the remaining batches of the plan (a cursor inside a group: the whole group's
forwards, so every document shares its forward with the same documents as in an unbroken run). Nothing of the
queue is checkpointed.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dflash.batches.buckets import EpochPlan, PlannedBatch
from dflash.batches.packed import PackedBatch, pack_samples
from dflash.batches.ring import QueueError, Ring, RingGeometry
from dflash.batches.source import LengthSource, PlannedCursor, StreamConfig
from dflash.errors import ConfigError, DFlashError, ProducerError
from dflash.faults import fault_point

__all__ = ["BatchTask", "GroupTask", "BatchProducer", "OnlineBatches", "OnlineStats", "max_group_batches",
           "pack_slot_batch", "plan_groups"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchTask:
    """One producer task: compute the planned batch ``batch_index`` of ``epoch`` into ``slot`` of ring ``ring_name``.

    ``corpus_rows``: the batch's documents in plan order; ``ticket``: the slot's hand-out (checked on both sides).
    Small and picklable: what travels to a producer process.
    """

    ring_name: str
    slot: int
    ticket: int
    epoch: int
    batch_index: int
    bucket: int
    corpus_rows: tuple[int, ...]
    staging: str | None = None
    """``--cache-to``: the staging folder this first-epoch batch is also written to (``dflash.cache.staging``)."""
    stage_name: str = ""
    """The staged batch's name (``<split>-b<global batch index>-<digest of its rows>``)."""

    @property
    def name(self) -> str:
        """``batch B of epoch E`` (for messages)."""
        return f"batch {self.batch_index} of epoch {self.epoch}"


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupTask:
    """One producer task over a group of consecutive planned batches of one epoch (:func:`plan_groups`): their
    documents run through the target together (rows of several planned batches share forwards, as extract's rows of
    one shard do), and each batch's hidden states go into its own slot (``batches``: one :class:`BatchTask` each, in
    plan order, each with its slot, ticket and ``--cache-to`` staging).

    ``lead_rows``: the documents of the group's planned batches before the first of ``batches`` (a dispatcher that
    starts inside a group, after a resume): they run in the same forwards, so that every document shares its
    forward with the same documents as in an unbroken run, and their hidden states are dropped.
    """

    batches: tuple[BatchTask, ...]
    lead_rows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.batches:
            raise ValueError("a GroupTask needs at least one planned batch")
        if len({(task.ring_name, task.epoch) for task in self.batches}) != 1:
            raise ValueError("a GroupTask's planned batches belong to one ring and one epoch")

    @property
    def ring_name(self) -> str:
        return self.batches[0].ring_name

    @property
    def epoch(self) -> int:
        return self.batches[0].epoch

    @property
    def batch_index(self) -> int:
        """The first planned batch's global index."""
        return self.batches[0].batch_index

    @property
    def ticket(self) -> int:
        """The first planned batch's ticket (unique per hand-out, as the group's)."""
        return self.batches[0].ticket

    @property
    def name(self) -> str:
        """``batches B1-B2 of epoch E`` (for messages)."""
        first, last = self.batches[0].batch_index, self.batches[-1].batch_index
        return f"batches {first}-{last} of epoch {self.epoch}" if last != first else self.batches[0].name


def max_group_batches(num_slots: int) -> int:
    """Planned batches one producer task may hold in a ring of ``num_slots``: half the slots (a task holds a slot
    per batch from its dispatch, so one group is computed while the trainer reads the one before), at least 1."""
    return max(1, num_slots // 2)


def plan_groups(tokens: list[int], group_tokens: int | None, max_batches: int) -> list[int]:
    """The first step of each producer group of an epoch: consecutive planned batches (``tokens``: each one's real
    tokens, in plan order) join a group while its real tokens stay within ``group_tokens`` and it holds at most
    ``max_batches``; a batch over the budget is a group of its own. ``group_tokens`` ``None`` (or ``max_batches``
    1): every planned batch is its own group. The groups depend on the plan and these two numbers only, so a
    resumed run groups the same batches as an unbroken one."""
    starts: list[int] = []
    total = count = 0
    for step, batch_tokens in enumerate(tokens):
        if (not starts or group_tokens is None or count >= max_batches
                or total + batch_tokens > group_tokens):  # fmt: skip
            starts.append(step)
            total = count = 0
        total += batch_tokens
        count += 1
    return starts


class BatchProducer:
    """Producer side: runs the target on a task's corpus rows, its hidden states copied straight into the ring slot.

    :meth:`produce` queues the target's forwards with each document's device-to-host copy aimed at its place in the
    slot (no staging buffer; the segment is page-locked in this process when the runner is on CUDA, so the copies
    stay asynchronous), then waits for the copies, checks the documents, and commits the slot (rows, ids and masks,
    CRC-32C, header FULL). Several tasks may call :meth:`produce` at once (threads):
    one at a time queues its forwards (a lock), so while one task waits for its copies and commits, the next task's
    forwards already run on the device. Which documents share a forward depends only on the task, so the hidden
    states do not depend on that overlap. A :class:`GroupTask` runs the documents of several planned batches through
    the same forwards (the runner sorts them all by length) and commits each batch into its own slot.

    Args:
        runner: a :class:`dflash.target.runner.TargetRunner` (the extract stage's runner).
        corpus: the opened corpus (``dflash.corpus.format.Corpus``) the plan was made from.
        forwards_in_flight: at most this many of a task's forwards queued and not yet finished (their copies into
            the slot landed), >= 2: with 2 the task finishes forward k before it queues forward k+2, as extract's
            loop does, so the device holds at most two forwards' outputs until their copies land. ``None`` (the
            default): every forward of the task is queued before any is finished. The forwards, their documents
            and the copies do not change, only when the task waits for them, so the slots receive the same bytes.

    Raises:
        ConfigError: ``forwards_in_flight`` below 2.
    """

    def __init__(self, runner: Any, corpus: Any, *, forwards_in_flight: int | None = None) -> None:
        if forwards_in_flight is not None and forwards_in_flight < 2:
            raise ConfigError(f"forwards_in_flight must be >= 2 or None (the runner queues a task's next forward "
                              f"before it hands over the current one), got {forwards_in_flight}")
        self.runner = runner
        self.corpus = corpus
        self.forwards_in_flight = forwards_in_flight
        self._rings: dict[str, Ring] = {}
        self._rings_lock = threading.Lock()
        self._device_lock = threading.Lock()
        self._busy_until = 0.0  # when the latest task ended (perf_counter): overlapping tasks count once
        #: Whether every ring this producer attached is page-locked for CUDA copies (None: none attached yet);
        #: unlocked slots make each device-to-host copy synchronous.
        self.rings_pinned: bool | None = None

    def _ring(self, name: str) -> Ring:
        with self._rings_lock:
            if name not in self._rings:
                ring = self._rings[name] = Ring.attach(name, pin=self.runner.device.type == "cuda")
                self.rings_pinned = ring.pinned and self.rings_pinned is not False
                if self.runner.device.type == "cuda" and not ring.pinned:
                    log.warning("the online ring %s could not be page-locked for CUDA copies (cudaHostRegister "
                                "refused): each copy of hidden states into a slot synchronizes, slowing this "
                                "producer", name)
            return self._rings[name]

    def produce(self, task: BatchTask | GroupTask, *,
                queued: Callable[[], None] | None = None) -> dict[str, Any]:  # fmt: skip
        """Compute ``task`` into its slot (a :class:`GroupTask`: each planned batch into its own slot, from forwards
        over all the group's documents).

        Returns, for a :class:`BatchTask`, ``{"batch_index", "epoch", "tokens", "compute_seconds", "phases",
        "forwards"}``; for a :class:`GroupTask`, ``{"batches": [one such dict per planned batch, in plan order],
        "forwards"}``, the group's compute seconds, phases and forwards shared among its batches in proportion to
        their tokens.

        ``compute_seconds``: from the moment this task starts queuing its forwards to its commit, less what overlaps
        the earlier tasks of this producer (overlapping tasks are counted once, so tokens / the sum over tasks is the
        producer's rate). ``phases``: wall seconds of this task's steps, ``forwards`` (queuing the forwards and
        their copies; on CUDA the device runs them asynchronously; with ``forwards_in_flight``, also waiting for
        the earlier forwards' copies), ``copies`` (waiting until every copy landed in
        the slot, the non-finite check included: on CUDA, whatever device work of the task was still running) and
        ``commit`` (rows, ids and masks written, the CRC-32C, the header). ``forwards``: the target forwards the
        task ran. ``queued``: called once the task's forwards and copies are queued on the device, before
        this call waits for them (the Dask task secedes from its worker's thread pool there, so the worker starts
        its next task).

        Raises:
            DFlashError: a document's hidden states are not finite (the offline path quarantines such rows; online
                the run stops, naming the corpus row: extract and train offline to skip it).
            QueueError: a slot is no longer claimed by its ticket, or the ring carries hidden states of another
                dtype or width than the runner's.
        """
        group = task if isinstance(task, GroupTask) else GroupTask(batches=(task,))
        members = group.batches
        ring = self._ring(group.ring_name)
        geometry = ring.geometry
        if geometry.dtype != torch.bfloat16 or geometry.width != self.runner.feature_size:
            raise QueueError(f"{group.name}: the runner computes [L, {self.runner.feature_size}] "
                             f"torch.bfloat16; the ring carries [L, {geometry.width}] {geometry.dtype}")
        rows = [[self.corpus.row(int(r)) for r in member.corpus_rows] for member in members]
        lead = [self.corpus.row(int(r)).input_ids for r in group.lead_rows]
        input_ids = [[row.input_ids for row in batch] for batch in rows]
        everything = [*lead, *(ids for batch in input_ids for ids in batch)]
        owners = [*(None for _ in lead), *(int(row) for member in members for row in member.corpus_rows)]
        with self._device_lock:  # one task queues its forwards at a time; the copies land in the slots
            started = time.perf_counter()
            writes = [ring.begin_batch(member.slot, member.ticket, epoch=member.epoch, batch_index=member.batch_index,
                                       bucket=member.bucket,
                                       corpus_rows=np.asarray(member.corpus_rows, dtype=np.int64),
                                       input_ids=ids, loss_mask=[row.loss_mask for row in batch])
                      for member, batch, ids in zip(members, rows, input_ids, strict=True)]  # fmt: skip
            # The lead documents' hidden states (a group resumed inside) land in scratch memory and are dropped.
            out = [*(torch.empty(len(ids), geometry.width, dtype=geometry.dtype) for ids in lead),
                   *(view for write in writes for view in write.documents)]  # fmt: skip
            pending = []
            for item in self.runner.iter_pending(everything, out=out):  # item k comes once forward k+1 is queued
                pending.append(item)
                oldest = len(pending) + 1 - (self.forwards_in_flight or len(pending) + 2)
                if oldest >= 0:  # the next forward makes at most forwards_in_flight; the ones before are finished
                    pending[oldest].finish()
            forwards_queued = time.perf_counter()
        if queued is not None:
            queued()
        copies_started = time.perf_counter()
        for batch in [item.finish() for item in pending]:  # every copy landed before anything is checked
            for index, bad_layers in zip(batch.indices, batch.nonfinite_layers, strict=True):
                if bad_layers and owners[index] is not None:
                    raise DFlashError(
                        f"corpus row {owners[index]}: non-finite hidden states at tapped layers {bad_layers}; "
                        "the online mode cannot quarantine it (the plan holds it): use extract + train, which does"
                    )
        fault_point("online.produce")
        # --cache-to: private copies, staged after the commits (the trainer is waiting for the slots, and may hand
        # each to another batch as soon as it has read it).
        staged = [write.hidden.clone().split([len(ids) for ids in ids_]) if member.staging is not None else None
                  for member, write, ids_ in zip(members, writes, input_ids, strict=True)]  # fmt: skip
        commit_started = time.perf_counter()
        for write in writes:
            ring.commit_batch(write)
        committed = time.perf_counter()
        for member, hidden in zip(members, staged, strict=True):
            if hidden is not None:
                from dflash.cache.staging import stage_batch

                stage_batch(member.staging, member.stage_name, member.corpus_rows, hidden)  # type: ignore[arg-type]
        with self._rings_lock:
            ended = time.perf_counter()
            compute = max(0.0, ended - max(started, self._busy_until))
            self._busy_until = max(self._busy_until, ended)
        phases = {"forwards": forwards_queued - started, "copies": commit_started - copies_started,
                  "commit": committed - commit_started}  # fmt: skip
        tokens = [int(sum(len(ids) for ids in ids_)) for ids_ in input_ids]
        total = max(1, sum(tokens))
        results = [{"batch_index": member.batch_index, "epoch": member.epoch, "tokens": count,
                    "compute_seconds": compute * count / total, "forwards": len(pending) * count / total,
                    "phases": {phase: seconds * count / total for phase, seconds in phases.items()}}
                   for member, count in zip(members, tokens, strict=True)]  # fmt: skip
        if isinstance(task, GroupTask):
            return {"batches": results, "forwards": len(pending)}
        return results[0]

    def close(self) -> None:
        with self._rings_lock:
            for ring in self._rings.values():
                ring.close()
            self._rings.clear()


@dataclass(slots=True)
class OnlineStats:
    """Counters of :class:`OnlineBatches` (the trainer reads ``wait_seconds`` as for the offline loader)."""

    batches: int = 0
    tokens: int = 0
    wait_seconds: float = 0.0
    """Seconds the trainer waited for the next batch (producers, or the read-ahead, behind)."""
    slot_wait_seconds: float = 0.0
    """Seconds the reader waited for the next batch's producer (its slot not yet full: producers are the
    bottleneck); without read-ahead the trainer's own wait."""
    last_wait_seconds: float = 0.0
    dispatch_wait_seconds: float = 0.0
    """Seconds the dispatcher waited for a free slot (the ring was full: the trainer is the bottleneck)."""
    producer_seconds: float = 0.0
    """Producer compute time summed over the batches consumed."""
    producer_work: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Per producer (Dask worker name; ``"local"`` in-process): ``(tokens, compute seconds)`` of the batches consumed;
    tokens / seconds is that producer's capacity (:class:`dflash.training.telemetry.FeedMeter`)."""
    occupancy_sums: tuple[float, float, int] = (0.0, 0.0, 0)
    """Sums, over the batches consumed, of the batches computed and waiting (in their slots or read ahead) and of the
    batches in flight (ring slots in use plus batches read ahead), seen as the trainer asks for the next batch, and
    the number of samples (means: sum / samples)."""
    read_seconds: float = 0.0
    """Seconds copying slots out and checking them (:meth:`dflash.batches.ring.Ring.read_batch`)."""
    pack_seconds: float = 0.0
    """Seconds packing the batches read into training batches (:func:`pack_slot_batch`)."""
    producer_forwards: float = 0.0
    """Target forwards the producers ran for the batches consumed (a group's shared among its batches in proportion
    to their tokens)."""
    producer_phases: dict[str, float] = field(default_factory=dict)
    """The producers' ``phases`` (:meth:`BatchProducer.produce`) summed over the batches consumed."""
    bucket_batches: list[int] | None = None


_END = object()
_STOPPED = object()  # wakes a read waiting for a batch the stopped dispatcher will not hand out


@dataclass(slots=True)
class _Loaded:
    """A planned batch taken out of the ring and packed (:meth:`OnlineBatches._load`), with its timings."""

    epoch: int
    step: int
    planned: PlannedBatch
    batch: PackedBatch
    result: Any
    slot_wait: float
    read: float
    pack: float


class OnlineBatches(PlannedCursor):
    """Packed batches for one rank, computed by producers into a shared-memory ring, yielded in plan order.

    Args:
        source: a :class:`dflash.batches.source.LengthSource` of the corpus (``dflash.corpus.format.CorpusLengths``).
        config: :class:`dflash.batches.source.StreamConfig` (``shard_window`` must be ``None``: the plan is global).
        submit: ``submit(BatchTask) -> future`` (``.result()``, ``.add_done_callback()``, ``.cancel()``).
        width: ``n*H`` of the hidden states; ``dtype``: bfloat16 or float32 (the runner's output dtype).
        num_slots: ring slots (>= 2): batches in flight between producers and trainer.
        rank, world_size: this process's data-parallel rank.
        staging: a staging folder (``--cache-to``): producers also write the first epoch's batches there, for
            :class:`dflash.cache.staging.ShardAssembler`; ``None``: nothing is staged.
        health_check: called every ``health_interval`` seconds while a batch's producer is waited for; a message it
            returns (e.g. every producer is gone) stops the wait with :class:`dflash.errors.ProducerError`, so a run
            whose producers all died fails instead of waiting forever.
        read_ahead: batches read out of the ring and packed ahead of the consumer, on a background thread (one
            ``concurrent.futures`` worker: reads run one at a time, in plan order), at most ``num_slots``; each slot
            is released as soon as its batch is copied out, so the packed batches waiting hold host memory, not
            slots. ``1`` (default): the next batch is read while the consumer trains on this one. ``0``: the
            consumer's own thread reads each batch when it asks for it.
        group_tokens: producers run consecutive planned batches of an epoch together, one :class:`GroupTask`
            per group of at most this many real tokens (:func:`plan_groups`) and at most :attr:`max_group_batches`
            planned batches (half the slots: one group computes while the trainer reads the one before), so that
            their rows share target forwards; each batch still has its own slot. ``None`` (default): one
            :class:`BatchTask` per planned batch.

    The ring (``self.ring``) is created here and removed by :meth:`close`.
    """

    def __init__(self, source: LengthSource, config: StreamConfig, *, submit: Callable[[BatchTask], Any], width: int,
                 dtype: torch.dtype = torch.bfloat16, num_slots: int = 4, rank: int = 0, world_size: int = 1,
                 staging: str | None = None, health_check: Callable[[], str | None] | None = None,
                 health_interval: float = 5.0, read_ahead: int = 1,
                 group_tokens: int | None = None) -> None:  # fmt: skip
        if config.shard_window is not None:
            raise ConfigError(f"shard_window={config.shard_window}: the online mode plans globally (no cache shards "
                              "to window over); use shard_window=None")
        if not isinstance(read_ahead, int) or isinstance(read_ahead, bool) or read_ahead < 0:
            raise ConfigError(f"read_ahead must be an integer >= 0; got {read_ahead!r}")
        if group_tokens is not None and (not isinstance(group_tokens, int) or isinstance(group_tokens, bool)
                                         or group_tokens < 1):  # fmt: skip
            raise ConfigError(f"group_tokens must be an integer >= 1 or None; got {group_tokens!r}")
        self._plan_lock = threading.RLock()
        super().__init__(source, config, rank=rank, world_size=world_size)
        self.submit = submit
        self.staging = staging
        self.health_check = health_check
        self.health_interval = float(health_interval)
        self.stats = OnlineStats(bucket_batches=[0] * self.num_buckets)  # type: ignore[assignment]
        max_documents = min(config.token_budget, config.max_documents_per_batch or config.token_budget)
        self.ring = Ring.create(RingGeometry(num_slots=num_slots, max_tokens=config.token_budget,
                                             max_documents=max_documents, width=width, dtype=dtype))  # fmt: skip
        self.pin_memory = bool(config.pin_memory) and torch.cuda.is_available()
        self.read_ahead = min(read_ahead, num_slots)
        self.group_tokens = group_tokens
        #: Planned batches per producer task at most (:func:`max_group_batches`; 1 without ``group_tokens``).
        self.max_group_batches = max_group_batches(num_slots) if group_tokens is not None else 1
        self._dispatcher: threading.Thread | None = None
        self._in_order: queue.Queue = queue.Queue()
        self._reader: ThreadPoolExecutor | None = None
        self._reads: deque[Future] = deque()  # read-ahead, in plan order
        self._in_hand: tuple | None = None  # the batch being read while its slot is held (occupancy, stop)
        self._private: np.ndarray | None = None  # the slots' private copy, reused from batch to batch
        self._cuda_index: int | None = None  # the consumer's CUDA device, for pinned packing on the reader thread

    def plan(self, epoch: int | None = None) -> EpochPlan:
        with self._plan_lock:  # the dispatcher thread plans ahead too
            return super().plan(epoch)

    # ---- dispatcher ------------------------------------------------------------------------------------------

    def _start_dispatcher(self) -> None:
        if self._dispatcher is not None:
            return
        self.ring.restart()
        self._in_order = queue.Queue()
        start = (self.epoch, self._step)
        self._dispatcher = threading.Thread(target=self._dispatch, args=(start, self._in_order),
                                            name="dflash-online-dispatch", daemon=True)  # fmt: skip
        self._dispatcher.start()

    def _dispatch(self, start: tuple[int, int], in_order: queue.Queue) -> None:
        epoch, step = start
        try:
            while True:
                plan = self.plan(epoch)
                starts = plan_groups([plan.batch(s, self.rank).num_tokens for s in range(plan.num_steps)],
                                     self.group_tokens, self.max_group_batches)  # fmt: skip
                ends = [*starts[1:], plan.num_steps]
                for first, stop in zip(starts, ends, strict=True):
                    if stop <= step:
                        continue
                    members = [(s, plan.batch(s, self.rank)) for s in range(max(first, step), stop)]
                    slots = self._acquire(len(members))
                    if slots is None:
                        return  # stopped
                    tasks = [self._task(epoch, s, planned, slot, ticket)
                             for (s, planned), (slot, ticket) in zip(members, slots, strict=True)]  # fmt: skip
                    lead = tuple(int(r) for s in range(first, step) for r in self._rows(plan.batch(s, self.rank)))
                    task: BatchTask | GroupTask = (tasks[0] if len(tasks) == 1 and not lead
                                                   else GroupTask(batches=tuple(tasks), lead_rows=lead))  # fmt: skip
                    try:
                        future = self.submit(task)
                    except BaseException:
                        for slot, _ in slots:
                            self.ring.release(slot)
                        raise
                    for (s, planned), member in zip(members, tasks, strict=True):
                        in_order.put((epoch, s, planned, member, future))
                    step = stop
                epoch, step = epoch + 1, 0
        except BaseException as error:  # handed to the consumer, which raises it
            in_order.put((_END, error))

    def _acquire(self, count: int) -> list[tuple[int, int]] | None:
        """``count`` slots with their tickets (:meth:`Ring.acquire`, one after another: the earlier batches' slots
        come back as the trainer reads them, and ``count`` never exceeds the ring); ``None`` once stopped (the slots
        taken so far given back)."""
        slots: list[tuple[int, int]] = []
        waited = time.perf_counter()
        while len(slots) < count:
            claimed = self.ring.acquire()  # blocks while every slot is taken
            if claimed is None:
                for slot, _ in slots:
                    self.ring.release(slot)
                return None
            slots.append(claimed)
        self.stats.dispatch_wait_seconds += time.perf_counter() - waited
        return slots

    def _rows(self, planned: PlannedBatch) -> tuple[int, ...]:
        return tuple(int(r) for r in self.sample_row[planned.samples])

    def _task(self, epoch: int, step: int, planned: PlannedBatch, slot: int, ticket: int) -> BatchTask:
        """The :class:`BatchTask` of the planned batch at ``step`` of ``epoch``, in ``slot`` with ``ticket``."""
        index = self.global_batch_index(step)
        rows = self._rows(planned)
        stage = self.staging is not None and epoch == 0  # --cache-to: the first epoch only
        return BatchTask(ring_name=self.ring.name, slot=slot, ticket=ticket, epoch=epoch, batch_index=index,
                         bucket=int(planned.bucket), corpus_rows=rows, staging=self.staging if stage else None,
                         stage_name=_stage_name(self.config.split, index, rows) if stage else "")  # fmt: skip

    def _stop_dispatcher(self) -> None:
        """Stop handing out slots and drop the read-ahead; slots of batches in flight come back when their producers
        finish. Returns once no read of the ring runs any more."""
        if self._dispatcher is None and not self._reads:
            return
        self.ring.stop()
        if self._dispatcher is not None:
            self._dispatcher.join()
            self._dispatcher = None
        reads, self._reads = list(self._reads), deque()
        for read in reads:
            read.cancel()  # not started: never runs
        while True:
            try:
                item = self._in_order.get_nowait()
            except queue.Empty:
                break
            if item[0] is not _END and item[0] is not _STOPPED:
                self._release_when_done(item[3], item[4])
        for read in reads:
            if not read.cancelled():
                self._in_order.put((_STOPPED,))  # a read waiting for the next batch ends
        in_hand = self._in_hand
        if in_hand is not None:
            in_hand[4].cancel()  # a read waiting for its producer ends (its slot comes back when the task does)
        wait_all(reads)

    def _release_when_done(self, task: BatchTask, future: Any) -> None:
        ring = self.ring
        future.cancel()

        def release(_: Any) -> None:
            if ring.shm is not None:
                ring.release(task.slot)

        future.add_done_callback(release)

    # ---- consumer --------------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[PackedBatch]:
        """This rank's batches from the cursor to the end of the epoch (then the cursor moves to the next epoch).

        Producers run ahead (into the next epoch too) while slots are free, and so do the reads (``read_ahead``);
        closing the iterator early stops them (the slots of batches in flight come back when their tasks end)."""
        if self._step >= self.plan().num_steps:
            self._advance_epoch()
        self._start_dispatcher()
        try:
            yield from self._consume()
        except GeneratorExit:  # the consumer stopped early (e.g. max_validation_batches): producers stop too
            self._stop_dispatcher()
            raise
        self._advance_epoch()

    def _consume(self) -> Iterator[PackedBatch]:
        while self._step < self.plan().num_steps:
            ready, taken = self._occupancy()
            waited = time.perf_counter()
            try:
                if self.read_ahead:
                    self._fill_reads()
                    loaded = self._reads.popleft().result()  # the trainer waits here while producers are behind
                    if loaded is None:  # close() from another thread while this one waited
                        raise QueueError(f"ring {self.ring.name}: the batch source was closed while the trainer "
                                         "waited for a batch")
                    self._fill_reads()  # the next read starts while this batch trains
                else:
                    loaded = self._load(self._in_order.get())
            except BaseException:
                self._stop_dispatcher()
                raise
            wait = time.perf_counter() - waited if self.read_ahead else loaded.slot_wait
            assert (loaded.epoch, loaded.step) == (self.epoch, self._step), "online batches out of plan order"
            planned, result = loaded.planned, loaded.result
            stats = self.stats
            stats.slot_wait_seconds += loaded.slot_wait
            stats.read_seconds += loaded.read
            stats.pack_seconds += loaded.pack
            stats.wait_seconds += wait
            stats.last_wait_seconds = wait
            compute = float(result.get("compute_seconds", 0.0)) if isinstance(result, dict) else 0.0
            stats.producer_seconds += compute
            stats.producer_forwards += float(result.get("forwards", 0.0)) if isinstance(result, dict) else 0.0
            for phase, seconds in (result.get("phases") or {}).items() if isinstance(result, dict) else ():
                stats.producer_phases[phase] = stats.producer_phases.get(phase, 0.0) + float(seconds)
            producer = str(result.get("worker", "local")) if isinstance(result, dict) else "local"
            produced, busy = stats.producer_work.get(producer, (0, 0.0))
            stats.producer_work[producer] = (produced + planned.num_tokens, busy + compute)
            ready_sum, taken_sum, samples = stats.occupancy_sums
            stats.occupancy_sums = (ready_sum + ready, taken_sum + taken, samples + 1)
            stats.batches += 1
            stats.tokens += planned.num_tokens
            stats.bucket_batches[planned.bucket] += 1  # type: ignore[index]
            self._step += 1
            yield loaded.batch

    def _fill_reads(self) -> None:
        """Keep ``read_ahead`` reads submitted; each takes the next batch the dispatcher hands out."""
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="dflash-online-read")
            if self.pin_memory:  # pinned packing on the reader thread: under this rank's device, not GPU 0
                self._cuda_index = torch.cuda.current_device()
        while len(self._reads) < self.read_ahead:
            self._reads.append(self._reader.submit(self._read_next, self._in_order))

    def _read_next(self, in_order: queue.Queue) -> _Loaded | None:
        """Reader thread: the next batch of ``in_order`` (:meth:`_load`); ``None`` once the dispatcher stopped."""
        item = in_order.get()
        if item[0] is _STOPPED:
            return None
        if self._cuda_index is None:
            return self._load(item)
        with torch.cuda.device(self._cuda_index):
            return self._load(item)

    def _load(self, item: tuple) -> _Loaded:
        """Wait for the batch's producer, copy its slot out and check it (:meth:`Ring.read_batch`, into one reused
        private buffer), release the slot, check its corpus rows against the plan and pack it.

        Raises:
            The dispatcher's error (``item`` is its end), the producer's, or :class:`QueueError` (a slot failing a
            check, or rows other than the plan's).
        """
        if item[0] is _END:
            raise item[1]
        epoch, step, planned, task, future = item
        waited = time.perf_counter()
        self._in_hand = item
        try:
            try:
                result = _batch_result(self._result(future), task.batch_index)
            except BaseException:
                self._release_when_done(task, future)
                raise
            read_started = time.perf_counter()
            if self._private is None:
                self._private = np.empty(self.ring.geometry.payload_capacity, dtype=np.uint8)
            try:
                slot_batch = self.ring.read_batch(task.slot, task.ticket, epoch=epoch, batch_index=task.batch_index,
                                                  out=self._private)  # fmt: skip
            finally:
                self._in_hand = None
                self.ring.release(task.slot)
        finally:
            self._in_hand = None
        expected = self.sample_row[planned.samples]
        if not np.array_equal(slot_batch.corpus_rows, expected):
            raise QueueError(f"slot {task.slot}: batch {task.batch_index} of epoch {epoch} holds corpus rows "
                             f"{slot_batch.corpus_rows[:8].tolist()}..., the plan names {expected[:8].tolist()}...")
        pack_started = time.perf_counter()
        batch = self._pack(slot_batch, planned.bucket)  # copies: the private buffer may be reused after this
        return _Loaded(epoch=epoch, step=step, planned=planned, batch=batch, result=result,
                       slot_wait=read_started - waited, read=pack_started - read_started,
                       pack=time.perf_counter() - pack_started)  # fmt: skip

    def _result(self, future: Any) -> Any:
        """``future.result()``, asking ``health_check`` every ``health_interval`` seconds while it is not done."""
        while True:
            try:
                return future.result(timeout=self.health_interval if self.health_check is not None else None)
            except TimeoutError:
                if future.done():  # the producer's own error happened to be a TimeoutError
                    return future.result()
                problem = self.health_check()  # type: ignore[misc]
                if problem:
                    raise ProducerError(problem) from None

    def _occupancy(self) -> tuple[int, int]:
        """``(batches computed and not yet consumed, batches in flight: ring slots in use plus batches read
        ahead)`` now; the first is at most the second (the reader's moves between the counts are not locked)."""
        with self._in_order.mutex:  # the dispatcher appends and the reader takes concurrently
            items = list(self._in_order.queue)
        ready = sum(1 for item in items if item[0] is not _END and item[0] is not _STOPPED and item[4].done())
        in_hand = self._in_hand
        if in_hand is not None and in_hand[4].done():
            ready += 1
        read = sum(1 for future in list(self._reads) if future.done())
        taken = self.ring.geometry.num_slots - self.ring.num_free + read
        return min(ready + read, taken), taken

    def _pack(self, slot_batch: Any, bucket: int) -> PackedBatch:
        """The offline packing of the slot's documents (:func:`pack_slot_batch`)."""
        return pack_slot_batch(slot_batch, pad_to=self._pad_length(int(slot_batch.lengths.sum())), bucket=bucket,
                               pin_memory=self.pin_memory)  # fmt: skip

    def _cursor_moved(self) -> None:
        self._stop_dispatcher()  # batches in flight were for the old position

    def close(self) -> None:
        """Stop the dispatcher and the reads, and remove the ring (producers still writing get an error, their tasks
        end)."""
        self._stop_dispatcher()
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None
        self._private = None
        self.ring.close()

    def __enter__(self) -> OnlineBatches:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def describe(self) -> dict[str, Any]:
        geometry = self.ring.geometry
        return PlannedCursor.describe(self) | {
            "queue": {"num_slots": geometry.num_slots, "slot_bytes": geometry.slot_bytes, "width": geometry.width,
                      "dtype": str(geometry.dtype).removeprefix("torch."), "ring": self.ring.name},
        }  # fmt: skip


def pack_slot_batch(slot_batch: Any, *, pad_to: int | None, bucket: int, pin_memory: bool = False) -> PackedBatch:
    """A batch read from the ring (:class:`dflash.batches.ring.SlotBatch`: ``lengths [D]`` int64, ``corpus_rows
    [D]`` int64, ``input_ids [T]`` int32, ``loss_mask [T]`` uint8, ``hidden [T, n*H]`` of the ring's dtype, documents
    back to back) packed as the offline loader packs a cache batch (:func:`dflash.batches.packed.pack_samples`, padded to
    ``pad_to`` tokens, pinned when ``pin_memory``; the tensors are views of the slot batch until copied there).

    Raises:
        ValueError: as :func:`dflash.batches.packed.pack_samples` (no documents, ``pad_to`` below the real length).
    """
    offsets = np.concatenate([[0], np.cumsum(slot_batch.lengths)]).tolist()
    samples = [_Document(row, slot_batch.input_ids[start:stop], slot_batch.loss_mask[start:stop],
                         slot_batch.hidden[start:stop])
               for row, start, stop in zip(slot_batch.corpus_rows.tolist(), offsets[:-1], offsets[1:], strict=True)]
    return pack_samples(samples, pad_to=pad_to, bucket_id=bucket, pin_memory=pin_memory)


def _batch_result(result: Any, batch_index: int) -> Any:
    """One planned batch's part of a producer's result: a :class:`GroupTask`'s ``{"batches": [...]}`` gives the
    batch's own dict (with the producer's ``worker``, when the task's result names it); a :class:`BatchTask`'s is
    its own."""
    if not isinstance(result, dict) or "batches" not in result:
        return result
    mine = next(part for part in result["batches"] if part["batch_index"] == batch_index)
    return mine | ({"worker": result["worker"]} if "worker" in result else {})


def _stage_name(split: str, index: int, rows: tuple[int, ...]) -> str:
    """A staged batch's name: split, global batch index and a digest of its rows, so that the batches of another
    plan (another seed or token budget writing into the same ``--cache-to``) never pass for this plan's."""
    return f"{split}-b{index:08d}-{hashlib.sha256(repr(rows).encode()).hexdigest()[:12]}"


@dataclass(slots=True)
class _Document:
    """One document as :func:`dflash.batches.packed.pack_samples` reads it (views into the slot's private copy)."""

    corpus_row: int
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden: torch.Tensor
