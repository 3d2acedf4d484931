"""Remembered solves (``planning/partition/memo.py``) change no answer: a partition solved after
others (whose plans bound its table, whose infeasible budgets answer tighter ones at once, whose
inner tables under looser limits start its own) is the one solved afresh, stage for stage."""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest

from tandem.cluster import Cluster, Level
from tandem.planning import NoPlanFits, PartitionOptions
from tandem.planning.partition import memo, pipedream
from tandem.planning.partition.levels import solve_level
from tandem.planning.partition.pipedream import Partition, partition
from tests.test_partition_exact import random_profile

pytestmark = pytest.mark.pure


def _answer(profile, cluster: Cluster, options: PartitionOptions) -> object:
    try:
        solved: Partition = partition(profile, cluster, options)
    except NoPlanFits:
        return "no plan fits"
    return solved.bottleneck_s, [(s.before, s.state, s.replicas, s.devices)
                                 for s in solved.stages]


def _flat(units: int, bandwidth: float) -> Cluster:
    return Cluster(levels=(Level(num_units=units, bandwidth_Bps=bandwidth),))


@pytest.mark.parametrize("limited", [False, True], ids=["table", "limited-search"])
@pytest.mark.parametrize("seed", range(4))
def test_a_solve_after_others_is_the_solve_afresh(seed: int, limited: bool,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """In any order, with everything kept between solves, each answer is the fresh one;
    ``limited``: flat levels under a limit go to :mod:`.limited`'s search whatever their size,
    each search started from the optima its neighbouring budgets reached."""
    warm: list[tuple[float, float]] = []
    if limited:
        monkeypatch.setattr(pipedream, "FAST_PATH_ELEMENTS", -1)
        search = pipedream.search_limited

        def spied(problem, low=0.0, high=math.inf):  # type: ignore[no-untyped-def]
            warm.append((low, high))
            return search(problem, low, high)

        monkeypatch.setattr(pipedream, "search_limited", spied)
    rng = random.Random(seed)
    for _ in range(6):
        dag = rng.random() < 0.4
        profile = random_profile(rng, rng.randint(6, 10) if dag else rng.randint(8, 24), dag)
        units = rng.randint(2, 12)
        schedule = rng.choice(["pipedream", "1f1b", "gpipe"])
        options = PartitionOptions(activation_compression=rng.choice([None, 1.0]),
                                   allow_idle=rng.random() < 0.2, schedule=schedule)
        whole = max(sum(layer.parameter_bytes for layer in profile.layers), 1e6) * 4
        budgets = sorted({rng.uniform(0.05, 1.0) * whole for _ in range(5)}, reverse=True)
        questions = [(_flat(units, bandwidth), dataclasses.replace(options, memory_bytes=budget))
                     for bandwidth in (1.25e8, 1.25e9, 1e10) for budget in (None, *budgets)]
        if units % 2 == 0:  # the same devices as two levels: their plans bound the flat ones
            levels = (Level(num_units=2, bandwidth_Bps=1e10),
                      Level(num_units=units // 2, bandwidth_Bps=1.25e9))
            questions += [(Cluster(levels=levels), dataclasses.replace(options, memory_bytes=b))
                          for b in budgets]
        memo.forget()
        afresh = []
        for cluster, asked in questions:
            memo.forget()
            afresh.append(_answer(profile, cluster, asked))
        memo.forget()
        rng.shuffle(order := list(range(len(questions))))
        after = {index: _answer(profile, *questions[index]) for index in order}
        assert [after[index] for index in range(len(questions))] == afresh
    if limited:
        assert any(low > 0 or high < math.inf for low, high in warm)


def test_the_optima_kept_bound_a_budget_from_both_sides() -> None:
    memo.forget()
    assert memo.optimum_bounds("family", 4e9) == (0.0, math.inf)
    for budget, reached in ((8e9, 1.0), (16e9, 0.5), (2e9, 3.0), (1e9, 5.0)):
        memo.note_optimum("family", budget, reached)
    assert memo.optimum_bounds("family", 4e9) == (1.0, 3.0)  # 8 GB's below, 2 GB's above
    assert memo.optimum_bounds("family", 8e9) == (0.5, 3.0)  # its own is not a bound
    assert memo.optimum_bounds("family", 32e9) == (0.0, 0.5)
    assert memo.optimum_bounds("other", 4e9) == (0.0, math.inf)
    memo.forget()
    assert memo.optimum_bounds("family", 4e9) == (0.0, math.inf)


def test_a_budget_below_one_that_fits_nothing_is_answered_without_a_solve(monkeypatch) -> None:
    profile = random_profile(random.Random(3), 12, dag=False)
    whole = sum(layer.parameter_bytes for layer in profile.layers) * 4
    options = PartitionOptions(schedule="1f1b")
    memo.forget()
    with pytest.raises(NoPlanFits):
        partition(profile, _flat(4, 1.25e9), dataclasses.replace(options, memory_bytes=whole / 1e3))

    def no_solve(*args: object, **kwargs: object) -> None:
        raise AssertionError("solved")

    monkeypatch.setattr(pipedream, "_solve", no_solve)
    with pytest.raises(NoPlanFits, match="no plan fits in"):  # other links, tighter: no solve
        partition(profile, _flat(4, 1e10), dataclasses.replace(options, memory_bytes=whole / 2e3))


def test_an_equal_profile_built_anew_is_recognised() -> None:
    profile = random_profile(random.Random(4), 10, dag=True)
    again = dataclasses.replace(profile, layers=list(profile.layers))
    assert memo.content(profile) is memo.content(again)
    first = partition(profile, _flat(4, 1.25e9))
    assert partition(again, _flat(4, 1.25e9)) is first


@pytest.mark.parametrize("seed", range(3))
def test_an_inner_table_solved_from_a_looser_limits_is_the_table_solved_afresh(seed: int) -> None:
    """A walk down the memory grid solves the innermost level of a hierarchy again only where a
    cell's plan under the last (looser) limit has a stage over the new one
    (``levels.solve_level(problem, looser)``): every cell's value, split and replicas are a
    fresh solve's, on each budget of a descending walk."""
    rng = random.Random(seed)
    for _ in range(4):
        dag = rng.random() < 0.4
        profile = random_profile(rng, rng.randint(6, 10) if dag else rng.randint(8, 20), dag)
        options = PartitionOptions(activation_compression=rng.choice([None, 1.0]),
                                   allow_idle=rng.random() < 0.3, straight=rng.random() < 0.2,
                                   schedule=rng.choice(["pipedream", "1f1b", "gpipe"]))
        cluster = Cluster(levels=(Level(num_units=rng.randint(2, 6), bandwidth_Bps=1e10),
                                  Level(num_units=2, bandwidth_Bps=1.25e9)))
        states = memo.states_of(profile, memo.content(profile))
        segments = pipedream._segments(states, cluster.speed)
        whole = max(sum(layer.parameter_bytes for layer in profile.layers), 1e6) * 4
        looser = None
        changed = 0
        for budget in [None, *sorted((rng.uniform(0.02, 1.0) * whole for _ in range(6)),
                                     reverse=True)]:
            problem = pipedream._level_problem(
                states, segments, cluster, 0, dataclasses.replace(options, memory_bytes=budget),
                None)
            afresh = solve_level(problem)
            walked = solve_level(problem, looser) if looser is not None else afresh
            for name in ("best", "split", "replicas"):
                assert np.array_equal(getattr(walked, name), getattr(afresh, name)), (name, budget)
            changed += looser is not None and not np.array_equal(looser.best, afresh.best)
            looser = walked
        assert changed  # the limits bound
