"""The partitioner equals an exhaustive search under the same cost model on small instances."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from tandem.cluster import Cluster, Level
from tandem.planning import PartitionOptions
from tandem.planning.partition import memo
from tandem.planning.partition.pipedream import partition
import importlib

partition_module = importlib.import_module("tandem.planning.partition.pipedream")
from tandem.profile import LayerProfile, ModelProfile

pytestmark = pytest.mark.pure


@pytest.fixture(autouse=True)
def _solve_afresh() -> None:
    """Each test solves for itself: remembered solves (:mod:`memo`) would answer the fast
    path's cases with the table's."""
    memo.forget()


def random_profile(rng: random.Random, num_layers: int, dag: bool) -> ModelProfile:
    layers = [
        LayerProfile(
            name=f"l{i}",
            forward_s=rng.choice([0.0, rng.uniform(0.001, 0.05)]),
            backward_s=rng.uniform(0.0, 0.1),
            activation_bytes=rng.choice([0.0, rng.uniform(1e5, 5e7)]),
            parameter_bytes=rng.choice([0.0, rng.uniform(1e5, 1e8)]),
        )
        for i in range(num_layers)
    ]
    if not dag:
        return ModelProfile(layers=layers)
    edges = set()
    for i in range(1, num_layers):  # one source: every layer has a producer before it
        edges.add((rng.randrange(i), i))
        if i > 1 and rng.random() < 0.4:
            edges.add((rng.randrange(i), i))
    return ModelProfile(layers=layers, edges=sorted(edges))


# ---- an independent exhaustive search ------------------------------------------------------


def down_sets(profile: ModelProfile) -> list[frozenset[int]]:
    """All non-empty subsets closed under producers (single-source DAGs: all are states)."""
    n = profile.num_layers
    producers = {i: {a for a, b in profile.edge_list() if b == i} for i in range(n)}
    found = []
    for bits in range(1, 1 << n):
        members = frozenset(i for i in range(n) if bits >> i & 1)
        if all(producers[i] <= members for i in members):
            found.append(members)
    return found


def cut_bytes(profile: ModelProfile, members: frozenset[int]) -> float:
    """PipeDream's augmented antichain of a down-set, summed activation bytes."""
    edges = profile.edge_list()
    consumers = {i: {b for a, b in edges if a == i} for i in range(profile.num_layers)}

    def ancestors(node: int) -> set[int]:
        found: set[int] = set()
        stack = [a for a, b in edges if b == node]
        while stack:
            top = stack.pop()
            if top not in found:
                found.add(top)
                stack.extend(a for a, b in edges if b == top)
        return found

    maximal = [a for a in members if not consumers[a] & members]
    frontier = set(maximal)
    for top in maximal:
        below = ancestors(top)
        frontier |= {p for p in below if consumers[p] - below - {top}}
    return sum(profile.layers[i].activation_bytes for i in frontier)


def chains(sets: list[frozenset[int]], start: frozenset[int], end: frozenset[int]):
    """Every chain start < s1 < ... < end of down-sets."""
    if start == end:
        yield [end]
        return
    for middle in sets:
        if start < middle < end or middle == end:
            if middle == end:
                yield [end]
            else:
                for rest in chains(sets, middle, end):
                    yield [middle, *rest]


def stage_time(profile, segment, compute, params, replicas, bandwidth, per_unit, ratio,
               first, cut_in, cut_out):
    comm = 4 * (replicas - 1) * params / (bandwidth * replicas) / per_unit
    time_s = (compute + comm) / replicas
    if first or ratio is None:
        return time_s
    return max(time_s, 2 * max(cut_in, cut_out) / (bandwidth * replicas) / ratio)


def replica_choices(num_stages, units, straight, idle):
    top = 1 if straight else units
    for reps in itertools.product(range(1, top + 1), repeat=num_stages):
        spare = units - sum(reps)
        if spare == 0 or (idle and spare > 0):
            # idle units may sit after any stage; they only relax memory for later stages
            for gaps in itertools.product(range(spare + 1), repeat=num_stages):
                if sum(gaps) == spare:
                    yield reps, gaps


