"""The planner's promises as properties (issue 28), on a seeded sample of models, device
counts, link speeds (1-400 Gb/s), device speeds, memory limits and schedules: no plan slower,
simulated on its own cluster, than the plan for half the bandwidth, for devices half as fast or
for a tighter limit re-simulated there, nor than data parallelism or one device; every plan's
micro-batches divide its minibatch. Then issue 28's series of link speeds and of limits, each
plan no slower than every earlier one (where that holds in practice only, the test says so)."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from tandem.cluster import Cluster, flat_cluster, parse_cluster
from tandem.errors import UsageError
from tandem.plan import Plan
from tandem.planning import PartitionOptions, make_plan, partition_plan
from tandem.planning.partition.pipedream import NoPlanFits
from tandem.planning.search import candidates
from tandem.planning.simulate.sharded import sharded_plans
from tandem.planning.simulate.simulator import SimOptions, data_parallel_plan, simulate
from tandem.profile import LayerProfile, ModelProfile, load_profile
from tandem.spec.kinds import ScheduleKind
from tests.conftest import PROFILES, run_cli

pytestmark = pytest.mark.pure

SIM = SimOptions(record=False)
TOLERANCE = 1e-9
"""Relative slack for comparing two simulated times (the same arithmetic in another order)."""


def _chain(num_layers: int, batch_size: int, seed: int) -> ModelProfile:
    """A chain of random layers: ms-scale compute, MB-scale activations, a heavy tail."""
    rng = random.Random(seed)
    return ModelProfile(batch_size=batch_size, layers=[
        LayerProfile(name=f"layer{i}", forward_s=rng.uniform(1e-3, 6e-3),
                     backward_s=rng.uniform(2e-3, 1.2e-2),
                     activation_bytes=rng.uniform(2e7, 4e8) / (1 + i),
                     parameter_bytes=rng.uniform(1e6, 4e8) * (1 + i) / num_layers)
        for i in range(num_layers)])  # fmt: skip


MODELS = {
    "vgg16": dataclasses.replace(load_profile(str(PROFILES / "vgg16.graph.txt")), batch_size=64),
    "gnmt": dataclasses.replace(load_profile(str(PROFILES / "gnmt.graph.txt")), batch_size=128),
    "chain": _chain(14, batch_size=48, seed=28),
    "resnet50": dataclasses.replace(load_profile(str(PROFILES / "resnet50.graph.txt")),
                                    batch_size=64),
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One sampled planning problem."""

    model: str
    devices: int
    bandwidth_gbps: float
    speed: float
    limit_gb: float | None
    schedule: str
    pipeline_only: bool = False
    """As ``tandem plan --schedule``: one of the partitioner's plans, run as asked."""

    def cluster(self, *, bandwidth_scale: float = 1.0, speed_scale: float = 1.0,
                limit_gb: float | None = None) -> Cluster:
        limit = self.limit_gb if limit_gb is None else limit_gb
        flat = flat_cluster(num_devices=self.devices,
                            bandwidth=self.bandwidth_gbps * bandwidth_scale * 1e9 / 8)
        return dataclasses.replace(flat, speed=self.speed * speed_scale,
                                   memory_bytes=None if limit is None else limit * 1e9)


def _cases(count: int, seed: int) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        model = rng.choice(sorted(MODELS))
        cases.append(Case(model=model, devices=rng.choice((4, 8, 16)),
                          bandwidth_gbps=round(10 ** rng.uniform(0, 2.6), 2),
                          speed=rng.choice((0.5, 1.0, 2.0)),
                          limit_gb=rng.choice((None, 16.0, 8.0, 4.0)),
                          schedule=rng.choice(("1f1b", "pipedream", "gpipe"))))
    return cases


def _pipeline_cases(count: int, seed: int) -> list[Case]:
    """ResNet-50 and the chain with a schedule asked for (``pipeline_only``), on 4 and 8
    devices: the path ``tandem plan --schedule`` takes."""
    rng = random.Random(seed)
    return [Case(model=rng.choice(("resnet50", "chain")), devices=rng.choice((4, 8)),
                 bandwidth_gbps=round(10 ** rng.uniform(0, 2.6), 2),
                 speed=rng.choice((0.5, 1.0, 2.0)), limit_gb=rng.choice((None, 16.0, 8.0, 4.0)),
                 schedule=rng.choice(("1f1b", "pipedream")), pipeline_only=True)
            for _ in range(count)]


