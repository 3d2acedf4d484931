"""Tensor (intra-layer) parallelism and activation recomputation in the cost model.

Usage::

    per_device = split_profile(profile, 4)            # what one of 4 tensor devices computes
    seconds = tensor_allreduce_s(cluster, profile, layers, group=range(4), share=0.25)
    degrees = tensor_degrees(cluster, max_degree=8)   # what the search and scale try

A profile made by ``tandem profile`` of a reference model says how its tensor plan splits each
layer (``LayerProfile.tensor_allreduces``: the allreduces a split layer adds to its forward and
to its backward, ``(0, 0)`` for a layer that stays whole): a GPT block holds two column/row pairs
(attention, MLP), so two allreduces each way; its embedding and vocabulary projection stay whole
although they have parameters. Every allreduce is costed at the size of the layer's output
activation (exact for a GPT block, whose input and output have the same size; a column-wise
layer's backward allreduce is really of its input's gradient). A profile that does not say
(``None``; PipeDream's, or a user's model) is split by one rule: **a layer with parameters is
split** Megatron-style across the ``T`` devices of its stage replica (its compute beyond the
fixed cost per call and its parameter bytes divide by ``T``, and it ends with one allreduce of
its output activation among the ``T`` devices in the forward and one in the backward); **a
layer without parameters runs whole on every one of them** (activations, pooling, normalization
without weights). Activations are not divided: the output of a split layer is whole on every
device after its allreduce, so each device holds the same activations as without tensor
parallelism.

The ``T`` devices of one stage replica are adjacent (``lead .. lead + T - 1``), so they share
the innermost unit when ``T`` divides it and their allreduces run over its links.

Recomputation (``Plan.recompute``) is costed in :mod:`tandem.planning.simulate.simulator` and
:mod:`tandem.planning.partition.memory`: a backward runs the stage's forward again first, and a stage
holds only its input per micro-batch in flight, plus one micro-batch's full activations while
it recomputes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from tandem.cluster import Cluster, Level
from tandem.errors import UsageError
from tandem.plan import Plan
from tandem.planning.simulate.collectives import allreduce_s, branching, unit_sizes
from tandem.profile import LayerProfile, ModelProfile

DEFAULT_MAX_TENSOR_DEGREE = 8
"""Largest tensor degree the search and the scale analysis try by default (Megatron keeps its
tensor groups inside one server of 8)."""


def is_split(layer: LayerProfile) -> bool:
    """True when tensor parallelism splits ``layer``: as its profile records, or else when it has
    parameters (the module's rule)."""
    return any(allreduce_counts(layer))


def allreduce_counts(layer: LayerProfile) -> tuple[int, int]:
    """Allreduces of ``layer``'s output activation in its forward and in its backward when split:
    as its profile records, or else one each way for a layer with parameters (none without)."""
    if layer.tensor_allreduces is not None:
        return layer.tensor_allreduces
    return (1, 1) if layer.parameter_bytes > 0 else (0, 0)


def split_layer(layer: LayerProfile, degree: int) -> LayerProfile:
    """What one of ``degree`` tensor devices holds and computes of ``layer``."""
    if degree == 1 or not is_split(layer):
        return layer
    return dataclasses.replace(
        layer,
        forward_s=layer.forward_fixed_s + (layer.forward_s - layer.forward_fixed_s) / degree,
        backward_s=layer.backward_fixed_s + (layer.backward_s - layer.backward_fixed_s) / degree,
        parameter_bytes=layer.parameter_bytes / degree,
    )


def split_profile(profile: ModelProfile, degree: int) -> ModelProfile:
    """``profile`` as one of ``degree`` tensor devices sees it (:func:`split_layer` per layer):
    the simulator's compute, parameter, gradient-sync and memory figures come from it."""
    check_degree(degree)
    if degree == 1:
        return profile
    layers = [split_layer(layer, degree) for layer in profile.layers]
    return dataclasses.replace(profile, layers=layers)


def check_degree(degree: int) -> None:
    """:class:`UsageError` unless ``degree`` is a whole number of at least 1."""
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise UsageError(f"tensor degree must be a whole number of at least 1 (got {degree!r}); "
                         f"e.g. --tensor-parallel 2")


def tensor_group(lead: int, degree: int) -> range:
    """The devices of a stage replica whose first device is ``lead``."""
    return range(lead, lead + degree)


def tensor_allreduce_s(cluster: Cluster, profile: ModelProfile, layers: Iterable[int],
                       group: Sequence[int], share: float, algorithm: str = "auto",
                       latency_s: float | None = None, backward: bool = False) -> float:
    """Seconds of the tensor allreduces of one forward (or, with ``backward``, one backward) of
    ``layers`` on ``share`` of the profile's minibatch: each split layer's allreduces of its
    output activation among ``group`` (:func:`allreduce_counts`), one after another (0 for a
    group of one device)."""
    if len(group) < 2:
        return 0.0
    return sum(allreduce_counts(profile.layers[i])[backward]
               * allreduce_s(cluster, group, profile.layers[i].activation_bytes * share,
                             algorithm, latency_s)
               for i in layers if is_split(profile.layers[i]))


def tensor_allreduce_count(profile: ModelProfile, layers: Iterable[int], backward: bool) -> int:
    """Tensor allreduces of one forward (or, with ``backward``, one backward) of ``layers``."""
    return sum(allreduce_counts(profile.layers[i])[backward] for i in layers)


def port_sharing(cluster: Cluster, leads: Sequence[int], degree: int) -> int:
    """How many of a tensor group's devices share one port of the slowest level the stage's
    replicas (``leads``) span: the ``degree`` concurrent gradient allreduces (device ``t`` of
    every replica together) then move that many shards through it, so one allreduce of that
    many shards over ``leads`` stands for them (1 for one replica)."""
    if degree == 1 or len(set(leads)) < 2:
        return 1
    fanout = branching(cluster, leads)
    spanned = [level for level, count in enumerate(fanout) if count > 1]
    slowest = min(spanned, key=lambda level: cluster.levels[level].bandwidth_Bps)
    size = unit_sizes(cluster)[slowest]
    lead = leads[0]
    return sum(device // size == lead // size for device in tensor_group(lead, degree))


def tensor_degrees(cluster: Cluster, max_degree: int = DEFAULT_MAX_TENSOR_DEGREE) -> list[int]:
    """Tensor degrees worth trying on ``cluster``: divisors of its device count up to
    ``max_degree`` that also divide the innermost unit (a server) on a hierarchy, so that every
    tensor group sits inside one."""
    if max_degree < 1:
        raise UsageError(f"--max-tensor-degree must be at least 1 (got {max_degree})")
    inner = cluster.levels[0].num_units if len(cluster.levels) > 1 else cluster.num_devices
    return [t for t in range(1, max_degree + 1) if cluster.num_devices % t == 0 and inner % t == 0]


def grouped_cluster(cluster: Cluster, degree: int) -> Cluster:
    """``cluster`` with every ``degree`` adjacent devices as one: the cluster a partitioner sees
    when each of its devices is a tensor group (the innermost level's count divided by
    ``degree``, which must divide it)."""
    inner = cluster.levels[0]
    if inner.num_units % degree:
        raise UsageError(f"tensor degree {degree} does not divide the {inner.num_units} devices "
                         f"of the cluster's innermost level; use a divisor of {inner.num_units}")
    levels = (Level(num_units=inner.num_units // degree, bandwidth_Bps=inner.bandwidth_Bps,
                    latency_s=inner.latency_s), *cluster.levels[1:])
    return dataclasses.replace(cluster, levels=levels)


def layout_text(plan: Plan) -> str:
    """The plan's replicas per stage with its tensor degree and recomputation, e.g.
    ``1-1-1-1 x tensor 2, recompute`` or ``4, sharded 4 level 3`` (just ``1-1-1-1`` without
    any)."""
    text = plan.config + (f" x tensor {plan.tensor_degree}" if plan.tensor_degree > 1 else "")
    text += f", sharded {plan.shard_degree} level {plan.shard_level}" if plan.sharded else ""
    return text + (", recompute" if plan.recompute else "")
