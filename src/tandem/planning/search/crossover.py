"""The network bandwidth at which decentralized gossip (D-PSGD) and a parameter server trade
places, found by the simulator (Lian et al. 2017: on slow networks D-PSGD wins).

Usage::

    found = gossip_vs_ps(profile, num_workers=16, latency_s=1e-3, options=SimOptions(
        optimizer_Bps=50e9))
    found.crossover_Bps, found.points

    .venv/bin/python -m tandem.planning.search.crossover PROFILE WORKERS LATENCY_S OPTIMIZER_Bps

Both run ``num_workers`` workers of one stage on a flat cluster of that bandwidth and latency:
D-PSGD on a ring, and a synchronous parameter server on one more device. Per step a ring
worker's port carries ``2 P`` each way (one latency), the server's ``W P`` (two latencies),
so on slow networks gossip is faster. On fast ones both are bound by compute, and the parameter
server wins by what its workers do not do: they neither mix their neighbours' parameters nor
step (one optimizer pass on the server per update, against three passes on every gossip
worker: two neighbours mixed in and a step), which costs time when ``optimizer_Bps`` says so.
Without it the two only meet at infinite bandwidth, and :attr:`Crossover.crossover_Bps` is None.
"""

from __future__ import annotations

import dataclasses
import math
import sys

from tandem.cluster import Cluster, Level
from tandem.plan import Plan
from tandem.planning.simulate.simulator import SimOptions, data_parallel_plan, simulate
from tandem.profile import ModelProfile, load_profile
from tandem.spec.sync import GossipSync, ParameterServerSync


@dataclasses.dataclass(kw_only=True, slots=True)
class Crossover:
    """Step times of both methods per bandwidth, and where they cross."""

    points: list[tuple[float, float, float]]
    """``(bandwidth B/s, gossip step s, parameter-server step s)``, slowest network first."""
    crossover_Bps: float | None
    """The bandwidth below which gossip is faster (None: it is faster on every network tried)."""


def _steps(profile: ModelProfile, workers: int, bandwidth_Bps: float, latency_s: float,
           options: SimOptions) -> tuple[float, float]:
    cluster = Cluster(levels=(Level(num_units=workers + 1, bandwidth_Bps=bandwidth_Bps,
                                    latency_s=latency_s),))
    base = data_parallel_plan(profile, workers)
    plans: list[Plan] = [
        dataclasses.replace(base, num_devices=workers + 1, sync=GossipSync(topology="ring")),
        dataclasses.replace(base, num_devices=workers + 1, sync=ParameterServerSync(servers=1)),
    ]
    gossip, ps = (simulate(plan, profile, cluster, options).step_time_s for plan in plans)
    return gossip, ps


def gossip_vs_ps(profile: ModelProfile, *, num_workers: int, latency_s: float,
                 options: SimOptions | None = None, low_Bps: float = 1e7,
                 high_Bps: float = 1e13) -> Crossover:
    """Step times from ``low_Bps`` to ``high_Bps`` (a factor of ~3 apart), and the crossover
    bandwidth, bisected on a log scale to 1%."""
    options = dataclasses.replace(options or SimOptions(), record=False)
    points = []
    count = max(2, round(2 * math.log10(high_Bps / low_Bps)) + 1)
    for k in range(count):
        bandwidth = low_Bps * (high_Bps / low_Bps) ** (k / (count - 1))
        points.append((bandwidth, *_steps(profile, num_workers, bandwidth, latency_s, options)))
    crossing = next((k for k in range(1, count) if points[k][1] >= points[k][2]), None)
    if crossing is None:
        return Crossover(points=points, crossover_Bps=None)
    low, high = points[crossing - 1][0], points[crossing][0]
    while high / low > 1.01:
        middle = math.sqrt(low * high)
        gossip, ps = _steps(profile, num_workers, middle, latency_s, options)
        low, high = (middle, high) if gossip < ps else (low, middle)
    return Crossover(points=points, crossover_Bps=math.sqrt(low * high))


def main(argv: list[str]) -> None:
    """``PROFILE WORKERS LATENCY_S OPTIMIZER_Bps``: print the table and the crossover."""
    profile = load_profile(argv[0])
    found = gossip_vs_ps(profile, num_workers=int(argv[1]), latency_s=float(argv[2]),
                         options=SimOptions(optimizer_Bps=float(argv[3]) or None))
    print(f"{'bandwidth':>12} {'gossip ms':>11} {'ps ms':>11} {'ps/gossip':>9}")
    for bandwidth, gossip, ps in found.points:
        print(f"{bandwidth * 8 / 1e9:9.3g} Gb/s {gossip * 1e3:11.1f} {ps * 1e3:11.1f} {ps / gossip:9.2f}")
    where = (f"{found.crossover_Bps * 8 / 1e9:.3g} Gb/s" if found.crossover_Bps
             else "none: gossip is faster on every network tried")
    print(f"crossover: {where}")


if __name__ == "__main__":
    main(sys.argv[1:])
