"""Full check of a cache: every chunk decoded (crc32c), digests, offsets, completeness, duplicates.

``verify_cache`` reads every chunk of every committed shard once (block by block, bounded memory), recomputes
the sha256 digest each commit record holds, checks offsets and row ranges, and across shards that no corpus row
appears twice and none of the planned rows is missing. Corruption raises :class:`CacheCorruptError` naming the
shard and array; an unfinished cache (planned shards not committed) is reported, not raised, unless
``require_complete``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from dflash.cache.chunks import crc32c_trailer, stored_chunk
from dflash.cache.format import CORRUPT_SHARD_REPAIR
from dflash.cache.integrity import check_array_metadata, check_record_placement
from dflash.cache.reader import CacheReader
from dflash.cache.store import partial_files
from dflash.cache.writer import DIGEST_SEGMENT_BYTES, DIGEST_VERSION, digest_root, shard_arrays
from dflash.errors import CacheCorruptError, CacheError

__all__ = ["verify_cache", "verify_shard"]


class _Segments:
    """sha256 of consecutive ``segment_bytes`` segments of a byte stream fed in arbitrary blocks (verify's side of
    the version-2 digest; blocks are chunk rows, so segment edges fall inside blocks)."""

    def __init__(self, segment_bytes: int) -> None:
        self.segment_bytes, self.total, self._filled = segment_bytes, 0, 0
        self._current = hashlib.sha256()
        self.digests: list[str] = []

    def update(self, raw: memoryview) -> None:
        while len(raw):
            take = min(len(raw), self.segment_bytes - self._filled)
            self._current.update(raw[:take])
            self._filled += take
            self.total += take
            raw = raw[take:]
            if self._filled == self.segment_bytes:
                self.digests.append(self._current.hexdigest())
                self._current, self._filled = hashlib.sha256(), 0

    def finish(self) -> list[str]:
        if self._filled:
            self.digests.append(self._current.hexdigest())
            self._current, self._filled = hashlib.sha256(), 0
        return self.digests


def _chunk_key(array: Any, index: int) -> str:
    """The whole zarr key of the ``index``-th chunk along tokens: ``c/3`` (1-D arrays), ``c/3/0`` (``hidden``)."""
    return "c/" + "/".join([str(index)] + ["0"] * (len(array.shape) - 1))


def _verify_chunk_crcs(reader: CacheReader, shard: int, array: Any, layout: dict, step: int) -> tuple[list[str], int]:
    """Version-3 ``hidden`` leaves: each stored chunk's crc32c trailer must match its body (zarr's check, done here
    on the stored bytes) and the commit record's leaf; every chunk is also decoded. Returns (leaves, raw bytes)."""
    import google_crc32c

    expected = layout.get("crc32c_chunks") or []
    leaves: list[str] = []
    for index, lo in enumerate(range(0, layout["shape"][0], step)):
        where = f"array 'hidden' chunk {_chunk_key(array, index)} (tokens {lo}..{min(lo + step, layout['shape'][0])})"
        data = stored_chunk(array, (index, 0))
        if data is None or len(data) < 4:
            raise CacheCorruptError(f"shard {shard} of {reader.url}: {where} is missing; {CORRUPT_SHARD_REPAIR}")
        leaf = crc32c_trailer(data)
        if google_crc32c.value(data[:-4]) != int(leaf, 16):
            raise CacheCorruptError(f"shard {shard} of {reader.url}: {where} fails its crc32c checksum; {CORRUPT_SHARD_REPAIR}")
        if index >= len(expected) or expected[index] != leaf:
            raise CacheCorruptError(
                f"shard {shard} of {reader.url}: {where} has crc32c {leaf}, the commit record says "
                f"{expected[index] if index < len(expected) else 'nothing'}; a chunk was altered or swapped: {CORRUPT_SHARD_REPAIR}"
            )
        reader._read(shard, "hidden", slice(lo, lo + step), where=f" chunk {_chunk_key(array, index)}")  # decodes
        leaves.append(leaf)
    if len(leaves) != len(expected):
        raise CacheCorruptError(f"shard {shard} of {reader.url}: array 'hidden' has {len(leaves)} chunks, the commit record lists {len(expected)}")
    return leaves, int(np.prod(layout["shape"])) * np.dtype(array.dtype).itemsize


