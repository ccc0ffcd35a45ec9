"""The import rule of the code: ``pipelines -> stages -> dflash``, one direction, and no import circle.

The graph is built with :mod:`ast` from every import statement of ``dflash/``, ``stages/`` and ``pipelines/``,
the ones inside functions included (a function-local import still makes one module depend on another; deferring
it only hides a circle until the function runs). Modules named by a string count too: the argument of
``importlib.import_module``, ``importlib.util.find_spec`` or ``importlib.resources.files`` (a package's data is
part of it), and any string in a module-level constant that is a module's full name (tables of modules loaded by
name later, as the CLI's list of command modules). Imports under ``if TYPE_CHECKING:`` are left out, since they
never run and only name types, except in a module that defines a module-level ``__getattr__``: such a facade loads
exactly those names lazily, so they are its real dependencies.

``stages.cli``, the composition root, is the one module allowed to name a higher floor: it registers the commands
of ``pipelines``. Besides module circles, the packages themselves (``dflash.cache``, ``dflash.batches``, ...;
``stages.train``, ...) must not form a circle: two packages that each reach into the other are one contract split
in two.
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
#: The composition root: the one module that may name a higher floor (it registers the pipeline commands).
COMPOSITION_ROOT = "stages.cli"
#: Calls whose first argument, a string literal, names a module or package the caller depends on.
_BY_NAME_CALLS = {"import_module", "find_spec", "files"}


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


def _is_facade(tree: ast.AST) -> bool:
    return any(isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
               for node in getattr(tree, "body", []))


def _imported_names(tree: ast.AST, module: str, is_package: bool, known: frozenset[str] = frozenset()):
    """Every dotted name ``tree`` depends on: its import statements (``from a.b import c`` gives a.b and a.b.c),
    the string arguments of :data:`_BY_NAME_CALLS`, and the strings of module-level constants that are in
    ``known`` (full module names)."""
    skipped = set() if _is_facade(tree) else {
        id(node) for stmt in ast.walk(tree) if isinstance(stmt, ast.If) and _is_type_checking(stmt.test)
        for child in stmt.body for node in ast.walk(child)}
    for stmt in getattr(tree, "body", []):
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
            yield from (node.value for node in ast.walk(stmt.value)
                        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in known)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if called in _BY_NAME_CALLS:
                yield node.args[0].value
        elif isinstance(node, ast.Import):
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
    known = frozenset(modules)
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for name in _imported_names(tree, module, path.name == "__init__.py", known):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                graph[module].add(name)
        graph.setdefault(module, set())
    return graph


def upward(graph: dict[str, set[str]]) -> list[str]:
    """``"A imports B"`` for every edge from a module to a module of a higher floor, the composition root's aside."""
    return [f"{module} imports {target}" for module, targets in sorted(graph.items()) for target in sorted(targets)
            if FLOORS[target.split(".")[0]] > FLOORS[module.split(".")[0]] and module != COMPOSITION_ROOT]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph folded onto packages one level below the top (``dflash.cache.reader`` -> ``dflash.cache``;
    a top-level module such as ``dflash.errors`` stays itself)."""
    def package(name: str) -> str:
        return ".".join(name.split(".")[:2])

    folded: dict[str, set[str]] = defaultdict(set)
    for module, targets in graph.items():
        folded[package(module)].update(package(t) for t in targets if package(t) != package(module))
    return dict(folded)


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
    found = upward(fresh_import_graph())
    assert not found, "the import rule is pipelines -> stages -> dflash; move the shared code down:\n" + "\n".join(found)


def test_there_is_no_import_circle():
    graph = fresh_import_graph()
    found = circles(graph)
    described = ["; ".join(f"{a} -> {b}" for a in circle for b in sorted(graph[a]) if b in circle) for circle in found]
    assert not found, "import circles (break each by moving the shared code into a module both can import):\n" + \
        "\n".join(described)


def test_no_two_packages_depend_on_each_other():
    graph = package_graph(fresh_import_graph())
    found = circles(graph)
    described = ["; ".join(f"{a} -> {b}" for a in circle for b in sorted(graph[a]) if b in circle) for circle in found]
    assert not found, "package circles (one contract split over two packages; move the shared module):\n" + \
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
    by_name = ast.parse("import importlib\nfrom importlib import resources\nMODULES = [('pipelines.online', 'X')]\n"
                        "NOTE = 'pipelines.offline is a module'\n"
                        "def f():\n    importlib.import_module('stages.sweep')\n    resources.files('pipelines')\n")
    names = set(_imported_names(by_name, "stages.x", False, frozenset({"pipelines.online", "pipelines.offline"})))
    assert {"pipelines.online", "stages.sweep", "pipelines"} <= names and "pipelines.offline" not in names
    facade = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dflash.cache import reader\n"
                       "def __getattr__(name):\n    pass\n")
    assert "dflash.cache" in set(_imported_names(facade, "dflash.x", True))
    assert upward({"dflash.a": {"stages.b"}, "stages.b": {"dflash.a", "pipelines.c"}, COMPOSITION_ROOT: {"pipelines.c"},
                   "pipelines.c": {"stages.b"}}) == ["dflash.a imports stages.b", "stages.b imports pipelines.c"]
    folded = package_graph({"dflash.cache.reader": {"dflash.batches.shm", "dflash.cache.store"},
                            "dflash.batches.online": {"dflash.cache.staging"}, "dflash.errors": set()})
    assert circles(folded) == [["dflash.batches", "dflash.cache"]]
    real = fresh_import_graph()
    assert "dflash.cache.format" in real["dflash.cache.reader"]  # the real tree is read, function bodies included


if __name__ == "__main__":  # fresh_import_graph's subprocess
    print(json.dumps({module: sorted(imported) for module, imported in import_graph().items()}))
