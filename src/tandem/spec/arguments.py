"""The types of settings given as Python values (``tandem.fit(steps=200, servers=1)``): checked
as the command line's parsing checks its words, so that a wrong one is one line naming it,
not a ``TypeError`` from deep inside (``'<' not supported between 'str' and 'int'``).

Usage::

    value = checked_type("steps", value, "int", flag="--steps")    # 10 -> 10; "10" -> UsageError
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping
from typing import Any

from tandem.errors import UsageError

KINDS: dict[str, tuple[tuple[type, ...], str, str]] = {
    "int": ((numbers.Integral,), "a whole number", "10"),
    "float": ((numbers.Real,), "a number", "0.1"),
    "str": ((str,), "a string", "'...'"),
    "bool": ((bool,), "True or False", "True"),
    "dict": ((Mapping,), "a dict", "{...}"),
    "path": ((str, os.PathLike), "a path", "'runs/a'"),
}
"""A kind of setting -> the Python types it takes, how messages name it, an example."""


def checked_type(name: str, value: Any, kind: str, *, flag: str, optional: bool = False) -> Any:
    """``value`` of setting ``name`` (``flag`` on the command line) if it is of ``kind`` (a
    key of :data:`KINDS`; None too where ``optional``), as the plain Python value (an
    ``int`` of a numpy integer, a ``str`` of a path); else one line naming it."""
    if value is None and optional:
        return None
    types, what, example = KINDS[kind]
    if not _of(value, types, numeric=kind in ("int", "float")):
        shown = f"{what} or None" if optional else what
        kind_of = "None" if value is None else _a(type(value).__name__)
        raise UsageError(f"{name}={value!r} is {kind_of}, but {name} takes {shown}, as {flag} "
                         f"does; e.g. {name}={_example(value, kind, example)}")
    if kind == "int":
        return int(value)
    if kind == "float":
        return float(value)
    if kind == "path":
        return os.fspath(value)
    return value


def annotation_kind(annotation: str) -> tuple[str, bool] | None:
    """A dataclass field's annotation (``"int | None"``) as a kind of :data:`KINDS` and whether
    None is allowed; None where it is none of them."""
    parts = [part.strip() for part in str(annotation).split("|")]
    optional = "None" in parts
    kinds = [part.split("[")[0] for part in parts if part != "None"]
    if len(kinds) != 1 or kinds[0] not in KINDS:
        return None
    return kinds[0], optional


def _example(value: Any, kind: str, example: str) -> str:
    """The value to suggest: a number written as a string, as the number (``'0.1'``: 0.1)."""
    if isinstance(value, str) and kind in ("int", "float"):
        try:
            return repr(int(value) if kind == "int" else float(value))
        except ValueError:
            pass
    return example


def _of(value: Any, types: tuple[type, ...], *, numeric: bool) -> bool:
    """Whether ``value`` is one of ``types`` (a ``bool`` is no number here)."""
    return isinstance(value, types) and not (numeric and isinstance(value, bool))


def _a(noun: str) -> str:
    return f"an {noun}" if noun[:1] in "aeiou" else f"a {noun}"
