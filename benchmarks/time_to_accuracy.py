"""Steps to a target training loss at global batches 32 to 1024, predicted by McCandlish et
al.'s noise-scale model from a short measuring run against measured, on digits (mlp) and on
tokens (a small gpt), over seeds; the measured cost of staleness; and the batch ``tandem search
--objective time-to-accuracy`` picks on digits against the measured best.

For each task and seed ``s``:

- the measuring run of ``tandem search`` (``tandem.commands.measure_steps``: ``dp`` on 2
  workers at batch 32, seed ``100 + s``, so that no prediction is checked against its own run)
  gives the steps ``S0`` to the target and the gradient noise scale ``B_noise`` (at the step the
  loss reaches the target, or with ``--noise-step 50`` over the first 50 steps);
- the prediction at batch ``B`` is ``S0 (1 + B_noise/B) / (1 + B_noise/32)``, at the learning
  rate the model gives ``lr (1 + B_noise/32) / (1 + B_noise/B)``;
- the measured steps are those of ``tandem train --strategy dp`` (one worker: the same updates
  as any number of them) at batch ``B`` and that rate, seed ``s``: where the metrics lines'
  mean losses (every 5 steps) first reach the target, as the measuring run reads its own.

The step error of a batch is ``|predicted - measured| / measured``. Staleness: steps to the
digits target at batch 64 of asynchronous parameter servers (4 workers, staleness 3) and of a
4-stage PipeDream pipeline (staleness 3), against ``dp``, as ``(S_async / S_dp - 1) / 3``. The
search runs on two simulated 4-device clusters with synchronous plans only (the measured steps
are synchronous ones); the measured best batch is the one with the least measured steps (mean
over seeds) times the search's own simulated time per step. Prints tables, draws the plot,
ends with one JSON object on the last line.

    .venv/bin/python benchmarks/time_to_accuracy.py [--seeds 3] [--tasks digits,tokens]
        [--noise-step 50] [--plot docs/time_to_accuracy.png]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BATCHES = (32, 64, 128, 256, 512, 1024)
REFERENCE_BATCH = 32
LOG_EVERY = 5
STALE_BATCH = 64
STALE_RUNS = {
    "ps async": {"strategy": "ps", "servers": 1, "mode": "async", "nproc": 5},
    "pipedream": {"strategy": "pipeline", "schedule": "pipedream", "nproc": 4},
}
STALENESS = 3
CLUSTERS = {
    "4 x 10Gb/s": ("--devices", "4", "--bandwidth", "10Gb/s"),
    "4 x 10Gb/s, 2 ms per pass": ("--devices", "4", "--bandwidth", "10Gb/s", "--overhead",
                                  "2ms"),
}


@dataclasses.dataclass(frozen=True)
class Task:
    """A model on a dataset, its target loss and the measuring run's rate and length."""

    model: str
    data: str
    target: float
    lr: float
    measure_steps: int


TASKS = {
    "digits": Task(model="mlp", data="digits", target=0.3, lr=0.05, measure_steps=400),
    "tokens": Task(model="gpt:layers=2,dim=32,heads=2", data="tokens:n=4096,seq=16",
                   target=1.2, lr=0.1, measure_steps=200),
}


def train(task: Task, seed: int, batch: int, lr: float, steps: int,
          **strategy: Any) -> list[dict[str, Any]]:
    """The metrics lines of one run (``dp`` on one worker unless ``strategy`` says)."""
    from tandem import fit
    from tandem.commands.measure_steps import metrics_lines

    settings = {"strategy": "dp", "nproc": 1, **strategy}
    with tempfile.TemporaryDirectory(prefix="tta-") as out:
        fit(task.model, data=task.data, steps=steps, batch_size=batch, lr=lr, seed=seed,
            log_every=LOG_EVERY, out=out, **settings)
        return metrics_lines(Path(out) / "metrics.jsonl")


def measured_steps(task: Task, seed: int, batch: int, lr: float, cap: int,
                   **strategy: Any) -> tuple[float, bool]:
    """Steps to the target of one run of at most ``cap`` steps, and whether it got there
    (if not: ``cap``, a lower bound)."""
    from tandem.commands.measure_steps import crossing

    lines = train(task, seed, batch, lr, cap, **strategy)
    steps = crossing(lines, task.target, LOG_EVERY)
    return (float(cap), False) if steps is None else (steps, True)


