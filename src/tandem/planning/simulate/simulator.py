"""The simulator: run a plan's schedule on a cost model of a cluster and predict its timeline.

Usage::

    result = simulate(plan, profile, cluster)
    result.step_time_s, result.bubble_fraction, result.workers[0].peak_memory_bytes
    result.timeline.write("predicted.json")          # the runtime's trace format

The plan's schedule is generated exactly as the runtime generates it (``tandem.schedule``) and
replayed action by action (:mod:`tandem.planning.simulate.replay`): forwards and backwards take the
profiled time of the stage's layers, scaled to the micro-batch (their fixed cost per call once,
the rest times the micro-batch's share: :func:`call_s`) and divided by the device speed;
activations and gradients cross the link between the two workers' devices, with its latency and
bandwidth, and wait for its ports; a replicated stage allreduces its gradients with the
cluster's collective costs (:mod:`tandem.planning.simulate.collectives`) — after its last backward and
blocking (pipelines, as the engine does), or in DDP's buckets overlapping the backward (a
one-stage 1F1B plan: data parallelism, as ``tandem train --strategy dp`` runs it). With a gradient
codec (``SimOptions.compress``, :mod:`tandem.planning.simulate.codecs`) replicas exchange its payloads by
allreduce or allgather and encode and decode them on the device (:mod:`tandem.planning.simulate.replay`
says when). Flush schedules (GPipe, 1F1B, data parallelism) run ``num_steps`` steps back to
back and the step time is the last one's on worker 0, as the runtime measures it; PipeDream's
asynchronous schedule runs long enough to reach its steady state (three times the minibatches
in flight, whole rounds of its replicas) and the step time is the time per minibatch there, the
period once the pipeline is full, with the start-up apart (``SimResult.fill_s``,
:func:`steady_state`). A pipeline whose replay would run more than
``SimOptions.max_replay_actions`` actions (hundreds of stages, or replica counts whose least
common multiple makes PipeDream's run long) is rated in closed form from the same per-stage
costs, in time linear in its stages and workers (:mod:`tandem.planning.simulate.steady`, which
says what that form leaves out).

With a tensor degree ``T`` (``plan.tensor_degree``) every worker of the schedule is a group of
``T`` adjacent devices: the layers the profile records as split (``tensor_allreduces``), or
without a record the layers with parameters, are split (compute beyond the fixed cost and
parameters divided by ``T``, their recorded allreduces of their output among the group in the
forward and in the backward, one each way without a record, plus ``tensor_overhead_s`` of
compute per allreduce; :mod:`tandem.planning.simulate.tensor`), the others run whole on each device. With
``plan.recompute`` a backward runs the stage's forward again first, and a stage stashes only its
input per micro-batch (plus one micro-batch's activations while it recomputes).

A sharded plan (FSDP2 / ZeRO) is simulated unit by unit by :mod:`tandem.planning.simulate.sharded`.
One-stage plans that synchronize otherwise (``plan.sync`` a parameter server, gossip, local SGD
or EASGD spec) are simulated by :mod:`tandem.planning.simulate.servers` and
:mod:`tandem.planning.simulate.decentralized`, chosen by ``type(plan.sync)``; their results say what
their step time means (``SimResult.step_meaning``: a global step, a period's mean, or a
worker's time between updates for asynchronous methods) and count ``updates_per_s``.

Memory per device: parameters, their gradients, optimizer state (``optimizer_state_factor`` ×
parameters), weight versions stashed by PipeDream's schedule, and the activations of the
micro-batches in flight (the outputs of the stage's layers, from a forward to its backward),
added up by :func:`tandem.planning.partition.memory.device_memory_bytes`, the model the partitioner
budgets in closed form.

What it does not model:

- compute that does not scale linearly with the micro-batch beyond the layers' fixed cost per
  call (small batches run less efficiently on GPUs), and framework overhead per action beyond
  those fixed costs, ``compute_overhead_s`` and ``send_overhead_s``; branches of a DAG inside a stage run one
  after another; stragglers, noise and any variability between workers, so backup workers
  (``ParameterServerSync.backup``) only change who waits at the servers' ports, and
  asynchronous methods (async and SSP parameter servers, AD-PSGD) run in lock-step
  steady states that real runs reach only on average;
- interference between communication and compute on one device (memory bandwidth, cores used
  by the communication library), the reduction arithmetic of allreduces; compression's
  encode/decode time unless a codec is named (``SimOptions.compress``; ratios cost nothing);
- the network beyond one full-duplex port per unit and level: no switch topology, congestion
  control or TCP dynamics; collectives do not contend with point-to-point transfers or with
  each other; gossip's simultaneous exchanges share ports as a fluid (each port moves all its
  bytes at full bandwidth, every edge ends when its busier port is done), not packet by packet;
- which layers a real model splits and how, where the profile does not record it (the rule:
  layers with parameters, one allreduce each per direction); the parts of a split layer that run
  whole (a block's norms); activations inside a split layer, tensor allreduces overlapping
  compute;
  Megatron's scatter-gather of activations between stages (they cross once, whole);
- memory beyond the parts above: no workspace, temporary communication buffers, fragmentation
  or receive buffers, and the parts' peaks are added as if they coincided;
- a pipeline plan's activation codec (its ``compress``): give its ratio with
  ``SimOptions.activation_compression`` (a data-parallel plan's codec is modelled);
- data loading, the loss, logging, evaluation and checkpoints; vertical sync's version
  messages; parameter servers' message headers, their first (exact) replies, the goodbyes and
  liveness checks; a parameter server's own arithmetic beyond ``server_message_s`` per message
  and an optimizer step per update (its summing of pushes, Python's per-message cost unless
  ``server_message_s`` says it); AD-PSGD's passive side contending with its own training for
  the device; convergence: a method's step time says nothing of how many steps it needs
  (asynchronous updates are stale, local SGD and gossip workers disagree).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from tandem.cluster import Cluster
from tandem.errors import UsageError
from tandem.plan import Plan, Stage
from tandem.planning.simulate.codecs import (GRADIENT_ELEMENT_BYTES, CodecModel, CodecSpeed,
                                             codec_model)
from tandem.planning.simulate.collectives import ALGORITHMS, allreduce_s, collective_s
from tandem.planning.simulate.decentralized import simulate_averaging, simulate_gossip
from tandem.planning.simulate.costs import (
    DDP_BUCKET_BYTES,
    DDP_FIRST_BUCKET_BYTES,
    StageCost,
    check_plan,
    stage_costs,
)
from tandem.planning.partition.memory import device_memory_bytes
from tandem.planning.simulate.replay import Replay, Workload, replay
from tandem.planning.simulate.result import SimOptions, SimResult, WorkerResult
from tandem.planning.simulate.servers import simulate_ps
from tandem.planning.simulate.sharded import simulate_sharded
from tandem.planning.simulate.steady import closed_form, plan_microbatches, replay_actions
from tandem.planning.simulate.tensor import (port_sharing, split_profile, tensor_allreduce_count,
                                    tensor_allreduce_s, tensor_group)
from tandem.profile import ModelProfile, scale_call, topological_order
from tandem.schedule import Schedule, generate
from tandem.spec.kinds import ScheduleKind
from tandem.spec.sync import (
    AllReduceSync,
    ElasticAveragingSync,
    GossipSync,
    LocalSGDSync,
    ParameterServerSync,
)
from tandem.timeline import Timeline

__all__ = ["SimOptions", "SimResult", "WorkerResult", "data_parallel_plan", "simulate",
           "simulate_family", "plan_schedule", "pipedream_length", "codec_ratio", "worker_devices",
           "build_workload", "call_s", "with_codec", "steady_state"]

CODEC_RATIOS = {"fp16": 2.0, "bf16": 2.0, "int8": 4.0, "sign": 32.0, "1bit": 32.0}
"""Compression ratio of the codecs a plan's stage may name (besides a plain number)."""

