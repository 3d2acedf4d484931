"""A pipeline's step in closed form, for plans too large to replay action by action.

Usage::

    if replay_actions(plan, length, num_steps) > options.max_replay_actions:
        result = closed_form(plan, profile.batch_size, cluster, workload, options, parameter_bytes)

The replay (:mod:`tandem.planning.simulate.replay`) costs time and memory in proportion to the
actions of the schedule it runs: stages times micro-batches for a flush schedule, stages times a
run of minibatches (a multiple of the replica counts' least common multiple) for PipeDream's.
A 1,000-layer chain on 1,024 devices is hundreds of stages with replica counts whose least
common multiple is in the millions. Such a plan is rated here in time linear in its stages and
workers, from the same per-stage costs (:class:`~tandem.planning.simulate.replay.Workload`):

- ``pipedream``: the steady state is set by its slowest replica, a minibatch every
  ``max over stages of max(compute + sync, port) / replicas`` seconds, where a replica's compute
  is its forward, backward and optimizer step, its sync the blocking allreduce (and codec) of a
  replicated stage, and its port the bytes it moves (activations on and gradients back, each
  direction of its full-duplex port carrying both) — or by the round trip its in-flight counts
  make a stage wait for once per round of its replicas (:func:`_round_trip_s`), whichever is
  slower; the fill is one minibatch's trip through every stage and back, less one period;
- ``gpipe`` and ``1f1b``: one flush lasts, for the stage that makes it longest, its replicas'
  share of the step's micro-batches at ``max(compute, port)`` each, one micro-batch's trip
  through every other stage and back, and its sync and optimizer step.

Memory is the shared closed form (:mod:`tandem.planning.partition.memory`): what the replay
reaches exactly for ``pipedream`` and ``gpipe``, an upper bound for ``1f1b``.

What it does not model, beyond the replay's own limits: a port's transfers arriving in bursts
(they are spread evenly over the period), waits that chain several stages' syncs, and how a
flush overlaps one stage's allreduce with the others' drain. Against the replay, on random
plans of VGG-16 at 10 Gb/s: PipeDream's period agrees exactly for most plans without
activation transfers (at worst 20% short), and is up to 40% short with them (bursts); a flush
is within -33% and +17% (-49% and +19% with transfers). Memory is the replay's exactly (1F1B's
included, on those plans).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tandem.cluster import Cluster
from tandem.plan import Plan
from tandem.planning.partition.memory import device_memory_bytes
from tandem.planning.simulate.collectives import link_level, unit_sizes
from tandem.planning.simulate.replay import Workload
from tandem.planning.simulate.result import SimOptions, SimResult, WorkerResult
from tandem.schedule.generators import in_flight_counts, num_in_flight
from tandem.spec.kinds import ScheduleKind
from tandem.timeline import Timeline

__all__ = ["replay_actions", "closed_form", "plan_microbatches"]

ACTIONS_PER_COMPUTE = 3
"""Actions a forward or backward brings along in a schedule: itself, a receive and a send."""


def plan_microbatches(plan: Plan) -> int:
    """Micro-batches per step of ``plan``'s flush schedule, as its schedule is generated."""
    return int(plan.num_microbatches or 1)


def replay_actions(plan: Plan, length: int, num_steps: int) -> int:
    """Actions the replay of ``plan`` would run: ``length`` micro-batches per step (minibatches
    in the run for ``pipedream``) through every stage, forward and backward, ``num_steps``
    times (a close upper bound)."""
    per_step = sum(replicas * math.ceil(length / replicas) for replicas in plan.replicas)
    return 2 * ACTIONS_PER_COMPUTE * per_step * num_steps


def closed_form(plan: Plan, batch_size: int | None, cluster: Cluster, workload: Workload,
                options: SimOptions, parameter_bytes: Sequence[float]) -> SimResult:
    """The step of ``plan`` (two stages or more, blocking allreduces) from its per-stage costs
    ``workload`` and each stage's ``parameter_bytes`` per device, without replaying it (see the
    module docstring)."""
    kind = plan.schedule
    replicas = plan.replicas
    hops, wires = _hops(workload, cluster, replicas)
    compute = [f + b for f, b in zip(workload.forward_s, workload.backward_s)]
    sync = [_sync_s(workload, s) if r > 1 else 0.0 for s, r in enumerate(replicas)]
    port = [(wires[s - 1] if s > 0 else 0.0) + (wires[s] if s < len(wires) else 0.0)
            for s in range(len(replicas))]
    trip = sum(compute) + 2 * sum(hops)
    if kind.asynchronous:
        cycles = [max(c + o + a, p) for c, o, a, p in zip(compute, workload.step_s, sync, port)]
        step_s = max(max(cycle / r for cycle, r in zip(cycles, replicas)),
                     _round_trip_s(replicas, compute, hops, sync, workload.step_s))
        fill_s = max(0.0, trip - step_s)
        shares = [1.0 / r for r in replicas]  # of every minibatch, per replica
    else:
        count = plan_microbatches(plan)
        shares = [float(math.ceil(count / r)) for r in replicas]
        step_s = max(trip + (n - 1) * max(c, p) + a + o
                     for n, c, p, a, o in zip(shares, compute, port, sync, workload.step_s))
        fill_s = 0.0
    return _result(plan, batch_size, cluster, workload, options, parameter_bytes,
                   step_s=step_s, fill_s=fill_s, shares=shares, sync=sync, port=port)