CASES = _cases(12, seed=28) + _pipeline_cases(4, seed=280)


def _plan(case: Case, cluster: Cluster) -> Plan | None:
    """The planner's plan, or None when no plan fits the limit."""
    try:
        return make_plan(MODELS[case.model], cluster, PartitionOptions(), schedule=case.schedule,
                         sim=SIM, pipeline_only=case.pipeline_only)
    except UsageError:
        return None


def _step(plan: Plan, case: Case, cluster: Cluster) -> tuple[float, bool]:
    result = simulate(plan, MODELS[case.model], cluster, SIM)
    return result.step_time_s, result.fits_memory


def _runs_on_its_minibatch(plan: Plan, batch: int) -> bool:
    count = plan.num_microbatches or 1
    if plan.pipelined:
        return batch % count == 0
    replicas = plan.stages[0].replicas
    return batch % replicas == 0 and batch % count == 0 and count % replicas == 0


def _apart(plan: Plan) -> bool:
    """One stage on several replicas under PipeDream's schedule: each update averages as many
    minibatches (another training run, which the planner compares only when nothing else
    fits)."""
    return plan.schedule.asynchronous and len(plan.stages) == 1 and plan.stages[0].replicas > 1


@pytest.mark.parametrize("case", CASES, ids=lambda case: (
    f"{case.model}-{case.devices}-{case.bandwidth_gbps}Gbps-x{case.speed}-"
    f"{case.limit_gb}GB-{case.schedule}{'-asked' if case.pipeline_only else ''}"))
def test_no_plan_is_slower_than_one_it_could_have_made(case: Case) -> None:
    cluster = case.cluster()
    plan = _plan(case, cluster)
    if plan is None:  # a limit no plan meets: then no tighter one does either
        assert _plan(case, case.cluster(limit_gb=(case.limit_gb or 0) / 2)) is None
        return
    profile = MODELS[case.model]
    assert profile.batch_size is not None
    assert _runs_on_its_minibatch(plan, profile.batch_size), plan.to_dict()
    chosen, fits = _step(plan, case, cluster)
    assert fits and chosen == pytest.approx(plan.bottleneck_s, rel=1e-9)
    peak = max(stage.memory_bytes for stage in plan.stages)
    others = {
        "half the bandwidth": case.cluster(bandwidth_scale=0.5),
        "devices half as fast": case.cluster(speed_scale=0.5),
        "a tighter limit": case.cluster(limit_gb=0.75 * (case.limit_gb or peak / 1e9)),
    }
    for what, other_cluster in others.items():
        other = _plan(case, other_cluster)
        if other is None:
            continue
        assert _runs_on_its_minibatch(other, profile.batch_size), (what, other.to_dict())
        step, other_fits = _step(other, case, cluster)
        if other_fits and (_apart(plan) or not _apart(other)):  # the same training
            assert chosen <= step * (1 + TOLERANCE), (what, plan.config, other.config)
    references = {} if case.pipeline_only else {
        "data parallelism": data_parallel_plan(profile, case.devices),
        "one device": data_parallel_plan(profile, 1)}
    for what, reference in references.items():
        step, reference_fits = _step(reference, case, cluster)
        if reference_fits and profile.batch_size % reference.stages[0].replicas == 0:
            assert chosen <= step * (1 + TOLERANCE), (what, plan.config)


def test_a_hierarchical_plan_is_never_slower_than_the_flat_plans_and_fits() -> None:
    """The hierarchical partitioner holds the limit itself, device by device."""
    profile = MODELS["vgg16"]
    cluster = dataclasses.replace(parse_cluster("4x16GB/s,2x10Gb/s"), memory_bytes=8e9)
    plan = make_plan(profile, cluster, schedule="pipedream", sim=SIM)
    result = simulate(plan, profile, cluster, SIM)
    assert result.fits_memory
    flat = make_plan(profile, flat_cluster(num_devices=8, bandwidth=1.25e9),
                     PartitionOptions(memory_bytes=8e9), schedule="pipedream", sim=SIM)
    assert result.step_time_s <= simulate(flat, profile, cluster, SIM).step_time_s * (1 + 1e-9)


