"""Contract 1, the tokenized corpus: reading, schema and content validation, fingerprint, atomic writing.

A corpus is an Arrow table with one row per sample:

- ``input_ids``: ``list<int32>`` (``large_list`` and any integer value type are accepted and read as int32);
- ``loss_mask``: ``list<uint8>`` of the same length (``bool`` or any integer type accepted); 1 = a response token
  whose prediction is supervised;
- ``sample_id`` (optional): a string (integers accepted) naming the sample in its source;
- ``document_id`` (optional): a string (integers accepted, read as their decimal text) naming the source document
  the row comes from: rows with the same ``document_id`` come from the same document (the chunks of one split
  file, the prompts cut from one source file). The trainer's validation split takes whole documents
  (``dflash.batches.source.LoaderConfig.validation_split_by``). A row without one (null, or a file without the
  column) is its own document. :attr:`Corpus.document_keys` gives one uint64 key per row.

It is stored as Arrow IPC files (``*.arrow``, file or stream format), Parquet files (``*.parquet``), or a
``datasets.save_to_disk`` folder (read with pyarrow alone; ``datasets`` is not needed). A folder written by
:class:`CorpusWriter` holds ``corpus.arrow`` (IPC file format, memory-mapped on read) and the sidecar
``corpus.json`` (:data:`FORMAT_VERSION`, target spec and identity, tokenizer, max_length, preparation report,
fingerprint). Reading never loops over rows in Python: per-row lengths, offsets and values are numpy views of the
Arrow buffers, so ``lengths``, ``row(i)`` and ``fingerprint`` stay cheap on millions of tokens (``document_keys``
hashes each distinct document id once).

Run ``dflash-stages prepare`` to build a corpus; :func:`validate_corpus` checks one against a target's vocabulary
before any GPU work (``dflash-stages extract`` calls it).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash.errors import CorpusError, CorpusNotFoundError
from dflash.io.files import load_json

__all__ = [
    "FORMAT_VERSION",
    "DATA_FILE",
    "METADATA_FILE",
    "LengthPolicy",
    "CorpusRow",
    "document_key",
    "Corpus",
    "CorpusLengths",
    "check_corpus_output",
    "CorpusReport",
    "CorpusWriter",
    "open_corpus",
    "validate_corpus",
]

#: The fix named when a ``datasets`` folder's own JSON files cannot be read.
_DATASET_FIX = "the folder's datasets metadata is damaged: save the dataset again (datasets' save_to_disk)"

FORMAT_VERSION = "dflash.corpus/1"
DATA_FILE = "corpus.arrow"
METADATA_FILE = "corpus.json"
_SCHEMA_KEY = b"dflash.corpus"
_ARROW_SUFFIXES = (".arrow", ".feather", ".ipc")
_PARQUET_SUFFIXES = (".parquet", ".pq")
_FIX_PREPARE = "rebuild it with `dflash-stages prepare`"
_MAX_NAMED_ROWS = 5

LengthPolicy = Literal["error", "drop", "truncate"]
_LENGTH_POLICIES = ("error", "drop", "truncate")

SCHEMA = pa.schema(
    [
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),
        pa.field("sample_id", pa.string()),
        pa.field("document_id", pa.string()),
    ],
    metadata={_SCHEMA_KEY: json.dumps({"format_version": FORMAT_VERSION}).encode()},
)


def document_key(document_id: str | int) -> int:
    """The 64-bit key of a document id: the first 8 bytes of ``blake2b(str(document_id).encode("utf-8"),
    digest_size=8)`` read as a little-endian unsigned integer. Stable across machines, Python versions and runs (no
    salted ``hash()``); integers are keyed as their decimal text, so ``7`` and ``"7"`` are one document."""
    return int.from_bytes(hashlib.blake2b(str(document_id).encode("utf-8"), digest_size=8).digest(), "little")


@dataclass(frozen=True, slots=True)
class CorpusRow:
    """One sample: ``input_ids`` [L] int32, ``loss_mask`` [L] uint8 (1 = supervised), ``sample_id`` str."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    sample_id: str


@dataclass(slots=True)
class _Chunk:
    """One Arrow record batch's columns as numpy views (offsets index into the unsliced child values)."""

    file: Path
    first_row_in_file: int
    ids_offsets: np.ndarray
    ids_values: np.ndarray
    mask_offsets: np.ndarray
    mask_values: np.ndarray
    sample_ids: pa.Array | None
    document_ids: pa.Array | None = None


def _list_value_type(column_type: pa.DataType) -> pa.DataType | None:
    if pa.types.is_list(column_type) or pa.types.is_large_list(column_type):
        return column_type.value_type
    return None


