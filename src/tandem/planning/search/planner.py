"""From a profile and a cluster to the plan the simulator rates fastest among those it can make.

Usage::

    plan = make_plan(profile, cluster)                 # 1F1B, simulated, memory checked
    plan.config, plan.bottleneck_s, plan.estimate_s, plan.candidates
    bare = partition_plan(profile, cluster, PartitionOptions(activation_compression=None))

:func:`partition_plan` is PipeDream's partitioner alone, its times its cost model's. The planner
(:func:`make_plan`) asks it for plans on the cluster as it is and, for a hierarchical cluster,
on a flat cluster of as many devices at the slowest link, each under a ladder of memory budgets
(a fixed grid down from the limit) and of link speeds (:mod:`tandem.planning.search.candidates`); it
adds data parallelism and one device, simulates each (:mod:`tandem.planning.simulate.simulator`)
as it will run (the schedule, micro-batches that divide the minibatch), and, when data
parallelism does not fit the memory limit, its sharded forms (FSDP2 / ZeRO,
:mod:`tandem.planning.simulate.sharded`); it returns the fastest
that fits the devices' memory, its time the simulator's (``bottleneck_s``) beside the
partitioner's estimate (``estimate_s``). It is never slower than a candidate it built; a looser
memory limit never gives a slower plan, by construction (a tighter limit's candidates are all
among a looser one's: :mod:`.candidates` says why); more bandwidth and faster devices do not
in practice. Every candidate, with both figures and its memory, is listed in
``plan.candidates``. A memory limit that no
candidate meets is an error naming the smallest memory at which one would.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from typing import Any, NoReturn

from tandem.cluster import Cluster, Level
from tandem.errors import UsageError
from tandem.plan import Plan, Stage
from tandem.planning.partition.branches import compress_for_planning
from tandem.planning.partition.memory import stage_memory_bytes
from tandem.planning.search.candidates import Candidate, CandidatePool
from tandem.planning.search.microbatches import microbatch_counts, minibatch
from tandem.planning.partition.pipedream import (NoPlanFits, Partition, PartitionOptions,
                                                 memory_bracket, partition, schedule_kind)
from tandem.planning.simulate.sharded import sharded_plans
from tandem.planning.simulate.simulator import SimOptions, SimResult, data_parallel_plan, simulate
from tandem.profile import ModelProfile, topological_order
from tandem.spec.kinds import ScheduleKind
from tandem.spec.trainable import update_change

PIPELINE_CANDIDATES = ("partition", "flat")
"""The candidates that are the partitioner's pipelines (the others: ``dp`` and ``single``)."""
BUDGET_SCALES = (1.0, 2.0, 4.0, 8.0)
"""Flush schedules: the partitioner's memory budget as multiples of the limit that
:func:`smallest_memory_bytes` tries at each limit."""
MEMORY_TOLERANCE = 1e-3
"""Relative precision of the smallest memory reported when nothing fits."""
Least = Callable[[set[str]], "float | None"]
"""The least memory limit under which the planner has a candidate of these names that fits
(None: none at any limit; :meth:`CandidatePool.least_limit`)."""


def partition_plan(
    profile: ModelProfile, cluster: Cluster, options: PartitionOptions | None = None
) -> Plan:
    """PipeDream's partitioning as a plan: its times the partitioner's cost model (PipeDream's
    steady state, ``predicted_schedule`` ``pipedream``), its stages' memory the shared model's
    for ``options.schedule``. A DAG whose cut states explode is partitioned with its branches
    merged (:mod:`tandem.planning.partition.branches`, reported in ``options["branch_compression"]``)
    and the plan mapped back onto its own layers."""
    options = options or PartitionOptions()
    started = time.perf_counter()
    compression = compress_for_planning(profile)
    profile = compression.profile
    solved = partition(profile, cluster, options)
    solve_s = time.perf_counter() - started
    order = _layer_order(profile, solved)
    stages = _stages(profile, solved, order, options)
    return compression.expand(Plan(
        stages=stages,
        num_layers=profile.num_layers,
        num_devices=cluster.num_devices,
        bottleneck_s=solved.bottleneck_s,
        single_s=solved.single_s,
        data_parallel_s=solved.data_parallel_s,
        estimate_s=solved.bottleneck_s,
        layer_order=None if order == list(range(profile.num_layers)) else order,
        level_configs=list(solved.level_configs),
        predicted_schedule=ScheduleKind.PIPEDREAM,
        solve_s=solve_s,
        options=_recorded(dataclasses.replace(
            options, memory_bytes=options.memory_bytes or cluster.memory_bytes)),
    ))


