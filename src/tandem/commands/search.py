"""The ``tandem search`` command: find a fast plan by simulating many (FlexFlow-style MCMC)."""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from typing import Any

from tandem import strict_json
from tandem.cluster import Cluster, server_size
from tandem.commands.args import add_cluster_args, add_source_args, batch_scale
from tandem.commands.simulate import add_codec_args, add_sim_args, planning_inputs, sim_options
from tandem.commands.output_paths import check_output_files
from tandem.commands.time_to_accuracy import (
    TIME_FAMILIES,
    add_objective_args,
    batch_sizes,
    check_objective,
    format_timed,
    steps_model,
    time_families,
    timed_dict,
)
from tandem.errors import UsageError
from tandem.plan import Plan
from tandem.planning import PartitionOptions, make_plan
from tandem.planning.search.family_search import FAMILIES, best_of_families, describe_sync
from tandem.planning.search.flexflow import Candidate, SearchOptions, SearchResult, search
from tandem.planning.search.time_to_accuracy import Timed, fastest, time_to_target
from tandem.planning.simulate.simulator import SimOptions
from tandem.planning.simulate.tensor import DEFAULT_MAX_TENSOR_DEGREE, layout_text, split_layer
from tandem.profile import ModelProfile
from tandem.schedule import SCHEDULE_KINDS
from tandem.strategy import strategy_of
from tandem.spec.kinds import ScheduleKind
from tandem.spec.sync import AllReduceSync, ParameterServerSync