def _check_schema(schema: pa.Schema, file: Path, *, labels_as_mask: bool = False) -> None:
    names = schema.names
    if labels_as_mask and "loss_mask" not in names and "labels" in names:
        value_type = _list_value_type(schema.field("labels").type)
        if value_type is None or not pa.types.is_integer(value_type):
            raise CorpusError(f"{file}: column 'labels' has type {schema.field('labels').type}, expected a list of integers")
        names = [*names, "loss_mask"]
        schema = schema.append(pa.field("loss_mask", pa.list_(pa.uint8())))
    for name, allowed, what in (
        ("input_ids", pa.types.is_integer, "an integer"),
        ("loss_mask", lambda t: pa.types.is_integer(t) or pa.types.is_boolean(t), "an integer or bool"),
    ):
        if name not in names:
            fix = (
                "add a loss_mask column (1 on tokens to supervise, same length as input_ids; `dflash-stages "
                "prepare` derives it from a transformers-style 'labels' column, -100 = not supervised)"
                if name == "loss_mask"
                else "tokenize the data first"
            )
            raise CorpusError(
                f"{file}: no column {name!r} (columns: {names}); {fix}, or {_FIX_PREPARE} from chat/text data"
            )
        value_type = _list_value_type(schema.field(name).type)
        if value_type is None or not allowed(value_type):
            raise CorpusError(
                f"{file}: column {name!r} has type {schema.field(name).type}, expected a list of {what} type "
                f"(list<int32> for input_ids, list<uint8> for loss_mask); {_FIX_PREPARE}"
            )
    for name in ("sample_id", "document_id"):
        if name in names:
            label_type = schema.field(name).type
            if not (pa.types.is_string(label_type) or pa.types.is_large_string(label_type)
                    or pa.types.is_integer(label_type)):
                raise CorpusError(f"{file}: column {name!r} has type {label_type}, expected string (integers "
                                  "accepted); cast it to string or drop the column")


def _read_arrow(file: Path) -> pa.Table:
    source = pa.memory_map(str(file))
    try:
        return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:
        pass
    try:  # datasets.save_to_disk writes the streaming format into *.arrow files
        return pa.ipc.open_stream(pa.memory_map(str(file))).read_all()
    except pa.ArrowInvalid as error:
        raise CorpusError(f"{file}: not an Arrow IPC file or stream ({error}); {_FIX_PREPARE}") from error


def _mask_from_labels(table: pa.Table, file: Path) -> pa.Table:
    """``loss_mask = labels != -100`` (transformers' ignore index), same offsets as ``labels``."""
    import pyarrow.compute as pc

    labels = table.column("labels").combine_chunks()
    if labels.null_count:
        raise CorpusError(f"{file}: 'labels' holds null rows; fill them or drop the rows")
    values = pc.not_equal(labels.values, -100).cast(pa.uint8())
    list_type = pa.LargeListArray if pa.types.is_large_list(labels.type) else pa.ListArray
    return table.append_column("loss_mask", list_type.from_arrays(labels.offsets, values))


def _read_table(file: Path, *, labels_as_mask: bool = False) -> pa.Table:
    if file.suffix in _PARQUET_SUFFIXES:
        try:
            schema = pq.read_schema(file)
        except (pa.ArrowInvalid, OSError) as error:
            raise CorpusError(f"{file}: not a readable Parquet file ({error}); {_FIX_PREPARE}") from error
        _check_schema(schema, file, labels_as_mask=labels_as_mask)
        columns = [c for c in ("input_ids", "loss_mask", "labels", "sample_id", "document_id") if c in schema.names]
        table = pq.read_table(file, columns=columns, memory_map=True)
    else:
        table = _read_arrow(file)
        _check_schema(table.schema, file, labels_as_mask=labels_as_mask)
    if labels_as_mask and "loss_mask" not in table.schema.names:
        table = _mask_from_labels(table, file)
    return table


def _data_files(path: Path, *, allow_unfinished: bool = False) -> list[Path]:
    """The data files of a corpus path, in row order."""
    if path.is_file():
        return [path]
    if not allow_unfinished and (path / "generate.json").is_file() and not (path / METADATA_FILE).is_file():
        raise CorpusError(
            f"{path} is an unfinished generate output ({len(list(path.glob('part-*.arrow')))} parts committed, no "
            f"{METADATA_FILE} yet); rerun the same `dflash-stages generate` command to finish it"
        )
    if not path.is_dir():
        raise CorpusNotFoundError(f"corpus {path} does not exist; pass a corpus folder or an .arrow/.parquet file")
    if (path / "dataset_dict.json").is_file():
        splits = load_json(path / "dataset_dict.json", error=CorpusError, fix=_DATASET_FIX).get("splits", [])
        raise CorpusError(
            f"{path} is a datasets DatasetDict with splits {splits}; pass one split's folder, e.g. {path / (splits or ['train'])[0]}"
        )
    state = path / "state.json"
    if state.is_file():
        try:
            names = [entry["filename"] for entry in load_json(state, error=CorpusError, fix=_DATASET_FIX)
                     .get("_data_files", [])]
        except (KeyError, TypeError):
            raise CorpusError(f"{state}: _data_files is not a list of {{filename}} entries; {_DATASET_FIX}") from None
        files = [path / name for name in names]
    else:
        files = sorted(
            p for p in path.iterdir()
            if p.is_file() and not p.name.startswith(".") and p.suffix in _ARROW_SUFFIXES + _PARQUET_SUFFIXES
        )
    if not files:
        raise CorpusError(f"corpus folder {path} holds no .arrow or .parquet files; {_FIX_PREPARE}")
    return files


