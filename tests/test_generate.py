"""generate: the target's own responses as a contract-1 corpus.

Every supervised token is the target's greedy continuation of the tokens before it, computed again here with
transformers' own ``generate``; prompt and template tokens are unsupervised; multi-turn chats are regenerated on
the model's own history; bad lines, too-long prompts and templates without a generation prompt are counted or
refused by name; a SIGKILLed run rerun with the same command loses and duplicates no prompt; the openai engine
path writes the same corpus layout.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import COUNT, DURATION
from rich.console import Console

from dflash.corpus.format import open_corpus
from dflash.errors import ConfigError, CorpusError
from dflash.generation.engine import SamplingSettings
from dflash.generation.parts import PartSpec, committed_parts, generate_part
from dflash.generation.prompts import ConversationBuilder, check_generation_prompt, read_prompt_file
from dflash.generation.transformers_engine import TransformersEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [
    {"prompt": "Write a Python function that adds two numbers."},
    {"text": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"},
    {"messages": [{"role": "user", "content": "Hi, who are you?"}, {"role": "assistant", "content": "ORIGINAL-1"},
                  {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "ORIGINAL-2"}]},
]


def _write_jsonl(path: Path, rows: list) -> Path:
    with open(path, "wb") as handle:
        for row in rows:
            handle.write(row if isinstance(row, bytes) else (json.dumps(row) + "\n").encode())
    return path


def _spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for index, value in enumerate([*mask, 0]):
        if value and start is None:
            start = index
        elif not value and start is not None:
            spans.append((start, index))
            start = None
    return spans


def _part(tmp_path, tokenizer, records, **settings):
    return PartSpec(part_id=0, first_prompt=0, records=[r.to_dict() for r in records], output=str(tmp_path),
                    settings=SamplingSettings(**{"max_new_tokens": 6, **settings}).to_dict(), max_length=2048)


@pytest.fixture(scope="module")
def generated(tmp_path_factory, target):
    folder = tmp_path_factory.mktemp("generated")
    records, _ = read_prompt_file(_write_jsonl(folder / "prompts.jsonl", PROMPTS))
    engine = TransformersEngine(target.model, target.tokenizer, batch_size=2)
    record = generate_part(engine, target.tokenizer, _part(folder, target.tokenizer, records))
    return folder, records, record


def test_every_supervised_token_is_the_targets_greedy_continuation(generated, target):
    folder, _, record = generated
    corpus = open_corpus(folder / "part-000000.arrow")
    assert len(corpus) == 3 and record["num_rows"] == 3
    checked = 0
    for index in range(len(corpus)):
        row = corpus.row(index)
        ids, mask = [int(t) for t in row.input_ids], [int(m) for m in row.loss_mask]
        for start, stop in _spans(mask):
            expected = target.model.generate(torch.tensor([ids[:start]]), max_new_tokens=stop - start,
                                             do_sample=False, pad_token_id=target.tokenizer.eos_token_id)
            assert expected[0, start:].tolist() == ids[start:stop], (corpus.sample_id(index), start)
            checked += 1
    assert checked == 4  # one reply per single prompt, two for the two-turn chat


def test_prompt_and_template_tokens_are_unsupervised(generated, target):
    folder, records, _ = generated
    corpus = open_corpus(folder / "part-000000.arrow")
    tokenizer = target.tokenizer
    chat = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]["prompt"]}],
                                         add_generation_prompt=True, tokenize=False)
    first = corpus.row(0)
    prompt_ids = tokenizer(chat, add_special_tokens=False)["input_ids"]
    assert list(first.input_ids[: len(prompt_ids)]) == prompt_ids
    assert not np.any(first.loss_mask[: len(prompt_ids)]) and np.all(first.loss_mask[len(prompt_ids):])
    raw = corpus.row(1)
    raw_ids = tokenizer(PROMPTS[1]["text"])["input_ids"]
    assert list(raw.input_ids[: len(raw_ids)]) == raw_ids and not np.any(raw.loss_mask[: len(raw_ids)])
    text = tokenizer.decode(corpus.row(2).input_ids)
    assert "ORIGINAL" not in text and text.count("<|im_start|>assistant") == 2  # original replies dropped
    # The second turn's prompt holds the model's own first reply, then the template's next user turn.
    spans = _spans([int(m) for m in corpus.row(2).loss_mask])
    between = tokenizer.decode(corpus.row(2).input_ids[spans[0][1]: spans[1][0]])
    assert "What is 2+2?" in between and between.rstrip().endswith("assistant")


def test_json_no_step_can_use_is_a_bad_line_and_a_line_over_the_limit_an_error(tmp_path):
    """Nesting 100,000 deep, a 5,000-digit integer and a lone surrogate are lines left out as bad_json (no
    RecursionError, no crash later in the tokenizer); a line longer than max_prompt_bytes is refused naming the
    file, the line, the limit and the option that raises it, and so is a .txt line or a .parquet row's text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    path = _write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "fine"}, deep + b"\n", b'{"prompt": "x", "n": ' + b"9" * 5000 + b"}\n",
        b'{"prompt": "\\ud800 lone"}\n', {"prompt": "fine again"},
    ])
    records, drops = read_prompt_file(path)
    assert [r.prompt_id for r in records] == ["p.jsonl line 1", "p.jsonl line 5"]
    assert drops.examples == {"bad_json": ["p.jsonl line 2", "p.jsonl line 3", "p.jsonl line 4"]}
    assert len(read_prompt_file(path, max_prompt_bytes=len(deep))[0]) == 2  # a line of exactly the limit is read
    with pytest.raises(ConfigError) as raised:
        read_prompt_file(path, max_prompt_bytes=len(deep) - 1)
    assert str(raised.value) == (f"prompts: {path} line 2 is longer than {len(deep) - 1:,} bytes (the limit per "
                                 "line); shorten or split it, or raise the limit with --max-prompt-bytes")
    txt = tmp_path / "p.txt"
    txt.write_bytes(b"short\r\n" + b"y" * 101 + b"\r\n")
    assert [r.messages[0]["content"] for r in read_prompt_file(txt, max_prompt_bytes=101)[0]] == ["short", "y" * 101]
    with pytest.raises(ConfigError, match=r"p.txt line 2 is longer than 100 bytes"):
        read_prompt_file(txt, max_prompt_bytes=100)
    table = tmp_path / "p.parquet"
    pq.write_table(pa.table({"messages": [[{"role": "user", "content": "hi"}],
                                          [{"role": "user", "content": "z" * 300}]]}), table)
    with pytest.raises(ConfigError, match=r"p.parquet row 1 holds 304 bytes of text, more than 200 .*--max-prompt-bytes"):
        read_prompt_file(table, max_prompt_bytes=200)


