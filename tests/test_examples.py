"""The scripts in ``examples/`` run as a user would run them (with fewer steps)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cli

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, *args: str) -> str:
    result = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True,
                            text=True, timeout=300, cwd=EXAMPLES.parent)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_fit_your_model_trains_a_residual_net_with_batchnorm() -> None:
    out = _run("fit_your_model.py", "--steps", "60")
    match = re.search(r"dp: test accuracy (\d\.\d+) after 60 steps", out)
    assert match and float(match.group(1)) > 0.5, out


def test_fit_runs_as_one_worker_of_torchrun() -> None:
    """Under torchrun, ``tandem.fit`` in each process is that process's worker; rank 0 reports."""
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(EXAMPLES / "fit_your_model.py"), "--steps", "30"],
        capture_output=True, text=True, timeout=300, cwd=EXAMPLES.parent,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("dp: ")]
    assert len(lines) == 1 and "after 30 steps" in lines[0], result.stdout


def test_huggingface_gpt2_trains_with_tied_weights() -> None:
    pytest.importorskip("transformers")
    out = _run("huggingface_gpt2.py", "--steps", "30", "--strategy", "ps", "--nproc", "2")
    match = re.search(r"ps: next-token accuracy (\d\.\d+), .*tied: True\)", out)
    assert match and float(match.group(1)) > 1 / 64, out