SCHEDULE_CACHE_SIZE = 32
"""Generated schedules kept for reuse (each at most ``SimOptions.max_replay_actions`` actions
when the planner simulates it)."""

MAX_PIPEDREAM_MINIBATCHES = 20_000
"""Longest PipeDream run simulated (its length is a multiple of the replica counts' lcm)."""


def data_parallel_plan(profile: ModelProfile, num_devices: int) -> Plan:
    """Data parallelism as a plan: one stage on every device, one micro-batch each (its layers
    in a topological order of the profile's)."""
    order = topological_order(profile.num_layers, profile.edge_list())
    return Plan(stages=[Stage(start=0, end=profile.num_layers, replicas=num_devices)],
                num_layers=profile.num_layers, num_devices=num_devices,
                schedule=ScheduleKind.ONE_F_ONE_B, num_microbatches=num_devices,
                layer_order=None if order == list(range(profile.num_layers)) else order)


def simulate(plan: Plan, profile: ModelProfile, cluster: Cluster,
             options: SimOptions | None = None) -> SimResult:
    """Predict one step of ``plan`` on ``cluster``; :class:`UsageError` for a plan that does
    not fit the profile or the cluster."""
    options = options or SimOptions()
    check_plan(plan, profile, cluster)
    if plan.sharded:
        return simulate_sharded(plan, profile, cluster, options,
                                lambda plain: simulate(plain, profile, cluster, options))
    if not plan.pipelined and not isinstance(plan.sync, AllReduceSync):
        if plan.tensor_degree > 1 or plan.recompute:
            what = "tensor parallelism" if plan.tensor_degree > 1 else "recomputation"
            raise UsageError(f"{what} is simulated for allreduce plans and pipelines, not with "
                             f"sync method {plan.sync.method!r}; drop it or use --plan dp")
        return simulate_family(plan, profile, cluster, options)
    if not plan.pipelined and plan.compress is not None and options.compress is None:
        options = dataclasses.replace(options, compress=plan.compress)  # the run's codec
    costs = stage_costs(plan, split_profile(profile, plan.tensor_degree),
                        bucket_bytes=options.bucket_bytes,
                        first_bucket_bytes=min(DDP_FIRST_BUCKET_BYTES, options.bucket_bytes))
    workload = build_workload(plan, costs, cluster, options, profile=profile)
    if _too_large_to_replay(plan, options):
        return closed_form(plan, profile.batch_size, cluster, workload, options,
                           [c.parameter_bytes for c in costs])
    schedule = plan_schedule(plan)
    steps = 1 if schedule.kind.asynchronous else options.num_steps
    run = replay(schedule, workload, cluster, num_steps=steps, record=options.record)
    return _result(plan, profile, cluster, schedule, costs, run, workload, options)


