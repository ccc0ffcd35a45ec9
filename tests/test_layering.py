"""The import rule of the code: ``pipelines -> stages -> dflash``, one direction, and no import circle.

The graph is built with :mod:`ast` from every import statement of ``dflash/``, ``stages/`` and ``pipelines/``,
the ones inside functions included (a function-local import still makes one module depend on another; deferring
it only hides a circle until the function runs). Imports under ``if TYPE_CHECKING:`` are left out: they never run
and only name types for annotations.

``stages.cli``, the composition root, may name the commands of ``pipelines`` (it loads them by name with
:func:`importlib.import_module`, which is no import statement and so no edge here).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Each top-level package and its floor: a module may import its own floor and the floors below it.
FLOORS = {"dflash": 0, "stages": 1, "pipelines": 2}


def _modules() -> dict[str, Path]:
    modules = {}
    for package in FLOORS:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(tree: ast.AST, module: str, is_package: bool):
    """Every dotted name an import statement of ``tree`` brings in (``from a.b import c`` gives a.b and a.b.c)."""
    skipped = {id(node) for stmt in ast.walk(tree) if isinstance(stmt, ast.If) and _is_type_checking(stmt.test)
               for child in stmt.body for node in ast.walk(child)}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[:len(package) - node.level + 1]
                base = ".".join([*package, base] if base else package)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the three packages it imports (the longest known prefix of each imported name)."""
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for name in _imported_names(tree, module, path.name == "__init__.py"):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                graph[module].add(name)
        graph.setdefault(module, set())
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def fresh_import_graph() -> dict[str, set[str]]:
    """:func:`import_graph` built in a new interpreter: CPython 3.11's ``ast`` can fail with "AST constructor
    recursion depth mismatch" in a process where an earlier test hit a ``RecursionError`` (deep JSON, deep YAML)."""
    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=120, check=True)
    return {module: set(imported) for module, imported in json.loads(done.stdout).items()}


def test_no_module_imports_a_higher_floor():
    graph = fresh_import_graph()
    upward = [f"{module} imports {target}" for module, targets in sorted(graph.items()) for target in sorted(targets)
              if FLOORS[target.split(".")[0]] > FLOORS[module.split(".")[0]]]
    assert not upward, "the import rule is pipelines -> stages -> dflash; move the shared code down:\n" + "\n".join(upward)


def test_there_is_no_import_circle():
    graph = fresh_import_graph()
    found = circles(graph)
    described = ["; ".join(f"{a} -> {b}" for a in circle for b in sorted(graph[a]) if b in circle) for circle in found]
    assert not found, "import circles (break each by moving the shared code into a module both can import):\n" + \
        "\n".join(described)


def test_the_checks_see_a_circle_and_an_upward_import(tmp_path):
    graph = {"dflash.a": {"dflash.b"}, "dflash.b": {"dflash.c"}, "dflash.c": {"dflash.a"}, "dflash.d": {"dflash.a"}}
    assert circles(graph) == [["dflash.a", "dflash.b", "dflash.c"]]
    tree = ast.parse("from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n    from stages.x import Y\n"
                     "def f():\n    from ..batches import ring\n    import pipelines.offline\n")
    names = set(_imported_names(tree, "dflash.target.load", is_package=False))
    assert {"dflash.batches", "dflash.batches.ring", "pipelines.offline"} <= names
    assert not any(name.startswith("stages") for name in names)
    real = fresh_import_graph()
    assert "dflash.cache.format" in real["dflash.cache.reader"]  # the real tree is read, function bodies included


if __name__ == "__main__":  # fresh_import_graph's subprocess
    print(json.dumps({module: sorted(imported) for module, imported in import_graph().items()}))
