"""``tandem simulate --against RUN_DIR``: simulate a finished run's own plan on this machine and
print the predicted step times next to the measured ones.

Usage::

    tandem train --model mlp --data digits --nproc 2 --strategy pipeline --out runs/a
    tandem simulate --against runs/a [--json] [--cluster SPEC] [--gantt PNG]

From the run directory it reads ``plan.json`` (the plan it ran), ``config.json`` (model, data,
global batch, processes, threads, optimizer) and ``trace.json`` (every worker's actions). It then

1. profiles the run's model on this machine at the size of the run's micro-batch (the global
   batch over the plan's micro-batches; a whole minibatch for PipeDream's schedule), with the
   run's threads per worker, and tells the simulator that a step holds ``batch / micro`` of
   those (``SimOptions.batch_scale``);
2. describes the machine: ``--cluster SPEC`` (or ``--devices`` and ``--bandwidth``) as given,
   else calibrated here by :func:`tandem.runtime.calibrate.calibrate` (gloo latency and
   bandwidth, ring-allreduce step latency, how fast busy processes run together; a few seconds)
   plus the speed of the run's optimizer step on the model's parameters;
3. simulates the plan (four steps of a flush schedule) and reads both timelines the same way
   (:mod:`tandem.planning.simulate.compare`): per worker, the median time between the ends of its
   consecutive steps after the warm-up; overall, the same for the whole job's steps next to
   the simulator's step time.

Workers of an emulated model (``emulated:...``) sleep, so they are given the speed of a device
of their own; workers of a real model on the CPU share its cores at the calibrated speed. Not
modelled here: the runtime's own cost per forward and backward (give it with ``--overhead``),
a pipeline's activation codec, and any load other processes put on the machine during the run
but not during the calibration, or the other way round.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from tandem import strict_json
from tandem.cluster import Cluster, parse_duration
from tandem.commands.args import build_cluster
from tandem.errors import UsageError
from tandem.plan import Plan
from tandem.planning.simulate.compare import (
    GANTT_STEPS,
    Comparison,
    compare,
    gantt_window,
    plot_comparison,
    simulated_skip,
    warmup_steps,
)
from tandem.planning.simulate.simulator import SimOptions, SimResult, simulate
from tandem.profile import ModelProfile
from tandem.strategy import strategy_of
from tandem.timeline import Timeline

REFUSED = ("plan", "model", "profile", "batch_size", "data", "schedule", "microbatches")
"""Options that say what to simulate, which ``--against`` reads from the run instead."""
SIMULATED_STEPS = 4
"""Steps of a flush schedule simulated back to back (the first is left out as the fill)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RecordedRun:
    """What a ``tandem train --out DIR`` run left behind."""

    path: Path
    plan: Plan
    settings: dict[str, Any]
    """``config.json``'s ``run``: model, data, batch_size, nproc, threads, optimizer, ..."""
    timeline: Timeline

    @property
    def micro_batch(self) -> int:
        """Samples in one forward of the run: the global batch over the plan's micro-batches
        (PipeDream's schedule runs whole minibatches)."""
        return max(1, int(self.settings["batch_size"]) // int(self.plan.num_microbatches or 1))

    @property
    def emulated(self) -> bool:
        """True when the workers ran the emulated model (they sleep, not compute)."""
        return str(self.settings["model"]).partition(":")[0] == "emulated"


def read_run(directory: str) -> RecordedRun:
    """The run in ``directory``; :class:`UsageError` naming what is missing otherwise."""
    path = Path(directory)
    if not path.is_dir():
        raise UsageError(f"--against {directory}: no such directory (give the --out DIR of a "
                         f"tandem train run)")
    for name in ("plan.json", "config.json", "trace.json"):
        if not (path / name).is_file():
            raise UsageError(f"--against {directory}: no {name} there; is it the --out directory "
                             f"of a finished tandem train run? (runs write plan.json, config.json "
                             f"and trace.json when they end; rerun it with --out)")
    try:
        plan = Plan.load(str(path / "plan.json"))
        settings = json.loads((path / "config.json").read_text())["run"]
        timeline = Timeline.from_json(json.loads((path / "trace.json").read_text()))
        for key in ("model", "data", "batch_size"):
            settings[key]
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"--against {directory}: unreadable run files ({exc!r}); rerun the "
                         f"training with --out") from None
    return RecordedRun(path=path, plan=plan, settings=settings, timeline=timeline)


