"""Stage ``prepare``: chat, plain-text or tokenized data -> a tokenized corpus (contract 1, ``dflash/corpus.py``).

Run ``dflash-stages prepare [INPUT...] --output DIR``. Inputs (mixed freely):

- ``default`` (also what no input means): the embedded default corpus, the Python standard library's sources
  (``dflash/default_corpus.py``);
- chat data: ``*.jsonl``/``*.json`` lines, or Parquet/Arrow tables, with ``messages: [{role, content}]``
  (ShareGPT ``conversations: [{from, value}]`` too); ``loss_mask`` is 1 exactly on assistant replies
  (``dflash/corpus/chat.py``; ``--assistant-mask``, ``--last-turn-only``);
- plain text: a ``text`` field/column, any other file, a folder (files matching ``--pattern``) or a glob; one
  document per file or row, every token supervised;
- tokenized data: an Arrow/Parquet file or folder (``datasets.save_to_disk`` too) with ``input_ids`` and
  ``loss_mask`` (or transformers-style ``labels``, -100 = not supervised); validated against the target's
  vocabulary and rewritten (a corpus written by ``prepare`` is such data: it is re-validated and rewritten).

Refused with the name of what was found and what to do instead (exit 2): other outputs of this project, or a path
inside one (a generate output: already a corpus, for ``extract --corpus``; its ``heldout_prompts.jsonl``, wherever
it lies; a hidden-state cache, a run folder, an export, a sweep folder; a prepared corpus's files other than its
data files; a folder holding any of them), since their JSON files are not text to train on; and a file named as an
input that is binary (NUL bytes or not UTF-8). Binary files found in a folder or glob are dropped and counted. The
output is locked while it is written (``dflash.io.locks``; a second ``prepare`` into it is refused).

Every row records the source document it came from (the corpus ``document_id``, which the trainer's validation
split keeps whole): a text file's identity (``<source>:<relative path>``, the ``sample_id`` before any ``#<chunk>``)
for files, so all chunks of a split file are one document; for a JSON line or table row (chat or text), its
``document_id`` (or ``document``) field or column when it has one (a string or an integer), else its own
``sample_id`` (one conversation, one document); for tokenized data, its ``document_id`` column (rows without one stay
their own documents).

Rows longer than ``--max-length`` follow ``--length-policy``: ``error``, ``drop``, ``truncate`` or ``split``
(consecutive ``max_length`` chunks, one document). ``auto`` means ``split`` when every input is plain text or the default
corpus, ``error`` otherwise (chat and tokenized data: choose explicitly). The output is written to a temporary
sibling folder and renamed when complete; any error leaves nothing at ``--output``. 0 kept samples is an error.
A report of kept and dropped rows by reason is printed and stored in ``corpus.json``.

Whole documents are held out for evaluation (``dflash.corpus.split``): ``--heldout-documents`` of them (unset: 5%,
at least one; 0: none), chosen by ``--seed``, go to the corpus ``OUTPUT/heldout``, the rest to ``OUTPUT``, which
records the split. extract and train read ``OUTPUT`` alone; ``evaluate --corpus OUTPUT`` takes its prompts from
``OUTPUT/heldout``. Input of one document is refused unless ``--heldout-documents 0``.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import typer

from dflash.corpus.chat import ASSISTANT_MASK_MODES, check_assistant_mask, normalize_messages, tokenize_chat
from dflash.corpus.default_corpus import (
    DEFAULT_LENGTH_POLICY,
    DEFAULT_MAX_LENGTH,
    TextFile,
    collect_text_files,
    default_corpus_description,
    default_corpus_files,
)
from dflash.corpus.format import (
    FORMAT_VERSION,
    METADATA_FILE,
    CorpusWriter,
    check_corpus_output,
    open_corpus,
    validate_corpus,
)
from dflash.corpus.split import HELDOUT_DIR, choose_heldout, heldout_count, row_documents, split_corpus
from dflash.errors import ConfigError, CorpusError, CorpusNotFoundError, DFlashError
from dflash.generation.parts import HELDOUT_PROMPTS_FILE, PLAN_FILE
from dflash.io.files import (
    DEFAULT_MAX_LINE_BYTES,
    MAX_RECORD_BYTES,
    JSONInputError,
    decode_json,
    load_json,
    read_bounded,
    read_lines,
    what_is_at,
)
from dflash.io.locks import output_lock
from dflash.target.load import load_tokenizer, resolve_target_path, target_identity
from dflash.values import check_seed
from stages.config.exit_status import ExitCode, print_error
from stages.config.options import CommandSettings, config_options, setting
from stages.config.resolve import print_and_exit, resolve_stage_config

__all__ = ["PrepareConfig", "PrepareReport", "run_prepare", "register"]

PrepareLengthPolicy = Literal["auto", "error", "drop", "truncate", "split"]
_POLICIES = ("auto", "error", "drop", "truncate", "split")
_TABLE_SUFFIXES = (".parquet", ".pq", ".arrow", ".feather", ".ipc")
_JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
# Documents tokenized per call: enough for the fast tokenizer's batching, small enough that --max-tokens stops
# soon after its budget.
_BATCH_DOCUMENTS = 16


@dataclass(kw_only=True, slots=True)
class PrepareConfig:
    """Configuration of ``prepare``; validated on construction (errors name the field)."""

    inputs: list[str] = setting(default_factory=list, argument='INPUT...', repeat=True, help="Chat JSONL/Parquet (messages), text files/folders/globs, tokenized Arrow/Parquet/save_to_disk data, or 'default' (the Python stdlib sources). No input: 'default'.")
    output: Path = setting(short='-o', help='Corpus folder to create (written atomically; it must not exist unless --overwrite). Required (here or in --config/--preset/--set).')
    target: str = setting("default", help="Target whose tokenizer, chat template and vocabulary are used: 'default' (SmolLM2-135M-Instruct), a transformers folder or a .gguf file.")
    max_length: int = setting(DEFAULT_MAX_LENGTH, help='Longest sample, in tokens.')
    length_policy: PrepareLengthPolicy = setting("auto", choices=True, help='Rows longer than --max-length: error, drop, truncate or split (consecutive max_length chunks, one document); auto: split for plain text and the default corpus, error for chat/tokenized data (choose explicitly).')
    assistant_mask: Literal["template", "prefix-diff"] = setting("template", choices=True, help="Chat data: how assistant replies are found. template: the chat template's {% generation %} markers; prefix-diff: render each conversation prefix (for templates without markers, e.g. SmolLM2's).")
    last_turn_only: bool = setting(False, option='--last-turn-only', help='Chat data: supervise only the last assistant reply of each conversation.')
    patterns: tuple[str, ...] = setting(("*",), option='--pattern', repeat=True, help='File-name pattern (fnmatch) of the files taken from folder inputs (repeatable).')
    max_samples: int | None = setting(None, help='Stop after this many kept samples (documents are then taken in a seeded random order).')
    max_tokens: int | None = setting(None, help='Stop once this many tokens are kept; the sample reaching it is kept whole (documents in seeded random order).')
    seed: int = setting(0, help='Seed of the document order when --max-samples/--max-tokens is set, and of the held-out documents.')
    min_supervised_tokens: int = setting(1, help='Drop samples (or chunks) with fewer supervised tokens than this (DFlash: < 2 x block_size is of little use).')
    stdlib_tests: bool = setting(False, option='--stdlib-tests', help='Default corpus: also take the stdlib test suites (~3x tokens).')
    overwrite: bool = setting(False, option='--overwrite', help='Replace an existing --output folder (atomically).')
    break_lock: bool = setting(False, runtime=True, option='--break-lock', help="Take over --output's lock left by a run on another host known dead.")
    heldout_documents: int | None = field(default=None, metadata={"help": (
        "Documents (conversations, files) held out for evaluation in OUTPUT/heldout, chosen by --seed; unset: 5% "
        "of the documents, at least 1; 0: none.")})

    def __post_init__(self) -> None:
        check_seed("seed", self.seed)
        self.inputs = list(self.inputs) or ["default"]
        self.output = Path(self.output)
        if self.max_length < 1:
            raise ConfigError(f"max_length must be >= 1, got {self.max_length}")
        if self.length_policy not in _POLICIES:
            raise ConfigError(f"length_policy must be one of {_POLICIES}, got {self.length_policy!r}")
        if self.assistant_mask not in ASSISTANT_MASK_MODES:
            raise ConfigError(f"assistant_mask must be one of {ASSISTANT_MASK_MODES}, got {self.assistant_mask!r}")
        for name in ("max_samples", "max_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1 (or unset), got {value}")
        if self.min_supervised_tokens < 1:
            raise ConfigError(f"min_supervised_tokens must be >= 1, got {self.min_supervised_tokens}")
        if self.heldout_documents is not None and self.heldout_documents < 0:
            raise ConfigError(f"heldout_documents must be >= 0 (or unset), got {self.heldout_documents}")
        if not self.patterns:
            raise ConfigError("patterns must name at least one file pattern, e.g. '*'")


@dataclass(slots=True, eq=False)
class _Document:
    """One input document, read lazily: ``kind`` text (``payload``: TextFile or str), chat (messages) or tokens
    (``(corpus, row)``); ``document_id``: its source document, recorded on every row made from it (module
    docstring; ``None``: the row is its own document)."""

    kind: Literal["text", "chat", "tokens"]
    sample_id: str
    where: str
    payload: Any
    document_id: str | None = None


#: Fields (JSON lines) or columns (tables) naming a row's source document, in order of preference.
_DOCUMENT_FIELDS = ("document_id", "document")


def _document_field(value: Any, where: str, name: str) -> str | None:
    """A ``document_id``/``document`` value as the row's document id: a string or an integer (as decimal text).

    Raises:
        CorpusError: any other type, naming ``where`` and the field.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise CorpusError(f"{where}: {name!r} is {type(value).__name__} {value!r}, expected a string or an integer "
                          "naming the row's source document; fix the field or drop it")
    return str(value)


