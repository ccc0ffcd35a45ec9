"""``dflash-stages evaluate`` on the real SmolLM2 target: CLI report fields, prompt sets, the lossless check.

The drafter is a randomly initialized ``DFlashDrafter`` written in the serving format by ``dflash.serving.export`` (an
export folder is one of the three drafter paths evaluate accepts); its tau is near 1, the mechanics are what is
checked here. Trained drafters are evaluated in tests/test_pipeline.py.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from cli_helpers import COUNT, DURATION
from typer.testing import CliRunner

from dflash.decoding.eval_prompts import prompts_from_corpus, prompts_from_file
from dflash.decoding.speculative import GenerationResult
from dflash.errors import ConfigError

BLOCK = 4


# Token-by-token decoding gains nothing from a second thread (conftest's one_torch_thread).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def export_folder(tmp_path_factory, target, tokenizer):
    from dflash.drafter import DFlashConfig, DFlashDrafter
    from dflash.serving.export import export_drafter

    config = DFlashConfig.from_target_config(target.model.config, tokenizer=tokenizer, num_draft_layers=1,
                                             block_size=BLOCK, target_layer_ids=[15])
    torch.manual_seed(0)
    drafter = DFlashDrafter(config)
    drafter.attach_target(target.model.get_input_embeddings().weight, target.model.get_output_embeddings().weight)
    target_info = {"identity": target.identity.to_dict(), "target_spec": str(target.path),
                   "weight_hashes": drafter.target_weight_hashes()}
    return export_drafter(drafter.state_dict(), config, tmp_path_factory.mktemp("export") / "drafter",
                          target_info=target_info)


@pytest.fixture(scope="module")
def full_evaluation(export_folder, tmp_path_factory):
    """``evaluate`` with the references, the untrained drafter and two threads, on two prompts: (prompts file, CLI
    result, report)."""
    from stages.cli import _register_all, app

    _register_all()
    folder = tmp_path_factory.mktemp("full-evaluation")
    prompts = folder / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"messages": [{"role": "user", "content": "List three prime numbers."},
                                 {"role": "assistant", "content": "dropped: the reply is what gets generated"}]})
        + "\n" + json.dumps({"prompt": "Write a haiku about Python."}) + "\n"
    )
    out = folder / "report.json"
    result = CliRunner().invoke(app, [
        "evaluate", "--drafter", str(export_folder), "--prompts", str(prompts), "--max-new-tokens", "4",
        "--ignore-eos", "--compare-untrained", "--device", "cpu", "--cpu-threads", "2", "--json-file", str(out),
        "--set", "progress_interval=0.001",
    ])
    return prompts, result, json.loads(out.read_text()) if out.is_file() else None


def test_evaluate_cli_writes_report_with_every_field(full_evaluation, export_folder):
    _, result, report = full_evaluation
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert report["drafter_source"] == str(export_folder)  # the folder read (an export: itself)
    assert "tau = " in result.output and "per-position acceptance" in result.output
    # Output that is not a terminal gets no progress bar, and no blank line where one would have been drawn: a
    # line every progress_interval seconds instead (batch-job logs), with rate, ETA and tau so far, and one at the
    # end, for the trained and the untrained drafter.
    assert "" not in result.output.splitlines()
    rates = rf"{COUNT} tokens, {COUNT} tok/s, {COUNT} prompts/s"
    ends = [line for line in result.output.splitlines()
            if re.fullmatch(rf"evaluate .+: 2/2 prompts, {rates}, done in {DURATION}, tau [\d.]+, block size \d+", line)]
    assert len(ends) == 2, result.output
    assert any(re.fullmatch(rf"evaluate .+: 1/2 prompts, {rates}, ETA {DURATION}, tau [\d.]+, .+", line)
               for line in result.output.splitlines()), result.output
    assert report["settings"]["cpu_threads"] == 2
    for key in ("tau", "acceptance", "speedup", "throughput", "lossless", "per_prompt", "untrained", "target",
                "settings", "prompts"):
        assert key in report, key
    acceptance = report["acceptance"]
    assert acceptance["block_size"] == BLOCK
    assert 1.0 <= report["tau"] <= BLOCK
    assert sum(acceptance["histogram"].values()) == acceptance["num_cycles"] > 0
    assert len(acceptance["acceptance_per_position"]) == len(acceptance["reach_per_position"]) == BLOCK - 1
    weighted = sum(int(tau) * count for tau, count in acceptance["histogram"].items())
    assert report["tau"] == pytest.approx(weighted / acceptance["num_cycles"])
    assert report["lossless"]["checked"] and report["lossless"]["passed"]
    assert report["lossless"]["identical"] == report["prompts"]["count"] == 2
    # Every emitted token checked against the target's argmax, the references' outputs compared token for token.
    assert report["lossless"]["method"] == "teacher-forced" and report["lossless"]["tokens_checked"] == 8
    assert report["lossless_vs_block_size_1"]["passed"] and report["lossless_vs_block_size_1"]["identical"] == 2
    assert report["reference_prompts"] == 2 and "over all 2 prompts" in report["speedup_basis"]
    assert report["speedup"] > 0
    assert all(p["new_tokens"] == 4 for p in report["per_prompt"])
    assert 1.0 <= report["untrained"]["tau"] <= BLOCK
    # The second reference: the target's own generate() on the same prompts, the same number of new tokens.
    generate = report["throughput"]["target_generate"]
    assert generate["new_tokens"] == report["throughput"]["speculative"]["new_tokens"] == 8
    assert generate["tokens_per_second"] > 0 and "use_cache=True" in generate["call"]
    assert report["speedup_vs_generate"] == pytest.approx(
        report["throughput"]["speculative"]["tokens_per_second"] / generate["tokens_per_second"])
    against_generate = report["lossless_vs_generate"]
    assert against_generate["checked"] and against_generate["passed"]
    assert against_generate["identical"] == against_generate["block_size_1_identical"] == 2
    assert all(p["generate_new_tokens"] == 4 and p["generate_seconds"] > 0 for p in report["per_prompt"])
    assert report["untrained"]["speedup_vs_generate"] > 0 and report["untrained"]["lossless_vs_generate"]["passed"]
    assert "speedup vs generate()" in result.output and "lossless vs generate()" in result.output
    assert report["target"]["content_hash"].startswith("sha256:")


def test_no_references_measures_the_same_tau_without_the_references(export_folder, full_evaluation, tmp_path):
    """``--no-references`` decodes with the drafter only: the same tau, acceptance and per-prompt cycles as the full
    evaluation of the same prompts (greedy drafting does not depend on the references, nor on the thread count), no
    speedup and no token-for-token verdict, but the teacher-forced lossless check of every prompt."""
    from stages.cli import _register_all, app

    _register_all()
    prompts, full_result, full = full_evaluation
    assert full_result.exit_code == 0, full_result.output + repr(full_result.exception)
    out = tmp_path / "tau_only.json"
    result = CliRunner().invoke(app, [
        "evaluate", "--drafter", str(export_folder), "--prompts", str(prompts), "--max-new-tokens", "4",
        "--ignore-eos", "--no-references", "--device", "cpu", "--json-file", str(out),
    ])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "not measured (references off)" in result.output and "speedup vs" not in result.output
    tau_only = json.loads(out.read_text())
    assert tau_only["settings"]["references"] is False
    assert tau_only["settings"]["cpu_threads"] == 1  # the CPU default: one thread, whatever the core count
    assert tau_only["speedup"] is None and tau_only["speedup_vs_generate"] is None
    assert set(tau_only["throughput"]) == {"speculative"}
    # The teacher-forced check needs no reference: every prompt's output checked token by token all the same.
    assert tau_only["lossless"]["checked"] and tau_only["lossless"]["passed"]
    assert tau_only["lossless"]["tokens_checked"] == full["lossless"]["tokens_checked"] > 0
    for key in ("lossless_vs_block_size_1", "lossless_vs_generate"):
        assert not tau_only[key]["checked"] and "references not run" in tau_only[key]["reason"]
    assert full["settings"]["cpu_threads"] == 2
    assert full["speedup"] > 0 and full["lossless"]["passed"] and full["settings"]["references"] is True
    assert tau_only["tau"] == full["tau"] and tau_only["acceptance"] == full["acceptance"]
    assert [p["cycles"] for p in tau_only["per_prompt"]] == [p["cycles"] for p in full["per_prompt"]]
    assert all("baseline_seconds" not in p for p in tau_only["per_prompt"])


def test_static_kv_cache_decodes_what_the_dynamic_cache_decodes(export_folder, full_evaluation, tmp_path):
    """``--kv-cache static`` (the CUDA default; eager here) runs both loops on the static-cache target and the
    drafter over its fixed-size context: the same tau, acceptance, cycles and lossless verdicts as the dynamic cache
    of the full evaluation, and the report and table say which cache ran."""
    from stages.cli import _register_all, app

    _register_all()
    prompts, full_result, full = full_evaluation
    assert full_result.exit_code == 0, full_result.output + repr(full_result.exception)
    out = tmp_path / "static.json"
    result = CliRunner().invoke(app, [
        "evaluate", "--drafter", str(export_folder), "--prompts", str(prompts), "--max-new-tokens", "4",
        "--ignore-eos", "--kv-cache", "static", "--device", "cpu", "--json-file", str(out),
    ], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output + repr(result.exception)
    static = json.loads(out.read_text())
    assert full["decoding"] == {"kv_cache": "dynamic", "cuda_graphs": False, "graph_replays": 0,
                                "drafter_graph_replays": 0}
    assert static["decoding"]["kv_cache"] == "static" and not static["decoding"]["cuda_graphs"]
    assert static["settings"]["kv_cache"] == "static" and "target KV cache (speculative and block size 1 loops)" in result.output
    assert static["tau"] == full["tau"] and static["acceptance"] == full["acceptance"]
    assert [p["cycles"] for p in static["per_prompt"]] == [p["cycles"] for p in full["per_prompt"]]
    for key in ("lossless", "lossless_vs_block_size_1", "lossless_vs_generate"):
        assert static[key]["passed"] and static[key]["identical"] == full[key]["identical"] == 2


def _real_outputs(export_folder, target, tokenizer, texts, max_new_tokens):
    """The drafter's speculative outputs (greedy) on ``texts``: (prompts, results)."""
    from dflash.decoding.eval_prompts import EvalPrompt
    from dflash.decoding.speculative import SpeculativeConfig, TappedTarget, speculative_generate
    from dflash.serving.export import load_drafter

    drafter, config, _ = load_drafter(export_folder)
    drafter.attach_target(target.model.get_input_embeddings().weight, target.model.get_output_embeddings().weight)
    prompts = [EvalPrompt(input_ids=tokenizer.encode(text), source=f"doc {i}") for i, text in enumerate(texts)]
    settings = SpeculativeConfig(block_size=BLOCK, max_new_tokens=max_new_tokens,
                                 mask_token_id=int(config.mask_token_id))
    with TappedTarget(target.model, config.target_layer_ids) as tapped:
        results = [speculative_generate(tapped, drafter.eval(), p.input_ids, settings) for p in prompts]
    return prompts, results


