"""PipeDream's schedule is rated by its steady state, the fill apart (issue 28), and plans too
large to replay are rated in closed form, in time linear in their stages."""

from __future__ import annotations

import math
import time

import pytest

from tandem.cluster import flat_cluster
from tandem.plan import Plan, Stage
from tandem.planning import PartitionOptions, partition_plan
from tandem.planning.simulate.costs import stage_costs
from tandem.planning.simulate.replay import replay
from tandem.planning.simulate.simulator import (SimOptions, build_workload, simulate,
                                                steady_state)
from tandem.profile import LayerProfile, ModelProfile, load_profile
from tests.conftest import PROFILES, run_cli

pytestmark = pytest.mark.pure

VGG = load_profile(str(PROFILES / "vgg16.graph.txt"))
GNMT = load_profile(str(PROFILES / "gnmt.graph.txt"))
QUIET = SimOptions(record=False, activation_comm=False)
"""No activation transfers (PipeDream's optimizer's default model)."""


def _stage_compute_s(plan: Plan, profile: ModelProfile, stage: int) -> float:
    return sum(profile.layers[i].compute_s for i in plan.stage_layers(stage))


@pytest.mark.parametrize(("profile", "devices"), [(VGG, 4), (GNMT, 4), (GNMT, 8)])
def test_a_straight_pipeline_runs_at_its_slowest_stage(profile: ModelProfile,
                                                       devices: int) -> None:
    """Without communication, PipeDream's steady state is the partitioner's bottleneck: the
    slowest stage's forward and backward per minibatch; the fill comes on top."""
    cluster = flat_cluster(num_devices=devices, bandwidth="10Gb/s")
    plan = partition_plan(profile, cluster, PartitionOptions(activation_compression=None,
                                                             straight=True))
    plan = plan.rescheduled("pipedream")
    assert set(plan.replicas) == {1} and len(plan.stages) == devices
    result = simulate(plan, profile, cluster, QUIET)
    slowest = max(_stage_compute_s(plan, profile, s) for s in range(len(plan.stages)))
    assert result.step_time_s == pytest.approx(slowest, rel=1e-9)
    assert result.step_time_s == pytest.approx(plan.bottleneck_s, rel=1e-9)
    assert result.fill_s > 0
    # a run of N minibatches: the fill, then N periods; the fill is less than one trip
    trip = sum(_stage_compute_s(plan, profile, s) for s in range(len(plan.stages)))
    assert result.fill_s < trip


def test_a_replicated_stage_waits_for_a_round_trip_once_per_round() -> None:
    """VGG-16's 4-2-1-1 (PipeDream's 93.4 ms on 8 devices): stage 0's four replicas allreduce
    after every minibatch, so they run a round of four in lockstep, and with two minibatches in
    flight each, the last backward of a round waits for the first forward of the round after
    next to reach stage 2 and its gradient to come back: a round lasts stage 0's, 1's and 2's
    forward and backward, its allreduce and its step, not four times 93.4 ms."""
    cluster = flat_cluster(num_devices=8, bandwidth="10Gb/s")
    plan = partition_plan(VGG, cluster, PartitionOptions(activation_compression=None))
    plan = plan.rescheduled("pipedream")
    assert plan.config == "4-2-1-1" and plan.bottleneck_s == pytest.approx(0.093357134)
    result = simulate(plan, VGG, cluster, QUIET)
    workload = build_workload(plan, stage_costs(plan, VGG), cluster, QUIET)
    trip = sum(workload.forward_s[s] + workload.backward_s[s] for s in range(3))
    round_s = trip + workload.allreduce_s[0] + workload.step_s[0]
    assert result.step_time_s == pytest.approx(round_s / 4, rel=1e-9)
    assert result.step_time_s > 1.6 * plan.bottleneck_s
    # the closed form knows the round trip: it gives the replay's period
    closed = simulate(plan, VGG, cluster, SimOptions(record=False, activation_comm=False,
                                                     max_replay_actions=0))
    assert closed.step_time_s == pytest.approx(result.step_time_s, rel=1e-9)


@pytest.mark.parametrize("config", [[1, 1, 1, 1], [2, 1, 1], [3, 2, 1]])
def test_twice_the_minibatches_give_the_same_period(config: list[int]) -> None:
    """The period is the schedule's, not the length of the run replayed."""
    num_layers = VGG.num_layers
    bounds = [0, *[round(num_layers * (i + 1) / len(config)) for i in range(len(config))]]
    plan = Plan(stages=[Stage(start=a, end=b, replicas=r)
                        for a, b, r in zip(bounds, bounds[1:], config)],
                num_layers=num_layers, num_devices=sum(config), schedule="pipedream",
                num_microbatches=1)
    cluster = flat_cluster(num_devices=plan.num_devices, bandwidth="10Gb/s")
    options = SimOptions(record=False)
    workload = build_workload(plan, stage_costs(plan, VGG), cluster, options)
    rounds = math.lcm(*config)
    periods, fills = [], []
    for length in (60, 120):
        run = replay(plan.build_schedule(length), workload, cluster, record=False)
        period, fill, window = steady_state(run.done_s, length, rounds)
        periods.append(period)
        fills.append(fill)
        assert window[0] >= length // 3 - rounds and window[-1] < 2 * length // 3
    assert periods[1] == pytest.approx(periods[0], rel=1e-9)
    assert fills[1] == pytest.approx(fills[0], rel=1e-6)
    assert fills[0] > 0


