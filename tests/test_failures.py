"""User mistakes give one line and exit 2; a dead or stuck worker stops the job, named.

One case of each runs the real command in a subprocess (nothing else on stderr, stdout empty);
the others run it in this process (the launcher's stderr, which names the mistake)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from tandem.runtime.faults import PROGRESS_DIR, last_progress, record_progress
from tests.conftest import run_here, run_json, run_tandem

BAD_INPUTS = {
    "unknown model": (("--model", "transformerxl"), "unknown model 'transformerxl'"),
    "unknown dataset": (("--data", "imagenet"), "unknown dataset 'imagenet'"),
    "malformed options": (("--model", "gpt:layers4", "--data", "tokens"), "malformed model option"),
    "bad option value": (("--model", "mlp:hidden=wide"), "hidden='wide'"),
    "unknown option": (("--model", "mlp:depth=3"), "unknown model option 'depth'"),
    "model for other task": (("--model", "gpt", "--data", "digits"), "needs a token dataset"),
    "nproc 0": (("--nproc", "0"), "--nproc must be at least 1"),
    "batch not divisible": (("--nproc", "3", "--batch-size", "64"), "not divisible by the 3 workers"),
    "unknown strategy": (("--strategy", "zero3"), "unknown strategy 'zero3'"),
    "stop after beyond steps": (("--steps", "5", "--stop-after", "9"), "--stop-after 9"),
    "resume without checkpoint": (("--resume", "/nonexistent/ckpt.pt"), "no checkpoint at"),
    "not an int": (("--steps", "many"), "invalid int value"),
    "pipeline option without pipeline": (
        ("--stages", "2"), "--stages applies to --strategy pipeline only (this run has "
                           "--strategy dp); add --strategy pipeline or drop it"),
}


CASE_TIERS = {"unknown model": pytest.mark.cli,  # the real command: nothing else on stderr
              "resume without checkpoint": pytest.mark.multiprocess,  # a worker finds it
              "model for other task": pytest.mark.multiprocess}  # found after the forkserver starts
"""The tier of each case that is not ``pure`` (a mistake found in this process before the
workers' forkserver starts)."""


@pytest.mark.parametrize("case", [pytest.param(case, marks=CASE_TIERS.get(case, pytest.mark.pure))
                                  for case in sorted(BAD_INPUTS)])
def test_bad_input_is_one_line_and_status_2(case: str) -> None:
    args, expected = BAD_INPUTS[case]
    run = run_tandem if case == "unknown model" else run_here
    result = run("train", "--steps", "2", *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert expected in lines[0]
    assert result.stdout == ""


@pytest.mark.pure
@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere; see the /proc case")
def test_unwritable_out_permission(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    result = run_here("train", "--steps", "2", "--out", str(locked / "run"))
    assert result.returncode == 2 and "--out" in result.stderr


@pytest.mark.multiprocess
@pytest.mark.parametrize("out", ["/proc/tandem-run", "FILE"])
def test_unwritable_out(tmp_path: Path, out: str) -> None:
    if out == "FILE":
        out = str(tmp_path / "a-file")
        Path(out).write_text("not a directory")
    result = run_here("train", "--steps", "2", "--out", out)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--out {out} is not a writable directory" in lines[0]


@pytest.mark.multiprocess
def test_resume_with_other_settings_is_refused(tmp_path: Path) -> None:
    run_json("train", "--steps", "2", "--out", str(tmp_path))
    result = run_here("train", "--steps", "4", "--seed", "9", "--out", str(tmp_path), "--resume")
    assert result.returncode == 2 and "seed=0" in result.stderr


@pytest.mark.parametrize(
    ("how", "expected", "run"),
    [  # a killed worker prints nothing itself: the launcher's line is all there is to see
        pytest.param("crash", "worker rank 1 failed: RuntimeError: injected failure", run_tandem,
                     marks=pytest.mark.cli),
        pytest.param("kill", "worker rank 1 died: killed by SIGKILL", run_here,
                     marks=pytest.mark.multiprocess),
        pytest.param("hang", "worker rank 1 at step 3 (forward) is stuck", run_tandem,
                     marks=pytest.mark.cli),
    ],
)
def test_failed_worker_stops_the_job_and_is_named(how: str, expected: str, run: Any) -> None:
    start = time.monotonic()
    result = run("train", "--model", f"tests.faulty_models:{how}", "--nproc", "3",
                 "--batch-size", "63", "--steps", "20", "--timeout", "5", "--no-progress")
    assert result.returncode == 1
    lines = [line for line in result.stderr.strip().splitlines()
             if not line.startswith("tandem: warning:")]  # 3 workers on fewer cores say so
    assert len(lines) == 1, result.stderr
    assert expected in lines[0]
    # a hang would last until pytest's timeout (300 s); the job's end takes --timeout 5 after
    # start-up (a torch import in the command and in its forkserver), which a loaded machine
    # stretched to 75-83 s
    assert time.monotonic() - start < 150


@pytest.mark.pure
def test_progress_is_rewritten_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step rewrites the worker's progress file in place (it stays open); a smaller step
    after a larger one (a resumed attempt) reads back as itself."""
    monkeypatch.setenv(PROGRESS_DIR, str(tmp_path))
    for step in (120, 121, 5):
        record_progress(3, step)
        assert last_progress(tmp_path, 3) == step
