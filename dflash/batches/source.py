"""The batch-source seam of training: what the trainer consumes, and the epoch plan both sources share.

The trainer (``stages.train.loop``) reads packed batches (:class:`dflash.batches.packed.PackedBatch`) through one interface,
:class:`BatchSource`, implemented by the Zarr streaming loader (:class:`dflash.batches.stream.StreamingLoader`, offline) and
by the online queue consumer (:class:`dflash.batches.ring.OnlineBatches`, target replicas feeding training through
shared memory). Both derive from :class:`PlannedCursor`, which owns what makes their batches the SAME:

* the sample table, built from a :class:`LengthSource`: per shard, sample lengths, corpus rows and (with
  ``min_supervised_tokens``) supervised-token counts; no hidden state. A cache (``CacheReader``) is one length
  source, a corpus (``dflash.corpus.format.CorpusLengths``: Arrow offsets and loss masks) another;
* the validation split (whole source documents by default, from the source's document keys: the cache's
  ``document_keys`` array, the corpus's ``document_id`` column; else by corpus row; stable either way), the
  exclusion of samples with too few supervised tokens, the length buckets and the epoch plan
  (:func:`dflash.batches.buckets.plan_epoch`: same seed, buckets, token budget);
* the data cursor (``epoch``, ``step_in_epoch``) and its checkpoint form (:meth:`PlannedCursor.state_dict` /
  :meth:`PlannedCursor.load_state_dict`), which refuses a plan config or sample table that changed.

Same corpus rows, same config and seed -> the same samples in the same batches in the same order, whichever source
delivers the hidden states. Units: lengths and budgets in tokens.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import numpy as np

from dflash.batches.buckets import (
    BucketConfig,
    BucketRow,
    EpochPlan,
    PlannedBatch,
    assign_buckets,
    bucket_table,
    plan_epoch,
    quantile_boundaries,
)
from dflash.errors import CheckpointError, ConfigError
from dflash.values import check_seed

if TYPE_CHECKING:
    from dflash.batches.packed import PackedBatch

__all__ = [
    "LoaderConfig",
    "StreamConfig",
    "LoaderStats",
    "LengthSource",
    "BatchSource",
    "PlannedCursor",
    "validation_rows",
    "validation_split",
    "read_workers",
    "split_positions",
]

log = logging.getLogger(__name__)

_STATE_FORMAT = 1
#: Threads reading the shards' offsets and corpus rows when the table is built.
_INDEX_THREADS = 16
#: Sources whose missing document keys were already logged (one INFO line per source, not per loader or split).
_ROW_SPLIT_LOGGED: weakref.WeakSet[Any] = weakref.WeakSet()

ValidationSplitBy = Literal["document", "row"]


class LengthSource(Protocol):
    """Per-shard sample lengths and corpus rows, without hidden states (a cache, or a corpus)."""

    @property
    def shards(self) -> list[int]: ...

    def shard_lengths(self, shard: int) -> np.ndarray: ...

    def shard_corpus_rows(self, shard: int) -> np.ndarray: ...

    # Needed only with ``StreamConfig.min_supervised_tokens > 0``:
    # def shard_supervised_counts(self, shard: int) -> np.ndarray: ...

    # Optional (``validation_split_by="document"``): ``[R]`` uint64 source-document key per corpus row, indexed by
    # corpus row, or None when the source has none (``CacheReader.document_keys``, ``CorpusLengths.document_keys``):
    # def document_keys(self) -> np.ndarray | None: ...


def read_workers(config: LoaderConfig) -> int:
    """The read threads of a loader: ``config.num_read_workers``, or when it is ``None`` half the CPUs this process
    may run on (``os.sched_getaffinity``, else ``os.cpu_count``), at least 2 and at most 8."""
    if config.num_read_workers is not None:
        return int(config.num_read_workers)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 2
    return min(8, max(2, cpus // 2))


@dataclass(kw_only=True, slots=True)
class LoaderConfig(BucketConfig):
    """What a run reads and how, the user-facing part of a loader's settings (``[train.data]`` of the train stage):
    the batching of :class:`dflash.batches.buckets.BucketConfig` (token budget, buckets, documents per batch), the held-out
    split and the read-ahead. :class:`StreamConfig` adds what the trainer sets per loader (seed, split, padding)."""

    validation_fraction: float = field(default=0.0, metadata={"help": "Held-out share: of source documents (validation_split_by document) or of corpus rows (row), stable per document or row; 0: no validation. A share too small to hold out anything holds out the one document (or row) nearest to it."})
    validation_split_by: ValidationSplitBy = field(default="document", metadata={"help": "document: whole source documents held out (by the hash of the corpus document_id, which the cache stores as document_keys), so validation measures sources training never saw; row: each corpus row on its own (rows of one file land on both sides). A cache or corpus without document keys is split by row either way, with one INFO line saying so."})
    prefetch_batches: int = field(default=4, metadata={"runtime": True})
    """Batches read ahead in the background. Memory bound: ``prefetch_batches + 1`` batches of at most
    ``token_budget * n*H * 2`` bytes of hidden states each (pinned host memory; also GPU memory with ``device=``),
    e.g. 5 x 16384 x 20480 x 2 B = 3.4 GB for a Qwen3-8B cache with 5 taps."""
    num_read_workers: int | None = field(default=None, metadata={"runtime": True})
    """Threads reading, decompressing and packing batches, one batch per thread (chunk decompression and the
    checksums release the GIL); at most ``prefetch_batches`` of them are busy at once. ``None``: half the CPUs this
    process may run on, within [2, 8] (:func:`read_workers`). A runtime setting: it never changes the batches, so a
    resume may change it. A compressed cache read in shuffled order decodes each sample's whole chunks (about 3x
    the sample's bytes for 500-token samples and 1,024-token chunks), so it needs more threads than an
    uncompressed one."""
    shard_window: int | None = None
    """``None``: global shuffle, per-sample reads. K: mix within K shards at a time, whole-shard reads, LRU of K
    shards (object storage; a shard may be read twice when read-ahead crosses into the next window; order is
    unaffected)."""

    def __post_init__(self) -> None:
        BucketConfig.__post_init__(self)  # explicit: zero-argument super() fails in slots dataclasses on 3.11
        if isinstance(self.validation_fraction, bool) or not isinstance(self.validation_fraction, (int, float)) \
                or not 0.0 <= self.validation_fraction < 1.0:
            raise ConfigError(f"validation_fraction must be in [0, 1); got {self.validation_fraction!r}")
        if self.validation_split_by not in ("document", "row"):
            raise ConfigError(f"validation_split_by must be 'document' or 'row'; got {self.validation_split_by!r}")
        if not isinstance(self.prefetch_batches, int) or isinstance(self.prefetch_batches, bool) \
                or self.prefetch_batches < 1:
            raise ConfigError(f"prefetch_batches must be >= 1; got {self.prefetch_batches!r}")
        if self.shard_window is not None and (not isinstance(self.shard_window, int) or self.shard_window < 1):
            raise ConfigError(f"shard_window must be >= 1 shards or None; got {self.shard_window!r}")
        if self.num_read_workers is not None and (not isinstance(self.num_read_workers, int)
                                                  or isinstance(self.num_read_workers, bool)
                                                  or self.num_read_workers < 1):
            raise ConfigError(f"num_read_workers must be >= 1 threads or None (automatic); got {self.num_read_workers!r}")


@dataclass(kw_only=True, slots=True)
class StreamConfig(LoaderConfig):
    """Batching, mixing, split and prefetch settings of :class:`StreamingLoader`: a :class:`LoaderConfig` (declared
    there: token budget, buckets, validation split, read-ahead) plus what the trainer sets per loader."""

    min_supervised_tokens: int = 0
    """Samples with fewer supervised tokens (``loss_mask == 1``) are excluded before planning, counted in
    :attr:`StreamingLoader.num_excluded_short` (docs/dflash.md: fewer than ``2 * block_size`` are not useful). Read
    from the cache's loss masks (1 byte per token, no hidden state). 0: keep every sample."""
    seed: int = 0
    """Shuffle seed; the plan of epoch e is a pure function of (seed, e)."""
    shuffle: bool = True
    """Shuffle samples every epoch (``False`` for validation order)."""
    split: Literal["train", "validation", "all"] = "train"
    """Which part of the corpus rows this loader serves."""
    split_seed: int = 0
    """Salt of the document (or row) hash that decides the split (independent of ``seed`` so sweeps share one
    split)."""
    pin_memory: bool | None = None
    """Pack into pinned host memory; ``None``: when CUDA is available."""
    pad_to_budget: bool = False
    """Pad every batch to exactly ``token_budget`` tokens (fixed shapes for torch.compile / CUDA graphs)."""
    pad_to_multiple: int = 1
    """Pad each batch's length up to a multiple of this (ignored with ``pad_to_budget``)."""

    def __post_init__(self) -> None:
        LoaderConfig.__post_init__(self)
        check_seed("seed", self.seed)
        check_seed("split_seed", self.split_seed)
        if self.split not in ("train", "validation", "all"):
            raise ConfigError(f"split must be 'train', 'validation' or 'all'; got {self.split!r}")
        if self.split == "validation" and self.validation_fraction == 0.0:
            raise ConfigError("split='validation' needs validation_fraction > 0 (e.g. 0.01)")
        if self.pad_to_multiple < 1:
            raise ConfigError(f"pad_to_multiple must be >= 1; got {self.pad_to_multiple!r}")
        if not isinstance(self.min_supervised_tokens, int) or self.min_supervised_tokens < 0:
            raise ConfigError(f"min_supervised_tokens must be an integer >= 0; got {self.min_supervised_tokens!r}")

    def plan_fields(self) -> dict[str, Any]:
        """The fields the batch sequence depends on (checked on resume)."""
        keys = (
            "token_budget", "boundaries", "num_buckets", "max_documents_per_batch", "seed", "shuffle", "split",
            "validation_fraction", "validation_split_by", "split_seed", "shard_window", "pad_to_budget",
            "pad_to_multiple", "min_supervised_tokens",
        )  # fmt: skip
        values = asdict(self)
        return {key: list(values[key]) if isinstance(values[key], tuple) else values[key] for key in keys}