def test_flush_schedules_have_no_fill_apart() -> None:
    cluster = flat_cluster(num_devices=4, bandwidth="10Gb/s")
    plan = partition_plan(VGG, cluster, PartitionOptions(straight=True))
    for schedule in ("1f1b", "gpipe"):
        result = simulate(plan.rescheduled(schedule, 8), VGG, cluster, SimOptions(record=False))
        assert result.fill_s == 0.0 and result.step_time_s > 0


def test_simulate_prints_the_steady_state_and_the_fill(capsys, tmp_path) -> None:
    cluster = flat_cluster(num_devices=4, bandwidth="10Gb/s")
    plan = partition_plan(VGG, cluster, PartitionOptions(straight=True)).rescheduled("pipedream")
    path = tmp_path / "plan.json"
    plan.save(str(path))
    code, out, err = run_cli(capsys, "simulate", "--plan", str(path), "--profile",
                             str(PROFILES / "vgg16.graph.txt"), "--devices", "4",
                             "--bandwidth", "10Gb/s")
    assert code == 0, err
    result = simulate(plan, VGG, cluster, SimOptions(record=False))
    line = next(line for line in out.splitlines() if line.startswith("steady state"))
    assert f"{result.step_time_s * 1e3:.3f} ms per minibatch" in line
    assert f"fill of {result.fill_s * 1e3:.3f} ms" in line


def _chain(num_layers: int) -> ModelProfile:
    return ModelProfile(layers=[
        LayerProfile(name=f"layer{i}", forward_s=1e-3 * (1 + i % 5), backward_s=2e-3 * (1 + i % 3),
                     activation_bytes=1e6 * (1 + i % 7), parameter_bytes=1e5 * (1 + i % 4))
        for i in range(num_layers)])


@pytest.mark.parametrize("schedule", ["pipedream", "1f1b", "gpipe"])
def test_a_plan_too_large_to_replay_is_rated_in_closed_form_quickly(schedule: str) -> None:
    """400 stages with replicas whose least common multiple is 60 (PipeDream's run would be
    thousands of minibatches through 1,000 workers): closed form, in well under a second."""
    profile = _chain(800)
    replicas = [(1, 2, 3, 4, 5)[i % 5] for i in range(400)]
    plan = Plan(stages=[Stage(start=2 * i, end=2 * i + 2, replicas=r)
                        for i, r in enumerate(replicas)],
                num_layers=800, num_devices=sum(replicas), schedule=schedule,
                num_microbatches=None if schedule == "pipedream" else 400)
    cluster = flat_cluster(num_devices=plan.num_devices, bandwidth="10Gb/s")
    started = time.perf_counter()
    result = simulate(plan, profile, cluster, SimOptions(record=False))
    assert time.perf_counter() - started < 5.0
    assert result.step_meaning.startswith("closed form")
    assert len(result.workers) == plan.num_devices and result.timeline.events == []
    slowest = max((profile.layers[2 * i].compute_s + profile.layers[2 * i + 1].compute_s) / r
                  for i, r in enumerate(replicas))
    assert result.step_time_s >= slowest * (1 - 1e-9)
    assert (result.fill_s > 0) == (schedule == "pipedream")


@pytest.mark.parametrize("schedule", ["pipedream", "1f1b", "gpipe"])
def test_the_closed_form_agrees_with_the_replay_on_a_straight_pipeline(schedule: str) -> None:
    """Where nothing waits on a port or a round trip, the closed form is the replay's result:
    PipeDream's period and every device's memory exactly, a flush within 20%."""
    cluster = flat_cluster(num_devices=4, bandwidth="10Gb/s")
    plan = partition_plan(GNMT, cluster, PartitionOptions(straight=True, activation_compression=None))
    plan = plan.rescheduled(schedule, None if schedule == "pipedream" else 8)
    replayed = simulate(plan, GNMT, cluster, QUIET)
    closed = simulate(plan, GNMT, cluster, SimOptions(record=False, activation_comm=False,
                                                      max_replay_actions=0))
    assert not replayed.step_meaning and closed.step_meaning.startswith("closed form")
    if schedule == "pipedream":
        assert closed.step_time_s == pytest.approx(replayed.step_time_s, rel=1e-9)
    else:
        assert closed.step_time_s == pytest.approx(replayed.step_time_s, rel=0.2)
    for mine, theirs in zip(closed.workers, replayed.workers):
        assert mine.peak_memory_bytes == pytest.approx(theirs.peak_memory_bytes, rel=1e-9)
