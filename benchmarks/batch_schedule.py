"""Batch-size ramp against step learning-rate decay (Smith, Kindermans, Ying, Le 2018, "Don't
Decay the Learning Rate, Increase the Batch Size"): statistical efficiency on the digits.

Both runs train the default MLP for the same number of epochs in one process. The decay run
keeps the batch and multiplies the learning rate by 1/FACTOR at two epoch boundaries; the ramp
run keeps the learning rate and multiplies the batch by FACTOR at the same boundaries, so it
takes far fewer optimizer steps. Each runs with several seeds; prints a table of test accuracy
(mean and spread over the seeds) and optimizer steps, then one JSON object on the last line.

    .venv/bin/python benchmarks/batch_schedule.py [--epochs 30] [--seeds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAIN_SAMPLES = 1438
"""Training samples of ``--data digits``."""


def steps_per_epoch(batch: int) -> int:
    """Optimizer steps of one epoch of ``batch`` (the last batch holds what is left)."""
    return -(-TRAIN_SAMPLES // batch)


def runs(batch: int, factor: int, epochs: int, first: int, second: int) -> dict[str, list[str]]:
    """The flags of the two runs: decay at epochs ``first`` and ``second`` or a batch ramp."""
    per_epoch = steps_per_epoch(batch)
    decay_steps = epochs * per_epoch
    middle, last = batch * factor, batch * factor * factor
    ramp_first = first * per_epoch
    ramp_second = ramp_first + (second - first) * steps_per_epoch(middle)
    ramp_steps = ramp_second + (epochs - second) * steps_per_epoch(last)
    return {
        "lr step decay": ["--steps", str(decay_steps), "--batch-size", str(batch),
                          "--lr-schedule", f"step:{1 / factor:g}@{first * per_epoch},"
                                           f"{second * per_epoch}"],
        "batch ramp": ["--steps", str(ramp_steps), "--batch-schedule",
                       f"{batch}@0,{middle}@{ramp_first},{last}@{ramp_second}"],
    }


def train(flags: list[str], seed: int) -> dict[str, float]:
    """One run's test accuracy and optimizer steps."""
    command = [sys.executable, "-m", "tandem", "train", "--model", "mlp", "--data", "digits",
               "--nproc", "1", "--seed", str(seed), "--log-every", "1000000", *flags,
               "--json", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1200)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    return {"test_accuracy": float(summary["test_accuracy"]), "steps": int(summary["steps"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32, help="the first batch of both runs")
    parser.add_argument("--factor", type=int, default=5,
                        help="the batch grows (the learning rate shrinks) by this at each change")
    parser.add_argument("--changes", default="15,24",
                        help="the two epochs at which the batch or learning rate changes")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    first, second = (int(part) for part in args.changes.split(","))
    results: dict[str, dict[str, float | list[float]]] = {}
    for name, flags in runs(args.batch, args.factor, args.epochs, first, second).items():
        outcomes = [train(flags, seed) for seed in range(args.seeds)]
        accuracies = [outcome["test_accuracy"] for outcome in outcomes]
        results[name] = {"steps": outcomes[0]["steps"], "accuracies": accuracies,
                         "mean_accuracy": statistics.fmean(accuracies),
                         "spread": max(accuracies) - min(accuracies),
                         "flags": " ".join(flags)}
    decay, ramp = results["lr step decay"], results["batch ramp"]
    print(f"{args.epochs} epochs of digits, mlp, batch {args.batch}, factor {args.factor} at "
          f"epochs {first} and {second}, seeds 0-{args.seeds - 1}", file=sys.stderr)
    print(f"{'run':<15} {'steps':>6} {'test accuracy (mean)':>21} {'spread':>7}  per seed",
          file=sys.stderr)
    for name, row in results.items():
        seeds = " ".join(f"{a:.4f}" for a in row["accuracies"])
        print(f"{name:<15} {row['steps']:>6} {row['mean_accuracy']:>21.4f} "
              f"{row['spread']:>7.4f}  {seeds}", file=sys.stderr)
    step_ratio = ramp["steps"] / decay["steps"]
    gap = ramp["mean_accuracy"] - decay["mean_accuracy"]
    print(f"ramp/decay optimizer steps: {step_ratio:.3f}; accuracy difference (ramp - decay): "
          f"{gap:+.4f}", file=sys.stderr)
    print(json.dumps({"epochs": args.epochs, "batch": args.batch, "factor": args.factor,
                      "changes": [first, second], "seeds": args.seeds, "runs": results,
                      "step_ratio": step_ratio, "accuracy_difference": gap}))


if __name__ == "__main__":
    main()
