"""One level of PipeDream's dynamic program: its cost model and the full table.

``solve_level`` fills ``best[p, j, m]``: the smallest bottleneck for the layers of state ``j``
minus state ``p - 1`` (row 0: from the start) on ``m + 1`` units, vectorized over the last
stage's start and replica count. Row 0 alone is solved faster by :mod:`.bounded` and, for
many units, by :mod:`.parametric`. Under a memory limit an outer level checks every device of
the plan the level below chose for a segment (:meth:`LevelTable.device_stages`), with the
replicas and the devices after it that the whole plan gives it. Under a tighter limit than one
already solved, the innermost table is solved again only where a cell's plan no longer fits
(``solve_level(problem, looser)``: the planner's walk down the memory grid).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from tandem.planning.partition.antichain import States
from tandem.planning.partition.memory import stage_memory_bytes
from tandem.spec.kinds import ScheduleKind

Piece = tuple[int, int, int, float, float, float]
"""A stage of one level: (before, state, replicas, time_s, allreduce_s, transfer_s)."""

_CHUNK_ELEMENTS = 4_000_000


@dataclass(kw_only=True, slots=True, frozen=True)
class DeviceStages:
    """The devices of the plans a level chose, per segment ``[row, state]`` on all its units
    (one unit of the level above), padded along the last axis (``replicas`` 0: no stage)."""

    parameter_bytes: np.ndarray
    """Parameter bytes of each device stage."""
    activation_bytes: np.ndarray
    """Activation bytes per minibatch each device stage stashes."""
    replicas: np.ndarray
    """Devices running each stage inside the unit."""
    after: np.ndarray
    """Devices inside the unit running the stages after it."""


@dataclass(kw_only=True, slots=True)
class LevelProblem:
    """The inputs of one level: segment costs over states and the level's links."""

    states: States
    """The states stage boundaries are drawn from."""
    compute_s: np.ndarray
    """``[p, j]``: compute time of the segment after state ``p - 1`` up to state ``j`` (nan: invalid)."""
    parameter_bytes: np.ndarray
    """``[p, j]``: parameter bytes of the segment."""
    stash_bytes: np.ndarray
    """``[p, j]``: activation bytes the segment stashes per minibatch."""
    num_units: int
    """Units at this level."""
    bandwidth_Bps: float
    """Link bandwidth between units, bytes per second."""
    devices_per_unit: int
    """Devices inside one unit (1 at the innermost level)."""
    activation_compression: float | None
    """Activation transfer is divided by this; None ignores it."""
    gradient_compression: float = 1.0
    """The allreduce of replicated stages is divided by this."""
    memory_bytes: float | None
    """Per-device memory limit, or None."""
    straight: bool
    """One unit per stage."""
    allow_idle: bool
    """Plans may leave units unused."""
    all_rows: bool
    """Solve every segment start (needed by the level above), not only row 0."""
    schedule: ScheduleKind = ScheduleKind.PIPEDREAM
    """The schedule whose memory is budgeted (:mod:`tandem.planning.partition.memory`)."""
    optimizer_state_factor: float = 1.0
    """Optimizer state bytes per parameter byte."""
    inner: DeviceStages | None = None
    """At an outer level: the devices of the plan the level below chose for every segment, so
    that a stage's memory is checked device by device (None: the innermost level)."""
    transfer_bytes: np.ndarray = field(init=False)
    """``[p, j]``: bytes a non-first stage moves per minibatch in its larger direction."""

    def __post_init__(self) -> None:
        cut = self.states.cut_bytes
        n = self.states.num_states
        outgoing = cut.copy()
        outgoing[n - 1] = 0.0
        matrix = np.zeros((n + 1, n))
        if self.activation_compression is not None:
            np.maximum(cut[:, None], outgoing[None, :], out=matrix[1:])
        self.transfer_bytes = matrix

    def allreduce_s(self, params: np.ndarray | float, replicas: np.ndarray | float) -> np.ndarray:
        """PipeDream's data-parallel communication of a stage before dividing by replicas."""
        comm = (4 * (np.asarray(replicas) - 1) * params) / (self.bandwidth_Bps * replicas)
        shrink = self.devices_per_unit * self.gradient_compression
        return comm if shrink == 1 else comm / shrink

    def transfer_s(self, nbytes: np.ndarray | float,
                   replicas: np.ndarray | float) -> np.ndarray | float:
        """Activation transfer time of a non-first stage on ``replicas`` units."""
        if self.activation_compression is None:
            return np.zeros(np.broadcast(np.asarray(nbytes), np.asarray(replicas)).shape)
        moved = (2.0 * nbytes) / (self.bandwidth_Bps * replicas)
        ratio = self.activation_compression
        return moved if ratio == 1.0 else moved / ratio

    def stage_time(self, row: np.ndarray | int, state: np.ndarray | int,
                   replicas: np.ndarray | float, *, first: np.ndarray | bool) -> np.ndarray:  # fmt: skip
        """Time of the segment ``(row - 1, state]`` on ``replicas`` units (vectorized).

        The first stage of a pipeline (``first``) moves no activations at this level.
        """
        segment = (self.compute_s[row, state], self.parameter_bytes[row, state],
                   self.transfer_bytes[row, state])  # fmt: skip
        return self.segment_time(*segment, replicas, first=first)

    def segment_time(self, compute_s: np.ndarray, parameter_bytes: np.ndarray,
                     transfer_bytes: np.ndarray, replicas: np.ndarray | float, *,
                     first: np.ndarray | bool) -> np.ndarray:  # fmt: skip
        """:meth:`stage_time` from a segment's values rather than its position."""
        comm = self.allreduce_s(parameter_bytes, replicas)
        time_s: np.ndarray = (compute_s + comm) / replicas
        if first is True or self.activation_compression is None:
            return time_s
        slowest: np.ndarray = np.maximum(time_s, self.transfer_s(transfer_bytes, replicas))
        return slowest if first is False else np.where(first, time_s, slowest)

    def fits(self, row: np.ndarray | int, state: np.ndarray | int,
             replicas: np.ndarray, used: np.ndarray) -> np.ndarray:  # fmt: skip
        """Whether every device of the stage holds its weights, gradients, optimizer state,
        stashed versions and in-flight activations (:mod:`tandem.planning.partition.memory`)
        within the limit (vectorized).

        ``used`` counts the units up to and including this stage, so ``num_units - used`` follow
        it. At an outer level each device of the plan the level below chose for the segment is
        checked with its replicas times ``replicas`` and the devices after it (those of its unit
        after it, in every replica, and the units after this stage): exactly the memory of the
        whole plan's devices. The innermost level checks a stage as if nothing followed its
        level (for PipeDream's schedule fewer minibatches in flight than the whole plan may
        hold, which the levels above then check; for flush schedules more activations than
        once replicated above)."""
        if self.memory_bytes is None:
            return np.ones(np.broadcast(replicas, used).shape, dtype=bool)
        if self.inner is not None:
            return np.asarray(self._devices_need(row, state, replicas, used) <= self.memory_bytes)
        need = stage_memory_bytes(
            self.schedule, parameter_bytes=self.parameter_bytes[row, state],
            activation_bytes=self.stash_bytes[row, state], replicas=replicas,
            downstream=self.num_units - used, optimizer_state_factor=self.optimizer_state_factor)
        return np.asarray(need <= self.memory_bytes)

    def _devices_need(self, row: np.ndarray | int, state: np.ndarray | int,
                      replicas: np.ndarray, used: np.ndarray) -> np.ndarray:  # fmt: skip
        """The most any device of the segment's inner plan holds on ``replicas`` units with
        ``num_units - used`` units after it (nan for an invalid segment)."""
        inner = self.inner
        assert inner is not None
        units = np.asarray(replicas, dtype=np.float64)[..., None]
        after = (self.num_units - np.asarray(used, dtype=np.float64))[..., None]
        count = inner.replicas[row, state]
        need = stage_memory_bytes(
            self.schedule, parameter_bytes=inner.parameter_bytes[row, state],
            activation_bytes=inner.activation_bytes[row, state],
            replicas=np.maximum(count, 1) * units,
            downstream=inner.after[row, state] * units + after * self.devices_per_unit,
            optimizer_state_factor=self.optimizer_state_factor)
        need = np.where(count > 0, need, 0.0)
        invalid = np.isnan(self.parameter_bytes[row, state])
        return np.where(invalid, np.nan, np.max(need, axis=-1))

    def piece(self, before: int, state: int, replicas: int, *, first: bool) -> Piece:
        """The stage after ``before`` up to ``state`` as a :data:`Piece`."""
        row = before + 1
        comm = float(self.allreduce_s(self.parameter_bytes[row, state], replicas))
        moved = 0.0 if first else float(self.transfer_s(self.transfer_bytes[row, state], replicas))
        time_s = max((float(self.compute_s[row, state]) + comm) / replicas, moved)
        return (before, state, replicas, time_s, comm, moved)


