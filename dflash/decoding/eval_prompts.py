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
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dflash.corpus.chat import normalize_messages
from dflash.errors import ConfigError, ConfigPathNotFoundError, MismatchError
from dflash.io.files import DEFAULT_MAX_LINE_BYTES, JSONInputError, decode_json, read_lines

__all__ = ["EvalPrompt", "check_prompts_file", "held_out_rows", "prompts_from_corpus", "prompts_from_file"]

_MIN_PLAIN_PROMPT = 16


@dataclass(frozen=True, slots=True)
class EvalPrompt:
    """One evaluation prompt: its token ids and where it came from (for reports and errors)."""

    input_ids: list[int]
    source: str


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
        raise ConfigPathNotFoundError(f"prompts: {path} does not exist; pass held-out, a .jsonl or a .txt file")
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
            raise ConfigError(f"prompts: {where} has none of 'messages' (list), 'prompt' or 'text' (strings)")
        if not ids:
            raise ConfigError(f"prompts: {where} tokenizes to no token")
        prompts.append(EvalPrompt([int(t) for t in ids], where))
    if not prompts:
        raise ConfigError(f"prompts: {path} holds no prompt")
    return prompts