def _numpy_values(array: pa.Array) -> np.ndarray:
    if pa.types.is_boolean(array.type):
        return array.to_numpy(zero_copy_only=False).astype(np.uint8)
    return array.to_numpy(zero_copy_only=False)


def _chunks_of(table: pa.Table, file: Path) -> list[_Chunk]:
    chunks = []
    first_row = 0
    for batch in table.to_batches():
        ids, mask = batch.column("input_ids"), batch.column("loss_mask")
        for name, array in (("input_ids", ids), ("loss_mask", mask)):
            if array.null_count or array.values.null_count:
                rows = np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))
                where = f"row {first_row + int(rows[0])}" if rows.size else "inside a row"
                raise CorpusError(f"{file} {where}: {name} holds a null; remove the row or {_FIX_PREPARE}")
        sample_ids = batch.column("sample_id") if "sample_id" in batch.schema.names else None
        document_ids = batch.column("document_id") if "document_id" in batch.schema.names else None
        chunks.append(
            _Chunk(
                file=file,
                first_row_in_file=first_row,
                ids_offsets=ids.offsets.to_numpy().astype(np.int64, copy=False),
                ids_values=_numpy_values(ids.values),
                mask_offsets=mask.offsets.to_numpy().astype(np.int64, copy=False),
                mask_values=_numpy_values(mask.values),
                sample_ids=sample_ids,
                document_ids=document_ids,
            )
        )
        first_row += batch.num_rows
    return chunks


