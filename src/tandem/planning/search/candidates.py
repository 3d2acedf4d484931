"""The planner's candidates: the partitioner's plans along a ladder of link speeds and, on each
rung, down a fixed grid of memory budgets, each plan simulated once, as it would run, on the
real cluster.

Usage::

    pool = CandidatePool(profile, cluster, schedule, num_microbatches, sim,
                         reschedule_all=False)
    found = pool.ladders([("partition", cluster), ("flat", flat)], options, partition_plan)
    found.append(pool.evaluate("dp", dp_plan, estimate_s))

Why ladders: the partitioner's cost model (PipeDream's steady state) is not the simulator's,
so the plan it rates best under the limit is not always the fastest simulated one, and a plan
it makes for a tighter budget, for slower links or for slower devices can beat it. The planner
therefore asks it along two ladders and keeps the fastest simulated plan that fits:

- link speeds: every level's bandwidth times :data:`BANDWIDTH_RUNGS`, nearest first (twice the
  bandwidth is the partitioner's plan for devices half as fast: its cost model depends on
  bandwidth over speed only), each way until :data:`STABLE_RUNGS` rungs give no new free plan;
  beyond the cluster's own links a rung is walked while its fixed charge, :data:`RUNG_SOLVES`
  solves of :func:`solve_work`, fits what is left of :data:`MAX_SOLVE_WORK`;
- memory, on every rung walked (:meth:`CandidatePool._walk`): the free plan, then the plans
  under the points of a fixed grid of budgets (:func:`grid_point`: 1 GB times powers of 2 ** (1
  / points per doubling)) below the free plan's need: :data:`FINE_POINTS` points per doubling
  (4.4% apart), or for a view whose solve is costly (:func:`grid_points`: a 1,000-layer chain on
  1,024 devices) :data:`SPARSE_POINTS`; on other rungs than the cluster's own, fine for
  :data:`WINDOW_POINTS` points below the free plan's need, then :data:`COARSE_POINTS` (19%,
  every fourth). The walk starts at the least point at or above the top (:func:`walk_top`: the
  limit, for flush schedules times :data:`FLUSH_BUDGET_SCALE` as the partitioner budgets a
  replica's whole share in flight where 1F1B holds less); on one level it goes down to the first
  point with no plan, on from each plan at the greatest point below its need; on a hierarchy it
  solves every point down to the least memory any plan on its devices needs
  (:meth:`CandidatePool._least`).

Why this is monotone in the limit, by construction: every candidate of a tighter limit is a
candidate of a looser one, which it fits too, so the looser limit's choice, the fastest that
fits, is no slower. Nothing above depends on the limit but where a walk starts: the grids are
fixed (a rung's by its free plan and its solve's size), the rungs walked and their order do not
depend on the limit (the charges are fixed, the stop rule reads free plans); nor do the free
plans, data parallelism or one device, nor a plan's simulated time (the limit only says whether
it fits). A one-level walk from a higher point passes every point below it: a budget's plan is
the partitioner's best among the plans that fit it (the first in its own order among equals; the
limited search's, the one its search finds at the optimum itself) and its memory check of a
stage is the plan's need, so every grid point between a plan's need and the budget it was solved
for has that same plan, and a walk that goes on at the greatest point below the need misses none
(``tests/test_planner_properties.py`` checks this against a solve at every point). Without idle
units: those count as devices after a stage in its check, and a walk with them solves every
point. On a hierarchy neither holds: an inner level checks a stage without the replicas above it
(for flush schedules more than it will hold) and keeps one plan per segment, so a point between
a plan's need and its budget can have another plan (ResNet-50 on servers of 4 under 1F1B: 31 of
82 points), and a budget with no plan may have one below it; there the walk solves every point
from its start down to a floor no plan goes below, so it passes every point of a tighter limit's
walk (where the floor is not known, it starts below the free plan's need whatever the limit).
Its later solves start from the inner level's table under the last budget
(:mod:`tandem.planning.partition.memo`), so ResNet-50 on servers of 4 walks the fine grid. The
limit's own plan is among the candidates unless a plan's need lies between the limit and the
grid point below it while the point above has a plan that needs more than the limit: a budget
off the grid would be a candidate of that one limit alone.

Not by construction: more bandwidth or faster devices (another cluster's ladder is around other
links: ``tests/test_planner_properties.py`` checks twice the bandwidth and devices twice as fast
on a sample, and issue 28's series). Identical layouts are simulated once (by stages, layer
order, schedule and micro-batches).

Pipelines run micro-batch counts that divide the minibatch
(:mod:`tandem.planning.search.microbatches`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from tandem.cluster import Cluster, Level
from tandem.errors import UsageError
from tandem.plan import Plan
from tandem.planning.partition.branches import compress_for_planning
from tandem.planning.partition.pipedream import NoPlanFits, PartitionOptions, memory_bracket
from tandem.planning.search.microbatches import microbatch_counts, minibatch
from tandem.planning.simulate.simulator import SimOptions, SimResult, simulate
from tandem.profile import ModelProfile
from tandem.spec.kinds import ScheduleKind

BANDWIDTH_RUNGS = (1.0, 0.5, 2.0, 0.25, 4.0, 0.125, 8.0, 1 / 16, 16.0, 1 / 32, 32.0, 1 / 64, 64.0)
"""Every level's bandwidth times these when partitioning, nearest first (1: the cluster as it
is; above 1: the plans for devices that many times slower; below 1: for slower links); each
plan simulated on the real cluster."""
STABLE_RUNGS = 2
"""Rungs in one direction whose free plans are all layouts seen before, after which the ladder
stops that way (the partitioner's plan no longer changes with the links there)."""
FLUSH_BUDGET_SCALE = 8.0
"""Flush schedules: walks start from the limit times this (the partitioner budgets a replica's
whole share in flight; 1F1B's simulated peak is often lower)."""
GRID_BASE_BYTES = 1e9
"""Memory budgets lie on a grid: this times powers of 2 ** (1 / points per doubling)."""
FINE_POINTS = 16
"""Grid points per doubling of the budget on the cluster's own links: 4.4% apart."""
COARSE_POINTS = 4
"""Grid points per doubling on other link rungs below their window: 19% apart, every fourth."""
WINDOW_POINTS = 8
"""Other link rungs: fine grid points below the free plan's need (to 71% of it) before the
coarse grid."""
FINE_WORK = 1e7
"""One-level views whose solve is within this size (:func:`solve_work`; ResNet-50 on 16
devices 5e5) walk the grid of :data:`FINE_POINTS`; costlier ones (a 300-layer chain on 1,024
devices 9e7, 1,000 layers 1e9) that of :data:`SPARSE_POINTS`."""
FINE_WORK_LEVELS = 1e8
"""As :data:`FINE_WORK` for hierarchies (VGG-16 on 2 servers of 4 1e6, ResNet-50 on servers of
4 9e7, on servers of 8 4e8): a walk's solves after its first start from the inner level's
table under the last budget and solve again only the cells it changes
(:mod:`tandem.planning.partition.memo`)."""
SPARSE_POINTS = 4
"""Grid points per doubling for costly views: 19% apart, every fourth fine point (2 per doubling,
41% apart, planned the 1,000-layer chain under PipeDream's schedule at 2.4 GB in 581.5 ms where
the limit's own plan runs 195.1 ms; 4 find that plan at 1.3x the solves)."""
FLOOR_TOLERANCE = 1e-2
"""Relative precision of the least memory a hierarchy's walk goes down to (:meth:`_least`)."""
RUNG_SOLVES = 7
"""Solves a link rung beyond the cluster's own is charged, before its walk, whatever it takes
(so that every limit walks the same rungs)."""
MAX_SOLVE_WORK = 2e7
"""Partitioner work (:func:`solve_work`) charged to link rungs beyond the cluster's own:
ResNet-50 on 16 flat devices walks 5 of them, the flat view of ResNet-50 on servers of 4 as
many; costly views walk none."""

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
        self._entry: dict[tuple[Any, ...], float] = {}
        self._spent = 0.0
        self._floor: tuple[float | None] | None = None

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
        (its name and the cluster the partitioner sees) on the rungs of the link ladder and,
        on each rung walked, down the memory grid (module docstring, :meth:`_walk`), simulated
        on the real cluster, nearest rungs first; each distinct layout once."""
        found: list[Candidate] = []
        idle = {direction: 0 for direction in (1.0, -1.0)}
        free: set[tuple[Any, ...]] = set()
        for factor in BANDWIDTH_RUNGS:
            direction = 1.0 if factor >= 1.0 else -1.0
            if idle[direction] >= STABLE_RUNGS:
                continue  # the plans stopped changing this way
            before = len(free)
            for name, view in views:
                cluster = dataclasses.replace(scale_links(view, factor), memory_bytes=None)
                work = solve_work(self.profile.num_layers, cluster)
                rung = _Rung(name, cluster, factor)
                if self._admitted(rung, work):
                    found += self._walk(rung, options, solve, work=work)
                free |= {rung.free} if rung.free is not None else set()
            idle[direction] = idle[direction] + 1 if len(free) == before else 0
        return found

    def _admitted(self, rung: _Rung, work: float) -> bool:
        """Whether ``rung`` is walked: the cluster's own links always; another rung when its
        charge, :data:`RUNG_SOLVES` solves of ``work`` whatever its walk takes, fits what is
        left of :data:`MAX_SOLVE_WORK` (charged before the walk, so that every limit walks
        the same rungs)."""
        if rung.factor == 1.0:
            return True
        charge = work * RUNG_SOLVES
        if self._spent + charge > MAX_SOLVE_WORK:
            return False
        self._spent += charge
        return True

    def _solve(self, rung: _Rung, options: PartitionOptions, solve: Solve,
               budget: float | None) -> Plan | None:
        """The partitioner's plan on ``rung`` under ``budget`` (None when none fits it)."""
        try:
            plan = solve(rung.cluster, dataclasses.replace(options, memory_bytes=budget))
        except NoPlanFits:
            return None
        rung.need = plan_need(plan)
        return plan

    def _free(self, rung: _Rung, options: PartitionOptions,
              solve: Solve) -> list[Candidate] | None:  # fmt: skip
        """The free plan on ``rung`` (a candidate under every limit), None when there is none."""
        plan = self._solve(rung, options, solve, None)
        if plan is None:
            return None
        rung.free = layout_key(plan)
        self._entry[rung.free] = 0.0
        return self._take(rung, plan, None)

    def _walk(self, rung: _Rung, options: PartitionOptions, solve: Solve, *,
              work: float) -> list[Candidate]:  # fmt: skip
        """The free plan, then the plans under the points of ``rung``'s grid (:func:`grid_points`
        per doubling for a solve of ``work``; on other rungs than the cluster's own, fine only
        in a window below the free plan's need) below the free plan's need, from the least
        point at or above the top (:func:`walk_top`) down. On one level to the first point with
        no plan, going on from each plan at the greatest point below its need (the points
        between have the same plan, without idle units); on a hierarchy every point, down to
        the least memory any plan on its devices needs (:meth:`_least`; where that is not known,
        from below the free plan's need whatever the limit, to the first point with no plan)."""
        found = self._free(rung, options, solve)
        if found is None:
            return []
        rung.coarse = grid_points(work, len(rung.cluster.levels))
        if rung.coarse != FINE_POINTS:
            rung.fine_from = math.inf
        elif rung.factor != 1.0:  # fine from the free plan's need down WINDOW_POINTS, then coarse
            rung.fine_from, rung.coarse = grid_point(grid_index(rung.need) - WINDOW_POINTS), \
                COARSE_POINTS
        one_level = len(rung.cluster.levels) == 1
        least = 0.0 if one_level else self._least(rung, options)
        budget = rung.below(rung.need)
        top = walk_top(options) if least is not None else None
        if top is not None:
            budget = min(budget, rung.at_or_above(top))
        while budget > (least or 0.0):
            plan = self._solve(rung, options, solve, budget)
            if plan is None and (one_level or least is None):
                break  # on one level none fits below either; else the walk is any limit's
            found += [] if plan is None else self._take(rung, plan, budget)
            skips = plan is not None and one_level and not options.allow_idle
            budget = rung.below(rung.need if skips else budget)
            if plan is not None:  # a candidate of every limit whose walk starts above budget
                entry = budget / walk_scale(options) if least is not None else 0.0
                key = layout_key(plan)
                self._entry[key] = min(self._entry.get(key, math.inf), entry)
        return found

    def _least(self, rung: _Rung, options: PartitionOptions) -> float | None:
        """A budget at or below which no plan on ``rung``'s devices fits, whatever its levels
        (memory does not depend on the links): the floor single passes of the limited search
        find on a flat cluster of as many devices (:func:`memory_bracket`), which a hierarchy's
        walk goes down to, passing budgets with no plan (its level-by-level plans may fit one
        below them); None where that search does not apply (straight pipelines without idle
        devices). Found once per pool."""
        if self._floor is None:
            flat = Cluster(levels=(Level(num_units=rung.cluster.num_devices,
                                         bandwidth_Bps=rung.cluster.levels[-1].bandwidth_Bps),))
            bracket = memory_bracket(compress_for_planning(self.profile).profile, flat,
                                     dataclasses.replace(options, memory_bytes=None),
                                     rung.need, FLOOR_TOLERANCE)
            self._floor = (None if bracket is None else bracket[0],)
        return self._floor[0]

    def least_limit(self, views: list[tuple[str, Cluster]], options: PartitionOptions,
                    solve: Solve, names: set[str]) -> float | None:
        """On a fresh pool: the least memory limit under which the ladders give a candidate
        named in ``names`` that fits (None: none at any). The walks without a limit give every
        candidate of every limit; each is one from the limit above which its walk passes its
        need (the free plans from any), and fits from its least simulated peak (of the
        micro-batch counts tried)."""
        found = self.ladders(views, dataclasses.replace(options, memory_bytes=None), solve)
        limits = [max(self._entry[layout_key(c.plan)] * (1 + 1e-9),
                      min(self._simulated(v).peak_memory_bytes for v in self._variants(c.plan)))
                  for c in found if c.name in names and c.plan is not None]
        return min(limits, default=None)

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
    fine_from: float = 0.0
    """Its memory grid: the fine grid's points from this budget up, the coarse grid's below."""
    free: tuple[Any, ...] | None = None
    """The layout of its free plan (:func:`layout_key`), once solved."""
    coarse: int = COARSE_POINTS
    """Points per doubling of its grid below ``fine_from``."""

    def below(self, nbytes: float) -> float:
        """The greatest point of the rung's memory grid below ``nbytes``."""
        fine = grid_below(nbytes)
        return fine if fine >= self.fine_from else grid_below(min(nbytes, self.fine_from),
                                                              self.coarse)

    def at_or_above(self, nbytes: float) -> float:
        """The least point of the rung's memory grid at or above ``nbytes``."""
        coarse = grid_point(grid_index(nbytes, self.coarse), self.coarse)
        return coarse if coarse < self.fine_from else max(grid_point(grid_index(nbytes)),
                                                          self.fine_from)


def walk_top(options: PartitionOptions) -> float | None:
    """The budget a walk down the memory grid starts from (the least grid point at or above
    it): the limit times :func:`walk_scale`; None without a limit (the walk starts below the
    free plan)."""
    return None if options.memory_bytes is None else options.memory_bytes * walk_scale(options)


def walk_scale(options: PartitionOptions) -> float:
    """The top of a walk as a multiple of the limit: :data:`FLUSH_BUDGET_SCALE` under a flush
    schedule, 1 under PipeDream's (whose memory the partitioner's model gives exactly)."""
    return FLUSH_BUDGET_SCALE if options.schedule.flushes else 1.0


def grid_points(work: float, levels: int) -> int:
    """Points per doubling of the memory grid that a view of ``levels`` levels walks, whose
    solve is of size ``work`` (:func:`solve_work`): :data:`FINE_POINTS` within
    :data:`FINE_WORK` (:data:`FINE_WORK_LEVELS` on a hierarchy), else :data:`SPARSE_POINTS`."""
    return FINE_POINTS if work <= (FINE_WORK if levels == 1 else FINE_WORK_LEVELS) else \
        SPARSE_POINTS


def solve_work(num_layers: int, cluster: Cluster) -> float:
    """A size for one partitioner solve: inner levels fill a table of every segment on every
    unit count (``layers^3 x units^2``), the outermost one row (``layers^2 x units``); 40
    layers on 16 devices is 25,600."""
    inner = sum(level.num_units**2 for level in cluster.levels[:-1])
    return float(num_layers**3 * inner + num_layers**2 * cluster.levels[-1].num_units)


def plan_need(plan: Plan) -> float:
    """The partitioner's memory model of ``plan``: its largest stage's bytes per device."""
    return max(stage.memory_bytes for stage in plan.stages)


def grid_below(nbytes: float, points: int = FINE_POINTS) -> float:
    """The greatest grid point below ``nbytes`` (:func:`grid_point`)."""
    return grid_point(grid_index(nbytes, points) - 1, points)


def grid_index(nbytes: float, points: int = FINE_POINTS) -> int:
    """The index of the least grid point at least ``nbytes``."""
    index = math.ceil(math.log2(nbytes / GRID_BASE_BYTES) * points - 1e-9)
    return index if grid_point(index, points) >= nbytes else index + 1


def grid_point(index: int, points: int = FINE_POINTS) -> float:
    """Grid point ``index`` of a grid of ``points`` per doubling: :data:`GRID_BASE_BYTES`
    times 2 to the ``index / points`` (a grid of ``points / k`` is every ``k``-th point)."""
    return float(GRID_BASE_BYTES * 2.0 ** (index / points))


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
