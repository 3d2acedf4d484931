"""The ``tandem simulate`` command: predict a plan's step time, utilization and memory."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings
from typing import Any

from tandem import strict_json
from tandem.cluster import Cluster, parse_bandwidth, parse_duration
from tandem.commands.args import (
    add_cluster_args,
    add_source_args,
    batch_scale,
    build_cluster,
    load_source,
    with_memory,
)
from tandem.commands.output_paths import check_output_files
from tandem.errors import PlanNote, UsageError
from tandem.plan import Plan
from tandem.planning.simulate.collectives import ALGORITHMS
from tandem.planning.simulate.simulator import SimOptions, SimResult, data_parallel_plan, simulate
from tandem.profile import ModelProfile
from tandem.schedule import SCHEDULE_KINDS
from tandem.spec.sync import AllReduceSync
from tandem.strategy import ONE_STAGE, SYNC_FLAGS, Spelling, plan_from_flags
from tandem.timeline import plot_gantt

MAX_WORKER_ROWS = 32
"""Above this many workers the table shows one row per stage."""


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``tandem simulate``."""
    p = subparsers.add_parser(
        "simulate",
        help="predict a plan's step time, idle time and memory on a cluster",
        description="Replay the schedule of a plan on a cost model of a cluster (profiled "
        "compute, link bandwidth and latency, collectives) and print the predicted step time, "
        "throughput, busy and idle time and peak memory per device.",
    )
    p.add_argument("--against", metavar="RUN_DIR",
                   help="predict a finished run (tandem train --out RUN_DIR) on this machine and "
                   "print predicted next to measured step times (tandem.commands.against)")
    p.add_argument("--plan",
                   help="a plan JSON (tandem plan -o / tandem search -o), or one stage on every "
                   "device synchronized by: dp (allreduce), ps (parameter servers: the first "
                   "--servers devices), gossip, localsgd or easgd, with the options below")
    add_source_args(p, batch_help="global minibatch in samples (default: the profile's); "
                    "with --model also the batch to profile at (default 32)", batch_default=None,
                    required=False)
    add_cluster_args(p)
    add_sim_args(p)
    add_codec_args(p)
    add_sync_args(p)
    p.add_argument("--schedule", choices=SCHEDULE_KINDS, help="override the plan's schedule")
    p.add_argument("--microbatches", type=int, help="override the plan's micro-batches per step")
    add_layout_args(p)
    p.add_argument("--trace", help="write the predicted timeline as a Chrome trace here")
    p.add_argument("--gantt", help="draw the predicted timeline as a Gantt chart (PNG) here")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(run=run)


SIMULATE_SPELLING = Spelling(strategy="--plan", processes="--devices")
"""``--plan NAME`` on the cluster's devices is ``tandem train --strategy NAME --nproc N``."""


def add_sync_args(p: argparse.ArgumentParser) -> None:
    """The options of the sync specs, as ``tandem train`` spells them (each spec's ``FLAGS``)."""
    group = p.add_argument_group("synchronization (with --plan ps, gossip, localsgd or easgd)")
    group.add_argument("--servers", type=int, help="ps: server processes (default 1)")
    group.add_argument("--mode", help="ps: sync, async or ssp; easgd: sync (default sync)")
    group.add_argument("--staleness", type=int, help="ps --mode ssp: bound on how far ahead")
    group.add_argument("--staleness-lr", action="store_true", default=None,
                       help="ps: scale stale updates' learning rate (no effect on time)")
    group.add_argument("--backup", type=int, help="ps --mode sync: backup workers")
    group.add_argument("--topology", help="gossip: ring, torus, exponential, complete, custom:...")
    group.add_argument("--weights", help="gossip: uniform or metropolis (no effect on time)")
    group.add_argument("--async-gossip", action="store_true", default=None,
                       help="gossip: AD-PSGD (pairwise averaging, no global rounds)")
    group.add_argument("--gossip-step", type=float, help="gossip: CHOCO step (no effect on time)")
    group.add_argument("--period", type=int, help="localsgd, easgd: steps between averagings")
    group.add_argument("--rho", type=float, help="easgd: elasticity (no effect on time)")
    group.add_argument("--nesterov", action="store_true", default=None,
                       help="easgd: EAMSGD's Nesterov momentum (no effect on time)")


def sync_flags_given(args: argparse.Namespace | None) -> dict[str, Any]:
    """The sync specs' flags given on the command line (spelled as ``tandem train``'s)."""
    if args is None:
        return {}
    given = {flag: getattr(args, flag[2:].replace("-", "_"), None) for flag in SYNC_FLAGS}
    return {flag: value for flag, value in given.items() if value is not None}