@dataclass(kw_only=True, slots=True)
class LevelTable:
    """A solved level: ``best[p, j, m]`` and how to recover the stages behind it."""

    problem: LevelProblem
    """What was solved."""
    best: np.ndarray
    """Smallest bottleneck per (row, state, units - 1); inf where impossible."""
    split: np.ndarray | None = None
    """Choice per cell: -1 one stage, -2 same as one unit fewer (idle), k: last stage after k."""
    replicas: np.ndarray | None = None
    """Replicas of the last stage per cell."""
    pieces: list[Piece] | None = None
    """For the fast path: the row-0 stages directly."""

    def device_stages(self) -> DeviceStages:
        """For every segment on all of this level's units (one unit of the level above), the
        devices of the plan chosen for it: one backtrack step for every segment at once."""
        assert self.split is not None and self.replicas is not None  # a full table
        rows, n, N = self.best.shape
        grid_row, grid_state = np.meshgrid(np.arange(rows), np.arange(n), indexing="ij")
        row, state = grid_row.ravel(), grid_state.ravel()
        units = np.full(row.size, N - 1)
        active = np.isfinite(self.best[row, state, units])
        consumed = np.zeros(row.size, dtype=np.int64)
        parts: list[tuple[np.ndarray, ...]] = []
        while active.any():
            choice = np.where(active, self.split[row, state, units], -3)
            idle = choice == -2
            units = np.where(idle, units - 1, units)
            whole, cut = choice == -1, choice >= 0
            count = np.where(whole, units + 1,
                             np.where(cut, self.replicas[row, state, units], 0))
            start = np.where(whole, row, choice + 1)  # the row of the stage's segment
            parts.append(self._device_part(np.where(whole | cut, start, 0), state, count,
                                           consumed))
            consumed = consumed + np.where(cut, count, 0)
            state = np.where(cut, choice, state)
            units = np.where(cut, units - count, units)
            active = active & (idle | cut)
        if not parts:  # no segment fits on this level: one empty stage each
            nothing = np.zeros((row.size, 1), dtype=np.int64)
            parts.append((nothing.astype(np.float64), nothing.astype(np.float64), nothing,
                          nothing))
        shape = (rows, n, -1)
        stacked = [np.concatenate([part[i] for part in parts], axis=1).reshape(shape)
                   for i in range(4)]
        return DeviceStages(parameter_bytes=stacked[0], activation_bytes=stacked[1],
                            replicas=stacked[2], after=stacked[3])

    def _device_part(self, start: np.ndarray, state: np.ndarray, count: np.ndarray,
                     consumed: np.ndarray) -> tuple[np.ndarray, ...]:  # fmt: skip
        """One stage per segment (``count`` 0: none) as devices: ``(parameter bytes,
        activation bytes, replicas, devices after)``, each ``[segment, device stage]``."""
        problem = self.problem
        inner = problem.inner
        on = count > 0
        if inner is None:
            params = np.where(on, problem.parameter_bytes[start, state], 0.0)
            acts = np.where(on, problem.stash_bytes[start, state], 0.0)
            return params[:, None], acts[:, None], count[:, None], consumed[:, None]
        size = problem.devices_per_unit
        reps = inner.replicas[start, state] * count[:, None]
        after = inner.after[start, state] * count[:, None] + (consumed * size)[:, None]
        return (np.where(on[:, None], inner.parameter_bytes[start, state], 0.0),
                np.where(on[:, None], inner.activation_bytes[start, state], 0.0),
                np.where(on[:, None], reps, 0), after)

    def backtrack(self, row: int, state: int) -> list[Piece]:
        """The stages behind ``best[row, state, -1]`` in pipeline order."""
        if self.pieces is not None and row == 0:
            return list(self.pieces)
        assert self.split is not None and self.replicas is not None
        pieces: list[Piece] = []
        units = self.problem.num_units - 1
        while True:
            choice = int(self.split[row, state, units])
            if choice == -2:
                units -= 1
                continue
            if choice == -1:
                pieces.append(self.problem.piece(row - 1, state, units + 1, first=True))
                return pieces[::-1]
            reps = int(self.replicas[row, state, units])
            pieces.append(self.problem.piece(choice, state, reps, first=False))
            state, units = choice, units - reps


