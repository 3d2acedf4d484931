"""The ``tandem scale`` command: predicted speedup against device count, and where it stops."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from tandem import strict_json
from tandem.cluster import parse_cluster
from tandem.commands.args import load_source, with_memory
from tandem.commands.simulate import add_codec_args, add_sim_args, sim_options
from tandem.commands.output_paths import check_output_files
from tandem.errors import UsageError
from tandem.planning.search.scaling import FAMILIES, ScaleOptions, ScaleResult, scale
from tandem.planning.simulate.tensor import DEFAULT_MAX_TENSOR_DEGREE
from tandem.profile import ModelProfile
from tandem.spec.codec import CodecSpec

DEFAULT_MINIBATCHES = 8
"""Without ``--batch-size``, the global minibatch is this many of the profile's minibatches."""


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``tandem scale``."""
    p = subparsers.add_parser(
        "scale",
        help="predicted speedup vs device count for data parallelism, pipelines, hybrids, "
        "parameter servers, gossip and local SGD",
        description="Simulate one global minibatch (fixed: strong scaling) or a fixed batch per "
        "device (--per-device-batch: weak scaling) on 1, 2, 4, ... devices of a cluster for data "
        "parallelism (plain and with compressed gradients), a straight pipeline and the "
        "partitioner's hybrid plan, and tensor + pipeline + data layouts (3d); print speedups, compute and communication per step, and the "
        "device count where communication overtakes compute; also synchronous parameter "
        "servers, D-PSGD on a ring and local SGD (--families). Each curve is the best plan up "
        "to its device count (devices may be left idle).",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="profile this model spec locally first (e.g. vgg)")
    source.add_argument("--profile", help="profile file: tandem JSON or PipeDream graph.txt")
    p.add_argument("--data", default=None, help="with --model: dataset spec")
    p.add_argument("--batch-size", type=int,
                   help="global minibatch in samples (default: 8 of the profile's minibatches); "
                   "with --model, the profile is measured at 32 samples")
    p.add_argument("--minibatches", type=float, metavar="K",
                   help=f"global minibatch as K of the profile's minibatches (default {DEFAULT_MINIBATCHES})")
    p.add_argument("--per-device-batch", type=int, metavar="B",
                   help="weak scaling: every training device runs B samples per step, so the "
                   "global batch grows with the devices; speedup is throughput relative to one "
                   "device running B samples (needs the profile's minibatch: --profile-batch for "
                   "PipeDream profiles)")
    p.add_argument("--cluster", required=True,
                   help="cluster spec giving each level's bandwidth and latency, innermost first "
                   "(e.g. 8x300GB/s,128x25Gb/s); the outermost level grows with the device count")
    p.add_argument("--max-devices", type=int, default=1024, help="largest device count (default 1024)")
    p.add_argument("--compress", default="2,32", metavar="R|CODEC,...",
                   help="gradient compressions to show for data parallelism: ratios (default "
                   "2,32: fp16 and 1-bit, bytes divided and nothing else) or codecs as for "
                   "tandem train --compress (e.g. 2,sign,topk:ratio=0.01: their collective and "
                   "encode/decode time modelled)")
    p.add_argument("--microbatches-per-stage", type=int, default=4, metavar="K",
                   help="pipelines: micro-batches per stage and step (default 4)")
    p.add_argument("--families", default=",".join(FAMILIES),
                   help=f"synchronization families to draw beside dp and pipelines (default "
                   f"{','.join(FAMILIES)}; 'none' for none): synchronous parameter servers, "
                   f"D-PSGD on a ring, local SGD")
    p.add_argument("--max-tensor-degree", type=int, default=DEFAULT_MAX_TENSOR_DEGREE, metavar="T",
                   help=f"the 3d curve (tensor + pipeline + data) tries tensor degrees up to T "
                   f"that divide a server (default {DEFAULT_MAX_TENSOR_DEGREE}; 1: no 3d curve)")
    p.add_argument("--ps-servers", type=int, default=1, metavar="S",
                   help="parameter servers of the ps curve (default 1; the rest train)")
    p.add_argument("--period", type=int, default=4, metavar="H",
                   help="local SGD's averaging period (default 4)")
    add_sim_args(p)
    add_codec_args(p, compress=False)
    p.add_argument("--plot", default="scale.png", help="PNG of speedups and DP's compute vs "
                   "communication (default scale.png; 'none' for no plot)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(run=run)


def _compressions(text: str) -> tuple[float | CodecSpec, ...]:
    """``2,32,topk:ratio=0.01,ef=false`` -> ``(2.0, 32.0, <the spec topk:ratio=0.01,ef=false>)``:
    an item with ``=`` and no ``:`` continues the codec before it."""
    items: list[str] = []
    for part in (part.strip() for part in text.split(",")):
        if "=" in part and ":" not in part and items and ":" in items[-1]:
            items[-1] += "," + part
        elif part:
            items.append(part)
    result: list[float | CodecSpec] = []
    for item in items:
        try:
            result.append(float(item))
        except ValueError:
            name = item.partition(":")[0]
            if not name.isidentifier():
                raise UsageError(f"--compress {text!r} is not a list of ratios or codecs like "
                                 f"2,32,topk:ratio=0.01") from None
            result.append(CodecSpec.parse(item))
    return tuple(result)


def _families(text: str) -> tuple[str, ...]:
    """``ps,gossip`` -> ``("ps", "gossip")``; ``none`` -> ``()``."""
    if text.strip() == "none":
        return ()
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _weak_profile(args: argparse.Namespace, profile: ModelProfile) -> ModelProfile:
    """``profile`` with the minibatch it was measured at, for ``--per-device-batch``."""
    if args.batch_size is not None or args.minibatches is not None:
        given = "--batch-size" if args.batch_size is not None else "--minibatches"
        raise UsageError(f"give either --per-device-batch {args.per_device_batch} (weak scaling) "
                         f"or {given} (a fixed global batch: strong scaling), not both")
    if args.per_device_batch < 1:
        raise UsageError(f"--per-device-batch must be at least 1 sample "
                         f"(got {args.per_device_batch})")
    measured = args.profile_batch or profile.batch_size
    if not measured:
        raise UsageError(f"--per-device-batch {args.per_device_batch} counts samples, but the "
                         f"profile does not record the minibatch it was measured at: add "
                         f"--profile-batch N")
    return dataclasses.replace(profile, batch_size=measured)


def _global_batch(args: argparse.Namespace, profile: ModelProfile) -> tuple[float, int | None]:
    """``(batch_scale, samples or None)`` of ``--batch-size`` / ``--minibatches``."""
    measured = args.profile_batch or profile.batch_size
    if args.batch_size is not None and args.minibatches is not None:
        raise UsageError("give either --batch-size or --minibatches, not both")
    if args.batch_size is not None:
        if args.batch_size < 1:
            raise UsageError(f"--batch-size must be at least 1 (got {args.batch_size})")
        if not measured:
            raise UsageError(
                f"the profile does not record the minibatch it was measured at, so --batch-size "
                f"{args.batch_size} cannot be related to it: add --profile-batch N, or give "
                f"--minibatches K")
        return args.batch_size / measured, args.batch_size
    minibatches = DEFAULT_MINIBATCHES if args.minibatches is None else args.minibatches
    if not minibatches > 0:
        raise UsageError(f"--minibatches must be positive (got {minibatches})")
    return minibatches, round(minibatches * measured) if measured else None


def format_scale(result: ScaleResult, describe: str, batch: str) -> str:
    """One row per device count: speedup of each strategy (the best plan up to that count), and
    DP's compute and communication on exactly that count."""
    names = result.strategies()
    widths = [max(9, len(name)) for name in names]
    header = f"{'devices':>7} " + " ".join(f"{name:>{w + 1}}" for name, w in zip(names, widths))
    baseline = ("whole global minibatch" if result.scaling == "strong"
                else f"{result.per_device_batch} samples")
    lines = [f"cluster: {describe}; {batch}; one device ({baseline}): "
             f"{result.single_step_s * 1e3:.1f} ms per step{_unfit(result)}",
             "speedup vs one device (throughput; * = the best plan up to that count uses fewer "
             "devices; dp compute and comm: on exactly that count):",
             header + f" {'dp compute ms':>14} {'dp comm ms':>11}"]
    for n in result.device_counts:
        cells = []
        for name, w in zip(names, widths):
            point = next((p for p in result.series(name) if p.num_devices == n), None)
            mark = "*" if point and point.devices_used < n else " "
            cells.append(f"{point.speedup:{w}.1f}{mark}" if point else f"{'-':>{w}} ")
        dp = next((p for p in result.simulated_series("dp") if p.num_devices == n), None)
        tail = f" {dp.compute_s * 1e3:14.1f} {dp.communication_s * 1e3:11.1f}" if dp else ""
        lines.append(f"{n:>7} " + " ".join(cells) + tail)
    for name, count in result.crossover.items():
        best = result.series(name)[-1]
        where = f"at {count} devices" if count else "not within the range"
        lines.append(f"{name}: communication overtakes compute {where}; on {best.num_devices}: "
                     f"speedup {best.speedup:.1f}x, efficiency {best.efficiency:.1%}, using "
                     f"{best.devices_used} ({best.config[:40]})")
    lines += [f"skipped {item}" for item in result.skipped]
    return "\n".join(lines)


