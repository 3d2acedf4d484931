"""``tandem simulate`` end to end: JSON contract, trace and Gantt chart, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.plan import Plan, Stage
from tandem.timeline import Timeline
from tests.conftest import PROFILES, VGG, run_cli

pytestmark = pytest.mark.pure

DATA = PROFILES


run = run_cli


def one_line_error(capsys, *argv: str) -> str:
    code, out, err = run(capsys, *argv)
    assert code == 2, err
    assert out == "" and len(err.strip().splitlines()) == 1, err
    return err


def write_plan(tmp_path: Path, bounds: list[tuple[int, int, int]], num_layers: int,
               num_devices: int, schedule: str = "1f1b") -> str:
    plan = Plan(stages=[Stage(start=s, end=e, replicas=r) for s, e, r in bounds],
                num_layers=num_layers, num_devices=num_devices, schedule=schedule)
    path = tmp_path / "plan.json"
    plan.save(str(path))
    return str(path)


def test_json_trace_and_gantt(capsys, tmp_path: Path) -> None:
    plan = write_plan(tmp_path, [(0, 20, 2), (20, 40, 2)], 40, 4)
    trace, gantt = tmp_path / "t.json", tmp_path / "g.png"
    code, out, err = run(capsys, "simulate", "--plan", plan, "--profile", VGG, "--devices", "4",
                         "--bandwidth", "25Gb/s", "--json", "--trace", str(trace),
                         "--gantt", str(gantt))
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1, "human output must not go to stdout with --json"
    data = json.loads(lines[0])
    assert data["config"] == "2-2" and data["schedule"] == "1f1b"
    assert data["step_time_s"] > 0 and 0 <= data["bubble_fraction"] < 1
    assert len(data["workers"]) == 4 and data["workers"][3]["stage"] == 1
    assert "step" in err and "peak memory" in err
    timeline = Timeline.from_json(json.loads(trace.read_text()))
    assert timeline.source == "simulator" and timeline.num_workers == 4
    assert {"0F0", "0B0", "1RA0<0", "0AR", "0ST"} <= {e.name for e in timeline.events}
    assert gantt.read_bytes()[:4] == b"\x89PNG"


def test_data_parallel_and_schedule_override(capsys) -> None:
    code, out, _ = run(capsys, "simulate", "--plan", "dp", "--profile", VGG, "--cluster",
                       "pipedream-b", "--json")
    dp = json.loads(out)
    assert code == 0 and dp["config"] == "16" and dp["fits_memory"]
    code, out, _ = run(capsys, "simulate", "--plan", "dp", "--profile", VGG, "--cluster",
                       "pipedream-b", "--json", "--compression", "4")
    assert json.loads(out)["step_time_s"] < dp["step_time_s"]


def test_batch_size_needs_the_profiled_batch(capsys) -> None:
    err = one_line_error(capsys, "simulate", "--plan", "dp", "--profile", VGG, "--devices", "2",
                         "--bandwidth", "10Gb/s", "--batch-size", "256")
    assert "--profile-batch" in err
    code, out, _ = run(capsys, "simulate", "--plan", "dp", "--profile", VGG, "--devices", "2",
                       "--bandwidth", "10Gb/s", "--batch-size", "256", "--profile-batch", "128",
                       "--json")
    result = json.loads(out)
    assert code == 0 and result["samples_per_s"] == 256 / result["step_time_s"]


def test_plan_layers_out_of_bounds(capsys, tmp_path: Path) -> None:
    plan = write_plan(tmp_path, [(0, 30, 1), (30, 46, 1)], 46, 2)
    err = one_line_error(capsys, "simulate", "--plan", plan, "--profile", VGG, "--devices", "2",
                         "--bandwidth", "10Gb/s")
    assert "0..45" in err and "40 layers" in err


def test_more_workers_than_devices(capsys, tmp_path: Path) -> None:
    plan = write_plan(tmp_path, [(0, 20, 6), (20, 40, 2)], 40, 8)
    err = one_line_error(capsys, "simulate", "--plan", plan, "--profile", VGG, "--devices", "4",
                         "--bandwidth", "10Gb/s")
    assert "8 workers" in err and "4 devices" in err


@pytest.mark.parametrize(("argv", "words"), [
    (["--microbatches", "0"], "--microbatches"),
    (["--schedule", "1f1b", "--microbatches", "1"], "at least as many micro-batches"),
    (["--allreduce", "ring", "--compression", "0"], "compression"),
])
def test_bad_options(capsys, tmp_path: Path, argv: list[str], words: str) -> None:
    plan = write_plan(tmp_path, [(0, 20, 1), (20, 40, 1)], 40, 2)
    err = one_line_error(capsys, "simulate", "--plan", plan, "--profile", VGG, "--devices", "2",
                         "--bandwidth", "10Gb/s", *argv)
    assert words in err
