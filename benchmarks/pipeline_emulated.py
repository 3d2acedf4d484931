"""Pipeline schedules measured on the emulated model against their ideal length from a profile.

The emulated model (``--model emulated:...``) waits each layer's profiled time instead of
computing, so four pipeline workers on this two-core machine behave like four devices. The
profile is PipeDream's VGG16 (``tests/data/profiles/vgg16.graph.txt``, measured on a GPU at
minibatch 128), split into four straight stages by ``tandem plan --straight`` (the stages come
out unequal: about 216, 74, 167 and 215 ms of forward + backward per minibatch).

(a) GPipe and 1F1B, 4 stages x 8 micro-batches: the measured step time (median over steps, on
    rank 0; the loss logged once at the end) against the ideal schedule length: the critical path of the schedule's own action
    order with every forward and backward lasting its stage's profiled time for one
    micro-batch and communication taking no time (see :func:`ideal_length`).
(b) PipeDream's asynchronous schedule, minibatches of one micro-batch's size: steady-state
    throughput (minibatches completed per second over the middle half of the run, from the
    trace) against the bottleneck stage's rate, ``1 / max_s (f_s + b_s)``. Measured with the
    loss logged once at the end (``--log-every`` = steps), and again with the default
    logging every 10 steps: each logging is a collective over all workers, which drains part
    of the asynchronous pipeline.
(c) Peak memory per stage of the three runs, from the run summaries: activations held for
    the backward (saved tensors, at their peak) and the weight stash.

Prints tables, then one JSON object on the last line.

    .venv/bin/python benchmarks/pipeline_emulated.py [--scale 1.0] [--bytes-scale 1e-3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tandem.plan import Plan
from tandem.profile import ModelProfile, load_profile
from tandem.schedule import Kind, Schedule, generate
from tandem.timeline import Timeline, event_action

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "tests" / "data" / "profiles" / "vgg16.graph.txt"
DATA = "images:n=1280,size=4,channels=1"
"""1024 training samples (full batches of 128 and 16); the emulated model ignores pixels."""


def ideal_length(schedule: Schedule, forward_s: Sequence[float],
                 backward_s: Sequence[float]) -> float:
    """Length of ``schedule`` when stage ``s`` computes a forward in ``forward_s[s]`` and a
    backward in ``backward_s[s]``, and communication is free.

    Each worker runs its actions in the schedule's order. A forward or backward starts at
    ``max(end of the worker's previous computation, time its input was sent)``; a send happens
    when the worker reaches it (right after the computation that produced the tensor);
    receives, allreduces and optimizer steps take no time. The length is the time the last
    worker finishes: the critical path through the schedule's dependency graph. For a straight
    pipeline of equal stages it is GPipe's and 1F1B's ``(M + S - 1) (f + b)``.
    """
    sent: dict[tuple[str, int | None, int], float] = {}
    clocks = [0.0] * schedule.num_workers
    positions = [0] * schedule.num_workers
    last_stage = schedule.num_stages - 1
    moved = True
    while moved:
        moved = False
        for worker, actions in enumerate(schedule.workers):
            while positions[worker] < len(actions):
                action = actions[positions[worker]]
                if action.kind.is_compute:
                    forward = action.kind is Kind.FORWARD
                    needs = (("act" if forward else "grad"), action.microbatch, worker)
                    has_input = action.stage > 0 if forward else action.stage < last_stage
                    if has_input and needs not in sent:
                        break  # the producer has not got there yet
                    start = max(clocks[worker], sent.get(needs, 0.0))
                    times = forward_s if forward else backward_s
                    clocks[worker] = start + times[action.stage]
                elif action.kind.is_send:
                    channel = "act" if action.kind is Kind.SEND_ACT else "grad"
                    assert action.peer is not None
                    sent[(channel, action.microbatch, action.peer)] = clocks[worker]
                positions[worker] += 1
                moved = True
    assert all(p == len(a) for p, a in zip(positions, schedule.workers)), "schedule stuck"
    return max(clocks)


def stage_times(profile: ModelProfile, bounds: Sequence[tuple[int, int]], factor: float
                ) -> tuple[list[float], list[float]]:
    """Forward and backward seconds of each stage, times ``factor`` (scale x batch share)."""
    forward = [factor * sum(layer.forward_s for layer in profile.layers[a:b]) for a, b in bounds]
    backward = [factor * sum(layer.backward_s for layer in profile.layers[a:b]) for a, b in bounds]
    return forward, backward


def tandem(*args: str) -> dict[str, Any]:
    """Run the ``tandem`` command line; return its JSON summary (or plan)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run([sys.executable, "-m", "tandem", *args, "--json"],
                            capture_output=True, text=True, env=env, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(f"tandem {' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def steady_rate(trace: Path, num_minibatches: int) -> float:
    """Minibatches per second over the middle half of an asynchronous run: stage 0's backward
    of a minibatch is the last thing done for it."""
    events = Timeline.from_json(json.loads(trace.read_text())).events
    backwards = [(event_action(e.name), e) for e in events if e.worker == 0]
    done = {a.microbatch: e.end_s for a, e in backwards if a and a.kind is Kind.BACKWARD}
    first, last = num_minibatches // 4, 3 * num_minibatches // 4
    return (last - first) / (done[last] - done[first])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=str(PROFILE))
    parser.add_argument("--profile-batch", type=int, default=128,
                        help="minibatch the profile was measured at (VGG16's: 128)")
    parser.add_argument("--scale", type=float, default=1.0, help="factor on profiled times")
    parser.add_argument("--bytes-scale", type=float, default=1e-3,
                        help="factor on activation and parameter sizes (CPU gloo)")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20, help="steps of GPipe and 1F1B")
    parser.add_argument("--pipedream-steps", type=int, default=96)
    parser.add_argument("--out", default=None, help="keep runs here (default: a temp dir)")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="pipeline_emulated_"))
    out.mkdir(parents=True, exist_ok=True)
    batch, micro = args.profile_batch, args.profile_batch // args.microbatches

    plan = tandem("plan", "--profile", args.profile, "--devices", str(args.stages),
                  "--bandwidth", "100GB/s", "--straight", "--no-activation-comm",
                  "-o", str(out / "plan.json"))
    bounds = [(stage["start"], stage["end"]) for stage in plan["stages"]]
    profile = load_profile(args.profile)
    model = (f"emulated:profile={args.profile},batch={batch},scale={args.scale},"
             f"bytes_scale={args.bytes_scale},params=profiled")
    common = ["train", "--model", model, "--data", DATA, "--strategy", "pipeline",
              "--nproc", str(args.stages), "--lr", "0.01", "--no-progress"]

    def with_schedule(kind: str, microbatches: int | None = None) -> list[str]:
        """The plan's stages run with ``kind`` (the plan fixes the schedule)."""
        path = out / f"plan-{kind}.json"
        Plan.load(str(out / "plan.json")).rescheduled(kind, microbatches).save(str(path))
        return ["--plan", str(path)]

    forward, backward = stage_times(profile, bounds, args.scale * micro / batch)
    replicas = (1,) * args.stages

    runs: dict[str, dict[str, Any]] = {}
    print(f"(a) {args.stages} stages x {args.microbatches} micro-batches of {micro}; stage "
          f"f+b per micro-batch: {', '.join(f'{(f + b) * 1e3:.1f}' for f, b in zip(forward, backward))} ms")
    print(f"{'schedule':10}{'ideal':>12}{'measured':>12}{'measured/ideal':>16}")
    for kind in ("gpipe", "1f1b"):
        summary = tandem(*common, *with_schedule(kind, args.microbatches),
                         "--batch-size", str(batch), "--steps", str(args.steps),
                         "--log-every", str(args.steps), "--out", str(out / kind))
        ideal = ideal_length(generate(kind, replicas, args.microbatches), forward, backward)
        runs[kind] = {"ideal_step_s": ideal, "step_time_s": summary["step_time_s"],
                      "ratio": summary["step_time_s"] / ideal, "workers": summary["workers"]}
        print(f"{kind:10}{ideal * 1e3:9.1f} ms{summary['step_time_s'] * 1e3:9.1f} ms"
              f"{runs[kind]['ratio']:16.3f}")

    bottleneck_rate = 1.0 / max(f + b for f, b in zip(forward, backward))
    print(f"\n(b) pipedream, minibatches of {micro}, {args.pipedream_steps} minibatches; "
          f"bottleneck stage rate {bottleneck_rate:.2f}/s")
    print(f"{'loss logged':22}{'steady state':>14}{'median step':>14}{'steady/bottleneck':>19}")
    for name, log_every in (("pipedream", args.pipedream_steps), ("pipedream_log10", 10)):
        summary = tandem(*common, *with_schedule("pipedream"), "--batch-size", str(micro),
                         "--steps", str(args.pipedream_steps), "--log-every", str(log_every),
                         "--out", str(out / name))
        rate = steady_rate(out / name / "trace.json", args.pipedream_steps)
        runs[name] = {"log_every": log_every, "bottleneck_rate": bottleneck_rate,
                      "steady_rate": rate, "ratio": rate / bottleneck_rate,
                      "median_step_rate": 1.0 / summary["step_time_s"],
                      "workers": summary["workers"]}
        when = "at the end" if log_every == args.pipedream_steps else f"every {log_every} steps"
        print(f"{when:22}{rate:12.2f}/s{1 / summary['step_time_s']:12.2f}/s"
              f"{rate / bottleneck_rate:19.3f}")
    print("(logging the loss is a collective over all workers: each one drains part of the "
          "asynchronous pipeline)")

    print("\n(c) peak memory per stage (KB): activations held for the backward + weight stash")
    memory_runs = ("gpipe", "1f1b", "pipedream")
    print(f"{'stage':6}" + "".join(f"{kind:>22}" for kind in memory_runs))
    for stage in range(args.stages):
        cells = []
        for kind in memory_runs:
            run = runs[kind]
            worker = next(w for w in run["workers"] if w["stage"] == stage)
            cells.append(f"{worker['peak_activation_bytes'] / 1e3:11.1f} + "
                         f"{worker['stash_peak_bytes'] / 1e3:8.1f}")
        print(f"{stage:<6}" + "".join(f"{cell:>22}" for cell in cells))
    parameters = [next(w for w in runs["gpipe"]["workers"] if w["stage"] == s)["parameter_bytes"]
                  for s in range(args.stages)]
    print(f"parameters per stage (KB): {', '.join(f'{p / 1e3:.1f}' for p in parameters)}")
    print(json.dumps({
        "benchmark": "pipeline_emulated", "profile": Path(args.profile).name, "scale": args.scale,
        "bytes_scale": args.bytes_scale, "stages": args.stages, "bounds": bounds,
        "microbatches": args.microbatches, "microbatch_size": micro, **{
            kind: {key: value for key, value in run.items() if key != "workers"}
            for kind, run in runs.items()},
        "memory": {kind: [{key: w[key] for key in ("stage", "peak_activation_bytes",
                                                    "stash_peak_bytes", "parameter_bytes")}
                          for w in runs[kind]["workers"]] for kind in memory_runs},
    }))


if __name__ == "__main__":
    main()
