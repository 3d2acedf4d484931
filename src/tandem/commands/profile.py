"""The ``tandem profile`` command: measure a model's layers and write a ModelProfile."""

from __future__ import annotations

import argparse

from tandem.errors import UsageError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``tandem profile``."""
    p = subparsers.add_parser(
        "profile",
        help="measure per-layer time and sizes of a model",
        description="Measure every top-level block of a model on the local device.",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Profile the model (not yet implemented)."""
    raise UsageError("tandem profile is not implemented yet")
