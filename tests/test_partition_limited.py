"""The parametric search under a memory limit equals the table, and holds the limit itself.

``planning/partition/limited.py`` solves row 0 of a flat level under a memory limit for many
units (the 1,000-layer chain on 1,024 devices); the exhaustive search of
``test_partition_exact.py`` checks it on 8 layers. Here chains of up to 60 layers and DAGs on up
to 40 units, under limits that bind, compare it with the plain table of ``levels.py``, and every
plan it returns is checked stage by stage: its units, its time, each device's memory.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from tandem.planning.partition.levels import LevelProblem, solve_level
from tandem.planning.partition.limited import (
    memory_bracket,
    quick_plan,
    search_limited,
    solve_limited,
)
from tandem.planning.partition.memory import stage_memory_bytes
from tandem.spec.kinds import ScheduleKind
from tests.test_partition_bounded import random_problem

pytestmark = pytest.mark.pure


def limited_problem(rng: random.Random) -> LevelProblem:
    """A flat level of up to 40 units under a limit from a 50th of the whole model's memory on
    one device up, for any schedule."""
    problem = random_problem(rng)
    schedule = rng.choice([ScheduleKind.PIPEDREAM, ScheduleKind.PIPEDREAM,
                           ScheduleKind.ONE_F_ONE_B, ScheduleKind.GPIPE])
    factor = rng.choice([0.0, 1.0, 2.0])
    states = problem.states
    whole = float(stage_memory_bytes(schedule, parameter_bytes=states.parameter_bytes[-1],
                                     activation_bytes=states.activation_bytes[-1], replicas=1,
                                     downstream=0, optimizer_state_factor=factor))
    allow_idle = rng.random() < 0.3
    return dataclasses.replace(
        problem, num_units=rng.randint(2, 40), devices_per_unit=1, schedule=schedule,
        memory_bytes=max(whole, 1e6) * rng.uniform(0.02, 1.2), optimizer_state_factor=factor,
        allow_idle=allow_idle, straight=allow_idle and rng.random() < 0.2)


def check_plan(problem: LevelProblem, pieces: list, bottleneck: float) -> None:
    """Stages cover the model in order, on N units (at most with idle ones), each within the
    bottleneck and each device within the limit (idle units after the first stage)."""
    N = problem.num_units
    used = sum(piece[2] for piece in pieces)
    assert used <= N if problem.allow_idle else used == N
    assert pieces[0][0] == -1 and pieces[-1][1] == problem.states.num_states - 1
    after = used
    for index, (before, state, replicas, time_s, _, _) in enumerate(pieces):
        assert index == 0 or before == pieces[index - 1][1]
        assert time_s <= bottleneck
        after -= replicas
        downstream = after if index else N - replicas  # idle units sit after the first stage
        need = stage_memory_bytes(problem.schedule, parameter_bytes=problem.parameter_bytes[
            before + 1, state], activation_bytes=problem.stash_bytes[before + 1, state],
            replicas=replicas, downstream=downstream,
            optimizer_state_factor=problem.optimizer_state_factor)
        assert need <= problem.memory_bytes
        if problem.straight:
            assert replicas == 1


@pytest.mark.parametrize("seed", range(4))
def test_limited_search_equals_table(seed: int) -> None:
    rng = random.Random(seed)
    proven = 0
    for _ in range(30):
        problem = limited_problem(rng)
        expected = float(solve_level(problem).best[0, -1, -1])
        table, bound = solve_limited(problem)
        if table is None:  # not proven: an upper bound for the pruned table
            assert bound >= expected * (1 - 1e-12), problem
            continue
        proven += 1
        got = float(table.best[0, -1, -1])
        if math.isinf(expected):
            assert math.isinf(got), problem
            continue
        assert got == pytest.approx(expected, rel=1e-9), problem
        check_plan(problem, table.backtrack(0, problem.states.num_states - 1), got)
    assert proven >= 25



@pytest.mark.parametrize("seed", range(2))
def test_a_search_between_its_neighbours_bounds_returns_the_same_plan(seed: int) -> None:
    """What the walk down the memory grid hands each search (``memo.optimum_bounds``): the
    least bound a looser budget reached (just below, as a bound that reaches nothing) and a
    tighter budget's (one that reaches a plan). Down a ladder of budgets, each search started
    from its neighbours' optima returns the table, the bound and the optimum of a cold one."""
    rng = random.Random(300 + seed)
    checked = 0
    for _ in range(12):
        problem = limited_problem(rng)
        budgets = [problem.memory_bytes * 2 ** (-k / 3) for k in range(8)]
        optima = [search_limited(dataclasses.replace(problem, memory_bytes=budget))[2]
                  for budget in budgets]
        for index, budget in enumerate(budgets):
            at = dataclasses.replace(problem, memory_bytes=budget)
            looser = [o for o in optima[:index] if o is not None]
            tighter = [o for o in optima[index + 1:] if o is not None]
            low = max(looser, default=0.0) * (1 - 1e-12)
            high = min(tighter, default=math.inf)
            cold, warm = search_limited(at), search_limited(at, low, high)
            assert warm[1:] == cold[1:], (problem, budget)
            if cold[0] is not None:
                assert warm[0] is not None
                assert (warm[0].best == cold[0].best).all()
                assert warm[0].backtrack(0, problem.states.num_states - 1) == \
                    cold[0].backtrack(0, problem.states.num_states - 1)
                checked += 1
    assert checked >= 20


def test_quick_plan_is_a_plan_and_proves_when_nothing_fits() -> None:
    """The quick search that bounds the table: its plan holds every unit within the limit, and
    it says nothing fits exactly when the table finds nothing."""
    rng = random.Random(100)
    for _ in range(20):
        problem = limited_problem(rng)
        if problem.straight and not problem.allow_idle:
            continue
        expected = float(solve_level(problem).best[0, -1, -1])
        feasible, pieces = quick_plan(problem)
        if not feasible:
            assert math.isinf(expected), problem
            continue
        if pieces is not None:
            bottleneck = max(piece[3] for piece in pieces)
            assert sum(piece[2] for piece in pieces) == problem.num_units
            check_plan(problem, pieces, bottleneck)
            assert bottleneck >= expected * (1 - 1e-12)


def test_memory_bracket_holds_the_least_memory_that_fits() -> None:
    """No plan fits below the bracket's floor; one on every unit fits its roof (what lets the
    smallest memory named by ``tandem plan`` be found with a solve or two)."""
    rng = random.Random(200)
    checked = 0
    for _ in range(14):
        problem = limited_problem(rng)
        if problem.straight and not problem.allow_idle:
            continue
        high = float(problem.memory_bytes or 1.0) * 50
        bracket = memory_bracket(problem, high * 1e-9, high, 1e-4)
        if bracket is None:
            continue
        floor, roof = bracket
        below = dataclasses.replace(problem, memory_bytes=floor)
        assert math.isinf(float(solve_level(below).best[0, -1, -1])), problem
        if roof is not None:
            at = dataclasses.replace(problem, memory_bytes=roof)
            assert math.isfinite(float(solve_level(at).best[0, -1, -1])), problem
            assert floor <= roof
            checked += 1
    assert checked >= 6