def test_last_turn_mode_keeps_the_history_unsupervised(tmp_path, target):
    records, _ = read_prompt_file(_write_jsonl(tmp_path / "p.jsonl", PROMPTS[2:]), turns="last")
    builder = ConversationBuilder(records[0], target.tokenizer, {})
    assert builder.num_turns == 1
    prompt = builder.prompt_ids()
    text = target.tokenizer.decode(prompt)
    assert "ORIGINAL-1" in text and "ORIGINAL-2" not in text and text.endswith("<|im_start|>assistant\n")


def test_a_turns_prompts_tokenized_together_equal_each_tokenized_alone(tmp_path, target):
    """``prompt_ids_of`` (one tokenizer call per kind for a part's turn) gives each builder the ids of its own text
    tokenized alone, turn after turn: raw completions with the tokenizer's special tokens, chat template text
    without, a conversation at its second turn beside finished ones (None)."""
    from dflash.generation.prompts import prompt_ids_of

    def tokenized_alone(builder):
        text = builder.next_text()
        if text is None:
            return None
        ids = target.tokenizer(text[0]) if text[1] else target.tokenizer(text[0], add_special_tokens=False)
        return builder.input_ids + list(ids["input_ids"])

    records, _ = read_prompt_file(_write_jsonl(tmp_path / "p.jsonl", PROMPTS))
    alone = [ConversationBuilder(record, target.tokenizer, {}) for record in records]
    together = [ConversationBuilder(record, target.tokenizer, {}) for record in records]
    assert any(r.messages is None for r in records) and any(r.messages is not None for r in records)
    for turn in range(3):
        expected = [tokenized_alone(builder) for builder in alone]
        assert [builder.prompt_ids() for builder in alone] == expected
        assert prompt_ids_of(together) == expected
        assert (turn == 0 and None not in expected) or (turn == 1 and expected.count(None) == 2) or turn == 2
        for builders in (alone, together):
            for builder, prompt in zip(builders, expected, strict=True):
                if prompt is not None:
                    builder.add_reply(prompt, [42, 43], finished=False)
    assert prompt_ids_of(together) == [None] * len(records)


