"""From a profile and a cluster to the plan the simulator rates fastest among those it can make.

Usage::

    plan = make_plan(profile, cluster)                 # 1F1B, simulated, memory checked
    plan.config, plan.bottleneck_s, plan.estimate_s, plan.candidates
    bare = partition_plan(profile, cluster, PartitionOptions(activation_compression=None))

:func:`partition_plan` is PipeDream's partitioner alone, its times its cost model's. The planner
(:func:`make_plan`) asks it for a plan on the cluster as it is and, for a hierarchical cluster,
on a flat cluster of as many devices at the slowest link; it adds data parallelism on every
device and one device, simulates each (:mod:`tandem.planning.simulate.simulator`) with the schedule the
plan will run, and returns the fastest that fits the devices' memory, its time the simulator's
(``bottleneck_s``) beside the partitioner's estimate (``estimate_s``). Every candidate, with
both figures and its memory, is listed in ``plan.candidates``. A memory limit that no candidate
meets is an error naming the smallest memory at which one would.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

from tandem.cluster import Cluster, Level
from tandem.errors import UsageError
from tandem.plan import Plan, Stage, default_microbatches
from tandem.planning.partition.branches import compress_for_planning
from tandem.planning.partition.memory import stage_memory_bytes
from tandem.planning.partition.pipedream import (NoPlanFits, Partition, PartitionOptions,
                                                 partition, schedule_kind)
from tandem.planning.simulate.simulator import SimOptions, SimResult, data_parallel_plan, simulate
from tandem.profile import ModelProfile, topological_order
from tandem.spec.kinds import ScheduleKind

PIPELINE_CANDIDATES = ("partition", "flat")
"""The candidates that are the partitioner's pipelines (the others: ``dp`` and ``single``)."""
MICROBATCH_FACTORS = (1, 2, 4)
"""Flush schedules without a given count: micro-batches tried, as multiples of the default."""
MEMORY_RETRIES = 3
"""Times the partitioner re-solves under a tighter limit when its plan's simulated devices
exceed the memory (outer levels of a hierarchy estimate a unit's memory as an even share, and
flush schedules' micro-batches may not divide evenly among a stage's replicas)."""
TIGHTER_BUDGETS = (0.5, 0.25)
"""Memory budgets besides none, as fractions of the unconstrained partition's simulated peak."""
BUDGET_SCALES = (1.0, 2.0, 4.0, 8.0)
"""Flush schedules: the partitioner's memory budget as multiples of the limit, tried in turn."""
MEMORY_TOLERANCE = 1e-3
"""Relative precision of the smallest memory reported when nothing fits."""


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


@dataclasses.dataclass(kw_only=True, slots=True)
class _Candidate:
    """One plan the planner compared."""

    name: str
    plan: Plan | None
    estimate_s: float | None = None
    result: SimResult | None = None
    note: str = ""

    @property
    def fits(self) -> bool:
        return self.result is not None and self.result.fits_memory

    def row(self, chosen: bool) -> dict[str, Any]:
        result = self.result
        return {
            "name": self.name, "chosen": chosen,
            "config": self.plan.config if self.plan else None,
            "schedule": self.plan.schedule if self.plan else None,
            "num_microbatches": self.plan.num_microbatches if self.plan else None,
            "estimate_s": self.estimate_s,
            "simulated_s": result.step_time_s if result else None,
            "samples_per_s": result.samples_per_s if result else None,
            "peak_memory_bytes": result.peak_memory_bytes if result else None,
            "fits_memory": self.fits if result else None,
            "note": self.note,
        }