def _unfit(result: ScaleResult) -> str:
    """What to say when the one-device baseline does not fit the memory limit ("" when it
    does)."""
    if result.single_fits or result.memory_limit_bytes is None:
        return ""
    drawn = [p.strategy for p in result.simulated if p.num_devices == 1]
    return (f", but it needs {result.single_memory_bytes / 1e9:.3g} GB per device, over the "
            f"limit of {result.memory_limit_bytes / 1e9:g} GB: speedups are against a device "
            f"with enough memory" + (f"; on 1 device only {', '.join(drawn)} fits (fewer "
                                     f"samples at once)" if drawn else ""))


def plot_scale(result: ScaleResult, path: str, title: str) -> None:
    """Left: speedup per strategy (log-log, with the ideal); right: DP's compute and
    communication per step, the crossover marked."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.8), dpi=110)
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    counts = result.device_counts
    left.plot(counts, counts, color="#bbbbbb", linestyle="--", label="ideal")
    for name in result.strategies():
        series = result.series(name)
        left.plot([p.num_devices for p in series], [p.speedup for p in series], marker="o",
                  markersize=3, label=name)
    ylabel = "speedup vs one device" + ("" if result.single_fits else
                                        f" ({result.single_memory_bytes / 1e9:.3g} GB: over "
                                        f"the limit)")
    left.set(xscale="log", yscale="log", xlabel="devices", ylabel=ylabel,
             title="speedup, best plan up to each count (" + (
                 "fixed global minibatch)" if result.scaling == "strong"
                 else f"{result.per_device_batch} samples per device)"))
    left.legend(fontsize=8)
    dp = result.simulated_series("dp")
    right.plot([p.num_devices for p in dp], [p.compute_s * 1e3 for p in dp], marker="o",
               markersize=3, label="dp compute / step")
    right.plot([p.num_devices for p in dp], [p.communication_s * 1e3 for p in dp], marker="o",
               markersize=3, label="dp allreduce / step")
    right.plot([p.num_devices for p in dp], [p.step_time_s * 1e3 for p in dp], color="black",
               linewidth=1, label="dp step (overlapped)")
    crossing = result.crossover.get("dp")
    if crossing:
        right.axvline(crossing, color="#c44e52", linestyle=":", label=f"crossover: {crossing}")
    right.set(xscale="log", yscale="log", xlabel="devices", ylabel="ms per step",
              title="data parallelism: compute vs communication")
    right.legend(fontsize=8)
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.grid(linewidth=0.3, alpha=0.5)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)


def result_dict(result: ScaleResult, batch_scale: float | None,
                samples: int | None) -> dict[str, Any]:
    """The JSON output of ``tandem scale``: ``points`` are the curves (the best plan up to each
    device count), ``simulated`` each strategy on exactly each count; ``batch_scale`` and
    ``batch_samples`` are the fixed global batch (null under weak scaling)."""
    return {"scaling": result.scaling, "per_device_batch": result.per_device_batch,
            "single_step_s": result.single_step_s, "single_fits": result.single_fits,
            "single_memory_bytes": result.single_memory_bytes, "batch_scale": batch_scale,
            "batch_samples": samples, "device_counts": result.device_counts,
            "crossover": result.crossover, "skipped": result.skipped,
            "points": [dataclasses.asdict(point) for point in result.points],
            "simulated": [dataclasses.asdict(point) for point in result.simulated]}


def run(args: argparse.Namespace) -> int:
    """Analyse, print the table (stderr with --json) or JSON, and draw the plot."""
    check_output_files(("--plot", args.plot if args.plot and args.plot != "none" else None))
    cluster = with_memory(parse_cluster(args.cluster), args.memory)
    options = ScaleOptions(max_devices=args.max_devices, compressions=_compressions(args.compress),
                           microbatches_per_stage=args.microbatches_per_stage,
                           families=_families(args.families),
                           ps_servers=args.ps_servers, period=args.period,
                           per_device_batch=args.per_device_batch,
                           max_tensor_degree=args.max_tensor_degree)
    profile = load_source(argparse.Namespace(profile=args.profile, model=args.model,
                                             batch_size=None, data=args.data))  # --model: torch
    weak = args.per_device_batch is not None
    if weak:
        profile = _weak_profile(args, profile)
        batch_scale, samples = None, None
        batch = (f"{args.per_device_batch} samples per device (weak scaling: the global batch "
                 f"grows with the devices)")
    else:
        batch_scale, samples = _global_batch(args, profile)
        if profile.batch_size is None and args.profile_batch:  # the planner knows the samples
            profile = dataclasses.replace(profile, batch_size=args.profile_batch)
        batch = (f"global minibatch {batch_scale:g} profile minibatches"
                 + (f" ({samples} samples)" if samples else ""))
    sim = dataclasses.replace(sim_options(args, profile), batch_scale=batch_scale or 1.0)
    result = scale(profile, cluster, dataclasses.replace(options, batch_samples=samples), sim)
    human = sys.stderr if args.json else sys.stdout
    print(format_scale(result, args.cluster, batch), file=human)
    if args.plot and args.plot != "none":
        plot_scale(result, args.plot, f"{profile.model or args.profile or args.model} on "
                   f"{args.cluster}, {batch}")
        print(f"wrote {args.plot}", file=human)
    if args.json:
        print(strict_json.dumps(result_dict(result, batch_scale, samples)))
    return 0
