"""The streaming loader on a real cache: hidden states of the real SmolLM2 target on stdlib source snippets.

The cache is written through ``HiddenStateCache`` from the extract stage's ``TargetRunner`` (taps =
``hidden_states[l + 1]``), so these tests exercise the real Zarr reader end to end.
"""

from __future__ import annotations

import inspect
import json
import os
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from dflash.batches.packed import pack_samples
from dflash.batches.stream import StreamConfig, StreamingLoader, _ShardCache, validation_rows
from dflash.cache import CacheMetadata, CacheReader, HiddenSample, HiddenStateCache
from dflash.errors import CacheCorruptError, CheckpointError, ConfigError
from dflash.target.runner import TargetRunner
from dflash.target.taps import LAYER_ID_CONVENTION

NUM_SHARDS = 4
ROWS_PER_SHARD = 9
BUDGET = 256


def _snippets(count: int) -> list[str]:
    """Source of stdlib functions, in a fixed order (real text of varied length)."""
    import functools
    import json as json_module

    texts = []
    for module in (textwrap, functools, json_module.decoder, inspect):
        for _, function in sorted(inspect.getmembers(module, inspect.isfunction)):
            if function.__module__ == module.__name__:
                texts.append(inspect.getsource(function))
    return texts[:count]


@pytest.fixture(scope="module")
def cache_path(target, tmp_path_factory):
    """A 4-shard bf16 cache of 36 stdlib snippets (8..157 tokens), taps 1 and 3 of the real target."""
    tokenizer = target.tokenizer
    layer_ids = [1, 3]
    hidden_size = target.model.config.hidden_size
    texts = _snippets(NUM_SHARDS * ROWS_PER_SHARD)
    assert len(texts) == NUM_SHARDS * ROWS_PER_SHARD
    token_ids = [tokenizer(text).input_ids[: 8 + (row * 37) % 150] for row, text in enumerate(texts)]
    # The extract stage's runner: stops after the last tap, so early taps keep this fixture cheap on CPU.
    hidden = TargetRunner(target.model, layer_ids, "cpu", token_budget=2048).run(token_ids)
    samples = []
    for row, (ids, taps) in enumerate(zip(token_ids, hidden, strict=True)):
        loss_mask = torch.zeros(len(ids), dtype=torch.uint8)
        loss_mask[len(ids) // 4 :] = 1  # the "response" part of each snippet
        samples.append(HiddenSample(row, torch.tensor(ids, dtype=torch.int32), loss_mask, taps))
    path = tmp_path_factory.mktemp("stream") / "cache.zarr"
    metadata = CacheMetadata(
        target=target.identity.to_dict(),
        target_spec="default",
        target_layer_ids=layer_ids,
        layer_id_convention=LAYER_ID_CONVENTION,
        hidden_size=hidden_size,
        num_taps=len(layer_ids),
        corpus_fingerprint="sha256:stdlib-snippets",
        num_shards=NUM_SHARDS,
        shard_rows=[[s * ROWS_PER_SHARD, (s + 1) * ROWS_PER_SHARD] for s in range(NUM_SHARDS)],
    )
    cache = HiddenStateCache.create(path, metadata)
    for shard in range(NUM_SHARDS):
        cache.write_shard(shard, samples[shard * ROWS_PER_SHARD : (shard + 1) * ROWS_PER_SHARD], [])
    return path


@pytest.fixture()
def reader(cache_path):
    return CacheReader(cache_path)


def _fingerprint(batch) -> tuple:
    """Everything a batch holds, as comparable bytes."""
    return (
        batch.bucket_id,
        tuple(batch.corpus_rows),
        batch.num_real_tokens,
        *(
            getattr(batch, name).contiguous().view(torch.uint8).numpy().tobytes()
            for name in batch._TENSOR_FIELDS
        ),
    )


def _epoch(loader) -> list:
    return [_fingerprint(batch) for batch in loader]


def test_batches_hold_exactly_the_cached_samples(reader):
    loader = StreamingLoader(reader, StreamConfig(token_budget=BUDGET, num_buckets=3, seed=1))
    everything = {s.corpus_row: s for shard in reader.shards for s in reader.read_shard(shard)}
    seen = []
    for batch in loader:
        assert batch.num_real_tokens <= BUDGET
        assert batch.input_ids.dtype == torch.int64 and batch.hidden.dtype == torch.bfloat16
        for doc, row in enumerate(batch.corpus_rows):
            a, b = int(batch.cu_seqlens[doc]), int(batch.cu_seqlens[doc + 1])
            sample = everything[row]
            assert torch.equal(batch.input_ids[a:b], sample.input_ids.long())
            assert torch.equal(batch.loss_mask[a:b], sample.loss_mask)
            assert torch.equal(batch.hidden[a:b].view(torch.int16), sample.hidden.view(torch.int16))
            assert torch.equal(batch.position_ids[a:b], torch.arange(b - a))
            assert bool((batch.document_ids[a:b] == doc).all())
        seen.extend(batch.corpus_rows)
    assert sorted(seen) == list(range(NUM_SHARDS * ROWS_PER_SHARD))
    assert loader.epoch == 1 and loader.step_in_epoch == 0


def test_same_seed_and_epoch_give_the_same_batches_and_epochs_reshuffle(reader, cache_path):
    config = StreamConfig(token_budget=BUDGET, seed=7)
    first = StreamingLoader(reader, config)
    second = StreamingLoader(CacheReader(cache_path), config)
    epoch0 = _epoch(first)
    assert epoch0 == _epoch(second)
    epoch1 = _epoch(first)
    assert [fp[1] for fp in epoch1] != [fp[1] for fp in epoch0]
    other_seed = StreamingLoader(reader, StreamConfig(token_budget=BUDGET, seed=8))
    assert [fp[1] for fp in _epoch(other_seed)] != [fp[1] for fp in epoch0]


@pytest.mark.parametrize("stop_after", [1, 3, "epoch_end"])
def test_resume_continues_with_exactly_the_next_batch(reader, cache_path, stop_after):
    config = StreamConfig(token_budget=BUDGET, seed=3, prefetch_batches=2)
    straight = StreamingLoader(reader, config)
    reference = _epoch(straight) + _epoch(straight)

    interrupted = StreamingLoader(reader, config)
    taken = []
    limit = len(interrupted) if stop_after == "epoch_end" else stop_after
    for batch in interrupted:  # leaves the loop early, as a trainer stopping to checkpoint does
        taken.append(_fingerprint(batch))
        if len(taken) == limit:
            break
    state = json.loads(json.dumps(interrupted.state_dict()))
    interrupted.close()

    resumed = StreamingLoader(CacheReader(cache_path), config)
    resumed.load_state_dict(state)
    rest = _epoch(resumed)
    if stop_after == "epoch_end":
        assert rest == reference[limit:]  # state at the epoch's end resumes in the next epoch
    else:
        rest += _epoch(resumed)
        assert taken + rest == reference


def test_resume_with_a_changed_plan_config_is_refused(reader):
    loader = StreamingLoader(reader, StreamConfig(token_budget=BUDGET, seed=3))
    next(iter(loader))
    state = loader.state_dict()
    changed = StreamingLoader(reader, StreamConfig(token_budget=BUDGET + 64, seed=3))
    with pytest.raises(CheckpointError, match="token_budget"):
        changed.load_state_dict(state)
    reseeded = StreamingLoader(reader, StreamConfig(token_budget=BUDGET, seed=4))
    with pytest.raises(CheckpointError, match="seed"):
        reseeded.load_state_dict(state)


def test_ddp_ranks_read_disjoint_batches_covering_the_global_sequence(reader):
    config = StreamConfig(token_budget=BUDGET, seed=5)
    single = StreamingLoader(reader, config)
    global_batches = _epoch(single)
    ranks = [StreamingLoader(reader, config, rank=r, world_size=3) for r in range(3)]
    per_rank = [_epoch(loader) for loader in ranks]
    assert len({len(batches) for batches in per_rank}) == 1  # every step gives every rank a batch
    num_steps = len(per_rank[0])
    for step in range(num_steps):
        for rank in range(3):
            assert per_rank[rank][step] == global_batches[step * 3 + rank]
    rows = [row for batches in per_rank for fp in batches for row in fp[1]]
    assert len(rows) == len(set(rows))  # disjoint
    dropped = ranks[0].plan(0).dropped_samples
    assert len(global_batches) - 3 * num_steps == ranks[0].plan(0).num_dropped_batches
    assert sorted(rows + ranks[0].sample_row[dropped].tolist()) == list(range(NUM_SHARDS * ROWS_PER_SHARD))


def test_ddp_resume_with_another_world_size_keeps_the_global_order(reader):
    config = StreamConfig(token_budget=BUDGET, seed=5)
    global_batches = _epoch(StreamingLoader(reader, config))
    two = StreamingLoader(reader, config, rank=1, world_size=2)
    iterator = iter(two)
    next(iterator)
    next(iterator)
    iterator.close()
    state = two.state_dict()  # 2 steps x 2 ranks = 4 global batches
    one = StreamingLoader(reader, config)
    one.load_state_dict(state)
    assert _epoch(one) == global_batches[4:]
    three = StreamingLoader(reader, config, rank=0, world_size=3)
    with pytest.raises(CheckpointError, match="multiple of world_size=3"):
        three.load_state_dict(state)
    with pytest.raises(ConfigError, match="fewer than world_size=64"):
        StreamingLoader(reader, config, world_size=64).plan()


class _CountingSource:
    """Wraps a reader; counts samples being read concurrently and reads per shard."""

    def __init__(self, reader):
        self.reader = reader
        self.lock = threading.Lock()
        self.reading = 0
        self.max_reading = 0
        self.whole_shard_reads: dict[int, int] = {}

    shards = property(lambda self: self.reader.shards)

    def shard_lengths(self, shard):
        return self.reader.shard_lengths(shard)

    def shard_corpus_rows(self, shard):
        return self.reader.shard_corpus_rows(shard)

    def read_shard(self, shard, indices=None):
        count = len(self.reader.shard_lengths(shard)) if indices is None else len(indices)
        with self.lock:
            self.reading += count
            self.max_reading = max(self.max_reading, self.reading)
            if indices is None:
                self.whole_shard_reads[shard] = self.whole_shard_reads.get(shard, 0) + 1
        try:
            return self.reader.read_shard(shard, indices)
        finally:
            with self.lock:
                self.reading -= count


def test_memory_stays_within_the_prefetch_bound(reader):
    source = _CountingSource(reader)
    config = StreamConfig(token_budget=BUDGET, prefetch_batches=2, num_read_workers=2, boundaries=(40, 120))
    loader = StreamingLoader(source, config)
    max_docs = max(len(b.samples) for b in loader.plan().batches)
    for _ in loader:
        assert loader.stats.batches_in_flight <= loader.max_batches_in_flight
    stats = loader.stats
    assert stats.batches == len(loader.plan(0).batches)
    assert 1 <= stats.max_batches_in_flight <= config.prefetch_batches + 1
    assert stats.max_tokens_in_flight <= (config.prefetch_batches + 1) * BUDGET
    assert source.max_reading <= config.num_read_workers * max_docs
    # at the epoch's end only the next epoch's read-ahead is in flight; close() releases it
    assert stats.batches_in_flight <= config.prefetch_batches
    loader.close()
    assert stats.batches_in_flight == 0 and stats.tokens_in_flight == 0


def test_read_threads_change_nothing_but_how_many_reads_overlap(reader, monkeypatch):
    """``num_read_workers``: the same batches, bit for bit, whatever the thread count; more threads read more
    batches at once (bounded by ``prefetch_batches``); ``None`` resolves to half the usable CPUs within [2, 8]."""
    from dflash.batches.source import LoaderConfig, read_workers

    def run(workers):
        source = _CountingSource(reader)
        loader = StreamingLoader(source, StreamConfig(token_budget=BUDGET, prefetch_batches=4, seed=3,
                                                      num_read_workers=workers, boundaries=(40, 120)))
        batches = [(list(b.corpus_rows), b.input_ids.clone(), b.hidden.clone()) for b in loader]
        threads = {t.name for t in threading.enumerate() if t.name.startswith("dflash-stream")}
        loader.close()
        return batches, source.max_reading, len(threads), loader.describe()["config"]["num_read_workers"]

    one, one_reading, one_threads, one_described = run(1)
    three, _, three_threads, three_described = run(3)
    assert len(one) == len(three) > 3
    for (rows_a, ids_a, hidden_a), (rows_b, ids_b, hidden_b) in zip(one, three, strict=True):
        assert rows_a == rows_b and torch.equal(ids_a, ids_b) and torch.equal(hidden_a, hidden_b)
    assert one_threads == one_described == 1 and three_threads <= three_described == 3
    assert one_reading <= max(len(rows) for rows, _, _ in one)  # one thread: one batch's samples at a time
    with pytest.raises(ConfigError, match="num_read_workers must be >= 1"):
        LoaderConfig(num_read_workers=0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert read_workers(LoaderConfig()) == 8
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert read_workers(LoaderConfig()) == 2 and read_workers(LoaderConfig(num_read_workers=5)) == 5


def test_shard_window_reads_each_shard_once_and_mixes_inside_windows(reader):
    source = _CountingSource(reader)
    config = StreamConfig(token_budget=BUDGET, shard_window=2, seed=2, num_read_workers=1, prefetch_batches=2)
    loader = StreamingLoader(source, config)
    batches = list(loader)
    assert source.whole_shard_reads == {shard: 1 for shard in range(NUM_SHARDS)}  # once per epoch each
    assert loader.shard_cache.reads == NUM_SHARDS and len(loader.shard_cache) <= 2
    shard_of_row = {row: row // ROWS_PER_SHARD for row in range(NUM_SHARDS * ROWS_PER_SHARD)}
    windows = [frozenset(shard_of_row[row] for row in b.corpus_rows) for b in batches]
    assert all(len(w) <= 2 for w in windows)
    # a window's shards are finished before the next window starts
    order = [w for i, w in enumerate(windows) if i == 0 or w != windows[i - 1]]
    assert sum(len(w) for w in order) >= NUM_SHARDS


def test_validation_split_is_stable_disjoint_and_by_corpus_row(reader):
    rows = np.arange(NUM_SHARDS * ROWS_PER_SHARD)
    train = StreamingLoader(reader, StreamConfig(token_budget=BUDGET, validation_fraction=0.25, seed=1))
    valid = StreamingLoader(
        reader,
        StreamConfig(
            token_budget=BUDGET, validation_fraction=0.25, seed=9, split="validation", shuffle=False
        ),
    )
    train_rows, valid_rows = set(train.sample_row.tolist()), set(valid.sample_row.tolist())
    assert train_rows.isdisjoint(valid_rows) and train_rows | valid_rows == set(rows.tolist())
    assert valid_rows == set(rows[validation_rows(rows, 0.25)].tolist())
    assert 0 < len(valid_rows) < len(rows)
    # a larger corpus keeps every earlier row in its split (the hash depends on the row alone)
    assert np.array_equal(validation_rows(np.arange(10_000), 0.25)[: rows.size], validation_rows(rows, 0.25))
    assert abs(validation_rows(np.arange(10_000), 0.25).mean() - 0.25) < 0.02
    assert sorted(row for b in valid for row in b.corpus_rows) == sorted(valid_rows)


def test_padding_to_the_budget_gives_fixed_shapes(reader):
    loader = StreamingLoader(reader, StreamConfig(token_budget=BUDGET, pad_to_budget=True))
    for batch in loader:
        assert batch.num_tokens == BUDGET
        pad = slice(batch.num_real_tokens, None)
        assert bool((batch.loss_mask[pad] == 0).all()) and bool((batch.document_ids[pad] == -1).all())
        assert int(batch.cu_seqlens[-1]) == batch.num_real_tokens
    for batch in StreamingLoader(reader, StreamConfig(token_budget=BUDGET, pad_to_multiple=64)):
        assert batch.num_tokens % 64 == 0 and 0 <= batch.num_padding_tokens < 64


def test_pack_samples_rejects_bad_input(reader):
    samples = reader.read_shard(0, [0, 1])
    with pytest.raises(ValueError, match="pad_to"):
        pack_samples(samples, pad_to=1)
    with pytest.raises(ValueError, match="at least one"):
        pack_samples([])
    batch = pack_samples(samples)
    assert batch.num_documents == 2 and batch.num_padding_tokens == 0


def test_samples_longer_than_the_budget_are_refused_with_the_fix(reader):
    with pytest.raises(ConfigError, match=r"corpus row \d+ in shard \d+.*raise token_budget"):
        StreamingLoader(reader, StreamConfig(token_budget=64))


def test_bucket_table_matches_the_cache(reader):
    loader = StreamingLoader(reader, StreamConfig(token_budget=BUDGET, num_buckets=3))
    table = loader.bucket_table()
    assert sum(row.num_samples for row in table) == NUM_SHARDS * ROWS_PER_SHARD
    assert sum(row.num_tokens for row in table) == sum(
        int(reader.shard_lengths(s).sum()) for s in reader.shards
    )
    assert sum(row.num_batches for row in table) == len(loader)
    assert abs(sum(row.token_share for row in table) - 1.0) < 1e-9


@pytest.mark.gpu
def test_device_copy_on_a_side_stream(reader):
    loader = StreamingLoader(reader, StreamConfig(token_budget=BUDGET), device="cuda")
    host = StreamingLoader(reader, StreamConfig(token_budget=BUDGET, pin_memory=False))
    for on_device, on_host in zip(loader, host, strict=True):
        assert on_device.hidden.is_cuda
        assert _fingerprint(on_device.to("cpu")) == _fingerprint(on_host)


class _CorruptShardSource(_CountingSource):
    """A reader whose shard 2 fails its checksum, as ``CacheReader`` reports a corrupt chunk."""

    def read_shard(self, shard, indices=None):
        if shard == 2:
            raise CacheCorruptError(
                f"shard {shard}: array 'hidden' fails to decode (crc32c); re-extract the shard"
            )
        return super().read_shard(shard, indices)


def test_a_corrupt_shard_stops_the_loader_with_the_readers_error(reader):
    loader = StreamingLoader(
        _CorruptShardSource(reader), StreamConfig(token_budget=BUDGET, prefetch_batches=2)
    )
    with pytest.raises(CacheCorruptError, match="shard 2"):
        for _ in loader:
            pass
    loader.close()
    assert loader.stats.batches_in_flight == 0 and loader.stats.tokens_in_flight == 0


def test_shard_cache_threads_share_one_read_and_hold_at_most_k_shards(reader):
    calls = []

    def slow_read(shard, indices=None):
        calls.append(shard)
        time.sleep(0.2)  # long enough that all threads ask while the first read runs
        return reader.read_shard(shard, indices)

    cache = _ShardCache(slow_read, max_shards=2)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(cache.get, [1, 1, 1, 1]))
    assert calls == [1] and all(r is results[0] for r in results)
    for shard in (0, 2, 3):
        cache.get(shard)
    assert len(cache) == 2 and cache.reads == 4


def test_samples_with_too_few_supervised_tokens_are_excluded_and_counted(reader):
    # Supervised counts from the loss masks alone equal those of the full samples (hidden states included).
    everything = {s.corpus_row: s for shard in reader.shards for s in reader.read_shard(shard)}
    counts = {}
    for shard in reader.shards:
        rows = reader.shard_corpus_rows(shard).tolist()
        counts.update(zip(rows, reader.shard_supervised_counts(shard).tolist(), strict=True))
    assert counts == {row: int(sample.loss_mask.sum()) for row, sample in everything.items()}

    minimum = 32  # 2 * B for B = 16 (docs/dflash.md)
    short = {row for row, count in counts.items() if count < minimum}
    assert 0 < len(short) < len(counts)  # the fixture has both kinds
    loader = StreamingLoader(reader, StreamConfig(token_budget=BUDGET, seed=3, min_supervised_tokens=minimum))
    seen = [row for batch in loader for row in batch.corpus_rows]
    assert sorted(seen) == sorted(set(counts) - short)  # every other sample exactly once, none of the short ones
    assert loader.num_excluded_short == len(short)
    assert loader.num_excluded_short_tokens == sum(len(everything[row].input_ids) for row in short)
    described = loader.describe()
    assert described["excluded_short_samples"] == len(short)
    assert described["config"]["min_supervised_tokens"] == minimum
    # The split and the exclusion compose: each split counts only its own short samples.
    split = dict(token_budget=BUDGET, validation_fraction=0.3, min_supervised_tokens=minimum)
    train = StreamingLoader(reader, StreamConfig(split="train", **split))
    validation = StreamingLoader(reader, StreamConfig(split="validation", shuffle=False, **split))
    assert train.num_excluded_short + validation.num_excluded_short == len(short)
    assert train.num_samples + validation.num_samples == len(counts) - len(short)
    # A cursor taken without the exclusion cannot continue a loader with it (the batch order differs).
    unfiltered = StreamingLoader(reader, StreamConfig(token_budget=BUDGET, seed=3))
    with pytest.raises(CheckpointError, match="min_supervised_tokens"):
        loader.load_state_dict(unfiltered.state_dict())
    with pytest.raises(ConfigError, match="min_supervised_tokens"):
        StreamConfig(min_supervised_tokens=-1)


NUM_DOCUMENTS = 12


@pytest.fixture(scope="module")
def document_cache(cache_path, tmp_path_factory):
    """The fixture cache's samples again, in a cache that also stores document keys: row r comes from document
    ``file-{r % 12}``, so every document has rows in three different shards. Returns (path, keys)."""
    from dflash.corpus.format import document_key

    source = CacheReader(cache_path)
    keys = np.array([document_key(f"file-{row % NUM_DOCUMENTS}") for row in range(NUM_SHARDS * ROWS_PER_SHARD)],
                    dtype=np.uint64)
    path = tmp_path_factory.mktemp("stream-documents") / "cache.zarr"
    cache = HiddenStateCache.create(path, source.metadata, document_keys=keys)
    for shard in source.shards:
        cache.write_shard(shard, source.read_shard(shard), [])
    return path, keys


def _documents_of(loader, keys) -> set[int]:
    return {int(keys[row]) for row in loader.sample_row}


def test_validation_by_document_holds_out_whole_documents_stably(document_cache, reader):
    path, keys = document_cache
    documents = CacheReader(path)
    split = dict(token_budget=BUDGET, validation_fraction=0.3)
    train = StreamingLoader(documents, StreamConfig(seed=1, **split))
    valid = StreamingLoader(documents, StreamConfig(seed=9, split="validation", shuffle=False, **split))
    assert train.split_by == valid.split_by == "document" and valid.describe()["validation_split"] == "document"
    rows = np.arange(NUM_SHARDS * ROWS_PER_SHARD)
    train_rows, valid_rows = set(train.sample_row.tolist()), set(valid.sample_row.tolist())
    assert train_rows.isdisjoint(valid_rows) and train_rows | valid_rows == set(rows.tolist())
    assert _documents_of(train, keys).isdisjoint(_documents_of(valid, keys))  # no document on both sides
    assert valid_rows == set(rows[validation_rows(keys[rows], 0.3)].tolist())
    assert 0 < len(_documents_of(valid, keys)) < NUM_DOCUMENTS
    assert len(valid_rows) == 3 * len(_documents_of(valid, keys))  # whole documents: all 3 rows of each
    # Stable for any rank, world size, read mode and shuffle seed (the split comes before the plan).
    for other in (dict(rank=1, world_size=2), dict()):
        for window in (None, 2):
            loader = StreamingLoader(documents, StreamConfig(seed=5, split="validation", shard_window=window, **split),
                                     **other)
            assert set(loader.sample_row.tolist()) == valid_rows
    # The row split of the same cache is today's, bit for bit, and it does cut documents in two.
    by_row = StreamingLoader(documents, StreamConfig(split="validation", validation_split_by="row", **split))
    old = StreamingLoader(reader, StreamConfig(split="validation", **split))  # a cache without keys: the row split
    assert by_row.split_by == old.split_by == "row"
    assert by_row.sample_row.tolist() == old.sample_row.tolist() == rows[validation_rows(rows, 0.3)].tolist()
    row_train = StreamingLoader(documents, StreamConfig(validation_split_by="row", **split))
    assert _documents_of(by_row, keys) & _documents_of(row_train, keys)


def test_online_and_offline_sources_split_the_same_documents(document_cache, tmp_path):
    """The online mode plans from the corpus (CorpusLengths), the offline loader from the cache: same keys, same
    validation rows."""
    from dflash.batches.source import PlannedCursor
    from dflash.corpus.format import CorpusLengths, CorpusWriter, open_corpus

    path, keys = document_cache
    documents = CacheReader(path)
    with CorpusWriter(tmp_path / "corpus") as writer:
        for shard in documents.shards:
            for sample in documents.read_shard(shard):
                writer.add(sample.input_ids.numpy(), sample.loss_mask.numpy(), f"row-{sample.corpus_row}",
                           f"file-{sample.corpus_row % NUM_DOCUMENTS}")
        writer.commit({})
    corpus = open_corpus(tmp_path / "corpus")
    assert corpus.document_keys.tolist() == keys.tolist()
    config = StreamConfig(token_budget=BUDGET, validation_fraction=0.3, split="validation", shuffle=False)
    online = PlannedCursor(CorpusLengths(corpus, documents.metadata.shard_rows), config)
    assert online.split_by == "document"
    assert online.sample_row.tolist() == StreamingLoader(documents, config).sample_row.tolist()


def test_a_cache_without_document_keys_splits_by_row_and_says_so_once(reader, caplog):
    import logging

    split = dict(token_budget=BUDGET, validation_fraction=0.25)
    with caplog.at_level(logging.INFO, logger="dflash.batches.source"):
        train = StreamingLoader(reader, StreamConfig(**split))
        valid = StreamingLoader(reader, StreamConfig(split="validation", **split))
    lines = [r.getMessage() for r in caplog.records if "validation split by corpus row" in r.getMessage()]
    assert len(lines) == 1 and str(reader.url) in lines[0] and "no document keys" in lines[0]
    assert train.split_by == valid.split_by == "row"
    rows = np.arange(NUM_SHARDS * ROWS_PER_SHARD)
    assert valid.sample_row.tolist() == rows[validation_rows(rows, 0.25)].tolist()


def test_resume_refuses_a_changed_split(document_cache):
    documents = CacheReader(document_cache[0])
    split = dict(token_budget=BUDGET, validation_fraction=0.3, seed=2)
    by_document = StreamingLoader(documents, StreamConfig(**split))
    by_row = StreamingLoader(documents, StreamConfig(validation_split_by="row", **split))
    with pytest.raises(CheckpointError, match=r"'validation_split_by' changed since the checkpoint \('document' -> "
                                              r"'row'\)"):
        by_row.load_state_dict(by_document.state_dict())
    with pytest.raises(ConfigError, match="validation_split_by must be 'document' or 'row'; got 'file'"):
        StreamConfig(validation_split_by="file")


def test_a_fraction_too_small_for_the_documents_still_holds_out_one_whole_document(document_cache):
    """1% of 12 documents is none: rather than an empty validation split (a ConfigError at start), the document
    nearest to the fraction is held out alone, all its rows, and training keeps the other 11."""
    from dflash.batches.source import split_positions, validation_split

    path, keys = document_cache
    documents = CacheReader(path)
    rows = np.arange(NUM_SHARDS * ROWS_PER_SHARD)
    assert not validation_rows(keys[rows], 0.01).any()  # the plain rule holds out nothing here
    split = dict(token_budget=BUDGET, validation_fraction=0.01)
    valid = StreamingLoader(documents, StreamConfig(split="validation", shuffle=False, **split))
    train = StreamingLoader(documents, StreamConfig(**split))
    nearest = int(keys[rows][np.argmin(split_positions(keys[rows]))])
    assert _documents_of(valid, keys) == {nearest} and len(valid.sample_row) == 3
    assert nearest not in _documents_of(train, keys) and len(_documents_of(train, keys)) == NUM_DOCUMENTS - 1
    # A fraction that holds out something is untouched; one key alone is never held out (nothing would train).
    assert np.array_equal(validation_split(keys[rows], 0.3), validation_rows(keys[rows], 0.3))
    assert not validation_split(np.full(5, 7, dtype=np.uint64), 0.01).any()
