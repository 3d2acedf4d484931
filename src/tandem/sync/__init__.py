"""Synchronization strategies of data-parallel training, by name.

Usage::

    strategy = build_strategy("dp")
    module = strategy.wrap(model, device)
"""

from __future__ import annotations

from tandem.errors import UsageError
from tandem.sync.allreduce import AllReduce
from tandem.sync.base import SyncStrategy

__all__ = ["STRATEGIES", "AllReduce", "SyncStrategy", "build_strategy"]

STRATEGIES: dict[str, type[SyncStrategy]] = {"dp": AllReduce}


def build_strategy(name: str) -> SyncStrategy:
    """The synchronization strategy called ``name``."""
    if name not in STRATEGIES:
        raise UsageError(f"unknown strategy {name!r}; choose one of: {', '.join(sorted(STRATEGIES))}")
    return STRATEGIES[name]()
