"""A ``TANDEM_FAULT`` that is accepted fires, on every role (parameter servers too, and a rank
whose steps jump), or is refused before it could be missed (a step past ``--stop-after``, or
before the step a resumed run starts at)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tandem.errors import UsageError
from tandem.runtime import faults

from tests.conftest import max_abs_diff, run_here, run_json
from tests.test_hardening_resume import SOURCE
from tests.test_hardening_waits import finish, start

PS = ("train", "--strategy", "ps", "--nproc", "3", "--steps", "12", "--batch-size", "60",
      "--seed", "4", "--no-progress")


@pytest.mark.cli
def test_a_fault_aimed_at_a_parameter_server_fires(tmp_path: Path) -> None:
    """Was: the server never looked, and the run ended with status 0."""
    process, mark = start(*PS, "--out", str(tmp_path), env={**SOURCE, "TANDEM_FAULT": "0:5"})
    code, _, err = finish(process, mark, timeout_s=120)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) <= 3, err
    assert "tandem: TANDEM_FAULT=0:5: killing rank 0 at step 5" in lines
    assert lines[-1] == "tandem train: worker rank 0 died: killed by SIGKILL"


@pytest.mark.multiprocess
def test_a_killed_server_restarts_from_the_servers_checkpoint(tmp_path: Path) -> None:
    """The fault fires after the server saved the checkpoint of the step it reached, so the
    restarted group resumes from it and ends as the uninterrupted run (asynchronous EASGD's
    center servers fire it too)."""
    run_json(*PS, "--out", str(tmp_path / "whole"))
    summary = run_json(*PS, "--out", str(tmp_path / "cut"), "--checkpoint-every", "4",
                       "--max-restarts", "1", "--resume", "auto", env={"TANDEM_FAULT": "0:8"})
    assert summary["restarts"] == 1 and summary["finished"]
    assert max_abs_diff(tmp_path / "whole" / "final.pt", tmp_path / "cut" / "final.pt") == 0.0
    easgd = run_here("train", "--strategy", "easgd", "--mode", "async", "--nproc", "3",
                     "--steps", "12", "--batch-size", "60", "--no-progress", "--out",
                     str(tmp_path / "easgd"), env={"TANDEM_FAULT": "0:5"})
    assert easgd.returncode == 1
    assert easgd.stderr.strip().splitlines()[-1] == (
        "tandem train: worker rank 0 died: killed by SIGKILL")


@pytest.mark.pure
def test_a_rank_whose_steps_jump_fires_at_the_first_step_past_its_fault(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An asynchronous ps worker's steps are the servers' updates over the workers, which can
    skip the named one (a slow worker's next update may be several steps on)."""
    killed: list[int] = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, signum: killed.append(signum))
    monkeypatch.setenv(faults.FAULT, "1:5")
    monkeypatch.delenv(faults.ATTEMPT, raising=False)
    monkeypatch.delenv(faults.PROGRESS_DIR, raising=False)
    faults.maybe_fail(1, 4, since=2)
    faults.maybe_fail(0, 7, since=4)  # another rank
    assert killed == []
    faults.maybe_fail(1, 7, since=4)  # 5 and 6 skipped
    faults.maybe_fail(1, 5)
    assert killed == [signal.SIGKILL, signal.SIGKILL]
    with pytest.raises(UsageError, match="TANDEM_FAULT=1:5 names step 5, but rank 1 starts at "
                                         "step 6 .*; pick a step from 6 on, or unset"):
        faults.check_fault_ahead(1, 6)
    faults.check_fault_ahead(1, 5)
    monkeypatch.setenv(faults.ATTEMPT, "1")  # a restarted attempt: no fault, no refusal
    faults.check_fault_ahead(1, 6)


@pytest.mark.pure
def test_a_fault_past_stop_after_is_refused_before_start(tmp_path: Path) -> None:
    result = run_here(*PS, "--stop-after", "4", "--out", str(tmp_path),
                      env={"TANDEM_FAULT": "1:6"})
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1] == (
        "tandem train: error: TANDEM_FAULT=1:6 names rank 1 and step 6, but the job has ranks "
        "0-2 and steps 0-3 (--stop-after); pick ones it has, or unset TANDEM_FAULT")


@pytest.mark.multiprocess
def test_a_fault_before_the_step_a_run_resumes_from_is_refused(tmp_path: Path) -> None:
    dp = ("train", "--nproc", "2", "--steps", "12", "--batch-size", "60", "--no-progress",
          "--out", str(tmp_path))
    run_json(*dp, "--stop-after", "6")
    result = run_here(*dp, "--resume", env={"TANDEM_FAULT": "1:3"})
    assert result.returncode == 2
    assert ("TANDEM_FAULT=1:3 names step 3, but rank 1 starts at step 6 (the checkpoint it "
            "resumes from), so it would never fire") in result.stderr.strip().splitlines()[-1]
