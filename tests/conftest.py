"""Shared helpers: run the real ``tandem`` command line in a subprocess with a time limit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def run_tandem(*args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    """Run ``python -m tandem ARGS`` with one thread per process; fail the test on a hang."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    return subprocess.run(
        [sys.executable, "-m", "tandem", *args], capture_output=True, text=True, env=env,
        timeout=timeout_s, cwd=ROOT,
    )


def run_json(*args: str, timeout_s: float = 180) -> dict[str, Any]:
    """Run a command with ``--json`` and return its summary; fail with its stderr otherwise."""
    result = run_tandem(*args, "--json", "--no-progress", timeout_s=timeout_s)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def max_abs_diff(path_a: Path, path_b: Path) -> float:
    """Largest absolute difference between two saved state_dicts with the same keys."""
    a, b = torch.load(path_a), torch.load(path_b)
    assert a.keys() == b.keys()
    return max(float((a[key].double() - b[key].double()).abs().max()) for key in a)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


PROFILES = Path(__file__).parent / "data" / "profiles"
"""PipeDream's published profiles (see the README there)."""
VGG = str(PROFILES / "vgg16.graph.txt")


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``tandem ARGV`` in this process: exit status, stdout, stderr."""
    from tandem.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err