def check_simulable(plan: Plan) -> None:
    """:class:`UsageError` naming the strategy for a plan the simulator cannot replay yet."""
    what = None
    if plan.schedule_text is not None:
        what = "a hand-written schedule (the simulator generates schedules from the plan's kind)"
    elif plan.tensor_degree > 1:
        what = f"tensor parallelism (tensor degree {plan.tensor_degree})"
    if what:
        raise UsageError(f"the simulator cannot simulate this run's plan yet: strategy "
                         f"{strategy_of(plan)}, plan {plan.config} uses {what}")


def profile_run(run: RecordedRun) -> ModelProfile:
    """The run's model profiled here at its micro-batch, with its threads per worker."""
    import torch

    from tandem.commands.profile import measure

    torch.set_num_threads(int(run.settings.get("threads") or 1))
    return measure(str(run.settings["model"]), run.micro_batch, run.settings.get("data"))


def describe_machine(args: argparse.Namespace, run: RecordedRun,
                     profile: ModelProfile) -> tuple[Cluster, SimOptions, dict[str, Any]]:
    """The cluster and options to simulate ``run`` with, and what was measured for them."""
    from tandem.runtime.calibrate import calibrate, optimizer_Bps

    plan = run.plan
    options = SimOptions(batch_scale=run.settings["batch_size"] / run.micro_batch,
                         num_steps=SIMULATED_STEPS,
                         compute_overhead_s=parse_duration(args.overhead, "--overhead"),
                         compress=None if plan.pipelined or plan.compress is None
                         else plan.compress)
    parameter_bytes = sum(layer.parameter_bytes for layer in profile.layers)
    step_Bps = optimizer_Bps(parameter_bytes, str(run.settings.get("optimizer", "sgd")))
    options = dataclasses.replace(options, optimizer_Bps=step_Bps)
    measured: dict[str, Any] = {"optimizer_Bps": step_Bps}
    if args.cluster is not None or args.devices is not None or args.bandwidth is not None:
        cluster = build_cluster(args)
    else:
        calibration = calibrate(plan.num_workers)
        cluster = calibration.cluster(plan.num_devices, contended=not run.emulated)
        options = dataclasses.replace(
            options, allreduce="ring", allreduce_latency_s=calibration.allreduce_step_latency_s)
        measured["calibration"] = calibration.to_dict()
    if args.allreduce_latency:
        options = dataclasses.replace(options,
                                      allreduce_latency_s=parse_duration(args.allreduce_latency,
                                                                         "--allreduce-latency"))
    return cluster, options, measured


def predict(run: RecordedRun, profile: ModelProfile, cluster: Cluster,
            options: SimOptions) -> SimResult:
    """Simulate the run's plan; :class:`UsageError` naming the strategy if it cannot be."""
    try:
        return simulate(run.plan, profile, cluster, options)
    except UsageError as exc:
        raise UsageError(f"the simulator cannot simulate this run's plan (strategy "
                         f"{strategy_of(run.plan)}, plan {run.plan.config}): {exc}") from None


