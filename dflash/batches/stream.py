"""Stream a hidden-state cache into training as packed, bucket-balanced batches, with exact resume.

The loader plans every epoch from sample lengths alone (:mod:`dflash.batches.buckets`; no hidden state is touched), then
reads only the samples of the coming batches, in plan order, with background prefetch: a
:class:`concurrent.futures.ThreadPoolExecutor` keeps at most ``prefetch_batches`` batches being read or waiting,
each packed straight into pinned host memory (on CUDA hosts); with ``device=`` the next batch is also copied to
the GPU on a side stream while the current one trains. Memory is bounded by the prefetch depth (and, in
shard-window mode, by an LRU of ``shard_window`` whole shards), whatever the cache size.

Two read modes:

* ``shard_window=None`` (default): one global shuffle per epoch; each batch reads just its samples
  (``read_shard(shard, indices)``), best on local disk.
* ``shard_window=K``: shards are shuffled and taken K at a time; batches mix samples within those K shards only,
  and each shard is read whole once per epoch through an LRU of K shards: sequential reads for object storage.

Resume: :meth:`StreamingLoader.state_dict` holds ``epoch`` and the number of batches this rank has been handed
in that epoch; :meth:`load_state_dict` continues with exactly the next batch (the plan is a pure function of the
seed, the epoch, the lengths and the config, which the state records and checks).

Train/validation split (``StreamConfig.validation_split_by``): by source document (default; a hash of the
document key the cache stores per corpus row, ``CacheReader.document_keys``, and ``split_seed``: every row of a
document on one side), or by corpus row (``"row"``, and any cache without document keys: a hash of the row id);
stable either way, so it does not change with the shuffle seed, the world size, or how the cache was sharded.

Usage::

    reader = CacheReader("cache.zarr")
    loader = StreamingLoader(reader, StreamConfig(token_budget=16384, seed=0), rank=rank, world_size=world_size)
    for epoch in range(num_epochs):
        for batch in loader:          # one epoch from the cursor; the next call starts the next epoch
            batch = batch.to(device)  # or StreamingLoader(..., device=device) to overlap the copy
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import torch

from dflash.batches.buckets import PlannedBatch
from dflash.batches.packed import PackedBatch, pack_samples
from dflash.batches.source import (
    LengthSource,
    LoaderStats,
    PlannedCursor,
    StreamConfig,
    read_workers,
    validation_rows,
)
from dflash.errors import ConfigError

__all__ = ["HiddenSource", "StreamConfig", "LoaderStats", "StreamingLoader", "validation_rows"]


class HiddenSource(LengthSource, Protocol):
    """What the loader needs from a cache (``dflash.cache.CacheReader`` implements it): the lengths of
    :class:`dflash.batches.source.LengthSource` plus the samples themselves."""

    def read_shard(self, shard: int, indices: Any = None) -> list[Any]: ...


class StreamingLoader(PlannedCursor):
    """Packed batches for one rank, streamed from a cache in plan order (see module docstring).

    Args:
        source: a :class:`HiddenSource` (``dflash.cache.CacheReader``).
        config: :class:`StreamConfig`.
        rank, world_size: this process's data-parallel rank; ranks read disjoint batches.
        device: when set (e.g. ``"cuda:0"``), batches are yielded on it, copied one ahead on a side stream.

    Attributes:
        num_excluded_short, num_excluded_short_tokens: samples of this split (and their tokens) left out for
            fewer than ``config.min_supervised_tokens`` supervised tokens.

    Raises:
        ConfigError: bad rank/world size, an empty split, or a sample longer than ``token_budget``.
    """

    def __init__(
        self,
        source: HiddenSource,
        config: StreamConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str | None = None,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(
                f"rank must be in [0, world_size) with world_size >= 1; got rank={rank}, world_size={world_size}"
            )
        self.device = torch.device(device) if device is not None else None
        if self.device is not None and self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.pin_memory = torch.cuda.is_available() if config.pin_memory is None else config.pin_memory
        if self.pin_memory and not torch.cuda.is_available():
            raise ConfigError(
                "pin_memory=True needs CUDA (pinned memory only helps host-to-GPU copies); use None"
            )
        # Reader threads start on CUDA device 0; pin and copy under this rank's device so that no rank creates a
        # context (and its memory) on GPU 0.
        self._cuda_index: int | None = None
        if self.device is not None and self.device.type == "cuda":
            self._cuda_index = self.device.index
        elif self.pin_memory:
            self._cuda_index = torch.cuda.current_device()
        super().__init__(source, config, rank=rank, world_size=world_size)  # sample table and plans
        # Background pipeline, kept across epochs so the next epoch's first batches are read ahead too:
        # entries (epoch, step, planned batch, future of (batch, copy event)).
        self._pool: ThreadPoolExecutor | None = None
        self._pending: deque[tuple[int, int, PlannedBatch, Future]] = deque()
        self._next_submit: tuple[int, int] = (0, 0)
        self._held: PlannedBatch | None = None
        self._copy_stream = (
            torch.cuda.Stream(device=self.device)
            if self.device is not None and self.device.type == "cuda"
            else None
        )
        self.shard_cache = _ShardCache(self.source.read_shard, max_shards=config.shard_window or 1)

    # ---- reading (the sample table, plans and cursor are dflash.batches.source.PlannedCursor's) ---------------------------------------------------------------------------------------------

    def _read_samples(self, planned: PlannedBatch) -> list[Any]:
        shards = self.sample_shard[planned.samples]
        positions = self.sample_position[planned.samples]
        samples: list[Any] = [None] * planned.samples.size
        for shard in dict.fromkeys(shards.tolist()):
            slots = np.flatnonzero(shards == shard)
            wanted = positions[slots]
            if self.config.shard_window is not None:
                whole = self.shard_cache.get(shard)
                got = [whole[i] for i in wanted.tolist()]
            else:
                order = np.argsort(wanted, kind="stable")
                read = self.source.read_shard(shard, wanted[order].tolist())
                got = [None] * wanted.size
                for slot_in_order, sample in zip(order.tolist(), read, strict=True):
                    got[slot_in_order] = sample
            for slot, sample in zip(slots.tolist(), got, strict=True):
                samples[slot] = sample
        for slot, sample in enumerate(samples):
            expected_row = int(self.sample_row[planned.samples[slot]])
            if int(sample.corpus_row) != expected_row:
                raise ConfigError(
                    f"shard {int(shards[slot])} sample {int(positions[slot])}: expected corpus row {expected_row}, "
                    f"read {int(sample.corpus_row)}; the cache changed while reading: run `dflash-stages cache verify`"
                )
        return samples

    def _load(self, planned: PlannedBatch) -> tuple[PackedBatch, torch.cuda.Event | None]:
        """Worker thread: read, pack into (pinned) host memory, and start the device copy on the side stream."""
        if self._cuda_index is None:
            return self._load_on_device(planned)
        with torch.cuda.device(self._cuda_index):
            return self._load_on_device(planned)

    def _load_on_device(self, planned: PlannedBatch) -> tuple[PackedBatch, torch.cuda.Event | None]:
        start = time.perf_counter()
        samples = self._read_samples(planned)
        batch = pack_samples(
            samples,
            pad_to=self._pad_length(planned.num_tokens),
            bucket_id=planned.bucket,
            pin_memory=self.pin_memory,
        )
        event = None
        if self._copy_stream is not None:
            with torch.cuda.stream(self._copy_stream):
                batch = batch.to(self.device, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._copy_stream)
        elif self.device is not None:
            batch = batch.to(self.device)
        with self._lock:
            self.stats.read_seconds += time.perf_counter() - start
        return batch, event

    def _enter_flight(self, planned: PlannedBatch) -> None:
        with self._lock:
            stats = self.stats
            stats.batches_in_flight += 1
            stats.tokens_in_flight += planned.num_tokens
            stats.max_batches_in_flight = max(stats.max_batches_in_flight, stats.batches_in_flight)
            stats.max_tokens_in_flight = max(stats.max_tokens_in_flight, stats.tokens_in_flight)

    def _leave_flight(self, planned: PlannedBatch) -> None:
        with self._lock:
            self.stats.batches_in_flight -= 1
            self.stats.tokens_in_flight -= planned.num_tokens

    @property
    def max_batches_in_flight(self) -> int:
        """The memory bound in batches: the prefetch depth plus the batch the consumer holds."""
        return self.config.prefetch_batches + 1

    def _fill(self) -> None:
        """Submit reads in plan order (crossing into the next epoch) until ``prefetch_batches`` are pending."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(read_workers(self.config), thread_name_prefix="dflash-stream")
        while len(self._pending) < self.config.prefetch_batches:
            epoch, step = self._next_submit
            if step >= self.plan(epoch).num_steps:
                if epoch > self.epoch or self.plan(epoch + 1).num_steps == 0:
                    return  # read ahead at most into the next epoch
                epoch, step = epoch + 1, 0
            planned = self.plan(epoch).batch(step, self.rank)
            self._enter_flight(planned)
            self._pending.append((epoch, step, planned, self._pool.submit(self._load, planned)))
            self._next_submit = (epoch, step + 1)

    def _drop_pipeline(self) -> None:
        """Cancel read-ahead (after a jump of the cursor); running reads finish and are discarded."""
        for _, _, planned, future in self._pending:
            future.cancel()
            self._leave_flight(planned)
        self._pending.clear()
        self._next_submit = (self.epoch, self._step)

    def _release_held(self) -> None:
        if self._held is not None:
            self._leave_flight(self._held)
            self._held = None

    def __iter__(self) -> Iterator[PackedBatch]:
        """Yield this rank's batches from the cursor to the end of the epoch, then move to the next epoch.

        Reads run ahead in background threads, also into the next epoch, so epochs follow each other without a
        stall. Breaking out of the loop keeps the cursor (and the read-ahead) where it is.
        """
        if self._step >= self.plan().num_steps:
            self._advance_epoch()
        if self._pending and self._pending[0][:2] != (self.epoch, self._step):
            self._drop_pipeline()
        if not self._pending:
            self._next_submit = (self.epoch, self._step)
        try:
            while self._step < self.plan().num_steps:
                self._fill()
                epoch, step, planned, future = self._pending.popleft()
                assert (epoch, step) == (self.epoch, self._step), "read-ahead out of order"
                start = time.perf_counter()
                try:
                    batch, event = future.result()
                except BaseException:
                    self._leave_flight(planned)
                    self._drop_pipeline()
                    raise
                if event is not None:
                    current = torch.cuda.current_stream(self.device)
                    current.wait_event(event)
                    for name in PackedBatch._TENSOR_FIELDS:
                        getattr(batch, name).record_stream(current)
                waited = time.perf_counter() - start
                self._release_held()
                self._held = planned
                self._fill()
                stats = self.stats
                stats.wait_seconds += waited
                stats.last_wait_seconds = waited
                stats.batches += 1
                stats.tokens += planned.num_tokens
                stats.bucket_batches[planned.bucket] += 1
                self._step += 1
                yield batch
            self._advance_epoch()
        finally:
            self._release_held()

    def _cursor_moved(self) -> None:
        self._drop_pipeline()  # read-ahead was for the old position

    def close(self) -> None:
        """Stop the reader threads, drop read-ahead and cached shards. The loader can be iterated again after."""
        self._drop_pipeline()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self.shard_cache.clear()

    def __enter__(self) -> StreamingLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

class _ShardCache:
    """LRU of at most ``max_shards`` whole shards (shard-window mode), shared by the reader threads.

    Entries are futures, so threads asking for a shard being read wait for that one read instead of reading it
    again: each shard is read once while it stays cached, and at most ``max_shards`` are held.
    """

    def __init__(self, read_shard: Any, max_shards: int) -> None:
        self._read_shard = read_shard
        self.max_shards = max_shards
        self._entries: OrderedDict[int, Future] = OrderedDict()
        self._lock = threading.Lock()
        self.reads = 0
        """Whole-shard reads done (cache misses)."""

    def get(self, shard: int) -> list[Any]:
        with self._lock:
            future = self._entries.get(shard)
            if future is not None:
                self._entries.move_to_end(shard)
                owner = False
            else:
                future = Future()
                self._entries[shard] = future
                while len(self._entries) > self.max_shards:
                    self._entries.popitem(last=False)
                self.reads += 1
                owner = True
        if owner:
            try:
                future.set_result(self._read_shard(shard))
            except BaseException as error:
                with self._lock:
                    if self._entries.get(shard) is future:
                        del self._entries[shard]
                future.set_exception(error)
        return future.result()

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