class Corpus:
    """A read-only corpus (contract 1). Build with :func:`open_corpus`.

    Attributes:
        path: what was opened (folder or file).
        files: the data files, in row order.
        metadata: the sidecar ``corpus.json`` (or the Arrow schema metadata; ``{}`` if none): ``format_version``,
            ``target_spec``, ``target``, ``tokenizer``, ``max_length``, ``report``...
    """

    def __init__(self, path: Path, files: list[Path], chunks: list[_Chunk], metadata: dict[str, Any]) -> None:
        self.path = path
        self.files = files
        self.metadata = metadata
        self._chunks = chunks
        counts = [len(c.ids_offsets) - 1 for c in chunks]
        self._chunk_starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])

    def __len__(self) -> int:
        return int(self._chunk_starts[-1])

    def __repr__(self) -> str:
        return f"Corpus({str(self.path)!r}, rows={len(self)}, tokens={self.num_tokens})"

    @cached_property
    def lengths(self) -> np.ndarray:
        """Tokens per row, ``[len(self)]`` int64 (from the Arrow offsets; no row is read)."""
        parts = [np.diff(c.ids_offsets) for c in self._chunks]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    @cached_property
    def mask_lengths(self) -> np.ndarray:
        """Entries of ``loss_mask`` per row, ``[len(self)]`` int64 (equal to :attr:`lengths` in a valid corpus)."""
        parts = [np.diff(c.mask_offsets) for c in self._chunks]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @cached_property
    def supervised_counts(self) -> np.ndarray:
        """Supervised tokens (``loss_mask == 1``) per row, ``[len(self)]`` int64 (from the mask values; no row object
        is built)."""
        parts = []
        for chunk in self._chunks:
            starts, stops = chunk.mask_offsets[:-1], chunk.mask_offsets[1:]
            cumulative = np.concatenate([[0], np.cumsum(chunk.mask_values[chunk.mask_offsets[0]: chunk.mask_offsets[-1]]
                                                        .astype(np.int64) == 1)])
            base = chunk.mask_offsets[0]
            parts.append(cumulative[stops - base] - cumulative[starts - base])
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    @cached_property
    def fingerprint(self) -> str:
        """``"sha256:<hex>"`` of the content: per-row lengths (int64 LE), all ``input_ids`` (int32 LE) and all
        ``loss_mask`` values (uint8), in row order. Independent of the file format, chunking, ``sample_id`` and
        ``document_id`` (labels, not content: a cache stores the document keys it was made with and checks them
        itself); changes with any token, mask bit, row boundary or row order."""
        lengths, ids, mask = hashlib.sha256(), hashlib.sha256(), hashlib.sha256()
        lengths.update(np.ascontiguousarray(self.lengths, dtype="<i8"))
        lengths.update(np.ascontiguousarray(self.mask_lengths, dtype="<i8"))
        for chunk in self._chunks:
            ids.update(np.ascontiguousarray(chunk.ids_values[chunk.ids_offsets[0]: chunk.ids_offsets[-1]], dtype="<i4"))
            mask.update(np.ascontiguousarray(chunk.mask_values[chunk.mask_offsets[0]: chunk.mask_offsets[-1]], dtype=np.uint8))
        combined = hashlib.sha256(FORMAT_VERSION.encode())
        for digest in (lengths, ids, mask):
            combined.update(digest.digest())
        return f"sha256:{combined.hexdigest()}"

    def check_fingerprint(self) -> None:
        """Recompute :attr:`fingerprint` from the data and compare it with the one ``corpus.json`` records (a corpus
        written by ``prepare`` or ``generate``; nothing to compare without one). One pass of sha256 over the tokens
        and mask values: what a consumer that records the fingerprint (extract, online, evaluate) calls first, so it
        never records the fingerprint of data that is not what ``corpus.json`` describes.

        Raises:
            CorpusError: the fingerprints differ; names the corpus, its data files and the fix.
        """
        recorded = self.metadata.get("fingerprint")
        if recorded is None or recorded == self.fingerprint:
            return
        sidecar = (self.path if self.path.is_dir() else self.path.parent) / METADATA_FILE
        files = ", ".join(f.name for f in self.files[:3]) + (f" (+{len(self.files) - 3} more)" if len(self.files) > 3 else "")
        counts = ""
        if (self.metadata.get("num_rows"), self.metadata.get("num_tokens")) != (len(self), self.num_tokens):
            counts = (f" ({len(self)} rows, {self.num_tokens} tokens against {self.metadata.get('num_rows')} rows, "
                      f"{self.metadata.get('num_tokens')} tokens recorded)")
        raise CorpusError(
            f"corpus {self.path}: its data ({files}) has fingerprint {self.fingerprint}{counts}, but {sidecar} records "
            f"{recorded}: the data was changed after the corpus was written; restore the original files, or rebuild the "
            "corpus (`dflash-stages prepare`, or `dflash-stages generate` for a generate output) into a new folder"
        )

    @cached_property
    def has_document_ids(self) -> bool:
        """Whether any row has a ``document_id`` (a column of nulls, as :class:`CorpusWriter` writes for rows added
        without one, counts as none: every row is then its own document)."""
        return any(chunk.document_ids is not None and chunk.document_ids.null_count < len(chunk.document_ids)
                   for chunk in self._chunks)

    @cached_property
    def document_keys(self) -> np.ndarray:
        """``[len(self)]`` uint64: the source-document key of each row, :func:`document_key` of its ``document_id``;
        rows without one (no column, or null) get their row index, so each is its own document. Rows with equal
        keys come from one document (two different ids collide with probability ~2^-64 per pair). Computed once:
        the ids are dictionary-encoded by Arrow and each distinct id is hashed once (no per-row Python loop)."""
        import pyarrow.compute as pc

        keys = np.arange(len(self), dtype=np.uint64)
        parts, positions = [], []
        for start, chunk in zip(self._chunk_starts[:-1], self._chunks, strict=True):
            if chunk.document_ids is not None and len(chunk.document_ids):
                parts.append(chunk.document_ids.cast(pa.large_string()))  # integers as decimal text, one type
                positions.append(np.arange(int(start), int(start) + len(chunk.document_ids), dtype=np.int64))
        if not parts:
            return keys
        encoded = pc.dictionary_encode(pa.concat_arrays(parts))
        hashed = np.fromiter((document_key(value) for value in encoded.dictionary.to_pylist()), dtype=np.uint64,
                             count=len(encoded.dictionary))
        valid = encoded.is_valid().to_numpy(zero_copy_only=False)
        indices = encoded.indices.fill_null(0).to_numpy(zero_copy_only=False)
        rows = np.concatenate(positions)
        keys[rows[valid]] = hashed[indices[valid]]
        return keys

    def document_id(self, index: int) -> str | None:
        """The row's ``document_id`` as a string (integers as decimal text), ``None`` when it has none."""
        chunk, local = self._locate(index)
        if chunk.document_ids is not None and chunk.document_ids[local].is_valid:
            return str(chunk.document_ids[local].as_py())
        return None

    def _locate(self, index: int) -> tuple[_Chunk, int]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} is outside the corpus {self.path} of {len(self)} rows")
        index %= max(len(self), 1)
        chunk_idx = int(np.searchsorted(self._chunk_starts, index, side="right")) - 1
        return self._chunks[chunk_idx], index - int(self._chunk_starts[chunk_idx])

    def sample_id(self, index: int) -> str:
        """The row's ``sample_id`` (``"<file stem>:<row in file>"`` when the corpus has none)."""
        chunk, local = self._locate(index)
        if chunk.sample_ids is not None and chunk.sample_ids[local].is_valid:
            return str(chunk.sample_ids[local].as_py())
        return f"{chunk.file.stem}:{chunk.first_row_in_file + local}"

    def describe_row(self, index: int) -> str:
        """Where a row lives, for error messages: ``"<file> row <n> (sample_id '<id>')"``."""
        chunk, local = self._locate(index)
        return f"{chunk.file} row {chunk.first_row_in_file + local} (sample_id {self.sample_id(index)!r})"

    def row(self, index: int) -> CorpusRow:
        """Row ``index``: fresh (writable) ``input_ids`` [L] int32 and ``loss_mask`` [L] uint8 arrays.

        Raises:
            IndexError: ``index`` outside ``[-len, len)``.
        """
        chunk, local = self._locate(index)
        ids = chunk.ids_values[chunk.ids_offsets[local]: chunk.ids_offsets[local + 1]]
        mask = chunk.mask_values[chunk.mask_offsets[local]: chunk.mask_offsets[local + 1]]
        return CorpusRow(np.array(ids, dtype=np.int32), np.array(mask, dtype=np.uint8), self.sample_id(index))

    def rows(self, start: int, stop: int) -> list[CorpusRow]:
        """Rows ``[start, stop)`` (clipped to the corpus) as :class:`CorpusRow` objects."""
        start, stop = max(0, start), min(stop, len(self))
        return [self.row(i) for i in range(start, stop)]


