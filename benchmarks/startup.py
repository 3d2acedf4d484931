"""Start-up: how soon ``tandem train --nproc 4`` finishes its first step, against a plain script
under ``torchrun --nproc-per-node 4`` that does the same (import torch, join a gloo group, wrap
the model in DDP, one step on the digits); and how soon ``tandem --help`` and a usage error
answer.

Each side is a fresh command started from this script; the time to its first step is from the
command's start to the moment rank 0's record of step 1 is on disk (tandem's
``metrics.jsonl``, the plain script's marker file), polled every 5 ms. The repeats alternate
the two sides so that the machine's background load hits both alike; medians are reported.
Prints a table, then one JSON object on the last line.

    .venv/bin/python benchmarks/startup.py [--repeats 5] [--nproc 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POLL_S = 0.005
LIMIT_S = 300.0

PLAIN = textwrap.dedent('''
    """One DDP step of tandem's default mlp on the digits, as a user writes it for torchrun."""
    import os, sys
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from sklearn.datasets import load_digits

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    digits = load_digits()
    inputs = torch.tensor(digits.data, dtype=torch.float32) / 16
    targets = torch.tensor(digits.target)
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(
        nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
        nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    local = 64 // world
    batch = slice(rank * local, (rank + 1) * local)
    loss = nn.functional.cross_entropy(model(inputs[batch]), targets[batch])
    loss.backward()
    optimizer.step()
    if rank == 0:
        with open(sys.argv[1], "w") as marker:
            marker.write(f"{loss.item()}\\n")
    dist.destroy_process_group()
''')


def environment() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    return env


def first_step_metrics(path: Path) -> bool:
    """Whether tandem's ``metrics.jsonl`` holds the record of a training step."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return False
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            return False  # a line being written
        if "loss" in record and record.get("step", 0) >= 1:
            return True
    return False


def time_to_first_step(command: list[str], done: "callable[[], bool]") -> float:
    """Seconds from starting ``command`` until ``done()``; the command then runs to its end."""
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, env=environment(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    seen = None
    while seen is None and time.perf_counter() - start < LIMIT_S:
        if done():
            seen = time.perf_counter() - start
        elif process.poll() is not None:
            break
        else:
            time.sleep(POLL_S)
    _, err = process.communicate(timeout=LIMIT_S)
    if seen is None:
        raise SystemExit(f"{command[:4]} reached no first step (exit {process.returncode}): "
                         f"{err.strip()[-2000:]}")
    if process.returncode != 0:
        raise SystemExit(f"{command[:4]} failed (exit {process.returncode}): {err[-2000:]}")
    return seen


def tandem_first_step(nproc: int, scratch: Path) -> float:
    out = Path(tempfile.mkdtemp(dir=scratch))
    return time_to_first_step(
        [sys.executable, "-m", "tandem", "train", "--nproc", str(nproc), "--strategy", "dp",
         "--model", "mlp", "--data", "digits", "--steps", "1", "--log-every", "1",
         "--out", str(out), "--no-progress", "--json"],
        lambda: first_step_metrics(out / "metrics.jsonl"))


def torchrun_first_step(nproc: int, scratch: Path, script: Path) -> float:
    marker = Path(tempfile.mkdtemp(dir=scratch)) / "first-step"
    return time_to_first_step(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(nproc), str(script), str(marker)],
        marker.exists)


def answer_time(*args: str, status: int) -> float:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "tandem", *args], cwd=ROOT, env=environment(),
                          capture_output=True, text=True, timeout=LIMIT_S)
    seconds = time.perf_counter() - start
    if done.returncode != status:
        raise SystemExit(f"tandem {' '.join(args)} exited {done.returncode}, not {status}: "
                         f"{done.stderr.strip()}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=4)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="tandem-startup-") as scratch_name:
        scratch = Path(scratch_name)
        script = scratch / "plain_ddp_step.py"
        script.write_text(PLAIN)
        tandem, torchrun, helps, errors = [], [], [], []
        for repeat in range(args.repeats):
            tandem.append(tandem_first_step(args.nproc, scratch))
            torchrun.append(torchrun_first_step(args.nproc, scratch, script))
            helps.append(answer_time("--help", status=0))
            errors.append(answer_time("train", "--nproc", "0", status=2))
            print(f"repeat {repeat + 1}: tandem {tandem[-1]:.2f} s, torchrun "
                  f"{torchrun[-1]:.2f} s, --help {helps[-1]:.3f} s, usage error "
                  f"{errors[-1]:.3f} s", file=sys.stderr, flush=True)
    result = {
        "first_step_s": round(statistics.median(tandem), 3),
        "torchrun_first_step_s": round(statistics.median(torchrun), 3),
        "first_step_ratio": round(statistics.median(tandem) / statistics.median(torchrun), 3),
        "help_s": round(statistics.median(helps), 3),
        "usage_error_s": round(statistics.median(errors), 3),
        "nproc": args.nproc, "repeats": args.repeats,
        "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }
    print(f"{'':24}{'median s':>10}")
    for key in ("first_step_s", "torchrun_first_step_s", "help_s", "usage_error_s"):
        print(f"{key:24}{result[key]:>10.3f}")
    print(f"{'first_step_ratio':24}{result['first_step_ratio']:>10.3f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
