"""The shape of the code, read from the source: no file over 500 lines, and in the runtime and
the sync strategies no god object — no class over 250 lines or 20 attributes, no constructor
over 8 parameters (a longer list of settings is a value object: a dataclass).

Dataclasses are the value objects that replace long argument lists, so their fields are not
counted as a class's attributes or its constructor's parameters; their length is.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "tandem"
MAX_FILE_LINES = 500
MAX_CLASS_LINES = 250
MAX_ATTRIBUTES = 20
MAX_PARAMETERS = 8
WORKER_SIDE = ("runtime", "sync")
"""Packages that hold the workers and their parts, where the class limits apply."""


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _is_dataclass(node: ast.ClassDef) -> bool:
    return any("dataclass" in ast.unparse(decorator) for decorator in node.decorator_list)


def attributes(node: ast.ClassDef) -> set[str]:
    """The names a class's methods assign on ``self`` (``self.x = ...``, also in a tuple)."""
    names = set()
    for sub in ast.walk(node):
        targets: list[ast.expr] = []
        if isinstance(sub, ast.Assign):
            targets = sub.targets
        elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
            targets = [sub.target]
        while targets:
            target = targets.pop()
            if isinstance(target, (ast.Tuple, ast.List)):
                targets.extend(target.elts)
            elif (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                    and target.value.id == "self"):
                names.add(target.attr)  # self.x = ...; not self.x.y = ... (x's own attribute)
    return names


def parameters(node: ast.ClassDef) -> int | None:
    """How many arguments the class's own ``__init__`` takes besides ``self`` (None: none)."""
    for item in node.body:
        if isinstance(item, ast.FunctionDef) and item.name == "__init__":
            args = item.args
            return len(args.posonlyargs) + len(args.args) - 1 + len(args.kwonlyargs)
    return None


def test_no_file_over_the_limit() -> None:
    long = [f"{path.relative_to(PACKAGE.parent)}: {count} lines" for path in _sources()
            if (count := len(path.read_text().splitlines())) > MAX_FILE_LINES]
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}"


def test_no_god_object_on_the_worker_side() -> None:
    found = []
    for path in _sources():
        if path.relative_to(PACKAGE).parts[0] not in WORKER_SIDE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}"
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_CLASS_LINES:
                found.append(f"{where}: {length} lines")
            if _is_dataclass(node):
                continue
            count = len(attributes(node))
            if count > MAX_ATTRIBUTES:
                found.append(f"{where}: {count} attributes")
            arguments = parameters(node)
            if arguments is not None and arguments > MAX_PARAMETERS:
                found.append(f"{where}: a constructor of {arguments} parameters")
    assert not found, "\n".join(found)


def test_the_measures_count_what_they_say() -> None:
    """The measures themselves, on a made-up class."""
    tree = ast.parse("class A:\n"
                     "    def __init__(self, a, b, *, c, d=1):\n"
                     "        self.x = a\n"
                     "        self.y: int = b\n"
                     "        self.x += 1\n"
                     "        self.z, other.w = c, d\n"
                     "        self.x.v = 2\n")
    node = tree.body[0]
    assert isinstance(node, ast.ClassDef)
    assert attributes(node) == {"x", "y", "z"}
    assert parameters(node) == 4
