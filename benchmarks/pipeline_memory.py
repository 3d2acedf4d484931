"""Memory of a 4-stage pipeline's workers against one process training the whole model.

Trains the same model three times through the real command line (``tandem train --json``, one
thread per process, a few steps): on one process, as a 4-stage GPipe pipeline, and as that
pipeline with ``--recompute``. Each worker reports its peak resident memory up to its last update
(``VmHWM``) and its resident memory right after its imports (the same in every run);
the table shows both, the peak less the start, and each pipeline worker's ratio to the single
process (the target is at most 0.35: a worker materializes only its stage, a quarter of the
weights, gradients and optimizer state). It also shows each stage's activation memory (what
autograd saved for backwards at once, ``peak_activation_bytes``) with and without
recomputation, and checks that both pipelines' final.pt equal the single process's. The last
column (``ckpt MB``) is the peak of the whole run, less the start: the final checkpoint and
final.pt gather every stage's state on rank 0, which then holds the whole model and its
optimizer state (not per stage yet). Prints a
table, then one JSON object on the last line.

    .venv/bin/python benchmarks/pipeline_memory.py
    .venv/bin/python benchmarks/pipeline_memory.py --model mlp:hidden=1024,layers=9 --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODEL = "mlp:hidden=3072,layers=9"
"""7 hidden 3072x3072 layers (264 MB of fp32 weights): 4 stages of blocks 3-2-2-2 hold at
most two of them each."""
MB = 1e6


def train(out: Path, args: argparse.Namespace, *extra: str) -> dict[str, Any]:
    """``tandem train`` with the benchmark's settings plus ``extra``; its JSON summary."""
    cmd = [sys.executable, "-m", "tandem", "train", "--model", args.model, "--data", args.data,
           "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--lr", "0.01",
           "--momentum", "0.9", "--seed", "3", "--threads", "1", "--json", "--no-progress",
           "--out", str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def max_abs_diff(a: Path, b: Path) -> float:
    """Largest difference between two final.pt state dicts (parameters and buffers)."""
    import torch

    x, y = torch.load(a), torch.load(b)
    if x.keys() != y.keys():
        raise SystemExit(f"{a} and {b} hold different tensors")
    return max(float((x[k].double() - y[k].double()).abs().max()) for k in x)


def memory(worker: dict[str, Any]) -> dict[str, float]:
    """A worker's peak, start and peak-less-start resident memory in MB."""
    peak, start = worker["training_peak_rss_bytes"], worker["start_rss_bytes"]
    return {"peak_mb": peak / MB, "start_mb": start / MB, "training_mb": (peak - start) / MB,
            "with_checkpoint_mb": (worker["peak_rss_bytes"] - start) / MB}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--data", default="digits")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedule", default="gpipe", choices=("gpipe", "1f1b"))
    args = parser.parse_args()
    pipeline = ("--strategy", "pipeline", "--nproc", "4", "--schedule", args.schedule,
                "--microbatches", str(args.microbatches))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        single = train(work / "single", args, "--nproc", "1")
        plain = train(work / "pipeline", args, *pipeline)
        recomputed = train(work / "recompute", args, *pipeline, "--recompute")
        diffs = {"pipeline": max_abs_diff(work / "single/final.pt", work / "pipeline/final.pt"),
                 "recompute": max_abs_diff(work / "single/final.pt",
                                           work / "recompute/final.pt")}
    whole = memory(single)
    rows = []
    for worker, again in zip(plain["workers"], recomputed["workers"]):
        mine, theirs = memory(worker), memory(again)
        rows.append({
            "stage": worker["stage"], "layers": worker["layers"],
            "held_model_mb": worker["held_model_bytes"] / MB, **mine,
            "ratio": mine["training_mb"] / whole["training_mb"],
            "raw_ratio": mine["peak_mb"] / whole["peak_mb"],
            "recompute_training_mb": theirs["training_mb"],
            "activation_kb": worker["peak_activation_bytes"] / 1e3,
            "recompute_activation_kb": again["peak_activation_bytes"] / 1e3,
        })
    print(f"model {args.model}, {args.schedule} x{args.microbatches} micro-batches, batch "
          f"{args.batch_size}, {args.steps} steps, one thread per process", file=sys.stderr)
    print(f"single process: peak {whole['peak_mb']:.0f} MB, at start {whole['start_mb']:.0f} "
          f"MB, training {whole['training_mb']:.0f} MB, with checkpoint "
          f"{whole['with_checkpoint_mb']:.0f} MB", file=sys.stderr)
    print(f"{'stage':>5} {'layers':>7} {'held MB':>8} {'peak MB':>8} {'start MB':>8} "
          f"{'train MB':>8} {'ratio':>6} {'raw':>5} {'rc train MB':>11} {'act kB':>8} "
          f"{'rc act kB':>9} {'ckpt MB':>8}", file=sys.stderr)
    for r in rows:
        print(f"{r['stage']:>5} {'%d-%d' % tuple(r['layers']):>7} {r['held_model_mb']:8.1f} "
              f"{r['peak_mb']:8.0f} {r['start_mb']:8.0f} {r['training_mb']:8.0f} "
              f"{r['ratio']:6.3f} {r['raw_ratio']:5.2f} {r['recompute_training_mb']:11.0f} "
              f"{r['activation_kb']:8.0f} {r['recompute_activation_kb']:9.0f} "
              f"{r['with_checkpoint_mb']:8.0f}", file=sys.stderr)
    print(f"final.pt max abs diff vs single process: pipeline {diffs['pipeline']:.2e}, "
          f"with --recompute {diffs['recompute']:.2e}", file=sys.stderr)
    print(json.dumps({"model": args.model, "schedule": args.schedule,
                      "microbatches": args.microbatches, "batch_size": args.batch_size,
                      "steps": args.steps, "single": whole, "stages": rows,
                      "max_ratio": max(r["ratio"] for r in rows),
                      "max_abs_diff": diffs}), flush=True)


if __name__ == "__main__":
    main()
