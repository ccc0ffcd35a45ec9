"""Stage ``prepare`` (stages/prepare.py) end to end on real data with the real SmolLM2 tokenizer."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from dflash.corpus.default_corpus import stdlib_root
from dflash.corpus.format import open_corpus
from dflash.errors import CorpusError
from stages.prepare import PrepareConfig as _PrepareConfig
from stages.prepare import register, run_prepare


def PrepareConfig(**values):  # noqa: N802
    """The tests below check the rows prepare writes, so every row stays in OUTPUT unless a test asks for the
    held-out split (tested on its own)."""
    return _PrepareConfig(**{"heldout_documents": 0, **values})

CHATS = [
    {"id": "fr-gen", "messages": [
        {"role": "system", "content": "Tu es un assistant précis."},
        {"role": "user", "content": "Qu'est-ce qu'un générateur ? 🐍"},
        {"role": "assistant", "content": "Une fonction avec `yield` : elle produit ses valeurs à la demande."},
        {"role": "user", "content": "Et « merci » en japonais ?"},
        {"role": "assistant", "content": "ありがとう (arigatō)."},
    ]},
    {"id": "de-sort", "messages": [
        {"role": "system", "content": "Antworte knapp."},
        {"role": "user", "content": "Wie sortiere ich eine Liste rückwärts?"},
        {"role": "assistant", "content": "Mit `sorted(xs, reverse=True)` oder `xs.sort(reverse=True)`."},
    ]},
    {"id": "no-system", "messages": [
        {"role": "user", "content": "2 + 2 = ?"},
        {"role": "assistant", "content": "4, naturellement — 四."},
        {"role": "user", "content": "Et 3 × 3 ?"},
        {"role": "assistant", "content": "9."},
    ]},
]
END_OF_TURN = "<|im_end|>"


@pytest.fixture(scope="module")
def cli():
    app = typer.Typer()
    register(app)

    @app.callback()
    def _root() -> None:  # keep `prepare` a named sub-command, as in stages/cli.py
        pass

    runner = CliRunner()

    def invoke(*args: str, every_row: bool = True):
        split = ["--heldout-documents", "0"] if every_row else []  # as PrepareConfig above
        return runner.invoke(app, ["prepare", *map(str, args), *split])

    return invoke


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def _replies(chat, last_only=False):
    replies = [m["content"] + END_OF_TURN for m in chat["messages"] if m["role"] == "assistant"]
    return replies[-1:] if last_only else replies


def _masked_runs(tokenizer, row):
    edges = np.diff(np.concatenate([[0], row.loss_mask.astype(np.int8), [0]]))
    return [tokenizer.decode(row.input_ids[a:b]) for a, b in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1), strict=True)]


def _nothing_written(parent, name):
    return not (parent / name).exists() and not [p for p in parent.iterdir() if p.name.startswith(f".{name}.")]


def test_chat_jsonl_masks_exactly_the_assistant_replies(tmp_path, cli, tokenizer):
    source = _write_jsonl(tmp_path / "chats.jsonl", CHATS)
    result = cli(source, "--output", tmp_path / "out", "--assistant-mask", "prefix-diff")
    assert result.exit_code == 0, result.output
    corpus = open_corpus(tmp_path / "out")
    assert len(corpus) == len(CHATS)
    for index, chat in enumerate(CHATS):
        row = corpus.row(index)
        assert row.sample_id == chat["id"]
        assert _masked_runs(tokenizer, row) == _replies(chat)
        assert row.input_ids.tolist() == list(
            tokenizer.apply_chat_template(chat["messages"], tokenize=True, return_dict=True)["input_ids"])
    metadata = corpus.metadata
    assert metadata["assistant_mask"] == "prefix-diff" and metadata["target_spec"] == "default"
    assert metadata["report"]["samples_kept"] == 3 and metadata["report"]["documents_by_kind"] == {"chat": 3}
    assert metadata["target"]["vocab_size"] == 49152 and metadata["fingerprint"] == corpus.fingerprint

    # The same chats from Parquet (messages as list<struct>), supervising the last reply only.
    pq.write_table(pa.table({"messages": [c["messages"] for c in CHATS]}), tmp_path / "chats.parquet")
    result = cli(tmp_path / "chats.parquet", "-o", tmp_path / "last", "--assistant-mask", "prefix-diff", "--last-turn-only")
    assert result.exit_code == 0, result.output
    last = open_corpus(tmp_path / "last")
    for index, chat in enumerate(CHATS):
        assert _masked_runs(tokenizer, last.row(index)) == _replies(chat, last_only=True)
        np.testing.assert_array_equal(last.row(index).input_ids, corpus.row(index).input_ids)


def test_template_without_generation_markers_fails_with_the_fix(tmp_path, cli):
    source = _write_jsonl(tmp_path / "chats.jsonl", CHATS)
    result = cli(source, "--output", tmp_path / "out")
    assert result.exit_code == 2
    assert "no {% generation %} markers" in result.output and "--assistant-mask prefix-diff" in result.output
    assert _nothing_written(tmp_path, "out")


def _saved_tokenized(tmp_path, tokenizer, edit=lambda rows: None):
    datasets = pytest.importorskip("datasets")
    rows = []
    for name in ("bisect.py", "heapq.py", "colorsys.py"):
        ids = tokenizer((stdlib_root() / name).read_text())["input_ids"][:400]
        rows.append({"input_ids": ids, "loss_mask": [0] * 100 + [1] * (len(ids) - 100), "sample_id": name})
    edit(rows)
    path = tmp_path / "tokenized"
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def _set(row, key, value):
    row[key] = value


@pytest.mark.parametrize(
    ("make_input", "message"),
    [
        (lambda tmp, tok: _write_jsonl(tmp / "c.jsonl", CHATS[:1] + [{"messages": [{"role": "robot", "content": "x"}]}]),
         r"c.jsonl line 2 message 0: role 'robot' is not one of"),
        (lambda tmp, tok: (tmp / "c.jsonl").write_text('{"text": "x"}\n{oops\n') and tmp / "c.jsonl",
         r"c.jsonl line 2: not valid JSON .*one JSON object per line"),
        # A line cut off mid-string, not the last line: the line break is not blamed as a control character.
        (lambda tmp, tok: (tmp / "c.jsonl").write_text('{"text": "x"}\n{"text": "cut of\n{"text": "x"}\n') and tmp / "c.jsonl",
         r"c.jsonl line 2: not valid JSON at line 1 column 10 \(Unterminated string starting at\)"),
        (lambda tmp, tok: _write_jsonl(tmp / "c.jsonl", [{"prompt": "x", "completion": "y"}]),
         r"c.jsonl line 1: no 'messages', 'conversations' or 'text' field"),
        (lambda tmp, tok: _write_jsonl(tmp / "c.jsonl", CHATS[:1] + [{"messages": []}]),
         r"c.jsonl line 2: 'messages' is an empty list; give at least one message, or leave the row out"),
        (lambda tmp, tok: _write_jsonl(tmp / "c.jsonl", [{"text": None}]),
         r"c.jsonl line 1: 'text' is null, expected a string"),
        (lambda tmp, tok: __import__("os").mkfifo(tmp / "c.jsonl") or tmp / "c.jsonl",  # not "does not exist"
         r"input '.*c.jsonl' is a FIFO; pass files, folders, globs or 'default'"),
        (lambda tmp, tok: _write_jsonl(tmp / "c.jsonl", [{"messages": CHATS[0]["messages"][:2]}]),
         r"no sample to write .*0 rows kept"),
        (lambda tmp, tok: _saved_tokenized(tmp, tok, lambda rows: rows[1]["input_ids"].__setitem__(3, 50000)),
         r"tokenized/data-00000-of-00001.arrow row 1 \(sample_id 'heapq.py'\): token id 50000 at position 3 is outside \[0, 49152\)"),
        (lambda tmp, tok: _saved_tokenized(tmp, tok, lambda rows: rows[2]["loss_mask"].pop()),
         r"row 2 \(sample_id 'colorsys.py'\): input_ids has 400 tokens but loss_mask has 399 entries"),
        (lambda tmp, tok: _saved_tokenized(tmp, tok, lambda rows: rows[0].update(input_ids=[], loss_mask=[])),
         r"row 0 \(sample_id 'bisect.py'\): empty input_ids"),
        (lambda tmp, tok: _saved_tokenized(tmp, tok, lambda rows: _set(rows[1], "loss_mask", [0] * 400)),
         r"row 1 \(sample_id 'heapq.py'\): no supervised token"),
        (lambda tmp, tok: _saved_tokenized(tmp, tok, lambda rows: [r.pop("loss_mask") for r in rows]),
         r"no column 'loss_mask'"),
        (lambda tmp, tok: _saved_tokenized(tmp, tok),
         r"\(sample_id 'bisect.py'\): 400 tokens > --max-length 300; choose --length-policy split\|truncate\|drop"),
    ],
    ids=["bad-role", "bad-json", "cut-json-line", "no-messages", "empty-messages", "null-text", "fifo", "zero-samples", "token-id", "length-mismatch", "empty",
         "no-supervised", "missing-column", "too-long"],
)
def test_bad_inputs_give_clear_errors_and_write_nothing(tmp_path, cli, tokenizer, make_input, message):
    source = make_input(tmp_path, tokenizer)
    result = cli(source, "--output", tmp_path / "out", "--assistant-mask", "prefix-diff", "--max-length", "300")
    assert result.exit_code == 2, result.output
    assert "error:" in result.output
    assert __import__("re").search(message, " ".join(result.output.split())), result.output
    assert _nothing_written(tmp_path, "out")


def test_tokenized_input_is_validated_and_rewritten(tmp_path, tokenizer):
    source = _saved_tokenized(tmp_path, tokenizer)
    output, report = run_prepare(PrepareConfig(inputs=[str(source)], output=tmp_path / "out"))
    rewritten, original = open_corpus(output), open_corpus(source)
    assert rewritten.fingerprint == original.fingerprint
    assert [r.sample_id for r in rewritten.rows(0, 3)] == ["bisect.py", "heapq.py", "colorsys.py"]
    assert report.documents_by_kind == {"tokens": 3} and report.samples_kept == 3


def test_text_folder_and_glob_one_document_per_file(tmp_path, tokenizer):
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    texts = {"a.txt": "Größe und Maß — plain prose.\n", "sub/b.py": (stdlib_root() / "bisect.py").read_text()}
    for name, text in texts.items():
        (folder / name).write_text(text, encoding="utf-8")
    (folder / "empty.txt").write_text("")
    (folder / "blob.bin").write_bytes(bytes(range(256)))
    (folder / ".hidden").write_text("never read")
    output, report = run_prepare(PrepareConfig(inputs=[str(folder)], output=tmp_path / "out"))
    corpus = open_corpus(output)
    assert [r.sample_id for r in corpus.rows(0, 9)] == ["docs:a.txt", "docs:sub/b.py"]
    for row, text in zip(corpus.rows(0, 2), texts.values(), strict=True):
        assert tokenizer.decode(row.input_ids) == text and row.loss_mask.all()
    assert dict(report.dropped) == {"empty": 1, "not UTF-8 text": 1}
    _, from_glob = run_prepare(PrepareConfig(inputs=[str(folder / "**" / "*.py")], output=tmp_path / "glob"))
    assert open_corpus(tmp_path / "glob").row(0).input_ids.tolist() == corpus.row(1).input_ids.tolist()


@pytest.mark.parametrize("policy", ["split", "truncate", "drop"])
def test_length_policies_on_text(tmp_path, tokenizer, policy):
    source = stdlib_root() / "heapq.py"
    full = np.asarray(tokenizer(source.read_text())["input_ids"], np.int32)
    max_length = 1000
    config = PrepareConfig(inputs=[str(source), str(stdlib_root() / "this.py")], output=tmp_path / "out",
                           max_length=max_length, length_policy=policy)
    if policy == "drop":
        output, report = run_prepare(config)
        assert dict(report.dropped) == {"longer than max_length": 1} and len(open_corpus(output)) == 1
        return
    output, report = run_prepare(config)
    corpus = open_corpus(output)
    heapq_rows = [r for r in corpus.rows(0, len(corpus)) if "heapq.py" in r.sample_id]
    assert max(corpus.lengths) <= max_length
    if policy == "split":
        assert report.split_documents == 1 and report.split_chunks == len(heapq_rows) == -(-len(full) // max_length)
        assert [r.sample_id.rsplit("#", 1)[1] for r in heapq_rows] == [str(i) for i in range(len(heapq_rows))]
        np.testing.assert_array_equal(np.concatenate([r.input_ids for r in heapq_rows]), full)
    else:
        assert report.truncated == 1 and len(heapq_rows) == 1
        np.testing.assert_array_equal(heapq_rows[0].input_ids, full[:max_length])


def test_default_corpus_is_stdlib_split_and_seeded(tmp_path, cli):
    result = cli("--output", tmp_path / "a", "--max-tokens", "6000", "--max-length", "512", "--seed", "3")
    assert result.exit_code == 0, result.output
    corpus = open_corpus(tmp_path / "a")
    metadata = corpus.metadata
    assert metadata["length_policy"] == "split" and metadata["default_corpus"]["name"] == "python-stdlib"
    assert metadata["inputs"] == ["default"] and metadata["max_tokens"] == 6000
    assert 6000 <= corpus.num_tokens < 6000 + 512 and max(corpus.lengths) <= 512
    assert all(corpus.sample_id(i).startswith("stdlib:") for i in range(len(corpus)))
    assert metadata["report"]["documents_not_read"] > 0 and metadata["report"]["limit_reached"] == "max_tokens"
    found, skipped = sum(metadata["report"]["documents_by_kind"].values()), metadata["report"]["documents_not_read"]
    lines = [" ".join(line.strip("│ ").split()) for line in result.output.splitlines()]
    assert f"documents read │ {found - skipped:,}" in lines
    assert f"documents skipped: token limit (--max-tokens) reached │ {skipped:,}" in lines
    assert all(corpus.row(i).loss_mask.all() for i in range(len(corpus)))
    again = run_prepare(PrepareConfig(output=tmp_path / "b", max_tokens=6000, max_length=512, seed=3))[0]
    other = run_prepare(PrepareConfig(output=tmp_path / "c", max_tokens=6000, max_length=512, seed=4))[0]
    assert open_corpus(again).fingerprint == corpus.fingerprint != open_corpus(other).fingerprint
    # An existing output is refused unless --overwrite.
    assert cli("--output", tmp_path / "a", "--max-samples", "2").exit_code == 2
    result = cli("--output", tmp_path / "a", "--max-samples", "2", "--overwrite")
    assert result.exit_code == 0 and "documents skipped: sample limit (--max-samples) reached" in result.output
    assert len(open_corpus(tmp_path / "a")) == 2


def test_tokenized_labels_become_the_loss_mask(tmp_path, tokenizer):
    rows = []
    for name in ("bisect.py", "heapq.py", "colorsys.py"):
        ids = tokenizer((stdlib_root() / name).read_text())["input_ids"][:300]
        rows.append((name, ids, [-100] * 50 + ids[50:]))  # transformers-style: -100 = not supervised
    table = pa.table({"input_ids": [r[1] for r in rows], "labels": [r[2] for r in rows], "sample_id": [r[0] for r in rows]})
    pq.write_table(table, tmp_path / "sft.parquet", row_group_size=1)  # several chunks per column
    output, report = run_prepare(PrepareConfig(inputs=[str(tmp_path / "sft.parquet")], output=tmp_path / "out"))
    corpus = open_corpus(output)
    for index, (name, ids, labels) in enumerate(rows):
        row = corpus.row(index)
        assert row.sample_id == name and row.input_ids.tolist() == ids
        assert row.loss_mask.tolist() == [int(label != -100) for label in labels]
    # open_corpus alone keeps to the contract: labels are not a loss_mask.
    with pytest.raises(CorpusError, match="no column 'loss_mask'.*'labels' column, -100 = not supervised"):
        open_corpus(tmp_path / "sft.parquet")


def test_tokenized_labels_rows_are_checked_where_they_are(tmp_path, tokenizer):
    ids = tokenizer((stdlib_root() / "bisect.py").read_text())["input_ids"][:200]
    labels = [ids, [-100] * len(ids), ids]  # row 1 supervises nothing
    table = pa.table({"input_ids": [ids] * 3, "labels": labels})
    pq.write_table(table, tmp_path / "sft.parquet", row_group_size=1)
    with pytest.raises(CorpusError, match=r"sft.parquet row 1 .*no supervised token"):
        run_prepare(PrepareConfig(inputs=[str(tmp_path / "sft.parquet")], output=tmp_path / "out"))
    assert _nothing_written(tmp_path, "out")


def _zarr_cache(tmp):
    import zarr

    root = zarr.create_group(store=str(tmp / "cache"), zarr_format=3, attributes={"dflash_cache": {}})
    root.create_group("shards/000000")
    (tmp / "cache" / "commits").mkdir()
    (tmp / "cache" / "commits" / "shard-000000.json").write_text('{"shard": 0}')
    return tmp / "cache"


def _run_folder(tmp):
    step = tmp / "run" / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (tmp / "run" / "run.json").write_text('{"config": {}}')
    (tmp / "run" / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    (step / "trainer_state.json").write_text("{}")
    (tmp / "run" / "latest").write_text("step_00000002")
    return tmp / "run"


def _prepared_corpus(tmp, name="c1"):
    (tmp / f"{name}.txt").write_text("def f(x):\n    return x + 1\n")
    return run_prepare(PrepareConfig(inputs=[str(tmp / f"{name}.txt")], output=tmp / name))[0]


def _generate_output(tmp):
    """A finished generate output's layout around a real corpus part: plan, part record, part, corpus.json and the
    held-out prompts."""
    folder = _prepared_corpus(tmp, "gen")
    (folder / "corpus.arrow").rename(folder / "part-000000.arrow")
    (folder / "generate.json").write_text('{"settings": {}, "parts": [[0, 1]]}')
    (folder / "parts").mkdir()
    (folder / "parts" / "part-000000.json").write_text('{"part_id": 0, "num_rows": 1}')
    (folder / "heldout_prompts.jsonl").write_text('{"id": "h0", "prompt": "a held-out question"}\n')
    return folder


@pytest.mark.parametrize(
    "make_input, message",
    [
        (_generate_output, r"is a generate output \(the target's replies, already a tokenized corpus\): pass the folder "
                           r"to `extract --corpus`, and its heldout_prompts.jsonl to `evaluate --prompts`"),
        (lambda tmp: _generate_output(tmp) / "heldout_prompts.jsonl",
         r"is generate's held-out evaluation prompts: pass them to `evaluate --prompts`"),
        (lambda tmp: _generate_output(tmp) / "parts" / "part-000000.json", r"is a generate output .*\(it lies inside .*gen\)"),
        (lambda tmp: _generate_output(tmp) / "part-000000.arrow", r"is a generate output .*\(it lies inside .*gen\)"),
        (lambda tmp: _generate_output(tmp).parent, r"holds a generate output \(the target's replies, already a tokenized "
                                                   r"corpus\) at .*gen; pass a folder of text files only"),
        (lambda tmp: _prepared_corpus(tmp) / "corpus.json", r"is a prepared corpus \(prepare's output\): pass the corpus "
                                                            r"folder itself .*\(it lies inside .*c1\)"),
        (lambda tmp: _prepared_corpus(tmp).parent, r"holds a prepared corpus \(prepare's output\) at .*c1; pass a folder"),
        (lambda tmp: str(_prepared_corpus(tmp)) + "/*", r"is a prepared corpus .*\(it lies inside .*c1\)"),
        (_zarr_cache, r"is a Zarr store \(extract's hidden-state cache\): pass it to `train --cache`"),
        (lambda tmp: _zarr_cache(tmp) / "commits" / "shard-000000.json", r"is a Zarr store .*\(it lies inside .*cache\)"),
        (lambda tmp: _zarr_cache(tmp) / "shards", r"is a Zarr store .*\(it lies inside .*cache\)"),
        (_run_folder, r"is a training run folder \(train's output\)"),
        (lambda tmp: _run_folder(tmp) / "checkpoints" / "step_00000002", r"is a training checkpoint"),
        (lambda tmp: _run_folder(tmp).parent, r"holds a training checkpoint \(train's output\) at .*run/checkpoints/step_00000002; pass a folder of text"),
        (lambda tmp: (tmp / "export").mkdir() or (tmp / "export" / "dflash_export.json").write_text("{}") and tmp / "export",
         r"is a drafter export \(export's output\)"),
        (lambda tmp: (tmp / "blob.bin").write_bytes(b"text\0\x01\x02" * 10) and tmp / "blob.bin",
         r"blob.bin holds NUL bytes: binary data, not text"),
        (lambda tmp: (tmp / "latin1.txt").write_bytes("café crème\n".encode("latin-1")) and tmp / "latin1.txt",
         r"latin1.txt is not UTF-8 \(byte 3 is b'\\xe9'\)"),
        (lambda tmp: (tmp / "c.jsonl").write_bytes('{"text": "café"}\n'.encode("latin-1")) and tmp / "c.jsonl",
         r"c.jsonl: not UTF-8 text \(it holds the byte b'\\xe9'\); a JSON/JSONL input must be UTF-8"),
    ],
    ids=["generate-output", "heldout-prompts", "generate-part-record", "generate-part", "folder-holding-a-generate-output",
         "corpus-json", "folder-holding-a-corpus", "glob-into-a-corpus", "cache", "cache-commit-record", "cache-subfolder", "run", "checkpoint", "folder-holding-a-run", "export",
         "nul-bytes", "not-utf8", "not-utf8-jsonl"],
)
def test_outputs_of_this_project_and_binary_files_are_refused(tmp_path, cli, make_input, message):
    source = make_input(tmp_path)
    result = cli(source, "--output", tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: input"), result.output
    assert __import__("re").search(message, " ".join(result.output.split())), result.output
    assert _nothing_written(tmp_path, "out")


def test_binary_files_inside_a_folder_are_dropped_and_counted(tmp_path):
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.txt").write_text("def f(x):\n    return x + 1\n")
    (folder / "b.bin").write_bytes(b"\0\1\2" * 100)
    _, report = run_prepare(PrepareConfig(inputs=[str(folder)], output=tmp_path / "out"))
    assert report.samples_kept == 1 and report.dropped["not UTF-8 text"] == 1


def test_a_prepared_corpus_is_accepted_as_tokenized_data(tmp_path):
    (tmp_path / "a.txt").write_text("def f(x):\n    return x + 1\n")
    first, _ = run_prepare(PrepareConfig(inputs=[str(tmp_path / "a.txt")], output=tmp_path / "c1"))
    second, report = run_prepare(PrepareConfig(inputs=[str(first)], output=tmp_path / "c2"))
    assert report.documents_by_kind == {"tokens": 1}
    assert open_corpus(second).fingerprint == open_corpus(first).fingerprint
    _, from_file = run_prepare(PrepareConfig(inputs=[str(first / "corpus.arrow")], output=tmp_path / "c3"))
    assert from_file.documents_by_kind == {"tokens": 1}


def test_a_corpus_json_of_the_users_own_is_text(tmp_path):
    """Only a dflash corpus sidecar marks a corpus: a user's file that happens to be named corpus.json is text."""
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "corpus.json").write_text('{"title": "my notes"}\n')
    _, report = run_prepare(PrepareConfig(inputs=[str(folder)], output=tmp_path / "out"))
    assert report.documents_by_kind == {"text": 1} and report.samples_kept == 1