class CorpusLengths:
    """A :class:`dflash.batches.source.LengthSource` over a corpus: what the epoch plan needs, without hidden states.

    The online mode plans its epochs from it exactly as the streaming loader plans them from a cache of the same
    corpus (same rows, lengths, supervised counts and document keys, in corpus-row order): same seed -> same
    batches.

    Args:
        corpus: an opened :class:`Corpus`.
        shard_rows: ``[start, stop)`` corpus-row ranges, one per shard (``None``: one shard of every row).
    """

    def __init__(self, corpus: Corpus, shard_rows: list[list[int]] | None = None) -> None:
        self.corpus = corpus
        self.shard_rows = [list(map(int, r)) for r in shard_rows] if shard_rows is not None else [[0, len(corpus)]]

    @property
    def shards(self) -> list[int]:
        return list(range(len(self.shard_rows)))

    def shard_lengths(self, shard: int) -> np.ndarray:
        start, stop = self.shard_rows[shard]
        return self.corpus.lengths[start:stop]

    def shard_corpus_rows(self, shard: int) -> np.ndarray:
        start, stop = self.shard_rows[shard]
        return np.arange(start, stop, dtype=np.int64)

    def shard_supervised_counts(self, shard: int) -> np.ndarray:
        start, stop = self.shard_rows[shard]
        return self.corpus.supervised_counts[start:stop]

    def document_keys(self) -> np.ndarray | None:
        """``[len(corpus)]`` uint64 :attr:`Corpus.document_keys` indexed by corpus row, or ``None`` when the corpus
        has no ``document_id`` column (the validation split then goes by row)."""
        return self.corpus.document_keys if self.corpus.has_document_ids else None


def open_corpus(path: str | os.PathLike[str], *, labels_as_mask: bool = False, allow_unfinished: bool = False) -> Corpus:
    """Open a corpus: an Arrow IPC or Parquet file, a folder of them, or a ``datasets.save_to_disk`` folder.

    An unfinished ``generate`` output (parts committed, no ``corpus.json`` yet) is refused unless
    ``allow_unfinished`` (the generate stage itself, fingerprinting its finished parts).

    The schema of every file is checked (columns, list-of-integer types, no nulls); contents are checked by
    :func:`validate_corpus`, which needs the target's vocabulary size. With ``labels_as_mask`` (used by
    ``prepare``), a file without ``loss_mask`` but with transformers-style ``labels`` gets
    ``loss_mask = labels != -100``.

    Raises:
        CorpusError: missing path or file, unreadable file, missing column or wrong type; names the file and the fix.
    """
    path = Path(path).expanduser()
    files = _data_files(path, allow_unfinished=allow_unfinished)
    chunks: list[_Chunk] = []
    first_schema_metadata: dict[bytes, bytes] = {}
    for file in files:
        if not file.is_file():
            raise CorpusNotFoundError(f"corpus data file {file} is missing; {_FIX_PREPARE}")
        table = _read_table(file, labels_as_mask=labels_as_mask)
        if not chunks:
            first_schema_metadata = table.schema.metadata or {}
        chunks.extend(_chunks_of(table, file))
    metadata: dict[str, Any] = {}
    sidecar = (path if path.is_dir() else path.parent) / METADATA_FILE
    if sidecar.is_file() and (path.is_dir() or path.name == DATA_FILE):
        metadata = load_json(sidecar, error=CorpusError, fix="corpus.json is written by prepare and generate: rerun "
                             "the command that made this corpus, or remove the file to read the data alone")
    elif _SCHEMA_KEY in first_schema_metadata:
        metadata = json.loads(first_schema_metadata[_SCHEMA_KEY])
    return Corpus(path, files, chunks, metadata)


