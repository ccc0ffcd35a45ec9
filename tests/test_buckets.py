"""Length buckets, token-budget batches and bucket-balanced mixing, on real token lengths.

The lengths are those of stdlib function sources under the real SmolLM2 tokenizer (a long-tailed distribution
like chat data: many short samples, a few long ones).
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from dflash.batches.buckets import (
    BucketConfig,
    RealizedShares,
    assign_buckets,
    bucket_table,
    plan_epoch,
    quantile_boundaries,
    realized_token_shares,
    render_bucket_table,
)
from dflash.errors import ConfigError

BUDGET = 2048


@pytest.fixture(scope="module")
def lengths(tokenizer) -> np.ndarray:
    import argparse
    import collections
    import email.message
    import json.decoder
    import textwrap
    import typing

    texts = []
    for module in (inspect, argparse, typing, collections, email.message, json.decoder, textwrap):
        for _, member in sorted(inspect.getmembers(module, inspect.isfunction)):
            if member.__module__ == module.__name__:
                texts.append(inspect.getsource(member))
        for _, cls in sorted(inspect.getmembers(module, inspect.isclass)):
            if cls.__module__ == module.__name__:
                for _, method in sorted(vars(cls).items()):
                    if inspect.isfunction(method):
                        texts.append(inspect.getsource(method))
    counts = np.array([len(ids) for ids in tokenizer(texts).input_ids], dtype=np.int64)
    assert counts.size > 200
    return np.minimum(counts, BUDGET)


def _plan(lengths, *, seed=0, epoch=0, world_size=1, num_buckets=4, **kwargs):
    edges = quantile_boundaries(lengths, num_buckets)
    buckets = assign_buckets(lengths, edges)
    plan = plan_epoch(
        lengths,
        buckets,
        num_buckets=len(edges) + 1,
        token_budget=BUDGET,
        seed=seed,
        epoch=epoch,
        world_size=world_size,
        **kwargs,
    )
    return plan, buckets


def test_quantile_boundaries_split_samples_evenly(lengths):
    edges = quantile_boundaries(lengths, 4)
    assert len(edges) == 3 and list(edges) == sorted(set(edges))
    buckets = assign_buckets(lengths, edges)
    counts = np.bincount(buckets, minlength=4)
    assert counts.min() >= 0.2 * lengths.size  # ~25% each, ties at an edge shift a few samples
    for bucket, (low, high) in enumerate(zip((0, *edges), (*edges, np.inf), strict=True)):
        members = lengths[buckets == bucket]
        assert members.min() > low and members.max() <= high
    assert quantile_boundaries(lengths, 1) == ()
    assert quantile_boundaries(np.full(50, 7), 4) == ()  # one repeated length -> one bucket


def test_every_sample_once_within_budget_and_one_bucket_per_batch(lengths):
    plan, buckets = _plan(lengths)
    seen = np.concatenate([batch.samples for batch in plan.batches])
    assert np.array_equal(np.sort(seen), np.arange(lengths.size))
    for batch in plan.batches:
        assert batch.num_tokens == lengths[batch.samples].sum() <= BUDGET
        assert set(buckets[batch.samples].tolist()) == {batch.bucket}
    rows = bucket_table(lengths, buckets, plan, BUDGET)
    # first-fit inside a length bucket wastes little of the budget, except in the last few batches
    busy = [row for row in rows if row.num_batches >= 5]
    assert busy and all(row.fill > 0.8 for row in busy)


def test_realized_shares_over_every_window_match_corpus_shares(lengths):
    """Tolerance: over any window, a bucket's tokens differ from its corpus share by at most 2 token budgets."""
    plan, buckets = _plan(lengths, seed=3)
    corpus_share = np.bincount(buckets, weights=lengths) / lengths.sum()
    ids = [batch.bucket for batch in plan.batches]
    tokens = [batch.num_tokens for batch in plan.batches]
    for window in (4, 8, 16, 32):
        for start in range(len(ids) - window + 1):
            realized = realized_token_shares(ids[start : start + window], tokens[start : start + window], 4)
            window_tokens = sum(tokens[start : start + window])
            assert np.all(np.abs(realized - corpus_share) * window_tokens <= 2 * BUDGET), (window, start)
    # the whole epoch reproduces the corpus shares exactly (every sample once)
    assert np.allclose(realized_token_shares(ids, tokens, 4), corpus_share)