@dataclass(kw_only=True, slots=True)
class PrepareReport:
    """Counts of what ``prepare`` read, kept and dropped (by reason); stored in ``corpus.json``."""

    documents_by_kind: Counter = field(default_factory=Counter)
    documents_not_read: int = 0
    #: The limit that stopped reading (``"max_tokens"`` or ``"max_samples"``), ``None`` if every document was read.
    limit_reached: str | None = None
    samples_kept: int = 0
    tokens_kept: int = 0
    supervised_tokens_kept: int = 0
    dropped: Counter = field(default_factory=Counter)
    truncated: int = 0
    split_documents: int = 0
    split_chunks: int = 0
    max_length: int = DEFAULT_MAX_LENGTH
    length_policy: str = "error"
    longest_kept: int = 0
    #: The held-out split (``dflash.corpus.split``): documents, samples and tokens written to ``OUTPUT/heldout``.
    heldout_documents: int = 0
    heldout_samples: int = 0
    heldout_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["documents_by_kind"] = dict(self.documents_by_kind)
        data["dropped"] = dict(self.dropped)
        return data

    def table(self) -> Any:
        """A rich table of the report."""
        from rich.table import Table

        table = Table(title="prepare report", show_header=True)
        table.add_column("what")
        table.add_column("count", justify="right")
        for kind, count in sorted(self.documents_by_kind.items()):
            table.add_row(f"documents found ({kind})", f"{count:,}")
        if self.documents_not_read:
            found = sum(self.documents_by_kind.values())
            limit = {"max_tokens": "token limit (--max-tokens)", "max_samples": "sample limit (--max-samples)"}.get(
                self.limit_reached or "", "--max-tokens / --max-samples limit")
            table.add_row("documents read", f"{found - self.documents_not_read:,}")
            table.add_row(f"documents skipped: {limit} reached", f"{self.documents_not_read:,}")
        table.add_row("[bold]samples kept[/]", f"[bold]{self.samples_kept:,}[/]")
        table.add_row("tokens kept", f"{self.tokens_kept:,}")
        table.add_row("supervised tokens kept", f"{self.supervised_tokens_kept:,}")
        table.add_row("longest sample kept", f"{self.longest_kept:,}")
        if self.split_documents:
            table.add_row(f"documents split into {self.max_length}-token chunks", f"{self.split_documents:,}")
            table.add_row("chunks made", f"{self.split_chunks:,}")
        if self.truncated:
            table.add_row(f"samples truncated to {self.max_length}", f"{self.truncated:,}")
        if self.heldout_documents:
            table.add_row(f"held out for evaluation ({HELDOUT_DIR}/): documents", f"{self.heldout_documents:,}")
            table.add_row(f"held out for evaluation ({HELDOUT_DIR}/): samples", f"{self.heldout_samples:,}")
        for reason, count in sorted(self.dropped.items()):
            table.add_row(f"[yellow]dropped: {reason}[/]", f"{count:,}")
        return table