def sweep(name: str, task: Task, seeds: int, noise_step: int | None) -> dict[str, Any]:
    """Predicted and measured steps at every batch, for every seed."""
    from tandem.commands.measure_steps import MeasureOptions, measure_steps

    rows = []
    for seed in range(seeds):
        model = measure_steps(MeasureOptions(
            model=task.model, data=task.data, target_loss=task.target, batch=REFERENCE_BATCH,
            lr=task.lr, steps=task.measure_steps, seed=100 + seed, log_every=LOG_EVERY,
            noise_step=noise_step))
        print(f"{name} seed {seed}: {model.source}", flush=True)
        for batch in BATCHES:
            predicted = model.steps(batch)
            cap = LOG_EVERY * math.ceil((2.5 * predicted + 40) / LOG_EVERY)
            lr = model.lr_at(batch)
            assert lr is not None
            steps, reached = measured_steps(task, seed, batch, lr, cap)
            error = abs(predicted - steps) / steps
            rows.append({"seed": seed, "batch": batch, "lr": lr, "predicted": predicted,
                         "measured": steps, "reached": reached, "error": error,
                         "noise_scale": model.noise_scale,
                         "reference_steps": model.reference_steps})
            print(f"  batch {batch:5d} lr {lr:.4f}: predicted {predicted:7.1f}, measured "
                  f"{'' if reached else '> '}{steps:7.1f}, error {error:.3f}", flush=True)
    return {"task": dataclasses.asdict(task), "rows": rows}


def staleness_cost(task: Task, seeds: int) -> dict[str, Any]:
    """Measured extra steps per unit of staleness, per asynchronous strategy."""
    per_kind: dict[str, list[float]] = {}
    dp = [measured_steps(task, seed, STALE_BATCH, task.lr, 600)[0] for seed in range(seeds)]
    result: dict[str, Any] = {"batch": STALE_BATCH, "staleness": STALENESS, "dp_steps": dp}
    for kind, strategy in STALE_RUNS.items():
        steps = [measured_steps(task, seed, STALE_BATCH, task.lr, 600, **strategy)[0]
                 for seed in range(seeds)]
        per_kind[kind] = [(s / d - 1) / STALENESS for s, d in zip(steps, dp)]
        result[f"{kind}_steps"] = steps
        print(f"staleness: {kind} {steps} steps against dp {dp}: cost per unit "
              f"{statistics.fmean(per_kind[kind]):.3f}", flush=True)
    result["cost_per_unit"] = {kind: statistics.fmean(v) for kind, v in per_kind.items()}
    result["cost_per_unit_all"] = statistics.fmean(v for vs in per_kind.values() for v in vs)
    return result


