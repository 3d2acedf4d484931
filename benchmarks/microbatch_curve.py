"""Step time against the number of micro-batches: the U-shape a fixed cost per micro-batch makes,
measured with the real runtime and predicted by the simulator, emulated and real.

A pipeline step of ``S`` equal stages and ``M`` micro-batches takes about
``(M + S - 1) (c + V / M)``: ``V`` the stage's time per minibatch that shrinks with the
micro-batch, ``c`` what every micro-batch pays however small it is (kernel launches, framework
dispatch, per-message latency). Without ``c`` the best ``M`` is always the largest; with it, the
curve is a U with its bottom near ``sqrt((S - 1) V / c)``.

One profile of a real MLP, by ``tandem profile`` on this machine (one thread), gives both the
per-layer times and each layer's fixed cost per call (fitted over the batch, its half, quarter
and eighth). Then, for each micro-batch count, a GPipe pipeline is run with ``tandem train ...
--strategy pipeline --plan PLAN --json`` (its ``step_time_s``: rank 0's median step after the
warm-up, the best of ``--repeats`` runs) and simulated (``tandem.planning.simulate.simulator``, the library
behind ``tandem simulate``) on the same plan:

- ``emulated``: 4 stages of the emulated model playing that profile (times x ``--scale``):
  each block waits ``fixed + (t - fixed) * share``, and the workers sleep, so they behave like
  four devices of their own;
- ``real``: 2 stages of the MLP itself, one thread per worker, sharing this machine's cores.

The cluster model comes from :func:`tandem.runtime.calibrate.calibrate` with the part's number of
workers (gloo latency and bandwidth while workers exchange; for the real part, the speed of two
busy processes). The runtime's own cost per forward or backward (Python, autograd, the engine's
sends and receives: ``SimOptions.compute_overhead_s``, ``tandem simulate --overhead``), which
no profile of the layers sees, is calibrated once per part on a workload that is not one of the
measured points: the same pipeline at 16 micro-batches running the emulated model with
``scale=0`` (no waits at all), measured minus simulated, per forward or backward on the
critical path (``2 (M + S - 1)`` of them). Each curve is also simulated without the profile's
fixed costs (``charge_fixed_costs=False``) and with no fixed cost at all (neither the profile's
nor the runtime's: the simulator before the fixed cost, as run without ``--overhead``).

    .venv/bin/python benchmarks/microbatch_curve.py [--parts emulated,real] [--steps 8]
        [--repeats 1] [--scale 4]

Prints a table per part, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from simulator_fidelity import tandem  # noqa: E402

from tandem.cluster import Cluster  # noqa: E402
from tandem.planning.search.balance import balanced_plan  # noqa: E402
from tandem.planning.simulate.simulator import SimOptions, simulate  # noqa: E402
from tandem.profile import ModelProfile  # noqa: E402

MODEL = "mlp:hidden=256,layers=8"
DATA = "images:n=2048,size=16,channels=3"
BATCH = 256
MICROBATCHES = (1, 2, 4, 8, 16, 32)
CALIBRATION_MICROBATCHES = 16
STAGES = {"emulated": 4, "real": 2}


def profile_here(path: Path) -> ModelProfile:
    """The MLP's profile at the run's batch, with its fitted fixed costs (one thread)."""
    tandem("profile", "--model", MODEL, "--data", DATA, "--batch-size", str(BATCH),
           "--repeats", "9", "-o", str(path))
    return ModelProfile.load(str(path))


def scaled(profile: ModelProfile, scale: float, path: Path) -> ModelProfile:
    """``profile`` with every time, fixed costs included, times ``scale`` (saved to ``path``)."""
    layers = [dataclasses.replace(layer, forward_s=layer.forward_s * scale,
                                  backward_s=layer.backward_s * scale,
                                  forward_fixed_s=layer.forward_fixed_s * scale,
                                  backward_fixed_s=layer.backward_fixed_s * scale)
              for layer in profile.layers]
    copy = dataclasses.replace(profile, layers=layers, model=f"{profile.model} x{scale}")
    copy.save(str(path))
    return copy


def measured_step_s(model: str, plan_path: Path, workers: int, steps: int, repeats: int) -> float:
    """The best of ``repeats`` runs' ``step_time_s``."""
    runs = []
    for _ in range(repeats):
        out = tandem("train", "--model", model, "--data", DATA, "--batch-size", str(BATCH),
                     "--steps", str(steps), "--nproc", str(workers), "--strategy", "pipeline",
                     "--plan", str(plan_path), "--threads", "1", "--json", "--no-progress",
                     "--log-every", str(steps))
        runs.append(float(json.loads(out.strip().splitlines()[-1])["step_time_s"]))
    return min(runs)


def runtime_overhead(profile: ModelProfile, stages: int, cluster: Cluster, steps: int,
                     repeats: int, tmp: Path) -> float:
    """Seconds the runtime adds to each forward or backward: the pipeline of ``stages`` at
    :data:`CALIBRATION_MICROBATCHES` micro-batches on the emulated model with no waits,
    measured minus simulated, per forward or backward on the critical path."""
    idle = scaled(profile, 0.0, tmp / "idle.json")
    count = CALIBRATION_MICROBATCHES
    plan = balanced_plan(profile, [1] * stages, schedule="gpipe", num_microbatches=count)
    plan_path = tmp / f"plan-idle-{stages}.json"
    plan.save(str(plan_path))
    measured = measured_step_s(f"emulated:profile={tmp / 'idle.json'}", plan_path, stages, steps,
                               repeats)
    simulated = simulate(plan, idle, cluster, SimOptions(record=False)).step_time_s
    return max(0.0, (measured - simulated) / (2 * (count + stages - 1)))