def _is_tabular_folder(path: Path) -> bool:
    if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
        return True
    entries = [p for p in path.iterdir() if not p.name.startswith(".")]
    return (any(p.suffix in _TABLE_SUFFIXES for p in entries)
            and all(p.is_file() and (p.suffix in _TABLE_SUFFIXES or p.name == METADATA_FILE)
                    or p.is_dir() and p.name == HELDOUT_DIR and (p / METADATA_FILE).is_file()  # a split's held-out rows
                    for p in entries))


def _table_documents(path: Path) -> list[_Document]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.is_file() and path.suffix in (".parquet", ".pq"):
        names = pq.read_schema(path).names
    elif path.is_file():
        try:
            names = pa.ipc.open_file(pa.memory_map(str(path))).schema.names
        except pa.ArrowInvalid:
            names = pa.ipc.open_stream(pa.memory_map(str(path))).schema.names
    else:
        names = ["input_ids"]  # a corpus / save_to_disk folder: open_corpus checks its columns
    if "input_ids" in names:
        corpus = open_corpus(path, labels_as_mask=True)
        return [_Document("tokens", corpus.sample_id(i), corpus.describe_row(i), (corpus, i), corpus.document_id(i))
                for i in range(len(corpus))]
    column = next((c for c in ("messages", "conversations", "text") if c in names), None)
    if column is None:
        raise CorpusError(
            f"{path}: no 'input_ids', 'messages', 'conversations' or 'text' column (columns: {names}); give "
            "tokenized rows (input_ids + loss_mask), chat rows (messages: [{role, content}]) or plain text rows"
        )
    document_column = next((c for c in _DOCUMENT_FIELDS if c in names), None)
    columns = [column] + ([document_column] if document_column else [])
    table = pq.read_table(path, columns=columns) if path.suffix in (".parquet", ".pq") else _read_arrow_columns(path, columns)
    values = table.column(column).to_pylist()
    document_values = table.column(document_column).to_pylist() if document_column else [None] * len(values)
    documents = []
    for row, (value, document_value) in enumerate(zip(values, document_values, strict=True)):
        where = f"{path} row {row}"
        sample_id = f"{path.stem}:{row}"
        document_id = _document_field(document_value, where, document_column or "") or sample_id
        if column == "text":
            if not isinstance(value, str):
                raise CorpusError(f"{where}: text is {type(value).__name__}, expected a string")
            documents.append(_Document("text", sample_id, where, value, document_id))
        else:
            messages = normalize_messages({column: value}, where=where)
            documents.append(_Document("chat", sample_id, where, messages, document_id))
    return documents