@dataclass(slots=True, kw_only=True)
class CorpusReport:
    """What :func:`validate_corpus` found and what a consumer must do.

    Fields:
        num_rows, num_tokens, num_supervised_tokens: totals of the corpus as stored.
        max_length, length_policy: the limit applied (``None``: no limit).
        num_too_long: rows longer than ``max_length``.
        kept_rows: ``[K]`` int64 row indices to use (all rows but the dropped ones), ascending.
        truncate_to: ``max_length`` when rows must be cut to it (policy ``"truncate"``), else ``None``.
        dropped: rows left out, by reason.
    """

    num_rows: int
    num_tokens: int
    num_supervised_tokens: int
    max_length: int | None
    length_policy: str
    num_too_long: int
    kept_rows: np.ndarray
    truncate_to: int | None
    dropped: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_rows": self.num_rows,
            "num_kept_rows": int(self.kept_rows.size),
            "num_tokens": self.num_tokens,
            "num_supervised_tokens": self.num_supervised_tokens,
            "max_length": self.max_length,
            "length_policy": self.length_policy,
            "num_too_long": self.num_too_long,
            "truncate_to": self.truncate_to,
            "dropped": dict(self.dropped),
        }


def _fail(corpus: Corpus, rows: np.ndarray, problem: str | Callable[[int], str], fix: str) -> CorpusError:
    """An error naming up to ``_MAX_NAMED_ROWS`` of ``rows`` (file, row, sample_id), what is wrong, and ``fix``."""
    named = "; ".join(f"{corpus.describe_row(int(r))}: {problem(int(r)) if callable(problem) else problem}"
                      for r in rows[:_MAX_NAMED_ROWS])
    more = f" (and {rows.size - _MAX_NAMED_ROWS} more rows)" if rows.size > _MAX_NAMED_ROWS else ""
    return CorpusError(f"{rows.size} bad row(s): {named}{more}; {fix}")


def _row_of_flat(offsets_per_chunk: list[tuple[int, np.ndarray]], flat_bad: list[np.ndarray]) -> np.ndarray:
    """Map flat value indices (per chunk) to unique global row indices."""
    rows = []
    for (start, offsets), bad in zip(offsets_per_chunk, flat_bad, strict=True):
        if bad.size:
            rows.append(start + np.searchsorted(offsets, bad, side="right") - 1)
    return np.unique(np.concatenate(rows)) if rows else np.zeros(0, np.int64)


