"""Every plan that ``tandem plan`` (:func:`make_plan`), ``tandem search`` and ``tandem scale``
produce over a small grid (the shipped profiles, a few device counts, bandwidths, memory limits
and schedules) is accepted by ``tandem train --plan``, checked without running: each plan is
written to JSON and read back, and goes through the checks ``tandem train`` runs on a plan
before its workers start (:func:`tandem.runtime.run.check_flags` on the job read with
``--plan``: its micro-batches divide the batch, its processes, its layout), then the runtime's
layout of the stages and its schedule checker. What needs the model itself (as many blocks as
the plan has layers, no weights shared between asynchronous stages) is left out."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from tandem.cluster import flat_cluster, parse_cluster
from tandem.errors import UsageError
from tandem.plan import Plan, Stage
from tandem.planning import PartitionOptions, make_plan
from tandem.planning.search.flexflow import SearchOptions, search
from tandem.planning.search.scaling import ScaleOptions, scale
from tandem.planning.simulate.simulator import SimOptions
from tandem.profile import ModelProfile, load_profile
from tandem.runtime.config import RunConfig
from tandem.runtime.job import Job
from tandem.runtime.pipeline.layout import layout_from_plan
from tandem.runtime.run import check_flags
from tandem.schedule.check import check
from tandem.spec.trainable import batch_refusal, layout_refusal, update_change
from tandem.strategy import plan_with_flags
from tests.conftest import PROFILES, run_cli

pytestmark = pytest.mark.pure

BATCH = 128
"""The global minibatch the shipped profiles stand for here (graph.txt does not say)."""


def profile(name: str) -> ModelProfile:
    return dataclasses.replace(load_profile(str(PROFILES / f"{name}.graph.txt")),
                               batch_size=BATCH)


def train_accepts(plan: Plan, batch: int, tmp_path: Path) -> None:
    """Raise :class:`UsageError` where ``tandem train --plan FILE --batch-size BATCH`` would
    refuse ``plan`` before starting its workers (the steps: a whole number of PipeDream's
    rounds of replicas, as its schedule needs)."""
    path = str(tmp_path / "plan.json")
    plan.save(path)
    loaded = plan_with_flags(Plan.load(path), None, {}, path)
    assert loaded.to_dict() == plan.to_dict()
    steps = 10 * math.lcm(*loaded.replicas)
    job = Job(run=RunConfig(batch_size=batch, steps=steps, nproc=loaded.num_workers),
              plan=loaded)
    check_flags(job)
    if loaded.pipelined:
        layout_from_plan(loaded, loaded.num_layers)
        check(loaded.build_schedule(steps))


# -- tandem plan --------------------------------------------------------------------------------

PLAN_GRID = [(name, devices, bandwidth, memory)
             for name, counts in (("vgg16", (2, 4, 8)), ("gnmt", (4, 8)), ("resnet50", (4,)))
             for devices in counts
             for bandwidth, memory in (("1Gb/s", None), ("25Gb/s", 8e9))]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "pipedream"])
def test_every_plan_of_make_plan_runs(schedule: str, tmp_path: Path) -> None:
    made = 0
    for name, devices, bandwidth, memory in PLAN_GRID:
        cluster = flat_cluster(num_devices=devices, bandwidth=bandwidth)
        try:
            plan = make_plan(profile(name), cluster, PartitionOptions(memory_bytes=memory),
                             schedule=schedule)
        except UsageError:  # nothing fits the limit: no plan written
            continue
        made += 1
        train_accepts(plan, BATCH, tmp_path)
    hierarchy = parse_cluster("4x16GB/s,2x10Gb/s")
    train_accepts(make_plan(profile("vgg16"), hierarchy, schedule=schedule), BATCH, tmp_path)
    assert made >= len(PLAN_GRID) // 2


# -- tandem search ------------------------------------------------------------------------------

SEARCH_GRID = [("vgg16", 4, "1Gb/s", None, 128), ("vgg16", 8, "25Gb/s", 16e9, 96),
               ("gnmt", 4, "25Gb/s", None, 100), ("gnmt", 8, "1Gb/s", 8e9, 128),
               ("resnet50", 4, "10Gb/s", None, 128), ("resnet50", 8, "10Gb/s", None, 100)]
"""Profile, devices, bandwidth, memory limit, batch (96 and 100 do not split in two evenly
among 8 devices or their micro-batches)."""


@pytest.mark.parametrize(("name", "devices", "bandwidth", "memory", "batch"), SEARCH_GRID)
def test_every_plan_of_search_runs(name: str, devices: int, bandwidth: str,
                                   memory: float | None, batch: int, tmp_path: Path) -> None:
    cluster = dataclasses.replace(flat_cluster(num_devices=devices, bandwidth=bandwidth),
                                  memory_bytes=memory)
    sim = SimOptions(batch_scale=batch / BATCH)
    found = search(profile(name), cluster, SearchOptions(max_iterations=80, seed=0,
                                                         batch_samples=batch), sim)
    train_accepts(found.best.plan, batch, tmp_path)
    assert not found.best.note and update_change(found.best.plan) is None
    if found.apart is not None:  # reported apart: faster, but another training run
        assert found.apart.note and found.apart.result.step_time_s < found.best.result.step_time_s
        train_accepts(found.apart.plan, batch, tmp_path)


def test_search_never_recommends_replicated_pipedream(capsys, tmp_path: Path) -> None:
    """ResNet-50 on 4 devices at 10 Gb/s: PipeDream's 4 replicas of one stage simulate 1.2x as
    fast as data parallelism, but average 4 minibatches per update (4 times fewer updates,
    each 4 times larger); the search once recommended them."""
    out = tmp_path / "best.json"
    code, out_text, _ = run_cli(capsys, "search", "--profile", str(PROFILES / "resnet50.graph.txt"),
                           "--profile-batch", "64", "--devices", "4", "--bandwidth", "10Gb/s",
                           "--memory", "64GB",  # 4 replicas of PipeDream's stage need 30 GB
                           "--iterations", "200", "--families", "none", "-o", str(out))
    assert code == 0
    best = Plan.load(str(out))
    assert update_change(best) is None
    train_accepts(best, 64, tmp_path)
    assert "not compared: 4, pipedream" in out_text and "1/4 as many updates" in out_text


# -- tandem scale -------------------------------------------------------------------------------

@pytest.mark.parametrize(("spec", "devices", "memory", "batch"), [
    ("4x16GB/s,4x10Gb/s", 8, None, 96), ("8x300GB/s,2x25Gb/s", 16, 16e9, 128)])
def test_every_plan_of_scale_runs(spec: str, devices: int, memory: float | None, batch: int,
                                  tmp_path: Path) -> None:
    cluster = dataclasses.replace(parse_cluster(spec), memory_bytes=memory)
    result = scale(profile("vgg16"), cluster,
                   ScaleOptions(max_devices=devices, batch_samples=batch, compressions=()),
                   SimOptions(batch_scale=batch / BATCH))
    assert result.plans.keys() == {(p.strategy, p.num_devices) for p in result.simulated}
    for plan in result.plans.values():
        train_accepts(plan, batch, tmp_path)
    assert {"dp", "pipeline", "hybrid", "3d", "ps", "gossip", "localsgd"} <= {
        name for name, _ in result.plans}


# -- the planners' own statement of the rules agrees with the runtime's ------------------------

LAYOUTS = [([2], "1f1b", 2, 1, False), ([2], "1f1b", 2, 1, True), ([1, 1], "1f1b", 2, 1, True),
           ([2, 1], "gpipe", 4, 2, False), ([2, 2], "gpipe", 4, 2, False),
           ([1, 1], "pipedream", 1, 2, False), ([2], "1f1b", 2, 2, False),
           ([2, 1], "1f1b", 4, 1, False), ([2, 1], "1f1b", 6, 1, False),
           ([2], "1f1b", 6, 1, False), ([3], "pipedream", 1, 1, False)]
"""Replicas, schedule, micro-batches, tensor degree, recompute."""


@pytest.mark.parametrize(("replicas", "schedule", "count", "degree", "recompute"), LAYOUTS)
def test_planners_refuse_what_train_refuses(replicas: list[int], schedule: str, count: int,
                                            degree: int, recompute: bool,
                                            tmp_path: Path) -> None:
    plan = Plan(stages=[Stage(start=i, end=i + 1, replicas=r) for i, r in enumerate(replicas)],
                num_layers=len(replicas), num_devices=sum(replicas) * degree,
                schedule=schedule, num_microbatches=count, tensor_degree=degree,
                recompute=recompute)
    refusal = layout_refusal(plan) or batch_refusal(plan, 64)
    try:
        train_accepts(plan, 64, tmp_path)
    except UsageError as exc:
        assert refusal is not None, exc
    else:
        assert refusal is None


def test_update_changes_are_said() -> None:
    def plan(replicas: list[int], schedule: str) -> Plan:
        return Plan(stages=[Stage(start=i, end=i + 1, replicas=r)
                            for i, r in enumerate(replicas)],
                    num_layers=len(replicas), num_devices=sum(replicas), schedule=schedule)

    assert update_change(plan([1, 1, 1], "pipedream")) is None  # stale, but one update a step
    assert update_change(plan([2, 1], "1f1b")) is None
    said = update_change(plan([4, 2, 1], "pipedream"))
    assert said is not None and "stage 0 makes 1/4 as many updates, each of 4 minibatches" in said
    assert "stage 1 makes 1/2" in said and "stage 2" not in said

