"""``tandem export RUN_DIR``: write a run's ``final.pt`` from its final shards
(``RUN_DIR/final.dcp``), a few tensors at a time (:mod:`tandem.runtime.export`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from tandem import strict_json
from tandem.commands.output_paths import check_output_files
from tandem.errors import UsageError


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir} is not a directory; give the --out of a finished sharded, "
                         f"tensor-parallel or pipeline run")
    target = Path(args.output) if args.output else run_dir / "final.pt"
    check_output_files(("-o", str(target)))
    from tandem.runtime.export import FINAL_SHARDS, export_final  # torch, once checked

    folder = run_dir / FINAL_SHARDS
    if not folder.is_dir():
        raise UsageError(f"{run_dir} has no {FINAL_SHARDS} (the final shards that sharded "
                         f"(--shard-level 2 or 3), tensor-parallel and pipeline runs write); "
                         f"export the --out of such a run")
    exported = export_final(folder, target)
    summary = {"out": str(target), "tensors": exported.num_tensors, "bytes": exported.num_bytes,
               "largest_tensor_bytes": exported.largest_tensor_bytes,
               "skipped": exported.skipped}
    if args.json:
        print(strict_json.dumps(summary))
    else:
        skipped = (f"; left out {len(exported.skipped)} entries that are not tensors "
                   f"({', '.join(exported.skipped[:3])})" if exported.skipped else "")
        print(f"wrote {target}: {exported.num_tensors} tensors, "
              f"{exported.num_bytes / 1e6:,.1f} MB, a few at a time (at most "
              f"{exported.largest_tensor_bytes / 1e6:,.1f} MB held){skipped}")
    return 0


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "export", help="write a run's final.pt from its final shards, a few tensors at a time",
        description="Write RUN_DIR/final.pt (a plain state_dict that torch.load reads) from the "
        "final shards a sharded, tensor-parallel or pipeline run wrote to RUN_DIR/final.dcp, "
        "joining at most 256 MB of tensors (or one larger tensor) at a time so that no process "
        "holds the whole model. The run does this itself at its end; run it again after "
        "removing final.pt, or to write elsewhere with -o.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the --out of a finished run that wrote final.dcp")
    parser.add_argument("-o", "--output", default=None, metavar="FILE",
                        help="where to write the state_dict (default RUN_DIR/final.pt)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    parser.set_defaults(run=run)