def test_a_requested_schedule_and_count_are_run_even_on_one_stage() -> None:
    """Defect: ``--schedule gpipe --microbatches 8`` returned data parallelism under 1F1B with 2
    micro-batches when the partitioner gave one stage."""
    profile = dataclasses.replace(load_profile(str(PROFILES / "resnet50.graph.txt")),
                                  batch_size=64)
    cluster = flat_cluster(num_devices=2, bandwidth="400Gb/s")
    plan = make_plan(profile, cluster, schedule="gpipe", num_microbatches=8, pipeline_only=True,
                     sim=SIM)
    assert (plan.schedule, plan.num_microbatches) == ("gpipe", 8)
    assert all(row["schedule"] == "gpipe" and row["num_microbatches"] == 8
               for row in plan.candidates if row["name"] == "partition" and row["config"])


def test_a_count_that_does_not_divide_the_minibatch_is_refused_in_one_line(capsys) -> None:
    code, out, err = run_cli(capsys, "plan", "--profile", str(PROFILES / "vgg16.graph.txt"),
                             "--profile-batch", "32", "--devices", "4", "--bandwidth", "10Gb/s",
                             "--schedule", "gpipe", "--microbatches", "12")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "--microbatches 12 does not divide the minibatch of 32" in err and "such as 8" in err


@pytest.mark.parametrize("spec", ["4x16GB/s,2x10Gb/s", "2x16GB/s,2x10Gb/s,2x1Gb/s"])
@pytest.mark.parametrize("limit", [16e9, 8e9])
def test_the_hierarchical_partitioner_holds_the_limit_on_every_device(spec: str,
                                                                      limit: float) -> None:
    """Defect: outer levels checked a unit's even share of a segment's bytes, so a plan's
    device could hold twice the limit (the planner then fell back to the flat plan)."""
    profile = MODELS["vgg16"]
    cluster = dataclasses.replace(parse_cluster(spec), memory_bytes=limit)
    plan = partition_plan(profile, cluster, PartitionOptions(memory_bytes=limit,
                                                             schedule="pipedream"))
    result = simulate(plan.rescheduled("pipedream"), profile, cluster, SIM)
    assert len(plan.level_configs) == len(cluster.levels) and result.fits_memory
    for index, stage in enumerate(plan.stages):  # the partitioner's model is the simulator's
        peaks = [w.peak_memory_bytes for w in result.workers if w.stage == index]
        assert stage.memory_bytes == pytest.approx(max(peaks), rel=1e-9)
        assert stage.memory_bytes <= limit


def test_no_limit_is_never_slower_than_a_limit() -> None:
    """Without a memory limit the planner still walks down the memory axis from its free plan
    (ResNet-50 on Cluster-A: the free plan is data parallelism at 145.2 ms, while under 32 GB
    the steps below it found 9-4-3 at 142.8 ms)."""
    profile = load_profile(str(PROFILES / "resnet50.graph.txt"))
    cluster = parse_cluster("pipedream-a")
    free = make_plan(profile, dataclasses.replace(cluster, memory_bytes=None),
                     PartitionOptions(memory_bytes=None))
    limited = make_plan(profile, dataclasses.replace(cluster, memory_bytes=32e9),
                        PartitionOptions(memory_bytes=32e9))
    assert free.bottleneck_s <= limited.bottleneck_s * (1 + TOLERANCE), (free.config,
                                                                         limited.config)


SERIES: list = [  # devices or cluster, schedule, limit GB, the link speeds in Gb/s or limits in GB
    (8, "1f1b", 16.0, "bandwidth", (100.0, 200.0)),
    (16, "1f1b", 16.0, "bandwidth", (50.0, 100.0)),
    (16, "pipedream", 32.0, "bandwidth", (25.0, 50.0)),
    ("4x16GB/s,4x10Gb/s", "pipedream", None, "limit", (28.0, 32.0)),
]


