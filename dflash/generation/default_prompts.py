"""The embedded default prompt set: prompts built from the Python standard library, on every machine with Python.

Three kinds of prompt, all from the stdlib's ``*.py`` files (the documents of :mod:`dflash.corpus.default_corpus`, test
suites excluded):

- ``complete``: code completion, raw text (no chat template): a window of source ending at a line boundary, at most
  ``window_chars`` characters (the file's start when the cut is near it); the target continues the code. About one
  prompt per ``chars_per_completion`` characters of a file, at seeded random cut points.
- ``instruct``: an instruction through the chat template about one function or class of the file (found with
  :mod:`ast`, 3 to 60 lines): "Explain what this Python function does", "Write a docstring for it", "Write unit
  tests for it with pytest", "Add type hints to it", "Point out possible bugs in it", "Rewrite it to be more
  readable" (one of them per definition, seeded), the definition's source in a fenced block.
- ``ask`` (only with ``ask_prompts``): a question through the chat template about one documented public function,
  class or method of the file (:func:`documented_definitions`: found with :mod:`ast`, never imported; a module or
  name starting with ``_`` is private), named by its dotted path and signature, with the first paragraph of its
  docstring and no code quoted. One of :data:`QUESTIONS` per definition, seeded: how to use it with an example, what
  its parameters mean, when to pick it over another definition of the module, which exceptions it raises, an
  exercise that needs it, what it is for and a common mistake. The replies are prose with examples, as a user's
  questions get. ``ask_prompts`` of them join the training split, on top of ``max_prompts`` and
  ``package_prompts``, spread over as many training files (the stdlib's and ``packages``') as possible, like the
  package prompts below; the held-out split has none.

Every prompt records its source file (``PromptRecord.document``, ``stdlib:<relative path>``), which ``generate``
writes as the corpus ``document_id``, so the trainer's validation split also keeps each file whole.

Optionally more training code from installed packages (``packages``, e.g. ``("torch", "transformers")``, which every
machine running this project has): their ``*.py`` files (test folders left out; found with
:func:`importlib.util.find_spec`, never imported) give prompts of the first two kinds, documents
``<package>:<relative path>``. ``package_prompts`` of them join the training split, spread over as many files as
possible (one prompt per file, files in seeded random order, then a second round, ...), since what limits a small
drafter here is generalization to files it never saw (docs/training.md); with ``ask_prompts`` their files give
questions too. A package file in the held-out hash range (of ``<package>/<relative path>``) is left out altogether;
the held-out split stays the stdlib's completions and instructions, so held-out tau compares across runs and
machines whose installed package versions differ (``describe_default_prompts`` records them). Questions like the
``ask`` kind's are measured on a set of their own, about a package no preset trains on (``numpy-questions``,
:mod:`dflash.decoding.eval_prompts`).

Split by source document, never by prompt: a file is held out when ``sha256(relative path)`` falls in the lowest
``heldout_permille`` of the hash range, so the held-out files are the same on every machine and Python version that
has them, training never sees a held-out file's code nor a question about it, and the held-out prompts test
generalization to unseen code ("prompts whose source documents training never saw").

Measured on CPython 3.11.7 (defaults: 1 completion per 600 characters, window 1,200 characters, every eligible
definition): 669 documents with prompts, 34 of them held out; 18,945 completion and 14,135 instruction prompts in
the training split, 512 (capped) held out; 4,602 documented definitions in the training files could give ``ask``
prompts. ``generate`` records the counts of the machine it ran on, by kind and split
(:func:`describe_default_prompts`).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import itertools
import json
import logging
import multiprocessing
import os
import re
import signal
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import numpy as np

from dflash.corpus.default_corpus import (
    SKIP_DIRS,
    TEST_DIRS,
    collect_text_files,
    default_corpus_files,
    stdlib_root,
)
from dflash.errors import ConfigError
from dflash.generation.prompts import PromptRecord
from dflash.io.files import atomic_output

__all__ = ["DefaultPromptConfig", "default_prompt_sets", "is_heldout_document", "write_prompts_jsonl",
           "describe_default_prompts", "package_root", "package_files", "package_version", "INSTRUCTIONS",
           "QUESTIONS", "PROMPT_KINDS", "Documented", "documented_definitions", "docstring_summary", "module_name",
           "prompt_kind"]

Split = Literal["train", "heldout"]

log = logging.getLogger(__name__)

#: The instruction templates of ``instruct`` prompts; ``{kind}`` is "function" or "class".
INSTRUCTIONS = (
    "Explain what this Python {kind} does.",
    "Write a docstring for this Python {kind}.",
    "Write unit tests for this Python {kind} with pytest.",
    "Add type hints to this Python {kind}.",
    "Point out possible bugs in this Python {kind}.",
    "Rewrite this Python {kind} to be more readable.",
)

#: The question templates of ``ask`` prompts, each of another shape. ``{target}`` is the dotted path and signature
#: in backticks (always the first backticked name of the question), ``{kind}`` "function", "class" or "method",
#: ``{origin}`` where it comes from ("the Python standard library", "the torch package"), ``{summary}`` the first
#: paragraph of its docstring, ``{other}`` another documented definition of the same kind in the same module (the
#: template that names one is left out for a definition that has none, the one about parameters for a definition
#: without any).
QUESTIONS = (
    'How would I use the {kind} {target} from {origin}? Its docstring says: "{summary}" Show a short, realistic '
    "example and walk through what happens when it runs.",
    "Go through the parameters of {target} ({origin}) one at a time: what each one controls, which ones can be left "
    'out, and what the {kind} gives back. It is documented as: "{summary}"',
    "When should I pick {target} over `{other}`? Both are in {origin}; the first is documented as \"{summary}\" "
    "Explain how they differ and describe a situation that suits each.",
    'Which exceptions can {target} raise, and in what situations? ({origin}, documented as "{summary}") Show how '
    "calling code should deal with them.",
    'Give me a small programming exercise that needs {target} from {origin} ("{summary}"), then solve it in Python '
    "and explain the solution step by step.",
    "I am new to {origin}. In simple terms, what is {target} for, and what is a mistake people often make with it? "
    'The documentation starts: "{summary}"',
)

#: The prompt kinds of the default set (module docstring); a record's kind is the last ``:`` field of its id.
PROMPT_KINDS = ("complete", "instruct", "ask")

#: Longest docstring summary an ``ask`` prompt quotes, in characters, and longest signature it names.
_MAX_ASK_SUMMARY_CHARS = 300
_MAX_ASK_SIGNATURE_CHARS = 240


@dataclass(kw_only=True, slots=True, frozen=True)
class DefaultPromptConfig:
    """Settings of the embedded default prompt set (module docstring). ``heldout_permille`` is described by its help.

    Attributes:
        chars_per_completion: one completion prompt per this many characters of a file (at least one per file).
        window_chars: longest completion prompt, in characters.
        instruct: build instruction prompts too.
        max_definition_lines: longest function/class (in lines) an instruction prompt quotes.
        max_prompts: cap per split after shuffling (None: all); the held-out split is capped at ``max_heldout``.
        max_heldout: cap of the held-out split (evaluation needs tens, not thousands).
        packages: installed packages (import names) whose sources add training prompts (module docstring).
        package_prompts: training prompts taken from ``packages`` (None: all), on top of ``max_prompts``.
        ask_prompts: training prompts of kind ``ask`` (questions about documented functions and classes of the
            stdlib's training files and of ``packages``, no code quoted), on top of ``max_prompts`` and
            ``package_prompts``; 0: none.
        seed: cut points, instruction and question choice and the shuffle.
    """

    heldout_permille: int = field(default=50, metadata={"help": "Default prompt set: share of documents held out, in 1/1000 (by path hash), 0..999."})
    chars_per_completion: int = 600
    window_chars: int = 1200
    instruct: bool = True
    max_definition_lines: int = 60
    max_prompts: int | None = None
    max_heldout: int = 512
    packages: tuple[str, ...] = ()
    package_prompts: int | None = None
    ask_prompts: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        """Raises ConfigError: a setting out of range, a name in ``packages`` that is not an installed package, or
        ``package_prompts`` without ``packages``."""
        if self.ask_prompts < 0:
            raise ConfigError(f"ask_prompts must be >= 0 (0: no ask prompts), got {self.ask_prompts}")
        if not 0 <= self.heldout_permille <= 999:
            raise ConfigError(f"heldout_permille must be in 0..999, got {self.heldout_permille}")
        if self.chars_per_completion < 50:
            raise ConfigError(f"chars_per_completion must be >= 50, got {self.chars_per_completion}")
        if self.window_chars < 50:
            raise ConfigError(f"window_chars must be >= 50, got {self.window_chars}")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ConfigError(f"max_prompts must be >= 1 or None, got {self.max_prompts}")
        if self.max_heldout < 1:
            raise ConfigError(f"max_heldout must be >= 1, got {self.max_heldout}")
        if isinstance(self.packages, str) or not all(isinstance(p, str) and p for p in self.packages):
            raise ConfigError(f"packages must be a list of package names, e.g. [\"torch\"], got {self.packages!r}")
        object.__setattr__(self, "packages", tuple(self.packages))
        if len(set(self.packages)) != len(self.packages):
            raise ConfigError(f"packages names a package twice: {list(self.packages)}")
        for name in self.packages:
            package_root(name)  # a wrong name fails with the settings, before any prompt is built
        if self.package_prompts is not None:
            if self.package_prompts < 1:
                raise ConfigError(f"package_prompts must be >= 1 or None, got {self.package_prompts}")
            if not self.packages:
                raise ConfigError("package_prompts is set but packages is empty; name packages, e.g. [\"torch\"]")

    def to_dict(self) -> dict[str, Any]:
        data = {name: getattr(self, name) for name in self.__slots__}
        data["packages"] = list(self.packages)
        return data


def is_heldout_document(relative_path: str, heldout_permille: int) -> bool:
    """Whether the document at ``relative_path`` (posix, relative to the stdlib) is held out."""
    digest = int(hashlib.sha256(relative_path.encode()).hexdigest()[:8], 16)
    return digest % 1000 < heldout_permille


def _completions(text: str, name: str, config: DefaultPromptConfig, rng: np.random.Generator) -> list[PromptRecord]:
    line_ends = [match.end() for match in re.finditer("\n", text)]
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


def _instructions(text: str, tree: ast.Module | None, name: str, config: DefaultPromptConfig,
                  rng: np.random.Generator) -> list[PromptRecord]:  # fmt: skip
    if tree is None:
        return []
    lines = text.splitlines()
    records = []
    for node in _definitions(tree):
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


def module_name(relative_path: str) -> str:
    """The dotted module name of the source file at ``relative_path`` (posix, relative to the folder imports search):
    ``json/decoder.py`` -> ``json.decoder``, ``email/__init__.py`` -> ``email``."""
    return ".".join(PurePosixPath(relative_path).with_suffix("").parts).removesuffix(".__init__")


def docstring_summary(doc: str | None, max_chars: int) -> str | None:
    """The first paragraph of a docstring on one line, cut at a word boundary (``" ..."`` added) past ``max_chars``;
    None when there is no docstring or its first paragraph is under 20 characters."""
    if not doc:
        return None
    summary = " ".join(doc.strip().split("\n\n", 1)[0].split())
    if len(summary) < 20:
        return None
    if len(summary) > max_chars:
        summary = summary[:max_chars].rsplit(" ", 1)[0] + " ..."
    return summary


@dataclass(frozen=True, slots=True)
class Documented:
    """A documented public function, class or method of a module's source.

    Fields:
        path: its dotted path, ``module.name`` or ``module.Class.method``.
        signature: its parameters as :func:`ast.unparse` writes them, without ``self``/``cls`` (a class: its
            ``__init__``'s).
        kind: "function", "class" or "method".
        summary: the first paragraph of its docstring (:func:`docstring_summary`).
        line: the line of its ``def`` or ``class``.
    """

    path: str
    signature: str
    kind: str
    summary: str
    line: int


#: Decorators that make a definition something other than a callable with the signature written
#: (``@property``, ``@x.setter``, ``@overload``'s stubs).
_NOT_CALLABLE_AS_WRITTEN = re.compile(r"(^|\.)(property|cached_property|setter|getter|deleter|overload)$")


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef, *, bound: bool) -> str:
    """``node``'s parameters as written, the first positional one (``self``/``cls``) left out when ``bound``."""
    args = node.args
    if bound:
        positional = [*args.posonlyargs, *args.args]
        if not positional:
            return ast.unparse(args)
        posonly, plain = (args.posonlyargs[1:], args.args) if args.posonlyargs else ([], args.args[1:])
        defaults = args.defaults[1:] if len(args.defaults) == len(positional) else args.defaults
        args = ast.arguments(posonlyargs=posonly, args=plain, vararg=args.vararg, kwonlyargs=args.kwonlyargs,
                             kw_defaults=args.kw_defaults, kwarg=args.kwarg, defaults=defaults)
    return ast.unparse(args)


def _callable_as_written(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return not any(_NOT_CALLABLE_AS_WRITTEN.search(ast.unparse(d)) for d in node.decorator_list)


def documented_definitions(tree: ast.Module, module: str) -> list[Documented]:
    """The documented public definitions of the module ``module`` parsed as ``tree``, in source order: its
    top-level functions and classes, and the methods of those classes, whose names do not start with ``_``, whose
    docstring has a summary (:func:`docstring_summary`) without a doctest or a fence, and whose signature is at most
    240 characters without a backtick; a class needs an ``__init__`` of its own (its signature). Nothing for a
    private module (a part of ``module`` starting with ``_``)."""
    if any(part.startswith("_") or not part.isidentifier() for part in module.split(".")):
        return []
    found = []

    def add(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef, path: str, signature: str, kind: str) -> None:
        summary = docstring_summary(ast.get_docstring(node), _MAX_ASK_SUMMARY_CHARS)
        if summary is None or ">>>" in summary or "```" in summary:
            return
        if len(signature) > _MAX_ASK_SIGNATURE_CHARS or "`" in signature:
            return
        found.append(Documented(path=path, signature=signature, kind=kind, summary=summary, line=node.lineno))

    functions = ast.FunctionDef | ast.AsyncFunctionDef
    for node in tree.body:
        if not isinstance(node, functions | ast.ClassDef) or node.name.startswith("_"):
            continue
        if isinstance(node, functions):
            if _callable_as_written(node):
                add(node, f"{module}.{node.name}", _signature(node, bound=False), "function")
            continue
        methods = [child for child in node.body if isinstance(child, functions)]
        init = next((m for m in methods if m.name == "__init__"), None)
        if init is not None:
            add(node, f"{module}.{node.name}", _signature(init, bound=True), "class")
        for method in methods:
            if method.name.startswith("_") or not _callable_as_written(method):
                continue
            static = any(ast.unparse(d).endswith("staticmethod") for d in method.decorator_list)
            add(method, f"{module}.{node.name}.{method.name}", _signature(method, bound=not static), "method")
    return found


def _origin(sample_id: str) -> str:
    source = sample_id.split(":", 1)[0]
    return "the Python standard library" if source == "stdlib" else f"the {source} package"


def _questions(tree: ast.Module | None, relative: str, name: str, rng: np.random.Generator) -> list[PromptRecord]:
    """One ``ask`` prompt per documented definition of the file (:func:`documented_definitions`), its question
    template chosen with ``rng``."""
    if tree is None:
        return []
    definitions = documented_definitions(tree, module_name(relative))
    origin = _origin(name)
    records = []
    for definition in definitions:
        others = [d for d in definitions if d.kind == definition.kind and d.path != definition.path]
        templates = [t for t in QUESTIONS if (others or "{other}" not in t)
                     and (definition.signature or not t.startswith("Go through the parameters"))]
        template = templates[int(rng.integers(len(templates)))]
        other = others[int(rng.integers(len(others)))].path if "{other}" in template else ""
        content = template.format(target=f"`{definition.path}({definition.signature})`", kind=definition.kind,
                                  origin=origin, summary=definition.summary, other=other)
        records.append(PromptRecord(prompt_id=f"{name}:{definition.line}:ask",
                                    messages=[{"role": "user", "content": content},
                                              {"role": "assistant", "content": None}], document=name))
    return records


def prompt_kind(record: PromptRecord) -> str:
    """The kind of a default-set prompt (:data:`PROMPT_KINDS`), from its id."""
    return record.prompt_id.rsplit(":", 1)[-1]


#: The nodes on any path from a module to a definition: statements, ``except`` handlers and ``case`` blocks (a
#: statement never sits inside an expression).
_STATEMENT_NODES = (ast.stmt, ast.excepthandler, ast.match_case)


def _definitions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef]:
    """Every function and class definition of ``tree`` in :func:`ast.walk`'s order (breadth first, children in
    field order), without visiting expressions: the same nodes at the same depths in the same sibling order, so the
    same sequence; about 3x faster on real sources (``tests/test_default_prompts.py`` checks it against
    ``ast.walk`` on every stdlib file)."""
    found = []
    pending = deque([tree])
    while pending:
        node = pending.popleft()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.append(node)
        pending.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, _STATEMENT_NODES))
    return found


