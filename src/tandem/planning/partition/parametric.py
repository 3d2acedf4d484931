"""Row 0 of the final level by a parametric search over the bottleneck, for many units.

For a time bound ``T`` each stage needs a least number of units, found in closed form from a
quadratic, and a prefix minimum over states says whether ``T`` is reachable; bisection finds
the least reachable ``T``. That solves the problem with idle units allowed, a lower bound; a
second pass proves (or fails to prove, falling back to the table) that the same ``T`` is
reachable using every unit.
"""

from __future__ import annotations

import numpy as np

from tandem.planning.partition.levels import LevelProblem, LevelTable, Piece


def solve_level_fast(problem: LevelProblem) -> LevelTable | None:
    """Row 0 of the final level by parametric search, or None where the table is needed."""
    if problem.memory_bytes is not None or (problem.straight and not problem.allow_idle):
        return None
    search = _Parametric(problem)
    bound, pieces = search.minimize()
    if not problem.allow_idle:
        every_unit = search.use_every_unit(bound)
        if every_unit is None:
            return None
        pieces = every_unit
    best = np.full((1, problem.states.num_states, problem.num_units), np.inf)
    best[0, -1, -1] = max(piece[3] for piece in pieces)
    return LevelTable(problem=problem, best=best, pieces=pieces)