def test_bad_lines_are_counted_with_their_reason(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "fine"}, {"prompt": "   "}, b"not json\n", {"foo": 1}, b'{"prompt": "caf\xe9"}\n', b"\n",
        {"messages": [{"role": "assistant", "content": "only a reply"}]},
        {"conversations": [{"from": "human", "value": "What's 1+1?"}, {"from": "gpt", "value": "2"}]},
        {"messages": [{"role": "user"}]},
    ])
    records, drops = read_prompt_file(path)
    assert [r.prompt_id for r in records] == ["p.jsonl line 1", "p.jsonl line 8"]
    assert records[1].messages == [{"role": "user", "content": "What's 1+1?"}, {"role": "assistant", "content": None}]
    assert dict(drops.counts) == {"empty": 2, "bad_json": 1, "no_prompt": 1, "not_utf8": 1, "bad_messages": 1}
    assert drops.examples["not_utf8"] == ["p.jsonl line 5"]
    bad = _write_jsonl(tmp_path / "bad.jsonl", [b"\xff\xfe\n", {"prompt": ""}])
    with pytest.raises(ConfigError, match=r"holds no usable prompt \(left out: empty: 1 .*not_utf8: 1"):
        read_prompt_file(bad)
    with pytest.raises(ConfigError, match="is a folder; pass a file"):
        read_prompt_file(tmp_path)
    txt = tmp_path / "p.txt"
    txt.write_text("first prompt\n\nsecond prompt\n")
    assert [r.messages[0]["content"] for r in read_prompt_file(txt)[0]] == ["first prompt", "second prompt"]


def test_prompts_longer_than_max_length_are_dropped_and_counted(tmp_path, target):
    records, _ = read_prompt_file(_write_jsonl(tmp_path / "p.jsonl", [{"text": "x = 1\n" * 40}, {"text": "y = 2\n"}]))
    engine = TransformersEngine(target.model, target.tokenizer, batch_size=2)
    spec = _part(tmp_path, target.tokenizer, records)
    spec.max_length = 40
    record = generate_part(engine, target.tokenizer, spec)
    assert record["num_rows"] == 1 and record["dropped"]["counts"] == {"too_long": 1}
    assert record["dropped"]["examples"]["too_long"] == ["p.jsonl line 1"]
    row = open_corpus(tmp_path / "part-000000.arrow").row(0)
    assert len(row.input_ids) <= 40


def test_a_template_without_a_generation_prompt_is_refused(target):
    import copy

    tokenizer = copy.copy(target.tokenizer)
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ConfigError, match="writes no generation prompt"):
        check_generation_prompt(tokenizer, {}, where="target X")
    tokenizer.chat_template = None
    with pytest.raises(ConfigError, match="has no chat template"):
        check_generation_prompt(tokenizer, {}, where="target X")


def _generate_args(prompts: Path, output: Path, *extra: str) -> list[str]:
    return ["generate", str(prompts), "--output", str(output), "--target-processes", "1", "--part-size", "1",
            "--max-new-tokens", "4", *extra]