_DURATION = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|min|h)?\s*")
_SECONDS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, None: 1.0}


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``tandem search``."""
    p = subparsers.add_parser(
        "search",
        help="search stages, replicas, tensor degree, recomputation, schedule and micro-batches "
        "with the simulator",
        description="Metropolis-Hastings over plans (stage boundaries, replicas per stage, "
        "tensor degree, activation recomputation, schedule, micro-batches) with the simulator as cost and device memory as a "
        "constraint, started from data parallelism and from the partitioner's plan; then the "
        "fastest plan of each other synchronization family (parameter servers, gossip, local "
        "SGD, EASGD), reported apart.",
    )
    add_source_args(p, batch_help="global minibatch in samples (default: the profile's); "
                    "with --model also the batch to profile at (default 32)", batch_default=None)
    add_cluster_args(p)
    add_sim_args(p)
    add_codec_args(p)
    p.add_argument("--budget", default="30s", help="search time, e.g. 30s or 2m (default 30s)")
    p.add_argument("--iterations", type=int, help="stop after this many proposals")
    p.add_argument("--seed", type=int, default=0, help="random seed of the search")
    p.add_argument("--schedules", default=",".join(SCHEDULE_KINDS),
                   help="schedules to consider (default: gpipe,1f1b,pipedream)")
    p.add_argument("--max-microbatches", type=int, default=64, metavar="M",
                   help="most micro-batches per step to consider (default 64)")
    p.add_argument("--max-tensor-degree", type=int, default=DEFAULT_MAX_TENSOR_DEGREE, metavar="T",
                   help=f"largest tensor degree to consider: divisors of the devices up to T "
                   f"that divide a server (default {DEFAULT_MAX_TENSOR_DEGREE}; 1: none)")
    p.add_argument("--no-recompute", action="store_true",
                   help="do not consider activation recomputation")
    p.add_argument("--families",
                   help=f"synchronization families whose best plan is reported beside the "
                   f"search's (default {','.join(FAMILIES)}, with --objective "
                   f"time-to-accuracy {','.join(TIME_FAMILIES)}; 'none' for none); they are "
                   f"compared on time per step, not convergence")
    p.add_argument("--pick", default="allreduce", metavar="METHOD",
                   help="whose best plan -o writes and the run line shows: allreduce (the "
                   "search's, default) or one of the families")
    p.add_argument("-o", "--output", help="write the best plan JSON here")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    add_objective_args(p)
    p.set_defaults(run=run)


def parse_duration(text: str) -> float:
    """Seconds of ``30s``, ``2m``, ``500ms`` or a plain number of seconds."""
    match = _DURATION.fullmatch(text)
    if match is None:
        raise UsageError(f"cannot read --budget {text!r}: write e.g. 30s, 2m or 500ms")
    seconds = float(match.group(1)) * _SECONDS[match.group(2)]
    if seconds <= 0:
        raise UsageError(f"--budget {text!r} must be positive")
    return seconds


def _partitioner(profile: ModelProfile, cluster: Cluster,
                 sim: SimOptions) -> tuple[Plan | None, str]:
    """The planner's plan with the search's simulator options (its memory model's optimizer
    state, ``--optimizer-state``, among them), or why it has none."""
    try:
        return make_plan(profile, cluster, PartitionOptions(), sim=sim), ""
    except UsageError as exc:
        return None, str(exc)


def _batch_samples(args: argparse.Namespace, profile: ModelProfile) -> int | None:
    if args.batch_size is not None:
        return int(args.batch_size)
    return args.profile_batch or profile.batch_size


def describe(candidate: Candidate) -> str:
    """``15-1, 1f1b, 8 micro-batches`` (``2-2 x tensor 2, recompute, ...`` with either)."""
    plan = candidate.plan
    micro = ("" if plan.schedule.whole_minibatches
             else f", {candidate.result.num_microbatches} micro-batches")
    return f"{layout_text(plan)}, {plan.schedule}{micro}"


def format_search(found: SearchResult, profile: ModelProfile, cluster: Cluster,
                  partitioner_error: str, output: str | None) -> str:
    """The best plan's stages, its predicted step, and the comparison with the references."""
    best, plan = found.best, found.best.plan
    lines = [f"cluster: {cluster.describe()}",
             f"searched {found.evaluated} plans ({found.iterations} proposals, "
             f"{found.elapsed_s:.1f} s); best: {describe(best)}",
             f"{'stage':>5} {'layers':>11} {'replicas':>8} {'compute ms':>11} {'peak MB':>9}  first layer"
             + ("  (compute and memory per device of a tensor group)" if plan.tensor_degree > 1
                else "")]
    for index, stage in enumerate(plan.stages):
        layers = plan.stage_layers(index)
        compute = sum(split_layer(profile.layers[i], plan.tensor_degree).compute_s for i in layers)
        peak = max(w.peak_memory_bytes for w in best.result.workers if w.stage == index)
        lines.append(f"{index:>5} {f'{stage.start}..{stage.end - 1}':>11} {stage.replicas:>8} "
                     f"{compute * 1e3:11.3f} {peak / 1e6:9.1f}  {profile.layers[layers[0]].name[:30]}")
    step = best.result.step_time_s
    lines.append(f"predicted step {step * 1e3:.3f} ms, bubble {best.result.bubble_fraction:.1%}, "
                 f"peak memory {best.result.peak_memory_bytes / 1e9:.3f} GB per device")
    reasons = {"data parallelism": f"tandem train refuses it: {found.data_parallel_refusal}"
               if found.data_parallel_refusal else "",
               "the partitioner's plan": partitioner_error}
    for label, ref in (("data parallelism", found.data_parallel), ("the partitioner's plan", found.partitioner)):
        if ref is None:
            lines.append(f"vs {label}: none" + (f" ({reasons[label]})" if reasons[label] else ""))
            continue
        fits = "" if ref.result.fits_memory else ", does not fit in memory"
        if ref.note:  # refused by tandem train, or another training run: not compared
            lines.append(f"vs {label} ({describe(ref)}): {ref.result.step_time_s * 1e3:.3f} ms"
                         f"{fits}; not compared: {ref.note}")
            continue
        lines.append(f"vs {label} ({describe(ref)}): {ref.result.step_time_s * 1e3:.3f} ms{fits}; "
                     f"best is {ref.result.step_time_s / step:.2f}x as fast")
    if found.apart is not None:
        lines.append(f"not compared: {describe(found.apart)}, "
                     f"{found.apart.result.step_time_s * 1e3:.3f} ms per minibatch, is "
                     f"{found.apart.note}")
    target = output or "best.json"
    lines.append(f"run it: tandem train --plan {target} --model ... (the plan holds its "
                 f"{plan.num_workers} workers, {plan.schedule} and "
                 f"{plan.num_microbatches} micro-batches per step)")
    return "\n".join(lines)


def _candidate_dict(candidate: Candidate | None) -> dict[str, Any] | None:
    if candidate is None:
        return None
    return {"plan": candidate.plan.to_dict(), "result": candidate.result.to_dict(),
            "note": candidate.note or None}