def brute_force(profile, cluster, options, level=None, start=frozenset(), end=None, memo=None):
    """Best bottleneck for the layers end - start at ``level`` (top level by default)."""
    sets = down_sets(profile)
    full = frozenset(range(profile.num_layers))
    end = full if end is None else end
    level = len(cluster.levels) - 1 if level is None else level
    memo = {} if memo is None else memo
    key = (level, start, end)
    if key in memo:
        return memo[key]
    lv = cluster.levels[level]
    per_unit = cluster.devices_per_unit(level)
    ratio = options.activation_compression
    memory = options.memory_bytes
    best = math.inf
    for chain in chains(sets, start, end):
        bounds = [start, *chain]
        segments = list(zip(bounds, bounds[1:]))
        costs = []
        for before, after in segments:
            layers = after - before
            if level == 0:
                compute = sum(profile.layers[i].compute_s for i in layers)
            else:
                compute = brute_force(profile, cluster, options, level - 1, before, after, memo)
            params = sum(profile.layers[i].parameter_bytes for i in layers)
            stash = sum(profile.layers[i].activation_bytes for i in layers)
            cut_in = cut_bytes(profile, before) if before else 0.0
            cut_out = cut_bytes(profile, after) if after != full else 0.0
            costs.append((compute, params, stash, cut_in, cut_out))
        for reps, gaps in replica_choices(len(segments), lv.num_units, options.straight,
                                          options.allow_idle):
            worst, used = 0.0, 0
            for index, ((compute, params, stash, cut_in, cut_out), r) in enumerate(zip(costs, reps)):
                used += r + (gaps[index - 1] if index > 0 else 0)
                if memory is not None:
                    # a device holds weights, gradients, optimizer state, stashed versions and
                    # the activations in flight; PipeDream: 1 + ceil(later units / r)
                    # minibatches and one version less; flush schedules: a 1/r share, no version
                    later = lv.num_units - used
                    if options.schedule == "pipedream":
                        minibatches = 1 + math.ceil(later / r)
                        versions = minibatches - 1
                    else:
                        minibatches, versions = 1 / r, 0
                    weights = params * (2 + options.optimizer_state_factor + versions)
                    if (weights + minibatches * stash) / per_unit > memory:
                        worst = math.inf
                        break
                worst = max(worst, stage_time(profile, None, compute, params, r, lv.bandwidth_Bps,
                                              per_unit, ratio, index == 0, cut_in, cut_out))
            best = min(best, worst)
    memo[key] = best
    return best


# ---- the comparison --------------------------------------------------------------------


def cases(seed: int, count: int):
    rng = random.Random(seed)
    for _ in range(count):
        dag = rng.random() < 0.4
        two_level = rng.random() < 0.3
        num_layers = rng.randint(1, 5 if two_level else (7 if dag else 8))
        profile = random_profile(rng, num_layers, dag)
        if two_level:
            inner, outer = rng.randint(1, 3), rng.randint(1, 2)
            levels = (Level(num_units=inner, bandwidth_Bps=rng.choice([1e9, 1e11])),
                      Level(num_units=outer, bandwidth_Bps=rng.choice([1.25e8, 1.25e9])))
        else:
            levels = (Level(num_units=rng.randint(1, 6), bandwidth_Bps=rng.choice([1.25e8, 1.25e9, 1e10])),)
        options = PartitionOptions(
            activation_compression=rng.choice([None, 1.0, 4.0]),
            straight=rng.random() < 0.15,
            allow_idle=rng.random() < 0.3,
            memory_bytes=rng.choice([None, None, rng.uniform(1e8, 2e9)]),
            schedule=rng.choice(["pipedream", "pipedream", "1f1b", "gpipe"]),
            optimizer_state_factor=rng.choice([0.0, 1.0, 2.0]),
        )
        yield profile, Cluster(levels=levels), options


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("path", ["table", "fast"])
def test_bottleneck_equals_exhaustive_search(seed: int, path: str, monkeypatch) -> None:
    if path == "fast":
        monkeypatch.setattr(partition_module, "FAST_PATH_ELEMENTS", -1)
    for profile, cluster, options in cases(seed, 12):
        expected = brute_force(profile, cluster, options)
        try:
            got = partition(profile, cluster, options).bottleneck_s
        except ValueError:
            got = math.inf
        if math.isinf(expected):
            assert math.isinf(got), (profile, cluster, options)
        else:
            assert got == pytest.approx(expected, rel=1e-9), (profile, cluster, options)


def test_stage_times_reproduce_the_bottleneck() -> None:
    for profile, cluster, options in cases(99, 20):
        try:
            solved = partition(profile, cluster, options)
        except ValueError:
            continue
        assert max(s.time_s for s in solved.stages) == pytest.approx(solved.bottleneck_s, rel=1e-12)
        assert sum(s.replicas for s in solved.stages) <= cluster.num_devices
        if not options.allow_idle:
            assert sum(s.replicas for s in solved.stages) == cluster.num_devices


def test_fast_path_matches_table_on_larger_chains(monkeypatch) -> None:
    rng = random.Random(5)
    for _ in range(6):
        profile = random_profile(rng, rng.randint(10, 30), dag=False)
        cluster = Cluster(levels=(Level(num_units=rng.randint(8, 40), bandwidth_Bps=1.25e9),))
        options = PartitionOptions(activation_compression=rng.choice([None, 1.0]),
                                   allow_idle=rng.random() < 0.5)
        table = partition(profile, cluster, PartitionOptions(
            activation_compression=options.activation_compression,
            allow_idle=options.allow_idle, exact_dp=True)).bottleneck_s
        monkeypatch.setattr(partition_module, "FAST_PATH_ELEMENTS", -1)
        fast = partition(profile, cluster, options).bottleneck_s
        monkeypatch.undo()
        assert fast == pytest.approx(table, rel=1e-9)
