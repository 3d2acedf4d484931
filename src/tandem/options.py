"""Parsing of compact ``name:key=value,...`` specifications into typed option dataclasses.

Usage::

    name, raw = split_spec("gpt:layers=4,dim=128", what="model")
    opts = fill_options(GPTOptions, raw, spec="gpt:layers=4,dim=128", what="model")
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar, get_type_hints

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


def positive(name: str, value: float) -> None:
    """Raise ``ValueError`` unless ``value`` is strictly positive."""
    if value <= 0:
        raise ValueError(f"{name} must be positive (got {value})")
