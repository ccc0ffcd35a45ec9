"""The embedded default corpus: the Python standard library's sources, present on every machine with Python.

Documents, one per file, every token supervised (plain text):

- every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` (``pydoc_data/topics.py``, ~170K tokens of the
  language reference in prose, included), leaving out ``site-packages``/``dist-packages``, ``__pycache__``,
  build-specific files (``config-*``, ``lib-dynload``, ``_sysconfigdata_*``) and, unless asked for, the test
  suites (``test/``, ``tests/``, ``idle_test/``). Measured on CPython 3.11.7 with SmolLM2's tokenizer: 732 files,
  3.41M tokens, 2,093 samples at ``max_length`` 2048 (~30 s on one core); with the test suites 1,788 files,
  9.08M tokens, 5,492 samples (~2.5 min);
- optionally extra folders of text, given as further ``prepare`` inputs, e.g. the reStructuredText sources of the
  Python docs that Debian's ``python3.11-doc`` package installs under ``/usr/share/doc/python3.11/html/_sources``
  (``dflash-stages prepare default /usr/share/doc/python3.11/html/_sources -o DIR``).

Long files are split into ``max_length`` chunks by default (``DEFAULT_LENGTH_POLICY = "split"``): 367 of the 732
files are longer than 2048 tokens, and dropping or truncating them would throw most of the corpus away. The sample
id of a chunk is ``stdlib:<relative path>#<chunk>``; empty files (``__init__.py``) and non-UTF-8 files are dropped
and counted in the report.

The corpus differs between Python versions (3.11 here, 3.12 on the GPU host); ``dflash-stages prepare`` records
the version and the fingerprint, so caches and runs say which one they used.
"""

from __future__ import annotations

import fnmatch
import os
import sys
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEFAULT_MAX_LENGTH",
    "DEFAULT_LENGTH_POLICY",
    "SKIP_DIRS",
    "TEST_DIRS",
    "TextFile",
    "stdlib_root",
    "default_corpus_files",
    "collect_text_files",
    "default_corpus_description",
]

DEFAULT_MAX_LENGTH = 2048
DEFAULT_LENGTH_POLICY = "split"
#: Folders never read as source text (installed packages, bytecode, extension modules).
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "lib-dynload"})
#: Test-suite folders, read only when asked to.
TEST_DIRS = frozenset({"test", "tests", "idle_test"})
_SKIP_FILE_PATTERNS = ("_sysconfigdata_*",)


@dataclass(frozen=True, slots=True)
class TextFile:
    """One document: ``path`` on disk, ``sample_id`` recorded in the corpus (``<source>:<relative path>``)."""

    path: Path
    sample_id: str


def stdlib_root() -> Path:
    """The running interpreter's standard library folder (``sysconfig.get_paths()["stdlib"]``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def collect_text_files(
    root: Path, *, patterns: Iterable[str] = ("*",), source: str | None = None, skip_dirs: Iterable[str] = ()
) -> list[TextFile]:
    """Regular files under ``root`` whose name matches one of ``patterns`` (fnmatch), sorted by relative path;
    hidden files and folders, and folders named in ``skip_dirs``, are left out. Binary files are not filtered
    here (the reader drops files that are not UTF-8 text and counts them).

    Args:
        root: a folder.
        patterns: file-name patterns, e.g. ``("*.py",)`` or ``("*.rst", "*.rst.txt")``.
        source: prefix of the sample ids (default: the folder's name).
        skip_dirs: folder names not to descend into.
    """
    root = Path(root)
    skip = set(skip_dirs)
    patterns = tuple(patterns)
    prefix = source if source is not None else root.name
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in skip and not d.startswith("config-"))
        for name in names:
            if name.startswith(".") or not any(fnmatch.fnmatch(name, p) for p in patterns):
                continue
            if any(fnmatch.fnmatch(name, p) for p in _SKIP_FILE_PATTERNS):
                continue
            path = Path(folder) / name
            if path.is_file():
                found.append(TextFile(path, f"{prefix}:{path.relative_to(root).as_posix()}"))
    return sorted(found, key=lambda f: f.sample_id)


def default_corpus_files(*, include_tests: bool = False, extra_folders: Iterable[Path] = ()) -> list[TextFile]:
    """The documents of the embedded default corpus, in a stable order (stdlib first, then each extra folder).

    Args:
        include_tests: also take the stdlib test suites (~3x the tokens).
        extra_folders: folders of text to add (every non-hidden file; e.g. the Python docs' reST sources).
    """
    skip = SKIP_DIRS if include_tests else SKIP_DIRS | TEST_DIRS
    files = collect_text_files(stdlib_root(), patterns=("*.py",), source="stdlib", skip_dirs=skip)
    for folder in extra_folders:
        files += collect_text_files(Path(folder), patterns=("*",), source=Path(folder).name)
    return files


def default_corpus_description(*, include_tests: bool = False) -> dict[str, object]:
    """What the default corpus was built from, for the corpus metadata."""
    return {
        "name": "python-stdlib",
        "python_version": sys.version.split()[0],
        "stdlib": str(stdlib_root()),
        "include_tests": include_tests,
    }
