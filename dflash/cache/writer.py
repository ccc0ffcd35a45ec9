"""Writing the hidden-state cache: create a cache, write a shard (arrays first, commit record last), finalize.

Exactly-once rules: a shard is written by exactly one task; its arrays go to
``shards/NNNNNN/`` and its commit record to ``commits/shard-NNNNNN.json`` last, with the store's atomic put.
Only shards with a commit record count. Writing an uncommitted shard first deletes whatever a killed earlier
attempt left there; writing an already committed shard is a no-op that returns the existing record, so a rerun
or a retried Dask task never double counts.

Write path of ``hidden`` (the bulk of a shard: ~670 MB for 16K tokens of an 8B target with 5 taps): the samples
are never concatenated into one shard-sized array. Each ``chunk_tokens`` chunk is one job on a thread pool: it
gathers its rows from the samples (a ~10 MB copy), hashes them (the chunk is one sha256 digest segment) and
stores them with zarr (``array[lo:hi] = rows``: zarr's codec chain encodes and checksums it in its own pool).
So gathering, hashing and compression all run chunk-parallel on every write thread, and no stage is serial over
the whole shard (measured: ~1.7x less CPU per GB than one ``torch.cat`` + one ``array[...] = values``; figures in
docs/cache-format.md).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np
import torch

from dflash.cache.chunks import chunk_encoder, crc32c_trailer, store_chunk, stored_chunk_crc32c
from dflash.cache.format import (
    DOCUMENT_KEYS_ARRAY,
    DOCUMENT_KEYS_ATTRIBUTE,
    FORMAT_VERSION,
    METADATA_ATTRIBUTE,
    CacheMetadata,
    HiddenSample,
    codec_preset_name,
    commit_key,
    quantize_fp8,
    shard_group_key,
    zarr_compressors,
)
from dflash.cache.store import CacheStore, open_cache_store, read_cache_metadata
from dflash.errors import CacheError
from dflash.faults import fault_point

__all__ = [
    "DIGEST_SEGMENT_BYTES",
    "DIGEST_VERSION",
    "SMALL_ARRAY_CHUNK_ROWS",
    "HiddenStateCache",
    "array_chunk_keys",
    "array_settings",
    "expected_array_metadata",
    "chunk_write_threads",
    "digest_root",
    "document_keys_record",
    "segment_digests",
    "segment_views",
    "shard_arrays",
]

log = logging.getLogger(__name__)
_COUNTS_ATTRIBUTE = "dflash_cache_counts"


SMALL_ARRAY_CHUNK_ROWS = 1 << 16
"""Rows a chunk of the small per-shard arrays (offsets, corpus_rows, input_ids, loss_mask, hidden_scale) holds."""
DIGEST_SEGMENT_BYTES = 64 << 20
"""Segment size of the sha256 digest segments (:func:`segment_views`) of the small per-shard arrays."""
DIGEST_VERSION = 3
"""Commit-record digest scheme written by this code. 1 (records without ``digest_version``): ``sha256:`` of one
serial stream over each array's name then raw bytes. 2: ``sha256-tree:`` root over per-array lists of sha256
digests of ``digest_segment_bytes`` segments of the raw bytes (``arrays[name]["sha256_segments"]``). 3: as 2, except
that ``hidden``'s leaves are the crc32c checksums its stored chunks already carry (``arrays["hidden"]
["crc32c_chunks"]``, 8 hex digits each, chunk order): the write path does not hash the hidden states a second time
(docs/benchmarks.md has the cost of a sha256 pass), yet a chunk that is altered, swapped or
replaced by another valid chunk still changes a leaf and the root. ``verify`` reads all three."""


def segment_views(values: np.ndarray, segment_bytes: int | None = None) -> list[memoryview]:
    """The raw bytes of ``values`` (C order) as consecutive ``segment_bytes`` slices, no copy for contiguous input;
    an empty array has no segments. ``segment_bytes`` defaults to :data:`DIGEST_SEGMENT_BYTES`."""
    segment_bytes = segment_bytes or DIGEST_SEGMENT_BYTES
    flat = memoryview(np.ascontiguousarray(values).view(np.uint8).reshape(-1))
    return [flat[lo : lo + segment_bytes] for lo in range(0, len(flat), segment_bytes)]


def _sha256_hex(segment: memoryview) -> str:
    return hashlib.sha256(segment).hexdigest()  # hashlib releases the GIL for buffers over 2 KiB


def digest_root(segments: dict[str, list[str]], nbytes: dict[str, int]) -> str:
    """Root of the version-2 digest: sha256 over, per array in layout order, ``name NUL uint64-LE(nbytes)`` then
    its segment digests (32 raw bytes each). Returns ``"sha256-tree:<hex>"``."""
    root = hashlib.sha256()
    for name, leaves in segments.items():
        root.update(name.encode() + b"\0" + int(nbytes[name]).to_bytes(8, "little"))
        for leaf in leaves:
            root.update(bytes.fromhex(leaf))
    return f"sha256-tree:{root.hexdigest()}"


def segment_digests(
    named_arrays: list[tuple[str, np.ndarray]], pool: ThreadPoolExecutor, segment_bytes: int | None = None
) -> dict[str, list[Future[str]]]:
    """Submit the sha256 of every ``segment_bytes`` segment of every array to ``pool`` (all segments of all arrays
    hash concurrently); returns name -> futures of hex digests, in order. The arrays must stay unchanged until
    the futures are done (the segments are views, not copies)."""
    return {name: [pool.submit(_sha256_hex, view) for view in segment_views(values, segment_bytes)] for name, values in named_arrays}


def chunk_write_threads() -> int:
    """Threads of a shard write: zarr's ``threading.max_workers`` when set (``configure_write_threads``), else the
    cores this process may use (sched_getaffinity where the OS has it)."""
    import zarr

    configured = zarr.config.get("threading.max_workers", None)
    if configured:
        return max(1, int(configured))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores)


def shard_arrays(metadata: CacheMetadata) -> dict[str, tuple[str, int]]:
    """Arrays of a shard: name -> (numpy dtype, trailing width or 0 for 1-D), in digest order."""
    arrays: dict[str, tuple[str, int]] = {
        "offsets": ("int64", 0),
        "corpus_rows": ("int64", 0),
        "input_ids": ("int32", 0),
        "loss_mask": ("uint8", 0),
    }
    if metadata.storage_dtype == "bfloat16":
        arrays["hidden"] = ("uint16", metadata.row_width)
    else:
        arrays["hidden"] = ("uint8", metadata.row_width)
        arrays["hidden_scale"] = ("float32", metadata.stored_taps)
    return arrays


def array_settings(metadata: CacheMetadata, name: str) -> dict[str, Any]:
    """The settings every shard's array ``name`` is created with, besides its shape and chunks (``create_array``
    keyword arguments): dtype (:func:`shard_arrays`), the cache's codec, fill value 0, every chunk written."""
    return _array_settings(metadata.codec, shard_arrays(metadata)[name][0])


