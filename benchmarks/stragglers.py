"""Stragglers: steps per second of sync allreduce, parameter servers with a backup worker,
asynchronous parameter servers, gossip on a ring (D-PSGD and AD-PSGD), each with one of 4 workers slowed 4x,
relative to the same strategy without the straggler.

Compute is emulated (layers that sleep their profiled time), so the 4 workers do not compete
for this machine's 2 cores and the comparison is about synchronization alone. Prints a table,
then one JSON object on the last line.

    .venv/bin/python benchmarks/stragglers.py [--steps 200] [--layer-ms 5]
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
STRAGGLER_RANK = 2
STRATEGIES = {
    "dp (sync allreduce)": ("--strategy", "dp", "--nproc", "4"),
    "ps sync, backup 1": ("--strategy", "ps", "--nproc", "5", "--servers", "1", "--backup", "1"),
    "ps async": ("--strategy", "ps", "--nproc", "5", "--servers", "1", "--mode", "async"),
    "gossip ring": ("--strategy", "gossip", "--nproc", "4", "--topology", "ring"),
    "ad-psgd ring": ("--strategy", "gossip", "--async-gossip", "--nproc", "4"),
}


def write_profile(path: Path, layer_ms: float) -> None:
    """Four equal layers: forward ``layer_ms``, backward twice that, small tensors."""
    layers = [{"name": f"layer{i}", "forward_s": layer_ms / 1e3, "backward_s": 2 * layer_ms / 1e3,
               "activation_bytes": 4096.0, "parameter_bytes": 4096.0} for i in range(4)]
    path.write_text(json.dumps({"schema_version": 1, "model": "straggler-bench",
                                "batch_size": None, "layers": layers}))


def steps_per_s(args: tuple[str, ...], profile: Path, steps: int, straggler: bool) -> float:
    """Optimizer steps (server updates for ps) per second of training, from the summary."""
    command = [sys.executable, "-m", "tandem", "train", *args, "--model",
               f"emulated:profile={profile}", "--data", "digits", "--steps", str(steps),
               "--batch-size", "60", "--lr", "0.01", "--json", "--no-progress"]
    if straggler:
        command += ["--straggler", f"{STRAGGLER_RANK}:4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    if "updates_per_s" in summary:
        return float(summary["updates_per_s"])
    return summary["steps"] / summary["train_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--layer-ms", type=float, default=5.0)
    parser.add_argument("--only", default=None, help="run only strategies whose name contains this")
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        profile = Path(tmp) / "profile.json"
        write_profile(profile, args.layer_ms)
        for name, strategy in STRATEGIES.items():
            if args.only and args.only not in name:
                continue
            clean = steps_per_s(strategy, profile, args.steps, straggler=False)
            slowed = steps_per_s(strategy, profile, args.steps, straggler=True)
            rows[name] = {"steps_per_s": clean, "with_straggler": slowed, "ratio": slowed / clean}
            print(f"{name:22} {clean:7.2f} steps/s   with a 4x straggler {slowed:7.2f}   "
                  f"ratio {slowed / clean:5.2f}", flush=True)
    print(json.dumps({"benchmark": "stragglers", "workers": 4, "straggler_factor": 4,
                      "layer_ms": args.layer_ms, "steps": args.steps, "results": rows}))


if __name__ == "__main__":
    main()
