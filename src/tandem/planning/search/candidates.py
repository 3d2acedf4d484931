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
  bandwidth over speed only), each way until :data:`STABLE_RUNGS` rungs add no new layout;
- memory, on every link rung: the free plan, the limit times :data:`FLUSH_BUDGET_SCALES` (flush
  schedules, whose budget counts a replica's whole share of the minibatch in flight where 1F1B
  holds less), the limit itself, then down the memory axis one plan at a time (the budget the
  last plan's need less :data:`BUDGET_STEP`: the partitioner's best plan among those that hold
  less), :data:`MAX_BUDGETS` plans at most.

The ladders are the cluster's own figures scaled, so the candidates of a looser limit, twice
the bandwidth or devices twice as fast include those of the tighter or slower cluster (all but
the far end of its ladders), which makes the planner monotone along them; the property test
(``tests/test_planner_properties.py``) checks it. Identical layouts are simulated once (by
stages, layer order, schedule and micro-batches). Work is bounded: solves beyond the essential
ones (the free plan, the limit's and :data:`ESSENTIAL_STEPS` below it on the cluster's own
links) stop at :data:`MAX_SOLVE_WORK` (:func:`solve_work`), and at most :data:`MAX_LAYOUTS`
layouts are simulated.

Micro-batch counts divide the minibatch (what ``tandem train`` requires): the smallest divisor
at least each multiple :data:`MICROBATCH_FACTORS` of the default; with the minibatch unknown
(a PipeDream ``graph.txt`` without ``--profile-batch``) the next power of two.
"""

from __future__ import annotations

import dataclasses
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
"""Rungs in one direction that add no new layout after which the ladder stops that way (the
partitioner's plan no longer changes with the links there)."""
FLUSH_BUDGET_SCALES = (8.0, 4.0, 2.0)
"""Flush schedules: budgets above the limit, as multiples of it (the partitioner budgets a
replica's whole share in flight; 1F1B's simulated peak is often lower)."""
MAX_BUDGETS = 4
"""Plans down the memory axis below the limit (or the free plan), at most, per link speed."""
ESSENTIAL_STEPS = 2
"""Steps down the memory axis from the limit (or, without one, from the free plan) on the
cluster's own links taken whatever the :data:`MAX_SOLVE_WORK` (the plans nearest the limit,
which the simulator often rates far apart: ResNet-50 on 4x16GB/s,4x10Gb/s at 16 GB, 4-12 at
334 ms, then 4-4-4-4 at 65 ms)."""
ESSENTIAL_WORK = 2e8
"""The :data:`ESSENTIAL_STEPS` are taken whatever the work up to this size of a solve
(ResNet-50 on servers of 4 is 9e7); a 1,000-layer chain on 1,024 devices (1e9) takes only the
free plan and the limit's (a solve under a budget there fills a table of gigabytes)."""
BUDGET_STEP = 1e-6
"""Down the memory axis, the next budget is the last plan's need less this fraction of it:
the partitioner's best plan among those that hold less."""
MEMORY_RETRIES = 3
"""Times a plan at the limit whose simulated devices exceed it is solved again, the limit
shrunk by the overflow."""
MAX_LAYOUTS = 48
"""Distinct pipeline layouts simulated per planning, at most (the first rungs first)."""
MAX_SOLVE_WORK = 4e6
"""Partitioner work (:func:`solve_work`) per planning beyond the free plan and the limit's on
the cluster's own links: small models climb every rung, large ones and hierarchies fewer."""

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
        each link rung the free plan, the limit's and down the memory axis; each distinct
        layout once, within :data:`MAX_SOLVE_WORK` and :data:`MAX_LAYOUTS`."""
        found: list[Candidate] = []
        idle = {direction: 0 for direction in (1.0, -1.0)}
        for factor in BANDWIDTH_RUNGS:
            direction = 1.0 if factor >= 1.0 else -1.0
            if idle[direction] >= STABLE_RUNGS:
                continue  # the plans stopped changing this way
            before = len(self._layouts)
            for name, view in views:
                rung = _Rung(name, dataclasses.replace(scale_links(view, factor),
                                                       memory_bytes=None), factor)
                found += self._top(rung, options, solve)
                found += self._descend(rung, options, solve)
            idle[direction] = idle[direction] + 1 if len(self._layouts) == before else 0
        return found

    def _solve(self, rung: _Rung, options: PartitionOptions, solve: Solve,
               budget: float | None, *, essential: bool) -> Plan | None:  # fmt: skip
        """The partitioner's plan on ``rung`` under ``budget`` (None when none fits it, or
        when the work runs out; ``essential`` ones, the free plan, the limit's and
        :data:`ESSENTIAL_STEPS` below on the cluster's own links, always run)."""
        work = solve_work(self.profile.num_layers, rung.cluster)
        if not essential and (self._spent + work > MAX_SOLVE_WORK
                              or len(self._layouts) >= MAX_LAYOUTS):
            return None
        self._spent += work
        try:
            plan = solve(rung.cluster, dataclasses.replace(options, memory_bytes=budget))
        except NoPlanFits:
            limit = options.memory_bytes
            rung.exhausted = budget is None or (limit is not None and budget <= limit)
            return None
        rung.need = plan_need(plan)
        return plan

    def _top(self, rung: _Rung, options: PartitionOptions, solve: Solve) -> list[Candidate]:
        """The free plan, then the budgets at and above the limit that it does not meet."""
        own = rung.factor == 1.0
        plan = self._solve(rung, options, solve, None, essential=own)
        if plan is None:
            rung.exhausted = True
            return []
        found = self._take(rung, plan, None)
        limit = options.memory_bytes
        for budget in budgets(limit, options.schedule):
            if budget >= rung.need:
                continue
            plan = self._solve(rung, options, solve, budget, essential=own and budget == limit)
            if plan is None:
                continue
            taken = self._take(rung, plan, budget)
            found += taken
            if own and budget == limit and taken and not taken[0].fits:
                found += self._shrunk(rung, options, solve, taken[0])
        return found

    def _descend(self, rung: _Rung, options: PartitionOptions,
                 solve: Solve) -> list[Candidate]:  # fmt: skip
        """Down the memory axis from the last plan: each time under its need less
        :data:`BUDGET_STEP`, the partitioner's best plan among those that hold less
        (:data:`MAX_BUDGETS` at most)."""
        found: list[Candidate] = []
        for step in range(MAX_BUDGETS):
            if rung.exhausted:
                break
            budget = min(rung.need, options.memory_bytes or rung.need) * (1 - BUDGET_STEP)
            essential = (rung.factor == 1.0 and step < ESSENTIAL_STEPS
                         and solve_work(self.profile.num_layers, rung.cluster) <= ESSENTIAL_WORK)
            plan = self._solve(rung, options, solve, budget, essential=essential)
            if plan is None:
                break
            found += self._take(rung, plan, budget)
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


def solve_work(num_layers: int, cluster: Cluster) -> float:
    """A size for one partitioner solve: inner levels fill a table of every segment on every
    unit count (``layers^3 x units^2``), the outermost one row (``layers^2 x units``); 40
    layers on 16 devices is 25,600."""
    inner = sum(level.num_units**2 for level in cluster.levels[:-1])
    return float(num_layers**3 * inner + num_layers**2 * cluster.levels[-1].num_units)


def plan_need(plan: Plan) -> float:
    """The partitioner's memory model of ``plan``: its largest stage's bytes per device."""
    return max(stage.memory_bytes for stage in plan.stages)


def budgets(limit: float | None, schedule: ScheduleKind) -> list[float]:
    """Memory budgets at or above the limit, loosest first: the limit times
    :data:`FLUSH_BUDGET_SCALES` (flush schedules), then the limit itself (none without a limit:
    the free plan is the top of the ladder)."""
    if limit is None:
        return []
    scales = FLUSH_BUDGET_SCALES if schedule.flushes else ()
    return [*(limit * scale for scale in scales), limit]


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