def verify_shard(reader: CacheReader, shard: int) -> dict[str, Any]:
    """Check one committed shard; returns ``{"shard", "num_samples", "num_tokens", "rows": int64[S], ...}``.

    Raises:
        CacheCorruptError: a missing chunk, a checksum or digest mismatch, bad offsets, rows outside the shard's
            range or duplicated inside it; the message names the shard (and array).
    """
    meta = reader.metadata
    record = reader.commit_record(shard)
    names = list(shard_arrays(meta))
    if sorted(record.get("arrays", {})) != sorted(names):
        raise CacheCorruptError(f"shard {shard} of {reader.url}: commit record lists arrays {sorted(record.get('arrays', {}))}, expected {sorted(names)}")
    reader._check_chunks(shard, names)  # every chunk the layout promises exists
    check_record_placement(reader, shard)
    check_array_metadata(reader, shard)
    start, stop = record["row_range"]
    reader._index.pop(shard, None)
    offsets, rows = reader._shard_index(shard)  # offsets consistency, rows inside the range and unique
    version = int(record.get("digest_version", 1))
    if version not in (1, 2, DIGEST_VERSION):
        raise CacheCorruptError(
            f"shard {shard} of {reader.url}: commit record digest_version {version} is not known to this code (reads 1 "
            f"to {DIGEST_VERSION}); verify it with the dflash version that wrote it, or {CORRUPT_SHARD_REPAIR}"
        )
    stream = hashlib.sha256()  # version 1: one serial stream over names and bytes
    segment_bytes = int(record.get("digest_segment_bytes", DIGEST_SEGMENT_BYTES))
    if version != 1 and (not isinstance(segment_bytes, int) or segment_bytes <= 0):
        raise CacheCorruptError(f"shard {shard} of {reader.url}: commit record digest_segment_bytes {segment_bytes} is not a positive size")
    leaves: dict[str, list[str]] = {}
    nbytes: dict[str, int] = {}
    for name in names:
        layout = record["arrays"][name]
        array = reader._array(shard, name)
        if list(array.shape) != layout["shape"]:
            raise CacheCorruptError(f"shard {shard} of {reader.url}: array {name!r} has shape {list(array.shape)}, commit record says {layout['shape']}")
        stream.update(name.encode())
        segments = _Segments(segment_bytes)
        step = layout["chunks"][0]
        if version >= 3 and name == "hidden":
            leaves[name], nbytes[name] = _verify_chunk_crcs(reader, shard, array, layout, step)
            continue
        for lo in range(0, layout["shape"][0], step):  # one chunk row at a time: bounded memory
            block = reader._read(shard, name, slice(lo, lo + step), where=f" chunk {_chunk_key(array, lo // step)}")
            raw = memoryview(np.ascontiguousarray(block).view(np.uint8).reshape(-1))
            if version == 1:
                stream.update(raw)
            else:
                segments.update(raw)
        if version != 1:
            leaves[name], nbytes[name] = segments.finish(), segments.total
            expected = layout.get("sha256_segments")
            if expected != leaves[name]:
                bad = next((i for i, (a, b) in enumerate(zip(leaves[name], expected or [], strict=False)) if a != b), None)
                where = (
                    f"segment {bad} (bytes {bad * segment_bytes}..{min((bad + 1) * segment_bytes, segments.total)})"
                    if bad is not None
                    else f"{len(leaves[name])} segments against {len(expected or [])} recorded"
                )
                raise CacheCorruptError(
                    f"shard {shard} of {reader.url}: array {name!r} {where} has a sha256 that differs from the commit "
                    f"record's; a chunk was altered or swapped: {CORRUPT_SHARD_REPAIR}"
                )
    found = f"sha256:{stream.hexdigest()}" if version == 1 else digest_root(leaves, nbytes)
    if found != record["digest"]:
        raise CacheCorruptError(
            f"shard {shard} of {reader.url}: data digest {found[:28]}... differs from the commit record's "
            f"{str(record['digest'])[:28]}... (digest_version {version}); a chunk was altered or swapped or the record "
            f"was edited: {CORRUPT_SHARD_REPAIR}"
        )
    accounted = np.concatenate(
        [rows, np.array([int(e["corpus_row"]) for e in record.get("quarantined", []) + record.get("skipped", [])], dtype=np.int64)]
    )
    if accounted.size and (accounted.min() < start or accounted.max() >= stop):
        bad = accounted[(accounted < start) | (accounted >= stop)][:5].tolist()
        raise CacheCorruptError(f"shard {shard} of {reader.url}: corpus rows {bad} are outside the shard's range [{start}, {stop})")
    unique, counts = np.unique(accounted, return_counts=True)
    if np.any(counts > 1):
        raise CacheCorruptError(f"shard {shard} of {reader.url}: corpus rows {unique[counts > 1][:5].tolist()} appear more than once")
    missing = np.setdiff1d(np.arange(start, stop, dtype=np.int64), unique)
    return {
        "shard": shard,
        "num_samples": int(record["num_samples"]),
        "num_tokens": int(record["num_tokens"]),
        "num_quarantined": int(record.get("num_quarantined", 0)),
        "missing_rows": missing.tolist(),
        "rows": accounted,
    }