def validate_corpus(
    corpus: Corpus,
    *,
    vocab_size: int,
    max_length: int | None = None,
    length_policy: LengthPolicy = "error",
) -> CorpusReport:
    """Check every row of ``corpus`` against contract 1 and a target vocabulary; vectorized (no per-row loop).

    Checks, in order: the fingerprint ``corpus.json`` records (:meth:`Corpus.check_fingerprint`); empty rows;
    ``loss_mask`` length != ``input_ids`` length; token ids outside ``[0, vocab_size)``; mask values other than
    0/1; rows with no supervised token; rows longer than ``max_length`` (``length_policy``: ``"error"`` raises, ``"drop"`` leaves them out of ``kept_rows``,
    ``"truncate"`` keeps them with ``truncate_to = max_length``, and drops those with no supervised token in
    their first ``max_length`` tokens).

    Returns:
        :class:`CorpusReport`.

    Raises:
        CorpusError: naming up to 5 offending rows (file, row, sample_id), expected vs got, and the fix.
        ValueError: ``length_policy`` unknown or ``max_length < 1``.
    """
    if length_policy not in _LENGTH_POLICIES:
        raise ValueError(f"length_policy must be one of {_LENGTH_POLICIES}, got {length_policy!r}")
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    corpus.check_fingerprint()
    lengths, mask_lengths = corpus.lengths, corpus.mask_lengths
    if len(corpus) == 0:
        raise CorpusError(f"corpus {corpus.path} has 0 rows; {_FIX_PREPARE} from non-empty data")

    empty = np.flatnonzero(lengths == 0)
    if empty.size:
        raise _fail(corpus, empty, "empty input_ids", "remove empty samples or " + _FIX_PREPARE)
    mismatch = np.flatnonzero(lengths != mask_lengths)
    if mismatch.size:
        raise _fail(
            corpus, mismatch,
            lambda r: f"input_ids has {lengths[r]} tokens but loss_mask has {mask_lengths[r]} entries",
            "give loss_mask exactly one 0/1 entry per token",
        )

    # Offsets of input_ids and loss_mask may differ in absolute value (columns chunked or sliced differently).
    starts = [int(s) for s in corpus._chunk_starts[:-1]]
    ids_offsets = [(s, c.ids_offsets) for s, c in zip(starts, corpus._chunks, strict=True)]
    mask_offsets = [(s, c.mask_offsets) for s, c in zip(starts, corpus._chunks, strict=True)]
    bad_ids, bad_mask, supervised_parts = [], [], []
    for chunk in corpus._chunks:
        lo, hi = chunk.ids_offsets[0], chunk.ids_offsets[-1]
        values = chunk.ids_values[lo:hi]
        bad_ids.append(np.flatnonzero((values < 0) | (values >= vocab_size)) + lo)
        lo, hi = chunk.mask_offsets[0], chunk.mask_offsets[-1]
        mask = chunk.mask_values[lo:hi]
        bad_mask.append(np.flatnonzero((mask != 0) & (mask != 1)) + lo)
        # Cumulative sums give per-row supervised counts without a Python loop.
        cumulative = np.concatenate([[0], np.cumsum(mask != 0, dtype=np.int64)])
        supervised_parts.append(cumulative[chunk.mask_offsets[1:] - lo] - cumulative[chunk.mask_offsets[:-1] - lo])
    rows = _row_of_flat(ids_offsets, bad_ids)
    if rows.size:
        def describe_ids(r: int) -> str:
            ids = corpus.row(r).input_ids
            position = int(np.flatnonzero((ids < 0) | (ids >= vocab_size))[0])
            return f"token id {int(ids[position])} at position {position} is outside [0, {vocab_size})"
        raise _fail(corpus, rows, describe_ids,
                    f"the corpus was tokenized for another vocabulary; re-run prepare with the target's tokenizer (vocab_size {vocab_size})")
    rows = _row_of_flat(mask_offsets, bad_mask)
    if rows.size:
        raise _fail(corpus, rows, "loss_mask holds a value other than 0 or 1", "store loss_mask as 0/1 per token")
    supervised = np.concatenate(supervised_parts)
    unsupervised = np.flatnonzero(supervised == 0)
    if unsupervised.size:
        raise _fail(corpus, unsupervised, "no supervised token (loss_mask is all 0)",
                    "drop samples without a response, or check how loss_mask was built")

    keep = np.ones(len(corpus), dtype=bool)
    dropped: dict[str, int] = {}
    truncate_to = None
    too_long = np.zeros(0, np.int64)
    if max_length is not None:
        too_long = np.flatnonzero(lengths > max_length)
        if too_long.size and length_policy == "error":
            raise _fail(
                corpus, too_long, lambda r: f"{lengths[r]} tokens > max_length {max_length}",
                "choose a length policy explicitly (--length-policy drop|truncate, or split in prepare) or raise --max-length",
            )
        if too_long.size and length_policy == "drop":
            keep[too_long] = False
            dropped["longer than max_length"] = int(too_long.size)
        if length_policy == "truncate":
            truncate_to = max_length
            lost = [r for r in too_long if not corpus.row(int(r)).loss_mask[:max_length].any()]
            if lost:
                keep[lost] = False
                dropped["no supervised token after truncation"] = len(lost)
    return CorpusReport(
        num_rows=len(corpus),
        num_tokens=int(lengths.sum()),
        num_supervised_tokens=int(supervised.sum()),
        max_length=max_length,
        length_policy=length_policy,
        num_too_long=int(too_long.size),
        kept_rows=np.flatnonzero(keep).astype(np.int64),
        truncate_to=truncate_to,
        dropped=dropped,
    )


def _is_replaceable_corpus(path: Path) -> bool:
    """An existing output that ``--overwrite`` may replace: a corpus written by us, or an empty folder."""
    if path.is_dir():
        return (path / METADATA_FILE).is_file() or not any(path.iterdir())
    return False


