"""Bounded reads of line-based input files and bounded JSON parsing: the one way dflash-stages reads a user's
JSONL or one-prompt-per-line file, and parses JSON that came from outside (a file line, a server's reply).

Lines. :func:`read_lines` reads a file one line at a time, never more than ``max_line_bytes`` (plus the line
break) at once: a line over the limit is refused with one :class:`dflash.errors.ConfigError` naming the file, the
line number, the limit and the setting that raises it, after reading only the limit's worth of it. Memory and time
per line are then bounded, and a signal (Ctrl-C, SIGTERM) is answered between lines.

JSON. :func:`load_json` is ``json.loads`` whose every refusal is a :class:`JSONInputError` (a ``ValueError``) with
a one-line reason: invalid JSON (with the column), nesting deeper than the parser's recursion limit (a
``RecursionError`` inside ``json``), an integer of more digits than Python converts, or text with a lone
surrogate (``"\\ud800"``: valid JSON, but no UTF-8 text, so no tokenizer or file takes it).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

from dflash.errors import ConfigError

__all__ = ["DEFAULT_MAX_LINE_BYTES", "JSONInputError", "load_json", "read_lines", "has_lone_surrogate"]

#: Default bound on one line of a prompts or chat file: 4 MiB, about a million tokens of text (far past any
#: target's context), read and parsed in well under a second.
DEFAULT_MAX_LINE_BYTES = 4 * 2**20

_SURROGATE = re.compile("[\ud800-\udfff]")


class JSONInputError(ValueError):
    """JSON from outside that cannot be used; ``str()`` is the one-line reason (no location: the caller adds it)."""


def has_lone_surrogate(text: str) -> bool:
    """True when ``text`` holds a surrogate code point (only JSON ``\\ud800``-style escapes make one)."""
    return _SURROGATE.search(text) is not None


def _check_strings(value: Any) -> None:
    """Refuse a lone surrogate in any string of a parsed JSON value (iterative: the value may be deep)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if has_lone_surrogate(item):
                raise JSONInputError("a string holds a lone surrogate escape (e.g. \\ud800), which is not text; "
                                     "write the character itself or drop it")
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def load_json(text: str | bytes) -> Any:
    """``json.loads(text)``, with every way it refuses (or accepts what no later step can use) as one
    :class:`JSONInputError`.

    Raises:
        JSONInputError: invalid JSON, nesting deeper than the parser's recursion limit, an integer too long to
            convert, bytes that are not UTF-8, or a lone surrogate in a string.
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise JSONInputError(f"not valid JSON ({error.msg} at column {error.colno})") from None
    except RecursionError:
        raise JSONInputError("JSON nested too deep (arrays or objects thousands of levels deep)") from None
    except UnicodeDecodeError:
        raise JSONInputError("not UTF-8 text") from None
    except ValueError as error:  # an integer of more digits than int() converts
        raise JSONInputError(f"unreadable JSON value ({str(error)[:120]})") from None
    _check_strings(value)
    return value


def read_lines(path: str | os.PathLike[str], *, max_line_bytes: int, what: str,
               raise_with: str | None = None) -> Iterator[tuple[int, bytes]]:
    """``(line number, line)`` of the file at ``path``, from 1, the line break removed; never holds more than one
    line (of at most ``max_line_bytes`` bytes) in memory.

    Args:
        what: how messages name the input (``"prompts"``).
        raise_with: the setting that raises the limit, named in the refusal (``"--max-prompt-bytes"``); None: the
            limit is fixed.

    Raises:
        ConfigError: a line longer than ``max_line_bytes`` (named by file and line number).
        OSError: from the filesystem.
    """
    with open(path, "rb") as handle:
        number = 0
        while True:
            # Two bytes more than the limit: a line of exactly the limit still fits with its "\r\n".
            line = handle.readline(max_line_bytes + 2)
            if not line:
                return
            number += 1
            content = line.rstrip(b"\r\n")
            if len(content) > max_line_bytes:
                fix = "shorten or split it" + (f", or raise the limit with {raise_with}" if raise_with else "")
                raise ConfigError(f"{what}: {os.fspath(path)} line {number} is longer than {max_line_bytes:,} bytes "
                                  f"(the limit per line); {fix}")
            yield number, content
