"""The ``tandem plan`` command: choose stages and replicas for a model on a cluster."""

from __future__ import annotations

import argparse
import sys

from tandem import strict_json
from tandem.cluster import Cluster, format_bandwidth, parse_size
from tandem.commands.args import add_cluster_args, add_source_args, build_cluster, load_source
from tandem.commands.output_paths import check_output_files
from tandem.plan import Plan
from tandem.planning import PartitionOptions, make_plan
from tandem.profile import ModelProfile
from tandem.schedule import SCHEDULE_KINDS


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``tandem plan``."""
    p = subparsers.add_parser(
        "plan",
        help="choose pipeline stages and replication (PipeDream's partitioner)",
        description="Split a model into pipeline stages with a replica count each, minimizing "
        "the slowest stage under PipeDream's cost model.",
    )
    add_source_args(p, batch_help="with --model: minibatch to profile", batch_default=32)
    add_cluster_args(p)
    p.add_argument("--memory", help="per-device memory limit, e.g. 16GB (default: the cluster's)")
    p.add_argument("--activation-compression", type=float, default=1.0, metavar="R",
                   help="divide activation transfer time by R (default 1: full transfer)")
    p.add_argument("--gradient-compression", type=float, default=1.0, metavar="R",
                   help="divide the allreduce time of replicated stages and of data parallelism "
                   "by R (a gradient codec's ratio: 2 for fp16, about 32 for sign; default 1)")
    p.add_argument("--no-activation-comm", action="store_true",
                   help="ignore activation transfer, as PipeDream's optimizer does by default")
    p.add_argument("--straight", action="store_true", help="one device per stage, no replication")
    p.add_argument("--allow-idle", action="store_true", help="leave devices idle when faster")
    p.add_argument("--schedule", choices=SCHEDULE_KINDS, default=None,
                   help="schedule the plan runs (default 1f1b; the predicted times are PipeDream's "
                   "steady state whatever it is: tandem simulate --plan predicts the schedule)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="micro-batches per step the plan runs (default: max(stages, replicas))")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("-o", "--output", help="write the plan JSON here")
    p.set_defaults(run=run)


def _options(args: argparse.Namespace) -> PartitionOptions:
    return PartitionOptions(
        activation_compression=None if args.no_activation_comm else args.activation_compression,
        gradient_compression=args.gradient_compression,
        straight=args.straight,
        allow_idle=args.allow_idle,
        memory_bytes=parse_size(args.memory) if args.memory else None,
    )


def format_plan(plan: Plan, profile: ModelProfile, cluster: Cluster) -> str:
    """A readable table of stages and the predicted speedups."""
    lines = [f"cluster: {cluster.describe()}",
             f"plan {plan.config}: {len(plan.stages)} stages on "
             f"{sum(s.replicas for s in plan.stages)} of {plan.num_devices} devices",
             f"{'stage':>5} {'layers':>11} {'replicas':>8} {'time ms':>10} {'memory MB':>10}  first layer"]  # fmt: skip
    for index, stage in enumerate(plan.stages):
        first = profile.layers[plan.layers()[stage.start]].name[:30]
        lines.append(f"{index:>5} {f'{stage.start}..{stage.end - 1}':>11} {stage.replicas:>8} "
                     f"{stage.time_s * 1e3:10.3f} {stage.memory_bytes / 1e6:10.1f}  {first}")  # fmt: skip
    if len(plan.level_configs) > 1:
        lines.append("per level (innermost first): " + ", ".join(plan.level_configs))
    lines.append(f"bottleneck {plan.bottleneck_s * 1e3:.3f} ms per minibatch; "
                 f"speedup {plan.speedup_vs_single:.2f}x vs one device, "
                 f"{plan.speedup_vs_dp:.2f}x vs data parallel on {plan.num_devices} "
                 f"(solved in {plan.solve_s:.3f} s)")  # fmt: skip
    lines.append(f"runs {plan.schedule} with {plan.num_microbatches} micro-batches per step; the "
                 f"times above are {plan.predicted_schedule}'s steady state (tandem simulate "
                 f"--plan predicts the schedule it runs)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Plan, print a table (stderr with --json) or JSON, and optionally write the plan."""
    check_output_files(("-o", args.output))
    cluster = build_cluster(args)
    options = _options(args)
    profile = load_source(args)
    plan = make_plan(profile, cluster, options).rescheduled(args.schedule, args.microbatches)
    human = sys.stderr if args.json else sys.stdout
    print(format_plan(plan, profile, cluster), file=human)
    if args.output:
        plan.save(args.output)
        print(f"wrote {args.output}", file=human)
    if args.json:
        print(strict_json.dumps(plan.to_dict()))
    return 0


__all__ = ["add_parser", "build_cluster", "format_bandwidth", "format_plan", "run"]
