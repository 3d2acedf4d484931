"""Local workers fork from a preloaded forkserver (issue 25, deliverable 1): they find torch and
tandem's runtime imported, and what differs per job — the environment, ``sys.path``, the working
directory — reaches them from the launch, not from the moment the forkserver started."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from tandem.data.digits import digits_arrays
from tandem.output_files import remove_abandoned, temporary_path
from tandem.runtime import zygote
from tandem.runtime.launch import launch


def report(arg: str) -> dict[str, object]:
    """What a worker sees of its job (module level: workers import it by name)."""
    return {"arg": arg, "variable": os.environ.get("TANDEM_TEST_VARIABLE"),
            "removed": "TANDEM_TEST_REMOVED" in os.environ, "rank": os.environ.get("RANK"),
            "cwd": os.getcwd(), "path": list(sys.path),
            "preloaded": all(name in sys.modules for name in zygote.PRELOAD),
            "parent_is_forkserver": os.getppid() != int(os.environ["TANDEM_TEST_LAUNCHER"])}


@pytest.mark.multiprocess
def test_workers_take_the_launch_s_environment_not_the_forkserver_s(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_TEST_REMOVED", "1")
    zygote.start()  # the forkserver sees the variable above, and none of what follows
    monkeypatch.delenv("TANDEM_TEST_REMOVED")
    monkeypatch.setenv("TANDEM_TEST_VARIABLE", "set after the forkserver started")
    monkeypatch.setenv("TANDEM_TEST_LAUNCHER", str(os.getpid()))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "on-path"))
    seen = launch(report, "job", nproc=2)
    assert seen is not None
    assert seen["arg"] == "job" and seen["rank"] == "0"
    assert seen["variable"] == "set after the forkserver started"
    assert seen["removed"] is False
    assert seen["cwd"] == str(tmp_path)
    assert str(tmp_path / "on-path") in seen["path"]
    assert seen["preloaded"] is True
    assert seen["parent_is_forkserver"] is True


@pytest.mark.pure
def test_carried_keeps_the_agent_s_rank_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    carried = zygote.Carried(dict, {"A": "launch", "RANK": "launcher's", "OMP_NUM_THREADS": "9"})
    monkeypatch.setattr(os, "environ", {})  # a worker's, not this process's
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("STALE", "from the forkserver")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    carried({})
    assert os.environ["A"] == "launch"
    assert os.environ["RANK"] == "3" and os.environ["TORCHELASTIC_RUN_ID"] == "x"
    assert "STALE" not in os.environ and os.environ["OMP_NUM_THREADS"] == "1"
    assert carried.__name__ == "dict"


@pytest.mark.pure
def test_digits_read_from_the_shipped_file_equal_scikit_learn_s() -> None:
    from sklearn.datasets import load_digits

    images, labels = digits_arrays()
    reference = load_digits()
    assert images.shape == (1797, 8, 8)
    np.testing.assert_array_equal(images, reference.images)
    np.testing.assert_array_equal(labels, reference.target)


@pytest.mark.pure
def test_abandoned_temporary_files_are_removed(tmp_path: Path) -> None:
    dead = 2 ** 22 + 12345  # above the default pid_max: no process has it
    named_here = temporary_path(tmp_path / "metrics.jsonl").name  # .metrics.tmpPID@HOST.jsonl
    abandoned = [tmp_path / f".checkpoint.tmp{dead}.pt",  # before writers named their host
                 tmp_path / named_here.replace(f"tmp{os.getpid()}@", f"tmp{dead}@")]
    mine = temporary_path(tmp_path / "checkpoint.pt")  # a writer still at work
    # a writer on another machine that shares the directory: its pid means nothing here
    elsewhere = tmp_path / f".final.tmp{dead}@another-host.pt"
    others = [tmp_path / "checkpoint.pt", tmp_path / ".tandem.lock", tmp_path / ".x.tmpabc.pt",
              elsewhere]
    for path in [*abandoned, mine, *others]:
        path.write_text("x")
    assert sorted(remove_abandoned(tmp_path)) == sorted(abandoned)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in [mine, *others])
