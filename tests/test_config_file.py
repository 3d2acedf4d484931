"""``--config run.yaml``: a command's options from a YAML file, overridden by the command line,
and one-line errors with exit status 2 for every way the file can be wrong (issue 13)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from tandem.cli import CONFIG_COMMANDS
from tandem.commands.config_file import add_config_argument, expand_config
from tests.conftest import VGG, run_cli, run_json, run_tandem

PLAN = f"profile: {VGG}\ndevices: 16\nbandwidth: 10Gb/s\njson: true\n"


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.multiprocess
def test_train_takes_its_options_from_the_file(tmp_path) -> None:
    out = tmp_path / "run"
    config = write(tmp_path, f"model: mlp\ndata: digits\nstrategy: dp\nnproc: 2\nsteps: 2\n"
                             f"batch_size: 64\nlr: 0.05\nout: {out}\n")
    summary = run_json("train", "--config", config)
    assert (summary["strategy"], summary["model"], summary["data"]) == ("dp", "mlp", "digits")
    assert (summary["world_size"], summary["steps"], summary["global_batch_size"]) == (2, 2, 64)
    run = json.loads((out / "config.json").read_text())["run"]
    assert (run["steps"], run["batch_size"], run["lr"]) == (2, 64, 0.05)


@pytest.mark.multiprocess
def test_the_command_line_overrides_the_file(tmp_path) -> None:
    out = tmp_path / "run"
    config = write(tmp_path, f"model: mlp\ndata: digits\nsteps: 5\nbatch-size: 32\nlr: 0.05\n"
                             f"out: {tmp_path / 'elsewhere'}\n")
    summary = run_json("train", "--steps", "2", "--config", config, "--lr", "0.1",
                       "--out", str(out))
    assert summary["steps"] == 2
    run = json.loads((out / "config.json").read_text())["run"]
    assert (run["steps"], run["batch_size"], run["lr"]) == (2, 32, 0.1)
    assert not (tmp_path / "elsewhere").exists()


@pytest.mark.pure
def test_plan_takes_its_options_from_the_file(capsys, tmp_path) -> None:
    code, out, _ = run_cli(capsys, "plan", "--config", write(tmp_path, PLAN))
    assert code == 0
    assert json.loads(out)["config"] == "13-2-1"  # as test_plan_cli's run with these flags
    code, out, _ = run_cli(capsys, "plan", "--config", write(tmp_path, PLAN), "--devices", "4")
    _, direct, _ = run_cli(capsys, "plan", "--profile", VGG, "--devices", "4", "--bandwidth",
                           "10Gb/s", "--json")
    assert code == 0 and json.loads(out)["config"] == json.loads(direct)["config"]


@pytest.mark.pure
def test_a_command_line_alternative_overrides_the_file(capsys, tmp_path) -> None:
    """--profile and --model exclude each other: --model on the command line drops the file's
    --profile instead of clashing with it."""
    config = write(tmp_path, PLAN + "straight: true\n")
    code, _, err = run_cli(capsys, "plan", "--config", config, "--model", "mlp", "--data", "digits")
    assert code == 2 and "the model has only 4 layers" in err  # the mlp was planned, not VGG


TRAIN_ERRORS = {
    "unknown key": ("steps: 2\nbach-size: 3\n",
                    "run.yaml:2: 'bach-size' is not an option of tandem train; did you mean "
                    "'batch-size'?"),
    "nested config": ("config: other.yaml\n",
                      "run.yaml:1: a config file cannot name another one (no nesting)"),
    "not YAML": ("steps: 2\nbatch-size 64\nlr: 0.1\n",
                 "is not valid YAML: line 3: could not find expected ':' (while scanning a "
                 "simple key at line 2); fix the file"),
    "a list at the top": ("- steps\n- 2\n", "holds a list; it must hold one 'option: value' "
                                            "per line"),
    "a value at the top": ("steps\n", "holds a single value; it must hold one 'option: value'"),
    "list for a number": ("steps: [1, 2]\n",
                          "run.yaml:1: 'steps' is a list, but --steps takes one value; give a "
                          "whole number"),
    "mapping for a value": ("model: {name: mlp}\n",
                            "'model' is a mapping, but --model takes one value"),
    "string for a number": ("steps: two\n",
                            "run.yaml:1: steps: invalid int value: 'two'; give a whole number"),
    "fraction for a whole number": ("steps: 2.5\n", "steps: invalid int value: '2.5'"),
    "string for a float": ("lr: fast\n", "lr: invalid float value: 'fast'; give a number"),
    "yes/no for a value": ("compress: off\n",
                           "YAML reads compress: off as false, but --compress takes a value; "
                           "write compress: \"off\" for the word"),
    "word for a switch": ("json: maybe\n",
                          "--json is a switch; give json: true or json: false (got 'maybe')"),
    "no value": ("steps:\n", "run.yaml:1: 'steps' has no value; give one or remove the line"),
    "key twice": ("steps: 1\nsteps: 2\n", "run.yaml:2: 'steps' repeats 'steps' of line 1"),
    "two spellings": ("batch_size: 1\nbatch-size: 2\n",
                      "run.yaml:2: 'batch-size' repeats 'batch_size' of line 1; keep one"),
}


def one_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run ``tandem ARGV`` in this process; the one line it wrote on stderr, with status 2."""
    try:
        code, out, err = run_cli(capsys, *argv)
    except SystemExit as exc:  # argparse's own errors
        captured = capsys.readouterr()
        code, out, err = exc.code, captured.out, captured.err
    assert code == 2, err
    assert out == "" and len(err.splitlines()) == 1, err
    return err


