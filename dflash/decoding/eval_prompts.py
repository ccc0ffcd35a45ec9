"""Prompt sets for evaluating a drafter: held-out corpus rows, a chat JSONL file, or a text file of prompts.

Held-out corpus rows are rows the drafter never trained on. Given the corpus and the cache the drafter was trained
from, they are the rows outside every shard range of the cache (``CacheMetadata.shard_rows``); given a corpus alone
(e.g. the held-out split the offline pipeline writes), every row is held out. A row becomes a prompt as follows:

- a chat row (its first token is not supervised): the tokens before the first supervised token (system/user turns
  and the assistant header), i.e. what a serving engine would receive; the reply is what gets generated;
- a plain row (every token supervised, e.g. source code): a window of ``prompt_tokens`` tokens at a seeded
  random offset, leaving room for the continuation.

File prompts: ``.jsonl`` lines with ``messages`` (a trailing assistant turn is dropped; the chat template with the
generation prompt is applied), ``prompt`` (a user message through the chat template, or raw with
``chat_template=False``) or ``text`` (raw text, no template); ``.txt``: one prompt per non-empty line, as
``prompt``.

Embedded sets (:data:`EMBEDDED_PROMPT_SETS`), built on every machine from what this project installs:

- ``numpy-questions``: instruction-style questions about documented NumPy functions, through the chat template:
  the function's name, module and signature and the first paragraph of its docstring, then one question ("explain
  it and show an example", "what do its parameters mean", ...). No code is quoted. The functions are numpy's public
  module-level functions whose docstring has a ``Parameters`` section, read from the installed numpy's sources
  with :mod:`ast` (never imported, test folders left out), picked in a seeded order. They test a drafter on prompts
  of another kind than the code and code instructions the presets train on, from a package they never train on.
  The set depends on the installed numpy version, which the report records beside the set's fingerprint.

Every set has a fingerprint (:func:`prompts_fingerprint`): the SHA-256 of its prompts' token ids, so two reports
name the same prompts exactly when their fingerprints agree.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dflash.corpus.chat import normalize_messages
from dflash.corpus.default_corpus import SKIP_DIRS, TEST_DIRS, collect_text_files
from dflash.errors import ConfigError, MismatchError
from dflash.generation.default_prompts import docstring_summary, module_name, package_root, package_version
from dflash.io.files import DEFAULT_MAX_LINE_BYTES, JSONInputError, decode_json, not_a_file_error, read_lines

__all__ = ["EvalPrompt", "PromptSet", "EMBEDDED_PROMPT_SETS", "NUMPY_QUESTIONS", "check_prompt_source",
           "check_prompts_file", "embedded_prompts", "held_out_rows", "prompts_fingerprint", "prompts_from_corpus",
           "prompts_from_file"]

_MIN_PLAIN_PROMPT = 16


@dataclass(frozen=True, slots=True)
class EvalPrompt:
    """One evaluation prompt: its token ids and where it came from (for reports and errors)."""

    input_ids: list[int]
    source: str


@dataclass(frozen=True, slots=True)
class PromptSet:
    """A named prompt set of one evaluation.

    Fields:
        name: how reports and tables name it.
        spec: the setting it came from (``held-out``, a file path, an embedded set's name).
        source: what it is, in words.
        prompts: its prompts.
        details: what else identifies it (an embedded set's package version).
    """

    name: str
    spec: str
    source: str
    prompts: list[EvalPrompt]
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def fingerprint(self) -> str:
        return prompts_fingerprint(self.prompts)


def prompts_fingerprint(prompts: list[EvalPrompt]) -> str:
    """``sha256:<hex>`` of the prompts' token ids, in order."""
    digest = hashlib.sha256(json.dumps([p.input_ids for p in prompts], separators=(",", ":")).encode())
    return f"sha256:{digest.hexdigest()}"


#: The name of the embedded set of questions about NumPy's documented functions (module docstring).
NUMPY_QUESTIONS = "numpy-questions"

#: Embedded prompt sets by name, with what each one is.
EMBEDDED_PROMPT_SETS = {
    NUMPY_QUESTIONS: "instruction-style questions about documented NumPy functions (docstring summaries from the "
                     "installed numpy's sources, no code quoted)",
}

#: The questions of ``numpy-questions``, one per prompt (seeded).
NUMPY_QUESTION_TEMPLATES = (
    "Explain in plain words what it does, then show a short example of calling it.",
    "What do its parameters mean, and what does it return?",
    "Write a small Python function that uses it for a practical task, and explain the code.",
    "How does it behave on edge cases such as empty arrays or NaN values?",
    "Compare it with a plain Python loop that does the same job.",
)

#: Longest docstring summary quoted, in characters (cut at a word boundary).
_MAX_SUMMARY_CHARS = 400


def check_prompt_source(spec: str, *, what: str = "prompts", held_out: bool = True) -> None:
    """Refuse a prompt set setting that names neither ``held-out`` (when ``held_out``), an embedded set nor a
    prompts file (:func:`check_prompts_file`); the message names ``what``, the setting.

    Raises:
        ConfigPathNotFoundError: no file at ``spec``.
        ConfigError: ``held-out`` where it is not allowed; a file suffix other than .jsonl or .txt.
    """
    choices = ("held-out, " if held_out else "") + f"an embedded set ({', '.join(EMBEDDED_PROMPT_SETS)}), " \
        "a .jsonl or a .txt file"
    if spec in EMBEDDED_PROMPT_SETS or (held_out and spec == "held-out"):
        return
    if spec == "held-out":
        raise ConfigError(f"{what}: held-out is allowed only as the first prompt set (prompts); pass {choices}")
    path = Path(spec).expanduser()
    if not path.is_file():
        raise not_a_file_error(what, path, f"pass {choices}")
    try:
        check_prompts_file(path)
    except ConfigError as error:
        raise ConfigError(str(error).replace("prompts: ", f"{what}: ", 1)) from None


def _numpy_candidates() -> tuple[list[tuple[str, str, str, str]], str | None]:
    """``(module, name, signature, summary)`` of every public module-level function of the installed numpy whose
    docstring has a ``Parameters`` section, sorted; and numpy's version."""
    root = package_root("numpy")
    found = []
    for file in collect_text_files(root, patterns=("*.py",), source="numpy", skip_dirs=SKIP_DIRS | TEST_DIRS):
        try:
            tree = ast.parse(file.path.read_text(encoding="utf-8"))
        except (SyntaxError, ValueError, UnicodeDecodeError, OSError):
            continue
        module = module_name(f"numpy/{file.path.relative_to(root).as_posix()}")
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or "\nParameters\n" not in doc:
                continue
            summary = docstring_summary(doc, _MAX_SUMMARY_CHARS)
            if summary is None:
                continue
            found.append((module, node.name, ast.unparse(node.args), summary))
    return sorted(found), package_version("numpy")


def embedded_prompts(name: str, tokenizer: Any, *, num_prompts: int, seed: int = 0) -> PromptSet:
    """The embedded set ``name`` (:data:`EMBEDDED_PROMPT_SETS`), ``num_prompts`` prompts picked in a seeded order.

    Raises:
        ConfigError: an unknown name; a tokenizer without a chat template.
    """
    if name not in EMBEDDED_PROMPT_SETS:
        raise ConfigError(f"prompts: {name!r} is not an embedded prompt set; embedded: {', '.join(EMBEDDED_PROMPT_SETS)}")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(f"prompts: {name} holds chat questions but the target's tokenizer has no chat template; "
                          "pass a .jsonl file of 'text' prompts instead")
    candidates, version = _numpy_candidates()
    rng = np.random.default_rng(seed)
    prompts = []
    for index in rng.permutation(len(candidates))[:num_prompts]:
        module, function, signature, summary = candidates[int(index)]
        question = NUMPY_QUESTION_TEMPLATES[int(rng.integers(len(NUMPY_QUESTION_TEMPLATES)))]
        content = (f"I am using NumPy's `{function}` function (module `{module}`), called as "
                   f"`{function}({signature})`. Its documentation says: \"{summary}\"\n\n{question}")
        prompts.append(EvalPrompt(_chat_ids(tokenizer, [{"role": "user", "content": content}]),
                                  f"{name}:{module}.{function}"))
    return PromptSet(name=name, spec=name, source=EMBEDDED_PROMPT_SETS[name], prompts=prompts,
                     details={"package": "numpy", "package_version": version, "candidates": len(candidates),
                              "seed": seed})


def held_out_rows(corpus: Any, cache_path: str | os.PathLike[str] | None = None, *, heldout: Any = None) -> np.ndarray:
    """Corpus rows outside the cache's shard ranges (all rows when ``cache_path`` is None), int64 ascending.

    With ``heldout``, the held-out corpus of ``corpus``'s split (``dflash.corpus.split.heldout_corpus``): every row
    of ``heldout``, once the cache is checked to come from ``corpus``.

    Raises:
        MismatchError: the cache was extracted from another corpus (fingerprints differ).
        ConfigError: the cache covers every row, so nothing is held out.
    """
    rows = np.arange(len(corpus if heldout is None else heldout), dtype=np.int64)
    if cache_path is None:
        return rows
    from dflash.cache import CacheReader

    metadata = CacheReader(cache_path).metadata
    if metadata.corpus_fingerprint != corpus.fingerprint:
        raise MismatchError(
            f"corpus_fingerprint: cache {cache_path} was extracted from {metadata.corpus_fingerprint} "
            f"({metadata.corpus_path or 'unknown path'}), but corpus {corpus.path} is {corpus.fingerprint}; "
            "pass the corpus the cache was built from"
        )
    if heldout is not None:
        return rows
    covered = np.zeros(len(corpus), dtype=bool)
    for start, stop in metadata.shard_rows:
        covered[start:stop] = True
    held = rows[~covered]
    if held.size == 0:
        raise ConfigError(
            f"cache {cache_path} covers all {len(corpus)} rows of {corpus.path}: no row is held out; prepare "
            "holds documents out (--heldout-documents, OUTPUT/heldout), `dflash-stages run` too; or pass --prompts FILE"
        )
    return held


def prompts_from_corpus(
    corpus: Any,
    rows: np.ndarray,
    *,
    num_prompts: int,
    prompt_tokens: int = 128,
    continuation_tokens: int = 128,
    seed: int = 0,
) -> list[EvalPrompt]:
    """Up to ``num_prompts`` prompts from ``rows`` of ``corpus``, rows picked in a seeded random order.

    Args:
        prompt_tokens: length of the prompt window of a plain row; chat prompts keep their last ``4 *
            prompt_tokens`` tokens at most.
        continuation_tokens: room left after a plain row's window when the row is long enough.

    Raises:
        ConfigError: no row makes a prompt (all too short).
    """
    rng = np.random.default_rng(seed)
    prompts: list[EvalPrompt] = []
    for row_index in rng.permutation(rows):
        if len(prompts) >= num_prompts:
            break
        row = corpus.row(int(row_index))
        ids, mask = row.input_ids, row.loss_mask
        supervised = np.flatnonzero(mask)
        if supervised.size and supervised[0] > 0:  # chat row: everything before the first reply token
            ids_prompt = ids[: supervised[0]][-4 * prompt_tokens :]
        elif ids.size >= _MIN_PLAIN_PROMPT + 1:
            window = min(prompt_tokens, max(_MIN_PLAIN_PROMPT, ids.size // 2))
            room = ids.size - window - continuation_tokens
            start = int(rng.integers(0, room + 1)) if room > 0 else 0
            ids_prompt = ids[start : start + window]
        else:
            continue
        prompts.append(EvalPrompt([int(t) for t in ids_prompt], f"{corpus.describe_row(int(row_index))}"))
    if not prompts:
        raise ConfigError(
            f"none of the {len(rows)} held-out rows of {corpus.path} makes a prompt (all shorter than "
            f"{_MIN_PLAIN_PROMPT + 1} tokens); pass --prompts FILE"
        )
    return prompts


def _chat_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def check_prompts_file(path: str | os.PathLike[str]) -> Path:
    """``path`` (``~`` expanded) if it names a prompts file :func:`prompts_from_file` reads, by kind; the contents
    are read later. Lets a config refuse a wrong path before any work.

    Raises:
        ConfigPathNotFoundError: no file at ``path``.
        ConfigError: a suffix other than .jsonl or .txt.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise not_a_file_error("prompts", path, "pass held-out, a .jsonl or a .txt file")
    if path.suffix not in (".jsonl", ".txt"):
        raise ConfigError(f"prompts: {path} must end in .jsonl (chat rows) or .txt (one prompt per line)")
    return path


def prompts_from_file(
    path: str | os.PathLike[str], tokenizer: Any, *, num_prompts: int, chat_template: bool = True
) -> list[EvalPrompt]:
    """Prompts from a ``.jsonl`` (``messages`` / ``prompt`` / ``text`` per line) or ``.txt`` file (a line each).

    Lines are read one at a time up to :data:`dflash.io.files.DEFAULT_MAX_LINE_BYTES` each.

    Raises:
        ConfigError: missing file, unknown suffix, a line that is too long, not UTF-8, not a JSON object
            (:func:`dflash.io.files.decode_json`) or without a usable field (named by line number), or no prompt
            at all.
        CorpusError: a ``messages`` list with a message that is not ``{role, content}`` (named by line number).
    """
    path = check_prompts_file(path)
    use_template = chat_template and getattr(tokenizer, "chat_template", None) is not None
    prompts: list[EvalPrompt] = []
    for line_number, raw in read_lines(path, max_line_bytes=DEFAULT_MAX_LINE_BYTES, what="prompts"):
        if len(prompts) >= num_prompts:
            break
        where = f"{path} line {line_number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ConfigError(f"prompts: {where} is not UTF-8 text (it holds the byte "
                              f"{raw[error.start:error.start + 1]!r}); convert the file to UTF-8") from None
        if not line.strip():
            continue
        record: Any = {"prompt": line}
        if path.suffix == ".jsonl":
            try:
                record = decode_json(line)
            except JSONInputError as error:
                raise ConfigError(f"prompts: {where}: {error}; write one JSON object per line") from None
            if not isinstance(record, dict):
                raise ConfigError(f"prompts: {where}: expected a JSON object, got {type(record).__name__}")
        if isinstance(record.get("messages"), list) and record["messages"]:
            messages = normalize_messages(record, where=f"prompts: {where}")
            while messages and messages[-1]["role"] == "assistant":
                messages.pop()
            if not messages:
                raise ConfigError(f"prompts: {where} has only assistant turns; nothing to prompt with")
            if getattr(tokenizer, "chat_template", None) is None:
                raise ConfigError(f"prompts: {where} has chat messages but the tokenizer has no chat template")
            ids = _chat_ids(tokenizer, messages)
        elif isinstance(record.get("prompt"), str):
            text = record["prompt"]
            ids = _chat_ids(tokenizer, [{"role": "user", "content": text}]) if use_template else tokenizer.encode(text)
        elif isinstance(record.get("text"), str):
            ids = tokenizer.encode(record["text"])
        else:
            given = [f"{key!r} is " + ("an empty list" if record[key] == [] else "null" if record[key] is None
                                       else type(record[key]).__name__)
                     for key in ("messages", "prompt", "text") if key in record]
            raise ConfigError(f"prompts: {where} has none of 'messages' (a non-empty list), 'prompt' or 'text' "
                              f"(strings): " + (", ".join(given) if given else f"its keys are {sorted(record)}"))
        if not ids:
            raise ConfigError(f"prompts: {where} tokenizes to no token")
        prompts.append(EvalPrompt([int(t) for t in ids], where))
    if not prompts:
        raise ConfigError(f"prompts: {path} holds no prompt")
    return prompts
