"""Start a benchmark script's own worker function on 2 local gloo workers (torchrun) and return
the JSON object rank 0 prints last, so tandem and its reference run inside the same processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def run_workers(script: str, argv: list[str], nproc: int = 2) -> dict[str, Any]:
    """Run ``script --worker ARGV`` under torchrun with one thread per worker."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), script, "--worker", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if result.returncode != 0:
        raise SystemExit(f"benchmark workers failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])