def _parse(text: str) -> ast.Module | None:
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError):
        return None


def _file_prompts(path: Any, relative: str, sample_id: str, config: DefaultPromptConfig) -> list[PromptRecord]:
    """One source file's prompts (completions, then instructions, then with ``config.ask_prompts`` every question
    the file gives), seeded by ``config.seed`` and ``relative`` (the questions by a generator of their own, so the
    other kinds do not depend on ``ask_prompts``); none for a file that is not UTF-8 or holds under 100
    characters."""
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return []
    if len(text.strip()) < 100:
        return []
    seed = int(hashlib.sha256(f"{config.seed}:{relative}".encode()).hexdigest()[:8], 16)
    rng = np.random.default_rng(seed)
    records = _completions(text, sample_id, config, rng)
    tree = _parse(text) if config.instruct or config.ask_prompts else None
    if config.instruct:
        records += _instructions(text, tree, sample_id, config, rng)
    if config.ask_prompts:
        seed = int(hashlib.sha256(f"{config.seed}:{relative}:ask".encode()).hexdigest()[:8], 16)
        records += _questions(tree, relative, sample_id, np.random.default_rng(seed))
    return records


#: Below this many files the prompts are built in this process (a process pool's start-up would cost more).
_POOL_MIN_FILES = 256