def _recorded(options: PartitionOptions) -> dict[str, Any]:
    """The partitioner options a plan records."""
    return {
        "activation_compression": options.activation_compression,
        "gradient_compression": options.gradient_compression,
        "straight": options.straight,
        "allow_idle": options.allow_idle,
        "memory_bytes": options.memory_bytes,
    }


def make_plan(
    profile: ModelProfile, cluster: Cluster, options: PartitionOptions | None = None, *,
    schedule: ScheduleKind | str = ScheduleKind.ONE_F_ONE_B, num_microbatches: int | None = None,
    sim: SimOptions | None = None,
    pipeline_only: bool = False,
) -> Plan:  # fmt: skip
    """The fastest plan, by the simulator, among the partitioner's on ``cluster`` and on a flat
    cluster at the slowest link, each under the ladders of memory budgets and link speeds of
    :mod:`tandem.planning.search.candidates`, data parallelism and one device; pipelines run
    ``schedule`` with ``num_microbatches`` (None: the best of the default and its multiples for
    flush schedules, always a divisor of the minibatch). :class:`UsageError` when no candidate
    fits the memory limit (``options.memory_bytes`` or the cluster's), naming the smallest
    memory that would do, or when the micro-batches asked for cannot run. ``pipeline_only``
    (and ``options.straight``: the caller asked for a pipeline's layout or schedule) still
    simulates data parallelism and one device, for reference, but returns one of the
    partitioner's plans, run as asked even where the partitioner gives one stage."""
    options = options or PartitionOptions()
    kind = schedule_kind(schedule)
    if kind.whole_minibatches and num_microbatches not in (None, 1):
        raise UsageError(f"the pipedream schedule runs whole minibatches: --microbatches "
                         f"{num_microbatches} does not apply; drop it or use --schedule 1f1b or "
                         f"gpipe")
    sim = dataclasses.replace(sim or SimOptions(), record=False)
    memory = options.memory_bytes if options.memory_bytes is not None else cluster.memory_bytes
    cluster = dataclasses.replace(cluster, memory_bytes=memory)
    options = dataclasses.replace(options, memory_bytes=memory, schedule=kind,
                                  optimizer_state_factor=sim.optimizer_state_factor)
    asked = pipeline_only or options.straight
    started = time.perf_counter()
    pool = CandidatePool(profile, cluster, kind, num_microbatches, sim,
                         reschedule_all=asked or num_microbatches is not None)
    _check_asked_microbatches(num_microbatches, pool.batch)
    views = [("partition", cluster)]
    if len(cluster.levels) > 1:
        views.append(("flat", _flat_at_slowest_link(cluster)))
    solve = functools.partial(partition_plan, profile)
    candidates = pool.ladders(views, options, solve)

    def least(names: set[str]) -> float | None:
        return CandidatePool(profile, cluster, kind, num_microbatches, sim,
                             reschedule_all=pool.reschedule_all).least_limit(views, options,
                                                                             solve, names)

    if asked and not _as_asked(kind, [c for c in candidates if c.fits]):
        _refuse(profile, cluster, options, sim, candidates, least)  # the references change nothing
    candidates += _references(profile, cluster, pool, candidates)
    eligible = candidates
    if asked:
        eligible = [c for c in candidates if c.name in PIPELINE_CANDIDATES]
        for reference in candidates:
            if reference.name not in PIPELINE_CANDIDATES:
                reference.note = "for reference: a pipeline was asked for"
    fitting = _as_asked(kind, [c for c in eligible if c.fits]) if asked else [
        c for c in eligible if c.fits]
    if not fitting:
        _refuse(profile, cluster, options, sim, eligible, least)
    best = min(fitting, key=lambda c: c.step_s)
    rows = sorted(candidates, key=lambda c: (c.name not in PIPELINE_CANDIDATES, not c.fits,
                                             c.step_s))
    return _chosen_plan(best, rows, options, time.perf_counter() - started)