def test_teacher_forced_check_passes_real_output_and_flags_a_replaced_token(export_folder, target, tokenizer):
    """The lossless check of every prompt: one forward over prompt + speculative output. Real speculative output
    passes, every token counted; the same output with one token replaced by another fails at that prompt and index,
    naming the target's token and its logit gap; an output cut where greedy decoding would not cut it fails too."""
    from dataclasses import replace

    from stages.evaluate import _teacher_forced_report

    prompts, results = _real_outputs(export_folder, target, tokenizer,
                                     ["def fibonacci(n):\n    if n < 2:\n", "import os\n\ndef walk(top):\n"], 6)
    check = _teacher_forced_report(target.model, prompts, results, 1e-3, max_new_tokens=6, stop_token_ids=())
    assert check["passed"] and check["identical"] == 2 and check["tokens_checked"] == 12 and not check["mismatches"]

    output = results[1].output_ids
    with torch.no_grad():
        logits = target.model(torch.tensor([prompts[1].input_ids + output[:3]])).logits[0, -1]
    assert int(logits.argmax()) == output[3]
    wrong = int(logits.argmin())
    mutated = [results[0], replace(results[1], output_ids=output[:3] + [wrong] + output[4:])]
    check = _teacher_forced_report(target.model, prompts, mutated, 1e-3, max_new_tokens=6, stop_token_ids=())
    assert not check["passed"] and check["identical"] == 1 and check["near_ties"] == 0
    (mismatch,) = check["mismatches"]
    assert (mismatch["prompt"], mismatch["index"], mismatch["source"]) == (1, 3, "doc 1")
    assert (mismatch["speculative_token"], mismatch["target_token"]) == (wrong, output[3])
    assert mismatch["target_logit_gap"] == pytest.approx(float(logits.max() - logits.min()), rel=1e-4)
    assert not mismatch["near_tie"] and mismatch["deviations"] >= 1
    # A tolerance above that gap makes it a near-tie: reported, and the check passes.
    lenient = _teacher_forced_report(target.model, prompts, mutated, 1e4, max_new_tokens=6, stop_token_ids=())
    assert lenient["passed"] and lenient["near_ties"] == 1 and lenient["mismatches"][0]["near_tie"]

    # The cut: a token taken as a stop token before the end, or an output shorter than max_new_tokens without one.
    at = next(i for i in range(1, len(output) - 1) if output[i] not in output[:i])
    cut = _teacher_forced_report(target.model, prompts[1:], results[1:], 1e-3, max_new_tokens=6,
                                 stop_token_ids=(output[at],))
    assert not cut["passed"] and cut["mismatches"][0]["index"] == at + 1
    assert f"continues after the stop token {output[at]} at index {at}" in cut["mismatches"][0]["reason"]
    short = _teacher_forced_report(target.model, prompts[1:], results[1:], 1e-3, max_new_tokens=7, stop_token_ids=())
    assert not short["passed"] and "greedy decoding stops at max_new_tokens" in short["mismatches"][0]["reason"]