def _die_with_parent(parent: int) -> None:
    """Pool initializer: on Linux, ask the kernel to SIGKILL this worker when its parent dies (``prctl
    PR_SET_PDEATHSIG``), so a parent killed with SIGKILL (OOM killer, ``timeout -k``) leaves no orphan; exit at once if
    the parent is already gone."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def _prompts_of_files(items: list[tuple[Path, str, str]], config: DefaultPromptConfig,
                      processes: int | None) -> list[list[PromptRecord]]:  # fmt: skip
    """:func:`_file_prompts` of each ``(path, relative, sample_id)``, in order. Parsing every file (``ast.parse``)
    is most of the cost, and each file's prompts depend on that file alone (seeded by its path), so with many files
    and ``processes`` other than 1 they are built in a ``concurrent.futures`` process pool (spawned; ``None``: one
    process per usable core, at most 16): the same records either way. In a daemonic process (which may not start
    children, e.g. a Dask worker) they are built here, and here again if the pool breaks (logged)."""
    if processes is None:
        processes = min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    started = time.perf_counter()
    built = None
    if len(items) >= _POOL_MIN_FILES and processes >= 2 and not multiprocessing.current_process().daemon:
        paths, relatives, sample_ids = zip(*items, strict=True)
        try:
            with ProcessPoolExecutor(max_workers=processes, mp_context=multiprocessing.get_context("spawn"),
                                     initializer=_die_with_parent, initargs=(os.getpid(),)) as pool:
                built = list(pool.map(_file_prompts, paths, relatives, sample_ids, itertools.repeat(config),
                                      chunksize=max(1, len(items) // (8 * processes))))
        except (BrokenProcessPool, OSError) as error:  # e.g. a caller's main module without a __main__ guard
            log.warning("default prompts: the process pool failed (%s); building them in this process instead", error)
    if built is None:  # few files, one process asked for, a daemonic process, or a broken pool
        processes = 1
        built = [_file_prompts(path, relative, sample_id, config) for path, relative, sample_id in items]
    log.info("default prompts: %d files read and parsed in %.1f s (%d process%s)", len(items),
             time.perf_counter() - started, processes, "" if processes == 1 else "es")
    return built


def package_root(name: str) -> Path:
    """The source folder of the installed package ``name`` (import name), found without importing it.

    Raises:
        ConfigError: no such package is installed, or it is a single module rather than a package folder.
    """
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"packages: {name!r} is not an installed package (a folder of sources) in this Python "
                          f"({sys.executable}); install it or leave it out")
    return Path(next(iter(spec.submodule_search_locations)))


def package_files(config: DefaultPromptConfig) -> list[tuple[Any, str]]:
    """The ``*.py`` files of ``config.packages`` that may give prompts (test folders and held-out files left out),
    as ``(dflash.corpus.default_corpus.TextFile, "<package>/<relative path>")`` in listing order; the prompt set visits
    them in ``numpy.random.default_rng(config.seed).permutation(len(files))`` order (its first draw).

    Raises:
        ConfigError: a name in ``packages`` is not an installed package (:func:`package_root`).
    """
    files = []
    for name in config.packages:
        root = package_root(name)
        for file in collect_text_files(root, patterns=("*.py",), source=name, skip_dirs=SKIP_DIRS | TEST_DIRS):
            relative = f"{name}/{file.path.relative_to(root).as_posix()}"
            if not is_heldout_document(relative, config.heldout_permille):
                files.append((file, relative))
    return files


def _spread(per_file: list[list[PromptRecord]], wanted: int) -> list[PromptRecord]:
    """Up to ``wanted`` records of ``per_file`` (each file's list in its order), one of each file per round: the
    first of every file in file order, then the second, ..."""
    taken: list[PromptRecord] = []
    depth = 0
    while len(taken) < wanted and per_file:
        per_file = [records for records in per_file if len(records) > depth]
        taken.extend(records[depth] for records in per_file[: wanted - len(taken)])
        depth += 1
    return taken


def _split_questions(records: list[PromptRecord]) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """A file's records as (completions and instructions, questions)."""
    asks = [record for record in records if prompt_kind(record) == "ask"]
    return ([record for record in records if prompt_kind(record) != "ask"] if asks else records), asks


def _package_prompts(config: DefaultPromptConfig,
                     processes: int | None = 1) -> tuple[list[PromptRecord], list[list[PromptRecord]]]:  # fmt: skip
    """Training prompts from ``config.packages`` (module docstring): files in seeded random order, one prompt of
    each file per round, until ``package_prompts`` are taken; and each file's questions (``ask``, with
    ``config.ask_prompts``) in that file order."""
    files = package_files(config)
    rng = np.random.default_rng(config.seed)
    order = rng.permutation(len(files))
    built = _prompts_of_files([(files[i][0].path, files[i][1], files[i][0].sample_id) for i in order], config,
                              processes)
    per_file, questions = [], []
    for records, asks in map(_split_questions, built):
        if records:
            per_file.append([records[i] for i in rng.permutation(len(records))])
        questions.append(asks)
    wanted = config.package_prompts if config.package_prompts is not None else sum(map(len, per_file))
    return _spread(per_file, wanted), questions


def _ask_prompts(per_file: list[list[PromptRecord]], config: DefaultPromptConfig) -> list[PromptRecord]:
    """``config.ask_prompts`` of the training files' questions (``per_file``: each file's), spread over as many files
    as possible: files and each file's questions in a seeded random order, one question of each file per round."""
    rng = np.random.default_rng(config.seed + 2)
    per_file = [per_file[i] for i in rng.permutation(len(per_file))]
    per_file = [[records[i] for i in rng.permutation(len(records))] for records in per_file if records]
    available = sum(map(len, per_file))
    if available < config.ask_prompts:
        log.warning("default prompts: ask_prompts is %d but the training files hold %d documented definitions; "
                    "taking all %d", config.ask_prompts, available, available)
    return _spread(per_file, config.ask_prompts)


def default_prompt_sets(config: DefaultPromptConfig | None = None, *,
                        processes: int | None = 1) -> dict[Split, list[PromptRecord]]:  # fmt: skip
    """The training and held-out prompt records of this machine's stdlib (module docstring), each shuffled; with
    ``config.packages``, their prompts join the training split, and with ``config.ask_prompts`` questions about the
    stdlib's training files and the packages (shuffled in with the stdlib's).

    ``processes``: build the files' prompts in this many spawned processes (``None``: one per usable core, at most
    16; 1: in this process, the default). The records are the same either way; parsing is most of the time (about
    30 s for the h200-smollm2 preset's 24,576 prompts on one core). Spawned processes re-import the caller's main
    module: call it with ``processes`` != 1 only from code under ``if __name__ == "__main__":`` (as the CLI is).

    Returns:
        ``{"train": [...], "heldout": [...]}``; prompt ids ``stdlib:<path>@<offset>:complete``,
        ``stdlib:<path>:<line>:instruct`` and ``stdlib:<path>:<line>:ask``, each with ``document``
        ``stdlib:<path>`` (the source file, as the default corpus of ``prepare`` names it), so every row generated
        from one file has one corpus ``document_id`` (``<package>:<path>`` for package files). The held-out split
        holds completions and instructions only.
    """
    config = config or DefaultPromptConfig()
    root = stdlib_root()
    sets: dict[Split, list[PromptRecord]] = {"train": [], "heldout": []}
    questions: list[list[PromptRecord]] = []
    items = [(file.path, file.path.relative_to(root).as_posix(), file.sample_id) for file in default_corpus_files()]
    for (_, relative, _), built in zip(items, _prompts_of_files(items, config, processes), strict=True):
        records, asks = _split_questions(built)
        if is_heldout_document(relative, config.heldout_permille):
            sets["heldout"].extend(records)  # a held-out file's questions are dropped: no kind of it is trained on
        else:
            sets["train"].extend(records)
            questions.append(asks)
    for split, cap in (("train", config.max_prompts), ("heldout", config.max_heldout)):
        order = np.random.default_rng(config.seed).permutation(len(sets[split]))
        sets[split] = [sets[split][i] for i in order[: cap if cap is not None else len(order)]]
    extra: list[PromptRecord] = []
    if config.packages:
        from_packages, package_questions = _package_prompts(config, processes)
        extra += from_packages
        questions += package_questions
    if config.ask_prompts:
        extra += _ask_prompts(questions, config)
    if config.packages or config.ask_prompts:
        train = sets["train"] + extra
        order = np.random.default_rng(config.seed + 1).permutation(len(train))
        sets["train"] = [train[i] for i in order]
    return sets


def write_prompts_jsonl(records: list[PromptRecord], path: Any) -> int:
    """Write prompt records as a prompts file that ``evaluate --prompts`` and ``generate`` read: ``text`` lines
    for raw completions, ``prompt`` lines for single user messages, ``messages`` otherwise (the replies to generate
    left out). Returns the number of lines."""
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


def describe_default_prompts(config: DefaultPromptConfig,
                             sets: dict[Split, list[PromptRecord]] | None = None) -> dict[str, Any]:  # fmt: skip
    """What the default prompt set was built from, for the corpus metadata; given the ``sets`` it built, how many
    prompts of each kind (:data:`PROMPT_KINDS`) each split holds (``prompt_counts``)."""
    description = {"name": "python-stdlib-prompts", "python_version": sys.version.split()[0],
                   "stdlib": str(stdlib_root()), **config.to_dict()}
    if config.packages:
        description["package_versions"] = {name: package_version(name) for name in config.packages}
    if sets is not None:
        description["prompt_counts"] = {}
        for split, records in sets.items():
            counts = dict.fromkeys(PROMPT_KINDS, 0)
            for record in records:
                counts[prompt_kind(record)] += 1
            description["prompt_counts"][split] = counts
    return description


def package_version(name: str) -> str | None:
    """The installed version of the distribution that provides import name ``name`` (None when unknown)."""
    import importlib.metadata  # email, csv, calendar...: not loaded for every command's --help

    for distribution in importlib.metadata.packages_distributions().get(name, [name]):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None