def search_pick(cluster: tuple[str, ...], learning: Path | None,
                seed: int) -> dict[str, Any]:
    """The ``--json`` output of ``tandem search --objective time-to-accuracy`` on digits."""
    source = (("--learning", str(learning)) if learning is not None
              else ("--lr", str(TASKS["digits"].lr), "--measure-steps",
                    str(TASKS["digits"].measure_steps)))
    command = [sys.executable, "-m", "tandem", "search", "--model", "mlp", "--data", "digits",
               *cluster, "--objective", "time-to-accuracy", "--target-loss",
               str(TASKS["digits"].target), *source, "--schedules", "gpipe,1f1b",
               "--families", "none", "--iterations", "60", "--seed", str(seed), "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
    print(result.stderr, end="", flush=True)
    data: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return data


def compare_pick(search: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The search's batch against the measured best (least measured steps times the search's
    simulated step time), and their ratio."""
    tta = search["time_to_accuracy"]
    step_s = {c["batch_size"]: c["step_time_s"] for c in tta["candidates"]}
    steps = {b: statistics.fmean(r["measured"] for r in rows if r["batch"] == b) for b in BATCHES}
    measured = {b: steps[b] * step_s[b] for b in BATCHES if b in step_s}
    best = min(measured, key=lambda b: measured[b])
    picked = tta["best"]["batch_size"]
    return {"picked_batch": picked, "measured_best_batch": best,
            "ratio": max(picked, best) / min(picked, best),
            "measured_time_s": measured, "step_time_s": step_s}


def error_stats(rows: list[dict[str, Any]]) -> dict[str, float]:
    errors = [r["error"] for r in rows]
    return {"median_step_error": statistics.median(errors), "worst_step_error": max(errors)}


def plot(sweeps: dict[str, dict[str, Any]], path: Path) -> None:
    """Predicted against measured steps per batch, one panel per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(sweeps), figsize=(5.5 * len(sweeps), 4.2), squeeze=False)
    for axis, (name, result) in zip(axes[0], sweeps.items()):
        rows = result["rows"]
        for seed in sorted({r["seed"] for r in rows}):
            mine = [r for r in rows if r["seed"] == seed]
            color = f"C{seed}"
            axis.plot([r["batch"] for r in mine], [r["predicted"] for r in mine], "-",
                      color=color, label=f"seed {seed} predicted")
            axis.plot([r["batch"] for r in mine], [r["measured"] for r in mine], "o",
                      color=color, label=f"seed {seed} measured")
        stats = error_stats(rows)
        axis.set_xscale("log", base=2)
        axis.set_xticks(list(BATCHES), [str(b) for b in BATCHES])
        axis.set_xlabel("global batch")
        axis.set_ylabel(f"steps to loss {result['task']['target']:g}")
        axis.set_title(f"{name} ({result['task']['model']}): median error "
                       f"{stats['median_step_error']:.2f}, worst {stats['worst_step_error']:.2f}",
                       fontsize=9)
        axis.set_ylim(bottom=0)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--noise-step", type=int, default=None,
                        help="take the noise scale at this step (e.g. 50) instead of where the "
                        "measuring run reaches the target")
    parser.add_argument("--no-staleness", action="store_true")
    parser.add_argument("--no-search", action="store_true")
    parser.add_argument("--plot", default=str(ROOT / "docs" / "time_to_accuracy.png"))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sweeps = {name: sweep(name, TASKS[name], args.seeds, args.noise_step)
              for name in args.tasks.split(",")}
    stale = None if args.no_staleness else staleness_cost(TASKS["digits"], args.seeds)
    picks: dict[str, Any] = {}
    if not args.no_search and "digits" in sweeps:
        with tempfile.TemporaryDirectory() as scratch:
            learning = None
            for name, cluster in CLUSTERS.items():
                found = search_pick(cluster, learning, seed=0)
                learning = Path(scratch) / "learning.json"
                learning.write_text(json.dumps(found["time_to_accuracy"]["steps_model"]))
                picks[name] = compare_pick(found, sweeps["digits"]["rows"])
    plot(sweeps, Path(args.plot))
    print(f"\n{'task':8} {'batch':>6} {'predicted':>10} {'measured':>10} {'error':>7}  "
          f"(mean over seeds)")
    for name, result in sweeps.items():
        for batch in BATCHES:
            mine = [r for r in result["rows"] if r["batch"] == batch]
            print(f"{name:8} {batch:6d} {statistics.fmean(r['predicted'] for r in mine):10.1f} "
                  f"{statistics.fmean(r['measured'] for r in mine):10.1f} "
                  f"{statistics.fmean(r['error'] for r in mine):7.3f}")
        stats = error_stats(result["rows"])
        print(f"{name}: median step error {stats['median_step_error']:.3f}, worst "
              f"{stats['worst_step_error']:.3f}")
    for name, pick in picks.items():
        print(f"search on {name}: picked batch {pick['picked_batch']}, measured best "
              f"{pick['measured_best_batch']} ({pick['ratio']:.2g}x apart)")
    rows = [r for result in sweeps.values() for r in result["rows"]]
    print(json.dumps({
        "benchmark": "time_to_accuracy", "seeds": args.seeds, "batches": list(BATCHES),
        "noise_at": "target" if args.noise_step is None else f"step {args.noise_step}",
        **error_stats(rows),
        "per_task": {name: error_stats(result["rows"]) for name, result in sweeps.items()},
        "not_reached": sum(not r["reached"] for r in rows),
        "staleness": stale, "search": picks,
        "within_2x": all(p["ratio"] <= 2 for p in picks.values()) if picks else None,
        "sweeps": sweeps}))


if __name__ == "__main__":
    main()