def verify_cache(
    path_or_url: str | os.PathLike[str],
    *,
    require_complete: bool = False,
    fail_fast: bool = True,
    on_shard: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Verify a whole cache: every committed shard (:func:`verify_shard`), duplicates across shards, completeness.

    Args:
        path_or_url: the cache root.
        require_complete: raise :class:`CacheError` when planned shards are not committed.
        fail_fast: raise at the first corrupt shard; with ``False`` check every shard and list the corrupt ones in
            the report (``ok`` is then ``False``).
        on_shard: called with each shard id after it was checked (progress bars).

    Returns:
        ``{"ok", "complete", "committed_shards", "planned_shards", "uncommitted_shards", "stray_shards", "partial_files",
        "corrupt_shards": {shard: message}, "document_keys", "num_samples", "num_tokens", "num_quarantined"}``; counts
        cover the sound committed shards; ``document_keys``: ``{num_rows, num_documents, sha256}`` of the root array
        of document keys (checked), ``None`` without one. ``stray_shards``: data without a commit record, ignored by readers and redone by
        the next extract run. ``partial_files``: zarr temporaries (``*.partial``) of a killed write, ignored by
        readers and removed by the next extract run.

    Raises:
        CacheCorruptError: (``fail_fast``) a committed shard is corrupt or lacks rows of its range, or two
            committed shards hold the same corpus row; the message names the shard and, where known, the array.
            Also without ``fail_fast``: the document keys differ from their record.
        CacheError: ``require_complete`` and planned shards are not committed.
    """
    reader = CacheReader(path_or_url)
    meta = reader.metadata
    owner: dict[int, int] = {}
    totals = {"num_samples": 0, "num_tokens": 0, "num_quarantined": 0}
    corrupt: dict[int, str] = {}
    for shard in reader.shards:
        try:
            if shard >= meta.num_shards:
                raise CacheCorruptError(f"shard {shard} of {reader.url} is committed but the plan has only {meta.num_shards} shards")
            result = verify_shard(reader, shard)
            if result["missing_rows"]:
                raise CacheCorruptError(
                    f"shard {shard} of {reader.url} is committed but lacks corpus rows {result['missing_rows'][:5]} of its "
                    "range (neither stored, quarantined nor skipped): re-extract it"
                )
            rows = result["rows"].tolist()
            for row in rows:
                if row in owner:
                    raise CacheCorruptError(
                        f"shard {shard} of {reader.url}: corpus row {row} is also in shard {owner[row]}: duplicate sample"
                    )
        except CacheCorruptError as error:
            if fail_fast:
                raise
            corrupt[shard] = str(error)
        else:
            owner.update((row, shard) for row in rows)
            for name in totals:
                totals[name] += result[name]
        if on_shard is not None:
            on_shard(shard)
    document_keys = reader.document_keys()  # checked against its record (CacheCorruptError naming the array)
    uncommitted = sorted(set(range(meta.num_shards)) - set(reader.shards))
    present = {key.split("/")[0] for key in reader._store.list_prefix("shards")}
    stray = sorted(int(name) for name in present if name.isdigit() and int(name) not in set(reader.shards))
    partial = partial_files(path_or_url)  # temporaries of a killed write (e.g. during finalize); extract removes them
    complete = not uncommitted
    if require_complete and not complete:
        raise CacheError(
            f"{reader.url} is incomplete: {len(uncommitted)} of {meta.num_shards} planned shards are not committed "
            f"(first: {uncommitted[:5]}); rerun `dflash-stages extract` with the same arguments to finish it"
        )
    return {
        "ok": not corrupt,
        "complete": complete,
        "committed_shards": len(reader.shards),
        "planned_shards": meta.num_shards,
        "uncommitted_shards": uncommitted,
        "stray_shards": stray,
        "partial_files": partial,
        "corrupt_shards": corrupt,
        "document_keys": None if document_keys is None else reader.document_keys_info,
        **totals,
    }
