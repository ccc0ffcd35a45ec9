"""The single homes of two cross-cutting concerns: atomic file replacement (``dflash.io.files``) and the target-identity check (``dflash.training.checks``)."""

from __future__ import annotations

import pytest

from dflash.errors import ConfigError
from dflash.io.files import (
    JSONInputError,
    atomic_output,
    atomic_write_bytes,
    atomic_write_text,
    decode_json,
    read_lines,
    what_is_at,
)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "run.json"
    atomic_write_text(path, "old\n")
    with pytest.raises(RuntimeError, match="mid-write"), atomic_output(path) as handle:
        handle.write("new, partly")
        raise RuntimeError("mid-write")
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]
    atomic_write_bytes(path, b"\x00new")
    assert path.read_bytes() == b"\x00new" and sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]
    with pytest.raises(ValueError, match="mode must be"), atomic_output(path, "a"):
        pass


def test_one_target_identity_check_reads_every_recorded_form():
    """``dflash.training.checks.check_target_identity``: the check behind cache, checkpoint, export and evaluate, whatever
    form the artefact recorded its target in."""
    from dflash.errors import MismatchError
    from dflash.training.checks import check_target_identity, recorded_identity

    identity = {"name": "smol", "content_hash": "sha256:aa", "num_hidden_layers": 30, "hidden_size": 576,
                "vocab_size": 49152, "model_type": "llama"}
    for record in (identity, {"target_spec": "default", **identity}, {"identity": identity}, {"target": identity}):
        assert recorded_identity(record) == identity
        check_target_identity(record, identity, where="w", fix="f")  # the same target: no error
        renamed = {**identity, "name": "renamed folder"}
        check_target_identity(record, renamed, where="w", fix="f")  # a name is not an identity
    with pytest.raises(MismatchError, match=r"^target\.hidden_size differs: the drafter at R has 576, got 960; pass"):
        check_target_identity({"identity": identity}, {**identity, "hidden_size": 960}, where="the drafter at R",
                              fix="pass --target default")


def test_a_path_that_does_not_exist_is_the_familys_error_and_a_file_not_found_error(tmp_path):
    """dflash/errors.py: every error for a user's input also inherits the matching builtin; a missing path is a
    ``FileNotFoundError`` as well as its family's error, at each place that looks one up."""
    from dflash.cache import HiddenStateCache
    from dflash.corpus.format import open_corpus
    from dflash.errors import CacheError, CheckpointError, ConfigError, CorpusError, TargetError
    from dflash.target.load import resolve_target_path
    from dflash.training.checkpoint import resolve_checkpoint
    from stages.config.check import read_config_file

    missing = tmp_path / "nothing-here"
    for call, family in [(lambda: read_config_file(missing), ConfigError), (lambda: open_corpus(missing), CorpusError),
                         (lambda: HiddenStateCache.open(missing), CacheError),
                         (lambda: resolve_checkpoint(missing), CheckpointError),
                         (lambda: resolve_target_path(missing), TargetError)]:
        with pytest.raises(family) as caught:
            call()
        assert isinstance(caught.value, FileNotFoundError), (family, caught.value)
        assert str(missing) in str(caught.value)
    (tmp_path / "a-file").write_text("x")  # there, but not a folder: the family's error only
    with pytest.raises(CheckpointError, match="is not a folder") as caught:
        resolve_checkpoint(tmp_path / "a-file")
    assert not isinstance(caught.value, FileNotFoundError)


