"""Row 0 of a flat level under a memory limit, by a parametric search over the bottleneck.

For a bound ``T`` the search asks how few units can carry the model within ``T`` with every
device within the limit. A stage on ``r`` units takes at most ``T`` for ``r = 1`` when its
compute alone does, and for every ``r`` from a least one ``tail`` on (its time falls as ``r``
grows from 2: ``(C + k (r - 1) / r) / r`` decreases once ``r > 2k / (C + k)``, which is below 2).
Its memory depends on the units after it under PipeDream's schedule (``1 + ceil(d / r)``
minibatches in flight with ``d`` units after it: ``r >= d / c`` for the most ``c`` its device
holds), on ``r`` alone under flush schedules. Memory never grows when the stages after a stage
hold fewer units, so the search runs from the model's end: ``after[p]``, the fewest units that
carry the layers after state ``p - 1`` within ``T``, is each last stage's fewest with the
stages after it on their fewest. The first stage sees every other unit after it (idle ones
too), so ``T`` is reachable (idle units allowed) when a first stage and a suffix fit in ``N``
units, and bisection finds the least such ``T``: with idle units allowed the optimum, else a
lower bound that a plan using every unit proves when the first stage can take the spare units
(more units only shorten its time from 2 on and lower its memory). When it cannot, the
least bound at which one can is an upper bound for :mod:`.bounded`'s table
(:func:`solve_limited` returns it with no table).

Time per bound: a few passes over the ``(row, state)`` segments and one pass per row; the
bisection takes about 60 bounds. Memory: a few arrays of one entry per segment.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable

import numpy as np

from tandem.planning.partition.levels import LevelProblem, LevelTable, Piece
from tandem.planning.partition.memory import stage_memory_bytes
from tandem.planning.partition.parametric import _Parametric

MAX_BOUNDS = 200
"""Bisection steps at most (each halves the gap or lands on a plan's bottleneck)."""
QUICK_STEPS = 8
"""Bisection steps of :func:`quick_plan`."""
PRECISION = 1e-15
"""The bisection stops when the gap is below this fraction of the best plan's bottleneck."""


def solve_limited(problem: LevelProblem) -> tuple[LevelTable | None, float]:
    """Row 0 of ``problem`` (one flat level with a memory limit): the table of the optimum and
    its bottleneck; or no table and an upper bound on the optimum when a plan using every unit
    is not proven at the least bound (inf: no plan fits)."""
    table, bound, _ = search_limited(problem)
    return table, bound


def search_limited(problem: LevelProblem, low: float = 0.0,
                   high: float = math.inf) -> tuple[LevelTable | None, float, float | None]:
    """:func:`solve_limited`, its search started between ``low`` (a bound known to reach no plan
    on at most N units, or below the least that does) and ``high`` (one known to reach one, or
    inf), and the least bound it reached (None: no plan fits). The plan is the same whatever
    the two bounds: the one the search finds at the least bound itself."""
    search = _Limited(problem)
    found = search.least_reach(low, high)
    if found is None:
        return _table(problem, None), math.inf, None
    bound, pieces = found
    if problem.allow_idle or sum(piece[2] for piece in pieces) == problem.num_units:
        return _table(problem, pieces), max(piece[3] for piece in pieces), bound
    every = search.widened(bound)
    if every is not None:
        return _table(problem, every), max(piece[3] for piece in every), bound
    return None, search.widened_bound(bound), bound


def quick_plan(problem: LevelProblem, steps: int = QUICK_STEPS) -> tuple[bool, list[Piece] | None]:
    """Whether any plan fits the memory of ``problem`` (one flat level with a memory limit),
    and a plan on exactly N units found by ``steps`` of geometric bisection on the bound, from
    the compute's share of a unit up (None when none was found): a bound for :mod:`.bounded`'s
    table, far cheaper than the search to the optimum."""
    search = _Limited(problem)
    loosest = search._loosest()
    if search.reach(loosest) is None:
        return False, None
    found = search.widened(loosest)
    if found is None:
        return True, None
    high = max(piece[3] for piece in found)
    low = float(problem.compute_s[0, -1]) / problem.num_units
    for _ in range(steps):
        if not 0 < low < high:
            break
        pieces = search.widened(math.sqrt(low * high))
        if pieces is None:
            low = math.sqrt(low * high)
        else:
            found, high = pieces, max(piece[3] for piece in pieces)
    return True, found


def memory_bracket(problem: LevelProblem, low: float, high: float,
                   tolerance: float) -> tuple[float, float | None] | None:  # fmt: skip
    """For ``problem`` at budgets from ``low`` (where nothing fits) to ``high`` (its own limit
    ignored): a budget below which no plan on at most N units fits the shared memory model
    (a lower bound on every plan's need), and the least at which one on exactly N units is
    found (:meth:`_Limited.widened`; None: none up to ``high``), each to a relative
    ``tolerance``, one pass of the search per budget (geometric bisection for the first, for
    the second a gallop up from the first). None when nothing fits ``high``."""
    search = _Limited(dataclasses.replace(problem, memory_bytes=high))

    def reaches(budget: float) -> bool:
        limited = search.at(budget)
        return limited.reach(limited._loosest()) is not None

    def widens(budget: float) -> bool:
        limited = search.at(budget)
        return limited.widened(limited._loosest()) is not None

    if not reaches(high):
        return None
    top = high
    while top > low * (1 + tolerance):
        middle = math.sqrt(low * top)
        low, top = (low, middle) if reaches(middle) else (middle, top)
    ratio = 1 + tolerance
    while low * ratio < high and not widens(low * ratio):
        low, ratio = low * ratio, ratio * ratio
    if low * ratio >= high:
        if not widens(high):
            return top / (1 + tolerance), None
        ratio = high / low
    roof = low * ratio
    while roof > low * (1 + tolerance):
        middle = math.sqrt(low * roof)
        low, roof = (low, middle) if widens(middle) else (middle, roof)
    return top / (1 + tolerance), roof


def _table(problem: LevelProblem, pieces: list[Piece] | None) -> LevelTable:
    best = np.full((1, problem.states.num_states, problem.num_units), np.inf)
    if pieces is not None:
        best[0, -1, -1] = max(piece[3] for piece in pieces)
    return LevelTable(problem=problem, best=best, pieces=pieces or [])


class _Limited(_Parametric):
    """Segments held flat as :class:`_Parametric` holds them, row-major: ``offsets[p]:offsets[p +
    1]`` are row ``p``'s."""

    def __init__(self, problem: LevelProblem) -> None:
        assert problem.memory_bytes is not None and problem.inner is None
        super().__init__(problem)
        self.next_rows = self.cols + 1
        self.offsets = np.searchsorted(self.rows, np.arange(problem.states.num_states + 2))
        self.g_coef = np.where(self.first, 0.0, self.g_coef)  # the first stage moves nothing
        self.one_s = self._exact(np.ones(self.rows.size))
        self.held, self.least_memory, self.never = self._holding()

    def _holding(self) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """What the memory limit allows: under PipeDream's schedule the most ``ceil(d / r)`` a
        device of each segment holds; under flush schedules the fewest units whose devices hold
        it; and the segments no device holds on any unit count."""
        pipedream = not self.problem.schedule.flushes
        held = self._most_held() if pipedream else np.zeros(self.rows.size)
        least_memory = None if pipedream else self._least_memory_units()
        never = held < 0 if least_memory is None else ~np.isfinite(least_memory)
        return held, least_memory, never

    def at(self, limit: float) -> _Limited:
        """The same search under the memory limit ``limit``."""
        other = copy.copy(self)
        other.problem = copy.copy(self.problem)
        other.problem.memory_bytes = limit
        other.held, other.least_memory, other.never = other._holding()
        return other

    def _need(self, replicas: np.ndarray | float, downstream: np.ndarray | float,
              index: np.ndarray | slice = slice(None)) -> np.ndarray:  # fmt: skip
        """Bytes per device of segments ``index`` on ``replicas`` units, ``downstream`` after."""
        problem = self.problem
        return np.asarray(stage_memory_bytes(
            problem.schedule, parameter_bytes=self.params[index],
            activation_bytes=problem.stash_bytes[self.rows[index], self.cols[index]],
            replicas=replicas, downstream=downstream,
            optimizer_state_factor=problem.optimizer_state_factor))

    def _most_held(self) -> np.ndarray:
        """PipeDream's schedule: per segment the most ``ceil(d / r)`` its device holds within the
        limit (-1: not even alone; inf: any), by the shared memory model exactly."""
        limit = self.problem.memory_bytes
        assert limit is not None
        base = self._need(1.0, 0.0)
        step = self._need(1.0, 1.0) - base
        with np.errstate(divide="ignore", invalid="ignore"):
            held = np.floor((limit - base) / step)
        held = np.where(step > 0, held, np.inf)
        held = np.where(base <= limit, np.maximum(held, 0.0), -1.0)
        finite = np.isfinite(held) & (held >= 0)
        for _ in range(2):  # rounding: the exact model decides
            over = finite & (self._need(1.0, np.where(finite, held, 0.0)) > limit)
            held = np.where(over, held - 1, held)
            under = finite & (self._need(1.0, np.where(finite, held + 1, 0.0)) <= limit)
            held = np.where(under, held + 1, held)
        return held

    def _least_memory_units(self) -> np.ndarray:
        """Flush schedules: per segment the fewest units whose devices hold it (inf: none)."""
        limit = self.problem.memory_bytes
        N = self.problem.num_units
        assert limit is not None
        fixed = self._need(np.inf, 0.0)  # weights, gradients, optimizer state
        acts = self._need(1.0, 0.0) - fixed
        with np.errstate(divide="ignore", invalid="ignore"):
            least = np.ceil(acts / (limit - fixed))
        least = np.where(fixed < limit, np.clip(least, 1.0, N + 1.0), np.inf)
        least = np.where(acts <= 0, np.where(fixed <= limit, 1.0, np.inf), least)
        finite = np.isfinite(least)
        for _ in range(2):  # rounding: the exact model decides
            over = finite & (self._need(np.where(finite, least, 1.0), 0.0) > limit)
            least = np.where(over, least + 1, least)
            lower = finite & (least > 1) & (self._need(np.maximum(least - 1, 1.0), 0.0) <= limit)
            least = np.where(lower, least - 1, least)
        return np.where(least > N, np.inf, least)

    def _tail(self, bound: float) -> np.ndarray:
        """Per segment: the fewest units from 2 on within ``bound`` (every count above too; inf
        when more than N or never held). From the roots of ``T r^2 - (C + k) r + k`` and from
        ``g / T``; where either lies within rounding of a whole number the exact times decide."""
        if self.problem.straight:
            return np.full(self.rows.size, np.inf)
        with np.errstate(invalid="ignore"):
            root = np.sqrt(self.square - 4 * bound * self.k_coef)
        high = np.fmax((self.total + root) / (2 * bound), self.g_coef / bound)
        tail = np.maximum(2.0, np.ceil(high))
        near = np.flatnonzero(np.abs(high - np.rint(high)) <= 1e-7 * np.maximum(high, 1.0))
        if near.size:
            below = np.maximum(tail[near] - 1, 2.0)
            fixed = np.where(self._exact(below, near) <= bound, below, tail[near])
            tail[near] = np.where(self._exact(fixed, near) <= bound, fixed, fixed + 1)
        return np.where((tail > self.problem.num_units) | self.never, np.inf, tail)

    def _suffix(self, bound: float) -> tuple[np.ndarray, ...]:
        """``after[p]`` for rows ``p >= 1`` (``after[n] = 0``), each row's chosen segment and its
        units, and per segment the fewest units within ``bound`` from 2 on (``tail``) and from 1
        on where memory allows one (``single``)."""
        n, N = self.problem.states.num_states, self.problem.num_units
        tail = self._tail(bound)
        single = np.where((self.one_s <= bound) & ~self.never, 1.0, tail)
        fixed = None
        if self.least_memory is not None:
            fixed = np.where(self.least_memory <= 1, single, np.maximum(self.least_memory, tail))
        after = np.full(n + 1, np.inf)
        after[n] = 0.0
        choice = np.full(n + 1, -1, dtype=np.int64)
        units = np.zeros(n + 1)
        offsets, next_rows, held = self.offsets.tolist(), self.next_rows, self.held
        with np.errstate(divide="ignore", invalid="ignore"):
            for row in range(n, 0, -1):
                start, stop = offsets[row], offsets[row + 1]
                if start == stop:
                    continue
                downstream = after[next_rows[start:stop]]
                if fixed is not None:
                    need = fixed[start:stop]
                else:
                    least = np.fmax(1.0, np.ceil(downstream / held[start:stop]))
                    need = np.where(least <= 1, single[start:stop],
                                    np.maximum(least, tail[start:stop]))
                total = need + downstream
                best = int(total.argmin())
                if total[best] <= N:
                    after[row], choice[row], units[row] = total[best], start + best, need[best]
        return after, choice, units, tail, single

    def _plan_from(self, index: int, replicas: float, choice: np.ndarray,
                units: np.ndarray) -> list[Piece]:  # fmt: skip
        """The plan whose first stage is segment ``index`` on ``replicas`` units, the suffix
        after it as ``choice`` and ``units`` say."""
        problem = self.problem
        pieces = [problem.piece(-1, int(self.cols[index]), int(replicas), first=True)]
        row = int(self.next_rows[index])
        while row < problem.states.num_states:
            segment = int(choice[row])
            pieces.append(problem.piece(row - 1, int(self.cols[segment]), int(units[row]),
                                        first=False))
            row = int(self.next_rows[segment])
        return pieces

    def reach(self, bound: float) -> list[Piece] | None:
        """A plan within ``bound`` on at most N units (the first stage's memory counting every
        other unit after it), fewest units first; None when there is none."""
        after, choice, units, tail, single = self._suffix(bound)
        part = slice(self.offsets[0], self.offsets[1])
        if self.least_memory is not None:
            least = self.least_memory[part]
        else:  # ceil((N - r) / r) <= c: r >= N / (c + 1)
            with np.errstate(divide="ignore"):
                least = np.maximum(1.0, np.ceil(self.problem.num_units / (self.held[part] + 1)))
        need = np.where(least <= 1, single[part], np.maximum(least, tail[part]))
        total = need + after[self.next_rows[part]]
        best = int(np.argmin(total))
        if not total[best] <= self.problem.num_units:
            return None
        return self._plan_from(part.start + best, need[best], choice, units)

    def widened(self, bound: float) -> list[Piece] | None:
        """A plan within ``bound`` on exactly N units: the first stage takes every unit the
        fewest suffix leaves; None when no first stage can."""
        N = self.problem.num_units
        after, choice, units, _, _ = self._suffix(bound)
        part = slice(self.offsets[0], self.offsets[1])
        rest = after[self.next_rows[part]]
        replicas = np.where(rest <= N - 1, N - rest, np.inf)
        index = np.arange(part.start, part.stop)
        ok = (self._exact(replicas, index) <= bound) & ~self.never[part]
        ok &= self._need(np.where(ok, replicas, 1.0), np.where(ok, rest, 0.0),
                         index) <= self.problem.memory_bytes
        if self.problem.straight:
            ok &= replicas == 1
        hits = np.flatnonzero(ok)
        if hits.size == 0:
            return None
        return self._plan_from(part.start + int(hits[0]), replicas[hits[0]], choice, units)

    def least_reach(self, low: float = 0.0,
                    high: float = math.inf) -> tuple[float, list[Piece]] | None:
        """The least bound reachable on at most N units and a plan reaching it (None: no plan
        fits the memory at any bound); ``low`` below it and ``high`` at or above it where known
        (the search starts between them)."""
        return self._bisect(self.reach, low, monotone=True, start=high)

    def widened_bound(self, least: float) -> float:
        """The least bound above ``least`` at which :meth:`widened` finds a plan (an upper
        bound on the optimum with every unit used; inf when there is none)."""
        found = self._bisect(self.widened, least)
        return math.inf if found is None else found[0]

    def _bisect(self, plan_within: Callable[[float], list[Piece] | None], low: float, *,
                monotone: bool = False,
                start: float = math.inf) -> tuple[float, list[Piece]] | None:  # fmt: skip
        """The least bound above ``low`` at which ``plan_within`` finds a plan, and the plan.
        ``monotone``: a bound that finds none proves that no tighter one does, so the bisection
        stops once nothing is found just below the best plan's bottleneck (every later step
        would find nothing), and the plan is the one found at that bottleneck itself: the same
        whichever bounds the bisection tried (a budget whose own search meets it has it too,
        which lets the planner's walk down the memory grid skip: ``planning/search/
        candidates.py``). ``start``: a bound known to find a plan, tried first (inf: none).
        ``monotone`` with ``low`` above 0: the steps halve the ratio of the bounds, not the gap
        (from a looser budget's optimum, the 1,000-layer chain on 1,024 devices under
        PipeDream's schedule takes 289 bounds for its walk's 14 solves instead of 406)."""
        pieces = plan_within(start) if math.isfinite(start) else None
        if pieces is None:
            pieces = plan_within(self._loosest())
        if pieces is None:
            return None
        high = max(piece[3] for piece in pieces)
        checked, proven = math.inf, False
        for _ in range(MAX_BOUNDS):
            # geometric once a lower bound is known (a looser budget's optimum, just below)
            mid = math.sqrt(low * high) if monotone and low > 0 else 0.5 * (low + high)
            if not low < mid < high or high - low <= high * PRECISION:
                break
            if monotone and high != checked:
                checked = high
                if plan_within(float(np.nextafter(high, 0.0))) is None:
                    proven = True
                    break
            found = plan_within(mid)
            if found is None:
                low = mid
            else:
                pieces, high = found, max(piece[3] for piece in found)
        if not monotone:
            return high, pieces
        while not proven:  # the steps ran out: down to a bottleneck nothing beats
            lower = plan_within(float(np.nextafter(high, 0.0)))
            proven = lower is None
            high = high if lower is None else max(piece[3] for piece in lower)
        exact = plan_within(high)
        assert exact is not None  # a plan within high was found
        return high, exact

    def _loosest(self) -> float:
        """A bound every segment meets on every unit count: only memory limits plans there."""
        return float(np.max(self.compute + self.k_coef + self.g_coef)) * (1 + 1e-9) + 1e-30