class _Parametric:
    """Least units per stage under a time bound, and the prefix minimum over states.

    Segments are held flat: entry ``i`` is the segment after state ``rows[i] - 1`` up to state
    ``cols[i]`` (row 0: from the start), for every valid pair.
    """

    def __init__(self, problem: LevelProblem) -> None:
        self.problem = problem
        self.shape = problem.compute_s.shape
        self.rows, self.cols = np.nonzero(~np.isnan(problem.compute_s))
        self.first = self.rows == 0
        self.compute = problem.compute_s[self.rows, self.cols]
        self.params = problem.parameter_bytes[self.rows, self.cols]
        self.moved = problem.transfer_bytes[self.rows, self.cols]
        self.k_coef = 4 * self.params / (problem.bandwidth_Bps * problem.devices_per_unit
                                         * problem.gradient_compression)
        self.total = self.compute + self.k_coef
        self.square = self.total * self.total
        ratio = problem.activation_compression or 1.0
        self.g_coef = 2.0 * self.moved / problem.bandwidth_Bps / ratio

    def _exact(self, replicas: np.ndarray, index: np.ndarray | slice = slice(None)) -> np.ndarray:
        """Exact times of segments ``index`` on ``replicas`` units (inf units: inf)."""
        finite = np.isfinite(replicas)
        safe = np.where(finite, replicas, 1.0)
        segment = (self.compute[index], self.params[index], self.moved[index])
        times = self.problem.segment_time(*segment, safe, first=self.first[index])
        return np.where(finite, times, np.inf)

    def _matrix(self, flat: np.ndarray) -> np.ndarray:
        """``[p, j]`` from flat values (inf where the pair is invalid)."""
        matrix = np.full(self.shape, np.inf)
        matrix[self.rows, self.cols] = flat
        return matrix

    def _roots(self, bound: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per segment: least units for the transfer, and the roots of the stage-time quadratic.

        Both roots are nan where there are none (every unit count is then fast enough).
        """
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            root = np.sqrt(self.square - 4 * bound * self.k_coef)
            low = (self.total - root) / (2 * bound)
            high = (self.total + root) / (2 * bound)
            least = np.maximum(1.0, np.ceil(self.g_coef / bound))
        return least, low, high

    def _settle(self, cand: np.ndarray, bound: float, *, down: bool) -> np.ndarray:
        """From an estimate: up to three units more while too slow, then one fewer if it fits.

        Only the estimates that are too slow are re-timed more than twice.
        """
        N = self.problem.num_units
        cand = np.where(cand > N + 2, np.inf, cand)
        climb = np.flatnonzero((self._exact(cand) > bound) & np.isfinite(cand))
        for _ in range(3):
            slow = self._exact(cand[climb], climb) > bound
            cand[climb] = np.where(slow, cand[climb] + 1, cand[climb])
        fits = np.ones(cand.shape, dtype=bool)
        fits[climb] = self._exact(cand[climb], climb) <= bound
        if down:
            lower = np.where(cand > 1, cand - 1, np.inf)
            lowered = self._exact(lower) <= bound
            cand = np.where(lowered, lower, cand)
            fits |= lowered
        cand = np.where(fits & (cand <= N), cand, np.inf)
        if self.problem.straight:
            cand = np.where(cand == 1, cand, np.inf)
        return cand

    def least_units(self, bound: float) -> np.ndarray:
        """``[p, j]``: fewest units for the segment to take at most ``bound`` (inf: none)."""
        least, low, high = self._roots(bound)
        cand = np.where(least <= np.floor(low), least, np.fmax(least, np.ceil(high)))
        return self._matrix(self._settle(cand, bound, down=True))

    def tail_units(self, bound: float) -> np.ndarray:
        """``[p, j]``: fewest units from which every larger count up to N also fits."""
        least, _, high = self._roots(bound)
        cand = self._settle(np.fmax(least, np.ceil(high)), bound, down=False)
        every = self._exact(np.full(cand.shape, float(self.problem.num_units))) <= bound
        return self._matrix(np.where(every, cand, np.inf))

    def _prefix(self, need: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = need.shape[1]
        total = np.full(n + 1, np.inf)
        total[0] = 0.0
        arg = np.zeros(n, dtype=np.int64)
        for j in range(n):
            sums = total + need[:, j]
            arg[j] = int(np.argmin(sums))
            total[j + 1] = sums[arg[j]]
        return total, arg

    def _pieces(self, arg: np.ndarray, need: np.ndarray) -> list[Piece]:
        pieces: list[Piece] = []
        state = need.shape[1] - 1
        while state >= 0:
            row = int(arg[state])
            pieces.append(self.problem.piece(row - 1, state, int(need[row, state]), first=row == 0))
            state = row - 1
        return pieces[::-1]

    def minimize(self) -> tuple[float, list[Piece]]:
        """The least bound reachable with at most N units, and a plan reaching it: bisection,
        which stops as soon as nothing just below the best plan's bottleneck is reachable
        (fewer units never carry a tighter bound, so every later step would fail: the plain
        bisection's answer and plan, without its last forty steps)."""
        n, N = self.problem.states.num_states, self.problem.num_units
        one_stage = self.problem.stage_time(0, n - 1, np.arange(1, N + 1, dtype=np.float64),
                                            first=True)
        if self.problem.straight:
            one_stage = one_stage[:1]
        r = int(np.argmin(one_stage))
        pieces = [self.problem.piece(-1, n - 1, r + 1, first=True)]
        low, high = 0.0, float(one_stage[r])
        checked = np.inf  # the last ``high`` proven or not proven optimal
        for _ in range(200):
            mid = 0.5 * (low + high)
            if not low < mid < high or high - low <= high * 1e-15:
                break
            if high != checked:
                checked = high
                if not self._reachable(np.nextafter(high, 0.0)):
                    break  # nothing below high is reachable: every later bound would fail
            need = self.least_units(mid)
            total, arg = self._prefix(need)
            if total[n] <= N:
                pieces = self._pieces(arg, need)
                high = max(piece[3] for piece in pieces)
            else:
                low = mid
        return high, pieces

    def _reachable(self, bound: float) -> bool:
        """Whether at most N units carry the model within ``bound``."""
        total, _ = self._prefix(self.least_units(bound))
        return bool(total[-1] <= self.problem.num_units)

    def use_every_unit(self, bound: float) -> list[Piece] | None:
        """A plan within ``bound`` using exactly N units: one stage absorbs the spare units."""
        n, N = self.problem.states.num_states, self.problem.num_units
        need = self.least_units(bound)
        tail = self.tail_units(bound)
        plain, plain_arg = self._prefix(need)
        wide = np.full(n + 1, np.inf)
        wide[0] = np.inf
        wide_arg = np.zeros((n, 2), dtype=np.int64)
        for j in range(n):
            keep = wide + need[:, j]
            grow = plain + tail[:, j]
            a, b = int(np.argmin(keep)), int(np.argmin(grow))
            wide[j + 1], wide_arg[j] = (keep[a], (a, 0)) if keep[a] <= grow[b] else (grow[b], (b, 1))
        if not wide[n] <= N:
            return None
        return self._absorb(wide_arg, plain_arg, need, N)

    def _absorb(self, wide_arg: np.ndarray, plain_arg: np.ndarray, need: np.ndarray,
                N: int) -> list[Piece]:  # fmt: skip
        stages: list[tuple[int, int, bool]] = []
        state, widened = need.shape[1] - 1, True
        while state >= 0:
            row, flag = (int(wide_arg[state][0]), bool(wide_arg[state][1])) if widened else (
                int(plain_arg[state]), False)  # fmt: skip
            stages.append((row, state, widened and flag))
            widened = widened and not flag
            state = row - 1
        stages.reverse()
        spare = N - sum(int(need[row, state]) for row, state, _ in stages)
        return [
            self.problem.piece(row - 1, state, int(need[row, state]) + (spare if grow else 0),
                               first=row == 0)  # fmt: skip
            for row, state, grow in stages
        ]
