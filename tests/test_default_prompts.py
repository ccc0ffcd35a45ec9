"""The embedded default prompt set with extra training sources from installed packages (``packages``): real
files of an installed package (typer, a dependency of this project), three real stdlib files."""

from __future__ import annotations

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
)


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
