"""``tandem pack SOURCE --out DIR``: write a dataset as WebDataset tar shards that
``--data shards:DIR`` streams (:mod:`tandem.data.pack`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from tandem import strict_json
from tandem.cluster import parse_size
from tandem.errors import UsageError


def run(args: argparse.Namespace) -> int:
    try:
        shard_size = int(parse_size(args.shard_size)) if args.shard_size else None
    except UsageError:
        raise UsageError(f"--shard-size {args.shard_size!r} is not a size; write a number and a "
                         f"unit, e.g. --shard-size 64MB") from None
    from tandem.data.pack import DEFAULT_SHARD_SIZE, pack  # torch, once the flags are checked

    bar = _Bar(enabled=args.progress)
    try:
        result = pack(args.source, Path(args.out), progress=bar,
                      shard_size=DEFAULT_SHARD_SIZE if shard_size is None else shard_size)
    finally:
        bar.progress.stop()
    spec = result.source
    summary = {"out": str(result.out), "shards": result.shards, "samples": result.samples,
               "bytes": result.bytes, "source": spec}
    if args.json:
        print(strict_json.dumps(summary))
    else:
        print(f"packed {result.samples['train']:,} train and {result.samples['test']:,} test "
              f"samples of {spec} into {result.shards} shards ({result.bytes / 1e6:,.1f} MB) "
              f"in {result.out}; train on them with --data shards:{result.out}")
    return 0


class _Bar:
    """A progress bar of samples written (on stderr)."""

    def __init__(self, *, enabled: bool) -> None:
        from rich.console import Console  # rich takes a tenth of a second: not for --help
        from rich.progress import (
            BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
        )

        self.progress = Progress(TextColumn("[bold]pack"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("samples"), TimeElapsedColumn(),
                                 console=Console(stderr=True), disable=not enabled)
        self.task = self.progress.add_task("pack", total=None)

    def begin(self, total: int) -> None:
        self.progress.update(self.task, total=total)
        self.progress.start()  # only once the source is read: a mistake in it is one line

    def advance(self, count: int) -> None:
        self.progress.advance(self.task, count)


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "pack", help="write a dataset as tar shards that --data shards:DIR streams",
        description="Write a dataset as tar shards in the WebDataset layout (samples as "
        "consecutive KEY.PART members), with index.json listing each shard's samples. "
        "Training with --data shards:DIR then reads few large files instead of many small ones, "
        "each worker only its own part.",
    )
    parser.add_argument("source", metavar="SOURCE",
                        help="an image folder (one subfolder per class), or any --data form: "
                        "digits, folder:PATH[:size=S], package.module:function")
    parser.add_argument("--out", required=True, metavar="DIR", help="directory for the shards")
    parser.add_argument("--shard-size", default=None, metavar="SIZE",
                        help="close a shard once it holds this much, e.g. 64MB (default 64MB)")
    parser.add_argument("--no-progress", action="store_false", dest="progress",
                        help="hide the progress bar")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    parser.set_defaults(run=run)
