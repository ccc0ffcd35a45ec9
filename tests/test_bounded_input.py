"""dflash.bounded_input: a line-based file is read a bounded line at a time, and JSON from outside is refused with
one reason (never a RecursionError or a string no tokenizer takes)."""

from __future__ import annotations

import pytest

from dflash.bounded_input import JSONInputError, load_json, read_lines
from dflash.errors import ConfigError


def test_lines_up_to_the_limit_are_read_with_their_numbers_and_a_longer_one_is_refused(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_bytes(b"a" * 8 + b"\r\n" + b"\n" + b"b" * 8 + b"\n" + b"c" * 9)
    assert list(read_lines(path, max_line_bytes=9, what="prompts")) == [
        (1, b"a" * 8), (2, b""), (3, b"b" * 8), (4, b"c" * 9)]
    lines = read_lines(path, max_line_bytes=8, what="prompts", raise_with="--max-prompt-bytes")
    assert [next(lines) for _ in range(3)] == [(1, b"a" * 8), (2, b""), (3, b"b" * 8)]
    with pytest.raises(ConfigError) as raised:
        next(lines)
    assert str(raised.value) == (f"prompts: {path} line 4 is longer than 8 bytes (the limit per line); shorten or "
                                 "split it, or raise the limit with --max-prompt-bytes")
    with pytest.raises(ConfigError, match=r"line 4 is longer than 8 bytes \(the limit per line\); shorten or split it$"):
        list(read_lines(path, max_line_bytes=8, what="prompts"))


@pytest.mark.parametrize("text, reason", [
    ("[" * 100_000 + "]" * 100_000, "JSON nested too deep"),
    ('{"a": ' + "9" * 5000 + "}", "unreadable JSON value"),
    ('{"a": ["ok", {"b": "\\udc80"}]}', "lone surrogate"),
    ('{"a": 1,}', "not valid JSON (Expecting property name enclosed in double quotes at column 9)"),
    (b'{"a": "\xff"}', "not UTF-8 text"),
])
def test_json_that_no_later_step_can_use_is_one_reason(text, reason):
    with pytest.raises(JSONInputError) as raised:
        load_json(text)
    assert reason in str(raised.value) and "\n" not in str(raised.value)


def test_json_with_a_surrogate_pair_is_text():
    assert load_json('{"a": "\\ud83d\\ude00", "n": 1000000000000}') == {"a": "\U0001F600", "n": 10**12}