def solve_level(problem: LevelProblem, looser: LevelTable | None = None) -> LevelTable:
    """The full dynamic program (every row when ``problem.all_rows``, else row 0), a column of
    states at a time, vectorized over the rows of that column.

    ``looser``: the table of the same innermost level under a looser memory limit (or none).
    Only the cells whose plan there has a stage over ``problem``'s limit are solved again; every
    other cell keeps its plan, which is still its first best: the limit only removes
    candidates, and the others' times can only grow (the same table as a fresh solve, exactly:
    ``tests/test_partition_memo.py``)."""
    n = problem.states.num_states
    N = problem.num_units
    rows = n + 1 if problem.all_rows else 1
    if looser is None:
        table = (np.full((rows, n, N), np.inf), np.full((rows, n, N), -3, dtype=np.int64),
                 np.zeros((rows, n, N), dtype=np.int64))
    else:
        _check_looser(problem, looser)
        assert looser.split is not None and looser.replicas is not None  # a full table
        table = (looser.best.copy(), looser.split.copy(), looser.replicas.copy())
    over = np.zeros((rows, n, N), dtype=bool)
    units = np.arange(1, N + 1)
    for j in range(n):
        below = np.flatnonzero(problem.states.below[:, j])
        valid = np.concatenate(([0], below + 1)) if problem.all_rows else np.zeros(1, np.int64)
        cells = None  # [row, m]: the cells to solve (None: all)
        if looser is not None:
            cells = _over_limit(problem, table, over, valid, j)
            again = cells.any(axis=1)
            valid, cells = valid[again], cells[again]
            if valid.size == 0:
                continue
        base = _base_times(problem, valid, j, units)
        rec = _recursive(problem, table[0], valid, below, j, cells)
        _combine(problem, table, valid, j, base, rec, cells)
    return LevelTable(problem=problem, best=table[0], split=table[1], replicas=table[2])


