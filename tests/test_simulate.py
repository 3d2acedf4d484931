"""The simulator against timelines worked out by hand on tiny cases, drawn as tables.

Units are chosen so the arithmetic is easy: seconds, bytes, and links of 100 bytes/s. Every
table lists, per worker in time order, the actions that take time (receives from post to the
start of the computation that consumes them); zero-length send posts are left out.
"""

from __future__ import annotations

import re
import textwrap

import pytest

from tandem.cluster import Cluster, Level
from tandem.plan import Plan, Stage
from tandem.planning.simulate.collectives import allreduce_s, branching, link_level, ring_s, tree_s
from tandem.planning.simulate.costs import boundary_bytes, stage_costs
from tandem.planning.simulate.simulator import SimOptions, SimResult, data_parallel_plan, simulate
from tandem.profile import LayerProfile, ModelProfile


def profile(*layers: tuple[float, float, float, float], edges=None) -> ModelProfile:
    """Layers as ``(forward_s, backward_s, activation_bytes, parameter_bytes)`` per minibatch."""
    return ModelProfile(layers=[
        LayerProfile(name=f"l{i}", forward_s=f, backward_s=b, activation_bytes=a, parameter_bytes=p)
        for i, (f, b, a, p) in enumerate(layers)], edges=edges)


def flat(devices: int, bandwidth_Bps: float = 100.0, latency_s: float = 0.0) -> Cluster:
    return Cluster(levels=(Level(num_units=devices, bandwidth_Bps=bandwidth_Bps, latency_s=latency_s),))


def pipeline(bounds: list[tuple[int, int, int]], schedule: str, microbatches: int | None,
             num_devices: int) -> Plan:
    return Plan(stages=[Stage(start=s, end=e, replicas=r) for s, e, r in bounds],
                num_layers=bounds[-1][1], num_devices=num_devices, schedule=schedule,
                num_microbatches=microbatches)


def table(result: SimResult, step: int = 0) -> str:
    """``worker action start end`` rows of one step, in time order per worker; actions are
    drawn without their stage (the worker's) and peer (``1RA0<0`` as ``RA0``)."""
    rows = ["w  action  start  end"]
    events = [e for e in result.timeline.events if e.step == step and e.end_s > e.start_s]
    for e in sorted(events, key=lambda e: (e.worker, e.start_s, e.end_s, e.name)):
        name = re.sub(r"^\d+|[<>]\d+$", "", e.name)
        rows.append(f"{e.worker}  {name:<6}  {e.start_s:g}  {e.end_s:g}")
    return "\n".join(rows)


def drawn(text: str) -> str:
    return "\n".join(line.rstrip() for line in textwrap.dedent(text).strip("\n").splitlines())


def normalized(text: str) -> str:
    return "\n".join("  ".join(line.split()) for line in text.splitlines())


# Two layers; per minibatch forward 2 s and backward 4 s each, 100-byte activations: with two
# micro-batches a stage's forward takes 1 s, its backward 2 s, and a transfer of 50 bytes 0.5 s.
TWO = profile((2, 4, 100, 0), (2, 4, 100, 0))


@pytest.mark.pure
def test_gpipe_two_stages_two_microbatches() -> None:
    result = simulate(pipeline([(0, 1, 1), (1, 2, 1)], "gpipe", 2, 2), TWO, flat(2),
                      SimOptions(num_steps=1))
    # w1 posts both receives at 0. F0's activation leaves w0 at 1 and arrives at 1.5; F1's
    # leaves at 2 (w0's port is free again at 1.5) and arrives at 2.5. w1's gradients leave at
    # 5.5 and 7.5; w0's backwards wait for them. w1's step ends when its last send arrives (8).
    assert normalized(table(result)) == normalized(drawn("""
        w  action  start  end
        0  F0      0      1
        0  F1      1      2
        0  RG0     1      6
        0  RG1     2      8
        0  B0      6      8
        0  B1      8      10
        1  RA0     0      1.5
        1  RA1     0      2.5
        1  F0      1.5    2.5
        1  F1      2.5    3.5
        1  B0      3.5    5.5
        1  B1      5.5    7.5
    """))
    assert result.step_time_s == 10
    busy = [w.busy_s for w in result.workers]
    assert busy == [6, 6]
    assert result.bubble_fraction == pytest.approx(1 - 12 / 20)
    # Activations held: both micro-batches' (50 bytes each) between the fill and the drain.
    assert [w.activation_bytes for w in result.workers] == [100, 100]


