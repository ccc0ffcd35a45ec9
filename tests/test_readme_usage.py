"""README.md's "Your own chat data" commands, read from README.md itself and run as written on a small chat file.

Only the sizes shrink, through options a user could append: train runs one epoch, and evaluate measures the held-out
prompt alone, 8 new tokens of it (the preset's second prompt set and the untrained drafter are measured by
tests/test_pipeline.py and tests/test_evaluate.py); every option the README writes is still given, and the references
and the lossless check still run."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from cli_helpers import main_in_process_out

README = Path(__file__).resolve().parents[1] / "README.md"

# Ten short conversations of real text: 5% held out is one conversation, nine are left to train on (at least
# --min-train-samples), each reply long enough to be supervised (2 x the block size of --preset cpu-small).
CONVERSATIONS = [
    ("How do I reverse a list in Python?",
     "Use slicing: items[::-1] returns a reversed copy, while items.reverse() reverses the list in place and returns "
     "None. The built-in reversed(items) gives an iterator if you only need to loop backwards."),
    ("What is the capital of France?",
     "The capital of France is Paris. It sits on the Seine in the north of the country and has been the seat of "
     "government for most of the last thousand years."),
    ("Explain what a hash table is.",
     "A hash table stores key-value pairs in an array of buckets. A hash function maps each key to a bucket index, so "
     "lookups, inserts and deletes take constant time on average. Collisions are handled by chaining or open "
     "addressing."),
    ("Give me a tip for writing clear emails.",
     "Put the request or the main point in the first sentence, keep paragraphs short, and end with exactly what you "
     "need from the reader and by when. A specific subject line helps people find the email later."),
    ("Why is the sky blue?",
     "Sunlight is scattered by the molecules of the air, and shorter wavelengths scatter much more strongly than "
     "longer ones. Blue light is therefore scattered across the whole sky, which is why it looks blue during the day."),
    ("How many days are in a leap year?",
     "A leap year has 366 days instead of 365. The extra day is February 29, added in years divisible by four, except "
     "century years that are not divisible by four hundred."),
    ("What does a compiler do?",
     "A compiler translates source code written in a high-level language into a lower-level form, such as machine "
     "code or bytecode. Along the way it checks the program for errors and often optimizes it to run faster."),
    ("How should I store fresh basil?",
     "Trim the stems and stand the basil in a glass of water at room temperature, like cut flowers, with a loose bag "
     "over the leaves. The fridge turns the leaves black, so keep it out of the cold and use it within a few days."),
    ("What is the difference between weather and climate?",
     "Weather is the state of the atmosphere at a given place and time: today's rain, wind and temperature. Climate "
     "is the average pattern of weather over many years, so a cold week says little about the climate of a region."),
    ("Suggest a simple way to start running.",
     "Begin with one minute of easy running and two minutes of walking for twenty minutes, three times a week. Add a "
     "little more running each week, and keep the pace slow enough that you could still hold a conversation."),
]


# Appended to the README's command lines: sizes only (see the module docstring).
SMALLER = {"prepare": [], "extract": [], "train": ["--epochs", "1"],
           "evaluate": ["--max-new-tokens", "8", "--set", "extra_prompts=[]", "--set", "compare_untrained=false"]}


def readme_commands(heading: str) -> list[list[str]]:
    """The ``dflash-stages`` command lines of the first fenced block under ``## heading`` in README.md."""
    text = README.read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, f"README.md section {heading!r} has no fenced bash block"
    lines = [shlex.split(line, comments=True) for line in block.group(1).splitlines()]
    return [words for words in lines if words]


def test_readme_chat_data_commands_run_as_written(tmp_path, monkeypatch, capsys):
    commands = readme_commands("Your own chat data")
    assert [words[:2] for words in commands] == [["dflash-stages", "prepare"], ["dflash-stages", "extract"],
                                                ["dflash-stages", "train"], ["dflash-stages", "evaluate"]]
    with (tmp_path / "chats.jsonl").open("w") as out:
        for question, answer in CONVERSATIONS:
            out.write(json.dumps({"messages": [{"role": "user", "content": question},
                                               {"role": "assistant", "content": answer}]}) + "\n")
    monkeypatch.chdir(tmp_path)
    outputs = []
    for words in commands:
        code, out, err = main_in_process_out(monkeypatch, capsys, *words[1:], *SMALLER[words[1]])
        assert code == 0, f"{shlex.join(words)} exited {code}:\n{err[-3000:]}"
        outputs.append(out + err)

    from dflash.cache import CacheReader
    from dflash.corpus.format import open_corpus

    train, held = open_corpus(tmp_path / "data" / "corpus"), open_corpus(tmp_path / "data" / "corpus" / "heldout")
    assert (len(train), len(held)) == (9, 1)
    assert CacheReader(tmp_path / "data" / "cache").metadata.corpus_fingerprint == train.fingerprint
    assert "held out 1 documents" in " ".join(outputs[0].split())
    evaluation = " ".join(outputs[-1].split())
    assert re.search(r"tau = \d\.\d{3}", evaluation), evaluation[-2000:]
    assert f"1 (held-out rows of data/corpus (its split's {(tmp_path / 'data' / 'corpus' / 'heldout').resolve()}))" \
        in evaluation, evaluation[-2000:]  # the prompts come from the held-out conversation
    # The evaluation lands in the run folder, where report, diff and inspect show it as the evaluated tau.
    from stages.forensics.runs import evaluated_tau

    final = json.loads((tmp_path / "runs" / "r1" / "eval" / "final.json").read_text())
    assert f"tau = {final['tau']:.3f}" in evaluation
    assert evaluated_tau(tmp_path / "runs" / "r1")["tau"] == final["tau"]
