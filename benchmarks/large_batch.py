"""Large batches at a fixed number of epochs: test accuracy of the MLP on digits at batch 32 and
at batch 256 (8x, so 1/8 the steps) with plain SGD at the small batch's lr, linear lr scaling
with and without warm-up, LAMB and LARS; each the mean over seeds of single-process
``tandem train`` runs (statistical efficiency does not depend on the number of workers).
Prints a table with every seed's accuracy, then one JSON object on the last line.

    .venv/bin/python benchmarks/large_batch.py [--epochs 20] [--lr 0.03] [--seeds 3]
                                               [--warmup-steps 6]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMALL, LARGE = 32, 256


def runs(args: argparse.Namespace, warmup: int) -> dict[str, tuple[int, tuple[str, ...]]]:
    """Each row's batch size and its optimizer flags."""
    scaled = ("--lr", str(args.lr), "--lr-scaling", "linear", "--base-batch", str(SMALL))
    return {
        f"batch {SMALL}, sgd": (SMALL, ("--lr", str(args.lr))),
        f"batch {LARGE}, sgd, same lr": (LARGE, ("--lr", str(args.lr))),
        f"batch {LARGE}, linear + warm-up": (LARGE, (*scaled, "--warmup-steps", str(warmup))),
        f"batch {LARGE}, linear, no warm-up": (LARGE, scaled),
        f"batch {LARGE}, lamb": (LARGE, ("--optimizer", "lamb", "--lr", str(args.lamb_lr),
                                         "--warmup-steps", str(warmup))),
        f"batch {LARGE}, lars": (LARGE, ("--optimizer", "lars", "--lr", str(args.lars_lr),
                                         "--warmup-steps", str(warmup))),
    }


def accuracy(batch: int, flags: tuple[str, ...], steps: int, seed: int) -> float:
    """Test accuracy (%) of one ``tandem train`` run, from its JSON summary."""
    command = [sys.executable, "-m", "tandem", "train", "--model", "mlp", "--data", "digits",
               "--batch-size", str(batch), "--steps", str(steps), "--momentum", "0.9",
               "--seed", str(seed), *flags, "--json", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
    return 100 * json.loads(result.stdout.strip().splitlines()[-1])["test_accuracy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.03, help=f"SGD's lr at batch {SMALL}")
    parser.add_argument("--lamb-lr", type=float, default=0.02)
    parser.add_argument("--lars-lr", type=float, default=3.0)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help="warm-up of the large-batch runs (default: one epoch of them)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    from tandem.data import build_dataset

    num_train = len(build_dataset("digits").train)
    per_epoch = {batch: -(-num_train // batch) for batch in (SMALL, LARGE)}
    # one epoch: Goyal et al.'s 5 of 90 epochs, for 20 epochs
    warmup = per_epoch[LARGE] if args.warmup_steps is None else args.warmup_steps
    table = runs(args, warmup)
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {(name, seed): pool.submit(accuracy, batch, flags,
                                             args.epochs * per_epoch[batch], seed)
                   for name, (batch, flags) in table.items() for seed in range(args.seeds)}
        seeds = {name: [futures[(name, seed)].result() for seed in range(args.seeds)]
                 for name in table}
    means = {name: statistics.fmean(values) for name, values in seeds.items()}
    small = means[f"batch {SMALL}, sgd"]
    print(f"digits, mlp, {args.epochs} epochs ({num_train} training samples), warm-up "
          f"{warmup} steps, mean of {args.seeds} seeds")
    print(f"{'run':34} {'steps':>6} {'accuracy %':>10} {'vs small':>9}   seeds")
    for name, (batch, _) in table.items():
        print(f"{name:34} {args.epochs * per_epoch[batch]:6d} {means[name]:10.2f} "
              f"{means[name] - small:+9.2f}   {' '.join(f'{v:.1f}' for v in seeds[name])}")
    print(json.dumps({"benchmark": "large_batch", "epochs": args.epochs, "small_batch": SMALL,
                      "large_batch": LARGE, "lr": args.lr, "lamb_lr": args.lamb_lr,
                      "lars_lr": args.lars_lr, "warmup_steps": warmup, "seeds": args.seeds,
                      "accuracy": {name: round(value, 2) for name, value in means.items()},
                      "per_seed": {name: [round(v, 2) for v in values]
                                   for name, values in seeds.items()},
                      "vs_small": {name: round(value - small, 2)
                                   for name, value in means.items()}}))


if __name__ == "__main__":
    main()