def _check_looser(problem: LevelProblem, looser: LevelTable) -> None:
    """``looser`` is ``problem``'s innermost table under a limit at least as loose."""
    other = looser.problem
    limit = math.inf if problem.memory_bytes is None else problem.memory_bytes
    assert problem.inner is None and other.inner is None
    assert other.memory_bytes is None or other.memory_bytes >= limit
    assert other.states.num_states == problem.states.num_states
    assert other.num_units == problem.num_units and other.all_rows == problem.all_rows


def _over_limit(problem: LevelProblem, table: tuple[np.ndarray, np.ndarray, np.ndarray],
                over: np.ndarray, rows: np.ndarray, j: int) -> np.ndarray:  # fmt: skip
    """``[row, m]`` for column ``j`` of a table solved under a looser limit (not yet solved
    again): whether the cell's plan has a stage over ``problem``'s limit (its last stage, or
    its prefix's plan: ``over`` of the columns before; idle units: the cell one unit fewer).
    Kept in ``over``."""
    best, split, reps = table
    N = problem.num_units
    units = np.arange(N)[None, :]
    choice, count = split[rows, j], reps[rows, j]
    whole, cut = choice == -1, choice >= 0
    fits = problem.fits(np.where(cut, choice + 1, rows[:, None]), j,
                        np.where(whole, units + 1, np.maximum(count, 1)),
                        np.broadcast_to(units + 1, choice.shape))
    prefix = cut & over[rows[:, None], np.where(cut, choice, 0), np.maximum(units - count, 0)]
    result: np.ndarray = np.isfinite(best[rows, j]) & (((whole | cut) & ~fits) | prefix)
    for m in range(1, N):
        result[:, m] |= (choice[:, m] == -2) & result[:, m - 1]
    over[rows, j] = result
    return result


def _base_times(problem: LevelProblem, rows: np.ndarray, j: int, units: np.ndarray) -> np.ndarray:
    """``[row, m]``: the segment as one stage on ``m + 1`` units (inf where it does not fit)."""
    grid_rows, grid_units = rows[:, None], units[None, :]
    times = problem.stage_time(grid_rows, j, grid_units.astype(np.float64), first=True)
    times = np.where(problem.fits(grid_rows, j, grid_units, grid_units), times, np.inf)
    if problem.straight:
        times[:, 1:] = np.inf
    return np.where(np.isnan(times), np.inf, times)


