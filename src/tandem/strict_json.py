"""Strict JSON for everything tandem writes: numbers that are not finite become ``null``.

Python's :mod:`json` writes ``NaN``, ``Infinity`` and ``-Infinity``, which strict parsers
(JavaScript's ``JSON.parse``, jq, Go's and Rust's decoders) reject, and a diverged run's loss is
NaN. Every summary, ``metrics.jsonl`` line, trace, plan, profile and ``--json`` output goes
through :func:`dumps`::

    dumps({"loss": float("nan"), "step": 3})   # '{"loss": null, "step": 3}'
"""

from __future__ import annotations

import json
import math
from typing import Any


def strict(value: Any) -> Any:
    """``value`` with every non-finite float, however deeply nested, replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: strict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(item) for item in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` of :func:`strict` ``(value)``; never writes ``NaN`` or ``Infinity``."""
    return json.dumps(strict(value), allow_nan=False, **kwargs)
