"""From a profile and a cluster to a :class:`~tandem.plan.Plan`, timing the solve.

Usage::

    plan = make_plan(profile, cluster, PartitionOptions(activation_compression=None))
    print(plan.config, plan.bottleneck_s)
"""

from __future__ import annotations

import math
import time

from tandem.cluster import Cluster
from tandem.plan import Plan, Stage
from tandem.planning.partition import Partition, PartitionOptions, partition
from tandem.profile import ModelProfile, topological_order


def make_plan(
    profile: ModelProfile, cluster: Cluster, options: PartitionOptions | None = None
) -> Plan:
    """Solve PipeDream's partitioning and describe the result as a plan."""
    options = options or PartitionOptions()
    started = time.perf_counter()
    solved = partition(profile, cluster, options)
    solve_s = time.perf_counter() - started
    order = _layer_order(profile, solved)
    stages = _stages(profile, solved, order)
    return Plan(
        stages=stages,
        num_layers=profile.num_layers,
        num_devices=cluster.num_devices,
        bottleneck_s=solved.bottleneck_s,
        single_s=solved.single_s,
        data_parallel_s=solved.data_parallel_s,
        layer_order=None if order == list(range(profile.num_layers)) else order,
        level_configs=list(solved.level_configs),
        predicted_schedule="pipedream",
        solve_s=solve_s,
        options={
            "activation_compression": options.activation_compression,
            "gradient_compression": options.gradient_compression,
            "straight": options.straight,
            "allow_idle": options.allow_idle,
            "memory_bytes": options.memory_bytes or cluster.memory_bytes,
        },
    )


def _layer_order(profile: ModelProfile, solved: Partition) -> list[int]:
    rank = {layer: position for position, layer in
            enumerate(topological_order(profile.num_layers, profile.edge_list()))}  # fmt: skip
    order: list[int] = []
    for choice in solved.stages:
        order.extend(sorted(solved.states.layers_between(choice.before, choice.state), key=rank.get))
    return order


def _stages(profile: ModelProfile, solved: Partition, order: list[int]) -> list[Stage]:
    stages: list[Stage] = []
    position = 0
    total_replicas = [choice.replicas for choice in solved.stages]
    for index, choice in enumerate(solved.stages):
        layers = [profile.layers[i] for i in order[position : position + _size(solved, choice)]]
        params = sum(layer.parameter_bytes for layer in layers)
        stash = sum(layer.activation_bytes for layer in layers)
        downstream = sum(total_replicas[index + 1 :])
        in_flight = 1 + math.ceil(downstream / choice.replicas)
        stages.append(Stage(
            start=position, end=position + len(layers), replicas=choice.replicas,
            time_s=choice.time_s, compute_s=sum(layer.compute_s for layer in layers),
            parameter_bytes=params, memory_bytes=in_flight * (stash + params)))  # fmt: skip
        position += len(layers)
    return stages


def _size(solved: Partition, choice: object) -> int:
    return len(solved.states.layers_between(choice.before, choice.state))  # type: ignore[attr-defined]
