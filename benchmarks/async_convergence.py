"""Statistical efficiency of the asynchronous strategies with the default optimizer settings:
steps of 64 samples each needs to reach 0.9 test accuracy on digits, against synchronous
data parallelism (dp), with the asynchrony compensation on (the default) and off.

Every run is ``tandem train`` with 4 workers (parameter servers: 1 server + 4 workers), 300
steps of global batch 64, SGD at lr 0.05 and momentum 0.9, evaluated every 10 steps. A step
is 64 samples in every strategy (asynchronous parameter servers apply one update per worker's
share of it), so the steps compare the samples each needs. Prints a table, then one JSON
object on the last line.

    .venv/bin/python benchmarks/async_convergence.py [--seeds 0,1] [--only ps]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = 0.9
STRATEGIES = {
    "dp": ("--strategy", "dp", "--nproc", "4"),
    "ps async": ("--strategy", "ps", "--mode", "async", "--nproc", "5"),
    "ps ssp (staleness 2)": ("--strategy", "ps", "--mode", "ssp", "--staleness", "2",
                             "--nproc", "5"),
    "ps backup 1": ("--strategy", "ps", "--backup", "1", "--nproc", "5"),
    "pipedream": ("--strategy", "pipeline", "--schedule", "pipedream", "--nproc", "4"),
    "pipedream, vertical sync": ("--strategy", "pipeline", "--schedule", "pipedream",
                                 "--vertical-sync", "--nproc", "4"),
    "ad-psgd": ("--strategy", "gossip", "--async-gossip", "--nproc", "4"),
    "easgd async": ("--strategy", "easgd", "--mode", "async", "--nproc", "5"),
}
COMPENSATED = {"ps async", "ps ssp (staleness 2)", "pipedream", "pipedream, vertical sync"}
"""Strategies whose updates are stale, which ``--async-compensation`` changes."""


def curve(args: tuple[str, ...], seed: int, steps: int, out: Path) -> tuple[list[tuple[int, float]], dict]:
    """(step, test accuracy) every 10 steps and the summary of one run."""
    command = [sys.executable, "-m", "tandem", "train", *args, "--data", "digits",
               "--steps", str(steps), "--batch-size", "64", "--seed", str(seed),
               "--eval-every", "10", "--out", str(out), "--overwrite", "--json", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    points = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "test_accuracy" in record:
            points.append((int(record["step"]), float(record["test_accuracy"])))
    return points, summary


def steps_to(points: list[tuple[int, float]], target: float) -> int | None:
    """The first evaluated step at or above ``target``, or None."""
    return next((step for step, accuracy in points if accuracy >= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    parser.add_argument("--only", default=None, help="run only strategies whose name contains this")
    args = parser.parse_args()
    seeds = [int(seed) for seed in args.seeds.split(",")]
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, strategy in STRATEGIES.items():
            if args.only and args.only not in name:
                continue
            variants = {"on": ()}
            if name in COMPENSATED:
                variants["off"] = ("--async-compensation", "off")
            row: dict[str, list] = {}
            for label, extra in variants.items():
                for seed in seeds:
                    points, summary = curve(strategy + extra, seed, args.steps, Path(tmp) / "run")
                    row.setdefault(f"accuracy_{label}", []).append(round(summary["test_accuracy"], 4))
                    row.setdefault(f"steps_to_{TARGET}_{label}", []).append(steps_to(points, TARGET))
            rows[name] = row
            print(f"{name:26} " + "   ".join(f"{key} {value}" for key, value in row.items()),
                  flush=True)
    base = [s for s in rows.get("dp", {}).get(f"steps_to_{TARGET}_on", []) if s is not None]
    if base:
        dp_steps = sum(base) / len(base)
        for name, row in rows.items():
            reached = [s for s in row[f"steps_to_{TARGET}_on"] if s is not None]
            row["steps_vs_dp"] = (round(sum(reached) / len(reached) / dp_steps, 2)
                                  if len(reached) == len(row[f"steps_to_{TARGET}_on"]) else None)
            print(f"{name:26} steps to {TARGET} vs dp: {row['steps_vs_dp']}")
    print(json.dumps({"benchmark": "async_convergence", "workers": 4, "steps": args.steps,
                      "batch_size": 64, "target": TARGET, "seeds": seeds, "results": rows}))


if __name__ == "__main__":
    main()
