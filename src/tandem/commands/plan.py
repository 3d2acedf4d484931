"""The ``tandem plan`` command: choose stages and replicas for a model on a cluster."""

from __future__ import annotations

import argparse

from tandem.errors import UsageError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``tandem plan``."""
    p = subparsers.add_parser(
        "plan",
        help="choose pipeline stages and replication",
        description="Choose stages and replicas with PipeDream's partitioner.",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Plan (not yet implemented)."""
    raise UsageError("tandem plan is not implemented yet")