def _read_arrow_columns(path: Path, columns: list[str]) -> Any:
    import pyarrow as pa

    try:
        return pa.ipc.open_file(pa.memory_map(str(path))).read_all().select(columns)
    except pa.ArrowInvalid:
        return pa.ipc.open_stream(pa.memory_map(str(path))).read_all().select(columns)


def _json_documents(path: Path) -> list[_Document]:
    try:
        return _parse_json_documents(path)
    except UnicodeDecodeError as error:
        raise CorpusError(
            f"input {path}: not UTF-8 text (it holds the byte {error.object[error.start:error.start + 1]!r}); "
            "a JSON/JSONL input must be UTF-8: convert it (iconv -t UTF-8) or pass the right file"
        ) from None


def _parse_json_documents(path: Path) -> list[_Document]:
    """Documents of a JSON-lines file, read a bounded line at a time (``dflash.io.files.read_lines``: at most
    :data:`~dflash.io.files.DEFAULT_MAX_LINE_BYTES` a line, a regular file only)."""
    documents = []
    for line_number, raw in read_lines(path, max_line_bytes=DEFAULT_MAX_LINE_BYTES, what="input"):
        line = raw.decode("utf-8")
        if not line.strip():
            continue
        where = f"{path} line {line_number}"
        try:
            record = decode_json(line)
        except JSONInputError as error:
            raise CorpusError(f"{where}: {error}; write one JSON object per line") from None
        if not isinstance(record, dict):
            raise CorpusError(f"{where}: expected a JSON object, got {type(record).__name__}")
        sample_id = str(record.get("id", record.get("sample_id", f"{path.stem}:{line_number}")))
        name = next((n for n in _DOCUMENT_FIELDS if record.get(n) is not None), None)
        document_id = (_document_field(record[name], where, name) if name else None) or sample_id
        if "messages" in record or "conversations" in record:
            documents.append(_Document("chat", sample_id, where, normalize_messages(record, where=where), document_id))
        elif isinstance(record.get("text"), str):
            documents.append(_Document("text", sample_id, where, record["text"], document_id))
        elif "text" in record:
            kind = "null" if record["text"] is None else type(record["text"]).__name__
            raise CorpusError(f"{where}: 'text' is {kind}, expected a string; "
                              "give the document's text, or leave the row out")
        else:
            raise CorpusError(
                f"{where}: no 'messages', 'conversations' or 'text' field (keys: {sorted(record)}); "
                "give chat rows (messages: [{role, content}]) or plain text rows ({\"text\": ...})"
            )
    if not documents:
        raise CorpusError(f"{path}: no JSON rows (the file is empty); write one JSON object per line")
    return documents


def _file_documents(path: Path, *, named: bool = False) -> list[_Document]:
    """Documents of one file; ``named``: the user gave this very file (a binary one is then an error, not a file
    dropped from a folder)."""
    if path.suffix in _TABLE_SUFFIXES:
        return _table_documents(path)
    if path.suffix in _JSON_SUFFIXES:
        return _json_documents(path)
    if named:
        _refuse_binary(path)
    sample_id = f"{path.parent.name}:{path.name}"
    return [_Document("text", sample_id, str(path), TextFile(path, path.name), sample_id)]