def _series_cluster(where: int | str, gbps: float, limit_gb: float) -> Cluster:
    """``where`` devices at ``gbps`` (or the cluster it names) with ``limit_gb`` per device."""
    cluster = parse_cluster(where) if isinstance(where, str) else flat_cluster(
        num_devices=where, bandwidth=gbps * 1e9 / 8)
    return dataclasses.replace(cluster, memory_bytes=limit_gb * 1e9)


def _no_slower_than_before(plans: list[tuple[float, Plan]], cluster: Cluster,
                           profile: ModelProfile) -> None:
    """The last plan is no slower on ``cluster`` than every earlier one re-simulated there."""
    value, plan = plans[-1]
    for earlier_value, earlier in plans[:-1]:
        before = simulate(earlier, profile, cluster, SIM)
        assert before.fits_memory
        assert plan.bottleneck_s <= before.step_time_s * (1 + TOLERANCE), (
            value, plan.config, earlier_value, earlier.config)


@pytest.mark.parametrize(("where", "schedule", "limit_gb", "axis", "values"), SERIES,
                         ids=["8-1f1b-bandwidth", "16-1f1b-bandwidth", "16-pipedream-bandwidth",
                              "4x16GB/s,4x10Gb/s-pipedream-limit"])
def test_the_issues_series_are_monotone(where: int | str, schedule: str, limit_gb: float | None,
                                        axis: str, values: tuple[float, ...]) -> None:
    """Issue 28's series with a schedule asked for (ResNet-50): 8 devices under 1F1B and 16 GB
    gave "8" at 60.7 ms at 100 Gb/s and 5-2-1 at 98.5 ms at 200 Gb/s; 16 devices 58.4 ms at 50
    Gb/s and 67.6 ms at 100; under PipeDream's schedule and 32 GB "16" at 31.5 ms at 25 Gb/s and
    60.3 ms at 50, then (one stage on 16 replicas no longer compared: another training run)
    2-14 at 25 Gb/s, 43.2 ms at 50, where 50 Gb/s gave 4-12 at 53.4 ms (the rung of 25 Gb/s's
    plan lay beyond its work bound, MAX_SOLVE_WORK 1e7); on 4x16GB/s,4x10Gb/s "16" at 36.0 ms
    under 28 GB and 8-5-3 at 153.7 ms under 32 GB. Each point's plan is no slower than every
    earlier point's re-simulated there."""
    profile = MODELS["resnet50"]
    plans: list[tuple[float, Plan]] = []
    for value in values:
        cluster = _series_cluster(where, value if axis == "bandwidth" else 10.0,
                                  value if axis == "limit" else limit_gb or 0.0)
        plans.append((value, make_plan(profile, cluster, PartitionOptions(), schedule=schedule,
                                       sim=SIM, pipeline_only=True)))
        _no_slower_than_before(plans, cluster, profile)


def _ladder(low_gb: float, high_gb: float) -> tuple[float, ...]:
    """Limits 2 ** (1 / 4) apart from ``low_gb`` to at most ``high_gb``."""
    return tuple(low_gb * 2 ** (k / 4) for k in range(int(4 * math.log2(high_gb / low_gb)) + 1))


LIMITS: list = [  # devices or cluster, link speed in Gb/s, schedule, limits in GB
    (8, 100.0, "1f1b", (1.0, 1.5, 2.0, 3.0, 4.0)),
    (16, 50.0, "1f1b", _ladder(0.96, 1.92)),
    (16, 25.0, "pipedream", _ladder(11.8, 33.5)),
    ("4x16GB/s,4x10Gb/s", 0.0, "pipedream", (12.0, 14.0)),
]


@pytest.mark.parametrize(("where", "gbps", "schedule", "limits"), LIMITS,
                         ids=["8-1f1b", "16-1f1b", "16-pipedream", "4x16GB/s,4x10Gb/s-pipedream"])
