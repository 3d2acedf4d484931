"""tandem's layers, read from the source: every module has a layer, imports only its own layer or
those below, and no import circle exists, at module level or inside functions.

The modules are found by walking ``src/tandem``; the imports by reading each file's syntax tree
(imports under ``if TYPE_CHECKING:`` never run and are left out, and so are the imports
marked :data:`DELAYS_TORCH`). A module that appears in no
layer fails the test, so a new package must be placed in the picture before it can land.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parent.parent / "src"

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("spec", ("tandem", "tandem.errors", "tandem.strict_json", "tandem.output_files",
              "tandem.cluster", "tandem.profile", "tandem.plan", "tandem.strategy",
              "tandem.timeline", "tandem.topology", "tandem.spec", "tandem.schedule")),
    ("planning", ("tandem.planning",)),
    ("components", ("tandem.structures", "tandem.loss", "tandem.data", "tandem.models",
                    "tandem.split", "tandem.compress", "tandem.sync")),
    ("runtime", ("tandem.runtime",)),
    ("entry", ("tandem.api", "tandem.cli", "tandem.__main__", "tandem.commands")),
]
"""Layers from the bottom up, each by the modules and packages it holds (a package holds its
submodules). ``spec`` and ``planning`` are the planning side: no torch."""

PLANNING_SIDE = ("spec", "planning")

DELAYS_TORCH = "# delays torch"
"""The mark of an import inside a function that is there only so that torch is imported late
(the command line answers ``--help`` without it): such an import may close a circle."""


def modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    found = {}
    for path in sorted((SOURCE / "tandem").rglob("*.py")):
        parts = path.relative_to(SOURCE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def layer_of(module: str) -> int | None:
    """Index in :data:`LAYERS` of the most specific entry holding ``module``."""
    best: tuple[int, int] | None = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or (prefix != "tandem" and module.startswith(prefix + ".")):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), index)
            elif prefix == "tandem" and module == "tandem":
                best = (len(prefix), index)
    return None if best is None else best[1]


def _runtime_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements that run: everything but the body of ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in _runtime_imports_of(child))
            continue
        yield from _runtime_imports_of(node)


def _runtime_imports_of(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    else:
        yield from _runtime_imports(node)


def imports(known: dict[str, Path]) -> dict[str, dict[str, int]]:
    """Module -> the tandem modules it imports (resolved to a known module) -> first line."""
    result: dict[str, dict[str, int]] = {}
    for name, path in known.items():
        targets: dict[str, int] = {}
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        text = path.read_text()
        lines = text.splitlines()
        for node in _runtime_imports(ast.parse(text, str(path))):
            if DELAYS_TORCH in lines[node.lineno - 1]:
                continue
            if isinstance(node, ast.Import):
                wanted = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                    + ([base] if base else []))
                # ``from package import submodule`` imports the submodule (and, as every import
                # of a submodule does, its package); ``from module import name``: the module
                wanted = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                          for alias in node.names]
            for target in wanted:
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target and target != name and target.startswith("tandem"):
                    targets.setdefault(target, node.lineno)
        result[name] = targets
    return result


GRAPH = imports(modules())


@pytest.mark.pure
def test_every_module_has_a_layer() -> None:
    orphans = [name for name in GRAPH if layer_of(name) is None]
    assert not orphans, f"modules in no layer of tests/test_layers.py's LAYERS: {orphans}"


@pytest.mark.pure
def test_no_module_imports_a_layer_above_its_own() -> None:
    wrong = []
    for name, targets in GRAPH.items():
        mine = layer_of(name)
        for target, line in targets.items():
            theirs = layer_of(target)
            if mine is not None and theirs is not None and theirs > mine:
                wrong.append(f"{name}:{line} ({LAYERS[mine][0]}) imports {target} "
                             f"({LAYERS[theirs][0]})")
    assert not wrong, "\n".join(wrong)


@pytest.mark.pure
def test_api_imports_no_command_module() -> None:
    commands = [t for t in GRAPH["tandem.api"] if t.startswith("tandem.commands")]
    assert not commands, f"tandem.api imports the command line's modules {commands}"


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The import circles of ``graph``: its strongly connected components of two or more
    modules (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, {}))))
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


@pytest.mark.pure
def test_circles_are_found() -> None:
    """The detector itself, on a made-up graph: a circle of three, a self-free chain."""
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}, "e": {}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b": 1}, "b": {}}) == []


@pytest.mark.pure
def test_no_import_circle() -> None:
    found = circles(GRAPH)
    lines = [" -> ".join(f"{m} ({', '.join(f'{t}:{GRAPH[m][t]}' for t in GRAPH[m] if t in c)})"
                         for m in c) for c in found]
    assert not found, "import circles:\n" + "\n".join(lines)


@pytest.mark.cli
def test_planning_side_imports_without_torch() -> None:
    """Every module of the ``spec`` and ``planning`` layers imports in an interpreter where
    ``torch`` cannot be imported (so ``torch.distributed`` least of all): the planning side is
    pure Python and numpy."""
    side = [name for name in GRAPH if LAYERS[layer_of(name) or 0][0] in PLANNING_SIDE]
    script = textwrap.dedent(f"""
        import importlib, sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("blocked: " + name)
                return None
        sys.meta_path.insert(0, Block())
        for name in {side!r}:
            importlib.import_module(name)
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