def _generate_cli(prompts: Path, output: Path, *extra: str):
    """``dflash-stages generate`` running as its own process, in its own session (forked from one that imported torch
    and transformers once: cli_helpers.forked_cli_start)."""
    from cli_helpers import forked_cli_start

    return forked_cli_start(*_generate_args(prompts, output, *extra), cwd=os.getcwd(), new_session=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_sigkill_then_rerun_loses_and_duplicates_no_prompt(tmp_path, monkeypatch, capsys):
    """The killed run is a real ``dflash-stages generate`` process (its process group SIGKILLed); the rerun and the
    refused run are the same command through the same entry point, in this process (no second interpreter start)."""
    from cli_helpers import main_in_process

    prompts = _write_jsonl(tmp_path / "p.jsonl", [{"text": f"def function_{i}(x):\n    return x"} for i in range(5)])
    output = tmp_path / "out"
    process = _generate_cli(prompts, output)
    deadline = time.monotonic() + 600
    while len(committed_parts(output)) < 2 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)  # the driver and its Dask cluster, as a node failure would
    process.wait(timeout=60)
    before = {part: (output / f"part-{part:06d}.arrow").stat().st_ino for part in committed_parts(output)}
    assert 2 <= len(before) < 5, before
    with pytest.raises(CorpusError, match="unfinished generate output"):
        open_corpus(output)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as _generate_cli's environment, for the rerun's Dask worker
    code, stderr = main_in_process(monkeypatch, capsys, *_generate_args(prompts, output))
    assert code == 0, stderr[-3000:]
    assert re.search(r"generate time: tokenizer [\d.]+ s, prompts [\d.]+ s, cluster start [\d.]+ s, target load [\d.]+ s, parts", stderr)
    corpus = open_corpus(output)
    assert [corpus.sample_id(i) for i in range(len(corpus))] == [f"p.jsonl line {i + 1}" for i in range(5)]
    for part, inode in before.items():  # committed parts were kept, not redone
        assert (output / f"part-{part:06d}.arrow").stat().st_ino == inode
    generation = corpus.metadata["generation"]
    assert generation["temperature"] == 0.0 and generation["max_new_tokens"] == 4 and generation["seed"] == 0
    assert generation["engine"]["engine"] == "transformers" and generation["target"]["num_hidden_layers"] == 30
    assert generation["generated_tokens"] == int(sum(corpus.row(i).loss_mask.sum() for i in range(len(corpus))))
    # The same command with other settings is refused, naming what differs.
    code, stderr = main_in_process(monkeypatch, capsys, *_generate_args(prompts, output, "--temperature", "0.7"))
    assert code == 2 and "differs in: temperature" in stderr


def test_openai_engine_through_the_stage(tmp_path, target):
    from test_generation_openai import FakeServer

    from stages.generate import GenerateConfig, run_generate

    server = FakeServer(target.tokenizer, kind="vllm")
    try:
        prompts = _write_jsonl(tmp_path / "p.jsonl", PROMPTS[:2])
        config = GenerateConfig(prompts=str(prompts), output=str(tmp_path / "out"), engine="openai",
                                endpoints=[server.url], max_new_tokens=8)
        summary = run_generate(config)
        rerun = io.StringIO()
        run_generate(config, console=Console(file=rerun, width=300))  # every part committed: nothing to answer
    finally:
        server.stop()
    assert "generate time: tokenizer" in rerun.getvalue()
    assert "every part was committed before (no engine run)" in rerun.getvalue()
    corpus = open_corpus(tmp_path / "out")
    assert summary["rows"] == 2 and corpus.metadata["generation"]["token_sources"] == {"engine": 2}
    # Where the wall time went: the named phases add up to it; the engine's time is part of the parts' time.
    assert set(summary["timings"]) == {"tokenizer", "prompts", "parts", "other"}
    assert sum(summary["timings"].values()) == pytest.approx(summary["seconds"], abs=0.3)
    assert 0 < summary["engine_seconds"] <= summary["part_seconds"] <= summary["timings"]["parts"] + 0.1
    reply = [int(t) for t, m in zip(corpus.row(0).input_ids, corpus.row(0).loss_mask, strict=True) if m]
    assert reply[: len(server.reply_ids)] == server.reply_ids
    assert corpus.metadata["generation"]["engine"]["endpoints"] == [server.url]



