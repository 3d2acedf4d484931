"""The ``tandem plan`` command: choose stages and replicas for a model on a cluster."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings
from typing import Any

from tandem import strict_json
from tandem.cluster import Cluster, format_bandwidth, parse_duration, parse_size, server_size
from tandem.commands.args import add_cluster_args, add_source_args, build_cluster, load_source
from tandem.commands.output_paths import check_output_files
from tandem.errors import PlanNote, UsageError
from tandem.plan import Plan
from tandem.planning import PartitionOptions, make_plan
from tandem.planning.simulate.simulator import SimOptions
from tandem.profile import ModelProfile
from tandem.schedule import SCHEDULE_KINDS
from tandem.spec.kinds import ScheduleKind
from tandem.spec.trainable import update_change


NOT_COMPARED = "not compared:"
"""How a candidate that trains differently from the asked schedule is marked (its note)."""


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``tandem plan``."""
    p = subparsers.add_parser(
        "plan",
        help="choose pipeline stages and replication (PipeDream's partitioner)",
        description="Split a model into pipeline stages with a replica count each (PipeDream's "
        "partitioner) under a ladder of memory budgets (a fixed grid down from the limit) and link "
        "speeds, simulate each beside the flat plan at the slowest link, data parallelism and "
        "one device, and return the fastest that fits the devices' memory.",
    )
    add_source_args(p, batch_help="with --model: minibatch to profile", batch_default=32)
    add_cluster_args(p)
    p.add_argument("--memory", help="per-device memory limit, e.g. 16GB (default: the cluster's; "
                   "16GB with --devices and --bandwidth)")
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
                   help="schedule the plan runs and is simulated with (default 1f1b); given, "
                   "the plan is a pipeline even where data parallelism or one device is faster")
    p.add_argument("--microbatches", type=int, default=None,
                   help="micro-batches per step the plan runs, a divisor of the minibatch; "
                   "given, every pipeline runs it, one-stage ones too (default: the fastest the "
                   "simulator finds among the smallest divisors of the minibatch at least "
                   "max(stages, replicas) and 2 and 4 times that)")
    p.add_argument("--profile-batch", type=int,
                   help="minibatch the profile was measured at, if it does not say (PipeDream's "
                   "graph.txt): the plan then predicts samples per second")
    p.add_argument("--optimizer-state", type=float, default=1.0, metavar="X",
                   help="optimizer state bytes per parameter byte, for the memory budget (SGD "
                   "with momentum 1, Adam 2; default 1)")
    p.add_argument("--overhead", default="0", metavar="TIME",
                   help="fixed framework time added to every forward and backward in the "
                   "simulations, e.g. 1ms or 50us (default 0)")
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


def sim_options(args: argparse.Namespace) -> SimOptions:
    """The simulator's options of ``tandem plan``: the plan's compression ratios, the optimizer
    state the memory budget counts, the fixed overhead; with --no-activation-comm no activation
    bytes between stages, as the partitioner then assumes."""
    return SimOptions(
        gradient_compression=args.gradient_compression,
        activation_compression=args.activation_compression,
        activation_comm=not args.no_activation_comm,
        optimizer_state_factor=args.optimizer_state,
        compute_overhead_s=parse_duration(args.overhead, "--overhead"),
    )


def format_plan(plan: Plan, profile: ModelProfile, cluster: Cluster) -> str:
    """A readable table of stages, the predictions and the candidates compared."""
    lines = [f"cluster: {cluster.describe()}",
             f"plan {plan.config}: {len(plan.stages)} stages on "
             f"{sum(s.replicas for s in plan.stages)} of {plan.num_devices} devices",
             f"{'stage':>5} {'layers':>11} {'replicas':>8} {'est. ms':>10} {'memory MB':>10}  first layer"]  # fmt: skip
    for index, stage in enumerate(plan.stages):
        first = profile.layers[plan.layers()[stage.start]].name[:30]
        lines.append(f"{index:>5} {f'{stage.start}..{stage.end - 1}':>11} {stage.replicas:>8} "
                     f"{stage.time_s * 1e3:10.3f} {stage.memory_bytes / 1e6:10.1f}  {first}")  # fmt: skip
    if len(plan.level_configs) > 1:
        lines.append("per level (innermost first): " + ", ".join(plan.level_configs))
    if plan.sharded:
        why = next((f"chosen because data parallelism needs {row['peak_memory_bytes'] / 1e9:.3g}"
                    f" GB per device, over the limit" for row in plan.candidates
                    if row["name"] == "dp" and row["fits_memory"] is False), "the fastest plan")
        lines.append(f"sharded data parallelism: --shard {plan.shard_degree} --shard-level "
                     f"{plan.shard_level} ({why}; each device holds its shard of the state)")
    rate = f" ({plan.samples_per_s:.1f} samples/s)" if plan.samples_per_s is not None else ""
    estimate = (f"; the partitioner estimated {plan.estimate_s * 1e3:.3f} ms (PipeDream's steady "
                f"state)" if plan.estimate_s is not None else "")
    if plan.schedule.asynchronous:  # a minibatch per step, timed once the pipeline is full
        lines.append(f"runs {plan.schedule}: simulated {plan.bottleneck_s * 1e3:.3f} ms per "
                     f"minibatch in steady state{rate}{estimate}")
    else:
        lines.append(f"runs {plan.schedule} with {plan.num_microbatches} micro-batches per step: "
                     f"simulated {plan.bottleneck_s * 1e3:.3f} ms per step{rate}{estimate}")
    if plan.options.get("chosen_from"):
        lines.append(f"(the partitioner's plan for {plan.options['chosen_from']}: its ladders "
                     f"of link speeds and memory budgets, simulated on this cluster)")
    lines.append(f"speedup {_ratio(plan.single_s, plan.bottleneck_s)} vs one device, "
                 f"{_ratio(plan.data_parallel_s, plan.bottleneck_s)} vs data parallel on "
                 f"{plan.num_devices} (simulated; planned in {plan.solve_s:.3f} s)")
    apart = [row for row in plan.candidates if row["note"].startswith(NOT_COMPARED)
             and row["simulated_s"] is not None and row["simulated_s"] < plan.bottleneck_s]
    if apart:
        row = min(apart, key=lambda row: row["simulated_s"])
        lines.append(f"{NOT_COMPARED} {row['config']} at {row['simulated_s'] * 1e3:.3f} ms per "
                     f"minibatch, {row['note'][len(NOT_COMPARED) + 1:]}")
    change = update_change(plan)
    if change is not None:
        lines.append(f"note: {change}; the speedups compare time per minibatch, not time to "
                     f"the same model")
    if plan.candidates:
        lines.append(f"{'candidate':>10} {'plan':>16} {'schedule':>9} {'micro':>5} {'est. ms':>10} "
                     f"{'sim. ms':>10} {'peak MB':>10}  ")
        for row in plan.candidates:
            lines.append(_candidate_line(row))
    return "\n".join(lines)