def _round_trip_s(replicas: Sequence[int], compute: Sequence[float], hops: Sequence[float],
                  sync: Sequence[float], step_s: Sequence[float]) -> float:
    """PipeDream's period as its in-flight counts bound it: seconds per minibatch of the
    longest round trip that a stage must wait for once per round of its replicas.

    After its ``k``-th update a replica of stage ``s`` (``r`` replicas, ``n`` minibatches in
    flight each) forwards a minibatch of round ``k + n`` and then runs the backward of the last
    minibatch ``m`` of round ``k + 1``. A later stage ``t`` runs that backward only after the
    forward of minibatch ``m + w`` (``w`` = its replicas times its in-flight count less one);
    when that minibatch is in round ``k + n`` (``w >= (n - 2) r + 1``), one round of stage ``s``
    lasts at least a forward from ``s`` to ``t`` and a backward from ``t`` to ``s``, transfers,
    the sync and the step included. A straight pipeline has no such trip (``w`` falls short)."""
    flight = in_flight_counts(replicas)
    ahead = [(n - 1) * r for n, r in zip(flight, replicas)]  # w of each stage
    longest = 0.0
    for s, r in enumerate(replicas):
        threshold = (flight[s] - 2) * r + 1
        trip = compute[s] + sync[s] + step_s[s]
        for t in range(s + 1, len(replicas)):
            trip += compute[t] + 2 * hops[t - 1]
            if ahead[t] >= threshold:
                longest = max(longest, trip / r)
    return longest


def _hops(workload: Workload, cluster: Cluster,
          replicas: Sequence[int]) -> tuple[list[float], list[float]]:
    """Per pair of adjacent stages (their first replicas' devices), the seconds of one
    activation's transfer (overhead and latency included) and of its bytes on the wire alone."""
    sizes, first = unit_sizes(cluster), 0
    hops: list[float] = []
    wires: list[float] = []
    for stage in range(len(replicas) - 1):
        a, b = workload.devices[first], workload.devices[first + replicas[stage]]
        first += replicas[stage]
        if a == b:
            hops.append(0.0)
            wires.append(0.0)
            continue
        level = cluster.levels[link_level(cluster, a, b, sizes)]
        wire = workload.output_bytes[stage] / level.bandwidth_Bps
        hops.append(workload.send_overhead_s + level.latency_s + wire)
        wires.append(wire)
    return hops, wires


def _sync_s(workload: Workload, stage: int) -> float:
    """Seconds of a replicated stage's blocking gradient sync: encode, allreduce, decode."""
    encode, decode = workload.codec_s[stage] if workload.codec_s else (0.0, 0.0)
    return encode + workload.allreduce_s[stage] + decode


def _result(plan: Plan, batch_size: int | None, cluster: Cluster, workload: Workload,
            options: SimOptions, parameter_bytes: Sequence[float], *, step_s: float, fill_s: float, shares: list[float],
            sync: list[float], port: list[float]) -> SimResult:
    """A :class:`SimResult` with one row per worker, every replica of a stage alike."""
    kind, replicas = plan.schedule, plan.replicas
    workers: list[WorkerResult] = []
    for stage, count in enumerate(replicas):
        tensor = sum(workload.tensor_s[stage]) if workload.tensor_s else 0.0
        compute = workload.forward_s[stage] + workload.backward_s[stage] - tensor
        steps = shares[stage] if kind.asynchronous else 1.0
        busy = shares[stage] * compute + steps * workload.step_s[stage]
        comm = shares[stage] * (tensor + port[stage]) + steps * sync[stage]
        held, versions = _held(plan, stage)
        activations = held * workload.stash_bytes[stage]
        if workload.recompute_bytes is not None:
            activations += workload.recompute_bytes[stage]
        params = parameter_bytes[stage]
        peak = device_memory_bytes(parameter_bytes=params, activation_bytes=activations,
                                   stashed_versions=versions,
                                   optimizer_state_factor=options.optimizer_state_factor)
        first = sum(replicas[:stage])
        for replica in range(count):
            workers.append(WorkerResult(
                worker=first + replica, stage=stage, replica=replica,
                device=workload.devices[first + replica], busy_s=busy,
                idle_s=max(0.0, step_s - busy), communication_s=comm, weight_bytes=params,
                gradient_bytes=params, optimizer_bytes=params * options.optimizer_state_factor,
                stashed_weight_bytes=versions * params, activation_bytes=activations,
                peak_memory_bytes=float(peak)))
    total_busy = sum(w.busy_s for w in workers)
    return SimResult(
        config=plan.config, schedule=kind,
        num_microbatches=1 if kind.asynchronous else plan_microbatches(plan),
        step_time_s=step_s, steps_per_s=1.0 / step_s if step_s > 0 else math.inf,
        samples_per_s=(batch_size * options.batch_scale / step_s
                       if batch_size and step_s > 0 else None),
        bubble_fraction=max(0.0, 1.0 - total_busy / (len(workers) * step_s)) if step_s > 0 else 0.0,
        compute_s=max(w.busy_s for w in workers),
        communication_s=max(w.communication_s for w in workers),
        peak_memory_bytes=max(w.peak_memory_bytes for w in workers),
        memory_limit_bytes=cluster.memory_bytes, workers=workers,
        timeline=Timeline(events=[], source="simulator"),
        step_meaning=("closed form (the plan is too large to replay): "
                      + ("seconds per minibatch in steady state" if kind.asynchronous
                         else "one flush")),
        tensor_degree=plan.tensor_degree, recompute=plan.recompute, fill_s=fill_s)


def _held(plan: Plan, stage: int) -> tuple[int, int]:
    """Micro-batches (minibatches) of activations a replica of ``stage`` holds at its peak, and
    the weight versions it stashes besides its own."""
    replicas = plan.replicas
    in_flight = num_in_flight(replicas, stage)
    if plan.schedule.asynchronous:
        return in_flight, in_flight - 1
    share = math.ceil(plan_microbatches(plan) / replicas[stage])
    return (share if plan.schedule is ScheduleKind.GPIPE else min(share, in_flight)), 0