def test_a_lying_server_stops_the_run_with_one_error_and_the_committed_parts_stay(tmp_path, target, monkeypatch,
                                                                                  capsys):
    """A server whose reply for the third prompt cannot be the target's (ids that decode to other text than it
    returned): exit 2, one error line naming the endpoint, the prompt and the problem; parts 0 and 1 stay
    committed and a rerun against an honest server keeps them and finishes. A hung server fails within
    --request-timeout-s and --max-retries."""
    from cli_helpers import main_in_process
    from test_generation_openai import FakeServer

    def lie(body, choice):
        if body["seed"] == 2:  # request 2: the prompt of line 3
            choice.update(token_ids=[2, 2, 2, 2], text="completely different text")

    prompts = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"Say hello {i}"} for i in range(4)])
    output = tmp_path / "out"
    server = FakeServer(target.tokenizer, kind="vllm", lie=lie)
    try:
        openai = ["--engine", "openai", "--endpoint", server.url, "--part-size", "1", "--max-new-tokens", "4"]
        args = ["generate", str(prompts), "--output", str(output), *openai]
        code, stderr = main_in_process(monkeypatch, capsys, *args)
        assert code == 2 and stderr.count("error:") == 1 and "Traceback" not in stderr
        error = stderr[stderr.index("error:"):]
        assert f"endpoint {server.url}: completion of request 2 (p.jsonl line 3, turn 1)" in error
        assert "decode to '' but its text is 'completely different text'" in error
        assert sorted(committed_parts(output)) == [0, 1]
        inodes = {part: (output / f"part-{part:06d}.arrow").stat().st_ino for part in (0, 1)}
        server.lie = None
        code, stderr = main_in_process(monkeypatch, capsys, *args)
        assert code == 0, stderr[-2000:]
        assert {part: (output / f"part-{part:06d}.arrow").stat().st_ino for part in (0, 1)} == inodes
        assert len(open_corpus(output)) == 4
        server.delay_s = 5.0
        code, stderr = main_in_process(monkeypatch, capsys, "generate", str(prompts), "--output", str(tmp_path / "hung"),
                                       *openai, "--request-timeout-s", "0.3", "--max-retries", "0")
        assert code == 2 and "failed after 1 attempt(s), last: ReadTimeout" in stderr
    finally:
        server.stop()


def test_the_summary_tells_dropped_prompts_from_chats_cut_short(tmp_path, target):
    """A first turn with no room is left out (no row); a later turn with no room cuts the chat short (the row keeps its
    earlier turns): the stage's summary line counts them apart."""
    from test_generation_openai import FakeServer

    from stages.generate import GenerateConfig, run_generate

    long_text = " ".join(["lorem"] * 200)
    rows = [{"text": long_text},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"},
                          {"role": "user", "content": long_text}]},
            {"text": "def f(x):\n"}]
    prompts = _write_jsonl(tmp_path / "p.jsonl", rows)
    with prompts.open("a") as handle:  # a line dropped while reading, counted apart from those dropped generating
        handle.write("{oops\n")
    server = FakeServer(target.tokenizer, kind="vllm")
    log = io.StringIO()
    try:
        run_generate(GenerateConfig(prompts=str(prompts), output=str(tmp_path / "o"),
                                    engine="openai", endpoints=[server.url], max_new_tokens=4, max_length=120),
                     console=Console(file=log, width=400))
    finally:
        server.stop()
    corpus = open_corpus(tmp_path / "o")
    assert [corpus.sample_id(i) for i in range(len(corpus))] == ["p.jsonl line 2", "p.jsonl line 3"]
    assert corpus.metadata["generation"]["dropped"]["counts"] == {"too_long": 1, "turns_cut": 1}
    assert "left out while generating 1 (too_long 1), chats cut short 1 (turns_cut" in log.getvalue()
    assert "left out while reading 1 lines (bad_json: 1 (e.g. p.jsonl line 4))" in log.getvalue(), log.getvalue()