def format_comparison(run: RecordedRun, comparison: Comparison, cluster: Cluster,
                      measured: dict[str, Any]) -> str:
    """A table: per worker and overall, predicted and measured ms per step and the error."""
    plan, settings = run.plan, run.settings
    steps = comparison.measured_steps
    lines = [f"run {run.path}: {strategy_of(plan)} plan {plan.config}, {plan.schedule}, "
             f"{plan.num_microbatches} micro-batch(es) of {run.micro_batch}; "
             f"{settings['model']} on {settings['data']}, global batch {settings['batch_size']}",
             f"cluster: {cluster.describe()}{_calibration_text(measured)}",
             f"measured: median over steps {steps[0]}-{steps[-1]} (earlier ones are warm-up)",
             f"{'worker':>6} {'stage':>5} {'predicted ms':>13} {'measured ms':>12} {'error':>8}"]
    for row in comparison.workers:
        stage = "srv" if row.role == "server" else row.stage
        lines.append(f"{row.worker:>6} {stage:>5} {row.predicted_step_s * 1e3:13.3f} "
                     f"{row.measured_step_s * 1e3:12.3f} {row.error:+8.1%}")
    whole = comparison.overall
    lines.append(f"{'all':>6} {'':>5} {whole.predicted_step_s * 1e3:13.3f} "
                 f"{whole.measured_step_s * 1e3:12.3f} {whole.error:+8.1%}")
    return "\n".join(lines)


def _calibration_text(measured: dict[str, Any]) -> str:
    calibration = measured.get("calibration")
    if not calibration:
        return " (as given)"
    return (f"; calibrated here: latency {calibration['hop_latency_s'] * 1e3:.2f} ms with all "
            f"exchanging, {calibration['bandwidth_Bps'] / 1e9:.2f} GB/s, allreduce step "
            f"{calibration['allreduce_step_latency_s'] * 1e3:.2f} ms, busy processes at "
            f"{calibration['speed']:.2f}x")


def draw(run: RecordedRun, result: SimResult, skip_steps: int, path: str) -> None:
    """The predicted and the measured Gantt charts of a few steady steps, one above the other."""
    count = 2 * len(result.workers) if result.schedule.asynchronous else GANTT_STEPS
    measured_steps = gantt_window(run.timeline, skip_steps=skip_steps, count=count)
    predicted_steps = gantt_window(result.timeline, skip_steps=simulated_skip(result), count=count)
    title = f"{strategy_of(run.plan)} {run.plan.config}, {run.plan.schedule}"
    plot_comparison(result.timeline, predicted_steps, run.timeline, measured_steps, path,
                    titles=[f"{title}: predicted (steps {_range(predicted_steps)})",
                            f"{title}: measured (steps {_range(measured_steps)})"])


def _range(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if steps else "none"


def run_against(args: argparse.Namespace) -> int:
    """``tandem simulate --against``: print the comparison (stderr with ``--json``), the JSON
    object, and draw the charts."""
    given = [name for name in REFUSED if getattr(args, name, None) is not None]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise UsageError(f"{flag} does not apply with --against, which reads the plan, model, "
                         f"data and batch from the run; drop {flag}")
    run = read_run(args.against)
    check_simulable(run.plan)
    skip = warmup_steps(run.plan, int(run.settings.get("steps") or 0))
    steps = {event.step for event in run.timeline.events if event.step >= 0}
    if len(steps) < skip + 1:
        raise UsageError(f"--against {args.against}: the trace has {len(steps)} steps, too few to "
                         f"measure after {skip} warm-up steps; train for {skip + 2} or more")
    profile = profile_run(run)
    cluster, options, measured = describe_machine(args, run, profile)
    result = predict(run, profile, cluster, options)
    comparison = compare(result, run.timeline, skip_steps=skip)
    human = sys.stderr if args.json else sys.stdout
    print(format_comparison(run, comparison, cluster, measured), file=human)
    gantt = args.gantt or str(run.path / "predicted_vs_measured.png")
    draw(run, result, skip, gantt)
    print(f"wrote {gantt}", file=human)
    if args.trace:
        result.timeline.write(args.trace)
        print(f"wrote {args.trace}", file=human)
    if args.json:
        print(strict_json.dumps({**comparison.to_dict(), "run": str(run.path),
                                 "strategy": strategy_of(run.plan), "plan": run.plan.config,
                                 "schedule": run.plan.schedule, "micro_batch": run.micro_batch,
                                 "batch_scale": options.batch_scale, "warmup_steps": skip,
                                 "cluster": cluster.describe(), **measured, "gantt": gantt}))
    return 0
