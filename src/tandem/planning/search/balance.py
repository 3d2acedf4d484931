"""Stage boundaries that balance compute for given replica counts, along a fixed layer order.

Usage::

    plan = balanced_plan(profile, [2, 1, 1], schedule=ScheduleKind.ONE_F_ONE_B, num_microbatches=8)

Stage ``s`` gets a contiguous run of layers whose compute divided by its replica count is as
small as possible for the slowest stage (a bottleneck search over a greedy fill, which is exact
for contiguous stages). Communication is not considered: this is a starting point for the
simulator and the search, not a plan of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.cluster import flat_cluster
from tandem.errors import UsageError
from tandem.plan import Plan, Stage
from tandem.planning.partition.pipedream import PartitionOptions
from tandem.planning.search.planner import partition_plan
from tandem.profile import ModelProfile, topological_order
from tandem.spec.kinds import ScheduleKind


def layer_order(profile: ModelProfile) -> list[int]:
    """The profile's layers in a topological order (index order for a chain)."""
    return topological_order(profile.num_layers, profile.edge_list())


def balanced_bounds(times: Sequence[float], replicas: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, end)`` per stage minimizing ``max(sum(times[start:end]) / replicas[s])``."""
    if len(replicas) > len(times):
        raise UsageError(f"{len(replicas)} stages need at least as many layers (the profile has "
                         f"{len(times)})")
    low, high = 0.0, sum(times)
    bounds = _fill(times, replicas, high)
    assert bounds is not None
    for _ in range(60):
        middle = (low + high) / 2
        attempt = _fill(times, replicas, middle)
        if attempt is None:
            low = middle
        else:
            high, bounds = middle, attempt
    return bounds


def pipeline_bounds(profile: ModelProfile, replicas: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, end)`` per stage of a chain of layers on ``replicas`` devices per stage: the
    partitioner of ``tandem plan --straight`` when every stage has one device, else
    :func:`balanced_bounds` for those replica counts (compute only, communication ignored)."""
    if any(count != 1 for count in replicas):
        return balanced_bounds([layer.compute_s for layer in profile.layers], replicas)
    # one device per stage and activations ignored: no transfer is costed, so any bandwidth
    cluster = flat_cluster(num_devices=len(replicas), bandwidth=1e9)
    plan = partition_plan(profile, cluster,
                          PartitionOptions(straight=True, activation_compression=None))
    assert plan.layer_order is None, "a chain's layers stay in order"
    return [(stage.start, stage.end) for stage in plan.stages]


def _fill(times: Sequence[float], replicas: Sequence[int], limit: float) -> list[tuple[int, int]] | None:
    """Give each stage as many layers as fit under ``limit`` (at least one, leaving one for
    each later stage); None if the layers do not all fit."""
    bounds, start, n = [], 0, len(times)
    for index, count in enumerate(replicas):
        last_end = n - (len(replicas) - index - 1)
        end, total = start + 1, times[start]
        while end < last_end and (total + times[end]) / count <= limit:
            total += times[end]
            end += 1
        if total / count > limit * (1 + 1e-12) + 1e-15:
            return None
        bounds.append((start, end))
        start = end
    return bounds if start == n else None


def balanced_plan(profile: ModelProfile, replicas: Sequence[int], *, schedule: ScheduleKind,
                  num_microbatches: int | None, order: list[int] | None = None) -> Plan:
    """A plan with ``replicas`` per stage and compute-balanced boundaries along ``order``."""
    order = order or layer_order(profile)
    times = [profile.layers[layer].compute_s for layer in order]
    bounds = balanced_bounds(times, replicas)
    return Plan(
        stages=[Stage(start=s, end=e, replicas=r) for (s, e), r in zip(bounds, replicas)],
        num_layers=profile.num_layers, num_devices=sum(replicas),
        layer_order=None if order == list(range(profile.num_layers)) else order,
        schedule=schedule, num_microbatches=num_microbatches,
    )