def test_the_bounded_reader_refuses_devices_fifos_oversize_files_and_deep_nesting(tmp_path):
    """``dflash.io.files.load_json``: the one way a JSON record is read back; each refusal is the caller's error class,
    one line naming the file and the fix."""
    import os

    from dflash.errors import CheckpointError
    from dflash.io.files import MAX_DEPTH, load_json, parse_json, read_bounded

    def refusal(path, **kwargs):
        with pytest.raises(CheckpointError) as caught:
            load_json(path, error=CheckpointError, fix="the fix", **kwargs)
        assert str(caught.value).startswith(f"{path}: ") and str(caught.value).endswith("; the fix")
        return str(caught.value)

    good = tmp_path / "good.json"
    good.write_text('{"a": [1, {"b": 2}]}')
    assert load_json(good, error=CheckpointError, fix="") == {"a": [1, {"b": 2}]}
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")
    assert "is a device, not a regular file" in refusal(zero)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    assert "is a FIFO, not a regular file" in refusal(fifo)  # and the open did not block
    assert "is a folder" in refusal(tmp_path)
    assert "over the 10-byte limit" in refusal(good, limit=10)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)  # RecursionError in the parser
    assert f"nested more than {MAX_DEPTH} levels deep" in refusal(deep)
    deep.write_text('{"a": ' * (MAX_DEPTH + 1) + "1" + "}" * (MAX_DEPTH + 1))  # parses, then the depth check
    assert f"nested more than {MAX_DEPTH} levels deep" in refusal(deep)
    deep.write_text('{"a": ' * (MAX_DEPTH - 1) + "1" + "}" * (MAX_DEPTH - 1))
    assert load_json(deep, error=CheckpointError, fix="") is not None
    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(b"\xff\xfe{")
    assert "not UTF-8" in refusal(garbage) or "not valid JSON" in refusal(garbage)
    garbage.write_text('{"a": 1,')
    assert "not valid JSON at line 1" in refusal(garbage)
    garbage.write_text("9" * 5000)
    assert "unreadable value" in refusal(garbage, expect=None)
    garbage.write_text("[1]")
    assert "expected a JSON object at the top, got list" in refusal(garbage)
    with pytest.raises(FileNotFoundError):
        read_bounded(tmp_path / "missing.json", error=CheckpointError, fix="")
    with pytest.raises(CheckpointError, match=r"^here: nested more than"):
        parse_json("[" * 5000 + "]" * 5000, where="here", error=CheckpointError, fix="f")


def test_what_stands_at_a_path_names_each_kind_that_is_not_a_regular_file(tmp_path):
    """The error messages that refuse a path name what is there instead of saying it does not exist."""
    import os

    (tmp_path / "file.jsonl").write_text("{}\n")
    (tmp_path / "folder.jsonl").mkdir()
    os.mkfifo(tmp_path / "fifo.jsonl")
    (tmp_path / "loop.jsonl").symlink_to(tmp_path / "loop.jsonl")
    (tmp_path / "broken.jsonl").symlink_to(tmp_path / "absent")
    (tmp_path / "to-file.jsonl").symlink_to(tmp_path / "file.jsonl")
    found = {name: what_is_at(tmp_path / name) for name in ("file.jsonl", "folder.jsonl", "fifo.jsonl", "loop.jsonl",
                                                             "broken.jsonl", "to-file.jsonl", "absent")}
    assert found == {"file.jsonl": "a regular file", "folder.jsonl": "a folder", "fifo.jsonl": "a FIFO",
                     "loop.jsonl": "a symlink loop", "broken.jsonl": "a broken symlink",
                     "to-file.jsonl": "a regular file", "absent": "nothing"}
    assert what_is_at("/dev/null") == "a device"


def test_atomic_writes_follow_no_link_at_the_path_or_at_the_temporary(tmp_path):
    """A link planted at the file replaced, or at its temporary's name: the link goes, its target is untouched."""
    import os

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    path = tmp_path / "loss.png"
    path.symlink_to(victim)
    atomic_write_bytes(path, b"png")
    assert not path.is_symlink() and path.read_bytes() == b"png" and victim.read_text() == "keep me"
    temporary = tmp_path / f".report.html.tmp-{os.getpid()}"
    temporary.symlink_to(victim)
    atomic_write_text(tmp_path / "report.html", "<html>")
    assert (tmp_path / "report.html").read_text() == "<html>" and victim.read_text() == "keep me"
    assert not temporary.exists() and not temporary.is_symlink()


# Lines and JSON from outside: a line-based file is read a bounded line at a time, and JSON from outside is refused
# with one reason (never a RecursionError or a string no tokenizer takes).

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
    ("[" * 100_000 + "]" * 100_000, "nested more than 64 levels deep"),
    ('{"a": ' + "9" * 5000 + "}", "unreadable value"),
    ('{"a": ["ok", {"b": "\\udc80"}]}', "lone surrogate"),
    ('{"a": 1,}', "not valid JSON at line 1 column 9 (Expecting property name enclosed in double quotes)"),
    (b'{"a": "\xff"}', "not UTF-8 text"),
])
def test_json_that_no_later_step_can_use_is_one_reason(text, reason):
    with pytest.raises(JSONInputError) as raised:
        decode_json(text)
    assert reason in str(raised.value) and "\n" not in str(raised.value)


def test_json_with_a_surrogate_pair_is_text():
    assert decode_json('{"a": "\\ud83d\\ude00", "n": 1000000000000}') == {"a": "\U0001F600", "n": 10**12}