@pytest.mark.pure
@pytest.mark.parametrize("case", TRAIN_ERRORS)
def test_a_wrong_file_is_one_line_and_status_2(capsys, tmp_path, case: str) -> None:
    text, message = TRAIN_ERRORS[case]
    err = one_error(capsys, "train", "--config", write(tmp_path, text))
    assert err.startswith("tandem train: error: ") and message in err


@pytest.mark.pure
def test_a_file_that_cannot_be_read(capsys, tmp_path) -> None:
    missing = str(tmp_path / "nope.yaml")
    assert f"--config {missing}: no such file; check the path" in one_error(
        capsys, "train", "--config", missing)
    assert f"--config {tmp_path} is a directory; give a YAML file" in one_error(
        capsys, "train", "--config", str(tmp_path))
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"steps: \xff\xfe\n")
    assert "is not UTF-8 text" in one_error(capsys, "train", "--config", str(binary))
    assert "--config is given 2 times; give one file" in one_error(
        capsys, "train", "--config", str(binary), "--config", str(binary))


@pytest.mark.pure
@pytest.mark.skipif(os.geteuid() == 0, reason="root can read anything")
def test_a_file_without_read_permission(capsys, tmp_path) -> None:
    locked = Path(write(tmp_path, "steps: 2\n"))
    locked.chmod(0)
    assert f"cannot read --config {locked}: Permission denied; check its permissions" in \
        one_error(capsys, "train", "--config", str(locked))


@pytest.mark.pure
def test_plan_errors(capsys, tmp_path) -> None:
    err = one_error(capsys, "plan", "--config", write(tmp_path, PLAN + "model: vgg\n"))
    assert "run.yaml:5: 'model' and 'profile' (line 1) exclude each other; keep one" in err
    err = one_error(capsys, "plan", "--config", write(tmp_path, PLAN + "schedule: zigzag\n"))
    assert "run.yaml:5: schedule: invalid choice: 'zigzag' (choose from" in err


@pytest.mark.pure
@pytest.mark.parametrize("command", CONFIG_COMMANDS)
def test_every_command_that_trains_or_plans_reads_a_file(capsys, tmp_path, command) -> None:
    err = one_error(capsys, command, "--config", write(tmp_path, "jsn: true\n"))
    assert f"'jsn' is not an option of tandem {command}; did you mean 'json'?" in err


@pytest.mark.cli
def test_the_real_process_exits_2_with_one_line(tmp_path) -> None:
    done = run_tandem("train", "--config", write(tmp_path, "lr: [0.1]\n"))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"tandem train: error: {tmp_path / 'run.yaml'}:1: 'lr' is a list, but --lr takes one "
        f"value; give a number"]


def switches() -> argparse.ArgumentParser:
    """A parser with every kind of switch argparse has (tandem's own are all off by default)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--fast", action="store_true", default=True)
    parser.add_argument("--no-progress", action="store_false", dest="progress")
    parser.add_argument("--color", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--resume", nargs="?", const="auto")
    add_config_argument(parser)
    return parser


@pytest.mark.pure
@pytest.mark.parametrize("text, expected", [
    ("fast: false\n", dict(fast=False, progress=True, color=True, resume=None)),
    ("fast: true\nno_progress: true\n", dict(fast=True, progress=False, color=True, resume=None)),
    ("no-progress: false\ncolor: false\n",
     dict(fast=True, progress=True, color=False, resume=None)),
    ("no-color: true\nresume: true\n", dict(fast=True, progress=True, color=False, resume="auto")),
    ("resume: -old.pt\n", dict(fast=True, progress=True, color=True, resume="-old.pt")),
])
def test_switches_take_true_and_false(tmp_path, text: str, expected: dict) -> None:
    parser = switches()
    argv = expand_config(parser, ["--config", write(tmp_path, text)])
    args = vars(parser.parse_args(argv))
    assert {key: args[key] for key in expected} == expected


@pytest.mark.pure
def test_a_switch_on_the_command_line_beats_false_in_the_file(tmp_path) -> None:
    parser = switches()
    argv = expand_config(parser, ["--config", write(tmp_path, "color: false\n"), "--color"])
    assert parser.parse_args(argv).color is True