def _array_settings(codec: dict[str, Any], dtype: str) -> dict[str, Any]:
    return {"dtype": dtype, "compressors": zarr_compressors(codec), "fill_value": 0,
            "config": {"write_empty_chunks": True}}


#: ``zarr.json`` fields that decide how a shard's array is read, besides shape and chunk grid (the record's).
_COMPARED_ARRAY_FIELDS = ("zarr_format", "node_type", "data_type", "chunk_key_encoding", "fill_value", "codecs",
                          "storage_transformers")


@functools.lru_cache(maxsize=64)
def _array_metadata_fields(codec_json: str, dtype: str, width: int) -> tuple[tuple[str, Any], ...]:
    """The :data:`_COMPARED_ARRAY_FIELDS` of the ``zarr.json`` of an array of these settings, as zarr writes them
    (an array created in memory)."""
    import zarr
    from zarr.core.buffer import default_buffer_prototype
    from zarr.storage import MemoryStore

    shape = [1] + ([width] if width else [])
    array = zarr.create_array(store=MemoryStore(), name="a", shape=shape, chunks=shape,
                              **_array_settings(json.loads(codec_json), dtype))
    document = json.loads(array.metadata.to_buffer_dict(default_buffer_prototype())["zarr.json"].to_bytes())
    return tuple((key, document.get(key)) for key in _COMPARED_ARRAY_FIELDS)


