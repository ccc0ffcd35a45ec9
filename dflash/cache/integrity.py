"""The cache's integrity before training starts, cheaply: commit records against stored chunks, no hidden state
decompressed (the trainer runs :func:`check_cache` before step 1; ``benchmarks/cache_integrity.py`` measures it).

Per committed shard, against its commit record (``digest_version`` 3, docs/cache-format.md):

1. the record itself: it is the shard's (its ``shard`` and ``row_range`` are the plan's for that shard: shard folders
   swapped together with their records fail), and the digest root recomputed from the record's own leaves equals
   its ``digest`` (an edited record fails); every array's ``zarr.json`` is what the writer makes from the record's
   shape and chunks and the root metadata's dtype and codec (an edited shape, dtype or codec fails);
2. ``hidden``: every chunk the record lists is stored and its stored crc32c trailer (the last 4 bytes of the stored
   chunk: the chunk is neither read whole nor decompressed) equals the record's leaf for that chunk. A missing
   chunk, a chunk swapped in from another shard or another cache (valid crc32c of its own, wrong data), a truncated,
   extended or rewritten chunk fails; a bit flip inside a chunk keeps the trailer and is caught when the reader
   decodes the chunk (it checks the body against the trailer and the trailer against the record, before step 1
   only for the chunks read before it);
3. the small arrays (``offsets``, ``corpus_rows``, ``input_ids``, ``loss_mask`` [, ``hidden_scale``]: 17 bytes per
   token, 37 for fp8, against thousands for ``hidden``) are decoded and hashed against their sha256 segments, through
   the reader (:meth:`CacheReader.verified_array`), which keeps the results the loader's planning reads next;
4. the stored, quarantined and skipped rows cover the shard's row range exactly.

Across the cache: planned shards without a commit record make it incomplete (a :class:`CacheError`, unless
``allow_incomplete``; the report then says how many samples of how many planned rows remain). Records of
``digest_version`` < 3 hold no per-chunk checksum of ``hidden``: their hidden chunks are checked by their own crc32c
only when decoded (``dflash-stages cache verify`` checks them fully); the report counts them.

:func:`segment_leaves` and :func:`check_array_segments` are the reader's per-array checks.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from dflash.cache.format import CORRUPT_SHARD_REPAIR, shard_group_key
from dflash.errors import CacheCorruptError, CacheError

if TYPE_CHECKING:
    from dflash.cache.reader import CacheReader

__all__ = ["check_cache", "check_shard", "check_record_placement", "check_record_digest", "check_array_metadata",
           "check_hidden_trailers", "segment_leaves", "check_array_segments"]


def segment_leaves(values: np.ndarray, segment_bytes: int) -> list[str]:
    """sha256 hex digests of consecutive ``segment_bytes`` segments of ``values``' raw bytes (C order); the leaves
    a version-2/3 commit record keeps for a small array."""
    flat = memoryview(np.ascontiguousarray(values).view(np.uint8).reshape(-1))
    return [hashlib.sha256(flat[lo : lo + segment_bytes]).hexdigest() for lo in range(0, len(flat), segment_bytes)]


def check_array_segments(url: str, shard: int, name: str, values: np.ndarray, record: dict[str, Any]) -> None:
    """Raise :class:`CacheCorruptError` when the decoded array ``name`` of ``shard`` differs from its commit record's
    sha256 segments (records of digest_version >= 2; version 1 records keep no per-array leaves: nothing to check)."""
    if int(record.get("digest_version", 1)) < 2 or name == "hidden":  # hidden: per-chunk crc32c (reader)
        return
    segment_bytes = int(record.get("digest_segment_bytes", 64 << 20))
    expected = record["arrays"][name].get("sha256_segments")
    found = segment_leaves(values, segment_bytes)
    if found != expected:
        bad = next((i for i, (a, b) in enumerate(zip(found, expected or [], strict=False)) if a != b), None)
        where = f"segment {bad}" if bad is not None else f"{len(found)} segments against {len(expected or [])} recorded"
        raise CacheCorruptError(
            f"shard {shard} of {url}: array {name!r} {where} has a sha256 that differs from the commit record's; "
            f"a chunk was altered or swapped: {CORRUPT_SHARD_REPAIR}"
        )


def check_record_digest(reader: CacheReader, shard: int) -> None:
    """The commit record's digest root, recomputed from the record's own leaves, equals its ``digest``
    (digest_version 2 and 3; version 1 has no leaves). Raises :class:`CacheCorruptError` otherwise."""
    from dflash.cache.writer import digest_root, shard_arrays

    record = reader.commit_record(shard)
    version = int(record.get("digest_version", 1))
    if version == 1:
        return
    names = shard_arrays(reader.metadata)
    if sorted(record.get("arrays", {})) != sorted(names):
        raise CacheCorruptError(
            f"shard {shard} of {reader.url}: commit record lists arrays {sorted(record.get('arrays', {}))}, expected "
            f"{sorted(names)}; {CORRUPT_SHARD_REPAIR}"
        )
    leaves: dict[str, list[str]] = {}
    nbytes: dict[str, int] = {}
    for name, (dtype, _) in names.items():
        layout = record["arrays"][name]
        key = "crc32c_chunks" if version >= 3 and name == "hidden" else "sha256_segments"
        leaves[name] = list(layout.get(key) or [])
        nbytes[name] = int(np.prod(layout["shape"])) * np.dtype(dtype).itemsize
    if digest_root(leaves, nbytes) != record.get("digest"):
        raise CacheCorruptError(
            f"shard {shard} of {reader.url}: commit record's digest {str(record.get('digest'))[:28]}... does not match "
            f"its own leaves (digest_version {version}); the record was edited: {CORRUPT_SHARD_REPAIR}"
        )


def check_record_placement(reader: CacheReader, shard: int) -> None:
    """The commit record stored under ``shard`` is that shard's: its ``shard`` field is ``shard`` and its
    ``row_range`` the plan's range for it (root metadata ``shard_rows``). Shard folders moved or swapped together
    with their records keep every checksum valid and fail here.

    Raises:
        CacheCorruptError: naming the shard, what the record says and what the plan says.
    """
    record = reader.commit_record(shard)
    planned = list(reader.metadata.shard_rows[shard])
    recorded_shard, recorded_rows = record.get("shard", shard), record.get("row_range")
    if recorded_shard != shard or recorded_rows != planned:
        raise CacheCorruptError(
            f"shard {shard} of {reader.url}: its commit record is shard {recorded_shard}'s (corpus rows {recorded_rows}), "
            f"but the plan gives shard {shard} the rows {planned}: shard folders or commit records were moved or "
            f"swapped; {CORRUPT_SHARD_REPAIR}"
        )


def check_array_metadata(reader: CacheReader, shard: int) -> None:
    """Every array's stored ``zarr.json`` of ``shard`` is what the writer makes for it: shape and chunks from the
    commit record, dtype, codecs, fill value and the rest from the cache's root metadata
    (:func:`dflash.cache.writer.expected_array_metadata`; ``attributes`` are not compared). One small read per array,
    no chunk read.

    Raises:
        CacheCorruptError: a ``zarr.json`` is missing, unreadable or differs; names the file, the field and both values.
    """
    from dflash.cache.writer import expected_array_metadata, shard_arrays

    record = reader.commit_record(shard)
    names = list(shard_arrays(reader.metadata))
    keys = [f"{shard_group_key(shard)}/{name}/zarr.json" for name in names]
    for name, key, data in zip(names, keys, reader._store.get_many(keys), strict=True):
        try:
            stored = json.loads(data) if data is not None else None
        except ValueError:
            stored = None
        if not isinstance(stored, dict):
            raise CacheCorruptError(
                f"shard {shard} of {reader.url}: {key} is {'missing' if data is None else 'not a JSON object'}; "
                f"{CORRUPT_SHARD_REPAIR}"
            )
        layout = record["arrays"][name]
        expected = expected_array_metadata(reader.metadata, name, layout["shape"], layout["chunks"])
        for field, value in expected.items():
            if stored.get(field) != value:
                raise CacheCorruptError(
                    f"shard {shard} of {reader.url}: {key} has {field} {json.dumps(stored.get(field))}, but the commit "
                    f"record and the cache's root metadata give {json.dumps(value)}: the array's metadata was edited; "
                    f"{CORRUPT_SHARD_REPAIR}"
                )


def check_hidden_trailers(reader: CacheReader, shard: int) -> int:
    """Every ``hidden`` chunk of ``shard`` is stored and its crc32c trailer equals the commit record's leaf
    (digest_version 3; returns 0 without reading for older records). Returns the chunks checked.

    Raises:
        CacheCorruptError: a chunk is missing, or its trailer differs from the record (swapped, replaced, truncated
            or rewritten chunk); the message names the shard, the chunk index and its token range.
    """
    record = reader.commit_record(shard)
    if int(record.get("digest_version", 1)) < 3:
        return 0
    layout = record["arrays"]["hidden"]
    rows, step = int(layout["shape"][0]), int(layout["chunks"][0])
    expected = list(layout.get("crc32c_chunks") or [])
    count = -(-rows // step) if rows else 0
    if len(expected) != count:
        raise CacheCorruptError(
            f"shard {shard} of {reader.url}: commit record lists {len(expected)} crc32c leaves for array 'hidden', its "
            f"shape {layout['shape']} in chunks of {step} tokens needs {count}; {CORRUPT_SHARD_REPAIR}"
        )
    keys = [f"{shard_group_key(shard)}/hidden/c/{index}/0" for index in range(count)]
    trailers = reader._store.get_many(keys, suffix=4)  # local: one pread each; object stores: ranged GETs
    for index, (trailer, leaf) in enumerate(zip(trailers, expected, strict=True)):
        if trailer is not None and len(trailer) == 4 and trailer[::-1].hex() == leaf:
            continue
        where = f"array 'hidden' chunk {index} (c/{index}/0, rows {index * step}..{min(rows, (index + 1) * step)})"
        if trailer is None:
            raise CacheCorruptError(f"shard {shard} of {reader.url}: {where} is missing; {CORRUPT_SHARD_REPAIR}")
        found = trailer[::-1].hex() if len(trailer) == 4 else f"nothing ({len(trailer)} bytes stored)"
        raise CacheCorruptError(
            f"shard {shard} of {reader.url}: {where} ends with crc32c {found}, the commit record says {leaf}; the chunk "
            f"was swapped, replaced or truncated: {CORRUPT_SHARD_REPAIR}"
        )
    return count


def check_shard(reader: CacheReader, shard: int) -> dict[str, Any]:
    """Checks 1-4 of the module docstring on one committed shard; returns ``{"num_samples", "num_tokens",
    "hidden_chunks", "digest_version"}``.

    Raises:
        CacheCorruptError: the shard fails a check; the message names the shard, the array and the repair.
    """
    record = reader.commit_record(shard)
    check_record_placement(reader, shard)
    check_record_digest(reader, shard)
    check_array_metadata(reader, shard)
    chunks = check_hidden_trailers(reader, shard)
    names = ["input_ids"] + (["hidden_scale"] if reader.metadata.lossy else [])
    for name in names:
        reader.verified_array(shard, name)
    reader.shard_supervised_counts(shard)  # loss_mask, verified; the loader's planning reuses the counts
    rows = reader.shard_corpus_rows(shard)  # offsets and corpus_rows, verified and consistent
    start, stop = record["row_range"]
    accounted = np.concatenate(
        [rows, np.array([int(e["corpus_row"]) for e in record.get("quarantined", []) + record.get("skipped", [])],
                        dtype=np.int64)]
    )
    unique = np.unique(accounted)
    if unique.size != accounted.size or unique.size != stop - start or (unique.size and (unique[0] < start or unique[-1] >= stop)):
        missing = np.setdiff1d(np.arange(start, stop, dtype=np.int64), unique)[:5].tolist()
        raise CacheCorruptError(
            f"shard {shard} of {reader.url}: its stored, quarantined and skipped rows do not cover its range "
            f"[{start}, {stop}) exactly once (missing: {missing}); {CORRUPT_SHARD_REPAIR}"
        )
    return {"num_samples": int(record["num_samples"]), "num_tokens": int(record["num_tokens"]),
            "hidden_chunks": chunks, "digest_version": int(record.get("digest_version", 1))}  # fmt: skip


def check_cache(
    reader: CacheReader, *, allow_incomplete: bool = False, on_shard: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """Check every committed shard (:func:`check_shard`) and the cache's completeness before training.

    Args:
        reader: the open cache.
        allow_incomplete: accept planned shards without a commit record (the report says what is left out).
        on_shard: called with each shard id once checked (progress).

    Returns:
        ``{"committed_shards", "planned_shards", "uncommitted_shards", "num_samples", "num_tokens",
        "planned_rows", "missing_rows", "hidden_chunks", "unchecked_hidden_shards", "seconds"}``;
        ``unchecked_hidden_shards``: shards whose records (digest_version < 3) hold no per-chunk checksum of
        ``hidden``.

    Raises:
        CacheCorruptError: a committed shard fails a check (names the shard and the array).
        CacheError: planned shards are not committed and not ``allow_incomplete``; the message gives the counts
            and both fixes.
    """
    started = time.perf_counter()
    meta = reader.metadata
    stray = [shard for shard in reader.shards if shard >= meta.num_shards]
    if stray:
        raise CacheCorruptError(
            f"{reader.url}: shards {stray[:5]} are committed but the plan has only {meta.num_shards} shards; "
            f"{CORRUPT_SHARD_REPAIR}"
        )
    totals = {"num_samples": 0, "num_tokens": 0, "hidden_chunks": 0, "unchecked_hidden_shards": 0}
    # Shards in parallel threads: file reads, decompression and hashing release the GIL. map() yields in shard
    # order and raises the first failing shard's error.
    threads = max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
    with ThreadPoolExecutor(threads, thread_name_prefix="check-cache") as pool:
        results = list(zip(reader.shards, pool.map(lambda shard: check_shard(reader, shard), reader.shards), strict=True))
    for shard, result in results:
        totals["num_samples"] += result["num_samples"]
        totals["num_tokens"] += result["num_tokens"]
        totals["hidden_chunks"] += result["hidden_chunks"]
        totals["unchecked_hidden_shards"] += int(result["digest_version"] < 3)
        if on_shard is not None:
            on_shard(shard)
    uncommitted = sorted(set(range(meta.num_shards)) - set(reader.shards))
    planned_rows = sum(stop - start for start, stop in meta.shard_rows)
    missing_rows = sum(meta.shard_rows[shard][1] - meta.shard_rows[shard][0] for shard in uncommitted)
    if uncommitted and not allow_incomplete:
        raise CacheError(
            f"{reader.url} is incomplete: {len(uncommitted)} of {meta.num_shards} planned shards have no commit record "
            f"(first: {uncommitted[:5]}; {missing_rows} of {planned_rows} corpus rows), so training would see "
            f"{totals['num_samples']} samples instead of about {planned_rows}; rerun `dflash-stages extract` with the "
            "same arguments to finish it, or pass --allow-incomplete to train on the committed shards"
        )
    return {
        "committed_shards": len(reader.shards),
        "planned_shards": meta.num_shards,
        "uncommitted_shards": uncommitted,
        "planned_rows": planned_rows,
        "missing_rows": missing_rows,
        **totals,
        "seconds": time.perf_counter() - started,
    }