def make_plan(
    profile: ModelProfile, cluster: Cluster, options: PartitionOptions | None = None, *,
    schedule: ScheduleKind | str = ScheduleKind.ONE_F_ONE_B, num_microbatches: int | None = None,
    sim: SimOptions | None = None,
    pipeline_only: bool = False,
) -> Plan:  # fmt: skip
    """The fastest plan, by the simulator, among the partitioner's on ``cluster``, the
    partitioner's on a flat cluster at the slowest link, data parallelism and one device; run
    with ``schedule`` (pipelines) and ``num_microbatches`` (None: the best of the default and
    its multiples :data:`MICROBATCH_FACTORS` for flush schedules). :class:`UsageError` when no
    candidate fits the memory limit (``options.memory_bytes`` or the cluster's), naming the
    smallest memory that would do. ``pipeline_only`` (and ``options.straight``: the caller asked
    for a pipeline's layout or schedule) still simulates data parallelism and one device, for
    reference, but returns one of the partitioner's plans."""
    options = options or PartitionOptions()
    kind = ScheduleKind.parse(schedule)
    if kind is not None and kind.whole_minibatches and num_microbatches not in (None, 1):
        raise UsageError(f"the pipedream schedule runs whole minibatches: --microbatches "
                         f"{num_microbatches} does not apply; drop it or use --schedule 1f1b or "
                         f"gpipe")
    sim = dataclasses.replace(sim or SimOptions(), record=False)
    memory = options.memory_bytes if options.memory_bytes is not None else cluster.memory_bytes
    cluster = dataclasses.replace(cluster, memory_bytes=memory)
    options = dataclasses.replace(options, memory_bytes=memory, schedule=schedule_kind(schedule),
                                  optimizer_state_factor=sim.optimizer_state_factor)
    started = time.perf_counter()
    candidates = _candidates(profile, cluster, options, options.schedule, num_microbatches, sim)
    eligible = candidates
    if pipeline_only or options.straight:
        eligible = [c for c in candidates if c.name in PIPELINE_CANDIDATES]
        for reference in candidates:
            if reference.name not in PIPELINE_CANDIDATES:
                reference.note = "for reference: a pipeline was asked for"
    fitting = [c for c in eligible if c.fits]
    if not fitting:
        raise NoPlanFits(_no_fit_message(profile, cluster, options, sim, memory, eligible))
    best = min(fitting, key=lambda c: c.result.step_time_s)  # type: ignore[union-attr]
    return _chosen_plan(best, candidates, options, time.perf_counter() - started)


def _candidates(profile: ModelProfile, cluster: Cluster, options: PartitionOptions,
                schedule: ScheduleKind, num_microbatches: int | None,
                sim: SimOptions) -> list[_Candidate]:  # fmt: skip
    evaluate = _evaluator(profile, cluster, schedule, num_microbatches, sim)
    found = [_partitioned("partition", profile, cluster, options, evaluate)]
    if len(cluster.levels) > 1:
        flat = _flat_at_slowest_link(cluster)
        found.append(_partitioned("flat", profile, flat, options, evaluate))
    dp = data_parallel_plan(profile, cluster.num_devices)
    found.append(evaluate("dp", dp, _dp_estimate(found)))
    single = dataclasses.replace(data_parallel_plan(profile, 1), num_devices=cluster.num_devices)
    found.append(evaluate("single", single, _single_estimate(found)))
    return found


Evaluate = Callable[[str, Plan, "float | None"], _Candidate]


def _evaluator(profile: ModelProfile, cluster: Cluster, schedule: ScheduleKind,
               num_microbatches: int | None, sim: SimOptions) -> Evaluate:
    """Simulate a candidate as it would run: pipelines with ``schedule`` and the best
    micro-batch count tried; one-stage plans as data parallelism."""
    batch = profile.batch_size * sim.batch_scale if profile.batch_size else None

    def evaluate(name: str, plan: Plan, estimate_s: float | None) -> _Candidate:
        if len(plan.stages) == 1:
            variants = [plan]
        else:
            variants = [plan.rescheduled(schedule, count)
                        for count in _microbatch_counts(plan, schedule, num_microbatches, batch)]
        best: _Candidate | None = None
        for variant in variants:
            result = simulate(variant, profile, cluster, sim)
            trial = _Candidate(name=name, plan=variant, estimate_s=estimate_s, result=result)
            if best is None or _better(trial, best):
                best = trial
        assert best is not None
        return best

    return evaluate


def _better(trial: _Candidate, best: _Candidate) -> bool:
    """Fitting before not fitting, then faster."""
    if trial.fits != best.fits:
        return trial.fits
    return trial.result.step_time_s < best.result.step_time_s  # type: ignore[union-attr]


