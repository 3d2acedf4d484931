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
- memory, on every link rung alike: the free plan, the limit times :data:`FLUSH_BUDGET_SCALES`
  (flush schedules, whose budget counts a replica's whole share of the minibatch in flight
  where 1F1B holds less), the limit itself, then the points of a fixed grid below it
  (:func:`grid_budgets`: 1 GB times powers of 2 ** (1 / :data:`GRID_POINTS_PER_DOUBLING`),
  :data:`GRID_RUNGS` of them below the free plan's need), and from each budget's plan up to
  :data:`STEPS_PER_BUDGET` plans down the memory axis (the budget the last plan's need less
  :data:`BUDGET_STEP`: the partitioner's best plan among those that hold less) until one
  holds less than the next grid point; the limit's steps first.

The link ladder is the cluster's own figures scaled by powers of 2, and the memory grid does
not depend on the limit or on the path down it, so the candidates of a looser limit, twice the
bandwidth or devices twice as fast include those of the tighter or slower cluster (all but the
far ends of its ladders, the limit's own plan and the steps below it, and what the work bounds
cut), which makes the planner monotone along them in practice; the property test
(``tests/test_planner_properties.py``) checks it on a sample and on issue 28's series. Identical
layouts are simulated once (by stages, layer order, schedule and micro-batches). Work is
bounded: solves beyond the first :data:`ESSENTIAL_SOLVES` on the cluster's own links stop at
:data:`MAX_SOLVE_WORK` (:func:`solve_work`), at most :data:`MAX_LAYOUTS` layouts are
simulated, and solves that fill tables of gigabytes (:data:`ESSENTIAL_WORK`) take only the free
plan and the limit's.

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
"""Memory budgets lie on a grid: this times powers of 2 (1 GB, 1.19 GB, 1.41 GB, ...)."""
GRID_POINTS_PER_DOUBLING = 4
"""Grid points per doubling of the budget."""
GRID_RUNGS = 5
"""Grid points below the free plan's need tried per link rung (a factor of 2.4 below it)."""
STEPS_PER_BUDGET = 2
"""Plans down the memory axis from each grid budget's, at most, until one holds less than the
next grid point (the plans between two grid points that the partitioner rates best)."""
ESSENTIAL_SOLVES = 6
"""Solves on the cluster's own links taken whatever the :data:`MAX_SOLVE_WORK` (and not counted
in it): the free plan, the limit's, two below it and the next two grid points (the plans
nearest the limit, which the simulator often rates far apart: ResNet-50 on 4x16GB/s,4x10Gb/s
at 16 GB, 4-12 at 334 ms, then 4-4-4-4 at 65 ms)."""
ESSENTIAL_WORK = 2e8
"""Solves up to this size (:func:`solve_work`; ResNet-50 on servers of 4 is 9e7) climb the
memory grid; larger ones (a 1,000-layer chain on 1,024 devices, 1e9) take only the free plan
and the limit's, on the cluster's own links."""
BUDGET_STEP = 1e-6
"""Down the memory axis, the next budget is the last plan's need less this fraction of it:
the partitioner's best plan among those that hold less."""
MEMORY_RETRIES = 3
"""Times a plan at the limit whose simulated devices exceed it is solved again, the limit
shrunk by the overflow."""
MAX_LAYOUTS = 48
"""Distinct pipeline layouts simulated per planning, at most (the first rungs first)."""
MAX_SOLVE_WORK = 1e7
"""Partitioner work (:func:`solve_work`) per planning beyond the :data:`ESSENTIAL_SOLVES`:
small models climb every rung, large ones and hierarchies fewer."""

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
        each link rung the free plan and the memory grid below it; each distinct layout once,
        within :data:`MAX_SOLVE_WORK` and :data:`MAX_LAYOUTS`."""
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
                if solve_work(self.profile.num_layers, rung.cluster) > ESSENTIAL_WORK:
                    found += self._free_and_limit(rung, options, solve)
                else:
                    found += self._grid(rung, options, solve)
                free |= {rung.free} if rung.free is not None else set()
            idle[direction] = idle[direction] + 1 if len(free) == before else 0
        return found

    def _solve(self, rung: _Rung, options: PartitionOptions, solve: Solve,
               budget: float | None, *, essential: bool) -> Plan | None:  # fmt: skip
        """The partitioner's plan on ``rung`` under ``budget`` (None when none fits it, or
        when the work runs out; ``essential`` ones always run)."""
        work = solve_work(self.profile.num_layers, rung.cluster)
        if not essential:
            if self._spent + work > MAX_SOLVE_WORK or len(self._layouts) >= MAX_LAYOUTS:
                return None
            self._spent += work
        try:
            plan = solve(rung.cluster, dataclasses.replace(options, memory_bytes=budget))
        except NoPlanFits:
            rung.exhausted = True
            return None
        rung.need = plan_need(plan)
        return plan

    def _free_and_limit(self, rung: _Rung, options: PartitionOptions,
                        solve: Solve) -> list[Candidate]:  # fmt: skip
        """Solves that fill tables of gigabytes (a 1,000-layer chain on 1,024 devices): on the
        cluster's own links only, the free plan and, when it needs more, the limit's."""
        if rung.factor != 1.0:
            return []
        plan = self._solve(rung, options, solve, None, essential=True)
        if plan is None:
            return []
        rung.free = layout_key(plan)
        found = self._take(rung, plan, None)
        limit = options.memory_bytes
        if limit is None or rung.need <= limit:
            return found
        plan = self._solve(rung, options, solve, limit, essential=True)
        taken = [] if plan is None else self._take(rung, plan, limit)
        if taken and not taken[0].fits:
            taken += self._shrunk(rung, options, solve, taken[0])
        return found + taken

    def _grid(self, rung: _Rung, options: PartitionOptions, solve: Solve) -> list[Candidate]:
        """The free plan, each budget of :func:`grid_budgets` once, then down the memory axis
        from each budget's plan: up to :data:`STEPS_PER_BUDGET` plans, each under the last
        one's need less :data:`BUDGET_STEP`, until one holds less than the next grid point.
        The first :data:`ESSENTIAL_SOLVES` solves on the cluster's own links always run."""
        solves = 0

        def attempt(budget: float | None) -> Plan | None:
            nonlocal solves
            solves += 1
            return self._solve(rung, options, solve, budget, essential=rung.factor == 1.0
                               and solves <= ESSENTIAL_SOLVES)

        plan = attempt(None)
        if plan is None:
            return []
        rung.free = layout_key(plan)
        found = self._take(rung, plan, None)
        limit = options.memory_bytes
        shrink = rung.factor == 1.0 and limit is not None
        reached: list[tuple[float, float]] = []  # the next grid point, the plan's need
        nearest = True
        for budget, below in grid_budgets(rung.need, limit, options.schedule):
            if rung.exhausted:
                break
            if rung.need > budget:  # else the last plan is this budget's plan
                plan = attempt(budget)
                if plan is None:
                    continue
                taken = self._take(rung, plan, budget)
                found += taken
                if shrink and limit is not None and rung.need <= limit and taken:
                    shrink = False  # the first plan the partitioner deems within the limit
                    if not taken[0].fits:
                        found += self._shrunk(rung, options, solve, taken[0])
            if nearest and (limit is None or budget <= limit):
                nearest = False  # the steps below the limit's plan first
                found += self._steps(rung, (below, rung.need), attempt)
            else:
                reached.append((below, rung.need))
        for last in reached:
            rung.exhausted = False
            found += self._steps(rung, last, attempt)
        return found

    def _steps(self, rung: _Rung, last: tuple[float, float],
               attempt: Callable[[float], Plan | None]) -> list[Candidate]:  # fmt: skip
        """Down the memory axis from a plan that needs ``last[1]``: up to
        :data:`STEPS_PER_BUDGET` plans, each the partitioner's best among those that hold less
        than the last, until one holds at most the next grid point ``last[0]``."""
        below, need = last
        found: list[Candidate] = []
        for _ in range(STEPS_PER_BUDGET):
            if need <= below:
                break
            plan = attempt(need * (1 - BUDGET_STEP))
            if plan is None:
                break
            found += self._take(rung, plan, need * (1 - BUDGET_STEP))
            need = rung.need
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
            plan = self._solve(rung, options, solve, budget, essential=True)
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
    """One view of the cluster at one link speed, and how far down the memory axis it is."""

    name: str
    """The candidates' name (``partition`` or ``flat``)."""
    cluster: Cluster
    """The cluster the partitioner sees: the view's links scaled, no memory of its own."""
    factor: float
    """The scale of its links."""
    need: float = float("inf")
    """The last plan's need by the partitioner's memory model."""
    exhausted: bool = False
    """No plan holds less than the last one."""
    free: tuple[Any, ...] | None = None
    """The layout of its free plan (:func:`layout_key`), once solved."""


def solve_work(num_layers: int, cluster: Cluster) -> float:
    """A size for one partitioner solve: inner levels fill a table of every segment on every
    unit count (``layers^3 x units^2``), the outermost one row (``layers^2 x units``); 40
    layers on 16 devices is 25,600."""
    inner = sum(level.num_units**2 for level in cluster.levels[:-1])
    return float(num_layers**3 * inner + num_layers**2 * cluster.levels[-1].num_units)


def plan_need(plan: Plan) -> float:
    """The partitioner's memory model of ``plan``: its largest stage's bytes per device."""
    return max(stage.memory_bytes for stage in plan.stages)


def grid_budgets(need: float, limit: float | None,
                 schedule: ScheduleKind) -> list[tuple[float, float]]:
    """The memory budgets of a link rung whose free plan needs ``need``, loosest first, each
    with the next grid point (:func:`grid_point`) below it. Under a limit, the limit times
    :data:`FLUSH_BUDGET_SCALES` (flush schedules) and the limit itself; then the grid points
    below the limit (below the free plan's need without a limit) down to :data:`GRID_RUNGS`
    points below the free plan's (a tighter limit: three points below it). The grid is fixed,
    so a looser limit's budgets include a tighter one's grid points. Budgets at or above
    ``need`` are left out (they give the free plan)."""
    free = grid_index(need) - 1  # the first grid point below the need
    top = free if limit is None else min(free, grid_index(limit) - 1)
    bottom = min(free - GRID_RUNGS + 1, top - 2)
    budgets: list[float] = []
    if limit is not None:
        scales = FLUSH_BUDGET_SCALES if schedule.flushes else ()
        budgets = [budget for budget in (*(limit * s for s in scales), limit) if budget < need]
    budgets += [grid_point(index) for index in range(top, bottom - 1, -1)]
    return [(budget, grid_point(grid_index(budget) - 1)) for budget in budgets]


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