def expected_array_metadata(metadata: CacheMetadata, name: str, shape: list[int], chunks: list[int]) -> dict[str, Any]:
    """The ``zarr.json`` fields (shape, chunk grid, :data:`_COMPARED_ARRAY_FIELDS`; not ``attributes``) that
    :meth:`HiddenStateCache.write_shard` writes for a shard's array ``name`` of ``shape`` in ``chunks``, from the
    cache's root metadata: what a check compares a stored one with."""
    dtype, width = shard_arrays(metadata)[name]
    fields = dict(_array_metadata_fields(json.dumps(metadata.codec, sort_keys=True), dtype, width))
    return {"shape": list(shape), "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
            **fields}


def array_chunk_keys(shape: list[int], chunks: list[int]) -> set[str]:
    """Zarr v3 default chunk keys (``c/i/j``) of an array fully written with ``write_empty_chunks``."""
    grid = [max(0, -(-size // chunk)) for size, chunk in zip(shape, chunks, strict=True)]
    keys = [""]
    for count in grid:
        keys = [f"{prefix}/{index}" for prefix in keys for index in range(count)]
    return {"c" + key for key in keys}


class HiddenStateCache:
    """Writer side of a cache. Create with :meth:`create`, reopen with :meth:`open`.

    Thread/process safety: different shards may be written concurrently from any number of processes or
    machines; one shard must have exactly one writer at a time (the extract stage's Dask tasks guarantee it).
    """

    def __init__(self, store: CacheStore, metadata: CacheMetadata) -> None:
        self._store = store
        self.metadata = metadata
        self.url = store.url

    # ----------------------------------------------------------------------------------------------- lifecycle
    @classmethod
    def create(cls, path: str | os.PathLike[str], metadata: CacheMetadata, overwrite: bool = False, *,
               document_keys: np.ndarray | None = None) -> HiddenStateCache:
        """Create a new cache at ``path`` (folder or fsspec URL) holding ``metadata`` as root attributes.

        An existing cache with the same target, taps, storage dtype, codec, corpus fingerprint and shard plan is
        reopened as is (so a rerun resumes); anything else at ``path`` is an error unless ``overwrite``.

        Args:
            document_keys: ``[R]`` uint64, the corpus's ``Corpus.document_keys`` (R = corpus rows, at least every
                planned row), stored as the root array ``document_keys`` before any shard is written (``None``: a
                corpus without ``document_id``; nothing is stored). On reopening, a cache holding keys must hold
                these; one created without keys (killed before they were committed) gets them.

        Raises:
            CacheError: ``path`` holds something else, or other document keys; the message names the differing
                field and the fix.
        """
        path = os.fspath(path)
        if not overwrite:
            try:
                existing = cls.open(path)
            except (CacheError, FileNotFoundError):
                existing = None
            if existing is not None:
                _check_resumable(path, existing.metadata, metadata)
                existing._resume_document_keys(document_keys)
                return existing
            cls.check_creatable(path)
        store = CacheStore(path, "w", attributes={METADATA_ATTRIBUTE: metadata.to_dict()})
        cache = cls(store, metadata)
        if document_keys is not None:
            cache._write_document_keys(document_keys)
        return cache

    # ----------------------------------------------------------------------------------------------- document keys
    def _write_document_keys(self, document_keys: np.ndarray) -> None:
        """Store ``document_keys`` (array first, then its committing root attribute; a kill in between leaves a
        cache without keys, which the next run completes)."""
        from zarr.codecs import Crc32cCodec

        keys = np.ascontiguousarray(document_keys, dtype="<u8").reshape(-1)
        planned = self.metadata.shard_rows[-1][1] if self.metadata.shard_rows else 0
        if keys.size < max(planned, 1):
            raise CacheError(
                f"document_keys: {keys.size} keys for the {planned} planned corpus rows of {self.url}; pass the corpus's "
                "Corpus.document_keys (one key per corpus row)"
            )
        # Keys are hashes (incompressible): crc32c only, as the other arrays end.
        array = self._store.group.create_array(
            DOCUMENT_KEYS_ARRAY, shape=keys.shape, dtype="uint64", chunks=(min(SMALL_ARRAY_CHUNK_ROWS, keys.size),),
            compressors=[Crc32cCodec()], fill_value=0, config={"write_empty_chunks": True}, overwrite=True,
        )
        array[...] = keys
        record = document_keys_record(keys)
        self._store.group.update_attributes({DOCUMENT_KEYS_ATTRIBUTE: record})  # the commit, last
        log.info("%s: stored the document keys of %d corpus rows (%d documents)", self.url, keys.size,
                 record["num_documents"])

    def _resume_document_keys(self, document_keys: np.ndarray | None) -> None:
        """Reopening: the stored keys must equal ``document_keys``; a cache without keys gets them."""
        stored = dict(self._store.group.attrs).get(DOCUMENT_KEYS_ATTRIBUTE)
        if stored is None:
            if document_keys is not None:
                self._write_document_keys(document_keys)
            return
        if document_keys is None:
            raise CacheError(
                f"cannot resume the cache at {self.url}: it holds the document keys of {stored['num_rows']} corpus rows "
                "but this corpus has no document_id column (it was rewritten without it); pass the corpus the cache "
                "was made from, or use another --output"
            )
        wanted = document_keys_record(np.ascontiguousarray(document_keys, dtype="<u8").reshape(-1))
        if wanted != stored:
            raise CacheError(
                f"cannot resume the cache at {self.url}: its document keys ({stored['num_rows']} rows, "
                f"{stored['num_documents']} documents, {stored['sha256']}) differ from this corpus's ({wanted['num_rows']} "
                f"rows, {wanted['num_documents']} documents, {wanted['sha256']}): the corpus's document_id column changed; "
                "pass the corpus the cache was made from, or use another --output"
            )

    @staticmethod
    def check_creatable(path: str | os.PathLike[str]) -> None:
        """Refuse a ``path`` that holds something other than a cache (a non-empty folder without one), as
        :meth:`create` does, without creating anything.

        Raises:
            CacheError: ``path`` is a non-empty local folder (extract never deletes a folder it did not write).
        """
        if _has_content(os.fspath(path)):
            raise CacheError(f"{os.fspath(path)} exists and is not a dflash cache; choose another --output (extract "
                             "never deletes a folder it did not write)")  # fmt: skip

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> HiddenStateCache:
        """Open an existing cache for writing more shards.

        Raises:
            CacheError: no cache at ``path`` (or not this format).
        """
        store = open_cache_store(path, "r+")
        return cls(store, read_cache_metadata(store))

    # ----------------------------------------------------------------------------------------------- shards
    def committed_shards(self) -> set[int]:
        """Ids of shards whose commit record exists (the only ones that count)."""
        return committed_shard_ids(self._store)

    def commit_record(self, shard_id: int) -> dict[str, Any] | None:
        return self._store.get_json(commit_key(shard_id))

    def write_shard(
        self,
        shard_id: int,
        samples: list[HiddenSample],
        quarantined: list[dict[str, Any]] | None = None,
        *,
        skipped: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """Write one shard: clear leftovers, write every array, then the commit record (atomically, last).

        Args:
            shard_id: index into ``metadata.shard_rows``.
            samples: the shard's samples in any order (stored in the given order); ``hidden`` is
                ``Tensor[L, n*H]`` bf16 (or float32, converted), on any device.
            quarantined: samples left out for non-finite hidden states, one
                :func:`dflash.cache.format.quarantine_record` dict each (``corpus_row``, ``sample_id``, ``layers``).
            skipped: rows of the shard's range deliberately not extracted (e.g. dropped by a length policy), each
                ``{"corpus_row": int, "reason": str}``; they keep ``verify``'s completeness check exact.

        Returns:
            The commit record (small JSON-able dict: counts, digest, per-array layout, quarantine list). For an
            already committed shard, its existing record with ``"already_committed": True``; nothing is written.

        Raises:
            CacheError: bad shard id, a sample outside the shard's row range, a duplicate row, a shape or width
                mismatch; the message names the shard and the sample.
        """
        meta = self.metadata
        write_started = time.perf_counter()
        if not 0 <= shard_id < meta.num_shards:
            raise CacheError(f"shard {shard_id} is outside the plan of {meta.num_shards} shards of {self.url}")
        existing = self.commit_record(shard_id)
        if existing is not None:
            log.info("shard %d of %s is already committed; skipping", shard_id, self.url)
            return {**existing, "already_committed": True}
        quarantined = [dict(entry) for entry in quarantined or []]
        skipped = [dict(entry) for entry in skipped or []]
        start, stop = meta.shard_rows[shard_id]
        _check_rows(shard_id, start, stop, samples, quarantined, skipped)

        lengths = np.array([len(sample) for sample in samples], dtype=np.int64)
        offsets = np.zeros(len(samples) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        num_tokens = int(offsets[-1])
        data: dict[str, np.ndarray] = {
            "offsets": offsets,
            "corpus_rows": np.array([sample.corpus_row for sample in samples], dtype=np.int64),
            "input_ids": _concat(samples, "input_ids", torch.int32, num_tokens, shard_id),
            "loss_mask": _concat(samples, "loss_mask", torch.uint8, num_tokens, shard_id),
        }
        parts = _hidden_parts(samples, meta.row_width, shard_id)  # per-sample bf16 [L, n*H] on the CPU, no copy
        fp8 = meta.storage_dtype != "bfloat16"
        layout = shard_arrays(meta)
        hidden_dtype = np.dtype(layout["hidden"][0])
        if fp8:
            data["hidden_scale"] = np.zeros((num_tokens, meta.stored_taps), dtype=np.float32)  # filled chunk by chunk
        segment_bytes = DIGEST_SEGMENT_BYTES
        raw_bytes = int(sum(values.nbytes for values in data.values())) + num_tokens * meta.row_width * hidden_dtype.itemsize

        group_key = shard_group_key(shard_id)
        self._store.delete_dir(group_key)  # leftovers of a killed attempt never mix with this one
        group = self._store.group.create_group(group_key, overwrite=True)
        arrays: dict[str, Any] = {}
        segments: dict[str, list[str]] = {}

        def create(name: str, shape: list[int]) -> Any:
            width = layout[name][1]
            # hidden: chunk_tokens rows (~8 MiB). The small arrays (1 to 8 bytes a row): 65,536-row chunks, so a
            # shard's input_ids or loss_mask is one or two chunks to read and check, not hundreds of 1 KiB ones
            # (per-chunk overhead dominated the trainer's planning and its integrity check before step 1).
            chunk_rows = meta.chunk_tokens if name == "hidden" else SMALL_ARRAY_CHUNK_ROWS
            chunks = [max(1, min(chunk_rows, shape[0]))] + ([width] if width else [])
            array = group.create_array(name, shape=shape, chunks=chunks, **array_settings(meta, name))
            arrays[name] = {"shape": shape, "chunks": chunks, "num_chunks": len(array_chunk_keys(shape, chunks))}
            return array

        # One process-wide FIFO pool: concurrent shard writes queue their chunks oldest shard first.
        pool = _chunk_pool(chunk_write_threads())
        submitted: list[Future] = []
        try:
            hidden = create("hidden", [num_tokens, meta.row_width])
            encode = chunk_encoder(hidden) if num_tokens and _direct_chunks() else None
            chunk_starts = range(0, num_tokens, hidden.chunks[0])
            jobs = [pool.submit(_write_hidden_chunk, hidden, encode, parts, offsets, start,
                                min(num_tokens, start + hidden.chunks[0]), fp8, meta.stored_taps,
                                data.get("hidden_scale")) for start in chunk_starts]  # fmt: skip
            submitted += jobs
            small = [name for name in layout if name != "hidden"]
            pending = segment_digests([(name, data[name]) for name in small if name != "hidden_scale"], pool,
                                      segment_bytes)  # fmt: skip
            submitted += [future for futures in pending.values() for future in futures]
            for name in small:
                if name == "hidden_scale":
                    continue  # written once every chunk job has filled in its scales
                array = create(name, list(data[name].shape))
                if data[name].size:
                    array[...] = data[name]
            segments["hidden"] = [job.result() for job in jobs]
            hidden_done = time.perf_counter()
            if fp8:
                pending.update(segment_digests([("hidden_scale", data["hidden_scale"])], pool, segment_bytes))
                array = create("hidden_scale", list(data["hidden_scale"].shape))
                if num_tokens:
                    array[...] = data["hidden_scale"]
            for name, futures in pending.items():
                segments[name] = [future.result() for future in futures]
        except OSError as error:
            wait(submitted)  # no job of this attempt may still read the samples or write into the shard
            raise CacheError(
                f"shard {shard_id} of {self.url}: writing its arrays failed ({error}); the shard stays uncommitted and "
                "is redone by the next run (free space or fix the store first)"
            ) from error
        except BaseException:
            wait(submitted)
            raise
        arrays = {name: arrays[name] for name in layout}  # record in layout (digest) order
        nbytes = {name: int(data[name].nbytes) for name in layout if name != "hidden"}
        nbytes["hidden"] = num_tokens * meta.row_width * hidden_dtype.itemsize
        for name in layout:
            arrays[name]["crc32c_chunks" if name == "hidden" else "sha256_segments"] = segments[name]
        for name in arrays:
            arrays[name]["stored_bytes"] = self._store.size_prefix(f"{group_key}/{name}")

        record = {
            "format_version": FORMAT_VERSION,
            "shard": shard_id,
            "row_range": [start, stop],
            "num_samples": len(samples),
            "num_tokens": num_tokens,
            "num_quarantined": len(quarantined),
            "quarantined": quarantined,
            "num_skipped": len(skipped),
            "skipped": skipped,
            "storage_dtype": meta.storage_dtype,
            "arrays": arrays,
            "raw_bytes": raw_bytes,
            "stored_bytes": int(sum(entry["stored_bytes"] for entry in arrays.values())),
            "digest_version": DIGEST_VERSION,
            "digest_segment_bytes": segment_bytes,
            "digest": digest_root({name: segments[name] for name in layout}, {name: nbytes[name] for name in layout}),
            "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            # Telemetry (informative, not part of the digest): wall seconds of this write, and from its start until
            # the last hidden chunk was stored (chunk jobs queue behind other shards' in the shared pool).
            "write_seconds": round(time.perf_counter() - write_started, 4),
            "hidden_seconds": round(hidden_done - write_started, 4),
            "writer": f"{socket.gethostname()}:{os.getpid()}",
        }
        fault_point("cache.before-commit", f"{self.url}/{commit_key(shard_id)}")
        self._store.put_json(commit_key(shard_id), record, exclusive=True)
        stored = self.commit_record(shard_id)
        if stored is None or stored.get("digest") != record["digest"] or stored.get("writer") != record["writer"]:
            raise CacheError(
                f"shard {shard_id} of {self.url} was committed by another writer ({(stored or {}).get('writer')}) while "
                f"this one ({record['writer']}) wrote it: two tasks ran on one shard; run `dflash-stages cache verify "
                f"{self.url}` and, if it names this shard, delete {commit_key(shard_id)} and rerun extract"
            )
        fault_point("cache.after-commit")
        return record

    def uncommit(self, shard_id: int) -> bool:
        """Withdraw a shard: delete its commit record first (it stops counting at once), then its data, so the
        next extract run redoes it. Returns whether a commit record existed. Use it on a shard ``verify`` names."""
        existed = self._store.exists(commit_key(shard_id))
        if existed:
            self._store.delete(commit_key(shard_id))
        self._store.delete_dir(shard_group_key(shard_id))
        return existed

    def finalize(self) -> dict[str, Any]:
        """Aggregate the commit records into totals and store them as the root attribute ``dflash_cache_counts``.

        Call once, from one process, after the extract run; readers never depend on it (they read the commit
        records), it only makes ``cache info`` and plain zarr tools show the totals.
        """
        counts = summarize_commits(self._store, self.metadata)
        self._store.group.update_attributes({_COUNTS_ATTRIBUTE: counts})
        return counts


# --------------------------------------------------------------------------------------------------- helpers
def _has_content(path: str) -> bool:
    path = path[len("file://"):] if path.startswith("file://") else path
    if "://" in path:
        return False
    return os.path.isdir(path) and any(os.scandir(path))


def _check_resumable(path: str, existing: CacheMetadata, wanted: CacheMetadata) -> None:
    for name in ("target", "target_layer_ids", "final_tap", "storage_dtype", "codec", "corpus_fingerprint",
                 "shard_rows", "chunk_tokens"):
        have, want = getattr(existing, name), getattr(wanted, name)
        if have != want:
            if name == "codec":  # named as the --codec presets are
                have, want = codec_preset_name(have), codec_preset_name(want)
            raise CacheError(
                f"cannot resume the cache at {path}: its {name} is {have!r} but this run wants {want!r}; "
                + ("pass --codec auto (an existing cache keeps its codec), " if name == "codec" else "")
                + "use another --output, or delete that cache yourself if it is no longer needed"
            )


def document_keys_record(keys: np.ndarray) -> dict[str, Any]:
    """The root attribute committing a cache's ``document_keys`` (``[R]`` uint64): ``num_rows`` (R),
    ``num_documents`` (distinct keys) and ``sha256`` (``"sha256:<hex>"`` of the keys as uint64 little-endian)."""
    keys = np.ascontiguousarray(keys, dtype="<u8")
    return {"num_rows": int(keys.size), "num_documents": int(np.unique(keys).size),
            "sha256": "sha256:" + hashlib.sha256(keys.view(np.uint8)).hexdigest()}


def committed_shard_ids(store: CacheStore) -> set[int]:
    """Ids of the shards whose commit record exists (listing ``commits/``; no array is read)."""
    shards = set()
    for key in store.list_prefix("commits"):
        name = key.rsplit("/", 1)[-1]
        if name.startswith("shard-") and name.endswith(".json"):
            shards.add(int(name[len("shard-"):-len(".json")]))
    return shards


def summarize_commits(store: CacheStore, metadata: CacheMetadata) -> dict[str, Any]:
    """Totals over committed shards: shards, samples, tokens, quarantined, skipped, raw and stored bytes."""
    totals = {"committed_shards": 0, "num_samples": 0, "num_tokens": 0, "num_quarantined": 0, "num_skipped": 0, "raw_bytes": 0, "stored_bytes": 0}
    for shard_id in sorted(committed_shard_ids(store)):
        record = store.get_json(commit_key(shard_id)) or {}
        totals["committed_shards"] += 1
        for name in ("num_samples", "num_tokens", "num_quarantined", "num_skipped", "raw_bytes", "stored_bytes"):
            totals[name] += int(record.get(name, 0))
    totals["planned_shards"] = metadata.num_shards
    return totals


def _check_rows(shard_id: int, start: int, stop: int, samples: list[HiddenSample], quarantined: list[dict], skipped: list[dict]) -> None:
    seen: dict[int, str] = {}
    entries = [(int(s.corpus_row), "sample") for s in samples]
    entries += [(int(e["corpus_row"]), "quarantined") for e in quarantined]
    entries += [(int(e["corpus_row"]), "skipped") for e in skipped]
    for row, kind in entries:
        if not start <= row < stop:
            raise CacheError(f"shard {shard_id}: {kind} corpus row {row} is outside the shard's rows [{start}, {stop})")
        if row in seen:
            raise CacheError(f"shard {shard_id}: corpus row {row} given twice (as {seen[row]} and as {kind})")
        seen[row] = kind


def _concat(samples: list[HiddenSample], name: str, dtype: torch.dtype, num_tokens: int, shard_id: int) -> np.ndarray:
    parts = []
    for sample in samples:
        values = getattr(sample, name)
        if values.dim() != 1:
            raise CacheError(f"shard {shard_id}, corpus row {sample.corpus_row}: {name} must be 1-D, got shape {tuple(values.shape)}")
        parts.append(values.detach().to("cpu", dtype))
    if not parts:
        return np.zeros(0, dtype=torch.empty(0, dtype=dtype).numpy().dtype)
    out = torch.cat(parts).numpy()
    assert out.shape[0] == num_tokens
    return out


@functools.cache
def _chunk_pool(threads: int) -> ThreadPoolExecutor:
    """The process-wide pool of chunk-write threads (one per thread count, created on first use, kept for the
    process's life). Shared by every concurrent ``write_shard``: jobs run in submission order, so the oldest
    shard's chunks finish first and its pinned buffers are released soonest, and the cores are never
    oversubscribed by one pool per write."""
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cache-write", initializer=_yield_to_compute)


def _yield_to_compute() -> None:
    """Chunk-write threads run at a lower priority (nice +5, Linux per-thread) than the thread feeding the GPU, so
    a write backlog never delays kernel launches; with idle cores they run at full speed anyway."""
    if hasattr(os, "setpriority") and hasattr(threading, "get_native_id"):
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + 5))
        except OSError:
            pass


def _direct_chunks() -> bool:
    """Whether hidden chunks are encoded and stored off zarr's event loop (:mod:`dflash.cache.chunks`); set the
    environment variable ``DFLASH_CACHE_DIRECT_CHUNKS=0`` to route them through ``array[lo:hi] = rows`` instead
    (same bytes on disk; for comparison and debugging)."""
    return os.environ.get("DFLASH_CACHE_DIRECT_CHUNKS", "1") != "0"


def _hidden_parts(samples: list[HiddenSample], width: int, shard_id: int) -> list[np.ndarray]:
    """Each sample's ``hidden`` as a ``uint16 [L, width]`` view of bf16 bits on the CPU (no copy for CPU bf16
    input, e.g. the runner's pinned buffers; other devices/dtypes are converted). Raises CacheError on a bad shape."""
    parts = []
    for sample in samples:
        shape = tuple(sample.hidden.shape)
        if shape != (len(sample), width) or shape[0] != sample.loss_mask.shape[0]:
            raise CacheError(
                f"shard {shard_id}, corpus row {sample.corpus_row}: hidden has shape {shape}, expected "
                f"({len(sample)}, {width}) = (tokens, stored taps * hidden_size), with loss_mask of the same length"
            )
        hidden = sample.hidden.detach()
        if hidden.device.type != "cpu" or hidden.dtype != torch.bfloat16:
            hidden = hidden.to("cpu", torch.bfloat16)
        parts.append(hidden.contiguous().view(torch.uint16).numpy())
    return parts


def _write_hidden_chunk(
    array: Any,
    encode: Any,
    parts: list[np.ndarray],
    offsets: np.ndarray,
    lo: int,
    hi: int,
    fp8: bool,
    num_taps: int,
    scale_out: np.ndarray | None,
) -> str:
    """One chunk job of :meth:`HiddenStateCache.write_shard`: gather tokens ``[lo, hi)`` of the shard from the
    samples (``parts``, CSR ``offsets``), quantize them for fp8 storage, store them as chunk ``lo // chunk_tokens``
    of ``array`` and return its digest leaf: the crc32c checksum the stored chunk carries, as 8 hex digits.

    With ``encode`` (:func:`dflash.cache.chunks.chunk_encoder`) the chunk is encoded and stored in this thread
    (byte-identical to zarr's own encoding; a partial last chunk is zero-padded to the chunk shape as zarr pads
    edge chunks with the fill value); without, ``array[lo:hi] = rows`` goes through zarr's pipeline. numpy
    copies, hashlib and the codecs release the GIL, so jobs run truly in parallel."""
    chunk_rows = array.chunks[0]
    fault_point("cache.chunk-write", f"{array.store_path}/c/{lo // chunk_rows}/0")
    sample = int(np.searchsorted(offsets, lo, side="right")) - 1
    start = int(offsets[sample])
    if hi - lo == chunk_rows and int(offsets[sample + 1]) >= hi and not fp8 and encode is not None:
        # The whole chunk lies inside one sample: encode straight from its (pinned) rows, no gather copy.
        encoded = encode(parts[sample][lo - start : hi - start])
        store_chunk(array, (lo // chunk_rows, 0), encoded)
        return crc32c_trailer(encoded)
    rows = np.empty((chunk_rows if encode is not None else hi - lo, array.shape[1]), dtype=np.uint16)
    rows[hi - lo :] = 0  # zarr's fill value in the padded tail of a partial last chunk
    position = lo
    while position < hi:
        start, stop = int(offsets[sample]), int(offsets[sample + 1])
        take = min(hi, stop) - position
        if take > 0:
            rows[position - lo : position - lo + take] = parts[sample][position - start : position - start + take]
            position += take
        sample += 1
    if fp8:
        stored, scale = quantize_fp8(torch.from_numpy(rows).view(torch.bfloat16), num_taps)
        assert scale_out is not None
        scale_out[lo:hi] = scale[: hi - lo]
    else:
        stored = rows
    if encode is None:
        array[lo:hi] = stored
        return stored_chunk_crc32c(array, (lo // chunk_rows, 0))
    encoded = encode(stored)
    store_chunk(array, (lo // chunk_rows, 0), encoded)
    return crc32c_trailer(encoded)