def test_lossless_check_catches_a_real_divergence(target, tokenizer):
    from dflash.decoding.eval_prompts import EvalPrompt
    from stages.evaluate import _lossless_report, _lossless_vs_generate

    prompt = EvalPrompt(tokenizer.encode("def add(a, b):\n    return"), "inline")
    with torch.no_grad():
        logits = target.model(torch.tensor([prompt.input_ids])).logits[0, -1]
    best, worst = int(logits.argmax()), int(logits.argmin())

    def result(tokens):
        return GenerationResult(prompt_ids=prompt.input_ids, output_ids=tokens, acceptance_lengths=[1],
                                block_size=1, prefill_seconds=0.0, decode_seconds=0.0, finish_reason="length")

    same = _lossless_report(target.model, [prompt], [result([best])], [result([best])], 1e-3)
    assert same["passed"] and same["identical"] == 1
    wrong = _lossless_report(target.model, [prompt], [result([worst])], [result([best])], 1e-3)
    assert not wrong["passed"]
    (mismatch,) = wrong["mismatches"]
    assert mismatch["index"] == 0 and mismatch["target_token"] == best and not mismatch["near_tie"]
    assert mismatch["target_logit_gap"] == pytest.approx(float(logits[best] - logits[worst]), rel=1e-4)
    # Against generate(): the same report, plus whether the block-size-1 loop agreed with generate().
    against = _lossless_vs_generate(target.model, [prompt], [result([worst])], [result([best])], [result([best])], 1e-3)
    assert not against["passed"] and against["block_size_1_identical"] == 1
    assert against["mismatches"][0]["target_token"] == best