def _microbatch_counts(plan: Plan, schedule: ScheduleKind, given: int | None,
                       batch: float | None) -> list[int | None]:
    if not schedule.flushes:
        return [None]
    if given is not None:
        return [given]
    base = default_microbatches(plan.replicas, schedule)
    counts = [base * factor for factor in MICROBATCH_FACTORS]
    if batch is not None:  # no micro-batch smaller than one sample
        counts = [count for count in counts if count <= batch] or [base]
    return list(dict.fromkeys(counts))


def _partitioned(name: str, profile: ModelProfile, cluster: Cluster, options: PartitionOptions,
                 evaluate: Evaluate) -> _Candidate:
    """The fastest partition, by the simulator, among the partitioner's answers under several
    memory budgets: none, :data:`TIGHTER_BUDGETS` of that plan's simulated peak (or of the
    limit, if smaller: the partitioner's cost model can prefer a plan that the simulator finds
    slower than one holding less), and, when none of those fits the limit, budgets of
    :data:`BUDGET_SCALES` times the limit, loosest first (flush schedules' budget counts every
    micro-batch of a replica's share in flight, where 1F1B holds few), until one fits; at the
    limit itself a plan that overflows is solved again under a limit shrunk by the overflow
    (:data:`MEMORY_RETRIES` times)."""
    limit = options.memory_bytes
    free = _solved(name, profile, dataclasses.replace(cluster, memory_bytes=None),
                   dataclasses.replace(options, memory_bytes=None), evaluate)
    tried = [free]
    if free.result is not None:
        ceiling = free.result.peak_memory_bytes
        ceiling = ceiling if limit is None else min(ceiling, limit)
        tried += [_solved(name, profile, cluster,
                          dataclasses.replace(options, memory_bytes=ceiling * fraction), evaluate)
                  for fraction in TIGHTER_BUDGETS]
    if limit is not None and not any(c.fits for c in tried):
        tried.append(_within_limit(name, profile, cluster, options, evaluate))
    solved = [c for c in tried if c.plan is not None]
    if not solved:
        return free
    best = solved[0]
    for candidate in solved[1:]:
        if _better(candidate, best):
            best = candidate
    if not best.fits:
        best.note = "its devices exceed the memory limit"
    return best


def _within_limit(name: str, profile: ModelProfile, cluster: Cluster, options: PartitionOptions,
                  evaluate: Evaluate) -> _Candidate:
    """The first partition that fits the limit under budgets of :data:`BUDGET_SCALES` times
    it, loosest first (the last tried if none does)."""
    limit = options.memory_bytes
    assert limit is not None
    scales = BUDGET_SCALES if options.schedule.flushes else (1.0,)
    candidate = _Candidate(name=name, plan=None)
    for scale in sorted(scales, reverse=True):
        budget = dataclasses.replace(options, memory_bytes=limit * scale)
        candidate = _solved(name, profile, cluster, budget, evaluate)
        for _ in range(MEMORY_RETRIES if scale == 1.0 else 0):
            if candidate.plan is None or candidate.fits:
                break
            assert candidate.result is not None and budget.memory_bytes is not None  # solved
            shrink = limit / candidate.result.peak_memory_bytes
            budget = dataclasses.replace(budget, memory_bytes=budget.memory_bytes * shrink * 0.999)
            candidate = _solved(name, profile, cluster, budget, evaluate)
        if candidate.fits:
            return candidate
    return candidate


def _solved(name: str, profile: ModelProfile, cluster: Cluster, options: PartitionOptions,
            evaluate: Evaluate) -> _Candidate:
    """The partitioner's plan under ``options``, simulated; no plan (with the partitioner's
    reason) when none fits its budget."""
    try:
        plan = partition_plan(profile, cluster, options)
    except NoPlanFits as exc:
        return _Candidate(name=name, plan=None, note=str(exc))
    return evaluate(name, plan, plan.estimate_s)


