"""Arguments are checked wherever they come from: ``--config -`` reads standard input (or is
refused on a terminal), a file's value is checked even where a flag overrides it, and a range
error names the file and line; ``tandem.fit`` checks its arguments as the command line does."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pytest

import tandem
from tandem.errors import UsageError

from tests.conftest import run_cli, run_json


# -- --config ----------------------------------------------------------------------------------


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.multiprocess
def test_config_dash_reads_standard_input(monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    """Was: ``-`` was taken for no file at all, and a default run of 100 steps trained."""
    monkeypatch.setattr("sys.stdin", io.StringIO("steps: 3\nbatch-size: 32\nlr: 0.1\n"))
    summary = run_json("train", "--config", "-", "--out", str(tmp_path))
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


# -- tandem.fit ------------------------------------------------------------------------------


FIT_MISTAKES: dict[str, tuple[dict[str, Any], str]] = {
    "nproc 0": ({"nproc": 0}, "--nproc must be at least 1 (got 0)"),
    "steps as text": ({"steps": "10"}, "steps='10' is a str, but steps takes a whole number, as "
                                       "--steps does; e.g. steps=10"),
    "lr as text": ({"lr": "0.1"}, "lr='0.1' is a str, but lr takes a number, as --lr does; "
                                  "e.g. lr=0.1"),
    "seed as float": ({"seed": 1.5}, "seed=1.5 is a float, but seed takes a whole number"),
    "momentum None": ({"momentum": None}, "momentum=None is None, but momentum takes a number"),
    "batch as bool": ({"batch_size": True}, "batch_size=True is a bool, but batch_size takes a "
                                            "whole number"),
    "overwrite as text": ({"overwrite": "no"}, "overwrite='no' is a str, but overwrite takes "
                                               "True or False"),
    "out as number": ({"out": 3}, "out=3 is an int, but out takes a path or None"),
    "servers as text": ({"strategy": "ps", "servers": "2", "nproc": 3},
                        "servers='2' is a str, but servers takes a whole number, as --servers "
                        "does; e.g. servers=2"),
    "compress as number": ({"compress": 3}, "compress=3 is an int, but compress takes a string"),
    "strategy as list": ({"strategy": ["dp"]}, "strategy=['dp'] is a list, but strategy takes a "
                                               "string or None"),
}
"""Each was a raw TypeError or AttributeError from inside tandem (nproc=0 ran one worker)."""


@pytest.mark.pure
@pytest.mark.parametrize("case", sorted(FIT_MISTAKES))
def test_fit_checks_its_arguments_as_the_command_line(case: str) -> None:
    options, message = FIT_MISTAKES[case]
    options = {"steps": 2, "batch_size": 32, **options}
    with pytest.raises(UsageError) as error:
        tandem.fit("mlp", data="digits", **options)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.pure
def test_fits_plan_option_types_are_the_command_lines() -> None:
    """``PLAN_FLAG_KINDS`` (what ``fit`` checks a plan option against) says what ``tandem
    train``'s parser makes of each plan flag."""
    import argparse

    from tandem.commands.train import add_train_arguments
    from tandem.runtime.config import RunConfig
    from tandem.strategy import PLAN_FLAG_KINDS, PLAN_FLAGS

    parser = argparse.ArgumentParser()
    add_train_arguments(parser, RunConfig())
    parsed = {}
    for flag in dict.fromkeys(PLAN_FLAGS):
        action = parser._option_string_actions[flag]  # noqa: SLF001
        parsed[flag] = ("bool" if action.nargs == 0 else "int" if action.type is int
                        else "float" if action.type is float else "str")
    free = {"--tensor-layers", "--shard-units"}
    assert PLAN_FLAG_KINDS == {flag: kind for flag, kind in parsed.items() if flag not in free}


@pytest.mark.pure
def test_fit_takes_numpy_numbers_and_paths(tmp_path: Path) -> None:
    """Plain numbers of other types and ``os.PathLike`` paths are what they say."""
    from tandem.runtime.config import RunConfig

    numpy = pytest.importorskip("numpy")
    run = RunConfig(steps=numpy.int64(3), lr=numpy.float32(0.5), out=tmp_path, seed=1)
    assert (run.steps, run.out) == (3, os.fspath(tmp_path)) and type(run.steps) is int
    assert type(run.lr) is float and run.lr == 0.5
