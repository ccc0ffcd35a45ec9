"""The embedded default prompt set: prompts built from the Python standard library, on every machine with Python.

Two kinds of prompt, both from the stdlib's ``*.py`` files (the documents of :mod:`dflash.default_corpus`, test
suites excluded):

- ``complete``: code completion, raw text (no chat template): a window of source ending at a line boundary, at most
  ``window_chars`` characters (the file's start when the cut is near it); the target continues the code. About one
  prompt per ``chars_per_completion`` characters of a file, at seeded random cut points.
- ``instruct``: an instruction through the chat template about one function or class of the file (found with
  :mod:`ast`, 3 to 60 lines): "Explain what this Python function does", "Write a docstring for it", "Write unit
  tests for it with pytest", "Add type hints to it", "Point out possible bugs in it", "Rewrite it to be more
  readable" (one of them per definition, seeded), the definition's source in a fenced block.

Every prompt records its source file (``PromptRecord.document``, ``stdlib:<relative path>``), which ``generate``
writes as the corpus ``document_id``, so the trainer's validation split also keeps each file whole.

Split by source document, never by prompt: a file is held out when ``sha256(relative path)`` falls in the lowest
``heldout_permille`` of the hash range, so the held-out files are the same on every machine and Python version that
has them, training never sees a held-out file's code, and the held-out prompts test generalization to unseen code
(the issue-13 protocol: "prompts whose source documents training never saw").

Measured on CPython 3.11.7 (defaults: 1 completion per 600 characters, window 1,200 characters, every eligible
definition): 669 documents with prompts, 34 of them held out; 18,945 completion and 14,135 instruction prompts in
the training split, 512 (capped) held out. ``generate`` records the counts of the machine it ran on.
"""

from __future__ import annotations

import ast
import hashlib
import sys
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from dflash.errors import ConfigError
from dflash.generation.prompts import PromptRecord

__all__ = ["DefaultPromptConfig", "default_prompt_sets", "is_heldout_document", "write_prompts_jsonl",
           "describe_default_prompts", "INSTRUCTIONS"]

Split = Literal["train", "heldout"]

#: The instruction templates of ``instruct`` prompts; ``{kind}`` is "function" or "class".
INSTRUCTIONS = (
    "Explain what this Python {kind} does.",
    "Write a docstring for this Python {kind}.",
    "Write unit tests for this Python {kind} with pytest.",
    "Add type hints to this Python {kind}.",
    "Point out possible bugs in this Python {kind}.",
    "Rewrite this Python {kind} to be more readable.",
)


@dataclass(kw_only=True, slots=True, frozen=True)
class DefaultPromptConfig:
    """Settings of the embedded default prompt set (module docstring).

    Attributes:
        heldout_permille: share of documents held out, in 1/1000 (by path hash), 0..999.
        chars_per_completion: one completion prompt per this many characters of a file (at least one per file).
        window_chars: longest completion prompt, in characters.
        instruct: build instruction prompts too.
        max_definition_lines: longest function/class (in lines) an instruction prompt quotes.
        max_prompts: cap per split after shuffling (None: all); the held-out split is capped at ``max_heldout``.
        max_heldout: cap of the held-out split (evaluation needs tens, not thousands).
        seed: cut points, instruction choice and the shuffle.
    """

    heldout_permille: int = 50
    chars_per_completion: int = 600
    window_chars: int = 1200
    instruct: bool = True
    max_definition_lines: int = 60
    max_prompts: int | None = None
    max_heldout: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.heldout_permille <= 999:
            raise ConfigError(f"heldout_permille must be in 0..999, got {self.heldout_permille}")
        if self.chars_per_completion < 50:
            raise ConfigError(f"chars_per_completion must be >= 50, got {self.chars_per_completion}")
        if self.window_chars < 50:
            raise ConfigError(f"window_chars must be >= 50, got {self.window_chars}")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ConfigError(f"max_prompts must be >= 1 or None, got {self.max_prompts}")

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


def is_heldout_document(relative_path: str, heldout_permille: int) -> bool:
    """Whether the document at ``relative_path`` (posix, relative to the stdlib) is held out."""
    digest = int(hashlib.sha256(relative_path.encode()).hexdigest()[:8], 16)
    return digest % 1000 < heldout_permille