def _flat_at_slowest_link(cluster: Cluster) -> Cluster:
    """As many devices as ``cluster`` on one level with its slowest bandwidth and latency."""
    slowest = min(cluster.levels, key=lambda level: level.bandwidth_Bps)
    level = Level(num_units=cluster.num_devices, bandwidth_Bps=slowest.bandwidth_Bps,
                  latency_s=max(level.latency_s for level in cluster.levels))
    return dataclasses.replace(cluster, levels=(level,), name=f"{cluster.num_devices} devices")


def _dp_estimate(found: list[_Candidate]) -> float | None:
    return next((c.plan.data_parallel_s for c in found if c.plan is not None), None)


def _single_estimate(found: list[_Candidate]) -> float | None:
    return next((c.plan.single_s for c in found if c.plan is not None), None)


def _chosen_plan(best: _Candidate, candidates: list[_Candidate], options: PartitionOptions,
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
                 **{key: value for key, value in best.plan.options.items()
                    if key == "branch_compression"}},
    )


def _step(result: SimResult | None) -> float:
    return result.step_time_s if result is not None else 0.0


def _stage_peak(result: SimResult, stage: int) -> float:
    return max(w.peak_memory_bytes for w in result.workers if w.stage == stage and
               w.role == "worker")


def _no_fit_message(profile: ModelProfile, cluster: Cluster, options: PartitionOptions,
                    sim: SimOptions, memory: float | None, eligible: list[_Candidate]) -> str:
    assert memory is not None  # without a limit every plan fits
    peaks = [c.result.peak_memory_bytes for c in eligible if c.result is not None]
    need = min([smallest_memory_bytes(profile, cluster, options, sim), *peaks])
    words = {"partition": "straight pipelines" if options.straight else "pipelines",
             "flat": "straight pipelines" if options.straight else "pipelines",
             "dp": "data parallelism", "single": "one device"}
    kinds = ", ".join(dict.fromkeys(words[c.name] for c in eligible))
    return (f"no plan fits in {memory / 1e9:g} GB per device on {cluster.num_devices} devices "
            f"({kinds}, {options.schedule}): the smallest needs "
            f"{math.ceil(need / 1e7) / 100:g} GB; raise --memory to at least that, add "
            f"devices, or use a smaller batch")


def smallest_memory_bytes(profile: ModelProfile, cluster: Cluster, options: PartitionOptions,
                          sim: SimOptions | None = None) -> float:
    """The least per-device memory at which the partitioner's plan for a flat cluster of
    ``cluster``'s devices fits (memory does not depend on the links; ``options``' straight and
    idle rules kept): bisection on the limit, a limit counting as met when the simulator's peak
    of the plan is within it, to :data:`MEMORY_TOLERANCE`."""
    sim = dataclasses.replace(sim or SimOptions(), record=False)
    flat = _flat_at_slowest_link(cluster)
    relaxed = options

    scales = BUDGET_SCALES if options.schedule.flushes else (1.0,)
    unlimited = dataclasses.replace(flat, memory_bytes=None)

    def peak(limit: float) -> float | None:
        reached = []
        for scale in scales:
            budget = dataclasses.replace(relaxed, memory_bytes=limit * scale)
            try:
                plan = partition_plan(profile, flat, budget).rescheduled(options.schedule)
            except NoPlanFits:
                continue
            reached.append(simulate(plan, profile, unlimited, sim).peak_memory_bytes)
        fitting = [value for value in reached if value <= limit * (1 + MEMORY_TOLERANCE)]
        return min(fitting) if fitting else None

    whole = profile.layers
    params = sum(layer.parameter_bytes for layer in whole)
    acts = sum(layer.activation_bytes for layer in whole)
    high = float(stage_memory_bytes(options.schedule, parameter_bytes=params, activation_bytes=acts,
                                    replicas=1, downstream=0,
                                    optimizer_state_factor=options.optimizer_state_factor))
    high = max(high, 1.0)
    found = peak(high) or high
    low = 0.0
    while high - low > MEMORY_TOLERANCE * high:
        middle = (low + high) / 2
        reached = peak(middle)
        if reached is None:
            low = middle
        else:
            high, found = middle, min(found, reached)
    return found


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