def test_every_row_of_one_file_is_one_document_and_chats_name_theirs(tmp_path):
    """The corpus document_id: a split text file's chunks share the file's identity; a chat row takes its
    document_id/document field, else its own id; re-preparing the corpus keeps them."""
    files = [stdlib_root() / "heapq.py", stdlib_root() / "bisect.py"]
    output, report = run_prepare(PrepareConfig(inputs=[str(f) for f in files], output=tmp_path / "text",
                                               max_length=256, length_policy="split"))
    corpus = open_corpus(output)
    assert report.split_documents == 2 and len(corpus) > 4
    by_file: dict[str, set[int]] = {}
    for index in range(len(corpus)):
        file = corpus.sample_id(index).split("#", 1)[0]
        assert corpus.document_id(index) == file  # "lib:heapq.py": the file, not the chunk
        by_file.setdefault(file, set()).add(int(corpus.document_keys[index]))
    assert sorted(by_file) == [f"{files[0].parent.name}:bisect.py", f"{files[0].parent.name}:heapq.py"]
    assert all(len(keys) == 1 for keys in by_file.values()) and len(set.union(*by_file.values())) == 2

    chats = [dict(CHATS[0], document_id="thread-1"), dict(CHATS[1], document=42), CHATS[2]]
    chat_output, _ = run_prepare(PrepareConfig(inputs=[str(_write_jsonl(tmp_path / "c.jsonl", chats))],
                                               output=tmp_path / "chat", assistant_mask="prefix-diff"))
    chat_corpus = open_corpus(chat_output)
    assert [chat_corpus.document_id(i) for i in range(3)] == ["thread-1", "42", "no-system"]
    again = open_corpus(run_prepare(PrepareConfig(inputs=[str(chat_output)], output=tmp_path / "again"))[0])
    assert again.document_keys.tolist() == chat_corpus.document_keys.tolist()

    with pytest.raises(CorpusError, match=r"c2.jsonl line 1: 'document' is list \['a'\], expected a string or an "
                                          r"integer naming the row's source document"):
        run_prepare(PrepareConfig(inputs=[str(_write_jsonl(tmp_path / "c2.jsonl", [dict(CHATS[0], document=["a"])]))],
                                  output=tmp_path / "bad", assistant_mask="prefix-diff"))


