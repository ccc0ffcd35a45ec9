"""Length buckets, token-budget batches and bucket-balanced mixing: the epoch plan, computed from lengths only.

An epoch plan is a sequence of batches, each a list of sample indices from one length bucket whose total length
fits a token budget. Three steps, all deterministic given ``(seed, epoch)``:

1. Buckets: a sample of length L falls in bucket b when ``boundaries[b-1] < L <= boundaries[b]`` (the last bucket
   is open above). Default boundaries are the cache's length quantiles (:func:`quantile_boundaries`).
2. Token-budget batches inside a bucket: samples in shuffled order, placed first-fit into a few open batches
   whose real tokens stay <= ``token_budget`` (similar lengths pack with little waste, order stays random).
3. Mixing: the buckets' batch lists are merged by earliest finishing fraction (a smooth weighted round-robin /
   stride schedule, as in WF2Q and Linux CFS): the next batch comes from the bucket whose token count *after*
   this batch is the smallest fraction of its epoch total. So after any prefix of the epoch each bucket has
   emitted its corpus token share to within one batch, and over every window of steps the realized token
   share of each bucket stays within ``2 * token_budget / window_tokens`` of its corpus share. No long runs of
   one bucket; short and long samples stay mixed in every stretch of training.

Data parallel: the mixed sequence is cut into steps of ``world_size`` consecutive batches; rank r takes batch r
of every step, so ranks read disjoint batches and every step gives each rank one. The last ``len % world_size``
batches of an epoch are dropped (counted in :attr:`EpochPlan.num_dropped_batches`); samples are reshuffled every
epoch so no sample is dropped for good. The sequence of batches does not depend on ``world_size``: one process
with gradient accumulation over ``world_size`` micro-batches sees the same global batches as DDP.

Legend: N = samples in the table, K = buckets.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from dflash.errors import ConfigError

__all__ = [
    "BucketConfig",
    "PlannedBatch",
    "EpochPlan",
    "BucketRow",
    "quantile_boundaries",
    "assign_buckets",
    "plan_epoch",
    "bucket_table",
    "render_bucket_table",
    "realized_token_shares",
    "RealizedShares",
]

#: Open batches per bucket during first-fit packing: enough to fill budgets tightly, few enough to keep order random.
_OPEN_BATCHES = 8


@dataclass(kw_only=True, slots=True)
class BucketConfig:
    """How samples are grouped into length buckets and token-budget batches."""

    token_budget: int = field(default=16384, metadata={"help": "Real tokens per micro-batch per rank (on a CPU host, when nothing sets it: the cpu-small preset's)."})
    """Maximum real tokens per batch (per rank, per micro-step). A sample longer than this is an error."""
    boundaries: tuple[int, ...] | None = field(default=None, metadata={"help": "Bucket edges, e.g. 256,1024.", "option": "--bucket-boundaries"})
    """Upper length edges (inclusive) of every bucket but the last, strictly increasing; ``None``: quantiles."""
    num_buckets: int = field(default=4, metadata={"help": "Length buckets from quantiles."})
    """Buckets made from length quantiles when ``boundaries`` is ``None`` (fewer if lengths repeat)."""
    max_documents_per_batch: int | None = field(default=None, metadata={"help": "Documents per micro-batch cap."})
    """Cap on documents packed into one batch (``None``: only the token budget limits it)."""

    def __post_init__(self) -> None:
        if isinstance(self.boundaries, list):
            self.boundaries = tuple(self.boundaries)
        if not isinstance(self.token_budget, int) or self.token_budget < 1:
            raise ConfigError(
                f"token_budget must be a positive int (tokens per batch); got {self.token_budget!r}"
            )
        if not isinstance(self.num_buckets, int) or self.num_buckets < 1:
            raise ConfigError(f"num_buckets must be a positive int; got {self.num_buckets!r}")
        if self.boundaries is not None:
            edges = self.boundaries
            if any(not isinstance(e, (int, np.integer)) or e < 1 for e in edges) or any(
                b <= a for a, b in zip(edges, edges[1:], strict=False)
            ):
                raise ConfigError(
                    f"boundaries must be strictly increasing positive token lengths; got {list(edges)}"
                )
        if self.max_documents_per_batch is not None and self.max_documents_per_batch < 1:
            raise ConfigError(
                f"max_documents_per_batch must be >= 1 or None; got {self.max_documents_per_batch!r}"
            )


@dataclass(frozen=True, slots=True)
class PlannedBatch:
    """One batch of the plan: sample indices (into the loader's sample table), in packing order."""

    bucket: int
    samples: np.ndarray
    num_tokens: int


@dataclass(slots=True)
class EpochPlan:
    """The mixed batch sequence of one epoch, cut into steps of ``world_size`` batches."""

    epoch: int
    seed: int
    world_size: int
    batches: list[PlannedBatch]
    num_buckets: int
    num_dropped_batches: int = 0
    dropped_samples: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def num_steps(self) -> int:
        """Steps in the epoch; each gives every rank one batch."""
        return len(self.batches) // self.world_size

    def batch(self, step: int, rank: int) -> PlannedBatch:
        """The batch rank ``rank`` reads at step ``step`` (0-based within the epoch)."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank must be in [0, {self.world_size}); got {rank}")
        if not 0 <= step < self.num_steps:
            raise IndexError(f"step {step} outside the epoch's {self.num_steps} steps")
        return self.batches[step * self.world_size + rank]

    def rank_batches(self, rank: int) -> list[PlannedBatch]:
        """Every batch rank ``rank`` reads this epoch, in order."""
        return [self.batch(step, rank) for step in range(self.num_steps)]


def quantile_boundaries(lengths: np.ndarray, num_buckets: int) -> tuple[int, ...]:
    """Bucket edges at the ``1/K .. (K-1)/K`` quantiles of ``lengths`` (samples, not tokens), deduplicated.

    Args:
        lengths: ``[N]`` int sample lengths in tokens.
        num_buckets: K, the number of buckets wanted.

    Returns:
        Up to K-1 strictly increasing upper edges (inclusive); fewer when lengths repeat, none for K = 1.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if num_buckets <= 1 or lengths.size == 0:
        return ()
    quantiles = np.quantile(lengths, np.arange(1, num_buckets) / num_buckets, method="lower")
    edges = sorted({int(q) for q in quantiles if q < lengths.max()})
    return tuple(edges)


def assign_buckets(lengths: np.ndarray, boundaries: Sequence[int]) -> np.ndarray:
    """Bucket of each sample: ``[N]`` int64 in ``0..len(boundaries)`` (``L <= boundaries[b]`` picks the first b)."""
    return np.searchsorted(
        np.asarray(boundaries, dtype=np.int64), np.asarray(lengths, dtype=np.int64), side="left"
    )


def _pack_bucket(
    order: np.ndarray, lengths: np.ndarray, token_budget: int, max_documents: int | None
) -> list[tuple[list[int], int]]:
    """First-fit of ``order`` (sample indices, shuffled) into batches of <= ``token_budget`` tokens."""
    closed: list[tuple[list[int], int]] = []
    open_batches: list[tuple[list[int], int]] = []
    for index in order.tolist():
        length = int(lengths[index])
        for slot, (members, used) in enumerate(open_batches):
            if used + length <= token_budget and (max_documents is None or len(members) < max_documents):
                members.append(index)
                open_batches[slot] = (members, used + length)
                break
        else:
            if len(open_batches) == _OPEN_BATCHES:
                fullest = max(range(len(open_batches)), key=lambda slot: open_batches[slot][1])
                closed.append(open_batches.pop(fullest))
            open_batches.append(([index], length))
    # Closed batches in closing order, then the still-open ones in opening order: a function of `order` alone.
    return closed + open_batches


def _interleave(per_bucket: list[list[PlannedBatch]]) -> list[PlannedBatch]:
    """Merge bucket batch lists by earliest finishing fraction of each bucket's token total (see module doc)."""
    totals = [sum(b.num_tokens for b in batches) for batches in per_bucket]
    emitted = [0] * len(per_bucket)
    position = [0] * len(per_bucket)
    heap = [(batches[0].num_tokens / totals[k], k) for k, batches in enumerate(per_bucket) if batches]
    heapq.heapify(heap)
    merged: list[PlannedBatch] = []
    while heap:
        _, k = heapq.heappop(heap)
        batch = per_bucket[k][position[k]]
        merged.append(batch)
        emitted[k] += batch.num_tokens
        position[k] += 1
        if position[k] < len(per_bucket[k]):
            heapq.heappush(heap, ((emitted[k] + per_bucket[k][position[k]].num_tokens) / totals[k], k))
    return merged


def plan_epoch(
    lengths: np.ndarray,
    buckets: np.ndarray,
    *,
    num_buckets: int,
    token_budget: int,
    seed: int,
    epoch: int,
    world_size: int = 1,
    shuffle: bool = True,
    max_documents_per_batch: int | None = None,
    groups: Sequence[np.ndarray] | None = None,
) -> EpochPlan:
    """Plan one epoch from lengths alone (no hidden state is touched).

    Args:
        lengths: ``[N]`` int sample lengths; every one must be <= ``token_budget``.
        buckets: ``[N]`` bucket of each sample (:func:`assign_buckets`), values in ``0..num_buckets-1``.
        num_buckets: K.
        token_budget: maximum real tokens per batch.
        seed, epoch: the plan is a pure function of these (and the other arguments); a new epoch reshuffles.
        world_size: ranks; the batch sequence is cut into steps of this many batches.
        shuffle: ``False`` keeps sample order (validation); mixing still applies.
        max_documents_per_batch: optional cap on documents per batch.
        groups: optional partition of the sample indices into consecutive read windows (e.g. a few cache
            shards each); batches never mix samples of two groups, groups are planned in the given order.
            ``None``: one group of all samples.

    Returns:
        The :class:`EpochPlan`.

    Raises:
        ConfigError: a sample is longer than ``token_budget``, or ``world_size`` < 1.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    buckets = np.asarray(buckets, dtype=np.int64)
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1; got {world_size}")
    too_long = np.flatnonzero(lengths > token_budget)
    if too_long.size:
        raise ConfigError(
            f"{too_long.size} sample(s) are longer than token_budget={token_budget} (first: sample {too_long[0]} "
            f"with {lengths[too_long[0]]} tokens); raise token_budget to at least {lengths.max()} or cap the "
            "corpus length at prepare time"
        )
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(epoch)]))
    if groups is None:
        groups = [np.arange(lengths.size)]
    merged: list[PlannedBatch] = []
    for group in groups:
        group = np.asarray(group, dtype=np.int64)
        per_bucket: list[list[PlannedBatch]] = []
        for bucket in range(num_buckets):
            members = group[buckets[group] == bucket]
            if shuffle:
                members = rng.permutation(members)
            packed = _pack_bucket(members, lengths, token_budget, max_documents_per_batch)
            per_bucket.append(
                [PlannedBatch(bucket, np.asarray(idx, dtype=np.int64), int(used)) for idx, used in packed]
            )
        merged.extend(_interleave(per_bucket))
    keep = len(merged) - len(merged) % world_size
    dropped = merged[keep:]
    dropped_samples = np.concatenate([b.samples for b in dropped]) if dropped else np.zeros(0, dtype=np.int64)
    return EpochPlan(
        epoch=int(epoch),
        seed=int(seed),
        world_size=world_size,
        batches=merged[:keep],
        num_buckets=num_buckets,
        num_dropped_batches=len(dropped),
        dropped_samples=dropped_samples,
    )


@dataclass(frozen=True, slots=True)
class BucketRow:
    """One line of the bucket table logged at the start of training."""

    bucket: int
    min_length: int
    max_length: int
    num_samples: int
    num_tokens: int
    token_share: float
    num_batches: int
    batch_share: float
    fill: float
    """Real tokens / (batches * token_budget): how full this bucket's batches are."""


def bucket_table(
    lengths: np.ndarray, buckets: np.ndarray, plan: EpochPlan, token_budget: int
) -> list[BucketRow]:
    """Per-bucket samples, tokens, corpus token share, planned batches and fill, for logging."""
    lengths = np.asarray(lengths, dtype=np.int64)
    buckets = np.asarray(buckets, dtype=np.int64)
    total_tokens = max(int(lengths.sum()), 1)
    batch_counts = np.bincount([b.bucket for b in plan.batches], minlength=plan.num_buckets)
    rows = []
    for bucket in range(plan.num_buckets):
        member_lengths = lengths[buckets == bucket]
        tokens = int(member_lengths.sum())
        num_batches = int(batch_counts[bucket])
        rows.append(
            BucketRow(
                bucket=bucket,
                min_length=int(member_lengths.min()) if member_lengths.size else 0,
                max_length=int(member_lengths.max()) if member_lengths.size else 0,
                num_samples=int(member_lengths.size),
                num_tokens=tokens,
                token_share=tokens / total_tokens,
                num_batches=num_batches,
                batch_share=num_batches / max(len(plan.batches), 1),
                fill=sum(b.num_tokens for b in plan.batches if b.bucket == bucket)
                / max(num_batches * token_budget, 1),
            )
        )
    return rows


def render_bucket_table(rows: Sequence[BucketRow], title: str = "length buckets"):
    """A :class:`rich.table.Table` of :func:`bucket_table` rows."""
    from rich.table import Table

    table = Table(title=title)
    for name in ("bucket", "lengths", "samples", "tokens", "token share", "batches", "batch share", "fill"):
        table.add_column(name, justify="right")
    for row in rows:
        table.add_row(
            str(row.bucket),
            f"{row.min_length}-{row.max_length}",
            f"{row.num_samples:,}",
            f"{row.num_tokens:,}",
            f"{row.token_share:.1%}",
            f"{row.num_batches:,}",
            f"{row.batch_share:.1%}",
            f"{row.fill:.1%}",
        )
    return table


def realized_token_shares(
    bucket_ids: Sequence[int], num_tokens: Sequence[int], num_buckets: int
) -> np.ndarray:
    """``[K]`` share of tokens per bucket among the given batches (zeros when there are none)."""
    totals = np.bincount(
        np.asarray(bucket_ids, dtype=np.int64), weights=np.asarray(num_tokens), minlength=num_buckets
    )
    return totals / totals.sum() if totals.sum() > 0 else totals


class RealizedShares:
    """Sliding window over the last ``window`` batches: realized token share per bucket, for training logs."""

    def __init__(self, num_buckets: int, window: int = 100) -> None:
        if window < 1:
            raise ConfigError(f"window must be >= 1 batches; got {window}")
        self.num_buckets = num_buckets
        self._recent: deque[tuple[int, int]] = deque(maxlen=window)
        self.counts = np.zeros(num_buckets, dtype=np.int64)
        """Batches seen per bucket since creation (cumulative)."""

    def update(self, bucket_id: int, num_tokens: int) -> None:
        """Record one batch of bucket ``bucket_id`` with ``num_tokens`` real tokens."""
        self._recent.append((int(bucket_id), int(num_tokens)))
        if 0 <= bucket_id < self.num_buckets:
            self.counts[bucket_id] += 1

    def shares(self) -> np.ndarray:
        """``[K]`` token share of each bucket over the window."""
        known = [(b, t) for b, t in self._recent if 0 <= b < self.num_buckets]
        return realized_token_shares([b for b, _ in known], [t for _, t in known], self.num_buckets)
