"""Sharded data parallelism (FSDP2 / ZeRO, ``plan.sharded``) on the cost model: each unit's
all-gathers and reduce-scatters, overlapped with compute as FSDP2 prefetches them, and each
worker's shard of the state.

Usage::

    result = simulate_sharded(plan, profile, cluster, options,
                              lambda plain: simulate(plain, profile, cluster, options))
    result.step_time_s, result.workers[0].peak_memory_bytes

Every profiled layer with parameters is a unit (the runtime's units are the model's blocks; a
profile's layers are its blocks or finer). The ``N`` workers form ``N / S`` groups of ``S``
consecutive devices (the runtime's mesh ``(replicate, shard)``); a unit of ``p`` bytes is
all-gathered within the group (each device gives ``p / S``:
:func:`~tandem.planning.simulate.collectives.allgather_s`), its gradient reduce-scattered within
it (a ring reduce-scatter moves what a ring all-gather does) and, with several groups,
allreduced across them (``p / S`` per device, times the group's devices that share a port of the
level those allreduces cross: their ``S`` allreduces run at once). One worker's step, levels 2 and 3:

- forward: the first unit's all-gather is issued as the pass begins, unit ``i + 1``'s as unit
  ``i``'s forward starts (FSDP2 prefetches one unit ahead); a forward starts when the previous
  one and its unit's all-gather are done;
- backward, last unit first: at level 3 each unit is gathered again, prefetched the same way;
  a unit's reduce-scatter (and allreduce across groups) is issued as its backward ends;
- every collective runs on one channel per device, one after another (FSDP2's all-gather and
  reduce-scatter streams share the device's links); the step ends with the last collective or
  backward, then the optimizer steps the worker's shard.

With ``plan.accumulate`` micro-batches each runs its forward and backward (gathering again:
FSDP2 reshards after every backward) and only the last one reduce-scatters. Level 1 (ZeRO-1) is DDP's step (:func:`dp_step`, the
replayed plain data-parallel plan) plus the all-gather of the updated shards within each group.

A sharded step is never rated faster than the same plan's plain data-parallel step (DDP's,
replayed): levels 2 and 3 move at least the bytes its allreduce does, and FSDP2 pays costs
left out here (copies into and out of its communication buffers, hooks per unit), so where the
closed form, which overlaps the all-gathers with the forward, comes out below DDP's step, DDP's
is taken. The planner then never prefers sharding on a near tie of two models.

Memory per device, level 3: the shards of the parameters, gradients and optimizer state, two
units whole (the one computing and the one prefetched) and one unit's whole gradient before its
reduce-scatter (every unit's with ``plan.accumulate`` above 1: FSDP2 keeps the whole gradients
it accumulates without reduce-scattering), and the activations; level 2 keeps every unit gathered from its forward to its
backward (the whole parameters at the peak); level 1 holds whole parameters and gradients and
its shard of the optimizer state.

Not modelled: FSDP2's copies into and out of its flat communication buffers, the root unit's
parameters (not freed after the forward), contention between the two streams beyond sharing
one channel, mixed precision (bytes are the profile's), and offloading.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tandem.cluster import Cluster
from tandem.errors import UsageError
from tandem.plan import SHARD_LEVELS, Plan
from tandem.planning.simulate.collectives import allgather_s, allreduce_s, link_level, unit_sizes
from tandem.planning.simulate.result import SimResult, WorkerResult
from tandem.profile import ModelProfile, scale_call
from tandem.timeline import Timeline

PREFETCHED_UNITS = 2
"""Units a level-3 worker holds whole at once (the one computing and the one prefetched)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class UnitCosts:
    """One worker's per-layer times and the collectives of each unit, in layer order."""

    forward_s: list[float]
    backward_s: list[float]
    parameter_bytes: list[float]
    gather_s: list[float]
    """All-gather of each layer's parameters within the group (0 for layers without)."""
    reduce_s: list[float]
    """Reduce-scatter within the group plus allreduce across groups of each layer's gradient."""
    activation_bytes: float
    """Activation bytes one micro-batch keeps from its forward to its backward."""
    optimizer_s: float
    """The optimizer step over this worker's shard."""