@pytest.mark.pure
def test_one_f_one_b_three_microbatches() -> None:
    result = simulate(pipeline([(0, 1, 1), (1, 2, 1)], "1f1b", 3, 2),
                      profile((3, 6, 300, 0), (3, 6, 300, 0)), flat(2), SimOptions(num_steps=1))
    # Per micro-batch: forward 1 s, backward 2 s, transfers of 100 bytes take 1 s. Stage 0
    # keeps two micro-batches in flight (F0 F1 B0 F2 B1 B2), stage 1 one (F0 B0 F1 B1 F2 B2).
    # w1 posts RA1 only after F0 (at 3), so F1's activation leaves w0 at 3, not 2; w0 posts
    # RG1 after B0 (at 8) and F2's activation waits for nothing: it arrives at 10.
    assert normalized(table(result)) == normalized(drawn("""
        w  action  start  end
        0  F0      0      1
        0  F1      1      2
        0  RG0     1      6
        0  B0      6      8
        0  F2      8      9
        0  RG1     8      9
        0  B1      9      11
        0  RG2     9      14
        0  B2      14     16
        1  RA0     0      2
        1  F0      2      3
        1  B0      3      5
        1  RA1     3      5
        1  F1      5      6
        1  B1      6      8
        1  RA2     6      10
        1  F2      10     11
        1  B2      11     13
    """))
    assert result.step_time_s == 16
    # 1F1B holds at most two micro-batches on stage 0 and one on stage 1 (100 bytes each).
    assert [w.activation_bytes for w in result.workers] == [200, 100]


@pytest.mark.pure
def test_two_replicas_share_the_receivers_port() -> None:
    # GPipe 2-1, two micro-batches of forward 0.5 s and 100-byte activations (1 s to send): w0
    # runs micro-batch 0, w1 micro-batch 1, both send to w2 at 0.5 s. w2's port takes one
    # transfer at a time, so micro-batch 1 arrives at 2.5 (not 1.5) and F1 starts then.
    prof = profile((1, 2, 200, 0), (1, 2, 200, 0))
    result = simulate(pipeline([(0, 1, 2), (1, 2, 1)], "gpipe", 2, 3), prof, flat(3),
                      SimOptions(num_steps=1))
    rows = [line for line in normalized(table(result)).splitlines() if " RA" in line or " F" in line]
    assert rows == normalized(drawn("""
        0  F0   0    0.5
        1  F1   0    0.5
        2  RA0  0    1.5
        2  RA1  0    2.5
        2  F0   1.5  2
        2  F1   2.5  3
    """)).splitlines()


@pytest.mark.pure
def test_flush_steps_run_back_to_back() -> None:
    # Two steps of the GPipe case: worker 0 starts step 1 at 10, when its own step 0 ended.
    result = simulate(pipeline([(0, 1, 1), (1, 2, 1)], "gpipe", 2, 2), TWO, flat(2))
    first = [e for e in result.timeline.events if e.step == 1 and e.worker == 0]
    assert min(e.start_s for e in first) == 10
    assert result.step_time_s == 10


@pytest.mark.pure
def test_data_parallel_buckets_overlap_the_backward() -> None:
    # Two replicas, each half the batch: forward 2 s, backward 4 s. Two 100-byte buckets: the
    # last layer's gradients are ready 2 s into the backward, the first layer's at its end.
    # Each bucket's ring allreduce over 2 devices moves 2 x 50 bytes: 1 s.
    prof = profile((2, 4, 10, 100), (2, 4, 10, 100))
    plan = data_parallel_plan(prof, 2)
    options = SimOptions(num_steps=1, bucket_bytes=100)
    costs = stage_costs(plan, prof, bucket_bytes=100, first_bucket_bytes=100)
    assert costs[0].buckets == ((4, 100), (8, 100))
    result = simulate(plan, prof, flat(2), options)
    assert normalized(table(result)) == normalized(drawn("""
        w  action  start  end
        0  F0      0      2
        0  B0      2      6
        0  AR      6      7
        1  F1      0      2
        1  B1      2      6
        1  AR      6      7
    """))
    # Bucket 1 ran during the backward (4..5), bucket 2 after it (6..7).
    assert result.step_time_s == 7 and result.workers[0].communication_s == 2
    blocking = simulate(plan, prof, flat(2), SimOptions(num_steps=1, overlap_allreduce=False))
    assert blocking.step_time_s == 8


@pytest.mark.pure
def test_pipedream_steady_state_and_stashed_weights() -> None:
    # Straight 2-stage PipeDream, free communication: in steady state each stage runs one
    # forward (1 s) and one backward (2 s) per minibatch, so a minibatch every 3 s. Stage 0
    # keeps 2 minibatches in flight, so one weight version besides the current one.
    prof = profile((1, 2, 10, 7), (1, 2, 10, 5))
    result = simulate(pipeline([(0, 1, 1), (1, 2, 1)], "pipedream", None, 2), prof,
                      flat(2, bandwidth_Bps=1e12))
    assert result.step_time_s == pytest.approx(3)
    assert [w.stashed_weight_bytes for w in result.workers] == [7, 0]
    assert [w.busy_s for w in result.workers] == pytest.approx([3, 3])
    assert result.bubble_fraction == pytest.approx(0, abs=1e-9)
    # Weights, gradients and momentum (1x), one stashed version and two minibatches' outputs.
    assert result.workers[0].peak_memory_bytes == 7 + 7 + 7 + 7 + 20


