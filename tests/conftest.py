"""Shared helpers: run the real ``tandem`` command line in a subprocess with a time limit."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def run_tandem(*args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    """Run ``python -m tandem ARGS`` with one thread per process; fail the test on a hang."""
    # this checkout's src first (a git worktree's, not the one the editable install names)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
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


SharedRun = Callable[..., tuple[Path, dict[str, Any]]]
"""``shared_run(*train_args)``: the ``--out`` directory and ``--json`` summary of that run."""


def _canonical(args: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """``train`` options as (flag, value...) groups in flag order: the same run however the
    options are ordered (a repeated flag keeps its order, as the last one wins)."""
    groups: list[list[str]] = []
    for arg in args:
        if arg.startswith("--") or not groups:
            groups.append([arg])
        else:
            groups[-1].append(arg)
    return tuple(sorted((tuple(group) for group in groups), key=lambda group: group[0]))


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory: pytest.TempPathFactory) -> SharedRun:
    """Run ``tandem train ARGS --out DIR`` once per session for each ARGS (in any order) and
    give every test that asks its directory and summary: tests in one file or several that
    compare against the same run share it. The directory is read-only to the tests (a test
    that resumes or adds to a run's outputs starts its own)."""
    runs: dict[tuple[tuple[str, ...], ...], tuple[Path, dict[str, Any]]] = {}

    def run(*args: str, timeout_s: float = 180) -> tuple[Path, dict[str, Any]]:
        key = _canonical(args)
        if key not in runs:
            out = tmp_path_factory.mktemp("shared-run")
            runs[key] = (out, run_json("train", *args, "--out", str(out), timeout_s=timeout_s))
        out, summary = runs[key]
        return out, copy.deepcopy(summary)

    return run


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