class _RowsCorpus:
    """Two real rows: a chat row (prompt = the tokens before the reply) and a plain code row."""

    def __init__(self, tokenizer):
        from dflash.corpus.format import CorpusRow

        chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
        reply = tokenizer.encode("Hello! How can I help?")
        code = tokenizer.encode(open(__file__).read())[:400]
        self.path = "in-memory"
        self._rows = [
            CorpusRow(np.array(chat + reply, np.int32), np.array([0] * len(chat) + [1] * len(reply), np.uint8), "chat"),
            CorpusRow(np.array(code, np.int32), np.ones(len(code), np.uint8), "code"),
        ]
        self.chat_prompt = chat

    def __len__(self):
        return len(self._rows)

    def row(self, index):
        return self._rows[index]

    def describe_row(self, index):
        return f"row {index}"


def test_corpus_prompts_cut_chat_rows_before_the_reply_and_window_plain_rows(tokenizer):
    corpus = _RowsCorpus(tokenizer)
    prompts = prompts_from_corpus(corpus, np.arange(2), num_prompts=2, prompt_tokens=64, continuation_tokens=32)
    by_source = {p.source: p.input_ids for p in prompts}
    assert by_source["row 0"] == corpus.chat_prompt
    code = corpus.row(1).input_ids.tolist()
    window = by_source["row 1"]
    assert len(window) == 64
    start = next(i for i in range(len(code)) if code[i : i + 64] == window)
    assert start + 64 + 32 <= len(code)  # room left for the continuation


