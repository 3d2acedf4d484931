"""Outputs are safe and strict JSON: a full disk, a second job on the same ``--out``, a fresh run
over an unfinished one and a diverged loss each give one line (or valid JSON), never a lost
checkpoint, a temporary file left behind or a bare ``NaN``."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from tandem import strict_json
from tandem.errors import UsageError, WorkerFailure
from tandem.output_files import AppendLog, write_text
from tandem.runtime.checkpoint import CHECKPOINT_VERSION, load_checkpoint, save_atomic
from tandem.runtime.config import RunConfig
from tandem.runtime.out_dir import LOCK_NAME, claim_out
from tandem.strategy import plan_from_flags
from tandem.timeline import Event, Timeline, plot_gantt
from tests.conftest import ROOT, run_here, run_json, run_tandem

NO_SPACE = "No space left on device"


def strict_loads(text: str) -> Any:
    """``json.loads`` that rejects ``NaN``, ``Infinity`` and ``-Infinity``, as strict parsers do."""
    def reject(constant: str) -> None:
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=reject)


@pytest.mark.pure
def test_non_finite_numbers_become_null() -> None:
    text = strict_json.dumps({"loss": math.nan, "rates": [math.inf, -math.inf, 1.5], "t": (2,)})
    assert text == '{"loss": null, "rates": [null, null, 1.5], "t": [2]}'
    with pytest.raises(ValueError, match="NaN"):
        strict_loads(json.dumps({"loss": math.nan}))


# -- a full disk, simulated in this process --------------------------------------------------


@pytest.fixture
def disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """``tmp_path`` on a file system with ``disk["free"]`` bytes left (plenty until a test sets
    it): ``os.write`` to a file under it writes what fits (a short write), then fails with
    ``ENOSPC``, as the kernel does on a full disk."""
    real_write, disk = os.write, {"free": 1 << 40}

    def write(fd: int, data: Any) -> int:
        if not os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path)):
            return real_write(fd, data)
        view = memoryview(data).cast("B")
        if disk["free"] == 0 and len(view):
            raise OSError(errno.ENOSPC, NO_SPACE)
        written = real_write(fd, view[: disk["free"]])
        disk["free"] -= written
        return written

    monkeypatch.setattr(os, "write", write)
    return disk


def _checkpoint(step: int) -> dict[str, Any]:
    return {"version": CHECKPOINT_VERSION, "step": step, "fingerprint": {},
            "model": {"w": torch.randn(64, 64)}}


def _trace(num_events: int) -> Timeline:
    return Timeline(events=[Event(worker=0, name="0F0", start_s=i, end_s=i + 1.0, step=i)
                            for i in range(num_events)])


WRITERS: dict[str, Callable[[Path, int], None]] = {
    "checkpoint.pt": lambda path, size: save_atomic(_checkpoint(size), path),
    "final.pt": lambda path, size: save_atomic({"w": torch.zeros(size)}, path),
    "trace.json": lambda path, size: _trace(size).write(path),
    "plan.json": lambda path, size: plan_from_flags(
        "dp", {}, num_processes=size, num_blocks=4).save(str(path)),
    "config.json": lambda path, size: write_text(path, strict_json.dumps({"run": [0] * size})),
}
"""Each output's writer, given a size (small when the disk has room, larger when it has not)."""


@pytest.mark.pure
@pytest.mark.parametrize("name", list(WRITERS))
def test_a_write_that_does_not_fit_keeps_the_old_file(disk: dict[str, int], tmp_path: Path,
                                                     name: str) -> None:
    path = tmp_path / name
    WRITERS[name](path, 2)
    before = path.read_bytes()
    disk["free"] = 100
    with pytest.raises(WorkerFailure) as failure:
        WRITERS[name](path, 64)
    assert str(failure.value).startswith(f"cannot write {path}: {NO_SPACE}; free space")
    assert path.read_bytes() == before
    assert sorted(tmp_path.iterdir()) == [path]  # no temporary file left