def _refuse(profile: ModelProfile, cluster: Cluster, options: PartitionOptions, sim: SimOptions,
            eligible: list[Candidate], least: Least) -> NoReturn:  # fmt: skip
    """No ``eligible`` candidate fits: :class:`UsageError` with the reasons when none could run
    at all (data parallelism and one device, always built, are candidates too), else
    :class:`NoPlanFits` naming the smallest memory that would do (``least``: the planner's
    own)."""
    if not any(c.plan is not None for c in eligible):
        reasons = "; ".join(dict.fromkeys(c.note for c in eligible if c.note))
        raise UsageError(f"no {options.schedule} plan on {cluster.num_devices} devices can run as "
                         f"asked: {reasons}")
    raise NoPlanFits(_no_fit_message(profile, cluster, options, sim, eligible, least))


def _as_asked(kind: ScheduleKind, fitting: list[Candidate]) -> list[Candidate]:
    """The fitting candidates that train as the asked pipeline schedule does: under an
    asynchronous one (PipeDream's), a plan of one stage on ``r`` replicas is no pipeline but
    asynchronous data parallelism whose every update averages ``r`` minibatches (1/r as many
    updates of the whole model), another training run: it is not compared, its note says why
    (:func:`tandem.spec.trainable.update_change`), unless nothing else fits."""
    if not kind.asynchronous:
        return fitting
    apart = [c for c in fitting if c.plan is not None and len(c.plan.stages) == 1
             and c.plan.stages[0].replicas > 1]
    same = [c for c in fitting if c not in apart]
    if not same:
        return fitting
    for candidate in apart:
        assert candidate.plan is not None
        change = update_change(candidate.plan) or "a different training run"
        candidate.note = f"not compared: {change}"
    return same


def _check_asked_microbatches(count: int | None, batch: int | None) -> None:
    """A micro-batch count given that cannot split the minibatch, refused in one line."""
    if count is None or batch is None:
        return
    if count < 1 or batch % count:
        divisors = [d for d in range(1, batch + 1) if batch % d == 0]
        near = min(divisors, key=lambda d: (abs(d - count), d))
        raise UsageError(f"--microbatches {count} does not divide the minibatch of {batch} "
                         f"samples (tandem train refuses it): use a divisor such as {near}")


def _references(profile: ModelProfile, cluster: Cluster, pool: CandidatePool,
                found: list[Candidate]) -> list[Candidate]:  # fmt: skip
    """Data parallelism (on as many devices as divide the minibatch) and one device, both run
    as data parallelism."""
    devices = cluster.num_devices
    if pool.batch is not None:
        devices = max(d for d in range(1, devices + 1) if pool.batch % d == 0)
    dp = dataclasses.replace(data_parallel_plan(profile, devices), num_devices=cluster.num_devices)
    single = dataclasses.replace(data_parallel_plan(profile, 1), num_devices=cluster.num_devices)
    note = "" if devices == cluster.num_devices else (
        f"on {devices} devices: the minibatch of {pool.batch} does not split among "
        f"{cluster.num_devices}")
    plain = pool.evaluate("dp", dp, _dp_estimate(found), note=note, as_is=True)
    sharded = [] if plain.fits or plain.result is None else _sharded(dp, cluster, pool, plain)
    return [plain, *sharded,
            pool.evaluate("single", single, _single_estimate(found), as_is=True)]


def _sharded(dp: Plan, cluster: Cluster, pool: CandidatePool, plain: Candidate) -> list[Candidate]:
    """Sharded data parallelism on ``dp``'s devices (:func:`sharded_plans`), weighed when plain
    data parallelism (``plain``) does not fit the memory limit (their collectives move the same
    bytes, modelled in closed form against DDP's replay: a near tie between them would say
    nothing); each says so."""
    assert plain.result is not None
    why = f"; data parallelism needs {plain.result.peak_memory_bytes / 1e9:.3g} GB per device"
    return [pool.evaluate("sharded", plan, None, as_is=True,
                          note=f"--shard {plan.shard_degree} --shard-level {plan.shard_level}{why}")
            for plan in sharded_plans(dp, cluster)]


def _flat_at_slowest_link(cluster: Cluster) -> Cluster:
    """As many devices as ``cluster`` on one level with its slowest bandwidth and latency."""
    slowest = min(cluster.levels, key=lambda level: level.bandwidth_Bps)
    level = Level(num_units=cluster.num_devices, bandwidth_Bps=slowest.bandwidth_Bps,
                  latency_s=max(level.latency_s for level in cluster.levels))
    return dataclasses.replace(cluster, levels=(level,), name=f"{cluster.num_devices} devices")


def _dp_estimate(found: list[Candidate]) -> float | None:
    return next((c.plan.data_parallel_s for c in found
                 if c.plan is not None and c.estimate_s is not None), None)


