"""The embedded default prompt set with extra training sources from installed packages (``packages``): real
files of an installed package (typer, a dependency of this project), three real stdlib files."""

from __future__ import annotations

import ast
import dataclasses
import re
from collections import Counter

import pytest

import dflash.generation.default_prompts
from dflash.corpus.default_corpus import TextFile, collect_text_files, stdlib_root
from dflash.errors import ConfigError
from dflash.generation.default_prompts import (
    DefaultPromptConfig,
    default_prompt_sets,
    describe_default_prompts,
    is_heldout_document,
    package_root,
    prompt_kind,
)
from tests.cli_helpers import main_in_process


@pytest.fixture
def three_stdlib_files(monkeypatch):
    names = ("bisect.py", "colorsys.py", "keyword.py")
    files = [TextFile(stdlib_root() / name, f"stdlib:{name}") for name in names]
    monkeypatch.setattr(dflash.generation.default_prompts, "default_corpus_files", lambda **_: files)


def _key(record):
    return record.prompt_id, record.text, str(record.messages), record.document


def test_package_prompts_join_training_only_spread_over_files(three_stdlib_files):
    plain = default_prompt_sets(DefaultPromptConfig(heldout_permille=300))
    config = DefaultPromptConfig(heldout_permille=300, packages=("typer",), package_prompts=20)
    mixed = default_prompt_sets(config)

    assert mixed["heldout"] == plain["heldout"]  # the held-out split stays the stdlib's
    stdlib = [r for r in mixed["train"] if r.document.startswith("stdlib:")]
    from_package = [r for r in mixed["train"] if not r.document.startswith("stdlib:")]
    assert sorted(map(_key, stdlib)) == sorted(map(_key, plain["train"]))  # the same stdlib prompts as without
    assert len(from_package) == 20

    root = package_root("typer")
    files = collect_text_files(root, patterns=("*.py",), source="typer")
    relative = {f.sample_id: f"typer/{f.path.relative_to(root).as_posix()}" for f in files}
    held = {sample_id for sample_id, rel in relative.items() if is_heldout_document(rel, 300)}
    assert held  # some of typer's files fall in the held-out range: the next check is not vacuous
    used = Counter(r.document for r in from_package)
    assert not set(used) & held  # a package file in the held-out range is never trained on
    assert set(used) <= set(relative)  # documents are <package>:<relative path> of real files
    eligible = len(set(relative) - held)
    assert len(used) == min(20, eligible) or max(used.values()) - min(used.values()) <= 1  # one per file per round
    assert all(r.prompt_id.startswith(r.document) for r in from_package)
    for record in from_package[:5]:  # completions are real text of that file
        if record.text is not None:
            assert record.text in (root / record.document.split(":", 1)[1]).read_text(encoding="utf-8")

    again = default_prompt_sets(config)
    assert [_key(r) for r in again["train"]] == [_key(r) for r in mixed["train"]]  # seeded, the same every time
    # shuffled in with the stdlib's, not appended
    positions = [i for i, r in enumerate(mixed["train"]) if r.document.startswith("stdlib:")]
    assert positions != list(range(len(positions)))

    every = default_prompt_sets(DefaultPromptConfig(heldout_permille=300, packages=("typer",)))
    counted = Counter(r.document for r in every["train"] if not r.document.startswith("stdlib:"))
    assert sum(counted.values()) > 20 and max(counted.values()) > 1  # None takes every prompt of every file

    described = describe_default_prompts(config)
    assert described["packages"] == ["typer"] and described["package_prompts"] == 20
    from importlib.metadata import version

    assert described["package_versions"] == {"typer": version("typer")}


