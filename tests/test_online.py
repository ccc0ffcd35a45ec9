"""The online mode on the real SmolLM2 target (CPU): same batches as extract + train, exact resume, end to end.

The corpus is short stdlib snippets tokenized by the target's tokenizer, with an unsupervised "prompt" prefix.
Producers run in-process (a thread executor) where the test is about the plan or the trainer, and as Dask worker
processes (``dflash-stages online --workers 1``) end to end.
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console

from dflash.batch_source import StreamConfig
from dflash.cache import CacheReader
from dflash.corpus import CorpusLengths, CorpusWriter, open_corpus
from dflash.online import BatchProducer, OnlineBatches
from dflash.shm import list_segments
from dflash.stream import StreamingLoader
from dflash.target_runner import TargetRunner
from tests.train_helpers import TINY_LAYER_IDS, stdlib_snippets

WIDTH_TAPS = len(TINY_LAYER_IDS)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("online") / "corpus"
    with CorpusWriter(path) as writer:
        for index, text in enumerate(stdlib_snippets(24)):
            ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"][:96], dtype=np.int32)
            mask = np.ones(len(ids), dtype=np.uint8)
            mask[: max(1, len(ids) // 4)] = 0
            writer.add(ids, mask, f"snippet-{index}")
        writer.commit({"target_spec": "default"})
    return path


@pytest.fixture(scope="module")
def offline_cache(tmp_path_factory, corpus_dir, target_path, target):
    """``extract`` of the corpus (its prepare + shard tasks, in this process): 3 shards."""
    import os

    from stages.extract import ExtractConfig, prepare_cache
    from stages.extract_worker import ShardExtractor, ShardSpec

    output = tmp_path_factory.mktemp("online-offline") / "cache"
    config = ExtractConfig(corpus=str(corpus_dir), output=str(output), target=str(target_path),
                           target_layer_ids=TINY_LAYER_IDS, shard_size=600, workers=1, write_processes=0)
    _, corpus, shard_rows, _ = prepare_cache(config, Console(file=open(os.devnull, "w")))  # noqa: SIM115
    assert len(shard_rows) >= 3
    extractor = ShardExtractor(TargetRunner(target.model, TINY_LAYER_IDS, "cpu", token_budget=256), write_processes=0)
    for shard, (start, stop) in enumerate(shard_rows):
        extractor.process(ShardSpec(shard_id=shard, row_start=start, row_stop=stop, num_tokens=0,
                                    cache_path=str(output), corpus_path=str(corpus_dir)))
    extractor.close()
    return output


def _stream_config(split: str) -> StreamConfig:
    return StreamConfig(token_budget=192, num_buckets=2, seed=3, shuffle=split == "train", split=split,
                        validation_fraction=0.2, min_supervised_tokens=8, prefetch_batches=2)


def _collect(source, epochs: int) -> list[dict]:
    out = []
    for _ in range(epochs):
        for batch in source:
            digest = hashlib.sha256(repr(batch.corpus_rows).encode() + batch.input_ids.numpy().tobytes()
                                    + batch.loss_mask.numpy().tobytes()).hexdigest()
            out.append({"digest": digest, "rows": list(batch.corpus_rows), "bucket": batch.bucket_id,
                        "hidden": batch.hidden.clone(), "epoch": source.epoch})
    return out


@pytest.mark.parametrize("split", ["train", "validation"])
def test_online_batches_hold_the_same_samples_in_the_same_batches_as_offline(offline_cache, corpus_dir, target,
                                                                              split):
    producer = BatchProducer(TargetRunner(target.model, TINY_LAYER_IDS, "cpu", token_budget=256),
                             open_corpus(corpus_dir))
    width = WIDTH_TAPS * int(target.model.config.hidden_size)
    with ThreadPoolExecutor(1) as pool, StreamingLoader(CacheReader(offline_cache), _stream_config(split)) as offline, \
            OnlineBatches(CorpusLengths(open_corpus(corpus_dir)), _stream_config(split),
                          submit=lambda task: pool.submit(producer.produce, task), width=width, num_slots=3) as online:
        assert online.boundaries == offline.boundaries and len(online) == len(offline)
        expected, got = _collect(offline, 2), _collect(online, 2)
    producer.close()
    assert len(got) == len(expected) >= 4
    assert [b["digest"] for b in got] == [b["digest"] for b in expected]  # same samples, tokens, masks, order
    assert [b["bucket"] for b in got] == [b["bucket"] for b in expected]
    if split == "train":
        assert got[0]["rows"] != got[len(got) // 2]["rows"]  # the second epoch reshuffled (like offline)
    for online_batch, offline_batch in zip(got, expected, strict=True):
        assert online_batch["hidden"].dtype == torch.bfloat16
        torch.testing.assert_close(online_batch["hidden"].float(), offline_batch["hidden"].float(), rtol=1.6e-2,
                                   atol=2e-2)  # fmt: skip
