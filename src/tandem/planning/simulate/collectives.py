"""Cost of communication on a hierarchical cluster: links, ports and collective algorithms.

Usage::

    level = link_level(cluster, 3, 12)                       # 1: different servers
    seconds = allreduce_s(cluster, range(16), 553e6, "auto")
    seconds = allgather_s(cluster, range(16), 17e6, "auto")  # 1-bit gradients, say

Devices are numbered so that consecutive devices share the innermost unit (device ``d`` sits in
server ``d // 8`` of ``8x300GB/s,4x25Gb/s``). Two devices talk over the outermost level at which
they sit in different units. Level ``l`` is ``num_units`` units joined by links of
``bandwidth_Bps``; each unit (a device at level 0, a server at level 1, ...) has one such link,
full duplex, shared by all the traffic of its devices at that level — its *port*.

Allreduce of ``S`` bytes over ``n`` devices, with ``α`` and ``B`` the latency and bandwidth of the
slowest level the group spans (Thakur, Rabenseifner and Gropp, 2005; NCCL's tree is pipelined):

- ``ring``: ``2 (n - 1) (α + S / (n B))`` — a ring in device order crosses each port once per step;
- ``tree``: ``2 ceil(log2 n) α + 2 S / B`` — reduce up and broadcast down a pipelined tree;
- ``hierarchical``: reduce-scatter inside each unit, level by level, allreduce across the
  outermost units, all-gather back: ``sum over levels l of 2 (n_l - 1) (α_l + S / (n_l B_l))``
  where ``n_l`` is how many units of level ``l`` the group has inside one unit of level
  ``l + 1``. The devices of a unit share its port, so each level moves ``S`` per unit;
- ``auto``: the cheapest of the three, as NCCL's tuner would pick.

Allgather of ``S`` bytes from each of ``n`` devices (every device ends with all ``n S``), which
compression codecs whose payloads do not add up use:

- ``ring``: ``(n - 1) (α + S / B)`` — ``n - 1`` steps, each forwarding one device's payload;
- ``hierarchical``: level by level from the outermost, each device exchanging what it holds with
  its peers in the other units: ``sum over levels l of (n_l - 1) (α_l + n S / (n_l B_l))`` (the
  ``n / n_l`` payloads a unit's devices forward in a step share its port);
- ``tree``: libraries have no tree allgather (NCCL's is a ring), so it is the ring;
- ``auto``: the cheaper of ring and hierarchical.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from tandem.cluster import Cluster
from tandem.errors import UsageError

ALGORITHMS = ("auto", "ring", "tree", "hierarchical")
"""Allreduce algorithms the simulator knows."""


def unit_sizes(cluster: Cluster) -> tuple[int, ...]:
    """Devices per unit of each level, innermost first: ``(1, 8)`` for ``8x..,4x..``."""
    return tuple(cluster.devices_per_unit(index) for index in range(len(cluster.levels)))


def link_level(cluster: Cluster, a: int, b: int, sizes: Sequence[int] | None = None) -> int:
    """The level whose links join devices ``a`` and ``b`` (the outermost one they differ at)."""
    sizes = sizes or unit_sizes(cluster)
    for level in range(len(sizes) - 1, -1, -1):
        if a // sizes[level] != b // sizes[level]:
            return level
    raise ValueError(f"a device does not send to itself (devices {a} and {b})")


def port(level: int, device: int, sizes: Sequence[int]) -> int:
    """Identifier of the port ``device`` uses at ``level`` (its unit's link)."""
    return (device // sizes[level]) * len(sizes) + level


def transfer_s(cluster: Cluster, level: int, num_bytes: float) -> float:
    """Seconds to move ``num_bytes`` over one link of ``level``, latency included."""
    spec = cluster.levels[level]
    return spec.latency_s + num_bytes / spec.bandwidth_Bps


def branching(cluster: Cluster, devices: Iterable[int]) -> list[int]:
    """For each level, how many of its units the group has inside one unit of the next level
    (the most over such units): ``[4, 2]`` for 4 devices on each of 2 servers."""
    sizes = unit_sizes(cluster)
    group = sorted(set(devices))
    counts = []
    for level in range(len(sizes)):
        outer = sizes[level + 1] if level + 1 < len(sizes) else math.inf
        per_parent: dict[float, set[int]] = {}
        for device in group:
            parent = device // outer if outer != math.inf else 0
            per_parent.setdefault(parent, set()).add(device // sizes[level])
        counts.append(max(len(units) for units in per_parent.values()))
    return counts


def allreduce_s(cluster: Cluster, devices: Iterable[int], num_bytes: float,
                algorithm: str = "auto", latency_s: float | None = None) -> float:
    """Seconds to allreduce ``num_bytes`` over ``devices`` with ``algorithm``; ``latency_s``
    replaces every level's latency for the collective's steps when given (collective libraries
    often pay more per step than a point-to-point message does)."""
    span = _span(cluster, devices, algorithm, latency_s)
    if span is None or num_bytes <= 0:
        return 0.0
    fanout, latency, alpha, bandwidth = span
    n = math.prod(fanout)
    costs = {
        "ring": ring_s(n, num_bytes, alpha, bandwidth),
        "tree": tree_s(n, num_bytes, alpha, bandwidth),
        "hierarchical": sum(
            ring_s(count, num_bytes, latency[level], cluster.levels[level].bandwidth_Bps)
            for level, count in enumerate(fanout) if count > 1
        ),
    }
    return min(costs.values()) if algorithm == "auto" else costs[algorithm]


def allgather_s(cluster: Cluster, devices: Iterable[int], num_bytes: float,
                algorithm: str = "auto", latency_s: float | None = None) -> float:
    """Seconds to allgather ``num_bytes`` from each of ``devices`` with ``algorithm`` (``tree``
    runs the ring; see the module docstring); ``latency_s`` as for :func:`allreduce_s`."""
    span = _span(cluster, devices, algorithm, latency_s)
    if span is None or num_bytes <= 0:
        return 0.0
    fanout, latency, alpha, bandwidth = span
    n = math.prod(fanout)
    ring = ring_allgather_s(n, num_bytes, alpha, bandwidth)
    hierarchical = sum(
        ring_allgather_s(count, num_bytes * n / count, latency[level],
                         cluster.levels[level].bandwidth_Bps)
        for level, count in enumerate(fanout) if count > 1
    )
    if algorithm == "hierarchical":
        return hierarchical
    return min(ring, hierarchical) if algorithm == "auto" else ring


def collective_s(cluster: Cluster, collective: str, devices: Iterable[int], num_bytes: float,
                 algorithm: str = "auto", latency_s: float | None = None) -> float:
    """Seconds of an ``allreduce`` or ``allgather`` of ``num_bytes`` per device."""
    if collective == "allreduce":
        return allreduce_s(cluster, devices, num_bytes, algorithm, latency_s)
    if collective == "allgather":
        return allgather_s(cluster, devices, num_bytes, algorithm, latency_s)
    raise ValueError(f"unknown collective {collective!r}; expected allreduce or allgather")


def _span(cluster: Cluster, devices: Iterable[int], algorithm: str,
          latency_s: float | None) -> tuple[list[int], list[float], float, float] | None:
    """``(fanout per level, latency per level, α, B)`` of a collective over ``devices``: α the
    largest latency and B the slowest bandwidth of the levels it spans; None for one device."""
    if algorithm not in ALGORITHMS:
        raise UsageError(f"unknown allreduce algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")
    fanout = branching(cluster, devices)
    if math.prod(fanout) <= 1:
        return None
    spanned = [level for level, count in enumerate(fanout) if count > 1]
    latency = [cluster.levels[level].latency_s if latency_s is None else latency_s
               for level in range(len(fanout))]
    slowest = min(spanned, key=lambda level: cluster.levels[level].bandwidth_Bps)
    alpha = max(latency[level] for level in spanned)
    return fanout, latency, alpha, cluster.levels[slowest].bandwidth_Bps


def ring_s(n: int, num_bytes: float, latency_s: float, bandwidth_Bps: float) -> float:
    """Ring allreduce: reduce-scatter then all-gather, ``2 (n - 1)`` steps of ``S / n`` bytes."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * (latency_s + num_bytes / (n * bandwidth_Bps))


def tree_s(n: int, num_bytes: float, latency_s: float, bandwidth_Bps: float) -> float:
    """Pipelined tree allreduce: ``2 log2 n`` latencies, ``2 S`` bytes through the busiest link."""
    if n <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * latency_s + 2 * num_bytes / bandwidth_Bps


def ring_allgather_s(n: int, num_bytes: float, latency_s: float, bandwidth_Bps: float) -> float:
    """Ring allgather: ``n - 1`` steps, each forwarding ``S`` bytes (one device's payload)."""
    if n <= 1:
        return 0.0
    return (n - 1) * (latency_s + num_bytes / bandwidth_Bps)
