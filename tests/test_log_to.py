"""``--log-to jsonl,csv,tensorboard``: the metrics lines in the logs users read — TensorBoard's
reader loads the loss of every step, the CSV holds the JSON lines row for row (a resumed run
appends under the same header), and a log that cannot be written is one line before launch."""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

import tandem
from tandem.errors import UsageError
from tandem.runtime.config import TENSORBOARD_MISSING, RunConfig
from tandem.runtime.log_sinks import CsvSink, TensorBoardSink
from tandem.runtime.reporting import Reporter
from tests.conftest import run_here, run_json


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard's own reader finds in ``folder``: tag -> [(step, value)]."""
    accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator").EventAccumulator
    events = accumulator(str(folder))
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def jsonl(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# -- the sinks, in this process -----------------------------------------------------------------


@pytest.mark.pure
def test_csv_widens_its_header_and_a_resumed_run_appends_under_it(tmp_path: Path) -> None:
    sink = CsvSink(tmp_path)
    sink.write({"loss": 2.5, "step": 1, "noise_scale": None}, "train")
    sink.write({"step": 1, "test_loss": 2.25, "note": "a, b"}, "eval")  # new columns
    sink.close()
    resumed = CsvSink(tmp_path)  # --resume: the header is read back
    resumed.write({"loss": 0.1 + 0.2, "step": 2, "noise_scale": math.nan}, "train")
    resumed.close()
    assert (tmp_path / "metrics.csv").read_text().splitlines() == [
        'step,loss,noise_scale,test_loss,note',
        '1,2.5,,,',
        '1,,,2.25,"a, b"',
        '2,0.30000000000000004,nan,,',
    ]


@pytest.mark.pure
def test_tensorboard_gets_every_number_of_a_line_under_its_section(tmp_path: Path) -> None:
    """Non-numbers (None, text, a bool) are left out; an evaluation's fields, whatever their
    names, go under ``eval/``."""
    pytest.importorskip("tensorboard")
    reporter = Reporter(enabled=True, show_progress=False, out=tmp_path,
                        log_to="tensorboard,csv,jsonl", total_steps=2, first_step=0)
    with pytest.raises(RuntimeError, match="a worker failed"), reporter:
        reporter.record(loss=2.5, step=1, lr=0.1, batch_size=64, noise_scale=None, mode="x",
                        skipped=True)
        reporter.evaluated(2, {"test_loss": 2.25, "test_accuracy": 0.5, "test_f1": 0.25})
        raise RuntimeError("a worker failed")  # the logs are flushed and closed all the same
    assert scalars(tmp_path / "tensorboard") == {
        "train/loss": [(1, 2.5)], "train/lr": [(1, pytest.approx(0.1))],
        "train/batch_size": [(1, 64.0)], "eval/test_loss": [(2, 2.25)],
        "eval/test_accuracy": [(2, 0.5)], "eval/test_f1": [(2, 0.25)]}
    assert reporter.summary() == {"logs": {
        "jsonl": str(tmp_path / "metrics.jsonl"), "csv": str(tmp_path / "metrics.csv"),
        "tensorboard": str(tmp_path / "tensorboard")}}
    assert [line["step"] for line in jsonl(tmp_path)] == [1, 2]


# -- one line before launch -------------------------------------------------------------------


@pytest.mark.pure
def test_an_unknown_log_or_one_without_out_is_one_line(tmp_path: Path) -> None:
    for argv, expected in [
        (["--log-to", "tensorboard,wandb"], "--log-to 'wandb' is not one of: jsonl, csv, "
         "tensorboard (a comma list, e.g. --log-to tensorboard,jsonl)"),
        (["--log-to", ","], "--log-to ',' names no log; give a comma list of jsonl, csv, "
         "tensorboard, e.g. --log-to tensorboard,jsonl"),
        # without --out a run gets runs/<date>_<time>, except a --resume of a given path
        (["--log-to", "jsonl,csv", "--resume", "x.pt"], "--log-to csv writes its logs into the "
         "run's --out directory, and none is given; add --out DIR (e.g. --out runs/a)"),
    ]:
        result = run_here("train", *argv)
        assert (result.returncode, result.stderr.splitlines()) == (
            2, [f"tandem train: error: {expected}"])
    with pytest.raises(UsageError, match=r"fit\(log_to='tensorboard'\) writes its logs into "
                       r"out, and none is given"):
        tandem.fit("mlp", data="digits", log_to=["tensorboard"])
    assert RunConfig(log_to=["tensorboard", "jsonl", "csv"], out=str(tmp_path)).log_to == \
        "jsonl,csv,tensorboard"


@pytest.mark.pure
def test_tensorboard_missing_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("tensorboard", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed
    result = run_here("train", "--log-to", "tensorboard", "--out", str(tmp_path))
    assert (result.returncode, result.stderr.splitlines()) == (
        2, [f"tandem train: error: {TENSORBOARD_MISSING}"])
    assert TENSORBOARD_MISSING == ("--log-to tensorboard needs the tensorboard package: pip "
                                   "install tensorboard (or pip install -e .[tensorboard])")
    assert list(tmp_path.iterdir()) == []  # refused before anything was written
    with pytest.raises(UsageError, match="needs the tensorboard package"):  # a torchrun worker
        TensorBoardSink(tmp_path, first_step=0)


# -- end to end -------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_tensorboard_and_csv_hold_the_jsonl_lines(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    summary = run_json("train", "--model", "mlp", "--data", "digits", "--steps", "6",
                       "--log-every", "1", "--log-to", "tensorboard,csv,jsonl",
                       "--out", str(tmp_path))
    lines = jsonl(tmp_path)
    steps = [line for line in lines if "loss" in line]
    assert [line["step"] for line in steps] == [1, 2, 3, 4, 5, 6]
    assert {"lr", "samples_per_s", "rss_bytes", "data_wait_fraction"} <= set(steps[0])
    found = scalars(tmp_path / "tensorboard")
    assert [step for step, _ in found["train/loss"]] == [1, 2, 3, 4, 5, 6]
    for (_, value), line in zip(found["train/loss"], steps):
        assert abs(value - line["loss"]) <= 1e-6
    assert found["eval/test_loss"] == [(6, pytest.approx(lines[-1]["test_loss"], abs=1e-6))]
    with (tmp_path / "metrics.csv").open(newline="") as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == len(lines)
    for row, line in zip(rows, lines):
        assert {key for key, cell in row.items() if cell} == set(line)
        assert {key: float(row[key]) for key in line} == line
    assert summary["logs"] == {name: str(tmp_path / path) for name, path in [
        ("jsonl", "metrics.jsonl"), ("csv", "metrics.csv"), ("tensorboard", "tensorboard")]}