def check_corpus_output(path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
    """The rule :class:`CorpusWriter` applies to its output, for a stage to check before any work: a new path, or
    with ``overwrite`` an earlier corpus or an empty folder (never a folder of other files: a typo in --output).

    Raises:
        CorpusError: naming the output and the fix.
    """
    path = Path(path).expanduser()
    if path.exists() and not overwrite:
        raise CorpusError(f"output {path} already exists; pass another --output or --overwrite")
    if overwrite and path.exists() and not _is_replaceable_corpus(path):
        raise CorpusError(
            f"output {path} exists and is not a dflash corpus (no {METADATA_FILE}); --overwrite only replaces "
            "a corpus or an empty folder: pass another --output"
        )


class CorpusWriter:
    """Write a corpus folder atomically: rows go to a temporary sibling folder, renamed onto ``path`` by
    :meth:`commit`; an exception (or leaving the ``with`` block without commit) removes it, so a killed or
    failed run leaves no half corpus.

    Usage::

        with CorpusWriter(out) as writer:
            writer.add(input_ids, loss_mask, sample_id, document_id)
            writer.commit(metadata)

    Raises:
        CorpusError: ``path`` exists (and ``overwrite`` is False), or 0 rows at commit.
    """

    def __init__(self, path: str | os.PathLike[str], *, overwrite: bool = False, batch_rows: int = 1024) -> None:
        self.path = Path(path).expanduser()
        check_corpus_output(self.path, overwrite=overwrite)
        self.overwrite = overwrite
        self.batch_rows = batch_rows
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._staging = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.tmp-", dir=self.path.parent))
        try:
            self._sink = pa.OSFile(str(self._staging / DATA_FILE), "wb")
            self._writer = pa.ipc.new_file(self._sink, SCHEMA)
        except BaseException:  # e.g. SIGTERM (raised as KeyboardInterrupt) before a `with` could clean up
            shutil.rmtree(self._staging, ignore_errors=True)
            raise
        self._pending: list[tuple[np.ndarray, np.ndarray, str, str | None]] = []
        self.num_rows = 0
        self.num_tokens = 0
        self._closed = False

    def __enter__(self) -> CorpusWriter:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if not self._closed:
            self.abort()

    def add(self, input_ids: np.ndarray, loss_mask: np.ndarray, sample_id: str, document_id: str | None = None) -> None:
        """Append one row (``input_ids`` [L] ints, ``loss_mask`` [L] 0/1, its ``sample_id`` and the ``document_id``
        of its source document, ``None``: its own document). Content is checked by the caller."""
        assert len(input_ids) == len(loss_mask), (len(input_ids), len(loss_mask))
        self._pending.append((np.asarray(input_ids, np.int32), np.asarray(loss_mask, np.uint8), str(sample_id),
                              None if document_id is None else str(document_id)))
        self.num_rows += 1
        self.num_tokens += len(input_ids)
        if len(self._pending) >= self.batch_rows:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        ids, masks, names, documents = zip(*self._pending, strict=True)
        offsets = np.concatenate([[0], np.cumsum([len(x) for x in ids])]).astype(np.int32)
        batch = pa.record_batch(
            [
                pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(ids), pa.int32())),
                pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(masks), pa.uint8())),
                pa.array(names, pa.string()),
                pa.array(documents, pa.string()),
            ],
            schema=SCHEMA,
        )
        self._writer.write_batch(batch)
        self._pending.clear()

    def inner_path(self, name: str) -> Path:
        """A path inside the folder being written, for a companion written before :meth:`commit` (the held-out
        corpus of a split): it is renamed onto ``path`` with the corpus, or removed with it."""
        return self._staging / name

    def commit(self, metadata: dict[str, Any]) -> Path:
        """Finish the data file, write ``corpus.json`` (``metadata`` + format version, counts, fingerprint) and
        rename the folder onto ``path``. Returns ``path``.

        Raises:
            CorpusError: no row was added.
        """
        if self.num_rows == 0:
            self.abort()
            raise CorpusError(f"no sample to write to {self.path} (0 rows kept); see the report for why rows were dropped")
        self._flush()
        self._writer.close()
        self._sink.close()
        written = open_corpus(self._staging / DATA_FILE)
        record = {
            "format_version": FORMAT_VERSION,
            **metadata,
            "num_rows": len(written),
            "num_tokens": written.num_tokens,
            "fingerprint": written.fingerprint,
        }
        (self._staging / METADATA_FILE).write_text(json.dumps(record, indent=2, default=str) + "\n")
        self._staging.chmod(0o755)
        previous = None
        if self.path.exists():
            previous = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.old-", dir=self.path.parent))
            self.path.rename(previous / "corpus")
        self._staging.rename(self.path)
        self._closed = True
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)
        return self.path

    def abort(self) -> None:
        """Drop everything written so far (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._writer.close()
            self._sink.close()
        except (OSError, pa.ArrowException):
            pass
        shutil.rmtree(self._staging, ignore_errors=True)
