"""The pruned row-0 solver equals the unpruned table, in value and in plan, on medium instances.

The exhaustive search in ``test_partition_exact.py`` stops at 8 layers, where the bound prunes
little. Here chains of up to 60 layers and DAGs with up to a few hundred states on up to 24
units compare ``planning/bounded.py`` with the plain table of ``planning/levels.py`` (row 0).
"""

from __future__ import annotations

import importlib
import math
import random

import pytest

from tandem.planning.partition.antichain import build_states
from tandem.planning.partition.bounded import solve_row0
from tandem.planning.partition.levels import LevelProblem, solve_level
from tests.test_partition_exact import random_profile

pytestmark = pytest.mark.pure

segment_matrix = importlib.import_module("tandem.planning.partition.pipedream")._segment_matrix


def random_problem(rng: random.Random) -> LevelProblem:
    dag = rng.random() < 0.4
    profile = random_profile(rng, rng.randint(6, 10) if dag else rng.randint(10, 60), dag)
    states = build_states(profile)
    total_bytes = float(states.parameter_bytes[-1] + states.activation_bytes[-1])
    return LevelProblem(
        states=states,
        compute_s=segment_matrix(states, states.compute_s),
        parameter_bytes=segment_matrix(states, states.parameter_bytes),
        stash_bytes=segment_matrix(states, states.activation_bytes),
        num_units=rng.randint(2, 24),
        bandwidth_Bps=rng.choice([1.25e8, 1.25e9, 1e10]),
        devices_per_unit=rng.choice([1, 1, 4]),
        activation_compression=rng.choice([None, 1.0, 4.0]),
        memory_bytes=rng.choice([None, None, None, max(total_bytes, 1e6) * rng.uniform(0.2, 2)]),
        straight=rng.random() < 0.1,
        allow_idle=rng.random() < 0.3,
        all_rows=False,
    )


@pytest.mark.parametrize("seed", range(4))
def test_pruned_row0_equals_full_table(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(25):
        problem = random_problem(rng)
        last = problem.states.num_states - 1
        full, pruned = solve_level(problem), solve_row0(problem)
        expected = float(full.best[0, last, -1])
        assert float(pruned.best[0, last, -1]) == expected, problem
        if math.isfinite(expected):
            assert pruned.backtrack(0, last) == full.backtrack(0, last), problem