#: Marker files of this project's outputs -> what the folder holding them is and what to do instead. A generate
#: output is checked before a prepared corpus (it holds ``corpus.json`` too once finished).
_ARTIFACT_MARKERS = {
    "zarr.json": "a Zarr store (extract's hidden-state cache): pass it to `train --cache`, not to prepare",
    "run.json": "a training run folder (train's output): pass it to `evaluate --drafter` or `export`",
    "trainer_state.json": "a training checkpoint (train's output): pass it to `evaluate --drafter` or `export`",
    "dflash_export.json": "a drafter export (export's output): serve it with vLLM/SGLang, or check it with `inspect`",
    "sweep.json": "a sweep folder (sweep's output): its runs go to `evaluate --drafter` or `export`",
    PLAN_FILE: "a generate output (the target's replies, already a tokenized corpus): pass the folder to "
                     "`extract --corpus`, and its heldout_prompts.jsonl to `evaluate --prompts` (never train on them)",
    HELDOUT_PROMPTS_FILE: "generate's held-out evaluation prompts: pass them to `evaluate --prompts`; training on "
                          "them makes the evaluation meaningless",
    METADATA_FILE: "a prepared corpus (prepare's output): pass the corpus folder itself (it is re-validated as "
                   "tokenized data) or give it to `extract --corpus`",
}
_CORPUS = _ARTIFACT_MARKERS[METADATA_FILE]


def _is_marker(folder: Path, marker: str) -> bool:
    """Whether ``folder/marker`` is this project's file: present, and for ``corpus.json`` (a common name) a
    ``dflash.corpus.format`` sidecar."""
    file = folder / marker
    if not file.is_file():
        return False
    if marker != METADATA_FILE:
        return True
    try:
        record = load_json(file, error=CorpusError, fix="", limit=MAX_RECORD_BYTES)
        return str(record.get("format_version", "")).startswith("dflash.corpus/")
    except (OSError, ValueError):
        return False


def _project_artifact(path: Path) -> tuple[Path, str] | None:
    """``(folder, what it is)`` when ``path`` is, or lies inside, an output of this project."""
    path = path.resolve()
    if path.is_file() and path.name == HELDOUT_PROMPTS_FILE:
        return path, _ARTIFACT_MARKERS[HELDOUT_PROMPTS_FILE]
    folders = [path, *path.parents] if path.is_dir() else list(path.parents)
    for depth, folder in enumerate(folders):
        # A Zarr store has zarr.json at every level; other outputs are at most 3 levels deep (a run's checkpoint
        # files), so an unrelated run.json higher up (a home folder) is not mistaken for one.
        for marker, what in _ARTIFACT_MARKERS.items():
            if marker != HELDOUT_PROMPTS_FILE and (marker == "zarr.json" or depth < 3) and _is_marker(folder, marker):
                while marker == "zarr.json" and (folder.parent / marker).is_file():  # name the store's root
                    folder = folder.parent
                return folder, what
        if depth < 3 and (folder / "checkpoints").is_dir() and (folder / "latest").exists():
            return folder, _ARTIFACT_MARKERS["run.json"]
    return None


def _refuse_artifact(spec: str, path: Path, *, below: bool = False) -> None:
    """Raise naming what ``path`` is (or, ``below``: what the input folder ``spec`` holds at ``path``). A prepared
    corpus named itself (its folder, or one of its data files) is tokenized data and passes."""
    found = _project_artifact(path)
    if found is None:
        return
    folder, what = found
    if what == _CORPUS and not below and (path.resolve() == folder or path.suffix in _TABLE_SUFFIXES):
        return
    if below:
        where = f"holds {what.split(':')[0]} at {folder}; pass a folder of text files only"
    else:
        where = f"is {what}" + ("" if folder == path.resolve() else f" (it lies inside {folder})")
    raise CorpusError(
        f"input {spec!r} {where}; prepare reads chat data, text or tokenized data (a prepared corpus folder "
        "included)"
    )


def _refuse_binary(path: Path) -> None:
    with open(path, "rb") as handle:
        head = handle.read(8192)
    reason = "holds NUL bytes" if b"\0" in head else None
    if reason is None:
        try:
            head.decode("utf-8")
        except UnicodeDecodeError as error:
            if error.start < len(head) - 3:  # not merely a multi-byte character cut at the 8 KiB boundary
                reason = f"is not UTF-8 (byte {error.start} is {head[error.start:error.start + 1]!r})"
    if reason is not None:
        raise CorpusError(
            f"input {path} {reason}: binary data, not text; give text, chat JSONL or tokenized Arrow/Parquet "
            "data (binary files inside a folder input are skipped and counted)"
        )