def test_plan_is_a_function_of_seed_and_epoch(lengths):
    def order(plan):
        return [batch.samples.tolist() for batch in plan.batches]

    assert order(_plan(lengths, seed=1, epoch=2)[0]) == order(_plan(lengths, seed=1, epoch=2)[0])
    assert order(_plan(lengths, seed=1, epoch=2)[0]) != order(_plan(lengths, seed=1, epoch=3)[0])
    assert order(_plan(lengths, seed=1, epoch=2)[0]) != order(_plan(lengths, seed=2, epoch=2)[0])
    unshuffled = _plan(lengths, shuffle=False)[0]
    assert order(unshuffled) == order(_plan(lengths, seed=9, epoch=4, shuffle=False)[0])


@pytest.mark.parametrize("world_size", [2, 3, 8])
def test_ddp_ranks_are_disjoint_and_cover_the_global_sequence(lengths, world_size):
    single, _ = _plan(lengths, seed=4)
    plan, _ = _plan(lengths, seed=4, world_size=world_size)
    assert plan.num_dropped_batches == len(single.batches) % world_size < world_size
    per_rank = [plan.rank_batches(rank) for rank in range(world_size)]
    assert all(len(batches) == plan.num_steps for batches in per_rank)
    for step in range(plan.num_steps):
        for rank in range(world_size):
            assert plan.batch(step, rank) is plan.batches[step * world_size + rank]
            assert (
                plan.batch(step, rank).samples.tolist()
                == single.batches[step * world_size + rank].samples.tolist()
            )
    taken = np.concatenate([b.samples for batches in per_rank for b in batches] + [plan.dropped_samples])
    assert np.array_equal(np.sort(taken), np.arange(lengths.size))
    with pytest.raises(ConfigError, match="rank"):
        plan.batch(0, world_size)


def test_document_cap_and_read_groups_are_respected(lengths):
    plan, _ = _plan(lengths, max_documents_per_batch=3)
    assert max(len(batch.samples) for batch in plan.batches) == 3
    groups = np.array_split(np.arange(lengths.size), 5)
    grouped, _ = _plan(lengths, groups=groups)
    group_of = np.repeat(np.arange(5), [g.size for g in groups])
    last_group = -1
    for batch in grouped.batches:
        (group,) = set(group_of[batch.samples].tolist())
        assert group >= last_group  # groups are planned one after the other
        last_group = group


def test_too_long_samples_and_bad_configs_are_refused(lengths):
    with pytest.raises(ConfigError, match="token_budget"):
        plan_epoch(lengths, np.zeros_like(lengths), num_buckets=1, token_budget=16, seed=0, epoch=0)
    with pytest.raises(ConfigError, match="boundaries"):
        BucketConfig(boundaries=(512, 256))
    with pytest.raises(ConfigError, match="token_budget"):
        BucketConfig(token_budget=0)
    with pytest.raises(ConfigError, match="num_buckets"):
        BucketConfig(num_buckets=0)
    assert BucketConfig(boundaries=[64, 256]).boundaries == (64, 256)


def test_realized_share_window_for_training_logs(lengths):
    plan, buckets = _plan(lengths, seed=5)
    tracker = RealizedShares(4, window=16)
    for batch in plan.batches:
        tracker.update(batch.bucket, batch.num_tokens)
    last = plan.batches[-16:]
    expected = realized_token_shares([b.bucket for b in last], [b.num_tokens for b in last], 4)
    assert np.allclose(tracker.shares(), expected)
    assert tracker.counts.sum() == len(plan.batches)
    table = render_bucket_table(bucket_table(lengths, buckets, plan, BUDGET))
    assert table.row_count == 4
