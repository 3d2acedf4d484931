"""A stop signal at any moment of a job — importing torch, the rendezvous, the first steps, a
checkpoint write — ends ``tandem train`` within 10 s with one line and ``128 + signal``, no
traceback and no process left, whether it reaches the launcher alone or its whole process group
(as a terminal's Ctrl-C does). Issue 25, deliverable 3.

Each case is a real ``tandem train`` in a session of its own, so that the group can be
signalled and searched for survivors.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT

pytestmark = pytest.mark.cli

LONG_RUN = ("train", "--model", "mlp:hidden=256", "--data", "images:n=20000,size=16", "--nproc",
            "2", "--steps", "100000", "--no-progress")
"""A job that would run for many minutes (the issue's own example)."""
STOP_WITHIN_S = 10.0


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_at(delay_s: float, signum: int, *, group: bool, args: tuple[str, ...] = LONG_RUN
            ) -> tuple[int, list[str], float]:
    """Start ``tandem ARGS``, send ``signum`` after ``delay_s`` (to the launcher, or to its
    process group), and return its exit status, stderr lines and seconds to its end; fail if
    it outlives ``STOP_WITHIN_S`` or leaves a process of its group behind."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    process = subprocess.Popen([sys.executable, "-m", "tandem", *args], cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        time.sleep(delay_s)
        sent = time.monotonic()
        (os.killpg if group else os.kill)(process.pid, signum)
        _, err = process.communicate(timeout=STOP_WITHIN_S)
        took = time.monotonic() - sent
        deadline = time.monotonic() + 2.0  # the forkserver ends once it sees its launcher gone
        while _group_alive(process.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _group_alive(process.pid), "a process of the job outlived it"
        return process.returncode, err.strip().splitlines(), took
    finally:
        if _group_alive(process.pid):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


@pytest.mark.parametrize("group", [False, True], ids=["launcher", "group"])
@pytest.mark.parametrize("delay_s", [2.0, 4.0, 6.0])
def test_ctrl_c_at_start_up_ends_the_job(delay_s: float, group: bool) -> None:
    code, lines, took = stop_at(delay_s, signal.SIGINT, group=group)
    assert code == 130, lines
    assert 1 <= len(lines) <= 3, lines
    assert lines[-1] == "tandem train: stopped by SIGINT; every worker has ended"
    assert not any("Traceback" in line or "KeyboardInterrupt" in line for line in lines), lines
    assert took < STOP_WITHIN_S


@pytest.mark.parametrize(("signum", "group", "delay_s"), [
    (signal.SIGTERM, True, 0.3), (signal.SIGHUP, False, 1.0), (signal.SIGINT, True, 1.0),
], ids=["sigterm-group-imports", "sighup-launcher-parsing", "sigint-group-imports"])
def test_signal_while_the_command_starts(signum: int, group: bool, delay_s: float) -> None:
    """Before the workers exist: the command itself is reading arguments or importing torch."""
    code, lines, _ = stop_at(delay_s, signum, group=group)
    assert code == 128 + signum, lines
    assert lines == [f"tandem train: stopped by {signal.Signals(signum).name}; every worker "
                     f"has ended"]


def test_signal_during_checkpoint_writes_leaves_a_whole_checkpoint(tmp_path: Path) -> None:
    """A checkpoint every step: a SIGTERM to the group lands on or between writes, and the
    checkpoint left is a whole one (the previous or the new), with no temporary file."""
    out = tmp_path / "run"
    args = ("train", "--model", "mlp:hidden=512", "--data", "images:n=4096,size=16",
            "--nproc", "2", "--steps", "100000", "--checkpoint-every", "1", "--no-progress",
            "--out", str(out))
    deadline = time.monotonic() + 60
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    process = subprocess.Popen([sys.executable, "-m", "tandem", *args], cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        while not (out / "checkpoint.pt").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (out / "checkpoint.pt").exists(), "no checkpoint was written within 60 s"
        time.sleep(0.5)  # several writes in: the signal lands while one is under way or close
        os.killpg(process.pid, signal.SIGTERM)
        _, err = process.communicate(timeout=STOP_WITHIN_S)
    finally:
        if _group_alive(process.pid):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
    lines = err.strip().splitlines()
    assert process.returncode == 143, lines
    assert lines[-1] == "tandem train: stopped by SIGTERM; every worker has ended"
    state = torch.load(out / "checkpoint.pt", weights_only=False)
    assert state["step"] >= 1
    assert [path.name for path in out.iterdir() if "tmp" in path.name] == []
