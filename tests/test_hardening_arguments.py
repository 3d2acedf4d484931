"""Arguments are checked wherever they come from: ``--config -`` reads standard input (or is
refused on a terminal), a file's value is checked even where a flag overrides it, and a range
error names the file and line."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from tests.conftest import run_cli, run_json


# -- --config ----------------------------------------------------------------------------------


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.multiprocess
def test_config_dash_reads_standard_input(monkeypatch: pytest.MonkeyPatch) -> None:
    """Was: ``-`` was taken for no file at all, and a default run of 100 steps trained."""
    monkeypatch.setattr("sys.stdin", io.StringIO("steps: 3\nbatch-size: 32\nlr: 0.1\n"))
    summary = run_json("train", "--config", "-")
    assert summary["steps"] == 3 and summary["global_batch_size"] == 32 and summary["lr"] == 0.1


@pytest.mark.pure
def test_config_dash_errors_name_standard_input(capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdin", Terminal())
    code, _, err = run_cli(capsys, "train", "--config", "-")
    assert code == 2 and err == (
        "tandem train: error: --config - reads the options from standard input, which is a "
        "terminal here; pipe them in (tandem train --config - < run.yaml) or give the file's "
        "path\n")
    monkeypatch.setattr("sys.stdin", io.StringIO("steps: 2\nmomentum: 2\n"))
    code, _, err = run_cli(capsys, "train", "--config=-")
    assert code == 2 and err == ("tandem train: error: <stdin>:2: --momentum must be in [0, 1) "
                                 "(got 2.0); e.g. --momentum 0.9, or 0 for none\n")


@pytest.mark.pure
def test_a_files_value_is_checked_where_a_flag_overrides_it(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("steps: 3\nlr: fast\nbatch-size: -4\n")
    code, _, err = run_cli(capsys, "train", "--config", str(config), "--lr", "0.1")
    assert code == 2 and err == (f"tandem train: error: {config}:2: lr: invalid float value: "
                                 f"'fast'; give a number\n")
    config.write_text("steps: 3\nbatch-size: -4\n")  # a range: found once the options are parsed
    code, _, err = run_cli(capsys, "train", "--config", str(config))
    assert code == 2 and err == (f"tandem train: error: {config}:2: --batch-size must be at "
                                 f"least 1 (got -4)\n")