def unit_costs(plan: Plan, profile: ModelProfile, cluster: Cluster, options: Any) -> UnitCosts:
    """The :class:`UnitCosts` of ``plan`` (sharded, one stage) under ``options`` (a
    ``SimOptions``): layer times scaled to one worker's micro-batch and the device speed."""
    stage, degree = plan.stages[0], plan.shard_degree
    layers = [profile.layers[i] for i in plan.stage_layers(0)]
    share = options.batch_scale / int(plan.num_microbatches or stage.replicas)
    fixed = 1.0 if options.charge_fixed_costs else 0.0
    group = range(degree)  # the first group: every group spans the same levels
    across = range(0, stage.replicas, degree)
    sizes = [float(layer.parameter_bytes) for layer in layers]

    def gather(size: float) -> float:
        return allgather_s(cluster, group, size / degree, options.allreduce,
                           options.allreduce_latency_s)

    sharing = _port_sharing(cluster, degree, across)

    def reduce(size: float) -> float:
        crossing = allreduce_s(cluster, across, size / degree * sharing, options.allreduce,
                               options.allreduce_latency_s) if len(across) > 1 else 0.0
        return gather(size) + crossing

    total = sum(sizes)
    return UnitCosts(
        forward_s=[scale_call(l.forward_s, l.forward_fixed_s * fixed, share) / cluster.speed
                   + options.compute_overhead_s for l in layers],
        backward_s=[scale_call(l.backward_s, l.backward_fixed_s * fixed, share) / cluster.speed
                    + options.compute_overhead_s for l in layers],
        parameter_bytes=sizes,
        gather_s=[gather(size) for size in sizes],
        reduce_s=[reduce(size) for size in sizes],
        activation_bytes=sum(l.activation_bytes for l in layers) * share,
        optimizer_s=total / degree / options.optimizer_Bps if options.optimizer_Bps else 0.0,
    )