def family_command(plan: Plan) -> str:
    """The ``tandem train`` line of a family's one-stage plan (its spec's flags, from ``FLAGS``)."""
    sync = plan.sync
    default = type(sync)()
    flags = []
    shown = ("--topology", "--period", *(("--servers", "--mode") if isinstance(
        sync, ParameterServerSync) else ()))  # said even when default (EASGD's are sync, none)
    for flag, name in sync.FLAGS.items():
        value = getattr(sync, name)
        if value != getattr(default, name) or flag in shown:
            flags.append(flag if value is True else f"{flag} {value}")
    return (f"tandem train --strategy {strategy_of(plan)} {' '.join(flags)} "
            f"--nproc {plan.num_workers} ...")


def format_families(families: dict[str, Candidate], best_s: float) -> str:
    """One line per family: its fastest plan, step and speed relative to the search's best."""
    lines = ["best of each synchronization family (time per step, not convergence):"]
    for method, candidate in families.items():
        result = candidate.result
        workers = candidate.plan.stages[0].replicas
        lines.append(f"  {method:<9} {describe_sync(candidate.plan.sync, workers):<40} "
                     f"{result.step_time_s * 1e3:10.3f} ms  ({best_s / result.step_time_s:.2f}x "
                     f"the search's best speed)")
    return "\n".join(lines)


def result_dict(found: SearchResult) -> dict[str, Any]:
    """The JSON output of ``tandem search``."""
    step = found.best.result.step_time_s
    refs = {"data_parallel": found.data_parallel, "partitioner": found.partitioner}
    data: dict[str, Any] = {
        "config": found.best.plan.config, "schedule": found.best.plan.schedule,
        "tensor_degree": found.best.plan.tensor_degree, "recompute": found.best.plan.recompute,
        "num_microbatches": (None if found.best.plan.schedule.whole_minibatches
                             else found.best.result.num_microbatches),
        "step_time_s": step,
        "best": _candidate_dict(found.best),
        "iterations": found.iterations, "evaluated": found.evaluated,
        "accepted": found.accepted, "elapsed_s": found.elapsed_s,
        "apart": _candidate_dict(found.apart),
        "data_parallel_refusal": found.data_parallel_refusal or None,
    }
    for name, ref in refs.items():
        data[name] = _candidate_dict(ref)
        data[f"{name}_step_time_s"] = None if ref is None else ref.result.step_time_s
        data[f"speedup_vs_{name}"] = (None if ref is None or ref.note
                                      else ref.result.step_time_s / step)
    return data


def run(args: argparse.Namespace) -> int:
    """Search, print the comparison (stderr with --json) or JSON, and write the best plan."""
    check_output_files(("-o", args.output))
    if args.families is None:
        args.families = ",".join(TIME_FAMILIES if args.objective == "time-to-accuracy"
                                 else FAMILIES)
    check_objective(args)
    schedules = tuple(k.strip() for k in args.schedules.split(",") if k.strip())
    options = SearchOptions(budget_s=parse_duration(args.budget), max_iterations=args.iterations,
                            seed=args.seed, schedules=schedules,
                            max_microbatches=args.max_microbatches,
                            max_tensor_degree=args.max_tensor_degree,
                            recompute=not args.no_recompute)
    methods = () if args.families.strip() == "none" else tuple(
        m.strip() for m in args.families.split(",") if m.strip())
    if args.pick != "allreduce" and args.pick not in methods:
        raise UsageError(f"--pick {args.pick!r} is not allreduce or one of --families "
                         f"{','.join(methods) or 'none'}; e.g. --pick ps")
    profile, cluster = planning_inputs(args)  # --model: measured with torch, after the checks
    if profile.batch_size is None and args.profile_batch:  # the planner then knows the samples
        profile = dataclasses.replace(profile, batch_size=args.profile_batch)
    if args.objective == "time-to-accuracy":
        return run_time_to_accuracy(args, profile, cluster, options, time_families(args))
    options = dataclasses.replace(options, batch_samples=_batch_samples(args, profile))
    sim = sim_options(args, profile)
    partitioner, error = _partitioner(profile, cluster, sim)
    found = search(profile, cluster, options, sim, partitioner)
    families = best_of_families(profile, cluster, sim, methods, _batch_samples(args, profile))
    chosen = found.best if args.pick == "allreduce" else families.get(args.pick)
    if chosen is None:
        raise UsageError(f"no {args.pick} plan fits in memory on this cluster; pick another family")
    best = chosen.plan
    best.bottleneck_s = chosen.result.step_time_s
    best.predicted_schedule = best.schedule  # the simulator ran the schedule the plan runs
    best.options = {"found_by": "tandem search", "seed": args.seed, "pick": args.pick}
    best.devices_per_server = server_size(cluster)
    human = sys.stderr if args.json else sys.stdout
    print(format_search(found, profile, cluster, error, args.output), file=human)
    if families:
        print(format_families(families, found.best.result.step_time_s), file=human)
    if args.pick != "allreduce":
        print(f"run {args.pick}'s: {family_command(best)}", file=human)
    if args.output:
        best.save(args.output)
        print(f"wrote {args.output} ({args.pick})", file=human)
    if args.json:
        data = result_dict(found)
        data["families"] = {m: _candidate_dict(c) for m, c in families.items()}
        data["families_step_time_s"] = {m: c.result.step_time_s for m, c in families.items()}
        data["pick"] = args.pick
        print(strict_json.dumps(data))
    return 0