def _text_file_documents(files: list[TextFile]) -> list[_Document]:
    """One document per file; the file's identity (its sample id) is the document id of every chunk of it."""
    return [_Document("text", f.sample_id, str(f.path), f, f.sample_id) for f in files]


def collect_documents(config: PrepareConfig) -> list[_Document]:
    """Expand ``config.inputs`` into documents (chat rows are parsed and checked now; files are read later).

    Raises:
        CorpusError: an input names nothing, or a row is malformed (file and row named).
    """
    documents: list[_Document] = []
    for spec in config.inputs:
        path = Path(spec).expanduser()
        if spec == "default":
            documents += _text_file_documents(default_corpus_files(include_tests=config.stdlib_tests))
        elif path.is_dir():
            _refuse_artifact(spec, path)
            if _is_tabular_folder(path):
                documents += _table_documents(path)
            else:
                files = collect_text_files(path, patterns=config.patterns)
                if not files:
                    raise CorpusError(f"input folder {path} has no file matching {list(config.patterns)}; check --pattern")
                for file in files:  # an output of this project somewhere below the folder
                    if file.path.name in _ARTIFACT_MARKERS:
                        _refuse_artifact(spec, file.path, below=True)
                documents += _text_file_documents(files)
        elif path.is_file():
            _refuse_artifact(spec, path)
            documents += _file_documents(path, named=True)
        elif glob.has_magic(spec):
            matches = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
            if not matches:
                raise CorpusError(f"input glob {spec!r} matches no file")
            for match in matches:
                _refuse_artifact(str(match), match)
                documents += _file_documents(match)
        elif (there := what_is_at(path)) != "nothing":
            raise CorpusError(f"input {spec!r} is {there}; pass files, folders, globs or 'default'")
        else:
            raise CorpusNotFoundError(f"input {spec!r} does not exist; pass files, folders, globs or 'default'")
    return documents


def _resolve_policy(config: PrepareConfig, documents: list[_Document]) -> str:
    if config.length_policy != "auto":
        return config.length_policy
    return DEFAULT_LENGTH_POLICY if all(d.kind == "text" for d in documents) else "error"


#: Largest single text file prepare reads (read whole: a device or FIFO in its place is refused unread).
_MAX_TEXT_FILE_BYTES = 4 * 2**30


def _read_text(document: _Document, report: PrepareReport) -> str | None:
    if isinstance(document.payload, str):
        return document.payload
    try:
        data = read_bounded(document.payload.path, limit=_MAX_TEXT_FILE_BYTES, error=CorpusError,
                            fix="pass regular text files (split a text file over 4 GiB)")
        if b"\0" in data[:8192]:
            raise UnicodeDecodeError("utf-8", data[:1], 0, 1, "binary")
        return data.decode("utf-8")
    except UnicodeDecodeError:
        report.dropped["not UTF-8 text"] += 1
        return None


def _encode(batch: list[_Document], tokenizer: Any, config: PrepareConfig, report: PrepareReport):
    """Yield ``(position in batch, document, input_ids, loss_mask)`` for each document of ``batch`` with tokens."""
    texts = [(d, _read_text(d, report)) for d in batch if d.kind == "text"]
    texts = [(d, t) for d, t in texts if t is not None]
    encoded = tokenizer([t for _, t in texts], add_special_tokens=True)["input_ids"] if texts else []
    by_document = {id(d): np.asarray(ids, np.int32) for (d, _), ids in zip(texts, encoded, strict=True)}
    for position, document in enumerate(batch):
        if document.kind == "text":
            if id(document) not in by_document:
                continue
            ids = by_document[id(document)]
            yield position, document, ids, np.ones(len(ids), np.uint8)
        elif document.kind == "chat":
            ids, mask = tokenize_chat(tokenizer, document.payload, mode=config.assistant_mask,
                                      last_turn_only=config.last_turn_only, where=document.where)
            if not mask.any():
                report.dropped["no assistant reply"] += 1
                continue
            yield position, document, ids, mask
        else:
            corpus, row = document.payload
            sample = corpus.row(row)
            yield position, document, sample.input_ids, sample.loss_mask


