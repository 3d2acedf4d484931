"""PipeDream's optimizer reference cases at the planner level (issue 28).

VGG-16, ResNet-50 and GNMT (PipeDream's own profiles) on 2, 4, 8 and 16 flat devices at 10 and
25 Gb/s, without activation transfers (PipeDream's default) and with them: 48 cases. In every
one, ``make_plan(..., schedule="pipedream")`` builds PipeDream's plan, with PipeDream's
bottleneck exactly (the optimum of ``tests/test_partition_pipedream.py``'s transcription of
PipeDream's procedure), simulates it by its steady state, and returns nothing slower.

Where PipeDream's plan is a straight pipeline and activations are free, its simulated steady
state is PipeDream's bottleneck exactly. Where a stage is replicated, the runtime's schedule
(PipeDream's: a blocking allreduce after every minibatch, ``ceil(devices from the stage on /
replicas)`` minibatches in flight) makes the replicas wait once per round for a trip through
the later stages (``tests/test_steady_state.py``), so PipeDream's plan can run slower than its
model says and the planner may return another plan that the simulator rates faster (VGG-16 on
8 devices at 10 Gb/s: PipeDream's 4-2-1-1 runs 155 ms per minibatch, not 93.4; the planner's
6-1-1 runs 98).
"""

from __future__ import annotations

import pytest

from tandem.cluster import flat_cluster
from tandem.planning import PartitionOptions, make_plan, partition_plan
from tandem.planning.simulate.simulator import SimOptions, data_parallel_plan, simulate
from tandem.profile import load_profile
from tests.conftest import PROFILES
from tests.test_partition_pipedream import EXPECTED as EXPECTED_10GBPS

pytestmark = pytest.mark.pure

MODELS = ("vgg16", "resnet50", "gnmt")
PROFILE = {name: load_profile(str(PROFILES / f"{name}.graph.txt")) for name in MODELS}
BANDWIDTH_Bps = {"10Gb/s": 1.25e9, "25Gb/s": 3.125e9}

EXPECTED_25GBPS = {
    ("vgg16", 2, None): 0.370931, ("vgg16", 2, 1.0): 0.381063,
    ("vgg16", 4, None): 0.17153659968, ("vgg16", 4, 1.0): 0.17338726634666668,
    ("vgg16", 8, None): 0.09175018302222225, ("vgg16", 8, 1.0): 0.09366112877714287,
    ("vgg16", 16, None): 0.045477187001600014, ("vgg16", 16, 1.0): 0.0455248078264889,
    ("resnet50", 2, None): 0.221933, ("resnet50", 2, 1.0): 0.221933,
    ("resnet50", 4, None): 0.111497, ("resnet50", 4, 1.0): 0.11642631708444447,
    ("resnet50", 8, None): 0.05622, ("resnet50", 8, 1.0): 0.06413007955200002,
    ("resnet50", 16, None): 0.028879459377777777, ("resnet50", 16, 1.0): 0.03288334336,
    ("gnmt", 2, None): 0.045936, ("gnmt", 2, 1.0): 0.045936,
    ("gnmt", 4, None): 0.025868, ("gnmt", 4, 1.0): 0.025868,
    ("gnmt", 8, None): 0.019032, ("gnmt", 8, 1.0): 0.019032,
    ("gnmt", 16, None): 0.011081, ("gnmt", 16, 1.0): 0.011081,
}  # fmt: skip
"""PipeDream's optimum bottleneck in seconds at 25 Gb/s, flat: the transcription's
``reference_optimum`` of ``tests/test_partition_pipedream.py`` at 3.125e9 B/s, as computed for
this file (it agrees with tandem's partitioner to 1e-9 in every case)."""

EXPECTED = {**{(*key, "10Gb/s"): value for key, value in EXPECTED_10GBPS.items()},
            **{(*key, "25Gb/s"): value for key, value in EXPECTED_25GBPS.items()}}
CASES = sorted(EXPECTED, key=str)


def _name(case: tuple[str, int, float | None, str]) -> str:
    model, devices, ratio, bandwidth = case
    return f"{model}-{devices}-{bandwidth}-{'no-act' if ratio is None else 'act'}"


@pytest.mark.parametrize("case", CASES, ids=[_name(case) for case in CASES])
def test_the_planner_builds_pipedreams_plan_and_returns_nothing_slower(
        case: tuple[str, int, float | None, str]) -> None:
    model, devices, ratio, bandwidth = case
    expected = EXPECTED[case]
    profile = PROFILE[model]
    cluster = flat_cluster(num_devices=devices, bandwidth=BANDWIDTH_Bps[bandwidth])
    options = PartitionOptions(activation_compression=ratio)
    sim = SimOptions(activation_comm=ratio is not None)  # as `tandem plan --no-activation-comm`
    plan = make_plan(profile, cluster, options, schedule="pipedream", pipeline_only=True, sim=sim)
    # PipeDream's plan, with PipeDream's bottleneck, is among those the planner compared
    pipedream = partition_plan(profile, cluster, options)
    assert pipedream.bottleneck_s == pytest.approx(expected, rel=1e-9)
    compared = [row for row in plan.candidates if row["estimate_s"] is not None
                and row["estimate_s"] == pytest.approx(expected, rel=1e-9)]
    assert compared, [(row["config"], row["estimate_s"]) for row in plan.candidates]
    # the planner's plan runs PipeDream's schedule and is no slower than PipeDream's plan
    own = simulate(pipedream.rescheduled("pipedream"), profile, cluster, sim)
    assert plan.schedule == "pipedream"
    assert plan.bottleneck_s <= own.step_time_s * (1 + 1e-12)
    assert own.fill_s > 0
    if ratio is None and set(pipedream.replicas) == {1}:  # nothing to wait for but compute
        assert own.step_time_s == pytest.approx(expected, rel=1e-9)


def test_the_issues_example_is_rated_by_its_steady_state() -> None:
    """`tandem plan --profile vgg16.graph.txt --devices 8 --bandwidth 10Gb/s
    --no-activation-comm --schedule pipedream` showed PipeDream's 4-2-1-1 at 669 ms per step:
    the simulator charged its 822 MB activations at 10 Gb/s, which the flag asks to ignore.
    Without them its steady state is 155 ms per minibatch (a round trip per round of stage
    0's replicas), the fill apart, and the planner prefers a plan that runs faster."""
    profile, cluster = PROFILE["vgg16"], flat_cluster(num_devices=8, bandwidth="10Gb/s")
    options = PartitionOptions(activation_compression=None)
    sim = SimOptions(activation_comm=False)
    pipedream = partition_plan(profile, cluster, options).rescheduled("pipedream")
    assert pipedream.config == "4-2-1-1"
    result = simulate(pipedream, profile, cluster, sim)
    assert 0.150 < result.step_time_s < 0.160 and result.fill_s > 0.5
    plan = make_plan(profile, cluster, options, schedule="pipedream", pipeline_only=True, sim=sim)
    assert plan.bottleneck_s <= result.step_time_s
    single = simulate(data_parallel_plan(profile, 1), profile,
                      flat_cluster(num_devices=1, bandwidth="10Gb/s"), sim)
    assert single.step_time_s / plan.bottleneck_s > 4  # not the 1.01x the issue saw
