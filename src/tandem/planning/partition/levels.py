"""One level of PipeDream's dynamic program: its cost model and the full table.

``solve_level`` fills ``best[p, j, m]``: the smallest bottleneck for the layers of state ``j``
minus state ``p - 1`` (row 0: from the start) on ``m + 1`` units, vectorized over the last
stage's start and replica count. Row 0 alone is solved faster by :mod:`.bounded` and, for
many units, by :mod:`.parametric`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tandem.planning.partition.antichain import States
from tandem.planning.partition.memory import stage_memory_bytes
from tandem.spec.kinds import ScheduleKind

Piece = tuple[int, int, int, float, float, float]
"""A stage of one level: (before, state, replicas, time_s, allreduce_s, transfer_s)."""

_CHUNK_ELEMENTS = 4_000_000


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
        """Whether a device of the stage holds its weights, gradients, optimizer state, stashed
        versions and in-flight activations (:mod:`tandem.planning.partition.memory`) within the limit.

        ``used`` counts the units up to and including this stage, so ``num_units - used`` follow
        it. At an outer level a unit's ``D`` devices share the segment's bytes evenly, an
        estimate: the level below has checked each of its own stages, and the planner checks the
        whole plan's devices again (:func:`tandem.planning.search.planner.make_plan`).
        """
        if self.memory_bytes is None:
            return np.ones(np.broadcast(replicas, used).shape, dtype=bool)
        share = 1.0 / self.devices_per_unit
        need = stage_memory_bytes(
            self.schedule, parameter_bytes=self.parameter_bytes[row, state] * share,
            activation_bytes=self.stash_bytes[row, state] * share, replicas=replicas,
            downstream=self.num_units - used, optimizer_state_factor=self.optimizer_state_factor)
        return np.asarray(need <= self.memory_bytes)

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


def solve_level(problem: LevelProblem) -> LevelTable:
    """The full dynamic program (every row when ``problem.all_rows``, else row 0)."""
    n = problem.states.num_states
    N = problem.num_units
    rows = n + 1 if problem.all_rows else 1
    best = np.full((rows, n, N), np.inf)
    split = np.full((rows, n, N), -3, dtype=np.int64)
    reps = np.zeros((rows, n, N), dtype=np.int64)
    units = np.arange(1, N + 1)
    for j in range(n):
        below = np.flatnonzero(problem.states.below[:, j])
        valid_rows = [0] + ([int(p) + 1 for p in below] if problem.all_rows else [])
        last = _last_stage_times(problem, below, j) if below.size else None
        for p in valid_rows:
            base = _base_times(problem, p, j, units)
            rec, rec_k, rec_r = _recursive(problem, best, p, below, j, last)
            _combine(problem, best, split, reps, (p, j), base, (rec, rec_k, rec_r))
    return LevelTable(problem=problem, best=best, split=split, replicas=reps)


def _base_times(problem: LevelProblem, p: int, j: int, units: np.ndarray) -> np.ndarray:
    times = problem.stage_time(p, j, units.astype(np.float64), first=True)
    times = np.where(problem.fits(p, j, units, units), times, np.inf)
    if problem.straight:
        times[1:] = np.inf
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
    problem: LevelProblem, best: np.ndarray, p: int, below: np.ndarray, j: int,
    last: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """Best split per unit count m: min over k, r of max(best[p, k, m - r], last[k, r])."""
    N = problem.num_units
    rec = np.full(N, np.inf)
    rec_k = np.full(N, -3, dtype=np.int64)
    rec_r = np.zeros(N, dtype=np.int64)
    if last is None or N < 2:
        return rec, rec_k, rec_r
    pick = np.ones(below.size, dtype=bool) if p == 0 else problem.states.below[p - 1, below]
    index = np.flatnonzero(pick)
    m = np.arange(N)[:, None]
    r = np.arange(1, N + 1)[None, :]
    prior = m - r  # units index of the prefix
    ok = prior >= 0
    step = max(1, _CHUNK_ELEMENTS // (N * N))
    for start in range(0, index.size, step):
        chunk = index[start : start + step]
        ks = below[chunk]
        prefix = best[p, ks][:, np.clip(prior, 0, None)]
        cand = np.maximum(np.where(ok, prefix, np.inf), last[chunk][:, None, :])
        if problem.memory_bytes is not None:
            fits = problem.fits((ks + 1)[:, None, None], j, r[None], (m + 1)[None])
            cand = np.where(fits, cand, np.inf)
        flat = cand.transpose(1, 0, 2).reshape(N, -1)
        arg = np.argmin(flat, axis=1)
        value = flat[np.arange(N), arg]
        better = value < rec
        rec = np.where(better, value, rec)
        rec_k = np.where(better, ks[arg // N], rec_k)
        rec_r = np.where(better, arg % N + 1, rec_r)
    return rec, rec_k, rec_r


def _combine(
    problem: LevelProblem, best: np.ndarray, split: np.ndarray, reps: np.ndarray,
    cell: tuple[int, int], base: np.ndarray, rec: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> None:  # fmt: skip
    """PipeDream's order: one stage first, then idle units if strictly better, then splits."""
    p, j = cell
    values, ks, rs = rec
    for m in range(problem.num_units):
        value, choice, count = base[m], -1, m + 1
        if problem.allow_idle and m > 0 and best[p, j, m - 1] < value:
            value, choice, count = best[p, j, m - 1], -2, 0
        if values[m] < value:
            value, choice, count = values[m], int(ks[m]), int(rs[m])
        best[p, j, m], split[p, j, m], reps[p, j, m] = value, choice, count