def split_positions(split_keys: np.ndarray, split_seed: int = 0) -> np.ndarray:
    """``[N]`` float64 in [0, 1): where each uint64 key falls in the split (splitmix64 of key and ``split_seed``,
    as a fraction of 2^53). A key is held out for validation when its position is below the fraction."""
    x = np.asarray(split_keys, dtype=np.uint64) + np.uint64((split_seed * 0x9E3779B97F4A7C15) % 2**64)
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / float(2**53)


def validation_rows(split_keys: np.ndarray, fraction: float, split_seed: int = 0) -> np.ndarray:
    """``[N]`` bool: which samples belong to the validation split, from one uint64 key per sample: its corpus row
    (the row split) or its source document's key (the document split: equal keys, same side). A key is held out
    when its :func:`split_positions` value is below ``fraction``.

    Stable: the same key is in the same split for any cache sharding, shuffle seed or world size.
    """
    return split_positions(split_keys, split_seed) < fraction


def validation_split(split_keys: np.ndarray, fraction: float, split_seed: int = 0) -> np.ndarray:
    """:func:`validation_rows`, except that a split which would hold out nothing (``fraction > 0`` but too small
    for this few documents or rows, e.g. 1% of 40 files) holds out the one key nearest to the fraction instead,
    when there are at least two keys: a small corpus still validates on a whole document and trains on the rest.
    That fallback key depends on which keys are present (the committed shards), not on rank or world size.
    """
    keys = np.asarray(split_keys, dtype=np.uint64)
    positions = split_positions(keys, split_seed)
    held_out = positions < fraction
    if fraction > 0 and keys.size and not held_out.any() and np.unique(keys).size > 1:
        held_out = keys == keys[int(np.argmin(positions))]
    return held_out


