"""Every wait is bounded, signals stop the whole job, start-up mistakes are one line.

Each run is the real command line in its own session, marked by an environment variable, so
that the test can tell that none of the job's processes (workers, supervised children, their
resource trackers) is left once the command has ended.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.cli

MARK = "TANDEM_TEST_JOB"
FAST = ("--steps", "100000", "--batch-size", "32", "--no-progress", "--log-every", "1")


def start(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    """Start ``tandem ARGS`` in a session of its own; returns it and the job's mark."""
    mark = uuid.uuid4().hex
    # this checkout's src first (a git worktree's, not the one the editable install names)
    environ = {**os.environ, "OMP_NUM_THREADS": "1", MARK: mark,
               "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        environ.pop(key, None)
    environ.update(env or {})
    process = subprocess.Popen([sys.executable, "-m", "tandem", *args], env=environ, cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    return process, mark


def finish(process: subprocess.Popen[str], mark: str, timeout_s: float) -> tuple[int, str, str]:
    """Wait for the command (killing its session on a hang), then check nothing of it is left."""
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"the command did not end within {timeout_s} s:\n{err[-3000:]}")
    nothing_left(mark, err)
    return process.returncode, out, err


def nothing_left(mark: str, err: str) -> None:
    """Check that no process of the job marked ``mark`` is left (killing any that is)."""
    deadline = time.monotonic() + 5
    while (left := job_processes(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind: {left}\n{err[-3000:]}"


def job_processes(mark: str) -> list[int]:
    """Live processes (not zombies) whose environment carries ``mark``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"{MARK}={mark}".encode() in environ.split(b"\0") and state != "Z":
            found.append(int(entry.name))
    return found


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def wait_for(path: Path, process: subprocess.Popen[str], timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert process.poll() is None, process.communicate()[1]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


@pytest.mark.parametrize(("schedule", "how"), [("1f1b", "hang"), ("gpipe", "hang"),
                                               ("1f1b", "stop")])
def test_stuck_pipeline_stage_ends_the_job_naming_it(schedule: str, how: str,
                                                     tmp_path: Path) -> None:
    """The pipeline's own process groups (links between stages) wait --timeout, not 30 min.

    A stage frozen by SIGSTOP (``how=stop``) answers no SIGTERM: the worker that names it
    continues it as it exits, so the launcher's SIGTERM ends it at once (not 30 s later).
    """
    process, mark = start(
        "train", "--strategy", "pipeline", "--schedule", schedule, "--nproc", "2",
        "--model", f"tests.faulty_models:pipeline_hang:rank=1,after=6,how={how}",
        "--timeout", "10", *FAST, env={"TANDEM_TEST_FAULT_AT": str(tmp_path / "hung")})
    code, _, err = finish(process, mark, timeout_s=150)
    hung_at = float((tmp_path / "hung").read_text())
    line = one_line(err)
    assert code == 1 and line.startswith("tandem train: worker rank 1 ")
    assert "rank 0 gave up waiting" in line
    assert time.time() - hung_at < 30


def test_stuck_async_ps_worker_is_left_behind_and_ended(tmp_path: Path) -> None:
    """Asynchronous training goes on without a stuck worker, says so, and ends its process.

    Each training step sleeps 0.1 s, so the healthy workers' 200 steps last 20 s or more
    (whatever the machine), well past the stuck one's --timeout 10: it is named while they
    train (1,500 CPU-bound steps lasted as long as the machine was slow, at ~10 CPU-s)."""
    process, mark = start(
        "train", "--strategy", "ps", "--mode", "async", "--nproc", "4", "--servers", "1",
        "--model", "tests.faulty_models:hang:rank=2,after=5,delay=0.1", "--timeout", "10",
        "--steps", "200", "--batch-size", "30", "--no-progress", "--json")
    code, out, err = finish(process, mark, timeout_s=150)
    assert code == 0, err
    said = " ".join(line for line in err.splitlines() if not line.startswith("tandem: warning"))
    assert re.fullmatch(r"worker rank 2 is stuck at step \d+ \(forward\), no progress for 9 s; "
                        r"asynchronous training goes on without it", " ".join(said.split())), err
    assert '"dead_workers": [2]' in out


ASYNC = {"ps": ("--strategy", "ps", "--mode", "async"),
         "easgd": ("--strategy", "easgd", "--mode", "async")}
STOP_TIMEOUT_S = 5
"""``--timeout`` of the stopped-process runs: each must end, or name the stopped rank, within
this + 20 s of the stop."""


class Watched:
    """A started command whose stderr is read line by line as it comes, each line with the
    time it came (``lines``), and whose stdout is read whole (``out``)."""

    def __init__(self, process: subprocess.Popen[str], mark: str) -> None:
        self.process, self.mark = process, mark
        self.lines: list[tuple[float, str]] = []
        self.out: list[str] = []
        self.ended_at = float("inf")
        assert process.stderr is not None and process.stdout is not None
        stderr, stdout = process.stderr, process.stdout
        self.readers = [
            threading.Thread(target=lambda: self.lines.extend(
                (time.monotonic(), line.rstrip("\n")) for line in stderr), daemon=True),
            threading.Thread(target=lambda: self.out.append(stdout.read()), daemon=True)]
        for reader in self.readers:
            reader.start()

    def recorded(self, folder: Path, name: str, timeout_s: float = 120) -> tuple[int, int]:
        """``PID PPID`` that ``tests.faulty_models:recorded`` wrote to ``folder/name``."""
        deadline = time.monotonic() + timeout_s
        while not (folder / name).exists():
            assert self.process.poll() is None, "\n".join(line for _, line in self.lines)
            assert time.monotonic() < deadline, f"{folder / name} never appeared"
            time.sleep(0.1)
        pid, ppid = (folder / name).read_text().split()
        return int(pid), int(ppid)

    def finish(self, timeout_s: float) -> tuple[int, str, str]:
        """:func:`finish` for a watched command (``ended_at``: when it ended)."""
        try:
            self.process.wait(timeout=timeout_s)
            self.ended_at, hung = time.monotonic(), False
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            hung = True
        for reader in self.readers:
            reader.join(timeout=10)
        err = "\n".join(line for _, line in self.lines)
        assert not hung, f"the command did not end within {timeout_s} s:\n{err[-3000:]}"
        nothing_left(self.mark, err)
        return self.process.returncode, "".join(self.out), err


def start_stopped_run(strategy: str, nproc: int, steps: int, pids: Path,
                      *extra: str) -> Watched:
    """A job of asynchronous ``strategy`` on ``nproc`` processes whose model records their
    pids in ``pids`` and paces each training step (0.1 s), with ``--timeout 5``."""
    process, mark = start(
        "train", *ASYNC[strategy], "--nproc", str(nproc), "--steps", str(steps),
        "--batch-size", "60", "--model", "tests.faulty_models:recorded:delay=0.1",
        "--timeout", str(STOP_TIMEOUT_S), "--no-progress", "--log-every", str(steps), *extra,
        env={"TANDEM_TEST_PIDS": str(pids)})
    return Watched(process, mark)


def said(lines: list[tuple[float, str]]) -> list[tuple[float, str]]:
    """The lines that are not the warning of more workers than cores (a small machine's)."""
    return [(at, line) for at, line in lines if "workers will time-share the cores" not in line]


@pytest.mark.parametrize("strategy", ["ps", "easgd"])
def test_stopped_async_workers_are_named_once_and_left_behind(strategy: str,
                                                              tmp_path: Path) -> None:
    """SIGSTOP of a worker's top-level process (its supervisor: rank 1) and of another's
    training child (rank 2), as training runs. Each is named once within --timeout + 20 s and
    left behind; the server and the healthy worker (rank 3) are not named, and the job ends
    with exit 0, the two in ``dead_workers``, and no process left (stopped ones included)."""
    pids = tmp_path / "pids"
    pids.mkdir()
    job = start_stopped_run(strategy, 4, 100, pids, "--json")
    _, supervisor = job.recorded(pids, "1.trains")
    child, _ = job.recorded(pids, "2.trains")
    os.kill(supervisor, signal.SIGSTOP)
    os.kill(child, signal.SIGSTOP)
    stopped_at = time.monotonic()
    code, out, err = job.finish(timeout_s=240)
    assert code == 0, err
    assert len(err.strip().splitlines()) <= 3, err
    lines = said(job.lines)
    assert sorted(line for _, line in lines) == [
        "worker rank 1 stopped responding (its supervising process has been stopped for 10+ s); "
        "asynchronous training goes on without it",
        "worker rank 2 stopped responding (no heartbeat for 10+ s); asynchronous training goes "
        "on without it"], err
    assert all(at - stopped_at < STOP_TIMEOUT_S + 20 for at, _ in lines), (lines, stopped_at)
    assert json.loads(out.strip().splitlines()[-1])["dead_workers"] == [1, 2]


@pytest.mark.parametrize("strategy", ["ps", "easgd"])
def test_a_stopped_async_server_ends_the_job_naming_it(strategy: str, tmp_path: Path) -> None:
    """SIGSTOP of the server as training runs: the job ends within --timeout + 20 s with one
    line naming it (the worker whose wait ended first says where), exit 1, and no process
    left: the launcher kills the stopped server, which no SIGTERM can end."""
    pids = tmp_path / "pids"
    pids.mkdir()
    job = start_stopped_run(strategy, 3, 100000, pids)
    server, _ = job.recorded(pids, "0")
    job.recorded(pids, "1.trains")
    os.kill(server, signal.SIGSTOP)
    stopped_at = time.monotonic()
    code, _, err = job.finish(timeout_s=240)
    assert code == 1, err
    assert len(err.strip().splitlines()) <= 3, err
    lines = said(job.lines)
    assert len(lines) == 1 and re.fullmatch(
        r"tandem train: server rank 0 stopped responding \(no heartbeat for 10\+ s\); rank [12] "
        r"gave up waiting at step \d+ \(pull\)", lines[0][1]), err
    assert job.ended_at - stopped_at < STOP_TIMEOUT_S + 20, err


def test_ctrl_c_stops_every_worker_with_one_line_and_130(tmp_path: Path) -> None:
    process, mark = start("train", "--nproc", "2", "--out", str(tmp_path), *FAST)
    wait_for(tmp_path / "metrics.jsonl", process)
    os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    code, _, err = finish(process, mark, timeout_s=60)
    assert code == 130
    assert one_line(err) == "tandem train: stopped by SIGINT; every worker has ended"


def test_sigterm_gives_143_and_the_run_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """Each step sleeps 0.02 s: the run lasts 6 s or more whatever the machine, so SIGTERM, sent
    0.5 s after the first checkpoint (step 25), comes while it trains, and the resumed run has
    little left to compute (1,500 CPU-bound steps cost ~6 CPU-s)."""
    args = ("train", "--nproc", "2", "--steps", "300", "--batch-size", "32", "--model",
            "tests.faulty_models:recorded:delay=0.02", "--out", str(tmp_path),
            "--checkpoint-every", "25", "--no-progress")
    process, mark = start(*args)
    wait_for(tmp_path / "checkpoint.pt", process)
    time.sleep(0.5)
    process.send_signal(signal.SIGTERM)  # to the command alone, as a scheduler does
    code, _, err = finish(process, mark, timeout_s=60)
    assert code == 143
    assert one_line(err) == "tandem train: stopped by SIGTERM; every worker has ended"
    resumed, mark = start(*args, "--resume", "--json")
    code, out, err = finish(resumed, mark, timeout_s=150)
    assert code == 0, err
    assert '"steps": 300' in out


LAUNCHER_MISTAKES = {
    "only RANK": ({"RANK": "1"}, "RANK is set but WORLD_SIZE, MASTER_ADDR and MASTER_PORT are "
                  "not; start the job with torchrun"),
    "rank beyond world": ({"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": "29400"}, "RANK=3 is not below WORLD_SIZE=2"),
    "port not a number": ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": "http"}, "MASTER_PORT='http' must be an integer"),
}


@pytest.mark.parametrize("case", sorted(LAUNCHER_MISTAKES))
def test_inconsistent_launcher_variables_are_one_line_and_status_2(case: str) -> None:
    env, expected = LAUNCHER_MISTAKES[case]
    process, mark = start("train", "--steps", "2", env=env)
    code, _, err = finish(process, mark, timeout_s=60)
    assert code == 2 and expected in one_line(err)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(("rank", "expected"), [
    (0, "worker rank 0: only 1 of 2 workers joined the job at 127.0.0.1:"),
    (1, "worker rank 1 could not reach the job's master at 127.0.0.1:"),
])
def test_a_job_that_never_assembles_ends_within_its_timeout(rank: int, expected: str) -> None:
    env = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    begin = time.monotonic()
    process, mark = start("train", "--steps", "2", "--timeout", "4", env=env)
    code, _, err = finish(process, mark, timeout_s=60)
    assert code == 1 and expected in one_line(err) and "--timeout 4 s" in err
    assert time.monotonic() - begin < 4 + 25  # start-up of python and torch included
