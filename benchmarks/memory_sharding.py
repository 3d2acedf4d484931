"""Memory of sharded data parallelism (``--shard 4``, ZeRO-3 on FSDP2) against plain data
parallelism (DDP), gpt with Adam on 4 workers, in one run of this script.

Trains the same model twice through the real command line (``tandem train --json``, one thread
per process, a few steps): ``--strategy dp --nproc 4`` and ``--strategy dp --nproc 4 --shard 4``.
Each worker reports the bytes of the parameters, gradients and optimizer state it holds, measured
from its own tensors after its first optimizer step (a sharded tensor counts its local shard:
``held_state_bytes``), and its peak resident memory up to its last update (``VmHWM``,
``training_peak_rss_bytes``). The table shows both per rank; the last line is one JSON object
with ``state_bytes_ratio`` (the most any sharded worker holds over the most any dp worker holds;
target at most 0.3) and ``peak_rss_ratio`` (the same for peak resident memory, which also counts
torch itself, activations, DDP's gradient buckets and FSDP's gathered units; the sharded workers
build the model in pieces, and the line before it gives the most whole tensors one held while
building, ``build_peak_whole_mb``, against the whole model's bytes). Both runs set glibc's
``MALLOC_MMAP_THRESHOLD_`` to 128 KiB (``--allocator default`` leaves glibc's own): otherwise its dynamic threshold rises
to the size of the first large buffers freed, and the ~13 MB units FSDP gathers and frees
every step are served from a heap that is never given back, so that a sharded worker's peak
resident memory counts some 400 MB the allocator keeps but no tensor uses. It also checks
that the two runs' final.pt agree (Adam amplifies rounding noise in gradients that are zero in
exact arithmetic, so the figure is the largest difference, for the record).

    .venv/bin/python benchmarks/memory_sharding.py
    .venv/bin/python benchmarks/memory_sharding.py --allocator default
    .venv/bin/python benchmarks/memory_sharding.py --model gpt:layers=4,dim=256,heads=4 --steps 2

A third run shards the same model built whole by a user's builder (:func:`gpt_whole`): the
peak resident memory once each worker has built and sharded it, against building in pieces.
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
MODEL = "gpt:layers=8,dim=512,heads=8,dropout=0"
"""25.3 M parameters (101 MB in fp32): with Adam a dp worker holds 4 copies (405 MB), well
above the ~280 MB each worker's torch takes, and a step takes seconds on one thread."""
DATA = "tokens:n=256,seq=32,vocab=64"
MB = 1e6
MMAP_THRESHOLD = 128 * 1024
"""glibc's default threshold, fixed (a value set turns its dynamic adjustment off)."""


def train(out: Path, args: argparse.Namespace, *extra: str) -> dict[str, Any]:
    """``tandem train`` with the benchmark's settings plus ``extra``; its JSON summary."""
    model = next((extra[i + 1] for i in range(len(extra) - 1) if extra[i] == "--model"),
                 args.model)
    extra = tuple(word for i, word in enumerate(extra)
                  if word != "--model" and (i == 0 or extra[i - 1] != "--model"))
    cmd = [sys.executable, "-m", "tandem", "train", "--model", model, "--data", args.data,
           "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--optimizer",
           "adam", "--lr", "0.001", "--seed", "3", "--threads", "1", "--nproc", "4", "--json",
           "--no-progress", "--out", str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_MODEL": args.model,
           "PYTHONPATH": os.pathsep.join((str(ROOT / "src"), str(ROOT / "benchmarks")))}
    if args.allocator == "mmap":
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
    summary: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return summary


def gpt_whole(info: Any) -> Any:
    """``--model memory_sharding:gpt_whole``: the benchmark's model through a user's builder
    (``BENCH_MODEL``), which tandem builds whole on every worker before sharding it (no
    ``--init-fn``): the reference for building in pieces."""
    from tandem.models import build_model

    return build_model(os.environ["BENCH_MODEL"], info)