def _ratio(reference: float, value: float) -> str:
    return f"{reference / value:.2f}x" if reference > 0 and value > 0 else "n/a"


def _candidate_line(row: dict[str, Any]) -> str:
    if row["config"] is None:
        return f"{row['name']:>10} {'-':>16}  {row['note']}"
    def ms(value: float | None) -> str:
        return f"{value * 1e3:10.3f}" if value is not None else f"{'-':>10}"
    fit = "" if row["fits_memory"] else "  does not fit"
    mark = "  <- chosen" if row["chosen"] else (f"  ({row['note']})" if row["note"] else "")
    return (f"{row['name']:>10} {row['config'][:16]:>16} {row['schedule']:>9} "
            f"{row['num_microbatches']:>5} {ms(row['estimate_s'])} {ms(row['simulated_s'])} "
            f"{row['peak_memory_bytes'] / 1e6:10.1f}{fit}{mark}")


def run(args: argparse.Namespace) -> int:
    """Plan, print a table (stderr with --json) or JSON, and optionally write the plan."""
    check_output_files(("-o", args.output))
    cluster = build_cluster(args)
    options, sim = _options(args), sim_options(args)
    if args.profile_batch is not None and args.profile_batch < 1:
        raise UsageError(f"--profile-batch must be at least 1 sample (got {args.profile_batch})")
    profile = load_source(args)  # --model: measured, with torch, once the flags are checked
    if profile.batch_size is None and args.profile_batch:
        profile = dataclasses.replace(profile, batch_size=args.profile_batch)
    elif args.profile_batch is not None and args.profile_batch != profile.batch_size:
        raise UsageError(f"--profile-batch {args.profile_batch} contradicts the profile's own "
                         f"minibatch {profile.batch_size}; drop --profile-batch")
    asked = [flag for flag, given in (("--schedule", args.schedule is not None),
                                      ("--microbatches", args.microbatches is not None),
                                      ("--straight", args.straight)) if given]
    plan = make_plan(profile, cluster, options, schedule=args.schedule or ScheduleKind.ONE_F_ONE_B,
                     num_microbatches=args.microbatches, sim=sim,
                     pipeline_only=bool(asked))
    plan.devices_per_server = server_size(cluster)
    human = sys.stderr if args.json else sys.stdout
    if plan.options.get("branch_compression"):
        warnings.warn(plan.options["branch_compression"], PlanNote, stacklevel=1)
    if options.memory_bytes is not None:  # the header states the limit planned under
        cluster = dataclasses.replace(cluster, memory_bytes=options.memory_bytes)
    print(format_plan(plan, profile, cluster), file=human)
    faster = [row for row in plan.candidates
              if row["simulated_s"] is not None and row["fits_memory"]
              and row["simulated_s"] < plan.bottleneck_s
              and not row["note"].startswith(NOT_COMPARED)]
    if asked and faster:
        best = min(faster, key=lambda row: row["simulated_s"])
        warnings.warn(f"{best['name']} ({best['config']}) would be faster "
                      f"({best['simulated_s'] * 1e3:.3f} ms against {plan.bottleneck_s * 1e3:.3f} "
                      f"ms); {' and '.join(asked)} asked for a pipeline: drop them to let the "
                      f"planner choose", PlanNote, stacklevel=1)
    if args.output:
        plan.save(args.output)
        print(f"wrote {args.output}", file=human)
    if args.json:
        print(strict_json.dumps(plan.to_dict()))
    return 0


__all__ = ["add_parser", "build_cluster", "format_bandwidth", "format_plan", "run"]
