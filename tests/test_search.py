"""Strategy search: never slower than data parallelism or the partitioner's plan, memory as a
constraint, repeatable with a seed, and ``tandem search`` end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.cluster import flat_cluster, parse_cluster
from tandem.planning import make_plan, partition_plan
from tandem.planning.search.flexflow import SearchOptions, search
from tandem.planning.simulate.simulator import SimOptions, simulate
from tandem.profile import load_profile
from tests.conftest import PROFILES, run_cli

pytestmark = pytest.mark.pure

DATA = PROFILES
PROFILES = {name: load_profile(str(DATA / f"{name}.graph.txt")) for name in ("vgg16", "gnmt")}
QUICK = SearchOptions(budget_s=60, max_iterations=60, seed=0)


@pytest.mark.parametrize("devices", [4, 8, 16])
@pytest.mark.parametrize("name", ["vgg16", "gnmt"])
def test_at_least_as_fast_as_partitioner_and_data_parallelism(name: str, devices: int) -> None:
    profile = PROFILES[name]
    cluster = flat_cluster(num_devices=devices, bandwidth="10Gb/s")
    partitioner = make_plan(profile, cluster)
    found = search(profile, cluster, QUICK, partitioner_plan=partitioner)
    best = found.best.result.step_time_s
    assert found.partitioner is not None and found.data_parallel is not None
    assert best <= found.partitioner.result.step_time_s
    assert best <= found.data_parallel.result.step_time_s
    # The reported time is what simulating the returned plan gives.
    assert simulate(found.best.plan, profile, cluster).step_time_s == pytest.approx(best)


def test_memory_is_a_constraint() -> None:
    # PipeDream's schedule on the partitioner's VGG-16 plan keeps whole minibatches of
    # activations in flight (tens of GB per device). Started from that plan on 16 GB devices,
    # the search must return a plan that fits, slower than the one that does not.
    profile = PROFILES["vgg16"]
    limited = flat_cluster(num_devices=8, bandwidth="10Gb/s", memory="16GB")
    partitioner = partition_plan(profile, flat_cluster(num_devices=8, bandwidth="10Gb/s"))
    partitioner = partitioner.rescheduled("pipedream")
    too_big = simulate(partitioner, profile, limited)
    assert not too_big.fits_memory and too_big.peak_memory_bytes > 16e9
    found = search(profile, limited, QUICK, partitioner_plan=partitioner)
    assert found.best.result.fits_memory and found.best.result.peak_memory_bytes <= 16e9
    assert found.best.result.step_time_s > too_big.step_time_s


def test_repeatable_with_a_seed() -> None:
    profile, cluster = PROFILES["gnmt"], flat_cluster(num_devices=8, bandwidth="25Gb/s")
    first, second = (search(profile, cluster, QUICK) for _ in range(2))
    assert first.best.plan.to_dict() == second.best.plan.to_dict()


def test_schedules_can_be_restricted() -> None:
    found = search(PROFILES["gnmt"], flat_cluster(num_devices=4, bandwidth="10Gb/s"),
                   SearchOptions(max_iterations=40, schedules=("gpipe", "1f1b")))
    assert found.best.plan.schedule in ("gpipe", "1f1b")


def test_micro_batches_divide_a_known_batch() -> None:
    found = search(PROFILES["vgg16"], flat_cluster(num_devices=4, bandwidth="10Gb/s"),
                   SearchOptions(max_iterations=80, schedules=("1f1b",), batch_samples=96),
                   SimOptions())
    assert 96 % found.best.result.num_microbatches == 0


run = run_cli


def test_cli_json_and_best_plan_file(capsys, tmp_path: Path) -> None:
    target = tmp_path / "best.json"
    code, out, err = run(capsys, "search", "--profile", str(DATA / "vgg16.graph.txt"),
                         "--cluster", "pipedream-b", "--iterations", "40", "--json",
                         "-o", str(target))
    assert code == 0, err
    data = json.loads(out)
    assert data["step_time_s"] <= data["data_parallel_step_time_s"]
    assert data["speedup_vs_data_parallel"] >= 1 and data["best"]["result"]["fits_memory"]
    assert "vs data parallelism" in err and "vs the partitioner's plan" in err
    code, out, _ = run(capsys, "simulate", "--plan", str(target), "--profile",
                       str(DATA / "vgg16.graph.txt"), "--cluster", "pipedream-b", "--json")
    assert json.loads(out)["step_time_s"] == pytest.approx(data["step_time_s"])


@pytest.mark.parametrize(("argv", "words"), [
    (["--budget", "soon"], "--budget"),
    (["--schedules", "zigzag"], "zigzag"),
    (["--memory", "1MB", "--iterations", "5"], "no plan fits"),
])
def test_cli_errors(capsys, argv: list[str], words: str) -> None:
    code, out, err = run(capsys, "search", "--profile", str(DATA / "gnmt.graph.txt"),
                         "--devices", "4", "--bandwidth", "10Gb/s", *argv)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert words in err


def test_hierarchical_cluster() -> None:
    profile = PROFILES["vgg16"]
    cluster = parse_cluster("4x16GB/s,4x10Gb/s")
    found = search(profile, cluster, QUICK, partitioner_plan=make_plan(profile, cluster))
    assert found.best.result.step_time_s <= found.data_parallel.result.step_time_s
