"""``tandem demo``: the main job — train on the real digits with 2 local workers and print a summary."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tandem.commands.train import print_summary
from tandem.runtime.out_dir import default_out
from tandem.runtime.run import make_job, run_training, start_forkserver
from tandem.strategy import strategy_of

DEMO: dict[str, Any] = {"model": "mlp:hidden=128,layers=4", "data": "digits", "nproc": 2, "steps": 600,
        "batch_size": 64, "lr": 0.05, "momentum": 0.9, "eval_every": 200}
"""The demo's run settings; its strategy is ``dp``."""


def run(args: argparse.Namespace) -> int:
    start_forkserver()  # the demo's settings need no checking: its imports start at once
    out = args.out if args.out is not None else str(default_out())
    job = make_job("dp", **DEMO, out=out, overwrite=True,
                   progress=args.progress and not args.json)
    config = job.run
    print(f"tandem demo: {config.model} on {config.data}, {config.nproc} workers, strategy "
          f"{strategy_of(job.plan)}, {config.steps} steps of {config.batch_size} samples; "
          f"outputs in {out}", file=sys.stderr)
    summary = run_training(job)
    if summary is None:
        raise RuntimeError("rank 0 of a local run returned no summary")
    print_summary(summary, args.json)
    return 0


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo", help="train on the digits with 2 local workers and print a summary",
        description="Train an MLP on the 8x8 handwritten digits with 2 local workers and "
        "synchronous data parallelism, then print accuracy, time and throughput.",
    )
    parser.add_argument("--out", default=None, help="write final.pt, metrics and trace here "
                        "(replacing an earlier run's; default: a new runs/<date>_<time>)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    parser.add_argument("--no-progress", action="store_false", dest="progress",
                        help="hide the progress bar")
    parser.set_defaults(run=run)