@pytest.mark.pure
def test_the_last_good_checkpoint_stays_loadable(disk: dict[str, int], tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    save_atomic(_checkpoint(10), path)
    disk["free"] = 5000  # torch's archive gets part of the way: a short write, then ENOSPC
    with pytest.raises(WorkerFailure, match=f"cannot write {path}: {NO_SPACE}"):
        save_atomic(_checkpoint(20), path)
    assert load_checkpoint(path, {})["step"] == 10


@pytest.mark.pure
def test_a_metrics_line_that_does_not_fit_is_taken_back(disk: dict[str, int],
                                                        tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    log = AppendLog(path)
    log.write_line('{"step": 1}')
    disk["free"] = 5
    with pytest.raises(WorkerFailure, match=f"cannot write {path}: {NO_SPACE}"):
        log.write_line('{"step": 2, "loss": 0.5}')
    log.close()
    assert path.read_text() == '{"step": 1}\n'


@pytest.mark.pure
def test_a_gantt_chart_that_does_not_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """matplotlib writes through its own file objects: its disk fills up half-way."""
    from matplotlib.figure import Figure

    def half_then_full(self: Figure, path: Path, **kwargs: Any) -> None:
        Path(path).write_bytes(b"\x89PNG half")
        raise OSError(errno.ENOSPC, NO_SPACE)

    monkeypatch.setattr(Figure, "savefig", half_then_full)
    with pytest.raises(WorkerFailure, match=f"cannot write {tmp_path / 'gantt.png'}: {NO_SPACE}"):
        plot_gantt(_trace(3), tmp_path / "gantt.png")
    assert list(tmp_path.iterdir()) == []


# -- the --out directory ---------------------------------------------------------------------


@pytest.mark.pure
def test_a_fresh_run_over_outputs_is_refused_and_overwrite_removes_them(tmp_path: Path) -> None:
    for name in ("checkpoint.pt", "metrics.jsonl", "plan.json", "server-1.pt"):
        (tmp_path / name).write_text("old")
    with pytest.raises(UsageError) as refused, claim_out(RunConfig(out=str(tmp_path))):
        pass
    assert str(refused.value) == (
        f"--out {tmp_path} holds another run (checkpoint.pt, metrics.jsonl, server-1.pt); use "
        f"--resume to continue it or --overwrite to start over")
    with claim_out(RunConfig(out=str(tmp_path), resume="auto")):
        pass
    with claim_out(RunConfig(out=str(tmp_path), overwrite=True)):
        pass
    # plan.json may be this run's own --plan; it is rewritten when the run ends
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME, "plan.json"]
    with pytest.raises(UsageError, match="--overwrite starts a run over and --resume continues"):
        with claim_out(RunConfig(out=str(tmp_path), resume="auto", overwrite=True)):
            pass


HOLD = """
import sys, time
from tandem.runtime.config import RunConfig
from tandem.runtime.out_dir import claim_out
with claim_out(RunConfig(out=sys.argv[1])):
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.mark.cli
def test_a_second_job_on_the_same_out_stops_at_once(tmp_path: Path) -> None:
    """The lock a job's launching process holds (here a process that only holds it) makes a
    second ``tandem train`` fail at once, naming it; killed, it leaves no stale lock."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        result = run_here("train", "--steps", "2", "--out", str(tmp_path))
        assert result.returncode == 2, result.stderr
        assert result.stderr.splitlines() == [
            f"tandem train: error: --out {tmp_path} is in use by another tandem job (pid "
            f"{holder.pid} on {os.uname().nodename}); wait for it to end or choose another --out"]
        assert not (tmp_path / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    with claim_out(RunConfig(out=str(tmp_path))):
        assert (tmp_path / LOCK_NAME).read_text().startswith(f"pid {os.getpid()} ")


# -- the command line ------------------------------------------------------------------------

TRAIN = ("train", "--model", "mlp:hidden=16,layers=2", "--steps", "6", "--batch-size", "32",
         "--no-progress")


@pytest.fixture(scope="module")
def diverged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A run whose loss is NaN (``--lr 1e30``), stopped with a checkpoint after 3 of 6 steps:
    its directory and its ``--json`` output. In fp16, where a non-finite loss is an overflow
    the loss scaler skips (in fp32 it stops the run: see test_divergence.py)."""
    out = tmp_path_factory.mktemp("diverged")
    result = run_here(*TRAIN, "--lr", "1e30", "--precision", "fp16", "--stop-after", "3",
                      "--log-every", "1", "--out", str(out), "--json")
    assert result.returncode == 0, result.stderr
    return out, result.stdout


@pytest.mark.multiprocess
def test_a_diverged_run_writes_strict_json(diverged: tuple[Path, str]) -> None:
    out, stdout = diverged
    summary = strict_loads(stdout.strip().splitlines()[-1])
    assert summary["final_loss"] is None and summary["steps"] == 3
    lines = [strict_loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line.get("loss", "-") for line in lines][1:] == [None, None, "-"]  # step 1 before
    assert lines[-1]["test_loss"] is None  # the update that diverged; then the evaluation
    for name in ("trace.json", "config.json", "plan.json"):
        strict_loads((out / name).read_text())


@pytest.mark.multiprocess
def test_a_fresh_run_does_not_overwrite_an_unfinished_one(diverged: tuple[Path, str]) -> None:
    out, _ = diverged
    before = (out / "checkpoint.pt").read_bytes()
    result = run_here(*TRAIN, "--out", str(out))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"tandem train: error: --out {out} holds another run (checkpoint.pt, config.json, "
        f"gantt.png, metrics.jsonl, trace.json); use --resume to continue it or --overwrite to "
        f"start over"]
    assert (out / "checkpoint.pt").read_bytes() == before


@pytest.mark.multiprocess
def test_resuming_with_fewer_steps_than_the_checkpoint_is_refused(
        diverged: tuple[Path, str]) -> None:
    out, _ = diverged
    result = run_here(*TRAIN, "--steps", "2", "--out", str(out), "--resume")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"tandem train: error: checkpoint {out / 'checkpoint.pt'} was saved after 3 steps, but "
        f"this run has --steps 2; resume with --steps 3 or more"]


@pytest.mark.multiprocess
def test_overwrite_starts_over(diverged: tuple[Path, str], tmp_path: Path) -> None:
    out = tmp_path / "run"
    shutil.copytree(diverged[0], out)
    result = run_here(*TRAIN, "--steps", "2", "--log-every", "1", "--out", str(out),
                      "--overwrite")
    assert result.returncode == 0, result.stderr
    steps = [strict_loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 2]  # this run's lines only
    assert load_checkpoint(out / "checkpoint.pt", {})["step"] == 2


# -- a real full disk ------------------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (needs root and a kernel that lets this process mount)."""
    mount = tmp_path / "fs"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
            capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root; the simulated full disk above holds")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.mark.cli
def test_a_full_disk_stops_the_run_with_one_line(small_fs: Path) -> None:
    """Two workers; the disk fills up between a run's first checkpoint and its second: the job
    stops with one line naming the file, and the first checkpoint is still there."""
    out = small_fs / "run"
    args = (*TRAIN, "--model", "mlp", "--steps", "4", "--nproc", "2", "--out", str(out))
    run_json(*args, "--stop-after", "2")
    free = shutil.disk_usage(small_fs).free
    (small_fs / "filler").write_bytes(bytes(free - 100_000))  # a checkpoint needs ~350 kB
    result = run_tandem(*args, "--resume", timeout_s=300)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"tandem train: cannot write {out / 'checkpoint.pt'}: {NO_SPACE}; free space on its "
        f"file system, or write elsewhere"]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [LOCK_NAME]
    assert load_checkpoint(out / "checkpoint.pt", {})["step"] == 2
    for line in (out / "metrics.jsonl").read_text().splitlines():
        strict_loads(line)


@pytest.mark.multiprocess
def test_a_run_without_out_goes_to_a_new_runs_directory(tmp_path: Path) -> None:
    """Without ``--out`` (issue 29): a new ``runs/<date>_<time>`` under ``$TANDEM_RUNS_DIR``,
    named by the summary (and on stderr at its start, at a terminal), holds the run's outputs;
    a run refused before launch leaves none."""
    runs = tmp_path / "runs"
    result = run_here("train", "--steps", "2", "--json", "--no-progress",
                      env={"TANDEM_RUNS_DIR": str(runs)})
    assert result.returncode == 0, result.stderr
    out = Path(json.loads(result.stdout.strip().splitlines()[-1])["out"])
    assert out.parent == runs and (out / "final.pt").exists() and (out / "metrics.jsonl").exists()
    assert "tandem: writing" not in result.stderr  # not a terminal: the summary says it
    refused = run_here("train", "--steps", "2", "--batch-size", "0",
                       env={"TANDEM_RUNS_DIR": str(runs)})
    assert refused.returncode == 2 and sorted(runs.iterdir()) == [out]


@pytest.mark.pure
def test_runs_started_in_the_same_second_get_their_own_directories(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.runtime import out_dir

    monkeypatch.setenv("TANDEM_RUNS_DIR", str(tmp_path))
    monkeypatch.setattr(out_dir.time, "strftime", lambda _: "2026-11-27_12-00-00")
    made = [out_dir.default_out() for _ in range(3)]
    assert [path.name for path in made] == ["2026-11-27_12-00-00", "2026-11-27_12-00-00-2",
                                            "2026-11-27_12-00-00-3"]
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(UsageError, match="under torchrun, give --out DIR"):
        out_dir.default_out()