def _completions(text: str, name: str, config: DefaultPromptConfig, rng: np.random.Generator) -> list[PromptRecord]:
    line_ends = [i + 1 for i, ch in enumerate(text) if ch == "\n"]
    line_ends = [end for end in line_ends if 40 <= end <= len(text) - 40]  # something before, something to continue
    if not line_ends:
        return []
    count = max(1, len(text) // config.chars_per_completion)
    cuts = sorted(set(int(c) for c in rng.choice(line_ends, size=min(count, len(line_ends)), replace=False)))
    records = []
    for cut in cuts:
        start = max(0, cut - config.window_chars)
        if start > 0:  # start on a line boundary too
            newline = text.find("\n", start, cut)
            start = newline + 1 if 0 <= newline < cut - 40 else start
        records.append(PromptRecord(prompt_id=f"{name}@{cut}:complete", text=text[start:cut], document=name))
    return records


def _instructions(text: str, name: str, config: DefaultPromptConfig, rng: np.random.Generator) -> list[PromptRecord]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    records = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        last = node.end_lineno or node.lineno
        if not 3 <= last - first + 1 <= config.max_definition_lines:
            continue
        source = "\n".join(lines[first - 1 : last])
        kind = "class" if isinstance(node, ast.ClassDef) else "function"
        instruction = INSTRUCTIONS[int(rng.integers(len(INSTRUCTIONS)))].format(kind=kind)
        content = f"{instruction}\n\n```python\n{source}\n```"
        records.append(PromptRecord(prompt_id=f"{name}:{node.lineno}:instruct",
                                    messages=[{"role": "user", "content": content},
                                              {"role": "assistant", "content": None}], document=name))
    return records


def default_prompt_sets(config: DefaultPromptConfig | None = None) -> dict[Split, list[PromptRecord]]:
    """The training and held-out prompt records of this machine's stdlib (module docstring), each shuffled.

    Returns:
        ``{"train": [...], "heldout": [...]}``; prompt ids ``stdlib:<path>@<offset>:complete`` and
        ``stdlib:<path>:<line>:instruct``, each with ``document`` ``stdlib:<path>`` (the source file, as the default
        corpus of ``prepare`` names it), so every row generated from one file has one corpus ``document_id``.
    """
    from dflash.default_corpus import default_corpus_files, stdlib_root

    config = config or DefaultPromptConfig()
    root = stdlib_root()
    sets: dict[Split, list[PromptRecord]] = {"train": [], "heldout": []}
    for file in default_corpus_files():
        relative = file.path.relative_to(root).as_posix()
        try:
            text = file.path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text.strip()) < 100:
            continue
        seed = int(hashlib.sha256(f"{config.seed}:{relative}".encode()).hexdigest()[:8], 16)
        rng = np.random.default_rng(seed)
        records = _completions(text, file.sample_id, config, rng)
        if config.instruct:
            records += _instructions(text, file.sample_id, config, rng)
        sets["heldout" if is_heldout_document(relative, config.heldout_permille) else "train"].extend(records)
    for split, cap in (("train", config.max_prompts), ("heldout", config.max_heldout)):
        order = np.random.default_rng(config.seed).permutation(len(sets[split]))
        sets[split] = [sets[split][i] for i in order[: cap if cap is not None else len(order)]]
    return sets


def write_prompts_jsonl(records: list[PromptRecord], path: Any) -> int:
    """Write prompt records as a prompts file that ``evaluate --prompts`` and ``generate`` read: ``text`` lines
    for raw completions, ``prompt`` lines for single user messages, ``messages`` otherwise (the replies to generate
    left out). Returns the number of lines."""
    import json
    from pathlib import Path

    from dflash.files import atomic_output

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path) as handle:
        for record in records:
            if record.messages is None:
                line: dict[str, Any] = {"text": record.text}
            elif len(record.messages) == 2 and record.messages[0]["role"] == "user":
                line = {"prompt": record.messages[0]["content"]}
            else:
                line = {"messages": [m for m in record.messages if m["content"] is not None]}
            line["id"] = record.prompt_id
            if record.document is not None:
                line["document"] = record.document
            handle.write(json.dumps(line, ensure_ascii=False) + "\n")
    return len(records)


def describe_default_prompts(config: DefaultPromptConfig) -> dict[str, Any]:
    """What the default prompt set was built from, for the corpus metadata."""
    from dflash.default_corpus import stdlib_root

    return {"name": "python-stdlib-prompts", "python_version": sys.version.split()[0], "stdlib": str(stdlib_root()),
            **config.to_dict()}