@pytest.mark.parametrize(("settings", "message"), [
    ({"packages": ("no_such_package_here",)}, "'no_such_package_here' is not an installed package"),
    ({"packages": ("keyword",)}, "'keyword' is not an installed package (a folder of sources)"),  # a module
    ({"packages": ("typer", "typer")}, "names a package twice"),
    ({"packages": "typer"}, "must be a list of package names"),
    ({"package_prompts": 5}, "package_prompts is set but packages is empty"),
    ({"packages": ("typer",), "package_prompts": 0}, "package_prompts must be >= 1"),
])
def test_bad_package_settings_are_refused(settings, message):
    with pytest.raises(ConfigError) as raised:
        DefaultPromptConfig(**settings)
    assert message in str(raised.value)


def test_definitions_follow_ast_walk_on_every_stdlib_file():
    """The statement-only walk finds the same definitions in the same order as ast.walk, on real sources."""
    import ast

    from dflash.corpus.default_corpus import default_corpus_files
    from dflash.generation.default_prompts import _definitions

    kinds = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
    checked = 0
    for file in default_corpus_files():
        try:
            tree = ast.parse(file.path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        expected = [node for node in ast.walk(tree) if isinstance(node, kinds)]
        assert _definitions(tree) == expected, file.path
        checked += len(expected)
    assert checked > 10_000  # the stdlib holds tens of thousands of definitions


def test_prompts_built_in_processes_equal_those_built_here(caplog):
    """processes=2 (a spawned pool over the stdlib's files) gives exactly the records of processes=1."""
    config = DefaultPromptConfig(max_prompts=3000, max_heldout=100)
    here = default_prompt_sets(config)
    with caplog.at_level("WARNING", logger="dflash.generation.default_prompts"):
        pooled = default_prompt_sets(config, processes=2)
    assert not [r for r in caplog.records if "process pool failed" in r.getMessage()]  # the pool itself built them
    assert [_key(r) for r in pooled["train"]] == [_key(r) for r in here["train"]]
    assert [_key(r) for r in pooled["heldout"]] == [_key(r) for r in here["heldout"]]
    assert len(here["train"]) == 3000 and len(here["heldout"]) == 100


@pytest.fixture
def four_stdlib_files(monkeypatch):
    """Two training files with documented functions, one (json/decoder.py) with classes and methods, and one
    held-out file (json/__init__.py, at heldout_permille 300) with documented functions."""
    names = ("bisect.py", "json/__init__.py", "json/decoder.py", "netrc.py")
    files = [TextFile(stdlib_root() / name, f"stdlib:{name}") for name in names]
    monkeypatch.setattr(dflash.generation.default_prompts, "default_corpus_files", lambda **_: files)
    return names


#: The definition a question names: its dotted path and signature, the question's first backticked call.
_NAMED = re.compile(r"`([\w.]+)\((.*?)\)`")


def _parameter_names(args):
    names = [a.arg for a in (*args.posonlyargs, *args.args)]
    names += [f"*{args.vararg.arg}"] if args.vararg else []
    names += [a.arg for a in args.kwonlyargs]
    return names + ([f"**{args.kwarg.arg}"] if args.kwarg else [])


def _check_question(record):
    """The record asks about a definition that exists, as named, in its document's source (read here with ast)."""
    assert record.text is None and record.messages[1] == {"role": "assistant", "content": None}
    content = record.messages[0]["content"]
    assert record.messages[0]["role"] == "user" and "```" not in content and "\n" not in content  # no code quoted
    path, signature = _NAMED.search(content).groups()
    source, relative = record.document.split(":", 1)
    file = (stdlib_root() if source == "stdlib" else package_root(source)) / relative
    parts = ([] if source == "stdlib" else [source]) + relative.removesuffix(".py").split("/")
    module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    assert path.startswith(f"{module}.") and not any(part.startswith("_") for part in path.split("."))  # public
    names = path[len(module) + 1 :].split(".")
    node = next(n for n in ast.parse(file.read_text(encoding="utf-8")).body if getattr(n, "name", None) == names[0])
    if len(names) == 2:  # a method
        node = next(n for n in node.body if getattr(n, "name", None) == names[1])
    assert record.prompt_id == f"{record.document}:{node.lineno}:ask"
    summary = " ".join(ast.get_docstring(node).split("\n\n")[0].split())
    assert summary[:60] in content  # the question quotes its docstring's summary
    function = next(n for n in node.body if getattr(n, "name", None) == "__init__") if isinstance(node, ast.ClassDef) \
        else node
    static = any(ast.unparse(d) == "staticmethod" for d in function.decorator_list)
    named = ast.parse(f"def f({signature}): pass").body[0].args
    if isinstance(node, ast.ClassDef) or (len(names) == 2 and not static):  # self / cls left out
        assert _parameter_names(named) == _parameter_names(function.args)[1:]
        assert ast.unparse(function.args).endswith(signature)
    else:
        assert ast.unparse(function.args) == signature
    return node


def test_ask_prompts_are_questions_about_documented_definitions_of_training_files(four_stdlib_files, caplog):
    """``ask`` prompts of the stdlib's training files and of an installed package (typer): chat questions naming a
    documented public function, class or method by dotted path and signature as its real source has them, no code
    quoted; seeded; none from a held-out file; the other kinds unchanged; the counts recorded."""
    config = DefaultPromptConfig(heldout_permille=300, packages=("typer",), package_prompts=10, ask_prompts=30)
    sets = default_prompt_sets(config)
    asks = [r for r in sets["train"] if prompt_kind(r) == "ask"]
    assert len(asks) == 30 and not [r for r in sets["heldout"] if prompt_kind(r) == "ask"]

    assert is_heldout_document("json/__init__.py", 300) and not is_heldout_document("json/decoder.py", 300)
    assert "stdlib:json/__init__.py" in {r.document for r in sets["heldout"]}  # held out, with documented functions
    assert "stdlib:json/__init__.py" not in {r.document for r in asks}  # ... that give no question
    kinds = Counter(type(_check_question(record)).__name__ for record in asks)
    assert {r.document.split(":")[0] for r in asks} == {"stdlib", "typer"}
    assert kinds["FunctionDef"] and kinds["ClassDef"]  # functions, methods and classes
    assert len({r.messages[0]["content"][:12] for r in asks}) >= 3  # several question shapes

    every = default_prompt_sets(dataclasses.replace(config, ask_prompts=10**6))
    available = Counter(r.document for r in every["train"] if prompt_kind(r) == "ask")
    assert 30 < sum(available.values()) < 10**6
    used = Counter(r.document for r in asks)
    assert len(used) == min(30, len(available))  # spread over as many files as possible
    assert "ask_prompts is 1000000 but the training files hold" in caplog.text

    again = default_prompt_sets(config)
    assert [_key(r) for r in again["train"]] == [_key(r) for r in sets["train"]]  # seeded, the same every time
    without = default_prompt_sets(dataclasses.replace(config, ask_prompts=0))
    assert sorted(map(_key, without["train"])) == sorted(_key(r) for r in sets["train"] if prompt_kind(r) != "ask")
    assert without["heldout"] == sets["heldout"]

    counts = describe_default_prompts(config, sets)["prompt_counts"]
    assert counts["train"]["ask"] == 30 and counts["heldout"]["ask"] == 0
    assert sum(counts["train"].values()) == len(sets["train"]) and sum(counts["heldout"].values()) == len(sets["heldout"])


def test_a_bad_ask_prompts_setting_is_one_error_line(tmp_path, monkeypatch, capsys):
    for value, message in (("-1", "must be >= 0 (0: no ask prompts), got -1"), ("some", "expected int, got 'some'")):
        code, err = main_in_process(monkeypatch, capsys, "generate", "-o", str(tmp_path / "out"), "--set",
                                    f"default_prompts.ask_prompts={value}")
        assert code == 2 and err.strip() == (f"error: generate.default_prompts.ask_prompts (--set "
                                             f"default_prompts.ask_prompts={value}): {message}"), err
    assert not (tmp_path / "out").exists()