def curve(part: str, profile: ModelProfile, model: str, cluster: Cluster, options: SimOptions,
          steps: int, repeats: int, tmp: Path) -> list[dict[str, Any]]:
    """Measured and simulated step time (with and without fixed costs) per micro-batch count."""
    rows = []
    stages = STAGES[part]
    variants = {"simulated_s": options,
                "simulated_no_profile_fixed_s": dataclasses.replace(options, charge_fixed_costs=False),
                "simulated_no_fixed_s": dataclasses.replace(options, charge_fixed_costs=False,
                                                            compute_overhead_s=0.0)}
    for count in MICROBATCHES:
        plan = balanced_plan(profile, [1] * stages, schedule="gpipe", num_microbatches=count)
        plan_path = tmp / f"plan-{part}-{count}.json"
        plan.save(str(plan_path))
        row: dict[str, Any] = {"microbatches": count}
        row.update({key: simulate(plan, profile, cluster, how).step_time_s
                    for key, how in variants.items()})
        row["measured_s"] = measured_step_s(model, plan_path, stages, steps, repeats)
        row["ratio"] = row["simulated_s"] / row["measured_s"]
        rows.append(row)
        print(f"  {part} M={count:>2}: measured {row['measured_s'] * 1e3:7.2f} ms, simulated "
              f"{row['simulated_s'] * 1e3:7.2f} ms", file=sys.stderr, flush=True)
    return rows


def argmin(rows: list[dict[str, Any]], key: str) -> int:
    return min(rows, key=lambda row: row[key])["microbatches"]


def summarize(part: str, rows: list[dict[str, Any]], extra: dict[str, Any]) -> dict[str, Any]:
    """The part's table, printed, and its figures."""
    print(f"\n{part}: {STAGES[part]}-stage GPipe, {MODEL}, batch {BATCH}")
    print(f"{'M':>3} {'measured ms':>12} {'simulated ms':>13} {'ratio':>6} "
          f"{'no profile fixed':>17} {'no fixed at all':>16}")
    for r in rows:
        print(f"{r['microbatches']:>3} {r['measured_s'] * 1e3:12.2f} {r['simulated_s'] * 1e3:13.2f} "
              f"{r['ratio']:6.2f} {r['simulated_no_profile_fixed_s'] * 1e3:17.2f} "
              f"{r['simulated_no_fixed_s'] * 1e3:16.2f}")
    best = {"measured": argmin(rows, "measured_s"), "simulated": argmin(rows, "simulated_s"),
            "simulated_no_profile_fixed": argmin(rows, "simulated_no_profile_fixed_s"),
            "simulated_no_fixed": argmin(rows, "simulated_no_fixed_s")}
    measured_best = min(r["measured_s"] for r in rows)
    at_sim_best = next(r["measured_s"] for r in rows if r["microbatches"] == best["simulated"])
    print(f"best M: measured {best['measured']}, simulated {best['simulated']} (without the "
          f"profile's fixed costs {best['simulated_no_profile_fixed']}, with no fixed cost at all "
          f"{best['simulated_no_fixed']}); the simulated best runs "
          f"{at_sim_best / measured_best - 1:+.1%} slower than the measured best")
    return {"rows": rows, "best": best, "simulated_best_regret": at_sim_best / measured_best - 1,
            "max_abs_error": max(abs(r["ratio"] - 1) for r in rows), **extra}


def main() -> None:
    from tandem.runtime.calibrate import calibrate

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="emulated,real")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--scale", type=float, default=4.0,
                        help="factor on the profiled times for the emulated part (default 4)")
    args = parser.parse_args()
    parts = args.parts.split(",")
    summary: dict[str, Any] = {"model": MODEL, "batch": BATCH, "steps": args.steps,
                               "repeats": args.repeats, "scale": args.scale}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        profile = profile_here(tmp / "mlp.json")
        fixed, total = profile.total_fixed_s(), profile.total_compute_s()
        print(f"profile: {total * 1e3:.2f} ms per minibatch of {BATCH}, of which "
              f"{fixed * 1e3:.2f} ms fixed per call", file=sys.stderr, flush=True)
        summary["profile"] = {"compute_s": total, "fixed_s": fixed}
        for part in parts:
            calibration = calibrate(STAGES[part])
            cluster = calibration.cluster(STAGES[part], contended=part == "real")
            emulated = scaled(profile, args.scale, tmp / "emulated.json")
            overhead = runtime_overhead(profile, STAGES[part], cluster, args.steps, args.repeats,
                                        tmp)
            print(f"{part}: runtime cost per forward/backward {overhead * 1e3:.3f} ms",
                  file=sys.stderr, flush=True)
            options = SimOptions(compute_overhead_s=overhead, record=False)
            model, played = ((MODEL, profile) if part == "real"
                             else (f"emulated:profile={tmp / 'emulated.json'}", emulated))
            rows = curve(part, played, model, cluster, options, args.steps, args.repeats, tmp)
            summary[part] = summarize(part, rows, {"calibration": calibration.to_dict(),
                                                   "runtime_overhead_s": overhead})
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