@pytest.mark.pure
def test_speed_and_optimizer_step() -> None:
    prof = profile((2, 4, 10, 100))
    cluster = Cluster(levels=(Level(num_units=1, bandwidth_Bps=1.0),), speed=2.0)
    plan = pipeline([(0, 1, 1)], "gpipe", 1, 1)
    result = simulate(plan, prof, cluster, SimOptions(num_steps=1, optimizer_Bps=50))
    # Forward 1 s and backward 2 s on a device twice as fast; 100 parameter bytes at 50 B/s.
    assert normalized(table(result)) == normalized(drawn("""
        w  action  start  end
        0  F0      0      1
        0  B0      1      3
        0  ST      3      5
    """))


# -- collectives and topology ------------------------------------------------------------------

def two_level() -> Cluster:
    """2 servers of 4 devices: 1000 B/s inside a server, 100 B/s between servers."""
    return Cluster(levels=(Level(num_units=4, bandwidth_Bps=1000.0, latency_s=0.001),
                           Level(num_units=2, bandwidth_Bps=100.0, latency_s=0.01)))


@pytest.mark.pure
def test_link_levels_and_branching() -> None:
    cluster = two_level()
    assert link_level(cluster, 1, 2) == 0 and link_level(cluster, 3, 4) == 1
    assert branching(cluster, range(8)) == [4, 2]
    assert branching(cluster, [0, 1]) == [2, 1]
    assert branching(cluster, [0, 4]) == [1, 2]


@pytest.mark.pure
def test_allreduce_formulas() -> None:
    # Ring over 4 devices, 400 bytes, 100 B/s, 10 ms: 2 * 3 * (0.01 + 400 / 400) = 6.06 s.
    assert ring_s(4, 400, 0.01, 100) == pytest.approx(6.06)
    # Tree: 2 * log2(4) * 0.01 + 2 * 400 / 100 = 8.04 s.
    assert tree_s(4, 400, 0.01, 100) == pytest.approx(8.04)
    cluster = two_level()
    # Hierarchical on 2 x 4: inside (2*3*(0.001 + 800/4000)) + across (2*1*(0.01 + 800/200)).
    inside, across = 6 * (0.001 + 0.2), 2 * (0.01 + 4.0)
    assert allreduce_s(cluster, range(8), 800, "hierarchical") == pytest.approx(inside + across)
    # A flat ring over the 8 devices is limited by the slow link: 2*7*(0.01 + 800/800).
    assert allreduce_s(cluster, range(8), 800, "ring") == pytest.approx(14 * 1.01)
    assert allreduce_s(cluster, range(8), 800) == pytest.approx(min(inside + across, 14 * 1.01, 6 * 0.01 + 16))
    assert allreduce_s(cluster, [5], 800) == 0.0


@pytest.mark.pure
def test_transfer_between_servers_uses_the_slow_link() -> None:
    # Stage 0 on device 0, stage 1 on device 4 (the other server): 50 bytes at 100 B/s + 10 ms.
    plan = pipeline([(0, 1, 1), (1, 2, 1)], "gpipe", 2, 8)
    plan.stages[1].devices = [4]
    result = simulate(plan, TWO, two_level(), SimOptions(num_steps=1))
    ra0 = next(e for e in result.timeline.events if e.name == "1RA0<0")
    assert ra0.end_s == pytest.approx(1.51)


@pytest.mark.pure
def test_dag_boundary_carries_every_crossing_output() -> None:
    # 0 -> 1 -> 2 and a skip 0 -> 2: cutting after layer 1 sends layers 0's and 1's outputs.
    prof = profile((1, 1, 10, 0), (1, 1, 20, 0), (1, 1, 40, 0), edges=[(0, 1), (1, 2), (0, 2)])
    plan = pipeline([(0, 1, 1), (1, 2, 1), (2, 3, 1)], "gpipe", 3, 3)
    assert boundary_bytes(plan, prof) == [10, 30, 0]


@pytest.mark.pure
def test_allreduce_latency_override() -> None:
    # Ring over 4 devices with 1 s per step instead of the links' 10 ms: 2 * 3 * (1 + 1).
    cluster = Cluster(levels=(Level(num_units=4, bandwidth_Bps=100.0, latency_s=0.01),))
    assert allreduce_s(cluster, range(4), 400, "ring", latency_s=1.0) == pytest.approx(12)