def test_a_looser_limit_never_gives_a_slower_plan(where: int | str, gbps: float, schedule: str,
                                                  limits: tuple[float, ...]) -> None:
    """The devices and schedules of issue 28's series under limits from tight to loose
    (ResNet-50, a schedule asked for): each plan is no slower than every tighter limit's plan
    re-simulated under its own limit. By construction (a tighter limit's candidates are all
    among a looser one's: ``planning/search/candidates.py``); on the ladders 2 ** (1 / 4) apart
    the planner anchored at the limit was not: 16 devices at 50 Gb/s under 1F1B gave 58.4 ms at
    1.14 GB and 61.2 ms at 1.35 and 1.61 GB, and at 25 Gb/s under PipeDream's schedule 49.7 ms
    at 14.0 and 16.7 GB and 50.4 ms from 19.9 to 33.5 GB. On 4x16GB/s,4x10Gb/s the issue's
    pair: 12 GB's 4-4-4-4 at 85.3 ms against 14 GB's at 89.9 ms (now 86.3 and 84.6 ms)."""
    _looser_is_no_slower(MODELS["resnet50"], [_series_cluster(where, gbps, limit)
                                              for limit in limits], schedule)


def _looser_is_no_slower(profile: ModelProfile, clusters: list[Cluster], schedule: str,
                         options: PartitionOptions | None = None) -> None:
    """Plans for ``clusters`` (limits from tight to loose, a schedule asked for), each no
    slower than every earlier one re-simulated on its own cluster."""
    plans: list[tuple[float, Plan]] = []
    for cluster in clusters:
        assert cluster.memory_bytes is not None
        plans.append((cluster.memory_bytes / 1e9, make_plan(
            profile, cluster, options or PartitionOptions(), schedule=schedule, sim=SIM,
            pipeline_only=True)))
        _no_slower_than_before(plans, cluster, profile)


WALKS: list = [  # model, devices or cluster, schedule, limits in GB, every view's grid sparse
    ("vgg16", "4x16GB/s,2x10Gb/s", "pipedream", _ladder(7.7, 32.0), False, False),
    ("vgg16", "4x16GB/s,2x10Gb/s", "1f1b", _ladder(1.6, 8.0), False, True),
    ("vgg16", "4x16GB/s,2x10Gb/s", "pipedream", _ladder(7.7, 32.0), True, False),
    ("chain", "16", "pipedream", _ladder(1.4, 8.0), True, False),
]


@pytest.mark.parametrize(("model", "where", "schedule", "limits", "sparse", "straight"), WALKS,
                         ids=["hierarchy", "hierarchy-straight", "hierarchy-sparse",
                              "one-level-sparse"])