@pytest.mark.parametrize("line, message", [
    (b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested more than 64 levels deep"),
    (b'{"text": "a", "id": ' + b"9" * 5000 + b"}", "unreadable value"),
    (b'{"text": "\\ud800"}', "lone surrogate"),
    (b'{"text": "' + b"x" * (4 * 2**20 + 10) + b'"}', "is longer than 4,194,304 bytes"),
])
def test_hostile_jsonl_lines_are_one_error_naming_the_line(tmp_path, cli, line, message):
    """Chat/text JSONL is read a bounded line at a time and parsed by ``dflash.io.files.decode_json``: deep nesting,
    a number Python refuses, a lone surrogate and an endless line are each one error line (exit 2), nothing written."""
    source = tmp_path / "c.jsonl"
    source.write_bytes(b'{"text": "def f():\\n    return 1\\n"}\n' + line + b"\n")
    result = cli(source, "--output", tmp_path / "out", "--assistant-mask", "prefix-diff")
    assert result.exit_code == 2, result.output
    assert "c.jsonl line 2" in result.output and message in " ".join(result.output.split()), result.output
    assert _nothing_written(tmp_path, "out")


def test_an_existing_output_and_a_missing_input_are_refused_before_the_target_is_read(tmp_path, monkeypatch, capsys):
    """The output and the input files are checked first: with a target folder holding only a config.json (no
    tokenizer, no weights: reading it would fail), the refusal names the output or the input, exit 2."""
    from cli_helpers import main_in_process

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    chat = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                                {"role": "assistant", "content": "hello"}]}])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    code, err = main_in_process(monkeypatch, capsys, "prepare", str(chat), "-o", str(tmp_path / "out"),
                                "--target", str(target))
    assert code == 2 and err.count("error:") == 1 and f"output {tmp_path / 'out'} already exists" in err, err
    code, err = main_in_process(monkeypatch, capsys, "prepare", str(tmp_path / "missing.jsonl"),
                                "-o", str(tmp_path / "new"), "--target", str(target))
    assert code == 2 and err.count("error:") == 1 and "missing.jsonl" in err and "Traceback" not in err, err
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine" and not (tmp_path / "new").exists()