def test_rows_generated_from_one_stdlib_file_share_its_document(tmp_path, target, monkeypatch):
    """The default prompt set names each prompt's source file; generate writes it as the corpus document_id, so
    every row of one file has one document key; a prompts file's ``document`` field does the same. (The openai
    engine on a loopback server: the replies do not matter here, the rows do.)"""
    from test_generation_openai import FakeServer

    import dflash.generation.default_prompts
    from dflash.corpus.default_corpus import TextFile, stdlib_root
    from dflash.generation.default_prompts import DefaultPromptConfig
    from stages.generate import HELDOUT_PROMPTS_FILE, GenerateConfig, run_generate

    names = ("bisect.py", "colorsys.py", "keyword.py")
    files = [TextFile(stdlib_root() / name, f"stdlib:{name}") for name in names]
    monkeypatch.setattr(dflash.generation.default_prompts, "default_corpus_files", lambda **_: files)  # 3, not 600
    server = FakeServer(target.tokenizer, kind="vllm")
    try:
        run_generate(GenerateConfig(output=str(tmp_path / "default"), engine="openai", endpoints=[server.url],
                                    max_new_tokens=4,
                                    default_prompts=DefaultPromptConfig(heldout_permille=300, ask_prompts=2)))
        jsonl = _write_jsonl(tmp_path / "p.jsonl", [{"text": "def f(x):\n", "document": "notes/a.md"},
                                                    {"prompt": "Say hi.", "document_id": 3}, {"text": "x = 1\n"},
                                                    {"prompt": "Say bye.", "document": "notes/a.md"}])
        run_generate(GenerateConfig(prompts=str(jsonl), output=str(tmp_path / "file"), engine="openai",
                                    endpoints=[server.url], max_new_tokens=4))
    finally:
        server.stop()
    corpus = open_corpus(tmp_path / "default")
    keys_by_file: dict[str, set[int]] = {}
    for index in range(len(corpus)):
        file = next(f"stdlib:{name}" for name in names if corpus.sample_id(index).startswith(f"stdlib:{name}"))
        assert corpus.document_id(index) == file
        keys_by_file.setdefault(file, set()).add(int(corpus.document_keys[index]))
    assert len(keys_by_file) >= 2 and all(len(keys) == 1 for keys in keys_by_file.values())
    assert len(set.union(*keys_by_file.values())) == len(keys_by_file)
    assert len(corpus) > len(keys_by_file)  # several rows per file: the property is not vacuous
    heldout = [json.loads(line) for line in (tmp_path / "default" / HELDOUT_PROMPTS_FILE).read_text().splitlines()]
    assert heldout and all(line["id"].startswith(line["document"]) for line in heldout)
    assert not {line["document"] for line in heldout} & set(keys_by_file)  # held-out files are never trained on
    asked = [i for i in range(len(corpus)) if corpus.sample_id(i).endswith(":ask")]
    assert len(asked) == 2 and {corpus.document_id(i) for i in asked} <= set(keys_by_file)  # questions: rows too
    counts = json.loads((tmp_path / "default" / "corpus.json").read_text())["generation"]["prompt_source"]
    assert counts["prompt_counts"]["train"]["ask"] == 2 and counts["prompt_counts"]["heldout"]["ask"] == 0
    assert sum(counts["prompt_counts"]["train"].values()) == len(corpus)  # every training prompt gave a row
    assert sum(counts["prompt_counts"]["heldout"].values()) == len(heldout) == counts["heldout_prompts"]

    from_file = open_corpus(tmp_path / "file")
    assert [from_file.document_id(i) for i in range(len(from_file))] == [
        "notes/a.md", "3", "p.jsonl line 3", "notes/a.md"]  # without a document field: the prompt's own id
    keys = from_file.document_keys
    assert keys[0] == keys[3] and len({int(k) for k in keys}) == 3

    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "hi", "document": {"path": "a"}}])
    with pytest.raises(ConfigError, match=r"bad.jsonl line 1: 'document' is dict .*expected a string or an integer"):
        read_prompt_file(bad)