def _last_stage_times(problem: LevelProblem, below: np.ndarray, j: int) -> np.ndarray:
    """``[i, r - 1]``: time of the stage after state ``below[i]`` up to ``j`` on ``r`` units."""
    N = problem.num_units
    replicas = np.arange(1, N + 1, dtype=np.float64)[None, :]
    rows = (below + 1)[:, None]
    times = problem.stage_time(rows, j, replicas, first=False)
    if problem.straight:
        times[:, 1:] = np.inf
    return np.where(np.isnan(times), np.inf, times)


def _recursive(
    problem: LevelProblem, best: np.ndarray, rows: np.ndarray, below: np.ndarray, j: int,
    cells: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """Best split per row and unit count m: min over k, r of max(best[row, k, m - r],
    last[k, r]), the first minimum in the order of ``below`` then ``r`` (``r`` up to ``m``:
    the prefix keeps a unit); only where ``cells[row, m]`` when given (inf elsewhere)."""
    N = problem.num_units
    rec = np.full((rows.size, N), np.inf)
    rec_k = np.full((rows.size, N), -3, dtype=np.int64)
    rec_r = np.zeros((rows.size, N), dtype=np.int64)
    if below.size == 0 or N < 2:
        return rec, rec_k, rec_r
    last = _last_stage_times(problem, below, j)  # [k, r]
    # a prefix up to k must start after row - 1: state row - 1 below k (row 0: any k)
    starts = np.ones((rows.size, below.size), dtype=bool)
    inner = rows > 0
    starts[inner] = problem.states.below[rows[inner] - 1][:, below]
    fits = np.ones((below.size, N, N - 1), dtype=bool)  # [k, m, r - 1]
    if problem.memory_bytes is not None:
        fits = np.broadcast_to(problem.fits(
            (below + 1)[:, None, None], j, np.arange(1, N)[None, None, :],
            np.arange(1, N + 1)[None, :, None]), fits.shape)
    for m in range(1, N):
        r = np.arange(1, m + 1)
        step = max(1, _CHUNK_ELEMENTS // max(1, below.size * m))
        solved = np.arange(rows.size) if cells is None else np.flatnonzero(cells[:, m])
        for first in range(0, solved.size, step):
            part = solved[first : first + step]
            prefix = best[rows[part][:, None, None], below[None, :, None], (m - r)[None, None, :]]
            cand = np.maximum(prefix, last[None, :, :m])
            cand = np.where(starts[part][:, :, None] & fits[None, :, m, :m], cand, np.inf)
            flat = cand.reshape(cand.shape[0], -1)
            arg = np.argmin(flat, axis=1)
            value = flat[np.arange(part.size), arg]
            found = np.isfinite(value)
            rec[part, m] = value
            rec_k[part, m] = np.where(found, below[arg // m], -3)
            rec_r[part, m] = np.where(found, arg % m + 1, 0)
    return rec, rec_k, rec_r


def _combine(
    problem: LevelProblem, table: tuple[np.ndarray, np.ndarray, np.ndarray], rows: np.ndarray,
    j: int, base: np.ndarray, rec: tuple[np.ndarray, np.ndarray, np.ndarray],
    cells: np.ndarray | None = None,
) -> None:  # fmt: skip
    """PipeDream's order: one stage first, then idle units if strictly better, then splits;
    only the cells ``cells[row, m]`` when given."""
    best, split, reps = table
    values, ks, rs = rec
    for m in range(problem.num_units):
        value = base[:, m]
        choice = np.full(rows.size, -1, dtype=np.int64)
        count = np.full(rows.size, m + 1, dtype=np.int64)
        if problem.allow_idle and m > 0:
            idle = best[rows, j, m - 1] < value
            value = np.where(idle, best[rows, j, m - 1], value)
            choice, count = np.where(idle, -2, choice), np.where(idle, 0, count)
        splits = values[:, m] < value
        write = slice(None) if cells is None else cells[:, m]
        best[rows[write], j, m] = np.where(splits, values[:, m], value)[write]
        split[rows[write], j, m] = np.where(splits, ks[:, m], choice)[write]
        reps[rows[write], j, m] = np.where(splits, rs[:, m], count)[write]
