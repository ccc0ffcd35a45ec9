"""Reading the hidden-state cache: committed shards only, lengths without hidden states, bf16 tensors out.

Every read checks what the format promises: the chunks it needs exist (zarr would silently return the fill
value for a missing chunk) and their crc32c checksums match; a failure raises :class:`CacheCorruptError` naming
the shard and the array. fp8 caches are dequantized to bf16 on read.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from dflash.cache.format import (
    CORRUPT_SHARD_REPAIR,
    CacheMetadata,
    HiddenSample,
    commit_key,
    dequantize_fp8,
    shard_group_key,
)
from dflash.cache.store import CacheStore
from dflash.cache.writer import _open_store, _read_metadata, array_chunk_keys, committed_shard_ids
from dflash.errors import CacheCorruptError, CacheError

__all__ = ["CacheReader"]


class CacheReader:
    """Read-only view of a cache (local folder or fsspec URL).

    Attributes:
        metadata: the root :class:`CacheMetadata`.
        shards: committed shard ids, sorted (snapshot taken at open; call :meth:`refresh` to re-list).
    """

    def __init__(self, path_or_url: str | os.PathLike[str]) -> None:
        self.url = os.fspath(path_or_url)
        self._store: CacheStore = _open_store(path_or_url, "r")
        self.metadata: CacheMetadata = _read_metadata(self._store)
        self._records: dict[int, dict[str, Any]] = {}
        self._index: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._arrays: dict[tuple[int, str], Any] = {}
        self.refresh()

    def refresh(self) -> None:
        """Re-list committed shards (for reading a cache while extract is still writing it); drops cached
        commit records, indexes and array handles, so a withdrawn and redone shard is read afresh."""
        self.shards: list[int] = sorted(committed_shard_ids(self._store))
        self._records.clear()
        self._index.clear()
        self._arrays.clear()

    def commit_record(self, shard: int) -> dict[str, Any]:
        """The shard's commit record (counts, quarantined samples, layout, digest).

        Raises:
            CacheError: the shard is not committed.
        """
        if shard not in self._records:
            try:
                record = self._store.get_json(commit_key(shard))
            except CacheCorruptError as error:
                raise CacheCorruptError(f"shard {shard}: its commit record is unreadable: {error}") from error
            if record is None:
                raise CacheError(
                    f"shard {shard} of {self.url} is not committed (committed: {len(self.shards)} of "
                    f"{self.metadata.num_shards}); rerun `dflash-stages extract` to finish it"
                )
            self._records[shard] = record
        return self._records[shard]

    def _array(self, shard: int, name: str) -> Any:
        if (shard, name) in self._arrays:  # a committed shard's array metadata never changes
            return self._arrays[(shard, name)]
        try:
            array = self._store.group[f"{shard_group_key(shard)}/{name}"]
            self._arrays[(shard, name)] = array
            return array
        except Exception as error:
            raise CacheCorruptError(
                f"shard {shard} of {self.url} is committed but its array {name!r} is missing or unreadable ({error}); "
                "delete its commit record and rerun extract, or re-extract the cache"
            ) from error

    def _check_chunks(self, shard: int, names: list[str], row_chunks: dict[str, set[int]] | None = None) -> None:
        """Raise if a chunk that the commit record promises (restricted to ``row_chunks``) is absent."""
        record = self.commit_record(shard)
        present = set(self._store.list_prefix(shard_group_key(shard)))
        for name in names:
            layout = record["arrays"][name]
            expected = array_chunk_keys(layout["shape"], layout["chunks"])
            if row_chunks is not None and name in row_chunks:
                expected = {key for key in expected if int(key.split("/")[1]) in row_chunks[name]}
            missing = sorted(key for key in expected if f"{name}/{key}" not in present)
            if missing:
                raise CacheCorruptError(
                    f"shard {shard} of {self.url}: array {name!r} is missing chunk(s) {missing[:5]}"
                    f"{' ...' if len(missing) > 5 else ''} ({len(missing)} of {len(expected)}); "
                    "the shard is corrupt: re-extract it (delete its commit record, rerun extract)"
                )

    def _read(self, shard: int, name: str, selection: Any = ..., *, where: str = "") -> np.ndarray:
        array = self._array(shard, name)
        try:
            return np.asarray(array[selection])
        except Exception as error:  # crc32c mismatch, truncated chunk, codec error
            raise CacheCorruptError(
                f"shard {shard} of {self.url}: array {name!r}{where} fails to decode ({type(error).__name__}: {error}); "
                f"a chunk is corrupt: {CORRUPT_SHARD_REPAIR}"
            ) from error

    def _shard_index(self, shard: int) -> tuple[np.ndarray, np.ndarray]:
        if shard not in self._index:
            record = self.commit_record(shard)
            self._check_chunks(shard, ["offsets", "corpus_rows"])
            offsets = self._read(shard, "offsets").astype(np.int64)
            corpus_rows = self._read(shard, "corpus_rows").astype(np.int64)
            num_samples, num_tokens = record["num_samples"], record["num_tokens"]
            if (
                offsets.shape != (num_samples + 1,)
                or corpus_rows.shape != (num_samples,)
                or offsets[0] != 0
                or offsets[-1] != num_tokens
                or np.any(np.diff(offsets) < 0)
            ):
                raise CacheCorruptError(
                    f"shard {shard} of {self.url}: array 'offsets' is inconsistent with its commit record "
                    f"(expected {num_samples + 1} non-decreasing offsets from 0 to {num_tokens}); {CORRUPT_SHARD_REPAIR}"
                )
            start, stop = record["row_range"]
            outside = corpus_rows[(corpus_rows < start) | (corpus_rows >= stop)]
            if outside.size:
                raise CacheCorruptError(
                    f"shard {shard} of {self.url}: array 'corpus_rows' holds rows {outside[:5].tolist()} outside the "
                    f"shard's range [{start}, {stop}); {CORRUPT_SHARD_REPAIR}"
                )
            unique, counts = np.unique(corpus_rows, return_counts=True)
            if np.any(counts > 1):
                raise CacheCorruptError(
                    f"shard {shard} of {self.url}: array 'corpus_rows' holds duplicate rows {unique[counts > 1][:5].tolist()}; "
                    f"{CORRUPT_SHARD_REPAIR}"
                )
            self._index[shard] = (offsets, corpus_rows)
        return self._index[shard]

    def shard_lengths(self, shard: int) -> np.ndarray:
        """Token count of each sample of ``shard``: ``int64 [S]`` (reads only ``offsets``)."""
        return np.diff(self._shard_index(shard)[0])

    def shard_supervised_counts(self, shard: int) -> np.ndarray:
        """Supervised tokens (``loss_mask == 1``) of each sample of ``shard``: ``int64 [S]``.

        Reads only ``offsets`` and ``loss_mask`` (1 byte per token), never the hidden states, so planning can drop
        samples with too few supervised tokens cheaply.

        Raises:
            CacheError: ``shard`` is not committed.
            CacheCorruptError: a ``loss_mask`` chunk is missing or fails its checksum.
        """
        offsets, _ = self._shard_index(shard)
        self._check_chunks(shard, ["loss_mask"])
        loss_mask = self._read(shard, "loss_mask", slice(0, int(offsets[-1])))
        running = np.concatenate([[0], np.cumsum(loss_mask != 0, dtype=np.int64)])
        return running[offsets[1:]] - running[offsets[:-1]]

    def shard_corpus_rows(self, shard: int) -> np.ndarray:
        """Corpus row of each sample of ``shard``: ``int64 [S]``."""
        return self._shard_index(shard)[1].copy()

    def quarantined(self) -> list[dict[str, Any]]:
        """Quarantined samples of all committed shards (each entry with its ``shard``)."""
        return [{**entry, "shard": shard} for shard in self.shards for entry in self.commit_record(shard).get("quarantined", [])]

    def read_shard(self, shard: int, indices: list[int] | np.ndarray | None = None) -> list[HiddenSample]:
        """Samples of ``shard`` (all, or ``indices`` in the given order) with bf16 hidden states.

        Adjacent requested samples are read as one token span, so reading a whole shard or a sorted subset
        decodes each chunk once.

        Returns:
            ``HiddenSample``s: input_ids ``int32 [L]``, loss_mask ``uint8 [L]``, hidden ``bfloat16 [L, n*H]``.

        Raises:
            CacheError: ``shard`` is not committed or an index is out of range.
            CacheCorruptError: a needed chunk is missing or fails its checksum (names shard and array).
        """
        offsets, corpus_rows = self._shard_index(shard)
        num_samples = len(corpus_rows)
        order = np.arange(num_samples) if indices is None else np.asarray(indices, dtype=np.int64).reshape(-1)
        if order.size and (order.min() < 0 or order.max() >= num_samples):
            raise CacheError(f"shard {shard} of {self.url} has {num_samples} samples; index {int(order.max() if order.max() >= num_samples else order.min())} is out of range")
        wanted = np.unique(order)
        # Runs of consecutive sample indices -> contiguous token spans.
        runs: list[tuple[int, int]] = []
        for index in wanted.tolist():
            if runs and runs[-1][1] == index:
                runs[-1] = (runs[-1][0], index + 1)
            else:
                runs.append((index, index + 1))
        names = ["input_ids", "loss_mask", "hidden"] + (["hidden_scale"] if self.metadata.lossy else [])
        layout = self.commit_record(shard)["arrays"]
        touched: dict[str, set[int]] = {name: set() for name in names}
        for name in names:
            chunk_rows = layout[name]["chunks"][0]
            for first, last in runs:
                lo, hi = int(offsets[first]), int(offsets[last])
                if hi > lo:
                    touched[name].update(range(lo // chunk_rows, (hi - 1) // chunk_rows + 1))
        self._check_chunks(shard, names, touched)

        samples: dict[int, HiddenSample] = {}
        for first, last in runs:
            lo, hi = int(offsets[first]), int(offsets[last])
            span = {name: self._read(shard, name, slice(lo, hi)) for name in names}
            if self.metadata.lossy:
                hidden = dequantize_fp8(span["hidden"], span["hidden_scale"], self.metadata.num_taps)
            else:
                hidden = torch.from_numpy(np.ascontiguousarray(span["hidden"])).view(torch.bfloat16)
            input_ids = torch.from_numpy(np.ascontiguousarray(span["input_ids"]))
            loss_mask = torch.from_numpy(np.ascontiguousarray(span["loss_mask"]))
            for index in range(first, last):
                a, b = int(offsets[index]) - lo, int(offsets[index + 1]) - lo
                samples[index] = HiddenSample(
                    corpus_row=int(corpus_rows[index]),
                    input_ids=input_ids[a:b],
                    loss_mask=loss_mask[a:b],
                    hidden=hidden[a:b],
                )
        return [samples[index] for index in order.tolist()]

    def size_on_disk(self) -> int:
        """Bytes the whole cache occupies in its store (every shard, committed or not, and the metadata)."""
        return self._store.size_prefix("")

    def __repr__(self) -> str:
        return f"CacheReader({self.url!r}, shards={len(self.shards)}/{self.metadata.num_shards})"