def test_progress_in_a_log_gives_prompts_tokens_rate_and_eta(tmp_path, target, monkeypatch, capsys):
    """Output not on a terminal (captured, as in a log file): no bar, but a line every ``progress_interval``
    seconds with prompts done, tokens, rates and the ETA, and one when it ends; the real command, parts answered by
    a (slow) server."""
    from cli_helpers import main_in_process
    from test_generation_openai import FakeServer

    prompts = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"Say hello {i}"} for i in range(4)])
    server = FakeServer(target.tokenizer, kind="vllm", delay_s=0.3)  # each part outlasts many intervals
    try:
        code, stderr = main_in_process(monkeypatch, capsys, "generate", str(prompts), "--output", str(tmp_path / "out"),
                                       "--engine", "openai", "--endpoint", server.url, "--part-size", "1",
                                       "--max-new-tokens", "4", "--set", "progress_interval=0.02")
    finally:
        server.stop()
    assert code == 0, stderr
    lines = [line for line in stderr.splitlines() if re.match(r"generate: \d/4 prompts, ", line)]
    assert re.fullmatch(rf"generate: 4/4 prompts, {COUNT} tokens, {COUNT} tok/s, {COUNT} prompts/s, done in {DURATION}",
                        lines[-1])
    mid = [line for line in lines if re.fullmatch(rf"generate: [123]/4 prompts, {COUNT} tokens, {COUNT} tok/s, "
                                                   rf"{COUNT} prompts/s, ETA {DURATION}", line)]
    assert mid, lines
    assert "━" not in stderr  # no bar drawn into the log


def test_a_part_reports_each_batch_before_it_commits(tmp_path, target):
    """generate_part passes the engine's progress on (turn, replies, tokens, decoding): a long part shows progress
    before its commit, after each batch (its replies and tokens, final) and within a batch (the tokens its rows
    have chosen so far, step by step through generate()'s streamer, the last one the batch's final figure)."""
    records, _ = read_prompt_file(_write_jsonl(tmp_path / "prompts.jsonl", PROMPTS))
    engine = TransformersEngine(target.model, target.tokenizer, batch_size=2)
    calls = []
    record = generate_part(engine, target.tokenizer, _part(tmp_path, target.tokenizer, records),
                           progress=lambda *call: calls.append(call))
    finals = [index for index, (_, replies, _, _) in enumerate(calls) if replies]
    assert [calls[i][:2] for i in finals] == [(0, 2), (0, 1), (1, 1)]  # three first turns, two rows a batch; a second
    start = 0
    for index in finals:
        turn, replies, tokens, decoding = calls[index]
        during = calls[start:index]
        assert len(during) >= 6 and all(call[:3] == (turn, 0, 0) for call in during)  # a report every step
        steps = [call[3] for call in during]
        assert steps[0] == replies and steps == sorted(steps) and steps[-1] == tokens == 6 * replies and decoding == 0
        start = index + 1
    assert start == len(calls) and sum(calls[i][2] for i in finals) == record["generated_tokens"]
    assert engine.progress is None and record["num_prompts"] == 3


def test_an_output_of_other_files_or_settings_is_refused_before_the_target_is_read(tmp_path, monkeypatch, capsys):
    """The output is checked before the tokenizer, the prompts and the target: with a target folder holding only a
    config.json (reading it would fail), a folder of other files and a generate output of other settings are
    refused by name, exit 2."""
    from cli_helpers import main_in_process

    from dflash.generation.parts import PLAN_FILE

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    prompts = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Say hello"}])
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    args = ["generate", str(prompts), "--target", str(target), "--target-processes", "1"]
    code, err = main_in_process(monkeypatch, capsys, *args, "--output", str(tmp_path / "mine"))
    assert code == 2 and err.count("error:") == 1 and "exists and is not a generate output" in err, err

    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / PLAN_FILE).write_text(json.dumps({"plan_digest": "x", "settings": {"temperature": 0.7}}))
    code, err = main_in_process(monkeypatch, capsys, *args, "--output", str(earlier))
    assert code == 2 and err.count("error:") == 1 and "differs in: " in err and "temperature" in err, err


