"""Reading the hidden-state cache: committed shards only, lengths without hidden states, bf16 tensors out.

Every read checks what the format promises against the shard's commit record: the chunks it needs exist (zarr
would silently return the fill value for a missing chunk); each ``hidden`` chunk's stored crc32c equals the
record's leaf for that chunk (digest_version 3) and its body matches that crc32c before it is decoded, so a chunk
swapped in from another shard (valid checksum of its own, wrong data) fails too; the small arrays (offsets,
corpus_rows, input_ids, loss_mask, hidden_scale) are read whole per shard and compared with the record's sha256
segments. A failure raises :class:`CacheCorruptError` naming the shard, the array and the chunk. fp8 caches are
dequantized to bf16 on read. ``dflash.cache.integrity.check_cache`` runs the cheap whole-cache check before step 1.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from dflash.cache.chunks import crc32c_trailer, decoder_for
from dflash.cache.format import (
    CORRUPT_SHARD_REPAIR,
    DOCUMENT_KEYS_ARRAY,
    DOCUMENT_KEYS_ATTRIBUTE,
    CacheMetadata,
    HiddenSample,
    commit_key,
    dequantize_fp8,
    shard_group_key,
)
from dflash.cache.integrity import check_array_segments
from dflash.cache.store import CacheStore, open_cache_store, read_cache_metadata
from dflash.cache.writer import (
    array_chunk_keys,
    committed_shard_ids,
    document_keys_record,
    shard_arrays,
)
from dflash.errors import CacheCorruptError, CacheError, ConfigError

__all__ = ["CacheReader", "VERIFIED_SHARDS_KEPT"]

#: Shards whose verified per-token small arrays (input_ids, loss_mask, hidden_scale: 5 to 25 bytes per token) the
#: reader keeps, so reading a few samples of a shard at a time does not re-read and re-hash them.
VERIFIED_SHARDS_KEPT = 16


class CacheReader:
    """Read-only view of a cache (local folder or fsspec URL).

    Attributes:
        metadata: the root :class:`CacheMetadata`.
        shards: committed shard ids, sorted (snapshot taken at open; call :meth:`refresh` to re-list).
    """

    def __init__(self, path_or_url: str | os.PathLike[str], *, final_tap: bool = False) -> None:
        self.url = os.fspath(path_or_url)
        self._store: CacheStore = open_cache_store(path_or_url, "r")
        self.metadata: CacheMetadata = read_cache_metadata(self._store)
        if final_tap and not self.metadata.final_tap:
            raise ConfigError(
                f"{self.url}: the cache has no final tap (the target's final normed hidden state), which "
                "drafter.distill needs; re-extract it with `extract --final-tap` (extract.final_tap = true), or "
                "train with drafter.distill = none"
            )
        #: Samples come with the final tap as one more slot after the n taps (``[L, (n+1)*H]``); without it the
        #: reader returns the n taps alone (``[L, n*H]``) whatever the cache stores.
        self.final_tap = bool(final_tap)
        self._records: dict[int, dict[str, Any]] = {}
        self._index: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._arrays: dict[tuple[int, str], Any] = {}
        self._verified: OrderedDict[tuple[int, str], np.ndarray] = OrderedDict()
        self._supervised: dict[int, np.ndarray] = {}
        self._decoders: dict[tuple[str, tuple[int, ...]], Any] = {}
        self._document_keys: np.ndarray | None = None
        self._lock = threading.Lock()  # the loader's prefetch threads share one reader
        self.refresh()

    def refresh(self) -> None:
        """Re-list committed shards (for reading a cache while extract is still writing it); drops cached
        commit records, indexes and array handles, so a withdrawn and redone shard is read afresh."""
        self.shards: list[int] = sorted(committed_shard_ids(self._store))
        self._records.clear()
        self._index.clear()
        self._arrays.clear()
        self._verified.clear()
        self._supervised.clear()
        self._decoders.clear()

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

    def verified_array(self, shard: int, name: str, *, keep: bool = True) -> np.ndarray:
        """The whole small array ``name`` of ``shard`` (not ``hidden``), its chunks present and its bytes equal to
        the commit record's sha256 segments; kept for :data:`VERIFIED_SHARDS_KEPT` shards when ``keep``.

        Raises:
            CacheCorruptError: a chunk is missing, fails its crc32c or the array differs from the record.
        """
        assert name != "hidden", "hidden is read chunk by chunk (_decoded_rows)"
        with self._lock:
            cached = self._verified.get((shard, name))
            if cached is not None:
                self._verified.move_to_end((shard, name))
                return cached
        values = self._decoded_rows(shard, name)
        check_array_segments(self.url, shard, name, values, self.commit_record(shard))
        if keep:
            with self._lock:
                self._verified[(shard, name)] = values
                per_shard = 3 if self.metadata.lossy else 2  # input_ids, loss_mask[, hidden_scale]
                while len(self._verified) > VERIFIED_SHARDS_KEPT * per_shard:
                    self._verified.popitem(last=False)
        return values

    def _decoded_rows(self, shard: int, name: str, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Rows ``[lo, hi)`` (default: all) of array ``name`` of ``shard``, read chunk by chunk from the store and
        checked before decoding: each chunk stored, its crc32c trailer equal to the commit record's leaf (``hidden``,
        digest_version 3) and its body equal to that crc32c (zarr's own check). Small arrays are fetched in one
        batch (many tiny chunks), ``hidden`` one chunk at a time (bounded memory). Codecs :func:`decoder_for` does
        not know (gzip) are decoded by zarr after the checks."""
        import google_crc32c

        record = self.commit_record(shard)
        layout = record["arrays"][name]
        shape, chunks = [int(n) for n in layout["shape"]], [int(n) for n in layout["chunks"]]
        rows, step = shape[0], chunks[0]
        hi = rows if hi is None else hi
        dtype = np.dtype(shard_arrays(self.metadata)[name][0])
        out = np.empty((hi - lo, *shape[1:]), dtype=dtype)
        if hi <= lo:
            return out
        leaves = layout.get("crc32c_chunks") if name == "hidden" and int(record.get("digest_version", 1)) >= 3 else None
        if (name, tuple(chunks)) not in self._decoders:
            self._decoders[(name, tuple(chunks))] = decoder_for(self.metadata.codec, dtype, tuple(chunks))
        decode = self._decoders[(name, tuple(chunks))]
        indices = list(range(lo // step, (hi - 1) // step + 1))
        tail = "/0" * (len(shape) - 1)
        keys = [f"{shard_group_key(shard)}/{name}/c/{index}{tail}" for index in indices]
        batch = self._store.get_many(keys) if name != "hidden" else None
        for position, index in enumerate(indices):
            data = batch[position] if batch is not None else self._store.get_many([keys[position]])[0]
            where = f"array {name!r} chunk {index} (c/{index}{tail}, rows {index * step}..{min(rows, (index + 1) * step)})"
            if data is None or len(data) < 4:
                raise CacheCorruptError(f"shard {shard} of {self.url}: {where} is missing; {CORRUPT_SHARD_REPAIR}")
            leaf = crc32c_trailer(data)
            if leaves is not None and (index >= len(leaves) or leaves[index] != leaf):
                recorded = leaves[index] if index < len(leaves) else "no chunk"
                raise CacheCorruptError(
                    f"shard {shard} of {self.url}: {where} has crc32c {leaf}, the commit record says {recorded}; the "
                    f"chunk was swapped, replaced or truncated: {CORRUPT_SHARD_REPAIR}"
                )
            if google_crc32c.value(data[:-4]) != int(leaf, 16):
                raise CacheCorruptError(
                    f"shard {shard} of {self.url}: {where} fails its crc32c checksum (the chunk is corrupt); "
                    f"{CORRUPT_SHARD_REPAIR}"
                )
            first, last = max(lo, index * step), min(hi, (index + 1) * step)
            if decode is None:
                out[first - lo : last - lo] = self._read(shard, name, slice(first, last), where=f" chunk c/{index}{tail}")
                continue
            try:
                chunk = decode(data)
            except Exception as error:  # a codec frame that does not decode although its checksum matched
                raise CacheCorruptError(
                    f"shard {shard} of {self.url}: {where} fails to decode ({type(error).__name__}: {error}); "
                    f"{CORRUPT_SHARD_REPAIR}"
                ) from error
            out[first - lo : last - lo] = chunk[first - index * step : last - index * step]
        return out

    def _shard_index(self, shard: int) -> tuple[np.ndarray, np.ndarray]:
        if shard not in self._index:
            record = self.commit_record(shard)
            stored_offsets, stored_rows = self._decoded_rows(shard, "offsets"), self._decoded_rows(shard, "corpus_rows")
            offsets, corpus_rows = stored_offsets.astype(np.int64), stored_rows.astype(np.int64)
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
            # After the checks above, which say what is wrong in words; this one catches any other change.
            check_array_segments(self.url, shard, "offsets", stored_offsets, record)
            check_array_segments(self.url, shard, "corpus_rows", stored_rows, record)
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
        if shard not in self._supervised:
            offsets, _ = self._shard_index(shard)
            loss_mask = self.verified_array(shard, "loss_mask")
            running = np.concatenate([[0], np.cumsum(loss_mask != 0, dtype=np.int64)])
            self._supervised[shard] = running[offsets[1:]] - running[offsets[:-1]]
        return self._supervised[shard].copy()

    def shard_corpus_rows(self, shard: int) -> np.ndarray:
        """Corpus row of each sample of ``shard``: ``int64 [S]``."""
        return self._shard_index(shard)[1].copy()

    @property
    def document_keys_info(self) -> dict[str, Any] | None:
        """The root attribute recording the cache's document keys (``num_rows``, ``num_documents``, ``sha256``), as
        written (unchecked; :meth:`document_keys` checks), or ``None`` when the cache holds none."""
        record = dict(self._store.group.attrs).get(DOCUMENT_KEYS_ATTRIBUTE)
        return dict(record) if record is not None else None

    def document_keys(self) -> np.ndarray | None:
        """The corpus's source-document key of every corpus row, ``[R]`` uint64 indexed by corpus row (the root
        array ``document_keys``, checked against its committing attribute: row count and sha256), or ``None`` when
        the cache holds none (made from a corpus without ``document_id``, or by older code). Read once (8 bytes per
        corpus row), then kept.

        Raises:
            CacheCorruptError: the attribute exists but the array is missing, unreadable, of another length, does
                not cover the planned rows, or differs from the recorded sha256.
        """
        if self._document_keys is not None:
            return self._document_keys
        record = self.document_keys_info
        if record is None:
            return None
        repair = ("re-extract the cache, or delete the root attribute dflash_document_keys (training then splits by "
                  "row)")
        try:
            keys = np.asarray(self._store.group[DOCUMENT_KEYS_ARRAY][...], dtype=np.uint64)
        except Exception as error:  # missing array, crc32c mismatch, truncated chunk
            raise CacheCorruptError(
                f"{self.url}: array {DOCUMENT_KEYS_ARRAY!r} is missing or unreadable ({type(error).__name__}: {error}) "
                f"although {DOCUMENT_KEYS_ATTRIBUTE} records it; {repair}"
            ) from error
        planned = self.metadata.shard_rows[-1][1] if self.metadata.shard_rows else 0
        found = document_keys_record(keys)
        if any(found[name] != record.get(name) for name in ("num_rows", "sha256")) or keys.size < planned:
            raise CacheCorruptError(
                f"{self.url}: array {DOCUMENT_KEYS_ARRAY!r} ({found['num_rows']} rows, {found['sha256']}) differs from "
                f"{DOCUMENT_KEYS_ATTRIBUTE} ({record.get('num_rows')} rows, {record.get('sha256')}) or does not cover the "
                f"{planned} planned corpus rows; {repair}"
            )
        self._document_keys = keys
        return keys

    def quarantined(self) -> list[dict[str, Any]]:
        """Quarantined samples of all committed shards (each entry with its ``shard``)."""
        return [{**entry, "shard": shard} for shard in self.shards for entry in self.commit_record(shard).get("quarantined", [])]

    def read_shard(self, shard: int, indices: list[int] | np.ndarray | None = None) -> list[HiddenSample]:
        """Samples of ``shard`` (all, or ``indices`` in the given order) with bf16 hidden states.

        Adjacent requested samples are read as one token span, so reading a whole shard or a sorted subset
        decodes each chunk once.

        Returns:
            ``HiddenSample``s: input_ids ``int32 [L]``, loss_mask ``uint8 [L]``, hidden ``bfloat16 [L, n*H]``
            (``[L, (n+1)*H]``, the final tap last, for a reader opened with ``final_tap=True``).

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

        samples: dict[int, HiddenSample] = {}
        for first, last in runs:
            lo, hi = int(offsets[first]), int(offsets[last])
            span = {name: self.verified_array(shard, name)[lo:hi] for name in names if name != "hidden"}
            span["hidden"] = self._decoded_rows(shard, "hidden", lo, hi)
            if self.metadata.lossy:
                hidden = dequantize_fp8(span["hidden"], span["hidden_scale"], self.metadata.stored_taps)
            else:
                hidden = torch.from_numpy(np.ascontiguousarray(span["hidden"])).view(torch.bfloat16)
            if self.metadata.final_tap and not self.final_tap:  # the n taps alone
                hidden = hidden[:, : self.metadata.num_taps * self.metadata.hidden_size].contiguous()
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