def _label(candidate: Candidate) -> str:
    """The search's plan as :func:`describe` says it, a family's as its sync spec."""
    plan = candidate.plan
    if isinstance(plan.sync, AllReduceSync):
        return describe(candidate)
    return describe_sync(plan.sync, plan.stages[0].replicas)


def run_time_to_accuracy(args: argparse.Namespace, profile: ModelProfile, cluster: Cluster,
                         options: SearchOptions, methods: tuple[str, ...]) -> int:
    """``--objective time-to-accuracy``: search at every batch of ``--batch-sizes`` (the budget
    shared among them), time each batch's best plan and each family's to the target, print
    both factors of every one and keep the least product (:mod:`tandem.commands.time_to_accuracy`)."""
    if not (args.profile_batch or profile.batch_size):
        raise UsageError("--objective time-to-accuracy simulates the profile at each of "
                         "--batch-sizes, and it does not record the minibatch it was measured "
                         "at: add --profile-batch N (e.g. 128 for PipeDream's VGG-16 profile)")
    model = steps_model(args)
    sizes = batch_sizes(args)
    options = dataclasses.replace(options, budget_s=options.budget_s / len(sizes),
                                  staleness_cost=model.staleness_costs[ScheduleKind.PIPEDREAM])
    timed: list[Timed] = []
    searches: dict[int, SearchResult] = {}
    for batch in sizes:
        sim = sim_options(args, profile,
                          batch_scale=batch_scale(profile, batch, args.profile_batch))
        partitioner, _ = _partitioner(profile, cluster, sim)
        try:
            found = search(profile, cluster, dataclasses.replace(options, batch_samples=batch),
                           sim, partitioner)
        except UsageError:  # no plan fits at this batch: the others may
            continue
        searches[batch] = found
        timed.append(time_to_target(found.best, batch, model))
        families = best_of_families(profile, cluster, sim, methods, batch,
                                    staleness_cost=model.staleness_costs["ps"])
        timed += [time_to_target(c, batch, model, label=m) for m, c in families.items()]
    best = fastest(timed)
    plan = best.candidate.plan
    plan.bottleneck_s = best.step_time_s
    plan.predicted_schedule = plan.schedule
    plan.options = {"found_by": "tandem search --objective time-to-accuracy", "seed": args.seed,
                    "batch_size": best.batch_size, "target_loss": model.target_loss}
    plan.devices_per_server = server_size(cluster)
    human = sys.stderr if args.json else sys.stdout
    print(f"cluster: {cluster.describe()}", file=human)
    print(format_timed(timed, best, model, _label), file=human)
    lr = model.lr_at(best.batch_size)
    flags = f"--batch-size {best.batch_size}" + ("" if lr is None else f" --lr {lr:.4g}")
    target = args.output or "best.json"
    command = (f"tandem train --plan {target} --model ..." if best.label == "allreduce"
               else family_command(plan))
    print(f"run it: {command} {flags}", file=human)
    if args.output:
        plan.save(args.output)
        print(f"wrote {args.output} (batch {best.batch_size}, {best.label})", file=human)
    if args.json:
        data = result_dict(searches[best.batch_size])
        data.update(objective=args.objective, pick=best.label, batch_size=best.batch_size,
                    time_to_accuracy={
                        "target_loss": model.target_loss, "steps_model": model.to_dict(),
                        "best": timed_dict(best, model),
                        "candidates": [timed_dict(row, model) for row in timed]})
        print(strict_json.dumps(data))
    return 0