def test_prepare_holds_whole_documents_out_seeded_and_refuses_one_document(tmp_path, cli):
    """By default prepare holds out 5% of the documents (at least one) in OUTPUT/heldout, chosen by the seed: a
    conversation's rows and a document_id's rows stay on one side; the training corpus records the split, and one
    document is refused (exit 2, one error line, nothing written)."""
    from dflash.corpus.split import heldout_corpus

    chats = [dict(CHATS[0], document_id="thread-1"), dict(CHATS[1], document_id="thread-1"), CHATS[2],
             dict(CHATS[1], id="de-sort-2"), dict(CHATS[2], id="no-system-2")]
    source = _write_jsonl(tmp_path / "chats.jsonl", chats)
    sides = {}
    for name, extra in (("a", ()), ("b", ()), ("two", ("--heldout-documents", "2"))):
        result = cli(source, "-o", tmp_path / name, "--assistant-mask", "prefix-diff", *extra, every_row=False)
        assert result.exit_code == 0, result.output
        train = open_corpus(tmp_path / name)
        held = heldout_corpus(train)
        assert held is not None and held.path == (tmp_path / name / "heldout").resolve()
        train_docs = {train.document_id(i) for i in range(len(train))}
        held_docs = {held.document_id(i) for i in range(len(held))}
        assert not train_docs & held_docs and train_docs | held_docs == {"thread-1", "no-system", "de-sort-2",
                                                                         "no-system-2"}
        assert len(train) + len(held) == 5
        assert f"held out {len(held_docs)} documents" in " ".join(result.output.split())
        sides[name] = sorted(held_docs)
    assert sides["a"] == sides["b"] and len(sides["a"]) == 1 and len(sides["two"]) == 2
    # no hold-out: every row stays in OUTPUT
    result = cli(source, "-o", tmp_path / "all", "--assistant-mask", "prefix-diff", "--heldout-documents", "0",
                 every_row=False)
    assert result.exit_code == 0 and len(open_corpus(tmp_path / "all")) == 5
    assert not (tmp_path / "all" / "heldout").exists() and heldout_corpus(open_corpus(tmp_path / "all")) is None

    one = _write_jsonl(tmp_path / "one.jsonl", CHATS[:1])
    result = cli(one, "-o", tmp_path / "one", "--assistant-mask", "prefix-diff", every_row=False)
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert message.startswith("error: ") and "has only 1 document" in message and "--heldout-documents" in message
    assert _nothing_written(tmp_path, "one")
