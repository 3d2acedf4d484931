"""``tandem plan`` end to end: table, JSON contract, and one-line errors with exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.plan import Plan, Stage, parse_config
from tests.conftest import PROFILES, VGG, run_cli

pytestmark = pytest.mark.pure

DATA = PROFILES


run = run_cli


def test_json_contract(capsys, tmp_path) -> None:
    target = tmp_path / "plan.json"
    code, out, err = run(capsys, "plan", "--profile", VGG, "--devices", "16", "--bandwidth",
                         "10Gb/s", "--json", "-o", str(target))
    assert code == 0
    lines = out.strip().splitlines()
    assert len(lines) == 1, "human output must not go to stdout with --json"
    data = json.loads(lines[0])
    for key in ("config", "stages", "bottleneck_s", "speedup_vs_single", "speedup_vs_dp", "solve_s"):
        assert key in data
    assert set(data["stages"][0]) >= {"start", "end", "replicas", "time_s"}
    assert data["config"] == "13-2-1"
    assert "simulated" in err and "estimated" in err
    plan = Plan.load(str(target))
    assert plan.config == data["config"] and plan.stages[-1].end == 40


def test_table_and_cluster_spec(capsys) -> None:
    code, out, _ = run(capsys, "plan", "--profile", str(DATA / "resnet50.graph.txt"),
                       "--cluster", "4x300GB/s,4x25Gb/s")
    assert code == 0
    assert "speedup" in out and "vs data parallel" in out
    table = out.splitlines()[next(i for i, line in enumerate(out.splitlines())
                                  if line.split()[:1] == ["candidate"]) + 1:]
    assert {"partition", "flat", "dp", "single"} <= {line.split()[0] for line in table}, out


def test_plan_that_trains_differently_says_so(capsys) -> None:
    """PipeDream's replicated stages average several minibatches per update: the speedups
    are not to the same model, and the output says so; a flush schedule's plan has no note."""
    argv = ("plan", "--profile", str(DATA / "vgg16.graph.txt"), "--devices", "8",
            "--bandwidth", "10Gb/s", "--no-activation-comm")
    code, out, _ = run(capsys, *argv, "--schedule", "pipedream")
    assert code == 0
    chosen = next(line for line in out.splitlines() if line.startswith("plan "))
    assert any(r > 1 for r in parse_config(chosen.split()[1].rstrip(":"))), out
    assert "note: a different training run" in out and "as many updates" in out
    code, out, _ = run(capsys, *argv)
    assert code == 0 and "note:" not in out


def test_plan_round_trip_and_text_form() -> None:
    plan = Plan(stages=[Stage(start=0, end=3, replicas=3), Stage(start=3, end=5, replicas=1)],
                num_layers=5, num_devices=4, bottleneck_s=1.0, single_s=3.0)
    assert plan.config == "3-1" and parse_config("3-1") == [3, 1]
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.to_dict() == plan.to_dict()
    assert again.speedup_vs_single == 3.0


def write(tmp_path, name: str, data: object) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def layer(**changes: object) -> dict:
    base = {"name": "l", "forward_s": 0.01, "backward_s": 0.02, "activation_bytes": 1e6,
            "parameter_bytes": 1e6}
    base.update(changes)
    return {k: v for k, v in base.items() if v is not None}


def profile_json(layers: list[dict], edges=None) -> dict:
    return {"schema_version": 1, "layers": layers, "edges": edges}


BAD_PROFILES = {
    "missing field": (profile_json([layer(backward_s=None)]), "missing field 'backward_s'"),
    "negative time": (profile_json([layer(), layer(forward_s=-1.0)]), "negative forward_s"),
    "cycle": (profile_json([layer(), layer(), layer()], [[0, 1], [1, 2], [2, 1]]), "cycle"),
}


@pytest.mark.parametrize("case", sorted(BAD_PROFILES))
def test_malformed_profile(capsys, tmp_path, case: str) -> None:
    data, words = BAD_PROFILES[case]
    path = write(tmp_path, "bad.json", data)
    code, out, err = run(capsys, "plan", "--profile", path, "--devices", "2", "--bandwidth", "1GB/s")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and words in err


def test_cycle_in_pipedream_graph(capsys, tmp_path) -> None:
    text = (VGG and Path(VGG).read_text()) + "\tnode41 -- node2\n"
    path = tmp_path / "cyclic.graph.txt"
    path.write_text(text)
    code, _, err = run(capsys, "plan", "--profile", str(path), "--devices", "2", "--bandwidth", "1GB/s")
    assert code == 2 and "cycle" in err and len(err.strip().splitlines()) == 1


def one_line_error(capsys, *argv: str) -> str:
    code, out, err = run(capsys, *argv)
    assert code == 2, err
    assert out == "" and len(err.strip().splitlines()) == 1
    return err


def test_more_stages_than_layers(capsys, tmp_path) -> None:
    path = write(tmp_path, "p.json", profile_json([layer(), layer(), layer()]))
    err = one_line_error(capsys, "plan", "--profile", path, "--devices", "5", "--bandwidth",
                         "10Gb/s", "--straight")
    assert "5 stages" in err and "3 layers" in err


def test_memory_limit_no_plan_fits(capsys) -> None:
    err = one_line_error(capsys, "plan", "--profile", VGG, "--devices", "4", "--bandwidth",
                         "10Gb/s", "--memory", "1MB")
    assert "no plan fits" in err and "1MB" not in err and "0.001 GB" in err


def test_zero_devices(capsys) -> None:
    err = one_line_error(capsys, "plan", "--profile", VGG, "--devices", "0", "--bandwidth", "10Gb/s")
    assert "--devices" in err


@pytest.mark.parametrize("value", ["10Gbit/s", "10gb/s", "10GB", "ten"])
def test_unknown_unit(capsys, value: str) -> None:
    err = one_line_error(capsys, "plan", "--profile", VGG, "--devices", "2", "--bandwidth", value)
    assert repr(value) in err and "Gb/s" in err


def test_unknown_unit_in_cluster_spec(capsys) -> None:
    err = one_line_error(capsys, "plan", "--profile", VGG, "--cluster", "8x300GiB/s,4x25Gb/s")
    assert "300GiB/s" in err