def test_a_part_records_the_fewest_rows_its_engine_decoded_at_once(tmp_path, target, generated):
    """The static decoder's rows per call reach the part's record (``rows_at_a_time``: 1 where the memory held 1 of
    3) and the totals take the fewest over parts; ``model.generate()`` (the dynamic cache) reports none."""
    from dflash.generation.parts import summarize_parts
    from dflash.generation.static_decode import forward_activation_bytes, kv_cache_bytes

    _, _, dynamic = generated
    assert dynamic["rows_at_a_time"] is None
    records, _ = read_prompt_file(_write_jsonl(tmp_path / "p.jsonl", [{"text": "def f():\n"}, {"text": "x = 1\n"}]))
    engine = TransformersEngine(target.model, target.tokenizer, batch_size=3, cache="static")  # prompts in 64 columns
    config = target.model.config  # 64 prompt columns + 6 new tokens: a cache of 128 positions
    per_row = kv_cache_bytes(config, 1, 128, torch.float32) + 4 * 128
    engine._decoder.kv_memory = forward_activation_bytes(config, 3 * 64, 3, 64, torch.float32,
                                                         columns=128) + per_row * 3 // 2
    record = generate_part(engine, target.tokenizer, _part(tmp_path, target.tokenizer, records))
    steps = engine._decoder.last_steps
    engine.close()
    assert record["num_rows"] == 2 and record["rows_at_a_time"] == 1
    assert summarize_parts([dynamic, {**record, "rows_at_a_time": 3}, record])["rows_at_a_time"] == 1
    assert summarize_parts([dynamic])["rows_at_a_time"] is None
    # One row at a time: each reply's first token came from its prompt's forward; the decoder's steps are both
    # chunks' (last_steps), each over the one row.
    assert record["step_tokens"] == record["generated_tokens"] - 2 and record["row_steps"] == steps > 0
    assert summarize_parts([dynamic, record])["row_occupancy"] == round(record["step_tokens"] / record["row_steps"], 4)
    assert 0 < summarize_parts([record])["row_occupancy"] <= 1 and summarize_parts([dynamic])["row_occupancy"] is None
    assert record["caches_made"] == 1 and dynamic["caches_made"] is None  # both chunks on one cache


@pytest.mark.slow
def test_an_error_raised_on_a_worker_is_one_error_line_and_the_committed_parts_stay(tmp_path, target_path):
    """A part's ConfigError raised inside its Dask task (here: a chat template that drops earlier assistant turns, found
    at the second turn) reaches the user as one ``error:`` line, exit 2, without the worker's "Compute Failed" log and
    its traceback; the part committed before it stays."""
    from cli_helpers import forked_cli

    folder = tmp_path / "target"
    folder.mkdir()
    for path in Path(target_path).iterdir():
        if path.name == "model.safetensors":
            (folder / path.name).symlink_to(path)
        elif path.name not in ("dflash_target_identity.json", "chat_template.jinja"):
            (folder / path.name).write_bytes(path.read_bytes())
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'user' %}<|im_start|>user\n{{ m['content'] }}<|im_end|>\n{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    chat = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                         {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]}
    prompts = _write_jsonl(tmp_path / "p.jsonl", [{"text": "def f(x):\n"}, chat])
    output = tmp_path / "out"
    result = forked_cli(*_generate_args(prompts, output, "--target", str(folder)), cwd=os.getcwd(),
                        env={**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1", "COLUMNS": "400"})
    code, stderr = result.returncode, result.stderr  # the workers' output too (they write to the same stderr)
    assert code == 2 and stderr.count("error:") == 1 and "drops or rewrites earlier assistant turns" in stderr, stderr
    assert "Traceback" not in stderr and "Compute Failed" not in stderr, stderr
    assert list(committed_parts(output)) == [0]


@pytest.mark.slow
def test_a_full_disk_on_a_worker_is_one_error_line_and_the_committed_parts_stay(tmp_path):
    """ENOSPC while a Dask worker writes the second part: one ``error:`` line naming the file, exit 2, no worker
    log of the failed task; the first part stays committed."""
    from cli_helpers import forked_cli

    from dflash import faults

    prompts = _write_jsonl(tmp_path / "p.jsonl", [{"text": "def f(x):\n"}, {"text": "x = 1\n"}])
    output = tmp_path / "out"
    result = forked_cli(*_generate_args(prompts, output), cwd=os.getcwd(),
                        env={**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1", "COLUMNS": "400",
                             faults.ENV: "generate.part-write@2=enospc"})
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: No space left on device (ENOSPC) at {output}/.part-00000"), result.stderr
    assert "Traceback" not in result.stderr and "Compute Failed" not in result.stderr, result.stderr
    assert len(committed_parts(output)) == 1
