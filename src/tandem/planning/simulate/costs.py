"""What each stage of a plan costs on a profile: compute, bytes crossing, memory, DDP buckets.

Usage::

    check_plan(plan, profile, cluster)          # UsageError if they do not fit together
    costs = stage_costs(plan, profile)
    costs[0].forward_s, costs[0].output_bytes
"""

from __future__ import annotations

import dataclasses

from tandem.cluster import Cluster
from tandem.errors import UsageError
from tandem.plan import Plan
from tandem.profile import ModelProfile

DDP_BUCKET_BYTES = 25 * 2**20
"""PyTorch DDP's default bucket cap (``bucket_cap_mb=25``)."""
DDP_FIRST_BUCKET_BYTES = 2**20
"""DDP's first bucket (the last layers' gradients) is capped at 1 MiB so it starts early."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StageCost:
    """One stage's costs for one whole minibatch of the profile, on a device of speed 1."""

    forward_s: float
    """Forward seconds of the stage's layers."""
    backward_s: float
    """Backward seconds of the stage's layers."""
    parameter_bytes: float
    """Bytes of the stage's parameters (and of its gradients)."""
    activation_bytes: float
    """Bytes a forward keeps for the backward: the outputs of the stage's layers."""
    output_bytes: float
    """Bytes sent to the next stage: every output of this or an earlier stage that a later
    stage reads (0 for the last stage)."""
    buckets: tuple[tuple[float, float], ...]
    """DDP gradient buckets in the order they fill: ``(backward seconds until the bucket's
    gradients are all computed, bucket bytes)``."""
    forward_fixed_s: float = 0.0
    """The part of ``forward_s`` paid once per call, whatever the micro-batch (the layers'
    ``forward_fixed_s``)."""
    backward_fixed_s: float = 0.0
    """The part of ``backward_s`` paid once per call."""
    bucket_tensors: tuple[tuple[float, ...], ...] = ()
    """Per bucket of ``buckets``, the parameter bytes of each layer in it (a layer's
    parameters counted as one tensor), for codecs whose payload is per tensor."""


def check_plan(plan: Plan, profile: ModelProfile, cluster: Cluster) -> None:
    """Raise :class:`UsageError` (one line, with the fix) unless the plan fits the profile and
    the cluster."""
    if plan.num_layers != profile.num_layers:
        last = max(stage.end for stage in plan.stages) - 1
        raise UsageError(
            f"the plan's stages cover layers 0..{last} but the profile "
            f"{profile.model or profile.source or ''!s} has {profile.num_layers} layers "
            f"(0..{profile.num_layers - 1}); make the plan for this profile "
            f"(tandem plan --profile ... -o plan.json)"
        )
    order = plan.layers()
    if sorted(order) != list(range(profile.num_layers)):
        raise UsageError("the plan's layer_order is not a permutation of the profile's layers; "
                         "make the plan for this profile")
    _check_order(order, profile)
    degree = plan.tensor_degree
    workers = sum(stage.replicas for stage in plan.stages) * degree
    if workers > cluster.num_devices:
        tensor = f" of tensor degree {degree}" if degree > 1 else ""
        raise UsageError(
            f"plan {plan.config}{tensor} needs {workers} workers but the cluster has "
            f"{cluster.num_devices} devices; use a cluster with at least {workers} devices "
            f"or fewer replicas"
        )
    leads = [d for stage in plan.stages for d in (stage.devices or [])]
    devices = [d for lead in leads for d in range(lead, lead + degree)]
    if any(not 0 <= d < cluster.num_devices for d in devices) or len(set(devices)) < len(devices):
        groups = f" (each the first of {degree} adjacent devices)" if degree > 1 else ""
        raise UsageError(
            f"the plan's device assignment {leads}{groups} names a device twice or one outside "
            f"0..{cluster.num_devices - 1}"
        )


def _check_order(order: list[int], profile: ModelProfile) -> None:
    position = {layer: index for index, layer in enumerate(order)}
    for producer, consumer in profile.edge_list():
        if position[producer] > position[consumer]:
            raise UsageError(
                f"the plan's layer order runs layer {consumer} before its input {producer}; "
                "make the plan for this profile"
            )


def stage_costs(plan: Plan, profile: ModelProfile, *,
                bucket_bytes: float = DDP_BUCKET_BYTES,
                first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES) -> list[StageCost]:
    """The costs of every stage of ``plan`` (checked with :func:`check_plan` first)."""
    crossing = boundary_bytes(plan, profile)
    costs = []
    for index in range(len(plan.stages)):
        layers = [profile.layers[i] for i in plan.stage_layers(index)]
        buckets = _buckets([(layer.backward_s, layer.parameter_bytes) for layer in layers],
                           bucket_bytes, first_bucket_bytes)
        costs.append(StageCost(
            forward_s=sum(layer.forward_s for layer in layers),
            backward_s=sum(layer.backward_s for layer in layers),
            forward_fixed_s=sum(layer.forward_fixed_s for layer in layers),
            backward_fixed_s=sum(layer.backward_fixed_s for layer in layers),
            parameter_bytes=sum(layer.parameter_bytes for layer in layers),
            activation_bytes=sum(layer.activation_bytes for layer in layers),
            output_bytes=crossing[index],
            buckets=tuple((ready, sum(sizes)) for ready, sizes in buckets),
            bucket_tensors=tuple(sizes for _, sizes in buckets),
        ))
    return costs


def boundary_bytes(plan: Plan, profile: ModelProfile) -> list[float]:
    """Bytes crossing from stage ``s`` to ``s + 1`` for every ``s`` (last entry 0): each layer's
    output crosses every boundary between its stage and the last stage that reads it."""
    stage_of: dict[int, int] = {}
    for index in range(len(plan.stages)):
        for layer in plan.stage_layers(index):
            stage_of[layer] = index
    last_reader = dict(stage_of)
    for producer, consumer in profile.edge_list():
        last_reader[producer] = max(last_reader[producer], stage_of[consumer])
    crossing = [0.0] * len(plan.stages)
    for layer, stage in stage_of.items():
        for boundary in range(stage, last_reader[layer]):
            crossing[boundary] += profile.layers[layer].activation_bytes
    return crossing


def _buckets(layers: list[tuple[float, float]], cap: float,
             first_cap: float) -> list[tuple[float, tuple[float, ...]]]:
    """DDP's buckets as ``(ready seconds, each layer's parameter bytes)``: gradients in reverse
    layer order (the order backward produces them), a bucket closing once it holds ``cap``
    bytes (``first_cap`` for the first)."""
    buckets: list[tuple[float, tuple[float, ...]]] = []
    elapsed = ready = 0.0
    sizes: list[float] = []
    for backward_s, parameter_bytes in reversed(layers):
        elapsed += backward_s
        if parameter_bytes <= 0:
            continue
        sizes.append(parameter_bytes)
        ready = elapsed
        if sum(sizes) >= (first_cap if not buckets else cap):
            buckets.append((ready, tuple(sizes)))
            sizes = []
    if sizes:
        buckets.append((ready, tuple(sizes)))
    return buckets
