"""The planner's candidates: the partitioner's plans under ladders of memory budgets and link
speeds, each simulated once, as it would run, on the real cluster.

Usage::

    pool = CandidatePool(profile, cluster, schedule, num_microbatches, sim,
                         reschedule_all=False)
    found = pool.ladders([("partition", cluster), ("flat", flat)], options, partition_plan)
    found.append(pool.evaluate("dp", dp_plan, estimate_s))

Why ladders: the partitioner's cost model (PipeDream's steady state) is not the simulator's,
so the plan it rates best under the limit is not always the fastest simulated one, and a plan
the planner can make for a tighter limit, for slower links or for slower devices can beat it.
The planner therefore asks the partitioner along two ladders and keeps the fastest simulated
plan that fits:

- link speeds: every level's bandwidth times :data:`BANDWIDTH_RUNGS`, nearest first (twice
  the bandwidth is the partitioner's plan for devices half as fast: its cost model depends on
  bandwidth over speed only), each way until :data:`STABLE_RUNGS` rungs give no new free plan;
- memory, on every link rung alike: the free plan; under a limit it exceeds, the limit times
  :data:`FLUSH_BUDGET_SCALES` (flush schedules, whose budget counts a replica's whole share of
  the minibatch in flight where 1F1B holds less) and the limit itself; then :data:`WALK_STEPS`
  plans down the memory axis, each the partitioner's plan under the greatest point of a fixed
  grid below the last plan's need (:func:`grid_below`: 1 GB times powers of 2 ** (1 /
  :data:`GRID_POINTS_PER_DOUBLING`), 4.4% apart). Flush schedules walk down from their last
  plan even when the limit itself has none (the simulator's 1F1B holds less than the
  partitioner's model of it).

Why a grid: the partitioner's plan changes with its budget in steps (a plan answers every
budget from its need up to the next plan's), so a walk that steps to the grid point below
each plan's need meets the plan of every grid point it passes, and the walks of two limits
merge at the first grid point they share: a looser limit's walk holds a tighter limit's grid
plans that lie within its depth. It does not hold the tighter limit's own plan when no grid
point lies between that limit and the plan's need, nor the tighter limit's plans below its own
last step; only a walk of every plan down to the smallest memory would (ResNet-50 on
4x16GB/s,4x10Gb/s: 93 solves, 55 s; on 16 flat devices at 25 Gb/s under PipeDream's schedule,
32 grid plans per link rung from the free plan's 39.6 GB to 6.2 GB, where a rung now takes 7).
Of the link ladder, twice the bandwidth or devices twice as fast hold the slower cluster's
rungs but for the far end of its ladder. Work is charged a whole rung at a time, before its
walk (:func:`walk_solves` solves of :func:`solve_work` each), so that every limit of a model on
a cluster walks the same rungs. The planner is thus monotone along the ladders in practice, not
by construction: ``tests/test_planner_properties.py`` checks it on a sample, on issue 28's
series and on series of limits, and says where it is not. Identical layouts are simulated once
(by stages, layer order, schedule and micro-batches). Work is bounded: rungs beyond the
:data:`ESSENTIAL_SOLVES` of the cluster's own links are walked within :data:`MAX_SOLVE_WORK`
and :data:`MAX_LAYOUTS`, and solves that fill tables of gigabytes (:data:`ESSENTIAL_WORK`) take
only the free plan and the limit's.

Micro-batch counts divide the minibatch (what ``tandem train`` requires): the smallest divisor
at least each multiple :data:`MICROBATCH_FACTORS` of the default; with the minibatch unknown
(a PipeDream ``graph.txt`` without ``--profile-batch``) the next power of two.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from tandem.cluster import Cluster, Level
from tandem.errors import UsageError
from tandem.plan import Plan, default_microbatches
from tandem.planning.partition.pipedream import NoPlanFits, PartitionOptions
from tandem.planning.simulate.simulator import SimOptions, SimResult, simulate
from tandem.profile import ModelProfile
from tandem.spec.kinds import ScheduleKind

MICROBATCH_FACTORS = (1, 2, 4)
"""Flush schedules without a given count: micro-batches tried, as multiples of the default."""
BANDWIDTH_RUNGS = (1.0, 0.5, 2.0, 0.25, 4.0, 0.125, 8.0, 1 / 16, 16.0, 1 / 32, 32.0, 1 / 64, 64.0)
"""Every level's bandwidth times these when partitioning, nearest first (1: the cluster as it
is; above 1: the plans for devices that many times slower; below 1: for slower links); each
plan simulated on the real cluster."""
STABLE_RUNGS = 2
"""Rungs in one direction whose free plans are all layouts seen before, after which the ladder
stops that way (the partitioner's plan no longer changes with the links there)."""
FLUSH_BUDGET_SCALES = (8.0, 4.0, 2.0)
"""Flush schedules: budgets above the limit, as multiples of it (the partitioner budgets a
replica's whole share in flight; 1F1B's simulated peak is often lower)."""
GRID_BASE_BYTES = 1e9
"""Memory budgets below the limit lie on a grid: this times powers of 2 ** (1 /
:data:`GRID_POINTS_PER_DOUBLING`) (1 GB, 1.04 GB, 1.09 GB, ...)."""
GRID_POINTS_PER_DOUBLING = 16
"""Grid points per doubling of the budget: 4.4% apart."""
WALK_STEPS = 5
"""Plans down the memory axis per link rung, below the limit's (or the free plan): each the
partitioner's plan under the grid point below the last one's need."""
ESSENTIAL_SOLVES = 6
"""Solves on the cluster's own links taken whatever the :data:`MAX_SOLVE_WORK` (and not counted
in it): the free plan, the limit's (flush schedules: with those above it) and the first steps
down the memory axis (the plans nearest the limit, which the simulator often rates far apart:
ResNet-50 on 4x16GB/s,4x10Gb/s under PipeDream's schedule at 16 GB, 4-12 at 334 ms, then
4-4-4-4 at 65 ms)."""
ESSENTIAL_WORK = 2e8
"""Solves up to this size (:func:`solve_work`; ResNet-50 on servers of 4 is 9e7) walk down the
memory axis; larger ones (a 1,000-layer chain on 1,024 devices, 1e9) take only the free plan
and the limit's, on the cluster's own links."""
MEMORY_RETRIES = 3
"""Times a plan at the limit whose simulated devices exceed it is solved again, the limit
shrunk by the overflow."""
MAX_LAYOUTS = 48
"""Distinct pipeline layouts simulated per planning after which no further link rung is walked
(the first rungs first)."""
MAX_SOLVE_WORK = 2e7
"""Partitioner work (:func:`solve_work`) per planning beyond the :data:`ESSENTIAL_SOLVES`, a
whole link rung at a time: ResNet-50 on 16 flat devices walks up to 4 rungs under 1F1B and 6 under
PipeDream's schedule (2 and 3 at 1e7, where issue 28's bandwidth series were not monotone: the
plan for twice the bandwidth lacks the slower cluster's lowest rung); a hierarchy of servers
of 4 walks its own links' essential solves only."""

Solve = Callable[[Cluster, PartitionOptions], Plan]
"""The partitioner: a plan for a cluster under options (:class:`NoPlanFits` when none fits)."""


@dataclasses.dataclass(kw_only=True, slots=True)
class Candidate:
    """One plan the planner compared."""

    name: str
    """``partition`` (on the cluster), ``flat`` (on a flat cluster at its slowest link), ``dp``
    or ``single``."""
    plan: Plan | None
    """The plan as it would run; None when the partitioner found none (``note`` says why)."""
    estimate_s: float | None = None
    """The partitioner's own estimate on this cluster (None for other rungs)."""
    result: SimResult | None = None
    """Its simulation on the real cluster."""
    note: str = ""
    """Where it came from, or why it is not eligible."""

    @property
    def fits(self) -> bool:
        """Simulated, and its devices' peaks within the memory limit."""
        return self.result is not None and self.result.fits_memory

    @property
    def step_s(self) -> float:
        """Simulated time per step (infinite when not simulated)."""
        return self.result.step_time_s if self.result is not None else float("inf")

    def row(self, chosen: bool) -> dict[str, Any]:
        """The candidate as a row of ``Plan.candidates``."""
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


def better(trial: Candidate, best: Candidate) -> bool:
    """Fitting before not fitting, then faster."""
    if trial.fits != best.fits:
        return trial.fits
    return trial.step_s < best.step_s


class CandidatePool:
    """Simulates candidates on one cluster with one schedule, each layout once."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, schedule: ScheduleKind,
                 num_microbatches: int | None, sim: SimOptions, *,
                 reschedule_all: bool) -> None:  # fmt: skip
        self.profile = profile
        self.cluster = cluster
        self.schedule = schedule
        self.num_microbatches = num_microbatches
        self.sim = sim
        self.reschedule_all = reschedule_all
        self.batch = minibatch(profile, sim)
        self._results: dict[tuple[Any, ...], SimResult] = {}
        self._layouts: set[tuple[Any, ...]] = set()
        self._spent = 0.0

    def evaluate(self, name: str, plan: Plan, estimate_s: float | None, note: str = "", *,
                 as_is: bool = False) -> Candidate:  # fmt: skip
        """``plan`` as it would run (pipelines with the schedule and the best micro-batch
        count; one-stage plans as data parallelism unless a schedule was asked for; ``as_is``:
        as given), simulated; no plan, with the reason, when it cannot run on this minibatch."""
        try:
            variants = [plan] if as_is else self._variants(plan)
        except UsageError as exc:
            return Candidate(name=name, plan=None, estimate_s=estimate_s, note=str(exc))
        best: Candidate | None = None
        for variant in variants:
            trial = Candidate(name=name, plan=variant, estimate_s=estimate_s,
                              result=self._simulated(variant), note=note)
            if best is None or better(trial, best):
                best = trial
        assert best is not None  # _variants gives at least one
        return best

    def _variants(self, plan: Plan) -> list[Plan]:
        if len(plan.stages) == 1 and not self.reschedule_all:
            replicas = plan.stages[0].replicas
            if self.batch is not None and self.batch % replicas:
                raise UsageError(f"its {replicas} replicas do not divide the minibatch of "
                                 f"{self.batch}")
            return [plan.rescheduled(ScheduleKind.ONE_F_ONE_B)]
        counts = microbatch_counts(plan, self.schedule, self.num_microbatches, self.batch)
        return [plan.rescheduled(self.schedule, count) for count in counts]

    def _simulated(self, plan: Plan) -> SimResult:
        key = layout_key(plan) + (plan.schedule, plan.num_microbatches)
        if key not in self._results:
            self._results[key] = simulate(plan, self.profile, self.cluster, self.sim)
        return self._results[key]

    def ladders(self, views: list[tuple[str, Cluster]], options: PartitionOptions,
                solve: Solve) -> list[Candidate]:
        """The partitioner's plans (``solve(cluster, options)``) for each view of the cluster
        (its name and the cluster the partitioner sees) on the rungs of the link and memory
        ladders (module docstring), simulated on the real cluster, nearest rungs first: on
        each link rung the free plan and the walk down the memory grid (:meth:`_walk`); each
        distinct layout once, within :data:`MAX_SOLVE_WORK` and :data:`MAX_LAYOUTS`."""
        found: list[Candidate] = []
        idle = {direction: 0 for direction in (1.0, -1.0)}
        free: set[tuple[Any, ...]] = set()
        for factor in BANDWIDTH_RUNGS:
            direction = 1.0 if factor >= 1.0 else -1.0
            if idle[direction] >= STABLE_RUNGS:
                continue  # the plans stopped changing this way
            before = len(free)
            for name, view in views:
                rung = _Rung(name, dataclasses.replace(scale_links(view, factor),
                                                       memory_bytes=None), factor)
                work = solve_work(self.profile.num_layers, rung.cluster)
                if work > ESSENTIAL_WORK:
                    found += self._free_and_limit(rung, options, solve)
                else:
                    rung.allowed = self._allowance(rung, work, options)
                    found += self._walk(rung, options, solve)
                free |= {rung.free} if rung.free is not None else set()
            idle[direction] = idle[direction] + 1 if len(free) == before else 0
        return found

    def _allowance(self, rung: _Rung, work: float, options: PartitionOptions) -> int:
        """Solves ``rung`` may take (each of ``work``): its whole walk (:func:`walk_solves`)
        when that fits what is left of :data:`MAX_SOLVE_WORK` and :data:`MAX_LAYOUTS` (charged
        whole, however many it takes, so that a looser limit or another cluster walks the same
        rungs), else the :data:`ESSENTIAL_SOLVES` on the cluster's own links, else none."""
        solves = walk_solves(options)
        essential = ESSENTIAL_SOLVES if rung.factor == 1.0 else 0
        charge = work * max(0, solves - essential)
        if self._spent + charge > MAX_SOLVE_WORK or len(self._layouts) >= MAX_LAYOUTS:
            return essential
        self._spent += charge
        return solves

    def _solve(self, rung: _Rung, options: PartitionOptions, solve: Solve,
               budget: float | None) -> Plan | None:
        """The partitioner's plan on ``rung`` under ``budget`` (None when none fits it)."""
        try:
            plan = solve(rung.cluster, dataclasses.replace(options, memory_bytes=budget))
        except NoPlanFits:
            return None
        rung.need = plan_need(plan)
        return plan

    def _free_and_limit(self, rung: _Rung, options: PartitionOptions,
                        solve: Solve) -> list[Candidate]:  # fmt: skip
        """Solves that fill tables of gigabytes (a 1,000-layer chain on 1,024 devices): on the
        cluster's own links only, the free plan and, when it needs more, the limit's."""
        if rung.factor != 1.0:
            return []
        plan = self._solve(rung, options, solve, None)
        if plan is None:
            return []
        rung.free = layout_key(plan)
        found = self._take(rung, plan, None)
        limit = options.memory_bytes
        if limit is None or rung.need <= limit:
            return found
        plan = self._solve(rung, options, solve, limit)
        taken = [] if plan is None else self._take(rung, plan, limit)
        if taken and not taken[0].fits:
            taken += self._shrunk(rung, options, solve, taken[0])
        return found + taken

    def _walk(self, rung: _Rung, options: PartitionOptions, solve: Solve) -> list[Candidate]:
        """The free plan; under a limit that it exceeds, the limit's plan (flush schedules
        first the limit times :data:`FLUSH_BUDGET_SCALES`; a plan the simulator finds over the
        limit solved again, :meth:`_shrunk`); then :data:`WALK_STEPS` plans down the memory
        axis, each the partitioner's plan under the grid point (:func:`grid_below`) below the
        last one's need; as many solves as ``rung.allowed`` (:meth:`_allowance`)."""

        def attempt(budget: float | None) -> Plan | None:
            if rung.allowed <= 0:
                return None
            rung.allowed -= 1
            return self._solve(rung, options, solve, budget)

        plan = attempt(None)
        if plan is None:
            return []
        rung.free = layout_key(plan)
        found = self._take(rung, plan, None)
        limit = options.memory_bytes
        if limit is not None:
            at_limit = self._at_limit(rung, options, solve, attempt, limit)
            if at_limit is None:
                return found  # nothing holds that little, by the simulator too
            found += at_limit
        for _ in range(WALK_STEPS):
            budget = grid_below(rung.need)
            plan = attempt(budget)
            if plan is None:
                break
            found += self._take(rung, plan, budget)
        return found

    def _at_limit(self, rung: _Rung, options: PartitionOptions, solve: Solve,
                  attempt: Callable[[float], Plan | None], limit: float) -> list[Candidate] | None:
        """The plans under ``limit`` (flush schedules: first under it times
        :data:`FLUSH_BUDGET_SCALES`) that the last plan does not answer, the first within the
        limit solved again when the simulator finds it over (:meth:`_shrunk`); None when no
        plan holds ``limit`` under PipeDream's schedule (whose memory the partitioner's model
        gives exactly). Under a flush schedule the walk goes on from the last plan: plans that
        hold more by that model may fit."""
        flushes = options.schedule.flushes
        found: list[Candidate] = []
        scales = (*FLUSH_BUDGET_SCALES, 1.0) if flushes else (1.0,)
        for budget in [limit * scale for scale in scales]:
            if rung.need <= budget:
                continue  # the last plan is this budget's plan
            plan = attempt(budget)
            if plan is None:
                return found if flushes else None
            taken = self._take(rung, plan, budget)
            found += taken
            if rung.need <= limit and rung.factor == 1.0 and taken and not taken[0].fits:
                found += self._shrunk(rung, options, solve, taken[0])
        return found

    def _shrunk(self, rung: _Rung, options: PartitionOptions, solve: Solve,
                over: Candidate) -> list[Candidate]:  # fmt: skip
        """A plan at the limit whose simulated devices exceed it, solved again under the limit
        shrunk by the overflow (:data:`MEMORY_RETRIES` times): outer levels of a hierarchy and
        micro-batches shared unevenly among a stage's replicas hold more than the budget."""
        limit = options.memory_bytes
        assert limit is not None and over.result is not None
        found: list[Candidate] = []
        budget = limit
        for _ in range(MEMORY_RETRIES):
            budget *= limit / over.result.peak_memory_bytes * 0.999
            plan = self._solve(rung, options, solve, budget)
            if plan is None:
                break
            taken = self._take(rung, plan, budget)
            found += taken
            if not taken or taken[0].fits or taken[0].result is None:
                break
            over = taken[0]
        return found

    def _take(self, rung: _Rung, plan: Plan, budget: float | None) -> list[Candidate]:
        """``plan`` evaluated, unless its layout was already."""
        key = layout_key(plan)
        if key in self._layouts:
            return []
        self._layouts.add(key)
        where = [] if rung.factor == 1.0 else [f"links x{rung.factor:g}"]
        where += [] if budget is None else [f"budget {budget / 1e9:.3g} GB"]
        return [self.evaluate(rung.name, plan, plan.estimate_s if rung.factor == 1.0 else None,
                              note=", ".join(where))]


@dataclasses.dataclass(slots=True)
class _Rung:
    """One view of the cluster at one link speed, and the need of its last plan."""

    name: str
    """The candidates' name (``partition`` or ``flat``)."""
    cluster: Cluster
    """The cluster the partitioner sees: the view's links scaled, no memory of its own."""
    factor: float
    """The scale of its links."""
    need: float = float("inf")
    """The last plan's need by the partitioner's memory model."""
    free: tuple[Any, ...] | None = None
    """The layout of its free plan (:func:`layout_key`), once solved."""
    allowed: int = 0
    """Solves it may still take (:meth:`CandidatePool._allowance`)."""


def walk_solves(options: PartitionOptions) -> int:
    """Solves of a link rung's whole walk down the memory axis: the free plan, under a limit the
    limit's (and for flush schedules those above it), and :data:`WALK_STEPS`."""
    limits = 0 if options.memory_bytes is None else 1 + (
        len(FLUSH_BUDGET_SCALES) if options.schedule.flushes else 0)
    return 1 + limits + WALK_STEPS


def solve_work(num_layers: int, cluster: Cluster) -> float:
    """A size for one partitioner solve: inner levels fill a table of every segment on every
    unit count (``layers^3 x units^2``), the outermost one row (``layers^2 x units``); 40
    layers on 16 devices is 25,600."""
    inner = sum(level.num_units**2 for level in cluster.levels[:-1])
    return float(num_layers**3 * inner + num_layers**2 * cluster.levels[-1].num_units)


def plan_need(plan: Plan) -> float:
    """The partitioner's memory model of ``plan``: its largest stage's bytes per device."""
    return max(stage.memory_bytes for stage in plan.stages)


def grid_below(nbytes: float) -> float:
    """The greatest grid point below ``nbytes`` (:func:`grid_point`)."""
    return grid_point(grid_index(nbytes) - 1)


def grid_index(nbytes: float) -> int:
    """The index of the least grid point at least ``nbytes``."""
    index = math.ceil(math.log2(nbytes / GRID_BASE_BYTES) * GRID_POINTS_PER_DOUBLING - 1e-9)
    return index if grid_point(index) >= nbytes else index + 1


def grid_point(index: int) -> float:
    """Grid point ``index``: :data:`GRID_BASE_BYTES` times 2 to the ``index /``
    :data:`GRID_POINTS_PER_DOUBLING`."""
    return float(GRID_BASE_BYTES * 2.0 ** (index / GRID_POINTS_PER_DOUBLING))


def scale_links(cluster: Cluster, factor: float) -> Cluster:
    """``cluster`` with every level's bandwidth times ``factor``."""
    if factor == 1.0:
        return cluster
    levels = tuple(Level(num_units=level.num_units, bandwidth_Bps=level.bandwidth_Bps * factor,
                         latency_s=level.latency_s) for level in cluster.levels)
    return dataclasses.replace(cluster, levels=levels)


def layout_key(plan: Plan) -> tuple[Any, ...]:
    """What makes two plans the same layout: stages (layers, replicas, devices), layer order,
    tensor degree and sharding."""
    stages = tuple((s.start, s.end, s.replicas, tuple(s.devices or ())) for s in plan.stages)
    sharding = (plan.shard_degree, plan.shard_level) if plan.sharded else None
    return (stages, tuple(plan.layer_order or ()), plan.tensor_degree, sharding)


def minibatch(profile: ModelProfile, sim: SimOptions) -> int | None:
    """Samples in the minibatch the plan runs, when known and whole."""
    if not profile.batch_size:
        return None
    samples = profile.batch_size * sim.batch_scale
    return int(samples) if float(samples).is_integer() and samples >= 1 else None


def microbatch_counts(plan: Plan, schedule: ScheduleKind, given: int | None,
                      batch: int | None) -> list[int | None]:
    """Micro-batch counts to try for ``plan`` under ``schedule``: ``given`` (checked), or the
    smallest divisor of ``batch`` at least each multiple of the default (a multiple of the
    replicas for data parallelism); :class:`UsageError` when none can run."""
    if not schedule.flushes:
        return [None]
    step = plan.stages[0].replicas if len(plan.stages) == 1 and schedule.accumulates else 1
    if given is not None:
        if given % step:
            raise UsageError(f"--microbatches {given} is not a multiple of its {step} replicas")
        if batch is not None and batch % given:
            raise UsageError(f"--microbatches {given} does not divide the minibatch of {batch}")
        return [given]
    if batch is not None and batch % step:
        raise UsageError(f"its {step} replicas do not divide the minibatch of {batch}")
    base = default_microbatches(plan.replicas, schedule)
    counts: list[int | None] = []
    for factor in MICROBATCH_FACTORS:
        count = _count_at_least(base * factor, step, batch)
        if count is not None and count not in counts:
            counts.append(count)
    return counts or [batch]


def _count_at_least(wanted: int, step: int, batch: int | None) -> int | None:
    """The smallest multiple of ``step`` at least ``wanted`` that divides ``batch`` (None when
    there is none); without a batch, the smallest such power-of-two multiple of ``step``."""
    if batch is None:
        count = step
        while count < wanted:
            count *= 2
        return count
    return next((count for count in range(step, batch + 1, step)
                 if count >= wanted and batch % count == 0), None)