def _port_sharing(cluster: Cluster, degree: int, across: range) -> int:
    """How many of the groups' concurrent allreduces across groups share a port: the devices of
    one group inside one unit of the outermost level those allreduces cross (each moves its
    shard through the unit's one link)."""
    if len(across) < 2:
        return 1
    sizes = unit_sizes(cluster)
    level = link_level(cluster, across[0], across[-1], sizes)
    return sum(1 for device in range(degree) if device // sizes[level] == 0)


@dataclasses.dataclass(slots=True)
class _Clock:
    """When the device's compute and its one communication channel are next free."""

    compute: float = 0.0
    channel: float = 0.0
    busy: float = 0.0
    """Compute seconds so far."""
    talking: float = 0.0
    """Collective seconds so far."""

    def collective(self, seconds: float, after: float) -> float:
        """Run a collective of ``seconds`` once the channel is free and ``after``; its end."""
        start = max(self.channel, after)
        self.channel = start + seconds
        self.talking += seconds
        return self.channel

    def compute_after(self, seconds: float, ready: float) -> float:
        """Compute ``seconds`` once the last compute and ``ready`` are done; its start."""
        start = max(self.compute, ready)
        self.compute = start + seconds
        self.busy += seconds
        return start


def sharded_step(costs: UnitCosts, *, level: int, accumulate: int) -> _Clock:
    """One worker's step at level 2 or 3 (the module docstring's order), as its clock."""
    clock = _Clock()
    count = len(costs.forward_s)
    for micro in range(accumulate):
        _pass(clock, range(count), costs.forward_s, costs.gather_s)
        reduces = costs.reduce_s if micro == accumulate - 1 else None
        _pass(clock, range(count - 1, -1, -1), costs.backward_s,
              costs.gather_s if level == 3 else None, reduces)
    end = max(clock.compute, clock.channel)
    clock.compute = end + costs.optimizer_s
    clock.busy += costs.optimizer_s
    return clock


def _pass(clock: _Clock, order: range, compute_s: list[float], gather_s: list[float] | None,
          reduce_s: list[float] | None = None) -> None:
    """Layers in ``order``: each computed once its all-gather (if ``gather_s``) is done, the
    next layer's all-gather issued as this one's compute starts (FSDP2's prefetch), then this
    layer's reduction issued as its compute ends (if ``reduce_s``). The channel runs them in
    the order they are issued."""
    layers = list(order)
    gathered: dict[int, float] = {}

    def gather(position: int, issued: float) -> None:
        if gather_s is not None and position < len(layers) and gather_s[layers[position]] > 0:
            gathered[position] = clock.collective(gather_s[layers[position]], after=issued)

    gather(0, clock.compute)
    for position, index in enumerate(layers):
        started = clock.compute_after(compute_s[index], gathered.get(position, 0.0))
        gather(position + 1, started)
        if reduce_s is not None and reduce_s[index] > 0:
            clock.collective(reduce_s[index], after=clock.compute)


def sharded_memory(costs: UnitCosts, *, level: int, degree: int, optimizer_state_factor: float,
                   accumulate: int = 1) -> dict[str, float]:
    """One worker's peak bytes by part (the module docstring's model)."""
    whole = sum(costs.parameter_bytes)
    shard = whole / degree
    largest = sorted(costs.parameter_bytes, reverse=True)
    state = shard * optimizer_state_factor
    # accumulating without a reduce-scatter, FSDP2 keeps every unit's whole gradient
    gradients = shard + (whole if accumulate > 1 else largest[0])
    if level == 1:
        return {"weights": whole, "gradients": whole, "optimizer": state}
    if level == 2:
        return {"weights": shard + whole, "gradients": gradients, "optimizer": state}
    return {"weights": shard + sum(largest[:PREFETCHED_UNITS]), "gradients": gradients,
            "optimizer": state}


def simulate_sharded(plan: Plan, profile: ModelProfile, cluster: Cluster, options: Any,
                     dp_step: Callable[[Plan], SimResult]) -> SimResult:
    """Predict one step of the sharded one-stage ``plan``; ``dp_step`` simulates the same plan
    unsharded (DDP's step, which level 1 takes)."""
    if plan.pipelined or plan.tensor_degree > 1 or plan.compress is not None:
        raise UsageError(f"the simulator models sharded data parallelism alone (one stage, no "
                         f"tensor parallelism or codec), and plan {plan.config} combines it; "
                         f"simulate it without sharded, or the sharding alone")
    costs = unit_costs(plan, profile, cluster, options)
    level, degree = plan.shard_level, plan.shard_degree
    plain = dp_step(dataclasses.replace(plan, sharded=False, shard_degree=1, shard_level=3,
                                        shard_units=None))
    if level == 1:
        broadcast = allgather_s(cluster, range(degree), sum(costs.parameter_bytes) / degree,
                                options.allreduce, options.allreduce_latency_s)
        clock = _Clock(compute=plain.step_time_s + broadcast,
                       busy=plain.compute_s, talking=plain.communication_s + broadcast)
    else:
        clock = sharded_step(costs, level=level, accumulate=plan.accumulate)
    step_s = max(clock.compute, clock.channel, plain.step_time_s)
    memory = sharded_memory(costs, level=level, degree=degree,
                            optimizer_state_factor=options.optimizer_state_factor,
                            accumulate=plan.accumulate)
    peak = sum(memory.values()) + costs.activation_bytes
    replicas = plan.stages[0].replicas
    devices = plan.stages[0].devices or list(range(replicas))
    rows = [WorkerResult(worker=worker, stage=0, replica=worker, device=devices[worker],
                         busy_s=clock.busy, idle_s=max(0.0, step_s - clock.busy),
                         communication_s=clock.talking, weight_bytes=memory["weights"],
                         gradient_bytes=memory["gradients"], optimizer_bytes=memory["optimizer"],
                         stashed_weight_bytes=0.0, activation_bytes=costs.activation_bytes,
                         peak_memory_bytes=peak)
            for worker in range(replicas)]
    return SimResult(
        config=plan.config, schedule=plan.schedule,
        num_microbatches=int(plan.num_microbatches or replicas), step_time_s=step_s,
        steps_per_s=1.0 / step_s if step_s > 0 else float("inf"),
        samples_per_s=(profile.batch_size * options.batch_scale / step_s
                       if profile.batch_size and step_s > 0 else None),
        bubble_fraction=max(0.0, 1.0 - clock.busy / step_s) if step_s > 0 else 0.0,
        compute_s=clock.busy, communication_s=clock.talking, peak_memory_bytes=peak,
        memory_limit_bytes=cluster.memory_bytes, workers=rows,
        timeline=Timeline(events=[], source="simulator"), method="allreduce",
        step_meaning=f"one step of sharded data parallelism (level {level}, groups of {degree})",
    )


def sharded_plans(dp: Plan, cluster: Cluster) -> list[Plan]:
    """``dp`` (one stage) sharded at levels 1 to 3: over all its workers, and in groups of one
    server's devices (HSDP) on a hierarchical cluster — the layouts ``tandem plan`` and
    ``tandem search`` weigh against plain data parallelism."""
    workers = dp.stages[0].replicas
    inner = cluster.devices_per_unit(1) if len(cluster.levels) > 1 else workers
    degrees = sorted({d for d in (workers, inner) if 1 < d <= workers and workers % d == 0})
    return [dataclasses.replace(dp, sharded=True, shard_degree=degree, shard_level=level)
            for degree in degrees for level in SHARD_LEVELS]
