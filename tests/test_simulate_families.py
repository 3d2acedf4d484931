"""The simulator's synchronization families against timelines and step times worked out by hand.

Units keep the arithmetic easy: one layer whose forward takes 2 s and backward 4 s per
minibatch, 100 bytes of parameters, links of 100 bytes/s without latency (a 100-byte message
takes 1 s). With ``W`` workers each computes ``1/W`` of the minibatch.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from tandem.cli import main
from tandem.cluster import Cluster, Level
from tandem.errors import UsageError
from tandem.plan import Plan
from tandem.planning.search.crossover import gossip_vs_ps
from tandem.planning.search.family_search import best_of_families
from tandem.planning.simulate.simulator import SimOptions, SimResult, data_parallel_plan, simulate
from tandem.profile import LayerProfile, ModelProfile, load_profile
from tandem.spec.sync import (
    ElasticAveragingSync,
    GossipSync,
    LocalSGDSync,
    ParameterServerSync,
    SyncSpec,
)
from tests.test_simulate import drawn, normalized

pytestmark = pytest.mark.pure

ONE = ModelProfile(layers=[LayerProfile(name="l0", forward_s=2, backward_s=4,
                                        activation_bytes=10, parameter_bytes=100)],
                   batch_size=32)
VGG = "tests/data/profiles/vgg16.graph.txt"


def flat(devices: int, bandwidth_Bps: float = 100.0, latency_s: float = 0.0) -> Cluster:
    return Cluster(levels=(Level(num_units=devices, bandwidth_Bps=bandwidth_Bps,
                                 latency_s=latency_s),))


def plan(workers: int, sync: SyncSpec, profile: ModelProfile = ONE) -> Plan:
    servers = getattr(sync, "servers", 0)
    return dataclasses.replace(data_parallel_plan(profile, workers),
                               num_devices=workers + servers, sync=sync)


def table(result: SimResult, steps: set[int], ranks: set[int] | None = None) -> str:
    """``rank action start end`` of the given steps (and ranks), in time order per rank."""
    rows = ["r  action  start  end"]
    events = [e for e in result.timeline.events
              if e.step in steps and (ranks is None or e.worker in ranks)]
    for e in sorted(events, key=lambda e: (e.worker, e.start_s, e.name)):
        rows.append(f"{e.worker}  {e.name:<6}  {e.start_s:g}  {e.end_s:g}")
    return "\n".join(rows)


def test_sync_ps_two_workers_timeline() -> None:
    # Rank 0 is the server (its update: 100 bytes at 100 B/s = 1 s), ranks 1-2 the workers
    # (forward 1 s, backward 2 s). Step 0: both push at 3; the server's port takes the pushes
    # one after the other (incast: 3-4, 4-5), updates 5-6 and replies one after the other
    # (6-7, 7-8). Worker 1 thus starts step 1 a second before worker 2 and its push (10-11)
    # is done when worker 2's begins (11-12): from then on a step is
    # compute 3 + the last push 1 + the update 1 + both pulls 2 = 7 s.
    result = simulate(plan(2, ParameterServerSync()), ONE, flat(3),
                      SimOptions(optimizer_Bps=100.0))
    assert normalized(table(result, {0, 1})) == normalized(drawn("""
        r  action  start  end
        0  0ST     5      6
        0  0ST     12     13
        1  0F0     0      1
        1  0B0     1      3
        1  0PU     3      4
        1  0PL     4      7
        1  0F0     7      8
        1  0B0     8      10
        1  0PU     10     11
        1  0PL     11     14
        2  0F0     0      1
        2  0B0     1      3
        2  0PU     3      5
        2  0PL     5      8
        2  0F0     8      9
        2  0B0     9      11
        2  0PU     11     12
        2  0PL     12     15
    """))
    assert result.step_time_s == pytest.approx(7.0)
    assert [w.role for w in result.workers] == ["server", "worker", "worker"]
    assert result.workers[1].busy_s == pytest.approx(3.0)
    assert result.workers[1].communication_s == pytest.approx(2.0)  # its push and its pull
    assert result.workers[0].busy_s == pytest.approx(1.0)  # one update per step


# The same model as two layers of 50 bytes, so that two servers hold a shard each.
HALVES = ModelProfile(layers=[LayerProfile(name=f"l{i}", forward_s=1, backward_s=2,
                                           activation_bytes=5, parameter_bytes=50)
                              for i in range(2)], batch_size=32)


@pytest.mark.parametrize(("workers", "servers", "expected"), [
    # compute 6/W + the last worker's push (its whole gradient through its own port, 1 s)
    # + the W pulls of a server's shard (100/S bytes each) one after another through its port
    (2, 1, 3 + 1 + 2 * 1),
    (4, 1, 1.5 + 1 + 4 * 1),
    (4, 2, 1.5 + 1 + 4 * 0.5),
    (8, 2, 0.75 + 1 + 8 * 0.5),
])
def test_sync_ps_step_table(workers: int, servers: int, expected: float) -> None:
    result = simulate(plan(workers, ParameterServerSync(servers=servers), HALVES), HALVES,
                      flat(workers + servers))
    assert result.step_time_s == pytest.approx(expected)


def test_gossip_ring_of_four() -> None:
    # Each worker computes 1.5 s, then sends its 100 bytes to both neighbours and receives
    # theirs: its port carries 2 x 100 bytes each way, 2 s; a round is 3.5 s.
    result = simulate(plan(4, GossipSync(topology="ring")), ONE, flat(4))
    assert normalized(table(result, {0}, {0})) == normalized(drawn("""
        r  action  start  end
        0  0F0     0      0.5
        0  0B0     0.5    1.5
        0  0GX     1.5    3.5
        0  0ST     3.5    3.5
    """))
    assert result.step_time_s == pytest.approx(3.5)
    exchange = next(e for e in result.timeline.events if e.name == "0GX")
    assert exchange.bytes == 200
    assert all(w.communication_s == pytest.approx(2.0) for w in result.workers)


def test_gossip_port_carries_degree_times_parameters() -> None:
    # complete graph of 4: degree 3, 300 bytes each way through every port
    result = simulate(plan(4, GossipSync(topology="complete")), ONE, flat(4))
    assert result.step_time_s == pytest.approx(1.5 + 3.0)


@pytest.mark.parametrize(("period", "expected"), [(1, 3.0), (2, 2.25), (4, 1.875)])
def test_local_sgd_mean_step(period: int, expected: float) -> None:
    # compute 1.5 s per step; a ring allreduce of 100 bytes over 4: 2 (4-1) x 25 bytes = 1.5 s,
    # once per period: mean step = 1.5 + 1.5 / H
    options = SimOptions(allreduce="ring")
    local = simulate(plan(4, LocalSGDSync(period=period)), ONE, flat(4), options)
    elastic = simulate(plan(4, ElasticAveragingSync(period=period)), ONE, flat(4), options)
    assert local.step_time_s == pytest.approx(expected)
    assert elastic.step_time_s == pytest.approx(expected)  # one allreduce of the difference
    assert [e.name for e in local.timeline.events if e.worker == 0][-2:] == ["0ST", "0AR"]


def test_backup_workers_gain_only_port_queueing() -> None:
    # Without variability between workers, backup workers only spare the update the wait for
    # the last pushes' transfers: on a free network the step is the same as without them.
    free = flat(5, bandwidth_Bps=1e12)
    sync, backup = ParameterServerSync(), ParameterServerSync(backup=1)
    assert (simulate(plan(4, backup), ONE, free).step_time_s
            == pytest.approx(simulate(plan(4, sync), ONE, free).step_time_s))
    slow = flat(5)
    assert (simulate(plan(4, backup), ONE, slow).step_time_s
            <= simulate(plan(4, sync), ONE, slow).step_time_s)


@pytest.mark.parametrize("workers", [2, 4, 8])
@pytest.mark.parametrize("bandwidth", [10.0, 100.0, 1e4])
def test_async_ps_throughput_at_least_sync(workers: int, bandwidth: float) -> None:
    cluster = flat(workers + 1, bandwidth)
    sync = simulate(plan(workers, ParameterServerSync()), ONE, cluster)
    asynchronous = simulate(plan(workers, ParameterServerSync(mode="async")), ONE, cluster)
    assert asynchronous.samples_per_s >= sync.samples_per_s * (1 - 1e-9)
    assert "between its own updates" in asynchronous.step_meaning


def test_ssp_with_zero_staleness_is_no_faster_than_async() -> None:
    cluster = flat(3)
    ssp = simulate(plan(2, ParameterServerSync(mode="ssp", staleness=0)), ONE, cluster)
    free = simulate(plan(2, ParameterServerSync(mode="async")), ONE, cluster)
    assert ssp.step_time_s >= free.step_time_s


def test_ad_psgd_active_worker_sends_and_receives_one_model() -> None:
    result = simulate(plan(4, GossipSync(topology="ring", asynchronous=True)), ONE, flat(4))
    assert result.step_time_s == pytest.approx(1.5 + 1 + 1)  # compute, send, receive back
    assert result.updates_per_s > 4 / result.step_time_s  # passive workers only compute


def test_dpsgd_beats_ps_on_slow_networks_and_crossover() -> None:
    # Lian et al. 2017: on a slow, high-latency network D-PSGD is faster than a parameter
    # server; on a fast one the server's workers, which neither mix nor step, catch up.
    profile = load_profile(VGG)
    found = gossip_vs_ps(profile, num_workers=16, latency_s=1e-3,
                         options=SimOptions(optimizer_Bps=50e9))
    slow = found.points[0]
    assert slow[2] > 5 * slow[1]  # at 80 Mb/s gossip is several times faster
    assert found.crossover_Bps is not None and 1e11 < found.crossover_Bps < 1e12
    assert found.points[-1][2] < found.points[-1][1]  # past it, the server wins
    no_optimizer = gossip_vs_ps(profile, num_workers=16, latency_s=1e-3)
    assert no_optimizer.crossover_Bps is None


def test_ps_needs_devices_for_its_servers() -> None:
    with pytest.raises(UsageError, match="parameter server"):
        simulate(plan(4, ParameterServerSync(servers=2)), ONE, flat(5))


def test_best_of_families_reports_each() -> None:
    best = best_of_families(load_profile(VGG), flat(8, 1.25e9))
    assert set(best) == {"ps", "gossip", "localsgd", "easgd"}
    assert all(c.result.method == name for name, c in best.items())


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_simulates_families_from_flags_and_files(capsys, tmp_path) -> None:
    common = ["simulate", "--profile", VGG, "--devices", "5", "--bandwidth", "10Gb/s"]
    code, out, err = run(capsys, *common, "--plan", "ps", "--servers", "1", "--mode", "async",
                         "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["method"] == "ps" and data["updates_per_s"] > 0 and "step = " in err
    assert [w["role"] for w in data["workers"]].count("server") == 1
    path = tmp_path / "gossip.json"
    plan(4, GossipSync(topology="ring"), load_profile(VGG)).save(str(path))
    code, out, err = run(capsys, *common, "--plan", str(path), "--json")
    assert code == 0, err
    assert json.loads(out)["method"] == "gossip"


@pytest.mark.parametrize(("argv", "words"), [
    (["--plan", "gossip", "--servers", "2"], "--servers applies to --plan ps"),
    (["--plan", "ps", "--staleness", "3"], "--staleness applies to --mode ssp"),
    (["--plan", "ps", "--servers", "5"], "leaves no worker"),
    (["--plan", "localsgd", "--period", "0"], "--period"),
])
def test_cli_family_mistakes_are_one_line(capsys, argv: list[str], words: str) -> None:
    code, out, err = run(capsys, "simulate", "--profile", VGG, "--devices", "5",
                         "--bandwidth", "10Gb/s", *argv)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1