def _apply_length_policy(document: _Document, ids: np.ndarray, mask: np.ndarray, policy: str, report: PrepareReport):
    """Yield ``(sample_id, input_ids, loss_mask)`` after the length policy."""
    max_length = report.max_length
    if len(ids) == 0:
        report.dropped["empty"] += 1
        return
    if len(ids) <= max_length:
        yield document.sample_id, ids, mask
        return
    if policy == "error":
        raise CorpusError(
            f"{document.where} (sample_id {document.sample_id!r}): {len(ids)} tokens > --max-length {max_length}; "
            "choose --length-policy split|truncate|drop explicitly, or raise --max-length"
        )
    if policy == "drop":
        report.dropped["longer than max_length"] += 1
    elif policy == "truncate":
        report.truncated += 1
        yield document.sample_id, ids[:max_length], mask[:max_length]
    else:
        report.split_documents += 1
        for chunk, start in enumerate(range(0, len(ids), max_length)):
            report.split_chunks += 1
            yield f"{document.sample_id}#{chunk}", ids[start: start + max_length], mask[start: start + max_length]


def _samples(documents: list[_Document], tokenizer: Any, config: PrepareConfig, policy: str, report: PrepareReport):
    """Yield ``(documents consumed, sample_id, document_id, input_ids, loss_mask)`` for every sample to keep, in
    order (every chunk of a split document has the document's ``document_id``); drops are counted in ``report``."""
    for start in range(0, len(documents), _BATCH_DOCUMENTS):
        batch = documents[start: start + _BATCH_DOCUMENTS]
        for position, document, ids, mask in _encode(batch, tokenizer, config, report):
            for sample_id, sample_ids, sample_mask in _apply_length_policy(document, ids, mask, policy, report):
                if np.count_nonzero(sample_mask) < config.min_supervised_tokens:
                    minimum = config.min_supervised_tokens
                    report.dropped["no supervised token" if minimum == 1 else f"fewer than {minimum} supervised tokens"] += 1
                    continue
                yield start + position + 1, sample_id, document.document_id, sample_ids, sample_mask


@functools.lru_cache(maxsize=2)
def _tokenizer(target_path: Path) -> Any:
    """The target's tokenizer, loaded once per process (several ``run_prepare`` calls share it; never mutated)."""
    return load_tokenizer(target_path)


def run_prepare(config: PrepareConfig, *, console: Any = None) -> tuple[Path, PrepareReport]:
    """Build the corpus described by ``config``; returns ``(output folder, report)``.

    Raises:
        CorpusError: bad input (file and row named), a row too long under policy ``error``, or 0 kept samples;
            nothing is left at ``config.output``.
        TargetError: the target cannot be loaded.
        LockError: another process writes ``config.output``.
    """
    with output_lock(config.output, what="corpus", break_lock=config.break_lock):
        return _run_prepare(config, console=console)


def _run_prepare(config: PrepareConfig, *, console: Any = None) -> tuple[Path, PrepareReport]:
    from rich.console import Console

    console = console or Console(stderr=True)
    # The output and the input files are checked before the target is resolved (a GGUF target converted) and its
    # tokenizer loaded.
    check_corpus_output(config.output, overwrite=config.overwrite)
    documents = collect_documents(config)
    target_path = resolve_target_path(config.target)
    identity = target_identity(target_path)
    tokenizer = _tokenizer(target_path)
    if any(d.kind == "chat" for d in documents):
        check_assistant_mask(tokenizer, config.assistant_mask, where=f"target {config.target!r}")
    tokenized_sources = {id(d.payload[0]): d.payload[0] for d in documents if d.kind == "tokens"}
    for corpus in tokenized_sources.values():
        validate_corpus(corpus, vocab_size=identity.vocab_size)
    policy = _resolve_policy(config, documents)
    report = PrepareReport(max_length=config.max_length, length_policy=policy)
    report.documents_by_kind.update(d.kind for d in documents)
    if config.max_samples is not None or config.max_tokens is not None:
        order = np.random.default_rng(config.seed).permutation(len(documents))
        documents = [documents[i] for i in order]

    with contextlib.ExitStack() as stack:
        if config.heldout_documents == 0:
            writer = stack.enter_context(CorpusWriter(config.output, overwrite=config.overwrite))
            train = None
        else:  # every row goes to a scratch corpus first, then by document to OUTPUT and OUTPUT/heldout
            train = stack.enter_context(CorpusWriter(config.output, overwrite=config.overwrite))
            scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix=f".{config.output.name}.all-",
                                                                      dir=config.output.parent))
            writer = stack.enter_context(CorpusWriter(Path(scratch) / "corpus"))
        output = _write_rows(config, writer, documents, tokenizer, policy, report, console, identity, target_path)
        if train is not None:
            output = _write_split(config, open_corpus(output), train, report)
    return output, report


