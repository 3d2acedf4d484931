"""Row 0 of one level's dynamic program, pruned by the bottleneck of a plan known to exist.

PipeDream's recurrence, in its loop order (unit count outer), for the layers up to state ``j``
on ``m + 1`` units::

    best[j, m] = one stage on m + 1 units, else best[j, m - 1] if strictly better (idle
                 units, when allowed), else if strictly better
                 min over k below j and r <= m of max(best[k, m - r], last(k, j, r))

where ``last(k, j, r)`` is the time of the stage after state ``k`` up to ``j`` on ``r`` units.
Let ``U`` be the bottleneck of a plan known to exist (the whole model as one stage). Every cell
on the answer's path is at most ``U`` and leaves enough units for the layers after it, and a
term above ``U`` can be neither the answer nor under it. So the table keeps only cells at most
``U`` (the others read inf), and each step pushes from those cells only along the ``(k, j, r)``
whose last stage takes at most ``U`` and leaves the layers before and after it enough units.
On ResNet-50 and 16 devices that is 36 thousand of the 3.4 million terms of the full loop nest.
Every cell at most ``U`` that the layers after it can complete into a plan within ``U`` (so
every cell on the answer's path) keeps the full table's value and choice (ties: the smallest
``k``, then the fewest replicas); other cells may read inf.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tandem.planning.partition.levels import LevelProblem, LevelTable


CHUNK_TERMS = 4_000_000
"""Terms ``(k, j, r)`` timed at once: the table's memory stays within a few hundred megabytes
whatever the bound (how many terms there are in all is the bound's business)."""


@dataclass(kw_only=True, slots=True)
class _LastStages:
    """The last stages ``(k, j, r)`` that take at most the bound, grouped by ``(r, k)``."""

    before: np.ndarray
    """``k``: the state the stage starts after."""
    state: np.ndarray
    """``j``: the state the stage ends at."""
    replicas: np.ndarray
    """``r``: units of the stage."""
    time_s: np.ndarray
    """``last(k, j, r)``."""
    offsets: np.ndarray
    """Group ``(r - 1) * n + k`` is ``offsets[group] : offsets[group + 1]``."""


def solve_row0(problem: LevelProblem, bound: float = np.inf) -> LevelTable:
    """Row 0 of ``problem``, exact on every cell a plan within a known plan's bottleneck uses
    (``bound``: a smaller bottleneck of a plan known to exist, when there is one)."""
    n, N = problem.states.num_states, problem.num_units
    one_stage = _one_stage_times(problem)
    bound = min(bound, _known_bound(problem, one_stage))
    last = _last_stages(problem, bound)
    best = np.full((n, N), np.inf)
    best[:, 0] = np.where(one_stage[:, 0] <= bound, one_stage[:, 0], np.inf)
    split = np.full((n, N), -1, dtype=np.int64)
    replicas = np.tile(np.arange(1, N + 1, dtype=np.int64), (n, 1))
    for m in range(1, N):
        splits = _best_splits(problem, last, best, m)
        _combine(problem, (best, split, replicas), m, one_stage[:, m], splits, bound)
    return LevelTable(problem=problem, best=best[None], split=split[None], replicas=replicas[None])


def known_bound(problem: LevelProblem, plans: list[tuple[tuple[int, int, int], ...]]) -> float:
    """The least bottleneck, by ``problem``'s own cost and memory models, among ``plans`` (each
    its stages as (state before, state, replicas)) that are plans of ``problem``: every unit
    used, each stage within the memory limit; inf when none is. A bound for
    :func:`solve_row0` (one level whose units are single devices)."""
    best = np.inf
    N = problem.num_units
    for stages in plans:
        before, state, replicas = (np.array(column, dtype=np.int64) for column in zip(*stages))
        if (int(replicas.sum()) != N or state[-1] != problem.states.num_states - 1
                or (problem.straight and bool((replicas != 1).any()))):
            continue
        used = np.cumsum(replicas)
        if not bool(problem.fits(before + 1, state, replicas, used).all()):
            continue
        times = problem.stage_time(before + 1, state, replicas.astype(np.float64),
                                   first=before < 0)
        best = min(best, float(np.max(times)))
    return best * (1 + 1e-12) if np.isfinite(best) else np.inf


def one_stage_bound(problem: LevelProblem) -> float:
    """The bottleneck of the whole model as one stage, the plan :func:`solve_row0` knows exists
    (inf when it does not fit)."""
    return _known_bound(problem, _one_stage_times(problem))


def _one_stage_times(problem: LevelProblem) -> np.ndarray:
    """``[j, m]``: the layers up to state ``j`` as one stage on ``m + 1`` units."""
    states = np.arange(problem.states.num_states)[:, None]
    units = np.arange(1, problem.num_units + 1)[None, :]
    times = problem.stage_time(0, states, units.astype(np.float64), first=True)
    times = np.where(problem.fits(0, states, units, units), times, np.inf)
    if problem.straight:
        times[:, 1:] = np.inf
    return times


def _known_bound(problem: LevelProblem, one_stage: np.ndarray) -> float:
    """The bottleneck of a plan that exists: the whole model as one stage (inf if none fits)."""
    whole = one_stage[-1] if problem.allow_idle else one_stage[-1, -1:]
    return float(np.min(whole))


def _last_stages(problem: LevelProblem, bound: float) -> _LastStages:
    """Every ``(k, j, r)``, ``k`` below ``j``, whose stage takes at most ``bound`` (finite),
    timed :data:`CHUNK_TERMS` at a time."""
    n, N = problem.states.num_states, problem.num_units
    ks, js = np.nonzero(problem.states.below)
    flat = (ks + 1) * n + js
    segment = [matrix.ravel().take(flat) for matrix in
               (problem.compute_s, problem.parameter_bytes, problem.transfer_bytes)]  # fmt: skip
    most = _most_replicas(problem, ks, js, bound)
    least = np.minimum(_least_replicas(problem, segment[0], segment[2], bound), most + 1)
    count = (most - least + 1).astype(np.int64)
    kept: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for part in _chunks(count):
        pair = np.repeat(part, count[part])
        replicas = _ranges(least[part].astype(np.int64), count[part])
        compute, parameters, moved = (values[pair] for values in segment)
        times = problem.segment_time(compute, parameters, moved, replicas.astype(np.float64),
                                     first=False)
        keep = (times <= bound) & (times < np.inf)
        kept.append((pair[keep], replicas[keep], times[keep]))
    pair, replicas, times = (np.concatenate([part[i] for part in kept]) if kept
                             else np.zeros(0, dtype=np.int64 if i < 2 else np.float64)
                             for i in range(3))
    groups = (replicas - 1) * n + ks[pair]
    order = np.argsort(groups)  # order within a group is free: ties break on (k, r) later
    pair, replicas, times = pair[order], replicas[order], times[order]
    return _LastStages(
        before=ks[pair],
        state=js[pair],
        replicas=replicas,
        time_s=times,
        offsets=np.concatenate(([0], np.cumsum(np.bincount(groups, minlength=N * n)))),
    )


def _chunks(count: np.ndarray) -> list[np.ndarray]:
    """Consecutive indices of ``count`` in groups of at most :data:`CHUNK_TERMS` terms in all
    (a single index when it alone has more)."""
    ends = np.cumsum(count)
    cuts = np.searchsorted(ends, np.arange(CHUNK_TERMS, int(ends[-1]) if ends.size else 0,
                                           CHUNK_TERMS), side="right")
    bounds = np.unique(np.concatenate(([0], cuts, [count.size])))
    return [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def _least_replicas(problem: LevelProblem, compute: np.ndarray, moved: np.ndarray,
                    bound: float) -> np.ndarray:  # fmt: skip
    """Per segment: the fewest units on which it may take at most ``bound`` (1 or more).

    On ``r`` units a stage takes at least ``C / r`` (its compute) and, when not first, at
    least ``2 a / (B R r)`` (its transfer), so it needs ``r >= max(C, 2 a / (B R)) / U``; one
    unit of slack covers rounding, and the exact times decide.
    """
    if not 0 < bound < np.inf:
        return np.ones(compute.size)
    slowest = compute
    if problem.activation_compression is not None:
        rate = problem.bandwidth_Bps * problem.activation_compression
        slowest = np.maximum(compute, 2 * moved / rate)
    least: np.ndarray = np.maximum(1.0, np.ceil(slowest / bound) - 1)
    return least


def _most_replicas(problem: LevelProblem, ks: np.ndarray, js: np.ndarray,
                   bound: float) -> np.ndarray:  # fmt: skip
    """Per ``(k, j)``: the most units a stage from ``k`` to ``j`` has in a plan within ``bound``.

    A stage of compute ``C`` on ``r`` units takes at least ``C / r``, so a plan within ``U``
    gives the layers up to ``k`` at least ``compute[k] / U`` units, and those after ``j`` at
    least ``(compute[-1] - compute[j]) / U``. That needs segment computes that add up: a
    level whose units are single devices, with every prefix's compute finite (an inner level's
    memory limit makes some inf). Never more than N, or 1 with ``straight``.
    """
    N = problem.num_units
    cap = 1 if problem.straight else N
    compute = problem.compute_s[0]
    additive = problem.devices_per_unit == 1 and bool(np.isfinite(compute).all())
    if not additive or not 0 < bound < np.inf:
        return np.full(ks.size, float(cap))
    slack = 1 - 1e-9  # rounding in the sums of segment computes
    before = np.ceil(compute / bound * slack)
    after = np.ceil((compute[-1] - compute) / bound * slack)
    most: np.ndarray = np.minimum(N - before[ks] - after[js], cap)
    return most


def _best_splits(
    problem: LevelProblem, last: _LastStages, best: np.ndarray, m: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per state j: min over (k, r) of max(best[k, m - r], last(k, j, r)), with its k and r
    (the terms :data:`CHUNK_TERMS` at a time)."""
    n, N = best.shape
    prefix = best[:, m - 1 :: -1][:, :m]  # [k, r - 1] = best[k, m - r]
    ks, r_index = np.nonzero(prefix < np.inf)
    start = last.offsets[r_index * n + ks]
    count = last.offsets[r_index * n + ks + 1] - start
    least, first = np.full(n, np.inf), np.full(n, n * N, dtype=np.int64)
    for part in _chunks(count):
        index = _ranges(start[part], count[part])
        times = np.maximum(np.repeat(prefix[ks[part], r_index[part]], count[part]),
                           last.time_s[index])
        states, before, replicas = last.state[index], last.before[index], last.replicas[index]
        if problem.memory_bytes is not None:
            fits = problem.fits(before + 1, states, replicas, np.full(index.size, m + 1))
            times = np.where(fits, times, np.inf)
        _first_minimum(least, first, times, states, before * N + replicas)
    return least, first // N, first % N


def _ranges(start: np.ndarray, count: np.ndarray) -> np.ndarray:
    """The concatenation of ``range(s, s + c)`` for each ``s, c`` in ``start, count``."""
    ends = np.cumsum(count)
    return np.repeat(start - ends + count, count) + np.arange(ends[-1] if ends.size else 0)


def _first_minimum(least: np.ndarray, first: np.ndarray, times: np.ndarray, states: np.ndarray,
                   order: np.ndarray) -> None:  # fmt: skip
    """Per state, in place: the least time so far, and the smallest ``order = k * N + r``
    attaining it (``first``), merged with the terms ``times`` of ``states``."""
    chunk = np.full(least.size, np.inf)
    np.minimum.at(chunk, states, times)
    better = chunk < least
    first[better] = np.iinfo(np.int64).max
    least[better] = chunk[better]
    hit = (times == least[states]) & (times < np.inf)
    np.minimum.at(first, states[hit], order[hit])


def _combine(
    problem: LevelProblem, table: tuple[np.ndarray, np.ndarray, np.ndarray], m: int,
    one_stage: np.ndarray, splits: tuple[np.ndarray, np.ndarray, np.ndarray], bound: float,
) -> None:  # fmt: skip
    """PipeDream's order for every state at once: one stage, idle if strictly better, splits."""
    best, split, replicas = table
    values, ks, rs = splits
    value, choice, count = one_stage, np.full(one_stage.shape, -1), np.full(one_stage.shape, m + 1)
    if problem.allow_idle:
        idle = best[:, m - 1] < value
        value = np.where(idle, best[:, m - 1], value)
        choice, count = np.where(idle, -2, choice), np.where(idle, 0, count)
    better = values < value
    value = np.where(better, values, value)
    best[:, m] = np.where(value <= bound, value, np.inf)
    split[:, m] = np.where(better, ks, choice)
    replicas[:, m] = np.where(better, rs, count)