def _too_large_to_replay(plan: Plan, options: SimOptions) -> bool:
    """A generated pipeline schedule whose replay would exceed ``options.max_replay_actions``
    (PipeDream's run: :func:`pipedream_length` minibatches, or more than it allows)."""
    if len(plan.stages) < 2 or plan.schedule_text is not None:
        return False
    if plan.schedule.asynchronous:
        length, steps = _pipedream_run(plan.replicas), 1
        if length > MAX_PIPEDREAM_MINIBATCHES:
            return True
    else:
        length, steps = plan_microbatches(plan), options.num_steps
    return replay_actions(plan, length, steps) > options.max_replay_actions


def simulate_family(plan: Plan, profile: ModelProfile, cluster: Cluster,
                    options: SimOptions) -> SimResult:
    """A one-stage plan whose sync is not allreduce, by the model of ``type(plan.sync)``."""
    models = {ParameterServerSync: simulate_ps, GossipSync: simulate_gossip,
              LocalSGDSync: simulate_averaging, ElasticAveragingSync: simulate_averaging}
    return models[type(plan.sync)](plan, profile, cluster, options)


def plan_schedule(plan: Plan) -> Schedule:
    """The schedule the runtime runs for ``plan`` (its hand-written one if it has one; a long
    run for ``pipedream``), built by the plan as the runtime builds it."""
    if plan.schedule_text is not None:
        return plan.build_schedule(1)
    if plan.schedule.asynchronous:
        return _generated(plan.schedule, tuple(plan.replicas), pipedream_length(plan.replicas))
    return _generated(plan.schedule, tuple(plan.replicas), plan_microbatches(plan))