def _single_estimate(found: list[Candidate]) -> float | None:
    return next((c.plan.single_s for c in found
                 if c.plan is not None and c.estimate_s is not None), None)


def _chosen_plan(best: Candidate, candidates: list[Candidate], options: PartitionOptions,
                 solve_s: float) -> Plan:
    """The winner, its predictions the simulator's, the references and every candidate."""
    by_name = {c.name: c for c in candidates}
    assert best.plan is not None and best.result is not None
    reference = {name: by_name[name].result for name in ("single", "dp") if name in by_name}
    return dataclasses.replace(
        best.plan,
        bottleneck_s=best.result.step_time_s,
        predicted_schedule=best.plan.schedule,
        estimate_s=best.estimate_s,
        single_s=_step(reference.get("single")),
        data_parallel_s=_step(reference.get("dp")),
        samples_per_s=best.result.samples_per_s,
        candidates=[c.row(c is best) for c in candidates],
        solve_s=solve_s,
        stages=[dataclasses.replace(stage, memory_bytes=_stage_peak(best.result, index))
                for index, stage in enumerate(best.plan.stages)],
        options={**_recorded(options), "chosen": best.name,
                 "chosen_from": best.note if best.name in PIPELINE_CANDIDATES else "",
                 **{key: value for key, value in best.plan.options.items()
                    if key == "branch_compression"}},
    )


def _step(result: SimResult | None) -> float:
    return result.step_time_s if result is not None else 0.0


def _stage_peak(result: SimResult, stage: int) -> float:
    return max(w.peak_memory_bytes for w in result.workers if w.stage == stage and
               w.role == "worker")


def _no_fit_message(profile: ModelProfile, cluster: Cluster, options: PartitionOptions,
                    sim: SimOptions, eligible: list[Candidate], least: Least) -> str:
    """The smallest memory that would do: the least limit under which the planner's own
    candidates give an eligible one that fits (every candidate of a limit is one of every
    looser limit), or an eligible candidate's peak if less; the bisection of
    :func:`smallest_memory_bytes` where the ladders have no candidate of those names."""
    memory = options.memory_bytes
    assert memory is not None  # without a limit every plan fits
    peaks = [c.result.peak_memory_bytes for c in eligible if c.result is not None]
    planned = least({c.name for c in eligible})
    smallest = planned if planned is not None else smallest_memory_bytes(profile, cluster,
                                                                         options, sim)
    need = min([smallest, *peaks])
    words = {"partition": "straight pipelines" if options.straight else "pipelines",
             "flat": "straight pipelines" if options.straight else "pipelines",
             "dp": "data parallelism", "sharded": "sharded data parallelism",
             "single": "one device"}
    kinds = ", ".join(dict.fromkeys(words[c.name] for c in eligible)) or words["partition"]
    search = (", or let `tandem search` split layers across devices (tensor parallelism "
              "fits)" if _tensor_fits(profile, cluster, options, memory) else "")
    return (f"no plan fits in {memory / 1e9:g} GB per device on {cluster.num_devices} devices "
            f"({kinds}, {options.schedule}): the smallest needs "
            f"{math.ceil(need / 1e7) / 100:g} GB; raise --memory to at least that, add "
            f"devices, use a smaller batch{search}")


def _tensor_fits(profile: ModelProfile, cluster: Cluster, options: PartitionOptions,
                 memory: float) -> bool:
    """Whether every layer's parameters split across all devices (one replica, its activations
    whole) would fit ``memory``, by the shared memory model: then ``tandem search`` has a plan."""
    if cluster.num_devices < 2:
        return False
    params = sum(layer.parameter_bytes for layer in profile.layers) / cluster.num_devices
    acts = sum(layer.activation_bytes for layer in profile.layers)
    need = stage_memory_bytes(options.schedule, parameter_bytes=params, activation_bytes=acts,
                              replicas=1, downstream=0,
                              optimizer_state_factor=options.optimizer_state_factor)
    return float(need) <= memory


