"""Staged batches: how the online mode's ``--cache-to`` turns planned batches into committed cache shards.

A cache shard holds a contiguous range of corpus rows (contract 2, docs/cache-format.md), but an online run
computes the rows in the shuffled order of its epoch plan. So each producer also writes the first epoch's batches
it computes into a staging folder beside the cache, one folder per batch, and :class:`ShardAssembler` writes a
shard (with :meth:`dflash.cache.HiddenStateCache.write_shard`, commit record last) as soon as every row of its
range is staged, then deletes the staged batches no uncommitted shard still needs.

Layout of a staged batch (``CACHE/staging/<name>/``; written under ``.<name>.tmp`` and renamed, so a folder that
exists is whole; numpy ``.npy`` files, read with ``allow_pickle=False``)::

    corpus_rows.npy   int64  [D]        the batch's documents (plan order)
    lengths.npy       int64  [D]        their token counts
    hidden.npy        uint16 [T, n*H]   bfloat16 bit patterns, documents concatenated in that order

Token ids and loss masks are read back from the corpus (they are the corpus's). Staging holds at most one epoch's
hidden states uncompressed (about 1.5x the finished cache while the first epoch runs: shards of a shuffled plan
complete late); it is empty once every shard is committed.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash.cache.format import HiddenSample

__all__ = ["STAGING_DIR", "stage_batch", "ShardAssembler", "commit_staged_shards", "remove_staging"]

log = logging.getLogger(__name__)

#: The staging folder's name inside the cache folder.
STAGING_DIR = "staging"


def stage_batch(staging: str | os.PathLike[str], name: str, corpus_rows: Sequence[int], hidden: Sequence[torch.Tensor]) -> bool:
    """Write one computed batch into ``staging/<name>/`` (atomically: a temporary folder, then a rename).

    Args:
        staging: the staging folder (created if missing).
        name: the batch's name, unique per planned batch (e.g. ``train-b00000012``).
        corpus_rows: the documents' corpus rows, in order.
        hidden: one ``Tensor[L_i, n*H]`` bfloat16 per document (CPU).

    Returns:
        ``False`` when the batch was staged already (a recomputed batch, e.g. after a resume): nothing is written.
    """
    root = Path(staging)
    final = root / name
    if final.is_dir():
        return False
    root.mkdir(parents=True, exist_ok=True)
    temporary = root / f".{name}.tmp-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    np.save(temporary / "corpus_rows.npy", np.asarray(corpus_rows, dtype=np.int64))
    np.save(temporary / "lengths.npy", np.asarray([len(h) for h in hidden], dtype=np.int64))
    np.save(temporary / "hidden.npy", torch.cat([h.to(torch.bfloat16) for h in hidden]).view(torch.int16).numpy().view(np.uint16))
    try:
        os.rename(temporary, final)
    except OSError:  # another producer staged the same batch first (a task rerun): theirs is as good
        shutil.rmtree(temporary, ignore_errors=True)
        return False
    return True


class ShardAssembler:
    """Writes the shards of ``cache`` whose rows are all staged; call :meth:`poll` repeatedly, then :meth:`finish`.

    Args:
        cache: the :class:`dflash.cache.HiddenStateCache` (its metadata's ``shard_rows`` is the plan).
        corpus: the opened corpus the plan was made from (token ids and loss masks are read from it).
        excluded: corpus rows the run never computes (fewer supervised tokens than ``min_supervised_tokens``):
            recorded in their shard's commit record as ``skipped`` with ``reason``.
        reason: why ``excluded`` rows are not in the cache.
    """

    def __init__(self, cache: Any, corpus: Any, excluded: Iterable[int], *, reason: str) -> None:
        self.cache = cache
        self.corpus = corpus
        self.staging = Path(cache.url) / STAGING_DIR
        self.excluded = {int(r) for r in excluded}
        self.reason = reason
        self._where: dict[int, tuple[str, int, int]] = {}  # corpus row -> (batch name, token offset, length)
        self._batches: dict[str, set[int]] = {}  # staged batch -> its rows
        self.written: list[int] = []

    def _scan(self) -> None:
        if not self.staging.is_dir():
            return
        for entry in sorted(self.staging.iterdir()):
            if entry.name.startswith(".") or entry.name in self._batches or not entry.is_dir():
                continue
            try:
                rows = np.load(entry / "corpus_rows.npy", allow_pickle=False)
                lengths = np.load(entry / "lengths.npy", allow_pickle=False)
                hidden = np.load(entry / "hidden.npy", mmap_mode="r", allow_pickle=False)
                if hidden.ndim != 2 or rows.shape != lengths.shape or int(lengths.sum()) != hidden.shape[0]:
                    raise ValueError(f"shapes disagree: rows {rows.shape}, lengths sum {int(lengths.sum())}, "
                                     f"hidden {hidden.shape}")
            except (OSError, ValueError) as error:  # truncated or damaged (a full disk, a hand edit): not used
                log.warning("cache-to: staged batch %s is unreadable (%s); removed, its rows are not staged",
                            entry, error)
                shutil.rmtree(entry, ignore_errors=True)
                continue
            del hidden
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            for row, offset, length in zip(rows.tolist(), offsets[:-1].tolist(), lengths.tolist(), strict=True):
                self._where.setdefault(int(row), (entry.name, int(offset), int(length)))
            self._batches[entry.name] = {int(r) for r in rows.tolist()}

    def pending_shards(self) -> list[int]:
        """Shards of the plan without a commit record."""
        committed = self.cache.committed_shards()
        return [k for k in range(self.cache.metadata.num_shards) if k not in committed]

    def missing_rows(self, shard: int) -> list[int]:
        """Rows of ``shard``'s range neither staged nor excluded."""
        start, stop = self.cache.metadata.shard_rows[shard]
        return [r for r in range(start, stop) if r not in self._where and r not in self.excluded]

    def poll(self) -> list[int]:
        """Write every pending shard whose rows are all staged or excluded; returns the shards written."""
        self._scan()
        written = []
        for shard in self.pending_shards():
            if not self.missing_rows(shard):
                try:
                    self._write(shard)
                except (OSError, ValueError) as error:  # e.g. a full disk: the shard stays pending (extract finishes it)
                    log.warning("cache-to: shard %d could not be written (%s); it stays uncommitted", shard, error)
                    continue
                written.append(shard)
        self._sweep()  # also batches staged again after their shard was committed (recomputed, or run ahead)
        self.written += written
        return written

    def finish(self) -> list[int]:
        """The last :meth:`poll`, once no producer writes any more; removes the staging folder when every shard is
        committed (with what killed producers left half-written). Returns the shards still pending."""
        self.poll()
        pending = self.pending_shards()
        if not pending:
            shutil.rmtree(self.staging, ignore_errors=True)
        return pending

    def _write(self, shard: int) -> None:
        start, stop = self.cache.metadata.shard_rows[shard]
        samples, skipped, opened = [], [], {}
        for row in range(start, stop):
            if row not in self._where:
                skipped.append({"corpus_row": row, "reason": self.reason})
                continue
            name, offset, length = self._where[row]
            if name not in opened:
                opened[name] = np.load(self.staging / name / "hidden.npy", mmap_mode="r", allow_pickle=False)
            bits = np.array(opened[name][offset : offset + length])  # a copy: the map is read-only
            record = self.corpus.row(row)
            assert len(record.input_ids) == length, f"staged row {row} has {length} tokens, the corpus {len(record.input_ids)}"
            samples.append(HiddenSample(corpus_row=row, input_ids=torch.as_tensor(record.input_ids),
                                        loss_mask=torch.as_tensor(record.loss_mask),
                                        hidden=torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)))  # fmt: skip
        self.cache.write_shard(shard, samples, skipped=skipped)
        log.info("cache-to: shard %d committed (%d samples, %d skipped)", shard, len(samples), len(skipped))

    def _sweep(self) -> None:
        """Delete staged batches whose rows all lie in committed shards."""
        committed = self.cache.committed_shards()
        bounds = self.cache.metadata.shard_rows
        starts = np.asarray([a for a, _ in bounds], dtype=np.int64)

        def shard_of(row: int) -> int:
            return int(np.searchsorted(starts, row, side="right") - 1)

        for name, rows in list(self._batches.items()):
            if all(shard_of(r) in committed for r in rows):
                shutil.rmtree(self.staging / name, ignore_errors=True)
                del self._batches[name]
                for r in rows:
                    if self._where.get(r, ("",))[0] == name:
                        del self._where[r]


def commit_staged_shards(cache: Any, corpus: Any) -> list[int]:
    """Commit the pending shards of ``cache`` whose rows an online ``--cache-to`` run left staged (it stopped before
    it could), so that ``extract`` finishing that cache computes only the rest. Nothing happens without a staging
    folder. Rows the online run excluded were never staged: their shards stay pending for ``extract``.

    Args:
        cache: the opened :class:`dflash.cache.HiddenStateCache` (caller holds its lock).
        corpus: the corpus of its plan.
    Returns:
        The shards committed, in order.
    """
    if not (Path(str(cache.url)) / STAGING_DIR).is_dir():
        return []
    return ShardAssembler(cache, corpus, (), reason="").poll()


def remove_staging(cache_path: str | os.PathLike[str]) -> bool:
    """Delete ``CACHE/staging`` (once every shard is committed nothing in it is needed). Returns whether it existed."""
    staging = Path(str(cache_path)) / STAGING_DIR
    if not staging.is_dir():
        return False
    shutil.rmtree(staging, ignore_errors=True)
    return True