def _write_split(config: PrepareConfig, corpus: Any, train: CorpusWriter, report: PrepareReport) -> Path:
    """Split the prepared ``corpus`` by document into ``train`` (OUTPUT) and OUTPUT/heldout; counts go to ``report``."""
    count = heldout_count(len(set(row_documents(corpus))), config.heldout_documents,
                          where=f"the prepared data ({report.samples_kept} samples kept)",
                          setting="--heldout-documents")
    report.heldout_documents = count
    with CorpusWriter(train.inner_path(HELDOUT_DIR)) as heldout:
        # the report is final once the split is known: both corpora record it
        metadata = {k: v for k, v in corpus.metadata.items() if k not in ("fingerprint", "num_rows", "num_tokens")}
        rows = row_documents(corpus)
        held = choose_heldout(rows, count, config.seed)
        report.heldout_samples = sum(document in held for document in rows)
        report.heldout_tokens = int(sum(int(corpus.lengths[i]) for i, document in enumerate(rows) if document in held))
        metadata["report"] = report.to_dict()
        split_corpus(corpus, train, heldout, heldout_documents=count, seed=config.seed, heldout_path=HELDOUT_DIR,
                     metadata=metadata)
    return config.output


def _write_rows(config: PrepareConfig, writer: CorpusWriter, documents: list[_Document], tokenizer: Any, policy: str,
                report: PrepareReport, console: Any, identity: Any, target_path: Path) -> Path:
    from rich.progress import Progress

    read = 0
    with Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("tokenizing", total=len(documents))
        for read, sample_id, document_id, input_ids, loss_mask in _samples(documents, tokenizer, config, policy, report):
            writer.add(input_ids, loss_mask, sample_id, document_id)
            report.samples_kept += 1
            report.tokens_kept += len(input_ids)
            report.supervised_tokens_kept += int(np.count_nonzero(loss_mask))
            report.longest_kept = max(report.longest_kept, len(input_ids))
            progress.update(task, completed=read)
            if config.max_samples is not None and report.samples_kept >= config.max_samples:
                report.limit_reached = "max_samples"
                break
            if config.max_tokens is not None and report.tokens_kept >= config.max_tokens:
                report.limit_reached = "max_tokens"
                break
        else:
            read = len(documents)
        report.documents_not_read = len(documents) - read
        if report.samples_kept == 0:
            console.print(report.table())
        metadata = {
            "format_version": FORMAT_VERSION,
            "created_by": "dflash-stages prepare",
            "target_spec": config.target,
            "target": identity.to_dict(),
            "tokenizer": {"name": identity.name, "class": type(tokenizer).__name__, "path": str(target_path)},
            "vocab_size": identity.vocab_size,
            "max_length": config.max_length,
            "length_policy": policy,
            "assistant_mask": config.assistant_mask,
            "last_turn_only": config.last_turn_only,
            "inputs": config.inputs,
            "seed": config.seed,
            "max_samples": config.max_samples,
            "max_tokens": config.max_tokens,
            "report": report.to_dict(),
        }
        if "default" in config.inputs:
            metadata["default_corpus"] = default_corpus_description(include_tests=config.stdlib_tests)
        return writer.commit(metadata)


def register(app: Any) -> None:
    """Add ``prepare`` to the typer ``app``."""
    @app.command("prepare")
    @config_options(PrepareConfig, "prepare")
    def prepare_command(settings: CommandSettings) -> None:
        """Tokenize chat, plain-text or tokenized data into a corpus (input_ids + loss_mask) for extract.

        \b
        Examples:
          dflash-stages prepare -o data/corpus                      # embedded default: Python stdlib sources
          dflash-stages prepare default /usr/share/doc/python3.11/html/_sources -o data/corpus  # + Python docs
          dflash-stages prepare chats.jsonl --assistant-mask prefix-diff -o data/chat
          dflash-stages prepare 'code/**/*.rs' --length-policy split -o data/rust
        """
        from rich.console import Console

        console = Console(stderr=True)
        try:
            config = resolve_stage_config(PrepareConfig, "prepare", given=settings.given,
                                          config_file=settings.config_file, preset=settings.preset,
                                          overrides=settings.sets, required=("output",),
                                          option_names=settings.spellings)  # fmt: skip
            if settings.print_config:
                print_and_exit("prepare", config)
            path, report = run_prepare(config, console=console)
        except DFlashError as error:
            print_error(error, console)
            raise typer.Exit(ExitCode.USAGE) from None
        console.print(report.table())
        corpus = open_corpus(path)
        console.print(f"wrote {path}: {len(corpus):,} samples, {corpus.num_tokens:,} tokens, {corpus.fingerprint}",
                      soft_wrap=True, markup=False)
        if report.heldout_documents:
            console.print(f"held out {report.heldout_documents:,} documents ({report.heldout_samples:,} samples) for "
                          f"evaluation in {path / HELDOUT_DIR}: evaluate --corpus {path} uses them, extract and "
                          "train never see them", soft_wrap=True, markup=False)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run `dflash-stages prepare --help`")