def smallest_memory_bytes(profile: ModelProfile, cluster: Cluster, options: PartitionOptions,
                          sim: SimOptions | None = None) -> float:
    """The least per-device memory at which the partitioner's plan for a flat cluster of
    ``cluster``'s devices fits (memory does not depend on the links; ``options``' straight and
    idle rules kept): bisection on the limit, a limit counting as met when the simulator's peak
    of the plan is within it, to :data:`MEMORY_TOLERANCE`. The bisection starts from the
    bracket of :func:`memory_bracket` (single passes of a quick search, no solve): no plan
    below its floor, and its roof, once a solve confirms it, is often the answer itself."""
    sim = dataclasses.replace(sim or SimOptions(), record=False)
    flat = _flat_at_slowest_link(cluster)
    relaxed = options

    scales = BUDGET_SCALES if options.schedule.flushes else (1.0,)
    unlimited = dataclasses.replace(flat, memory_bytes=None)

    batch = minibatch(profile, sim)

    def peak(limit: float) -> float | None:
        reached = []
        for scale in scales:
            budget = dataclasses.replace(relaxed, memory_bytes=limit * scale)
            try:
                plan = partition_plan(profile, flat, budget)
            except NoPlanFits:
                continue
            reached += [simulate(variant, profile, unlimited, sim).peak_memory_bytes
                        for variant in _as_run(plan, options.schedule, batch)]
        fitting = [value for value in reached if value <= limit * (1 + MEMORY_TOLERANCE)]
        return min(fitting) if fitting else None

    whole = profile.layers
    params = sum(layer.parameter_bytes for layer in whole)
    acts = sum(layer.activation_bytes for layer in whole)
    high = float(stage_memory_bytes(options.schedule, parameter_bytes=params, activation_bytes=acts,
                                    replicas=1, downstream=0,
                                    optimizer_state_factor=options.optimizer_state_factor))
    high, low = max(high, 1.0), 0.0
    bracket = memory_bracket(compress_for_planning(profile).profile, flat, relaxed, high,
                             MEMORY_TOLERANCE / 4)
    reached = None
    if bracket is not None:  # no plan below the floor; the search's plan on every device
        floor, roof = bracket
        low = floor / max(scales)
        reached = peak(roof) if roof is not None else None
        high = roof if reached is not None and roof is not None else high
    found = reached or peak(high) or high
    while high - low > MEMORY_TOLERANCE * high:
        middle = (low + high) / 2
        reached = peak(middle)
        if reached is None:
            low = middle
        else:
            high, found = middle, min(found, reached)
    return found


def _as_run(plan: Plan, schedule: ScheduleKind, batch: int | None) -> list[Plan]:
    """``plan`` as the planner runs it (:class:`CandidatePool`): one stage as data
    parallelism, a pipeline with each micro-batch count it tries."""
    if len(plan.stages) == 1:
        return [plan.rescheduled(ScheduleKind.ONE_F_ONE_B)]
    try:
        counts = microbatch_counts(plan, schedule, None, batch)
    except UsageError:
        return []
    return [plan.rescheduled(schedule, count) for count in counts]


def _layer_order(profile: ModelProfile, solved: Partition) -> list[int]:
    rank = {layer: position for position, layer in
            enumerate(topological_order(profile.num_layers, profile.edge_list()))}  # fmt: skip
    order: list[int] = []
    for choice in solved.stages:
        order.extend(sorted(solved.states.layers_between(choice.before, choice.state),
                            key=rank.__getitem__))
    return order


def _stages(profile: ModelProfile, solved: Partition, order: list[int],
            options: PartitionOptions) -> list[Stage]:
    stages: list[Stage] = []
    position = 0
    total_replicas = [choice.replicas for choice in solved.stages]
    devices = [d for choice in solved.stages for d in choice.devices]
    interleaved = devices != list(range(len(devices)))
    for index, choice in enumerate(solved.stages):
        layers = [profile.layers[i] for i in order[position : position + _size(solved, choice)]]
        params = sum(layer.parameter_bytes for layer in layers)
        stash = sum(layer.activation_bytes for layer in layers)
        memory = stage_memory_bytes(
            options.schedule, parameter_bytes=params, activation_bytes=stash,
            replicas=choice.replicas, downstream=sum(total_replicas[index + 1 :]),
            optimizer_state_factor=options.optimizer_state_factor)
        stages.append(Stage(
            start=position, end=position + len(layers), replicas=choice.replicas,
            time_s=choice.time_s, compute_s=sum(layer.compute_s for layer in layers),
            parameter_bytes=params, memory_bytes=float(memory),
            devices=list(choice.devices) if interleaved else None))  # fmt: skip
        position += len(layers)
    return stages


def _size(solved: Partition, choice: object) -> int:
    return len(solved.states.layers_between(choice.before, choice.state))  # type: ignore[attr-defined]