@dataclass(slots=True)
class LoaderStats:
    """Counters of one loader (cumulative since creation unless noted)."""

    batches: int = 0
    tokens: int = 0
    read_seconds: float = 0.0
    """Seconds spent by worker threads reading and packing (summed over threads)."""
    wait_seconds: float = 0.0
    """Seconds the consumer waited for a batch (data wait)."""
    last_wait_seconds: float = 0.0
    batches_in_flight: int = 0
    """Batches read or being read and not yet released by the consumer (now)."""
    tokens_in_flight: int = 0
    max_batches_in_flight: int = 0
    max_tokens_in_flight: int = 0
    bucket_batches: list[int] = field(default_factory=list)


@runtime_checkable
class BatchSource(Protocol):
    """What the trainer consumes: this rank's packed batches in plan order, and the data cursor.

    Iterating yields the batches from the cursor to the end of the current epoch, then moves to the next epoch (a
    new ``iter()`` continues there). ``state_dict()`` taken after the step that consumed the last yielded batch,
    given to ``load_state_dict()`` of a fresh source with the same config and samples, continues with exactly the
    next batch. ``close()`` frees threads, processes and shared memory; idempotent.
    """

    epoch: int
    num_buckets: int
    boundaries: tuple[int, ...]
    stats: LoaderStats
    num_excluded_short: int
    num_excluded_short_tokens: int

    @property
    def step_in_epoch(self) -> int: ...

    @property
    def num_samples(self) -> int: ...

    def __iter__(self) -> Iterator[PackedBatch]: ...

    def __len__(self) -> int: ...

    def bucket_table(self) -> list[BucketRow]: ...

    def describe(self) -> dict[str, Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class PlannedCursor:
    """Sample table, epoch plans and data cursor of one rank (the shared part of every :class:`BatchSource`).

    Args:
        source: a :class:`LengthSource`.
        config: :class:`StreamConfig` (its plan fields decide the batches; the rest is the subclass's).
        rank, world_size: this process's data-parallel rank; ranks take disjoint batches of each global step.

    Attributes:
        sample_shard, sample_position, sample_length, sample_row, sample_bucket: ``[N]`` int64 per kept sample
            (shard, position in the shard, tokens, corpus row, bucket), in table order (shard id, then position).
        num_excluded_short, num_excluded_short_tokens: samples of this split (and their tokens) left out for
            fewer than ``config.min_supervised_tokens`` supervised tokens.
        split_by: what the validation split went by: ``"document"`` (the source's document keys), ``"row"``
            (``validation_split_by="row"``, or a source without document keys), ``None`` (no split).
        table_fingerprint: ``sha256:`` of the table (checked on resume).

    Raises:
        ConfigError: bad rank/world size, an empty split, or a sample longer than ``token_budget``.
    """

    def __init__(self, source: LengthSource, config: StreamConfig, *, rank: int = 0, world_size: int = 1) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(
                f"rank must be in [0, world_size) with world_size >= 1; got rank={rank}, world_size={world_size}"
            )
        self.source = source
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.stats = LoaderStats()
        self._lock = threading.Lock()
        self._build_table()
        self.epoch = 0
        self._step = 0
        self._plans: dict[int, EpochPlan] = {}

    # ---- sample table and plan -------------------------------------------------------------------------------

    def _build_table(self) -> None:
        shards, positions, lengths, rows, supervised = [], [], [], [], []
        shard_ids = sorted(int(s) for s in self.source.shards)
        min_supervised = self.config.min_supervised_tokens
        if min_supervised and not hasattr(self.source, "shard_supervised_counts"):
            raise ConfigError(
                f"min_supervised_tokens={min_supervised} needs a source with shard_supervised_counts() "
                f"({type(self.source).__name__} has none); use dflash.cache.CacheReader or min_supervised_tokens=0"
            )

        def index(shard: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
            return (
                np.asarray(self.source.shard_lengths(shard), dtype=np.int64),
                np.asarray(self.source.shard_corpus_rows(shard), dtype=np.int64),
                np.asarray(self.source.shard_supervised_counts(shard), dtype=np.int64) if min_supervised else None,
            )

        # Only the small per-shard index arrays (and, with min_supervised_tokens, the 1-byte loss masks) are read;
        # in parallel, since object stores answer slowly.
        with ThreadPoolExecutor(_INDEX_THREADS, thread_name_prefix="dflash-index") as pool:
            indexes = list(pool.map(index, shard_ids))
        for shard, (shard_lengths, shard_rows, shard_supervised) in zip(shard_ids, indexes, strict=True):
            if shard_rows.shape != shard_lengths.shape or (
                shard_supervised is not None and shard_supervised.shape != shard_lengths.shape
            ):
                raise ConfigError(
                    f"shard {shard}: {shard_lengths.size} lengths but {shard_rows.size} corpus rows"
                    f"{'' if shard_supervised is None else f' and {shard_supervised.size} supervised counts'}; "
                    "the cache is inconsistent: run `dflash-stages cache verify`"
                )
            shards.append(np.full(shard_lengths.size, shard, dtype=np.int64))
            positions.append(np.arange(shard_lengths.size, dtype=np.int64))
            lengths.append(shard_lengths)
            rows.append(shard_rows)
            supervised.append(shard_supervised if shard_supervised is not None else shard_lengths)
        empty = np.zeros(0, dtype=np.int64)
        all_lengths = np.concatenate(lengths) if lengths else empty
        cfg = self.config
        self.boundaries = (
            cfg.boundaries
            if cfg.boundaries is not None
            else quantile_boundaries(all_lengths, cfg.num_buckets)
        )
        self.num_buckets = len(self.boundaries) + 1
        all_rows = np.concatenate(rows) if rows else empty
        self.split_by: ValidationSplitBy | None = None
        if cfg.split == "all" or cfg.validation_fraction == 0.0:
            keep = np.ones(all_rows.size, dtype=bool)
        else:
            is_validation = validation_split(self._split_keys(all_rows), cfg.validation_fraction, cfg.split_seed)
            keep = is_validation if cfg.split == "validation" else ~is_validation
        # Samples of this split with too few supervised tokens to give useful anchors (docs/dflash.md): excluded, counted.
        all_supervised = np.concatenate(supervised) if supervised else empty
        short = keep & (all_supervised < cfg.min_supervised_tokens)
        self.num_excluded_short = int(short.sum())
        self.num_excluded_short_tokens = int(all_lengths[short].sum())
        keep &= ~short
        self.sample_shard = (np.concatenate(shards) if shards else empty)[keep]
        self.sample_position = (np.concatenate(positions) if positions else empty)[keep]
        self.sample_length = all_lengths[keep]
        self.sample_row = all_rows[keep]
        self.sample_bucket = assign_buckets(self.sample_length, self.boundaries)
        if self.sample_length.size == 0:
            raise ConfigError(
                f"the {cfg.split} split of the cache is empty ({all_rows.size} samples in "
                f"{len(shards)} committed shards, validation_fraction={cfg.validation_fraction} of "
                f"{self.split_by or 'row'}s, "
                f"{self.num_excluded_short} excluded for fewer than min_supervised_tokens={cfg.min_supervised_tokens} "
                "supervised tokens); extract more shards, change validation_fraction or lower min_supervised_tokens"
            )
        too_long = np.flatnonzero(self.sample_length > cfg.token_budget)
        if too_long.size:
            first = too_long[0]
            raise ConfigError(
                f"token_budget={cfg.token_budget} is below the length of {too_long.size} cached sample(s) (first: "
                f"corpus row {self.sample_row[first]} in shard {self.sample_shard[first]}, "
                f"{self.sample_length[first]} tokens); raise token_budget to at least {self.sample_length.max()} "
                "or cap the corpus length at prepare time"
            )
        self.stats.bucket_batches = [0] * self.num_buckets
        digest = hashlib.sha256()
        for array in (self.sample_shard, self.sample_position, self.sample_length, self.sample_row):
            digest.update(np.ascontiguousarray(array).tobytes())
        self.table_fingerprint = "sha256:" + digest.hexdigest()

    def _split_keys(self, corpus_rows: np.ndarray) -> np.ndarray:
        """``[N]`` uint64 keys the split hashes, one per sample: its document's key (``validation_split_by=
        "document"`` and the source has document keys), else its corpus row. Sets :attr:`split_by`.

        Raises:
            ConfigError: the source's document keys do not cover a sample's corpus row.
        """
        keys = None
        if self.config.validation_split_by == "document":
            getter = getattr(self.source, "document_keys", None)
            keys = getter() if getter is not None else None
            if keys is None and self.rank == 0 and self.source not in _ROW_SPLIT_LOGGED:
                _ROW_SPLIT_LOGGED.add(self.source)
                log.info(
                    "validation split by corpus row, not by source document: %s has no document keys (its corpus "
                    "has no document_id column); to split by document, give the corpus a "
                    "document_id column (prepare writes one) and re-run extract", getattr(self.source, "url", type(self.source).__name__))
        if keys is None:
            self.split_by = "row"
            return corpus_rows
        keys = np.asarray(keys, dtype=np.uint64)
        if corpus_rows.size and int(corpus_rows.max()) >= keys.size:
            raise ConfigError(
                f"the source's document keys cover {keys.size} corpus rows but it holds corpus row "
                f"{int(corpus_rows.max())}; the cache is inconsistent: run `dflash-stages cache verify`"
            )
        self.split_by = "document"
        return keys[corpus_rows]

    def _groups(self, epoch: int) -> list[np.ndarray] | None:
        window = self.config.shard_window
        if window is None:
            return None
        shard_ids = np.unique(self.sample_shard)
        if self.config.shuffle:
            rng = np.random.default_rng(np.random.SeedSequence([self.config.seed, epoch, 1]))
            shard_ids = rng.permutation(shard_ids)
        groups = []
        for start in range(0, shard_ids.size, window):
            groups.append(np.flatnonzero(np.isin(self.sample_shard, shard_ids[start : start + window])))
        return groups

    def plan(self, epoch: int | None = None) -> EpochPlan:
        """The :class:`EpochPlan` of ``epoch`` (default: the current one); computed from lengths only."""
        epoch = self.epoch if epoch is None else epoch
        if epoch in self._plans:
            return self._plans[epoch]
        plan = plan_epoch(
            self.sample_length,
            self.sample_bucket,
            num_buckets=self.num_buckets,
            token_budget=self.config.token_budget,
            seed=self.config.seed,
            epoch=epoch,
            world_size=self.world_size,
            shuffle=self.config.shuffle,
            max_documents_per_batch=self.config.max_documents_per_batch,
            groups=self._groups(epoch),
        )
        if plan.num_steps == 0:
            raise ConfigError(
                f"the {self.config.split} split packs into {len(plan.batches) + plan.num_dropped_batches} batch(es) "
                f"of token_budget={self.config.token_budget}, fewer than world_size={self.world_size}: every rank "
                "needs a batch per step; lower token_budget or use fewer ranks"
            )
        if epoch in (self.epoch, self.epoch + 1):  # the current epoch and the one being read ahead
            self._plans = {e: p for e, p in self._plans.items() if e >= self.epoch} | {epoch: plan}
        return plan

    def __len__(self) -> int:
        """Steps (batches for this rank) in the current epoch."""
        return self.plan().num_steps

    @property
    def step_in_epoch(self) -> int:
        """Batches of the current epoch already handed to the consumer by this rank."""
        return self._step

    def planned_batch(self, epoch: int, step: int) -> PlannedBatch:
        """This rank's :class:`PlannedBatch` at ``step`` of ``epoch`` (sample indices into the table)."""
        return self.plan(epoch).batch(step, self.rank)

    def global_batch_index(self, step: int) -> int:
        """Index of this rank's batch at ``step`` in the epoch's global batch sequence."""
        return step * self.world_size + self.rank

    def bucket_table(self) -> list[BucketRow]:
        """Per-bucket samples, tokens, corpus share, planned batches and fill (current epoch's plan)."""
        return bucket_table(self.sample_length, self.sample_bucket, self.plan(), self.config.token_budget)

    @property
    def num_samples(self) -> int:
        return int(self.sample_length.size)

    @property
    def num_tokens(self) -> int:
        return int(self.sample_length.sum())

    def _pad_length(self, num_tokens: int) -> int | None:
        cfg = self.config
        if cfg.pad_to_budget:
            return cfg.token_budget
        if cfg.pad_to_multiple > 1:
            return -(-num_tokens // cfg.pad_to_multiple) * cfg.pad_to_multiple
        return None

    def _advance_epoch(self) -> None:
        self.epoch += 1
        self._step = 0
        self._plans = {e: p for e, p in self._plans.items() if e >= self.epoch}

    # ---- state -----------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Data cursor for checkpoints: epoch, batches handed out this epoch, and what the plan depends on.

        JSON-serializable. Take it after the step that consumed the last yielded batch.
        """
        return {
            "format": _STATE_FORMAT,
            "epoch": self.epoch,
            "step_in_epoch": self._step,
            "global_batches_in_epoch": self._step * self.world_size,
            "world_size": self.world_size,
            "plan_config": self.config.plan_fields(),
            "boundaries": list(self.boundaries),
            "table_fingerprint": self.table_fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly after the last batch recorded in ``state``.

        Raises:
            CheckpointError: the state was taken with a different plan config, cache content or split, or at a
                position that this world size cannot continue from (the message names the field and the fix).
        """
        if state.get("format") != _STATE_FORMAT:
            raise CheckpointError(
                f"data cursor format {state.get('format')!r} is not {_STATE_FORMAT}; cannot resume"
            )
        saved = dict(state["plan_config"])
        current = self.config.plan_fields()
        for key in sorted(set(saved) | set(current)):
            if saved.get(key) != current.get(key):
                raise CheckpointError(
                    f"data config field {key!r} changed since the checkpoint ({saved.get(key)!r} -> "
                    f"{current.get(key)!r}): the batch order would differ and resume would not be exact; "
                    f"resume with {key}={saved.get(key)!r} or start a new run"
                )
        if list(state["boundaries"]) != list(self.boundaries):
            raise CheckpointError(
                f"bucket boundaries changed since the checkpoint ({state['boundaries']} -> {list(self.boundaries)}); "
                "pass the saved boundaries explicitly to resume exactly"
            )
        if state["table_fingerprint"] != self.table_fingerprint:
            raise CheckpointError(
                "the cache's committed samples differ from the checkpoint's (sample table fingerprint "
                f"{state['table_fingerprint']} -> {self.table_fingerprint}): shards were added or rewritten; "
                "resume against the same cache or start a new run"
            )
        global_batches = int(state["global_batches_in_epoch"])
        if global_batches % self.world_size:
            raise CheckpointError(
                f"the checkpoint stopped after {global_batches} global batches of epoch {state['epoch']} (world size "
                f"{state['world_size']}), not a multiple of world_size={self.world_size}; resume with a world size "
                f"that divides {global_batches}"
            )
        # A changed world size is fine: the global batch sequence does not depend on it.
        self.epoch = int(state["epoch"])
        self._plans = {}
        self._step = global_batches // self.world_size
        if self._step >= self.plan().num_steps:
            self._advance_epoch()
        self._cursor_moved()

    def _cursor_moved(self) -> None:
        """Called after :meth:`load_state_dict` moved the cursor (subclasses drop their read-ahead)."""

    def describe(self) -> dict[str, Any]:
        """Resolved loader settings for ``run.json``."""
        return {
            "config": self.config.plan_fields()
            | {
                "prefetch_batches": self.config.prefetch_batches,
                "num_read_workers": read_workers(self.config),
            },
            "boundaries": list(self.boundaries),
            "validation_split": self.split_by,  # what the split went by ("document", "row"; None: no split)
            "num_samples": self.num_samples,
            "num_tokens": self.num_tokens,
            "excluded_short_samples": self.num_excluded_short,
            "excluded_short_tokens": self.num_excluded_short_tokens,
            "rank": self.rank,
            "world_size": self.world_size,
            "table_fingerprint": self.table_fingerprint,
        }