def max_abs_diff(a: Path, b: Path) -> float:
    """Largest difference between two final.pt state dicts (parameters and buffers)."""
    import torch

    x, y = torch.load(a), torch.load(b)
    if list(x) != list(y):
        raise SystemExit(f"{a} and {b} hold different tensors")
    return max(float((x[k].double() - y[k].double()).abs().max()) for k in x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--data", default=DATA)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--allocator", choices=("mmap", "default"), default="mmap",
                        help="mmap: buffers of 128 KiB and more are mapped and given back when "
                        "freed (both runs); default: glibc's dynamic threshold")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        dp = train(work / "dp", args)
        sharded = train(work / "sharded", args, "--shard", "4")
        whole = train(work / "whole", args, "--shard", "4", "--model",
                      "memory_sharding:gpt_whole")
        diff = max_abs_diff(work / "dp/final.pt", work / "sharded/final.pt")
    rows = []
    for plain, shard in zip(dp["worker_memory"], sharded["worker_memory"]):
        rows.append({"rank": plain["rank"],
                     "dp_state_mb": plain["held_state_bytes"] / MB,
                     "sharded_state_mb": shard["held_state_bytes"] / MB,
                     "dp_peak_rss_mb": plain["training_peak_rss_bytes"] / MB,
                     "sharded_peak_rss_mb": shard["training_peak_rss_bytes"] / MB})
    state_ratio = (max(r["sharded_state_mb"] for r in rows) / max(r["dp_state_mb"] for r in rows))
    rss_ratio = (max(r["sharded_peak_rss_mb"] for r in rows)
                 / max(r["dp_peak_rss_mb"] for r in rows))
    print(f"model {args.model} ({dp['parameters'] / 1e6:.1f} M parameters), Adam, batch "
          f"{args.batch_size}, {args.steps} steps, 4 workers, one thread each, allocator "
          f"{args.allocator}", file=sys.stderr)
    print(f"{'rank':>4} {'dp state MB':>12} {'shard state MB':>15} {'dp peak RSS MB':>15} "
          f"{'shard peak RSS MB':>18}", file=sys.stderr)
    for r in rows:
        print(f"{r['rank']:>4} {r['dp_state_mb']:12.1f} {r['sharded_state_mb']:15.1f} "
              f"{r['dp_peak_rss_mb']:15.0f} {r['sharded_peak_rss_mb']:18.0f}", file=sys.stderr)
    whole_mb = dp["parameters"] * 4 / MB
    build_mb = sharded["build_peak_whole_bytes"] / MB
    pieces_rss, whole_rss = (run["build_peak_rss_bytes"] / MB for run in (sharded, whole))
    print(f"built in pieces: at most {build_mb:.1f} MB of whole tensors held while building "
          f"(the whole model: {whole_mb:.1f} MB); peak RSS once built and sharded "
          f"{pieces_rss:.0f} MB, against {whole_rss:.0f} MB for the same model built whole by "
          f"a user's builder (rank 0)", file=sys.stderr)
    print(f"state bytes sharded/dp {state_ratio:.3f} (target <= 0.3), peak RSS sharded/dp "
          f"{rss_ratio:.3f}; final.pt max abs diff {diff:.2e}; step time dp "
          f"{dp['step_time_s']:.2f} s, sharded {sharded['step_time_s']:.2f} s", file=sys.stderr)
    print(json.dumps({"model": args.model, "parameters": dp["parameters"],
                      "allocator": args.allocator,
                      "batch_size": args.batch_size, "steps": args.steps, "workers": rows,
                      "dp_step_time_s": dp["step_time_s"],
                      "sharded_step_time_s": sharded["step_time_s"], "max_abs_diff": diff,
                      "build_peak_whole_mb": build_mb, "whole_model_mb": whole_mb,
                      "build_peak_rss_mb": pieces_rss, "whole_build_peak_rss_mb": whole_rss,
                      "state_bytes_ratio": state_ratio, "peak_rss_ratio": rss_ratio}),
          flush=True)


if __name__ == "__main__":
    main()
