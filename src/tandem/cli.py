"""The ``tandem`` command line: parse arguments, call the library, print results.

Each subcommand lives in ``tandem.commands.<name>`` and provides ``add_parser(subparsers)``,
which registers its arguments and sets ``run`` (a function of the parsed arguments returning
the exit status) as a default.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn, Sequence

from tandem.errors import UsageError, WorkerFailure

COMMANDS = ("train", "demo", "profile", "plan", "topology", "simulate", "search", "scale")


class ArgumentParser(argparse.ArgumentParser):
    """An argument parser that reports a mistake in one line and exits with status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> ArgumentParser:
    """The parser of all subcommands."""
    parser = ArgumentParser(
        prog="tandem", description="Train one neural network on many devices with PyTorch."
    )
    subparsers = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=ArgumentParser
    )
    for name in COMMANDS:
        importlib.import_module(f"tandem.commands.{name}").add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except UsageError as exc:
        print(f"tandem {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except WorkerFailure as exc:
        print(f"tandem {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"tandem {args.command}: interrupted", file=sys.stderr)
        return 130