def add_layout_args(p: argparse.ArgumentParser) -> None:
    """``--tensor-parallel T`` and ``--recompute``, which change a plan's layout."""
    p.add_argument("--tensor-parallel", type=int, metavar="T",
                   help="split every layer with parameters across T adjacent devices per stage "
                   "replica (Megatron-style; T must divide the devices; with --plan dp the "
                   "devices / T replicas are data parallel); overrides the plan's tensor degree")
    p.add_argument("--recompute", action="store_true",
                   help="recompute activations in the backward: a stage keeps only its input "
                   "per micro-batch in flight (one more forward per backward)")


def with_layout(plan: Plan, profile: ModelProfile, cluster: Cluster, *, tensor: int | None,
                recompute: bool, data_parallel: bool) -> Plan:
    """``plan`` with ``--tensor-parallel`` and ``--recompute`` applied (``data_parallel``:
    ``--plan dp``, rebuilt on ``devices / T`` replicas); one-line errors for a bad degree."""
    if tensor is not None:
        devices = cluster.num_devices
        if tensor < 1:
            raise UsageError(f"--tensor-parallel must be at least 1 (got {tensor}); 1 splits "
                             f"nothing")
        if not isinstance(plan.sync, AllReduceSync) and tensor > 1:
            raise UsageError(f"--tensor-parallel applies to allreduce plans and pipelines (--plan "
                             f"dp or a plan file), not to sync method {plan.sync.method!r}")
        if devices % tensor:
            divisors = ", ".join(str(t) for t in range(1, devices + 1) if devices % t == 0)
            raise UsageError(f"--tensor-parallel {tensor} does not divide the {devices} devices; "
                             f"use one of {divisors}")
        if data_parallel:
            base = data_parallel_plan(profile, devices // tensor)
            plan = dataclasses.replace(base, num_devices=devices, sync=plan.sync,
                                       compress=plan.compress)
        elif sum(plan.replicas) * tensor > devices:
            raise UsageError(f"plan {plan.config} with --tensor-parallel {tensor} needs "
                             f"{sum(plan.replicas) * tensor} devices but the cluster has "
                             f"{devices}; use a smaller degree or fewer replicas")
        plan = dataclasses.replace(plan, tensor_degree=tensor)
    return dataclasses.replace(plan, recompute=True) if recompute else plan


def add_sim_args(p: argparse.ArgumentParser) -> None:
    """Cost-model options shared by simulate, search and scale."""
    p.add_argument("--profile-batch", type=int,
                   help="minibatch the profile was measured at, if the profile does not say "
                   "(PipeDream's graph.txt)")
    p.add_argument("--memory", help="per-device memory limit, e.g. 16GB (default: the cluster's)")
    p.add_argument("--allreduce", choices=ALGORITHMS, default="auto",
                   help="allreduce algorithm (default auto: the cheapest)")
    p.add_argument("--allreduce-latency", metavar="TIME",
                   help="latency of one allreduce step, e.g. 20us or 0.00002 (seconds) "
                   "(default: the links')")
    p.add_argument("--compression", type=float, default=1.0, metavar="R",
                   help="divide allreduce bytes by R (e.g. 2 for fp16 gradients)")
    p.add_argument("--activation-compression", type=float, default=1.0, metavar="R",
                   help="divide the bytes sent between stages by R")
    p.add_argument("--optimizer-bandwidth", metavar="BW",
                   help="parameter bytes an optimizer step updates per second, e.g. 50GB/s "
                   "(default: steps take no time)")
    p.add_argument("--optimizer-state", type=float, default=1.0, metavar="X",
                   help="optimizer state bytes per parameter byte (SGD momentum 1, Adam 2)")
    p.add_argument("--overhead", default="0", metavar="TIME",
                   help="fixed time added to every forward and backward on top of the "
                   "profile's own fixed cost per call (e.g. the runtime's cost per action), e.g. "
                   "1ms, 50us or 0.001 (seconds) (default 0)")
    p.add_argument("--tensor-overhead", default="0", metavar="TIME",
                   help="with a tensor degree above 1: compute time each tensor allreduce adds "
                   "beyond the collective (the framework's work for the split layers around it, "
                   "e.g. DTensor's Python on a CPU), e.g. 2ms (default 0)")


def add_codec_args(p: argparse.ArgumentParser, *, compress: bool = True) -> None:
    """``--compress CODEC`` (unless the command has its own) and ``--codec-speedup X``."""
    if compress:
        p.add_argument("--compress", dest="codec", metavar="CODEC[:k=v]",
                       help="model a gradient codec as tandem train --compress runs it: fp16, "
                       "bf16, qsgd:levels=7, sign, topk:ratio=0.01, randk:ratio=0.01, "
                       "powersgd:rank=2 (its payloads by allreduce or allgather, its encode and "
                       "decode time; see docs/simulator.md)")
    p.add_argument("--codec-speedup", type=float, default=1.0, metavar="X",
                   help="encode and decode X times faster than the defaults, which were measured "
                   "on one CPU thread (e.g. 10-100 for a GPU; default 1)")


def sim_options(args: argparse.Namespace, profile: ModelProfile, **changes: Any) -> SimOptions:
    """The :class:`SimOptions` of the shared arguments."""
    overhead_s = parse_duration(args.overhead, "--overhead")
    fields: dict[str, Any] = dict(
        batch_scale=batch_scale(profile, args.batch_size if args.profile else None,
                                args.profile_batch),
        allreduce=args.allreduce,
        allreduce_latency_s=(parse_duration(args.allreduce_latency, "--allreduce-latency")
                             if args.allreduce_latency else None),
        gradient_compression=args.compression,
        activation_compression=args.activation_compression,
        optimizer_Bps=parse_bandwidth(args.optimizer_bandwidth) if args.optimizer_bandwidth else None,
        optimizer_state_factor=args.optimizer_state,
        compute_overhead_s=overhead_s,
        tensor_overhead_s=parse_duration(args.tensor_overhead, "--tensor-overhead"),
        compress=getattr(args, "codec", None),
        codec_speedup=getattr(args, "codec_speedup", 1.0),
    )
    return SimOptions(**{**fields, **changes})


def planning_inputs(args: argparse.Namespace) -> tuple[ModelProfile, Cluster]:
    """The profile and the cluster (with ``--memory`` applied) of the shared arguments."""
    cluster = with_memory(build_cluster(args), args.memory)
    return load_source(args), cluster


def load_plan(text: str, profile: ModelProfile, cluster: Cluster,
              args: argparse.Namespace | None = None) -> Plan:
    """``--plan``: a plan file, or a one-stage strategy (:data:`tandem.strategy.ONE_STAGE`) on
    every device, built from the flags as ``tandem train --strategy NAME`` builds it
    (:func:`tandem.strategy.plan_from_flags`: parameter servers on the first ``--servers``
    devices, the workers on the rest), its layers in a topological order of the profile's."""
    given = sync_flags_given(args)
    if text not in ONE_STAGE:
        if given:
            first = next(iter(given))
            raise UsageError(f"{first} applies to --plan {'|'.join(ONE_STAGE)}; the plan "
                             f"file {text!r} carries its own sync (drop {first})")
        return Plan.load(text)
    codec = getattr(args, "codec", None)
    if codec:
        given["--compress"] = codec
    plan = plan_from_flags(text, given, num_processes=cluster.num_devices,
                           num_blocks=profile.num_layers, spelling=SIMULATE_SPELLING)
    return dataclasses.replace(plan, layer_order=data_parallel_plan(profile, 1).layer_order)


def format_result(result: SimResult, cluster: Cluster) -> str:
    """A per-worker table and the headline figures."""
    lines = [f"cluster: {cluster.describe()}",
             _plan_line(result),
             f"{'worker':>6} {'stage':>5} {'device':>6} {'busy ms':>10} {'idle ms':>10} "
             f"{'comm ms':>10} {'act MB':>9} {'stash MB':>9} {'peak MB':>9}"]
    shown = result.workers
    if len(shown) > MAX_WORKER_ROWS:  # one row per stage: its first worker
        lines.append(f"({len(shown)} workers: the first replica of each stage)")
        shown = [w for w in result.workers if w.replica == 0]
    for w in shown:
        lines.append(f"{w.worker:>6} {'srv' if w.role == 'server' else w.stage:>5} {w.device:>6} {w.busy_s * 1e3:10.3f} "
                     f"{w.idle_s * 1e3:10.3f} {w.communication_s * 1e3:10.3f} "
                     f"{w.activation_bytes / 1e6:9.1f} {w.stashed_weight_bytes / 1e6:9.1f} "
                     f"{w.peak_memory_bytes / 1e6:9.1f}")
    rate = (f"{result.samples_per_s:.1f} samples/s" if result.samples_per_s is not None
            else f"{result.steps_per_s:.3f} steps/s")
    limit = ("no limit" if result.memory_limit_bytes is None else
             f"limit {result.memory_limit_bytes / 1e9:g} GB: "
             f"{'fits' if result.fits_memory else 'DOES NOT FIT'}")
    codec = f", encode+decode {result.codec_s * 1e3:.3f} ms" if result.codec_s else ""
    lines.append(f"step {result.step_time_s * 1e3:.3f} ms ({rate}); bubble "
                 f"{result.bubble_fraction:.1%}; compute {result.compute_s * 1e3:.3f} ms, "
                 f"communication {result.communication_s * 1e3:.3f} ms{codec} per step "
                 f"(busiest worker)")
    lines.append(f"peak memory {result.peak_memory_bytes / 1e9:.3f} GB per device ({limit})")
    if result.schedule.asynchronous and result.method == AllReduceSync.method:
        lines.append(f"steady state: {result.step_time_s * 1e3:.3f} ms per minibatch, after a "
                     f"fill of {result.fill_s * 1e3:.3f} ms")
    if result.step_meaning:
        updates = f"; {result.updates_per_s:.3f} updates/s" if result.updates_per_s else ""
        lines.append(f"step = {result.step_meaning}{updates}")
    return "\n".join(lines)


def _plan_line(result: SimResult) -> str:
    if result.method != AllReduceSync.method:
        servers = sum(w.role == "server" for w in result.workers)
        return (f"plan {result.config}, synchronized by {result.method}"
                + (f" with {servers} server(s)" if servers else "")
                + f", {result.num_microbatches} micro-batches per step")
    unit = 'minibatches simulated' if result.schedule.whole_minibatches else 'micro-batches per step'
    layout = (f" x tensor {result.tensor_degree} (each row: the first of its {result.tensor_degree}"
              f" devices)" if result.tensor_degree > 1 else "")
    layout += ", recompute" if result.recompute else ""
    return f"plan {result.config}{layout}, {result.schedule}, {result.num_microbatches} {unit}"


def gantt_steps(result: SimResult) -> set[int] | None:
    """The steps worth drawing: all of a flush schedule's, a few steady-state minibatches of
    PipeDream's long run."""
    if result.schedule.flushes:
        return None
    middle = result.num_microbatches // 2
    return set(range(middle, middle + max(4, 2 * len(result.workers))))


def run(args: argparse.Namespace) -> int:
    """Simulate, print a table (stderr with --json) or JSON, and write the trace and chart."""
    check_output_files(("--trace", args.trace), ("--gantt", args.gantt))
    if args.against is not None:
        from tandem.commands.against import run_against

        return run_against(args)
    if args.plan is None or (args.model is None and args.profile is None):
        raise UsageError("give --plan with --model or --profile, or --against RUN_DIR")
    profile, cluster = planning_inputs(args)
    plan = load_plan(args.plan, profile, cluster, args)
    plan = with_layout(plan, profile, cluster, tensor=args.tensor_parallel,
                       recompute=args.recompute, data_parallel=args.plan in ONE_STAGE)
    if args.schedule or args.microbatches is not None:  # checked, defaults re-decided
        plan = plan.rescheduled(args.schedule, args.microbatches)
    if plan.compress is not None and args.codec and args.codec.strip() != plan.compress.text:
        raise UsageError(f"--compress {args.codec} contradicts the plan's codec "
                         f"{plan.compress.text}; drop --compress or edit the plan")
    if plan.pipelined and plan.compress is not None and args.activation_compression == 1.0:
        warnings.warn(f"the plan's activation codec {plan.compress.text} is not modelled; give "
                      f"its ratio with --activation-compression R", PlanNote, stacklevel=1)
    # the plan's codec, parsed once, when --compress names it too (a plan file's pipeline
    # codec is its activations', which --compress does not model)
    options = sim_options(args, profile, compress=plan.compress if args.codec and plan.compress
                          else args.codec)
    if profile.batch_size is None and args.profile_batch:  # known now: report samples/s too
        profile = dataclasses.replace(profile, batch_size=args.profile_batch)
    result = simulate(plan, profile, cluster, options)
    human = sys.stderr if args.json else sys.stdout
    print(format_result(result, cluster), file=human)
    print(f"fixed cost per micro-batch: {profile.total_fixed_s() * 1e3:.3f} ms forward+backward "
          f"over all layers ({profile.fixed_costs}; docs/simulator.md section 8)", file=human)
    if args.trace:
        result.timeline.write(args.trace)
        print(f"wrote {args.trace}", file=human)
    if args.gantt:
        plot_gantt(result.timeline, args.gantt, steps=gantt_steps(result),
                   title=f"plan {result.config}, {result.schedule} on {cluster.describe()} (simulated)")
        print(f"wrote {args.gantt}", file=human)
    if args.json:
        print(strict_json.dumps(result.to_dict()))
    return 0