@functools.lru_cache(maxsize=SCHEDULE_CACHE_SIZE)
def _generated(kind: ScheduleKind, replicas: tuple[int, ...], count: int) -> Schedule:
    """A generated schedule (frozen data), kept for the planner's candidates that share their
    replica counts."""
    return generate(kind, replicas, count)


def pipedream_length(replicas: list[int]) -> int:
    """Minibatches to simulate PipeDream's schedule over: three times its fill (the most
    minibatches in flight), whole rounds."""
    length = _pipedream_run(replicas)
    if length > MAX_PIPEDREAM_MINIBATCHES:
        rounds = math.lcm(*replicas)
        raise UsageError(
            f"pipedream with replicas {'-'.join(map(str, replicas))} pairs its allreduces every "
            f"{rounds} minibatches, too long a run to simulate; use replica counts with a "
            f"smaller least common multiple"
        )
    return length


def _pipedream_run(replicas: list[int]) -> int:
    """:func:`pipedream_length` without its limit."""
    rounds = math.lcm(*replicas)
    wanted = max(3 * max(sum(replicas), len(replicas)) + 12, 3 * rounds)
    return -(-wanted // rounds) * rounds


def codec_ratio(name: str | None) -> float:
    """The compression ratio of a stage's codec: a known name or a number."""
    if name is None:
        return 1.0
    if name in CODEC_RATIOS:
        return CODEC_RATIOS[name]
    try:
        ratio = float(name)
    except ValueError:
        raise UsageError(f"unknown compression {name!r} in the plan: use a ratio or one of "
                         f"{', '.join(CODEC_RATIOS)}") from None
    if not ratio > 0:
        raise UsageError(f"compression ratio {name!r} must be positive")
    return ratio


def worker_devices(plan: Plan) -> list[int]:
    """Device of every worker: the plan's assignment, else worker ``w`` on device ``w``. With a
    tensor degree ``T`` a worker is a stage replica on ``T`` adjacent devices and this is the
    first of them (by default ``T w``)."""
    devices, worker, degree = [], 0, plan.tensor_degree
    for stage in plan.stages:
        if stage.devices is not None and len(stage.devices) != stage.replicas:
            raise UsageError(f"stage {stage.start}..{stage.end} lists {len(stage.devices)} "
                             f"devices for {stage.replicas} replicas")
        devices += stage.devices or [degree * w for w in range(worker, worker + stage.replicas)]
        worker += stage.replicas
    return devices


def build_workload(plan: Plan, costs: list[StageCost], cluster: Cluster, options: SimOptions, *,
                   profile: ModelProfile | None = None) -> Workload:
    """Per-stage durations and sizes of one micro-batch's actions (``costs`` per device of a
    tensor group; ``profile``, the unsplit one, is needed for a tensor degree above 1).

    Tensor parallelism adds each split layer's allreduces to the forward and to the backward
    (:func:`tensor_allreduce_s` among the first replica's tensor group); recomputation runs the
    forward again, allreduces included, at the start of every backward, and stashes only the
    stage's input (the bytes the previous stage sends) per micro-batch."""
    share = options.batch_scale if plan.schedule.whole_minibatches else (
        options.batch_scale / plan_microbatches(plan))
    devices = worker_devices(plan)
    groups, first = [], 0
    for stage in plan.stages:
        groups.append(devices[first:first + stage.replicas])
        first += stage.replicas
    ratios = [codec_ratio(stage.compression) * options.gradient_compression for stage in plan.stages]
    overlap = options.overlap_allreduce
    if overlap is None:
        overlap = not plan.pipelined
    speed = cluster.speed
    degree = plan.tensor_degree
    sharing = [port_sharing(cluster, g, degree) for g in groups]

    def reduce_s(group: list[int], num_bytes: float, ratio: float, shards: int = 1) -> float:
        return allreduce_s(cluster, group, num_bytes * shards / ratio, options.allreduce,
                           options.allreduce_latency_s)

    tensor = _tensor_s(plan, profile, cluster, groups, share, options)
    framework = _tensor_overhead_s(plan, profile, options)
    forward = [call_s(c.forward_s, c.forward_fixed_s, share, options) / speed
               + options.compute_overhead_s + o + t
               for c, (t, _), (o, _) in zip(costs, tensor, framework)]
    backward = [call_s(c.backward_s, c.backward_fixed_s, share, options) / speed
                + options.compute_overhead_s + o + t
                for c, (_, t), (_, o) in zip(costs, tensor, framework)]
    redo = forward if plan.recompute else [0.0] * len(costs)
    inputs = [0.0, *(c.output_bytes * share for c in costs[:-1])]
    workload = Workload(
        forward_s=forward,
        backward_s=[r + b for r, b in zip(redo, backward)],
        step_s=[c.parameter_bytes / options.optimizer_Bps if options.optimizer_Bps else 0.0
                for c in costs],
        output_bytes=[c.output_bytes * share / options.activation_compression
                      / codec_ratio(stage.compression) if options.activation_comm else 0.0
                      for c, stage in zip(costs, plan.stages)],
        stash_bytes=inputs if plan.recompute else [c.activation_bytes * share for c in costs],
        recompute_bytes=[c.activation_bytes * share for c in costs] if plan.recompute else None,
        tensor_s=[(f, b + (f if plan.recompute else 0.0)) for f, b in tensor]
        if degree > 1 else None,
        allreduce_s=[reduce_s(g, c.parameter_bytes, r, k)
                     for c, g, r, k in zip(costs, groups, ratios, sharing)],
        buckets=[[(r0 + ready * _stretch(c, seconds), reduce_s(g, size, r, k))
                  for ready, size in c.buckets]
                 for c, g, r, k, seconds, r0 in zip(costs, groups, ratios, sharing, backward, redo)]
        if overlap else None,
        devices=devices,
        send_overhead_s=options.send_overhead_s,
    )
    if options.compress is None:
        return workload
    codec = codec_model(options.compress, options.codec_speed)
    return with_codec(workload, codec, costs, groups, cluster, options)


def _tensor_s(plan: Plan, profile: ModelProfile | None, cluster: Cluster, groups: list[list[int]],
              share: float, options: SimOptions) -> list[tuple[float, float]]:
    """Per stage, seconds of one forward's and of one backward's tensor allreduces among the
    first replica's group (0 without tensor parallelism)."""
    degree = plan.tensor_degree
    if degree == 1:
        return [(0.0, 0.0)] * len(plan.stages)
    if profile is None:
        raise ValueError("build_workload needs the profile for a tensor degree above 1")
    return [tuple(tensor_allreduce_s(cluster, profile, plan.stage_layers(s),  # type: ignore[misc]
                                     tensor_group(g[0], degree), share, options.allreduce,
                                     options.allreduce_latency_s, backward)
                  for backward in (False, True))
            for s, g in enumerate(groups)]


def _tensor_overhead_s(plan: Plan, profile: ModelProfile | None,
                       options: SimOptions) -> list[tuple[float, float]]:
    """Per stage, ``options.tensor_overhead_s`` times the tensor allreduces of one forward and of
    one backward (0 without tensor parallelism)."""
    if plan.tensor_degree == 1 or not options.tensor_overhead_s or profile is None:
        return [(0.0, 0.0)] * len(plan.stages)
    return [tuple(options.tensor_overhead_s * tensor_allreduce_count(  # type: ignore[misc]
        profile, plan.stage_layers(s), backward) for backward in (False, True))
        for s in range(len(plan.stages))]


def call_s(total_s: float, fixed_s: float, share: float, options: SimOptions) -> float:
    """Seconds of one forward or backward on ``share`` of the profile's minibatch, on a device
    of speed 1: the fixed cost once (unless ``options.charge_fixed_costs`` is off) and the rest
    scaled by the share (the profiled time already holds one fixed cost)."""
    return scale_call(total_s, fixed_s if options.charge_fixed_costs else 0.0, share)


def _stretch(cost: StageCost, backward_s: float) -> float:
    """Factor from the profile's backward seconds to a micro-batch's (for bucket ready times)."""
    return backward_s / cost.backward_s if cost.backward_s > 0 else 0.0


def with_codec(workload: Workload, codec: CodecModel, costs: list[StageCost],
               groups: list[list[int]], cluster: Cluster, options: SimOptions) -> Workload:
    """``workload`` with every stage's gradient sync done by ``codec``: its collectives' seconds
    and its ``(encode, decode)`` seconds per stage (blocking) and per bucket (overlapped).

    Gradients are float32 (4 bytes per element) and each layer's parameters are one tensor; a
    stage on one device syncs nothing. Encoding and decoding run ``options.codec_speedup``
    times the codec's speed on a device of the cluster's speed."""
    speedup = options.codec_speedup * cluster.speed

    def sync(group: list[int], tensors: Sequence[float]) -> tuple[float, tuple[float, float]]:
        if len(set(group)) < 2:
            return 0.0, (0.0, 0.0)
        numels = [max(1, round(b / GRADIENT_ELEMENT_BYTES)) for b in tensors if b > 0]
        seconds = sum(collective_s(cluster, collective, group, num_bytes, options.allreduce,
                                   options.allreduce_latency_s)
                      for collective, num_bytes in codec.rounds(numels))
        return seconds, (codec.encode_s(numels, speedup=speedup),
                         codec.decode_s(numels, len(group), speedup=speedup))

    whole = [sync(g, [b for bucket in c.bucket_tensors for b in bucket])
             for c, g in zip(costs, groups)]
    changes: dict[str, Any] = {"allreduce_s": [seconds for seconds, _ in whole],
                               "codec_s": [work for _, work in whole]}
    if workload.buckets is not None:
        synced = [[sync(g, tensors) for tensors in c.bucket_tensors]
                  for c, g in zip(costs, groups)]
        changes["buckets"] = [[(ready, seconds) for (ready, _), (seconds, _) in zip(old, new)]
                              for old, new in zip(workload.buckets, synced)]
        changes["bucket_codec_s"] = [[work for _, work in stage] for stage in synced]
    return dataclasses.replace(workload, **changes)


def _step_window(schedule: Schedule, run: Replay) -> tuple[float, list[int], float]:
    """The reported step time, the keys (steps or minibatches) it averages over, and the fill.

    Flush schedules: the last step on worker 0 (one step is one flush), no fill. PipeDream's
    run: the steady state, the slope of the times its minibatches' updates end on stage 0 over
    the middle third of the run (whole rounds of the replicas' round-robin: the pipeline is
    full and not yet draining), and the fill, what the first minibatches took beyond that
    period (:func:`steady_state`)."""
    if schedule.kind.asynchronous:
        period, fill, window = steady_state(run.done_s, schedule.num_microbatches,
                                            math.lcm(*schedule.replicas))
        return period, window, fill
    ends = run.step_ends[0]
    step = ends[-1] - ends[-2] if len(ends) > 1 else max(e[-1] for e in run.step_ends)
    return step, [len(ends) - 1], 0.0


def steady_state(done_s: dict[int, float], num_minibatches: int,
                 rounds: int) -> tuple[float, float, list[int]]:
    """``(period, fill, window)`` of a PipeDream run of ``num_minibatches`` whose minibatch
    ``m``'s update ended at ``done_s[m]``.

    The window is the middle third of the run (whole ``rounds``: the pipeline is full and not
    yet draining), cut to whole cycles of its pattern: the fewest rounds after which every
    minibatch ends the same time after the one a cycle before (ports and replicas can make the
    steady state repeat every few minibatches). The period is the seconds per minibatch over it;
    the fill, by how much the window's minibatches end later than ``(m + 1)`` periods (on
    average: a run of ``N`` minibatches takes about ``fill + N * period``)."""
    first = max(rounds, num_minibatches // 3 // rounds * rounds)
    last = max(first + rounds, 2 * num_minibatches // 3 // rounds * rounds)
    done = np.array([done_s[m] for m in range(first, last + 1)])
    cycle = _cycle(done, rounds)
    last = first + (last - first) // cycle * cycle
    period = (done_s[last] - done_s[first]) / (last - first)
    window = list(range(first, last))
    fill = sum(done_s[m] - (m + 1) * period for m in window) / len(window)
    return period, max(0.0, fill), window


def _cycle(done: np.ndarray, rounds: int) -> int:
    """The fewest minibatches, a multiple of ``rounds`` and at most half of ``done``, after
    which ``done`` repeats shifted by a constant (to a relative ``1e-9``); ``rounds`` if none."""
    tolerance = 1e-9 * max(1.0, float(abs(done[-1])))
    for cycle in range(rounds, (len(done) - 1) // 2 + 1, rounds):
        steps = done[cycle:] - done[:-cycle]
        if float(steps.max() - steps.min()) <= tolerance:
            return cycle
    return rounds


def _result(plan: Plan, profile: ModelProfile, cluster: Cluster, schedule: Schedule,
            costs: list[StageCost], run: Replay, workload: Workload,
            options: SimOptions) -> SimResult:
    step_s, keys, fill_s = _step_window(schedule, run)
    workers = []
    for w in range(schedule.num_workers):
        stage, replica = schedule.stage_of(w)
        params = costs[stage].parameter_bytes
        busy = sum(run.busy_s[w].get(k, 0.0) for k in keys) / len(keys)
        comm = sum(run.communication_s[w].get(k, 0.0) for k in keys) / len(keys)
        codec = sum(run.codec_s[w].get(k, 0.0) for k in keys) / len(keys) if run.codec_s else 0.0
        stash = run.peak_stashed_versions[w] * params
        peak = device_memory_bytes(parameter_bytes=params,
                                   activation_bytes=run.peak_activation_bytes[w],
                                   stashed_versions=run.peak_stashed_versions[w],
                                   optimizer_state_factor=options.optimizer_state_factor)
        workers.append(WorkerResult(
            worker=w, stage=stage, replica=replica, device=workload.devices[w], busy_s=busy,
            idle_s=max(0.0, step_s - busy - codec), communication_s=comm, codec_s=codec,
            weight_bytes=params,
            gradient_bytes=params, optimizer_bytes=params * options.optimizer_state_factor,
            stashed_weight_bytes=stash, activation_bytes=run.peak_activation_bytes[w],
            peak_memory_bytes=float(peak)))
    total_busy = sum(worker.busy_s for worker in workers)
    batch = profile.batch_size
    return SimResult(
        config=plan.config, schedule=schedule.kind, num_microbatches=schedule.num_microbatches,
        step_time_s=step_s, steps_per_s=1.0 / step_s if step_s > 0 else math.inf,
        samples_per_s=batch * options.batch_scale / step_s if batch and step_s > 0 else None,
        bubble_fraction=max(0.0, 1.0 - total_busy / (len(workers) * step_s)) if step_s > 0 else 0.0,
        compute_s=max(worker.busy_s for worker in workers),
        communication_s=max(worker.communication_s for worker in workers),
        codec_s=max(worker.codec_s for worker in workers),
        peak_memory_bytes=max(worker.peak_memory_bytes for worker in workers),
        memory_limit_bytes=cluster.memory_bytes, workers=workers,
        timeline=Timeline(events=run.events, source="simulator"),
        tensor_degree=plan.tensor_degree, recompute=plan.recompute, fill_s=fill_s,
    )
