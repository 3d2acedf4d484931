"""Parsing of compact ``name:key=value,...`` specifications into typed option dataclasses.

Usage::

    name, raw = split_spec("gpt:layers=4,dim=128", what="model")
    opts = fill_options(GPTOptions, raw, spec="gpt:layers=4,dim=128", what="model")
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import math
from typing import Any, Callable, TypeVar, get_type_hints

from tandem.errors import UsageError

T = TypeVar("T")


def split_spec(spec: str, *, what: str) -> tuple[str, dict[str, str]]:
    """Split ``name:k=v,k=v`` into the name and raw string options."""
    name, _, rest = spec.strip().partition(":")
    if not name:
        raise UsageError(f"empty {what} name in {spec!r}: write e.g. 'mlp' or 'mlp:hidden=64'")
    raw: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise UsageError(
                f"malformed {what} option {item!r} in {spec!r}: "
                f"expected key=value pairs separated by commas, e.g. {name}:key=value"
            )
        if key.strip() in raw:
            raise UsageError(f"{what} option {key.strip()!r} given twice in {spec!r}")
        raw[key.strip()] = value.strip()
    return name, raw


def _convert(value: str, kind: Any, key: str, spec: str, what: str) -> Any:
    try:
        if kind is bool:
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if kind is int:
            return int(value)
        if kind is float:
            return float(value)
        return str(value)
    except ValueError:
        type_name = getattr(kind, "__name__", str(kind))
        raise UsageError(
            f"{what} option {key}={value!r} in {spec!r} is not a valid {type_name}"
        ) from None


def fill_options(cls: type[T], raw: dict[str, str], *, spec: str, what: str) -> T:
    """Build the options dataclass ``cls`` from raw strings, rejecting unknown keys."""
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = get_type_hints(cls)
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise UsageError(
            f"unknown {what} option {unknown[0]!r} in {spec!r}; "
            f"valid options: {', '.join(sorted(fields)) or '(none)'}"
        )
    values = {key: _convert(value, hints[key], key, spec, what) for key, value in raw.items()}
    try:
        return cls(**values)
    except ValueError as exc:
        raise UsageError(f"bad {what} options in {spec!r}: {exc}") from None


MAX_SEED = 2**32 - 1
"""Largest seed accepted anywhere (as NumPy's): every seed fits torch's generators with room for
the offsets added to it."""


def path_spec(spec: str, cls: type[T], *, what: str, example: str) -> tuple[str, T]:
    """The path and options of ``PREFIX:PATH[:key=value,...]`` (``folder:``, ``shards:``); a
    last ``:``-part with ``=`` in it is the options, so the path may hold colons."""
    prefix, _, rest = spec.partition(":")
    path_text, options_text = rest, ""
    head, sep, tail = rest.rpartition(":")
    if sep and "=" in tail:
        path_text, options_text = head, tail
    if not path_text:
        raise UsageError(f"--data {spec!r} names no {what}; write {prefix}:PATH, e.g. "
                         f"{example}")
    _, raw = split_spec(f"{prefix}:{options_text}", what=prefix)
    return path_text, fill_options(cls, raw, spec=spec, what=prefix)


def check_seed(name: str, value: int) -> None:
    """Raise ``ValueError`` unless ``value`` is a seed in ``[0, MAX_SEED]``."""
    if not 0 <= value <= MAX_SEED:
        raise ValueError(f"{name} must be between 0 and {MAX_SEED} (got {name}={value}); "
                         f"e.g. {name}=0")


def positive(name: str, value: float, example: object = None) -> None:
    """Raise ``ValueError`` unless ``value`` is a finite number above zero (not nan or inf);
    the message suggests ``name=example`` when given."""
    if not (value > 0 and math.isfinite(value)):
        fix = f"; e.g. {name}={example}" if example is not None else ""
        raise ValueError(f"{name} must be a positive finite number (got {name}={value}){fix}")


def literal(value: str) -> Any:
    """A Python literal (``64``, ``0.5``, ``True``, ``'a'``) or else the text itself."""
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return value


def user_function(spec: str, *, what: str) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The function named by ``package.module:function[:key=value,...]`` and its options as
    keyword arguments (values read as Python literals); ``what`` names the flag in messages
    (``model``, ``--data``, ``--loss``)."""
    module_name, _, rest = spec.partition(":")
    function_name, _, options_text = rest.partition(":")
    if not module_name or not function_name:
        raise UsageError(f"{what} {spec!r} is not package.module:function; e.g. "
                         f"mypkg.module:build")
    _, raw = split_spec(f"x:{options_text}", what=what.lstrip("-"))
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"cannot import module {module_name!r} of {what} {spec!r} ({exc}); "
                         f"check the name and that it is on PYTHONPATH") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise UsageError(f"module {module_name!r} has no function {function_name!r} "
                         f"({what} {spec!r})")
    return function, {key: literal(value) for key, value in raw.items()}