def test_every_walk_down_the_memory_grid_is_monotone_in_the_limit(
        model: str, where: str, schedule: str, limits: tuple[float, ...], sparse: bool,
        straight: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each way the planner walks the memory grid, on ladders of limits 2 ** (1 / 4) apart: on a
    hierarchy every grid point down to the least memory any plan needs (as for ResNet-50 on
    servers of 4), or, for straight pipelines (where that least is not known), whatever the
    limit; with the grid of costly views (``sparse``: as a 1,000-layer chain on 1,024 devices
    walks it, on one level and on a hierarchy; every view made costly here). Each plan no
    slower than every tighter limit's plan re-simulated under its own limit."""
    if sparse:
        monkeypatch.setattr(candidates, "FINE_WORK", 0.0)
        monkeypatch.setattr(candidates, "FINE_WORK_LEVELS", 0.0)
    _looser_is_no_slower(MODELS[model], [_series_cluster(
        where if "x" in where else int(where), 10.0, limit) for limit in limits], schedule,
        PartitionOptions(straight=straight))


@pytest.mark.statistical
@pytest.mark.parametrize(("schedule", "limits"), [("pipedream", _ladder(7.0, 40.0)),
                                                  ("1f1b", _ladder(1.3, 16.0))])
def test_a_looser_limit_never_gives_a_slower_plan_on_servers_of_4(
        schedule: str, limits: tuple[float, ...]) -> None:
    """ResNet-50 on 4x16GB/s,4x10Gb/s (a costly hierarchy: its walk solves every fine grid
    point, each from the inner level's table under the last), limits 2 ** (1 / 4) apart over
    the range where plans fit: no plan slower than a tighter limit's (the anchored planner of
    commit bcc33f6 held here in practice only). About 15 s of CPU."""
    _looser_is_no_slower(MODELS["resnet50"], [_series_cluster("4x16GB/s,4x10Gb/s", 0.0, limit)
                                              for limit in limits], schedule)


@pytest.mark.parametrize(("model", "schedule", "limits"), [
    ("vgg16", "pipedream", (7.1, 10.3)), ("resnet50", "pipedream", (10.3, 14.5)),
    ("gnmt", "1f1b", (1.22, 2.6)), ("resnet50", "1f1b", (1.22, 2.6)),
])
def test_no_plan_is_slower_than_the_limits_own_between_grid_points(
        model: str, schedule: str, limits: tuple[float, ...]) -> None:
    """Limits between two points of the memory grid, whose own plan the walk need not meet:
    the partitioner's plan for the limit itself (its budget as the walk's top: under flush
    schedules the limit times ``FLUSH_BUDGET_SCALE``), run with each micro-batch count the
    planner tries, is never faster than the planner's plan when it fits. On views whose grid is
    fine (8 devices here); a costly view's grid is 19% apart and there the limit's own plan can
    be faster (the 1,000-layer chain at 2.2 GB under PipeDream's schedule: docs/planning.md,
    "The price")."""
    profile = MODELS[model]
    compared = 0
    for limit_gb in limits:
        cluster = _series_cluster(8, 25.0, limit_gb)
        options = PartitionOptions(schedule=schedule, memory_bytes=limit_gb * 1e9)
        budget = candidates.walk_top(options)
        assert budget is not None and candidates.grid_point(
            candidates.grid_index(budget)) != budget  # between grid points
        plan = make_plan(profile, cluster, PartitionOptions(), schedule=schedule, sim=SIM,
                         pipeline_only=True)
        own = partition_plan(profile, dataclasses.replace(cluster, memory_bytes=None),
                             dataclasses.replace(options, memory_bytes=budget))
        pool = candidates.CandidatePool(profile, cluster, ScheduleKind(schedule), None, SIM,
                                        reschedule_all=True)
        ran = pool.evaluate("the limit's own", own, None)
        if ran.fits:
            assert plan.bottleneck_s <= ran.step_s * (1 + TOLERANCE), (limit_gb, own.config)
            compared += 1
    assert compared


@pytest.mark.parametrize(("model", "where", "schedule", "top_gb"), [
    ("resnet50", "16", "pipedream", 16.0), ("gnmt", "16", "1f1b", 8.0),
    ("chain", "1024", "pipedream", 16.0),  # the limited search (planning/partition/limited.py)
])
def test_a_budgets_plan_is_the_plan_of_every_grid_point_down_to_its_need(
        model: str, where: str, schedule: str, top_gb: float) -> None:
    """What lets a walk down the memory grid on one level solve one budget per distinct plan:
    the partitioner's plan under a budget is its plan under every budget down to that plan's
    need (its best among the plans that fit, the first among equals; the limited search's, the
    plan its search finds at the optimum), so the walk, going on at the grid point below each
    plan's need, meets the plan of every point it passes, from whichever point it starts.
    Checked against a solve at every grid point (on a hierarchy it does not hold: there the
    planner solves every point)."""
    profile = MODELS[model]
    view = parse_cluster(where) if "x" in where else flat_cluster(num_devices=int(where),
                                                                   bandwidth="10Gb/s")
    options = PartitionOptions(schedule=schedule)

    def solved(budget: float) -> Plan | None:
        try:
            return partition_plan(profile, view, dataclasses.replace(options,
                                                                     memory_bytes=budget))
        except UsageError:
            return None

    walked: dict[int, Plan] = {}  # grid index -> the walk's plan there
    index = candidates.grid_index(top_gb * 1e9)
    while (plan := solved(candidates.grid_point(index))) is not None:
        below = candidates.grid_index(candidates.plan_need(plan)) - 1
        walked.update(dict.fromkeys(range(below + 1, index + 1), plan))
        index = below
    assert len(walked) > 3
    for point, plan in walked.items():
        alone = solved(candidates.grid_point(point))
        assert alone is not None and candidates.layout_key(alone) == candidates.layout_key(plan)
    assert solved(candidates.grid_point(index)) is None


@pytest.mark.parametrize("schedule", ["pipedream", "1f1b"])
@pytest.mark.parametrize(("model", "where"), [("resnet50", "8"), ("vgg16", "4x16GB/s,2x10Gb/s")])
def test_the_memory_named_when_nothing_fits_is_the_planners_own_least(schedule: str, model: str,
                                                                      where: str) -> None:
    """The smallest memory a refusal names is the least limit under which the planner's own
    candidates give a plan (each one from the limit at which its walk passes its need; on a
    hierarchy from any): enough, and 2% less is not (the message rounds up to 10 MB)."""
    profile = MODELS[model]

    def planned(limit_gb: float) -> Plan:
        cluster = dataclasses.replace(parse_cluster(where) if "x" in where else flat_cluster(
            num_devices=int(where), bandwidth="25Gb/s"), memory_bytes=limit_gb * 1e9)
        return make_plan(profile, cluster, PartitionOptions(), schedule=schedule, sim=SIM,
                         pipeline_only=True)

    with pytest.raises(NoPlanFits) as caught:
        planned(0.1)
    need = float(str(caught.value).split("the smallest needs ")[1].split(" GB")[0])
    assert max(stage.memory_bytes for stage in planned(need).stages) <= need * 1e9
    with pytest.raises(NoPlanFits):
        planned(0.98 * need)


def test_sharded_data_parallelism_is_never_faster_than_plain() -> None:
    """The planner weighs sharded data parallelism only when plain data parallelism does not
    fit the limit, so a looser limit under which plain fits never loses a faster sharded plan:
    the simulator never rates sharded faster (its collectives move the same bytes, and more)."""
    for model, where in [("vgg16", "16"), ("gnmt", "8"), ("resnet50", "4x16GB/s,4x10Gb/s")]:
        profile = MODELS[model]
        for gbps in (1.0, 25.0, 400.0):
            cluster = parse_cluster(where) if "x" in where else flat_cluster(
                num_devices=int(where), bandwidth=gbps * 1e9 / 8)
            plain = data_parallel_plan(profile, cluster.num_devices)
            step = simulate(plain, profile, cluster, SIM).step_time_s
            shards = sharded_plans(plain, cluster)
            assert shards
            for sharded in shards:
                assert simulate(sharded, profile, cluster, SIM).step_time_s >= step * (
                    1 - TOLERANCE), (model, where, gbps, sharded.shard_degree)


def test_a_plan_that_trains_differently_is_shown_apart_not_chosen(capsys) -> None:
    """Defect: with PipeDream's schedule asked for, `tandem plan` chose a plan of one stage on
    every device (asynchronous data parallelism, each update averaging 4 minibatches: a quarter
    as many updates) as the fastest per minibatch. It is now shown apart, not compared."""
    code, out, err = run_cli(capsys, "plan", "--profile", str(PROFILES / "resnet50.graph.txt"),
                             "--profile-batch", "64", "--devices", "4", "--bandwidth", "100Gb/s",
                             "--memory", "32GB", "--schedule", "pipedream")
    assert code == 0, err
    assert "not compared: 4 at" in out and "1/4 as many updates" in out
    assert not out.splitlines()[1].startswith("plan 4:")
    assert "partition (4) would be faster" not in err  # dp's updates are as asked: it may be


def test_the_header_states_the_limit_planned_under(capsys) -> None:
    """Defect: `tandem plan --memory 64GB` on a flat cluster printed "16 GB each"."""
    code, out, err = run_cli(capsys, "plan", "--profile", str(PROFILES / "vgg16.graph.txt"),
                             "--devices", "4", "--bandwidth", "10Gb/s", "--memory", "64GB")
    assert code == 0, err
    assert out.splitlines()[0] == "cluster: 4 devices (4 @ 10 Gb/s, 64 GB each)"
