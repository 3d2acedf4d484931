"""A killed or crashed peer (the asynchronous server, a loader process, a worker ended by a
signal) ends the job with one line naming it, once, and nothing of the job is left; a script
that calls ``tandem.fit`` outside ``if __name__ == "__main__":`` is stopped before any worker
starts, in one line; torch's warnings about what tandem itself does stay out of the output."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
import uuid
import warnings
from pathlib import Path

import pytest
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from tandem.runtime import launch
from tandem.runtime.main_guard import _guarded
from tests.conftest import ROOT
from tests.test_hardening_resume import SOURCE
from tests.test_hardening_waits import MARK, finish, job_processes, start

LOADER_DIED = re.compile(r"tandem train: worker rank [01] failed: LoaderDied: its loader process "
                         r"\(pid \d+, --loader-workers\) died before handing over a batch: "
                         r"killed, or out of memory")


@pytest.mark.cli
def test_a_killed_asynchronous_server_is_one_line(tmp_path: Path) -> None:
    """Was 72 lines: every worker's traceback of its lost connection to the server."""
    process, mark = start("train", "--strategy", "ps", "--mode", "async", "--nproc", "3",
                          "--steps", "400", "--batch-size", "60", "--timeout", "10",
                          "--no-progress", "--out", str(tmp_path),
                          env={**SOURCE, "TANDEM_FAULT": "0:20"})
    code, _, err = finish(process, mark, timeout_s=120)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) <= 3, err  # and maybe the line on sharing 2 cores
    assert "tandem: TANDEM_FAULT=0:20: killing rank 0 at step 20" in lines
    assert lines[-1] == "tandem train: worker rank 0 died: killed by SIGKILL"
    assert all(line.startswith("tandem") for line in lines), err


@pytest.mark.cli
def test_a_killed_loader_process_is_one_line_naming_it(tmp_path: Path) -> None:
    """Each worker's loader process is killed (as the out-of-memory killer would) reading its
    first batch of items from 1000 on: the first worker to find its loader gone is named, once
    (was: ``RuntimeError: DataLoader worker (pid(s) N) exited unexpectedly``)."""
    process, mark = start("train", "--data", "tests.user_data:killed_in_loader:at=1000",
                          "--loader-workers", "1", "--nproc", "2", "--steps", "20",
                          "--batch-size", "64", "--no-progress", "--out", str(tmp_path),
                          env=SOURCE)
    code, _, err = finish(process, mark, timeout_s=120)
    assert code == 1
    line, = err.strip().splitlines()
    assert LOADER_DIED.fullmatch(line), err


NO_GUARD = """\
import tandem
from tests.user_data import DigitPairs

result = tandem.fit("mlp", DigitPairs("train"), DigitPairs("test"), nproc=2, steps=2,
                    batch_size=32, out={out!r})
"""


@pytest.mark.cli
def test_fit_without_the_main_guard_stops_before_any_worker_starts(tmp_path: Path) -> None:
    """Was 80 lines ending in a PyTorch URL: every worker ran the script again, and its
    ``fit`` found the first one's ``--out`` taken."""
    script = tmp_path / "train.py"
    script.write_text(NO_GUARD.format(out=str(tmp_path / "run")))
    mark = uuid.uuid4().hex
    env = {**os.environ, **SOURCE, "OMP_NUM_THREADS": "1", MARK: mark}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            env=env, cwd=ROOT, timeout=120)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"tandem: error: {script} starts tandem's workers from its top level (line 4), and "
        f"every worker runs the script again as it starts; put that call under "
        f"if __name__ == \"__main__\":"]
    assert not job_processes(mark) and not (tmp_path / "run").exists()


@pytest.mark.pure
def test_the_guard_is_read_from_the_scripts_syntax() -> None:
    source = textwrap.dedent("""\
        import tandem                                   # 1
        tandem.fit(1)                                   # 2: unguarded
        if __name__ == "__main__":                      # 3
            tandem.fit(2)                               # 4: guarded
        else:                                           # 5
            tandem.fit(3)                               # 6: the workers run this
        try:                                            # 7
            if "__main__" == __name__:                  # 8
                main = lambda: tandem.fit(4)            # 9
                main()                                  # 10: guarded, inside a try
        finally:                                        # 11
            pass                                        # 12
        if __name__ != "__main__":                      # 13
            tandem.fit(5)                               # 14: not the guard
        """)
    body = ast.parse(source).body
    assert [line for line in range(1, 15) if _guarded(body, line)] == [4, 9, 10]


@pytest.mark.pure
def test_a_worker_ended_by_a_signal_is_named_as_killed(tmp_path: Path) -> None:
    """A worker that ``kill -TERM`` ended (was: ``worker rank 1 failed: Signal 15 (SIGTERM)
    received by PID N``), and one that ended before it could record why (was: ``... failed:
    To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html``)."""
    def failed(exitcode: int) -> str:
        failure = ProcessFailure(local_rank=1, pid=4321, exitcode=exitcode,
                                 error_file=str(tmp_path / "none.json"))
        return str(launch._failure(ChildFailedError("worker", {1: failure})))

    assert failed(-15) == "worker rank 1 died: killed by SIGTERM"
    assert failed(1) == "worker rank 1 failed with exit code 1 before it could say why"


@pytest.mark.pure
def test_fsdps_warning_about_the_models_output_is_filtered(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP2 warns of an in-place write into a unit's output that is a view; tandem hands the
    whole model's output to the loss and writes nothing into it (``--model gpt --shard 2``
    printed it once per worker). A unit inside a user's model keeps it: its own forward may."""
    import torch.distributed.fsdp as fsdp

    from tandem.sync.sharded import UnitSharder

    monkeypatch.setattr(fsdp, "fully_shard", lambda module, **options: None)
    text = ("FSDP2-wrapped module (FSDP{}) returned a view tensor. An in-place op on this view "
            "(e.g., `x += y`) will silently drop the pre-backward hook")
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        UnitSharder(nn.Sequential(nn.Linear(2, 2)), mesh=None, units=["0"], level=3,
                    param_dtype=None)("")
        for name in ("Sequential", "Linear"):
            warnings.warn(text.format(name), UserWarning)
    assert [str(warning.message) for warning in shown] == [text.format("Linear")]
