"""PipeDream's partitioner: stages and a replica count per stage, minimizing the slowest stage.

Usage::

    result = partition(profile, cluster, PartitionOptions(activation_compression=1.0))
    result.bottleneck_s, [(s.layers, s.replicas) for s in result.stages]

The cost model is PipeDream's (``optimizer_graph_hierarchical.py``), level by level, innermost
first. At a level with bandwidth ``B`` whose units each hold ``D`` devices, a stage made of the
layers between states ``k`` and ``j`` (compute ``C``, parameters ``P``) on ``r`` units, with
gradients compressed ``G`` times (``gradient_compression``, 1 by default), takes::

    time = (C + 4 (r - 1) P / (B r) / D / G) / r

and, when activations are costed (``activation_compression`` R is set) and the stage is not the
first one of its pipeline, at least ``2 a_k / (B r) / R`` to receive its input and
``2 a_j / (B r) / R`` to send its output (none after the model's last layer). At outer levels
``C`` is the best time of the segment on one unit of the level below. The plan minimizes the
slowest stage (the pipeline's steady-state time per minibatch) with exactly as many units as the
level has, unless idle units are allowed. With a memory limit, every stage's devices must hold
what :mod:`tandem.planning.partition.memory` says they hold under ``options.schedule`` (PipeDream's: a
stage on ``r`` units with ``d`` units after it keeps ``1 + ceil(d / r)`` minibatches in flight
and as many weight versions less one; flush schedules: its share of one minibatch), plus
gradients and optimizer state.

What it does not model: overlap of communication with compute beyond the max above, pipeline
fill and drain, latency, and stragglers — see ``tandem simulate`` for those.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem.cluster import Cluster
from tandem.errors import UsageError
from tandem.planning.partition import memo
from tandem.planning.partition.antichain import States
from tandem.planning.partition.bounded import known_bound, one_stage_bound, solve_row0
from tandem.planning.partition.levels import DeviceStages, LevelProblem, LevelTable, solve_level
from tandem.planning.partition.limited import memory_bracket as limited_bracket
from tandem.planning.partition.limited import quick_plan, search_limited
from tandem.planning.partition.memory import FLUSH_SCHEDULES
from tandem.planning.partition.parametric import solve_level_fast
from tandem.profile import ModelProfile
from tandem.spec.kinds import ScheduleKind


class NoPlanFits(UsageError):
    """No partition meets the memory limit (or, with exactly every unit used, exists at all)."""


def schedule_kind(name: ScheduleKind | str) -> ScheduleKind:
    """The schedule kind ``name`` names; :class:`UsageError` naming the known ones."""
    kind = ScheduleKind.parse(name)
    if kind is None:
        raise UsageError(f"unknown schedule {name!r}: use pipedream, "
                         f"{' or '.join(FLUSH_SCHEDULES)}")
    return kind


@dataclass(kw_only=True, slots=True, frozen=True)
class PartitionOptions:
    """Choices that change the cost model or the plans considered."""

    activation_compression: float | None = 1.0
    """Divide activation-transfer time by this ratio; None ignores activation transfer
    (PipeDream's default, ``--no-activation-comm``)."""
    gradient_compression: float = 1.0
    """Divide the allreduce time of replicated stages (and of data parallelism) by this ratio:
    what a gradient codec saves (``--gradient-compression``; e.g. 2 for fp16, 32 for sign)."""
    straight: bool = False
    """Give every stage exactly one unit (no replication)."""
    allow_idle: bool = False
    """Allow plans that leave units idle when that is faster."""
    memory_bytes: float | None = None
    """Per-device memory limit in bytes; None for no limit."""
    schedule: ScheduleKind = ScheduleKind.PIPEDREAM
    """The schedule whose memory a limit budgets (:mod:`tandem.planning.partition.memory`): PipeDream's
    in-flight minibatches and stashed weights, or a flush schedule's (``gpipe``, ``1f1b``)."""
    optimizer_state_factor: float = 1.0
    """Optimizer state bytes per parameter byte (SGD with momentum 1, Adam 2)."""
    exact_dp: bool = False
    """Always fill the dynamic program's table, never the parametric search (which is exact too;
    this is for testing)."""

    def __post_init__(self) -> None:
        ratio = self.activation_compression
        if ratio is not None and not (ratio > 0 and math.isfinite(ratio)):
            raise UsageError(f"--activation-compression must be a positive number (got {ratio})")
        ratio = self.gradient_compression
        if not (ratio > 0 and math.isfinite(ratio)):
            raise UsageError(f"--gradient-compression must be a positive number (got {ratio})")
        if self.memory_bytes is not None and not self.memory_bytes > 0:
            raise UsageError(f"memory limit must be positive (got {self.memory_bytes} bytes)")
        object.__setattr__(self, "schedule", schedule_kind(self.schedule))  # frozen: read once
        if not (self.optimizer_state_factor >= 0 and math.isfinite(self.optimizer_state_factor)):
            raise UsageError(f"--optimizer-state must be a number >= 0 (got "
                             f"{self.optimizer_state_factor})")


@dataclass(kw_only=True, slots=True, frozen=True)
class StageChoice:
    """One stage of a solved partition, flattened across levels."""

    before: int
    """State index this stage starts after (-1: from the start)."""
    state: int
    """State index this stage ends at (its layers are ``state`` minus ``before``)."""
    replicas: int
    """Devices running this stage (product of its replica counts at every level)."""
    time_s: float
    """Predicted time per minibatch of this stage (the pipeline runs at the slowest stage)."""
    level_replicas: tuple[int, ...]
    """Replica count at each level, innermost first."""
    devices: tuple[int, ...] = ()
    """The devices running the stage: at every level a segment takes the next units of each
    unit that holds it, so an inner pipeline replicated over servers keeps its stages' links
    inside each server."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Partition:
    """The solved partition: stages in pipeline order and predicted times."""

    states: States
    """The states the stage boundaries are drawn from."""
    stages: tuple[StageChoice, ...]
    """Stages in pipeline order."""
    bottleneck_s: float
    """Time per minibatch of the slowest stage."""
    single_s: float
    """Time per minibatch on one device."""
    data_parallel_s: float
    """Time per minibatch of data parallelism on all devices (PipeDream's formula)."""
    level_configs: tuple[str, ...]
    """PipeDream's text form per level, innermost first (outer levels count units)."""


def partition(
    profile: ModelProfile, cluster: Cluster, options: PartitionOptions | None = None
) -> Partition:
    """Solve PipeDream's dynamic program for ``profile`` on ``cluster`` (once per distinct
    question: :mod:`.memo`)."""
    options = options or PartitionOptions()
    memory = options.memory_bytes if options.memory_bytes is not None else cluster.memory_bytes
    options = dataclasses.replace(options, memory_bytes=memory)
    content = memo.content(profile)
    return memo.recall((content, cluster.levels, cluster.speed, options),
                       lambda: _partition(profile, content, cluster, options), NoPlanFits)


def _partition(profile: ModelProfile, content: memo.Content, cluster: Cluster,
               options: PartitionOptions) -> Partition:  # fmt: skip
    memory = options.memory_bytes
    states = memo.states_of(profile, content)
    _check_stage_count(states, cluster, options)
    fit_key = (content, cluster.num_devices, options.schedule, options.optimizer_state_factor,
               options.straight, options.allow_idle)
    limited = memory if len(cluster.levels) == 1 else None  # feasibility: memory's alone
    if limited is not None and memo.infeasible(fit_key, limited):
        raise NoPlanFits(_infeasible_message(cluster, limited))
    compute, params, stash = _segments(states, cluster.speed)
    tables: list[LevelTable] = []
    inner: DeviceStages | None = None
    top = len(cluster.levels) - 1
    for level_index in range(len(cluster.levels)):
        problem = _level_problem(states, (compute, params, stash), cluster, level_index, options,
                                 inner)
        if level_index == top:
            one_level = len(cluster.levels) == 1
            known = memo.known_plans((content, cluster.num_devices)) if one_level else []
            searches = (content, cluster.levels, cluster.speed,
                        dataclasses.replace(options, memory_bytes=None))
            tables.append(_solve(problem, options, known, searches))
            break
        key = (content, cluster.speed, cluster.levels[: level_index + 1], options)
        family = (content, cluster.speed, cluster.levels[:1],
                  dataclasses.replace(options, memory_bytes=None)) if level_index == 0 else None
        table, inner = memo.inner_table(
            key, lambda looser: _inner(problem, memory is not None, looser), family, memory)
        tables.append(table)
        compute = np.where(np.isnan(params), np.nan, table.best[:, :, -1])
    try:
        solved = _assemble(profile, cluster, states, tables, memory, options.gradient_compression)
    except NoPlanFits:
        if limited is not None:
            memo.note_infeasible(fit_key, limited)
        raise
    memo.note_plan((content, cluster.num_devices),
                   tuple((s.before, s.state, s.replicas) for s in solved.stages))
    return solved


def memory_bracket(profile: ModelProfile, cluster: Cluster, options: PartitionOptions,
                   high: float, tolerance: float) -> tuple[float, float | None] | None:
    """For a one-level ``cluster``: a budget below which no plan fits (by the shared memory
    model) and the least at which :mod:`.limited`'s quick search finds one on every device
    (None: none up to ``high``), to ``tolerance`` (:func:`.limited.memory_bracket`); None
    where that search does not apply (hierarchies, straight pipelines without idle devices) or
    nothing fits ``high``."""
    if len(cluster.levels) != 1 or (options.straight and not options.allow_idle):
        return None
    states = memo.states_of(profile, memo.content(profile))
    problem = _level_problem(states, _segments(states, cluster.speed), cluster, 0,
                             dataclasses.replace(options, memory_bytes=high), None)
    # every device holding the largest layer holds its weights, gradients and optimizer state
    largest = max(layer.parameter_bytes for layer in profile.layers)
    low = min(largest * (2 + options.optimizer_state_factor), high) * (1 - 1e-9)
    return limited_bracket(problem, max(low, high * 1e-12), high, tolerance)


def _segments(states: States, speed: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Compute seconds (on devices of ``speed``), parameter and stashed bytes of every segment."""
    compute = _segment_matrix(states, states.compute_s)
    if speed != 1:
        compute /= speed
    return (compute, _segment_matrix(states, states.parameter_bytes),
            _segment_matrix(states, states.activation_bytes))


def _level_problem(states: States, segments: tuple[np.ndarray, np.ndarray, np.ndarray],
                   cluster: Cluster, level_index: int, options: PartitionOptions,
                   inner: DeviceStages | None) -> LevelProblem:  # fmt: skip
    """Level ``level_index`` of ``cluster`` as a problem on ``segments`` (compute, parameter
    and stashed bytes)."""
    level = cluster.levels[level_index]
    return LevelProblem(
        states=states,
        compute_s=segments[0],
        parameter_bytes=segments[1],
        stash_bytes=segments[2],
        num_units=level.num_units,
        bandwidth_Bps=level.bandwidth_Bps,
        devices_per_unit=cluster.devices_per_unit(level_index),
        activation_compression=options.activation_compression,
        gradient_compression=options.gradient_compression,
        memory_bytes=options.memory_bytes,
        straight=options.straight,
        allow_idle=options.allow_idle,
        all_rows=level_index < len(cluster.levels) - 1,
        schedule=options.schedule,
        optimizer_state_factor=options.optimizer_state_factor,
        inner=inner,
    )


def _inner(problem: LevelProblem, limited: bool, looser: tuple[LevelTable, Any] | None
           ) -> tuple[LevelTable, DeviceStages | None]:  # fmt: skip
    """An inner level's full table (from ``looser``'s, the innermost level's under a looser
    limit, when given), and its plans' devices for the level above when memory is limited."""
    table = solve_level(problem, looser[0] if looser is not None else None)
    return table, table.device_stages() if limited else None


FAST_PATH_ELEMENTS = 50_000_000
"""Use the parametric fast path when the full table would touch more cells than this."""


def _solve(problem: LevelProblem, options: PartitionOptions, known: list[memo.StageKey],
           family: Hashable) -> LevelTable:
    """Row 0 of the final level.

    It goes to a parametric search when the table would be large (under a memory limit on a
    flat level, :mod:`.limited`), else to the table pruned by the bottleneck of a plan known to
    exist: the least among the ``known`` plans that fit (:func:`known_bound`), the whole model
    as one stage and, under a memory limit, the least bound :mod:`.limited` proves when it
    cannot prove the optimum, or else a plan its quick search finds (:func:`quick_plan`, which
    also proves at once that nothing fits). ``options.exact_dp``: the table, bounded by the
    whole model alone. ``family``: the problem under any memory limit, whose searches under
    other limits bound this one's (:func:`.memo.optimum_bounds`).
    """
    if options.exact_dp:
        return solve_row0(problem)
    pairs = int(problem.states.below.sum())
    bound = known_bound(problem, known) if known else math.inf
    limited = problem.inner is None and problem.memory_bytes is not None and (
        problem.allow_idle or not problem.straight)
    if pairs * problem.num_units**2 > FAST_PATH_ELEMENTS:
        fast = None
        if problem.memory_bytes is None:
            fast = solve_level_fast(problem)
        elif limited:
            low, high = memo.optimum_bounds(family, problem.memory_bytes)
            fast, proven, reached = search_limited(problem, low * (1 - 1e-12), high)
            if reached is not None:
                memo.note_optimum(family, problem.memory_bytes, reached)
            bound = min(bound, proven)
        if fast is not None:
            return fast
    elif limited and not math.isfinite(min(bound, one_stage_bound(problem))):
        feasible, quick = quick_plan(problem)
        if not feasible:
            return _infeasible_table(problem)
        if quick is not None:
            bound = known_bound(problem, [tuple(piece[:3] for piece in quick)])
    return solve_row0(problem, bound)


def _infeasible_table(problem: LevelProblem) -> LevelTable:
    """Row 0 when no plan fits: every cell inf."""
    best = np.full((1, problem.states.num_states, problem.num_units), np.inf)
    return LevelTable(problem=problem, best=best, pieces=[])


def _check_stage_count(states: States, cluster: Cluster, options: PartitionOptions) -> None:
    if options.straight and not options.allow_idle:
        need = cluster.num_devices
        if need > states.num_states:
            raise UsageError(
                f"--straight on {need} devices needs {need} stages but the model has only "
                f"{states.num_states} layers to cut between: use fewer devices or --allow-idle"
            )


def _segment_matrix(states: States, totals: np.ndarray) -> np.ndarray:
    """Row 0: totals of each state; row p >= 1: state j minus state p-1 (nan if not below)."""
    n = states.num_states
    matrix = np.empty((n + 1, n))
    matrix[0] = totals
    np.subtract(totals[None, :], totals[:, None], out=matrix[1:])
    np.copyto(matrix[1:], np.nan, where=~states.below)
    return matrix


def _assemble(
    profile: ModelProfile, cluster: Cluster, states: States, tables: list[LevelTable],
    memory: float | None, gradient_compression: float = 1.0,
) -> Partition:  # fmt: skip
    top = len(tables) - 1
    bottleneck = float(tables[top].best[0, states.num_states - 1, -1])
    if not math.isfinite(bottleneck):
        raise NoPlanFits(_infeasible_message(cluster, memory))
    stages = _expand(tables, top, 0, states.num_states - 1, ())
    configs = tuple(
        "-".join(str(r) for r in _level_config(stages, level)) for level in range(len(tables))
    )
    return Partition(
        states=states,
        stages=tuple(stages),
        bottleneck_s=bottleneck,
        single_s=float(states.compute_s[-1]) / cluster.speed,
        data_parallel_s=data_parallel_time(states, cluster, gradient_compression),
        level_configs=configs,
    )


def _infeasible_message(cluster: Cluster, memory: float | None) -> str:
    if memory is not None:
        return (
            f"no plan fits in {memory / 1e9:g} GB per device on {cluster.num_devices} devices: "
            "raise the memory limit (--memory), add devices, or use a smaller batch"
        )
    return f"no valid plan on {cluster.num_devices} devices: try --allow-idle"


def _level_config(stages: list[StageChoice], level: int) -> list[int]:
    counts: list[int] = []
    previous: tuple[int, ...] | None = None
    for stage in stages:
        key = stage.level_replicas[level + 1 :]
        if level == 0 or key != previous:
            counts.append(stage.level_replicas[level])
        previous = key
    return counts


def _expand(
    tables: list[LevelTable], level: int, row: int, state: int, outer: tuple[int, ...],
    containers: tuple[int, ...] = (0,),
) -> list[StageChoice]:  # fmt: skip
    """Flatten the stages of ``tables[level]`` for segment (row, state] into device stages.

    ``containers`` are the first devices of the units of the level above that each run the
    segment; a stage on ``r`` units takes the next ``r`` units (of ``D`` devices) in each.
    """
    pieces = tables[level].backtrack(row, state)
    size = tables[level].problem.devices_per_unit
    stages: list[StageChoice] = []
    used = 0
    for before, end, replicas, time_s, comm_s, moved_s in pieces:
        units = tuple(first + (used + i) * size for first in containers for i in range(replicas))
        used += replicas
        if level == 0:
            stages.append(StageChoice(before=before, state=end, replicas=replicas,
                                      time_s=time_s, level_replicas=(replicas, *outer),
                                      devices=units))  # fmt: skip
            continue
        inner = _expand(tables, level - 1, before + 1, end, (replicas, *outer), units)
        for choice in inner:
            scaled = max((choice.time_s + comm_s) / replicas, moved_s)
            stages.append(dataclasses.replace(choice, replicas=choice.replicas * replicas,
                                              time_s=scaled))
    return stages


def data_parallel_time(states: States, cluster: Cluster,
                       gradient_compression: float = 1.0) -> float:
    """PipeDream's data-parallel time per minibatch: nested allreduce, level by level, of
    gradients compressed ``gradient_compression`` times."""
    time_s = float(states.compute_s[-1]) / cluster.speed
    params = float(states.parameter_bytes[-1])
    for index, level in enumerate(cluster.levels):
        units = level.num_units
        comm = (4 * (units - 1) * params) / (level.bandwidth_Bps * units)
        comm /= cluster.devices_per_unit(index) * gradient_compression
        time_s = (time_s + comm) / units
    return time_s