def test_file_prompts_txt_and_errors(tokenizer, tmp_path):
    text = tmp_path / "prompts.txt"
    text.write_text("first prompt\n\nsecond prompt\n")
    prompts = prompts_from_file(text, tokenizer, num_prompts=5)
    assert [p.source.rsplit(" ", 1)[-1] for p in prompts] == ["1", "3"]
    raw = prompts_from_file(text, tokenizer, num_prompts=1, chat_template=False)
    assert raw[0].input_ids == tokenizer.encode("first prompt")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"question": "no field"}) + "\n")
    with pytest.raises(ConfigError, match="line 2"):
        prompts_from_file(bad, tokenizer, num_prompts=5)
    (tmp_path / "prompts.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match=r"must end in \.jsonl"):
        prompts_from_file(tmp_path / "prompts.csv", tokenizer, num_prompts=1)


def test_file_prompts_refuse_what_no_step_can_use_naming_the_line(tokenizer, tmp_path):
    """Deep nesting, a non-object line, a message without content, bytes that are not UTF-8 and a line past the
    limit are each one ConfigError/CorpusError naming the file and line (never a RecursionError or AttributeError)."""
    from dflash.errors import CorpusError
    from dflash.io.files import DEFAULT_MAX_LINE_BYTES

    cases = [
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", ConfigError, "nested more than 64 levels deep"),
        (b'["a list"]', ConfigError, "expected a JSON object, got list"),
        (b'{"messages": [{"role": "user"}]}', CorpusError, "message 0: content is NoneType"),
        (b'{"messages": ["hi"]}', CorpusError, "message 0: expected an object with role and content"),
        (b'{"messages": [], "text": null}', ConfigError, "'messages' is an empty list, 'text' is null"),
        (b'{"prompt": "caf\xe9"}', ConfigError, r"is not UTF-8 text \(it holds the byte b'\\xe9'\)"),
        (b'{"prompt": "' + b"x" * DEFAULT_MAX_LINE_BYTES + b'"}', ConfigError,
         f"line 2 is longer than {DEFAULT_MAX_LINE_BYTES:,} bytes"),
    ]
    for index, (line, error, message) in enumerate(cases):
        path = tmp_path / f"p{index}.jsonl"
        path.write_bytes(b'{"prompt": "fine"}\n' + line + b"\n")
        with pytest.raises(error, match=f"{path.name} line 2.*{message}" if "line 2" not in message else message):
            prompts_from_file(path, tokenizer, num_prompts=5)


def test_a_run_folders_own_report_is_replaced_keeping_the_earlier_one_and_a_named_file_is_overwritten(tmp_path):
    """evaluate --drafter RUN writes RUN/eval/final.json by default (report, diff and inspect read it): an evaluation on
    other prompts must not erase the earlier report, so it is renamed beside the new one; --json-file overwrites."""
    from stages.evaluate import write_report

    final = tmp_path / "eval" / "final.json"
    final.parent.mkdir()
    assert write_report(final, {"tau": 1.5}, keep_earlier=True) is None  # nothing there yet
    kept = [write_report(final, {"tau": tau}, keep_earlier=True) for tau in (1.2, 1.1)]  # within one second, too
    assert json.loads(final.read_text()) == {"tau": 1.1}
    assert [json.loads(path.read_text()) for path in kept] == [{"tau": 1.5}, {"tau": 1.2}]
    assert len({path.name for path in kept}) == 2 and all(p.name.startswith("final.replaced-") for p in kept)
    named = tmp_path / "mine.json"
    for tau in (1.0, 2.0):
        assert write_report(named, {"tau": tau}, keep_earlier=False) is None
    assert json.loads(named.read_text()) == {"tau": 2.0} and sorted(p.name for p in tmp_path.iterdir()) == ["eval", "mine.json"]


def test_progress_bar_over_prompts_on_a_terminal(export_folder, target, tokenizer):
    """On a terminal, evaluate draws a transient bar counting prompts (with the running tau) from the warm-up on."""
    import io

    from rich.console import Console

    from dflash.decoding.eval_prompts import EvalPrompt
    from dflash.serving.export import load_drafter
    from stages.evaluate import evaluate_drafter

    drafter, config, _ = load_drafter(export_folder)
    drafter.attach_target(target.model.get_input_embeddings().weight, target.model.get_output_embeddings().weight)
    prompts = [EvalPrompt(input_ids=tokenizer(text)["input_ids"], source=f"doc {i}")
               for i, text in enumerate([json.dumps.__doc__[:80], np.argsort.__doc__[:80]])]
    stream = io.StringIO()
    console = Console(file=stream, force_terminal=True, color_system=None, width=120)
    summary, _ = evaluate_drafter(target, drafter.eval(), prompts, block_size=BLOCK,
                                  mask_token_id=int(config.mask_token_id),
                                  target_layer_ids=list(config.target_layer_ids), max_new_tokens=4,
                                  console=console, label="my-drafter")
    drawn = stream.getvalue()
    assert "evaluate my-drafter" in drawn and "warm-up" in drawn
    assert "2/2 prompts" in drawn and f"tau {summary['tau']:.2f}" in drawn
    assert "prompts/s" not in drawn  # the plain progress lines are for logs only


def test_two_prompt_sets_are_reported_side_by_side(export_folder, tmp_path, tokenizer):
    """``--extra-prompts numpy-questions`` evaluates a second set, of another kind, in the same run: each set has
    its own tau, acceptance per position, lossless counts and fingerprint, in the JSON and in the tables, and the
    last line names both."""
    from dflash.decoding.eval_prompts import NUMPY_QUESTIONS, embedded_prompts
    from stages.cli import _register_all, app

    _register_all()
    prompts = tmp_path / "code.jsonl"
    prompts.write_text(json.dumps({"text": "def fibonacci(n):\n    if n < 2:\n"}) + "\n"
                       + json.dumps({"text": "import os\n\ndef walk(top):\n"}) + "\n")
    out = tmp_path / "report.json"
    result = CliRunner().invoke(app, [
        "evaluate", "--drafter", str(export_folder), "--prompts", str(prompts), "--extra-prompts", NUMPY_QUESTIONS,
        "--num-prompts", "1", "--max-new-tokens", "4", "--ignore-eos", "--device", "cpu", "--json-file", str(out),
    ], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output + repr(result.exception)
    report = json.loads(out.read_text())
    first, second = report["prompt_sets"]
    assert (first["name"], second["name"]) == ("code", NUMPY_QUESTIONS)
    assert first["tau"] == report["tau"] and first["acceptance"] == report["acceptance"]  # the top level: set 1
    expected = embedded_prompts(NUMPY_QUESTIONS, tokenizer, num_prompts=1, seed=0)
    assert second["fingerprint"] == expected.fingerprint != first["fingerprint"]
    assert second["package"] == "numpy" and second["package_version"] == np.__version__
    assert [p["source"] for p in second["per_prompt"]] == [p.source for p in expected.prompts]
    for entry in (first, second):
        assert entry["count"] == 1 and 1.0 <= entry["tau"] <= BLOCK
        assert len(entry["acceptance"]["acceptance_per_position"]) == BLOCK - 1
        assert entry["lossless"]["checked"] and entry["lossless"]["identical"] == 1
        assert entry["lossless_vs_generate"]["passed"] and entry["speedup"] > 0
        assert sum(p["cycles"] for p in entry["per_prompt"]) == entry["acceptance"]["num_cycles"]
    assert "prompt sets side by side" in result.output and f"P(>= k accepted) {NUMPY_QUESTIONS}" in result.output
    last = result.output.strip().splitlines()[-1]
    assert last == f"tau = {first['tau']:.3f} (code) / {second['tau']:.3f} ({NUMPY_QUESTIONS})"


def test_numpy_questions_are_chat_questions_about_documented_functions(tokenizer):
    """The embedded second set: the same prompts for the same seed, other ones for another seed; each a user turn
    through the chat template quoting a numpy function's documentation, no code."""
    from dflash.decoding.eval_prompts import NUMPY_QUESTIONS, embedded_prompts

    first = embedded_prompts(NUMPY_QUESTIONS, tokenizer, num_prompts=3, seed=0)
    assert embedded_prompts(NUMPY_QUESTIONS, tokenizer, num_prompts=3, seed=0).fingerprint == first.fingerprint
    assert embedded_prompts(NUMPY_QUESTIONS, tokenizer, num_prompts=3, seed=1).fingerprint != first.fingerprint
    assert len(first.prompts) == 3 and first.details["candidates"] > 100
    for prompt in first.prompts:
        text = tokenizer.decode(prompt.input_ids)
        assert "<|im_start|>user" in text and text.rstrip().endswith("<|im_start|>assistant")
        assert "I am using NumPy's `" in text and "Its documentation says:" in text and "```" not in text
        assert prompt.source.startswith(f"{NUMPY_QUESTIONS}:numpy.")


def test_extra_prompts_refused_before_the_target_loads(export_folder, tmp_path, monkeypatch, capsys):
    """A missing file, held-out (which needs the corpus rows of the first set), a set named twice, no prompt for
    the references, or a KV cache that is not auto, static or dynamic: one error line naming the setting, exit
    status 2."""
    from cli_helpers import main_in_process

    missing = tmp_path / "nope.jsonl"
    code, err = main_in_process(monkeypatch, capsys, "evaluate", "--drafter", str(export_folder), "--prompts",
                                "numpy-questions", "--extra-prompts", str(missing))
    assert code == 2 and err.count("error: ") == 1 and "Traceback" not in err, err
    assert f"evaluate.extra_prompts (--extra-prompts): {missing} does not exist" in err, err
    assert "an embedded set (numpy-questions), a .jsonl or a .txt file" in err and "held-out" not in err
    code, err = main_in_process(monkeypatch, capsys, "evaluate", "--drafter", str(export_folder), "--prompts",
                                "numpy-questions", "--extra-prompts", "numpy-questions")
    assert code == 2 and "named twice" in err, err
    code, err = main_in_process(monkeypatch, capsys, "evaluate", "--drafter", str(export_folder), "--prompts",
                                "numpy-questions", "--extra-prompts", "held-out")
    assert code == 2 and "held-out is allowed only as the first prompt set" in err, err
    code, err = main_in_process(monkeypatch, capsys, "evaluate", "--drafter", str(export_folder), "--prompts",
                                "numpy-questions", "--reference-prompts", "0")
    assert code == 2 and err.count("error: ") == 1 and "Traceback" not in err, err
    assert "evaluate.reference_prompts (--reference-prompts): must be >= 1 (or null: every prompt), got 0" in err, err
    for bad, message in ((["--kv-cache", "bogus"], "evaluate.kv_cache (--kv-cache): must be auto, static or dynamic"),
                         (["--set", "evaluate.kv_cache=1"], "expected one of auto|static|dynamic, got 1")):
        code, err = main_in_process(monkeypatch, capsys, "evaluate", "--drafter", str(export_folder), "--prompts",
                                    "numpy-questions", *bad)
        assert code == 2 and err.count("error: ") == 1 and message in err and "Traceback" not in err, err


def test_a_preset_s_switches_can_be_turned_off_on_the_command_line(export_folder, tmp_path, monkeypatch, capsys):
    """cpu-small sets ``compare_untrained`` and ``ignore_eos``: ``--no-compare-untrained`` and ``--no-ignore-eos``
    turn them off for one evaluation."""
    from cli_helpers import main_in_process_out

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def fibonacci(n):\n")
    args = ["evaluate", "--drafter", str(export_folder), "--prompts", str(prompts), "--preset", "cpu-small",
            "--print-config"]
    code, out, err = main_in_process_out(monkeypatch, capsys, *args)
    resolved = json.loads(out)["evaluate"]
    assert code == 0 and resolved["compare_untrained"] and resolved["ignore_eos"], err
    code, out, err = main_in_process_out(monkeypatch, capsys, *args, "--no-compare-untrained", "--no-ignore-eos")
    resolved = json.loads(out)["evaluate"]
    assert code == 0 and not resolved["compare_untrained"] and not resolved["ignore_eos"], err


def test_report_settings_say_what_this_evaluation_ran(export_folder, tmp_path):
    """``Evaluator.evaluate`` arguments over the config (the pipeline's final evaluation measures the untrained
    drafter with ``compare_untrained`` false in its config): the report's settings record what ran."""
    from stages.evaluate import EvaluateConfig, Evaluator

    prompts = tmp_path / "code.txt"
    prompts.write_text("def fibonacci(n):\n")
    config = EvaluateConfig(drafter=export_folder, prompts=str(prompts), num_prompts=1, max_new_tokens=2,
                            ignore_eos=True, device="cpu")
    evaluator = Evaluator(config, "default")
    drafter, drafter_config, _ = evaluator.load_drafter(export_folder)
    report = evaluator.evaluate(drafter, drafter_config, label="final", compare_untrained=True, references=False)
    assert report["untrained"] is not None and report["settings"]["compare_untrained"] is True
    assert report["settings"]["references"] is False and not config.compare_untrained and config.references
    report = evaluator.evaluate(drafter, drafter_config, label="final", references=False)
    assert report["untrained"] is None and report["settings"]["compare_untrained"] is False


def test_the_first_prompts_of_a_set_have_their_own_references(export_folder, tmp_path):
    """``Evaluator.evaluate(num_prompts=N)`` measures the first N prompts of the first set (another fingerprint);
    references measured on them are not reused for the whole set."""
    from stages.evaluate import EvaluateConfig, Evaluator

    prompts = tmp_path / "code.jsonl"
    prompts.write_text("".join(json.dumps({"text": text}) + "\n" for text in
                               ("def fibonacci(n):\n    if n < 2:\n", "import os\n\ndef walk(top):\n")))
    config = EvaluateConfig(drafter=export_folder, prompts=str(prompts), num_prompts=2, max_new_tokens=3,
                            ignore_eos=True, device="cpu")
    evaluator = Evaluator(config, "default")
    drafter, drafter_config, _ = evaluator.load_drafter(export_folder)
    first = evaluator.evaluate(drafter, drafter_config, label="subset", all_sets=False, num_prompts=1)
    whole = evaluator.evaluate(drafter, drafter_config, label="whole")
    assert [(s["name"], s["count"]) for s in first["prompt_sets"]] == [("code", 1)]
    assert [(s["name"], s["count"]) for s in whole["prompt_sets"]] == [("code", 2)]
    assert first["prompts"]["fingerprint"] != whole["prompts"]["fingerprint"]
    same = ("source", "new_tokens", "cycles", "tau")
    assert [first["per_prompt"][0][k] for k in same] == [whole["per_prompt"][0][k] for k in same]
    assert whole["lossless"]["identical"] == 2 and len(whole["per_prompt"]) == 2
    assert all("baseline_seconds" in p for p in whole["per_prompt"])


def test_reference_prompts_measures_the_references_on_the_first_n(export_folder, full_evaluation, tmp_path,
                                                                   monkeypatch):
    """``--reference-prompts 1``: the block-size-1 loop and generate() decode the first prompt only (counted at the
    calls), the speculative loop and the teacher-forced check every prompt; the report says what the speedups are
    computed over, and the references are kept per number of reference prompts."""
    import dflash.decoding.speculative as speculative
    from stages.cli import _register_all, app
    from stages.evaluate import EvaluateConfig, Evaluator

    _register_all()
    prompts, _, full = full_evaluation
    calls = {"block size 1": 0, "generate": 0}
    loop, generate = speculative.speculative_generate, speculative.target_generate

    def counted_loop(tapped, drafter, prompt_ids, config, **kwargs):
        calls["block size 1"] += config.block_size == 1
        return loop(tapped, drafter, prompt_ids, config, **kwargs)

    def counted_generate(*args, **kwargs):
        calls["generate"] += 1
        return generate(*args, **kwargs)

    monkeypatch.setattr(speculative, "speculative_generate", counted_loop)
    monkeypatch.setattr(speculative, "target_generate", counted_generate)
    out = tmp_path / "report.json"
    result = CliRunner().invoke(app, [
        "evaluate", "--drafter", str(export_folder), "--prompts", str(prompts), "--max-new-tokens", "4",
        "--ignore-eos", "--reference-prompts", "1", "--device", "cpu", "--json-file", str(out),
    ], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert calls == {"block size 1": 1 + 1, "generate": 1 + 1}  # one warm-up call each, then the first prompt
    report = json.loads(out.read_text())
    assert report["settings"]["reference_prompts"] == 1 and report["reference_prompts"] == 1
    assert report["speedup_basis"] == ("speculative tokens/s over all 2 prompts / the reference's tokens/s over "
                                       "the first 1")
    speed = report["throughput"]
    assert speed["speculative"]["prompts"] == 2 and speed["speculative"]["new_tokens"] == 8
    for name in ("baseline_block_size_1", "target_generate"):
        assert speed[name]["prompts"] == 1 and speed[name]["new_tokens"] == 4
    assert report["speedup"] == pytest.approx(speed["speculative"]["tokens_per_second"]
                                              / speed["baseline_block_size_1"]["tokens_per_second"])
    assert ["baseline_seconds" in p for p in report["per_prompt"]] == [True, False]
    assert report["lossless"]["prompts"] == 2 and report["lossless"]["tokens_checked"] == 8
    assert report["lossless_vs_block_size_1"]["prompts"] == report["lossless_vs_generate"]["prompts"] == 1
    assert report["lossless"]["passed"] and report["lossless_vs_generate"]["passed"]
    assert report["tau"] == full["tau"] and report["per_prompt"][1]["cycles"] == full["per_prompt"][1]["cycles"]
    assert "first 1 of 2" in result.output and "speedups over" in result.output

    # The references are reused per (set, prompts with references): the first prompt's serve every subset that
    # starts with it.
    config = EvaluateConfig(drafter=export_folder, prompts=str(prompts), max_new_tokens=2, ignore_eos=True,
                            device="cpu", reference_prompts=1)
    evaluator = Evaluator(config, "default")
    drafter, drafter_config, _ = evaluator.load_drafter(export_folder)
    calls.update({"block size 1": 0, "generate": 0})
    evaluator.evaluate(drafter, drafter_config, label="subset", num_prompts=1)
    evaluator.evaluate(drafter, drafter_config, label="whole")
    assert list(evaluator.baselines) == [("prompts", 1)] and calls["generate"] == 1 + 1


def test_a_report_without_the_newer_fields_still_renders(full_evaluation):
    """Reports on disk written before the teacher-forced check and reference_prompts (their ``lossless`` compared
    with the block-size-1 loop): the tables and the tau line still show them."""
    import io

    from rich.console import Console

    from stages.evaluate import print_report, tau_line

    _, _, report = full_evaluation
    old = json.loads(json.dumps(report))
    for entry in (old, *old["prompt_sets"]):
        for key in ("reference_prompts", "speedup_basis", "lossless_vs_block_size_1"):
            entry.pop(key, None)
        for key in ("method", "tokens_checked"):
            entry["lossless"].pop(key, None)
    for speed in old["throughput"].values():
        speed.pop("prompts", None)
    stream = io.StringIO()
    print_report(old, Console(file=stream, width=200, color_system=None))
    shown = stream.getvalue()
    assert "greedy lossless check" in shown and "passed: 2/2 identical" in shown and "argmax" not in shown
    assert "lossless vs block size 1" not in shown and "prompts with references" in shown and "all 2" in shown
    assert tau_line(old) == f"tau = {old['tau']:.3f}"
    stream = io.StringIO()
    print_report(report, Console(file=stream, width=200, color_system=None))
    assert "passed: 2/2 identical (8 tokens: the target's argmax)" in stream.getvalue()


def test_bad_prompts_and_a_bad_json_file_are_refused_before_the_model_loads(export_folder, target_path, tmp_path,
                                                                             monkeypatch, capsys):
    """The prompts are read (a file through the tokenizer alone) and --json-file checked before the target's
    weights load: with a target whose weights cannot load, the refusal names the prompts file or the JSON path."""
    from cli_helpers import main_in_process, unloadable_target

    broken = unloadable_target(tmp_path / "target", target_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Say hello"}) + "\n" + json.dumps({"neither": 1}) + "\n")
    args = ["evaluate", "--drafter", str(export_folder), "--target", str(broken), "--device", "cpu"]
    code, err = main_in_process(monkeypatch, capsys, *args, "--prompts", str(prompts))
    assert code == 2 and err.count("error:") == 1 and "prompts.jsonl" in err and "line 2" in err, err
    assert "safetensors" not in err  # the weights were never read
    (tmp_path / "report").mkdir()
    code, err = main_in_process(monkeypatch, capsys, *args, "--prompts", str(prompts), "--json-file",
                                str(tmp_path / "report"))
    assert code == 2 and err.count("error:") == 1 and f"--json-file {tmp_path / 'report'}" in err, err
