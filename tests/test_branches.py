"""Branch compression: branchy profiles are planned with merged branches, on their real layers."""

from __future__ import annotations

import importlib.util
import json
import math
import random
from pathlib import Path

import pytest

from tandem.cluster import Cluster, Level, flat_cluster
from tandem.errors import UsageError
from tandem.planning import PartitionOptions, make_plan
from tandem.planning.partition.pipedream import partition
from tandem.planning.partition.antichain import MAX_STATES, build_states, count_states
from tandem.planning.partition.branches import (
    DEFAULT_MAX_STATES,
    compress_branches,
    compress_for_planning,
    expand_plan,
)
from tandem.planning.simulate.costs import check_plan
from tandem.planning.partition.downsets import count_down_sets, dag_of_profile
from tandem.plan import Plan
from tandem.planning.simulate.simulator import simulate
from tandem.profile import LayerProfile, ModelProfile, load_profile
from tests.conftest import run_cli

pytestmark = pytest.mark.pure

DATA = Path(__file__).parent / "data" / "profiles"
SHARED = Path(__file__).resolve().parents[2] / "shared" / "profiles"


def _exact_module():
    """tests/test_partition_exact.py: its exhaustive search and random profiles."""
    path = Path(__file__).parent / "test_partition_exact.py"
    spec = importlib.util.spec_from_file_location("exact", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


exact = _exact_module()


def layer(rng: random.Random, name: str) -> LayerProfile:
    return LayerProfile(name=name, forward_s=rng.uniform(1e-4, 3e-3),
                        backward_s=rng.uniform(2e-4, 6e-3), activation_bytes=rng.uniform(1e5, 4e6),
                        parameter_bytes=rng.choice([0.0, rng.uniform(1e4, 4e6)]))


def inception(modules: int, branches: int, length: int, seed: int = 0) -> ModelProfile:
    """A stem, then modules of ``branches`` parallel chains of ``length`` layers joined by a
    concatenation, the next module forking from it."""
    rng = random.Random(seed)
    layers = [layer(rng, "stem")]
    edges = []
    previous = 0
    for module in range(modules):
        ends = []
        for branch in range(branches):
            last = previous
            for position in range(length):
                layers.append(layer(rng, f"m{module}b{branch}l{position}"))
                edges.append((last, len(layers) - 1))
                last = len(layers) - 1
            ends.append(last)
        layers.append(layer(rng, f"concat{module}"))
        edges += [(end, len(layers) - 1) for end in ends]
        previous = len(layers) - 1
    layers.append(layer(rng, "head"))
    edges.append((previous, len(layers) - 1))
    return ModelProfile(layers=layers, edges=edges)


def covers_once(groups: list[list[int]], num_layers: int) -> bool:
    return sorted(i for group in groups for i in group) == list(range(num_layers))


def mask_of(layers) -> int:
    return sum(1 << i for i in layers)


# ---- the defect: a branchy profile is planned, with a report --------------------------------


def test_branchy_profile_is_compressed_automatically_and_reported() -> None:
    profile = inception(modules=6, branches=4, length=3)  # 4^4 = 256 states per module
    assert count_states(profile, 10_000) == 1 + 6 * 4**4 + 1
    compression = compress_for_planning(profile, max_states=200)
    assert compression.merged
    assert compression.states_before == 1 + 6 * 4**4 + 1
    assert compression.report is not None and "\n" not in compression.report
    counts = f"{compression.states_before:,} cut states -> {compression.states_after:,}"
    assert counts in compression.report
    assert build_states(compression.profile).num_states == compression.states_after <= 200
    assert covers_once(compression.groups, profile.num_layers)


def test_real_size_inception_is_planned() -> None:
    """925 layers, 25 modules of four 9-layer branches: 250,002 states, over the refusal limit.
    (Its time is measured by benchmarks/plan_speed.py, not asserted here.)"""
    profile = inception(modules=25, branches=4, length=9)
    assert count_states(profile, MAX_STATES + 1) > MAX_STATES  # build_states would refuse it
    cluster = flat_cluster(num_devices=16, bandwidth="10Gb/s")
    compression = compress_for_planning(profile)
    plan = compression.expand(make_plan(compression.profile, cluster))
    assert compression.states_before == 1 + 25 * 10**4 + 1
    assert compression.states_after <= DEFAULT_MAX_STATES
    assert plan.num_layers == profile.num_layers
    assert plan.options["branch_compression"] == compression.report
    check_plan(plan, profile, cluster)


def test_compress_branches_returns_profile_and_groups() -> None:
    profile = inception(modules=3, branches=3, length=4)
    compressed, groups = compress_branches(profile, max_states=30)
    assert len(groups) == compressed.num_layers
    assert covers_once(groups, profile.num_layers)
    assert build_states(compressed).num_states <= 30


# ---- what merging keeps ------------------------------------------------------------------


@pytest.mark.parametrize("shape, limit", [((6, 4, 3), 200), ((4, 3, 5), 40), ((3, 4, 2), 8)])
def test_merged_profile_keeps_totals(shape, limit) -> None:
    profile = inception(*shape, seed=sum(shape))
    compressed, groups = compress_branches(profile, max_states=limit)
    for key in ("forward_s", "backward_s", "parameter_bytes", "activation_bytes"):
        assert sum(getattr(x, key) for x in compressed.layers) == pytest.approx(
            sum(getattr(x, key) for x in profile.layers), rel=1e-12)
    for group, merged in zip(groups, compressed.layers):
        if group:  # a merged layer is its members' compute and parameters
            members = [profile.layers[i] for i in group]
            assert merged.compute_s == pytest.approx(sum(x.compute_s for x in members))
            assert merged.parameter_bytes == pytest.approx(sum(x.parameter_bytes for x in members))
        else:  # a stash carrier costs nothing
            assert merged.compute_s == 0 and merged.parameter_bytes == 0


def random_branchy(rng: random.Random) -> ModelProfile:
    """Modules of 2-3 branches of 1-3 layers, with random extra edges: across branches, into a
    branch from an earlier module, and out of a module to a later layer."""
    layers = [layer(rng, "stem")]
    edges: list[tuple[int, int]] = []
    previous, earlier = 0, []
    for module in range(rng.randint(1, 3)):
        ends, inside = [], []
        for branch in range(rng.randint(2, 3)):
            last = previous
            for position in range(rng.randint(1, 3)):
                layers.append(layer(rng, f"m{module}b{branch}l{position}"))
                edges.append((last, len(layers) - 1))
                last = len(layers) - 1
                inside.append(last)
            ends.append(last)
        layers.append(layer(rng, f"join{module}"))
        edges += [(end, len(layers) - 1) for end in ends]
        for _ in range(rng.randint(0, 2)):
            a, b = sorted(rng.sample([*earlier, *inside, previous], 2))
            edges.append((a, b))
        if earlier and rng.random() < 0.3:
            edges.append((rng.choice(earlier), rng.choice(inside)))
        earlier += inside
        previous = len(layers) - 1
    if rng.random() < 0.5:
        layers.append(layer(rng, "head"))
        edges.append((previous, len(layers) - 1))
        if rng.random() < 0.3:
            edges.append((rng.choice(earlier), len(layers) - 1))
    return ModelProfile(layers=layers, edges=sorted(set(edges)))


def branchy_profiles() -> list[tuple[ModelProfile, int]]:
    cases = [(inception(3, 3, 2, seed=1), 12), (inception(2, 4, 3, seed=2), 40),
             (inception(4, 2, 4, seed=3), 15),
             (load_profile(str(DATA / "resnet50.graph.txt")), 150),  # 240 states
             (load_profile(str(DATA / "gnmt.graph.txt")), 70)]  # 99 states, three inputs
    rng = random.Random(11)
    for _ in range(20):
        profile = random_branchy(rng)
        cases.append((profile, max(2, build_states(profile).num_states // 3)))
    return cases


def test_most_cases_merge() -> None:
    merged = [compress_for_planning(p, limit).merged for p, limit in branchy_profiles()]
    assert all(merged[:5]) and sum(merged[5:]) >= 10


@pytest.mark.parametrize("index", range(25))
def test_states_are_the_original_states_that_cut_no_group(index: int) -> None:
    """Every state of the merged profile is an original state that keeps each group whole, and
    every such original state is one, with the same compute, parameters, stash and boundary
    bytes: planning the merged profile is planning the original over fewer boundaries."""
    profile, limit = branchy_profiles()[index]
    compressed, groups = compress_branches(profile, max_states=limit)
    original = build_states(profile)
    merged = build_states(compressed)
    whole = [mask_of(group) for group in groups if len(group) > 1]
    keep = {mask: k for k, mask in enumerate(original.masks)
            if all(mask & g in (0, g) for g in whole)}  # fmt: skip
    mapped = [mask_of(i for c in range(compressed.num_layers) if m >> c & 1 for i in groups[c])
              for m in merged.masks]  # fmt: skip
    assert sorted(mapped) == sorted(keep)
    for j, mask in enumerate(mapped):
        k = keep[mask]
        for field in ("compute_s", "parameter_bytes", "activation_bytes", "cut_bytes"):
            expected = getattr(original, field)[k]
            assert getattr(merged, field)[j] == pytest.approx(expected, rel=1e-9, abs=1e-9), field
    if merged.num_states > 1 or original.num_states > 1:
        assert merged.num_states <= max(limit, 1) or compressed is profile


# ---- plans on the original layers ------------------------------------------------------------


@pytest.mark.parametrize("devices, straight", [(4, False), (8, True), (16, False)])
def test_expanded_plan_covers_every_layer_once_in_order(devices: int, straight: bool) -> None:
    profile = inception(5, 4, 3, seed=devices)
    compression = compress_for_planning(profile, max_states=150)
    cluster = flat_cluster(num_devices=devices, bandwidth="10Gb/s")
    solved = make_plan(compression.profile, cluster, PartitionOptions(straight=straight))
    plan = compression.expand(solved)
    check_plan(plan, profile, cluster)  # a permutation, in a topological order
    assert sorted(plan.layers()) == list(range(profile.num_layers))
    assert plan.config == solved.config and plan.bottleneck_s == solved.bottleneck_s
    for index, stage in enumerate(plan.stages):
        layers = [profile.layers[i] for i in plan.stage_layers(index)]
        assert stage.compute_s == pytest.approx(sum(x.compute_s for x in layers))
        assert stage.parameter_bytes == pytest.approx(sum(x.parameter_bytes for x in layers))


def test_simulator_runs_the_expanded_plan_on_the_real_layers() -> None:
    from tandem.planning.simulate.simulator import simulate

    profile = inception(6, 4, 3, seed=4)
    compression = compress_for_planning(profile, max_states=100)
    cluster = flat_cluster(num_devices=4, bandwidth="10Gb/s")
    plan = compression.expand(make_plan(compression.profile, cluster))
    result = simulate(plan, profile, cluster)
    assert result.compute_s > 0 and result.config == plan.config


def test_expand_plan_refuses_groups_of_another_profile() -> None:
    profile = inception(3, 3, 3)
    compressed, groups = compress_branches(profile, max_states=10)
    plan = make_plan(compressed, flat_cluster(num_devices=2, bandwidth="10Gb/s"))
    with pytest.raises(UsageError, match="expand a plan made for the compressed profile"):
        expand_plan(plan, groups[:-1], profile)


# ---- few states: nothing changes -----------------------------------------------------------


def few_state_profiles():
    for name in ("resnet50", "gnmt", "vgg16"):
        yield name, load_profile(str(DATA / f"{name}.graph.txt"))
    rng = random.Random(3)
    yield "chain", ModelProfile(layers=[layer(rng, f"l{i}") for i in range(1_500)])


@pytest.mark.parametrize("name", ["resnet50", "gnmt", "vgg16", "chain"])
def test_few_states_nothing_is_merged_and_the_plan_is_identical(name: str) -> None:
    profile = dict(few_state_profiles())[name]
    compression = compress_for_planning(profile)
    assert compression.profile is profile and compression.report is None
    assert compression.groups == [[i] for i in range(profile.num_layers)]
    if name == "chain":
        return
    cluster = flat_cluster(num_devices=16, bandwidth="10Gb/s")
    plan = make_plan(profile, cluster)
    again = compression.expand(make_plan(compression.profile, cluster))
    plain, through = plan.to_dict(), again.to_dict()
    plain.pop("solve_s"), through.pop("solve_s")
    assert through == plain


def test_shared_profiles_are_the_tested_ones() -> None:
    for name in ("resnet50", "gnmt", "vgg16"):
        if (SHARED / f"{name}.graph.txt").exists():
            shared = load_profile(str(SHARED / f"{name}.graph.txt"))
            assert compress_for_planning(shared).report is None


# ---- plan quality against exhaustive search --------------------------------------------------


def small_branchy(rng: random.Random) -> ModelProfile:
    """Stem, two or three 1-2 layer branches, concatenation, maybe a head: at most 7 layers."""
    lengths = [rng.randint(1, 2) for _ in range(rng.choice([2, 3]))]
    while sum(lengths) > 5:
        lengths.pop()
    layers = [layer(rng, "stem")]
    edges, ends = [], []
    for b, length in enumerate(lengths):
        last = 0
        for position in range(length):
            layers.append(layer(rng, f"b{b}l{position}"))
            edges.append((last, len(layers) - 1))
            last = len(layers) - 1
        ends.append(last)
    layers.append(layer(rng, "concat"))
    edges += [(end, len(layers) - 1) for end in ends]
    if len(layers) < 7 and rng.random() < 0.5:
        layers.append(layer(rng, "head"))
        edges.append((len(layers) - 2, len(layers) - 1))
    return ModelProfile(layers=layers, edges=edges)


def quality_cases(seed: int, count: int):
    rng = random.Random(seed)
    for _ in range(count):
        profile = small_branchy(rng)
        if rng.random() < 0.3:
            levels = (Level(num_units=rng.randint(1, 2), bandwidth_Bps=1e10),
                      Level(num_units=2, bandwidth_Bps=1.25e9))  # fmt: skip
        else:
            bandwidth = rng.choice([1.25e8, 1.25e9])
            levels = (Level(num_units=rng.randint(2, 5), bandwidth_Bps=bandwidth),)
        options = PartitionOptions(activation_compression=rng.choice([None, 1.0]),
                                   allow_idle=rng.random() < 0.3,
                                   memory_bytes=rng.choice([None, None, rng.uniform(5e6, 4e7)]))
        yield profile, Cluster(levels=levels), options, rng.randint(2, 4)


def restricted(profile: ModelProfile, groups: list[list[int]]):
    """The exhaustive search's down-sets, less those cutting a merged group."""
    whole = [frozenset(g) for g in groups if len(g) > 1]
    every = exact.down_sets

    def down_sets(p: ModelProfile):
        return [s for s in every(p) if all(g <= s or not g & s for g in whole)]

    return down_sets


@pytest.mark.parametrize("seed", range(4))
def test_merged_plan_is_the_best_plan_that_cuts_no_group(seed: int, monkeypatch) -> None:
    """Exhaustive search: the merged profile's optimum is never better than the original's, and
    equals the best original plan among those that keep every group whole."""
    merged_any = 0
    for profile, cluster, options, limit in quality_cases(seed, 6):
        compressed, groups = compress_branches(profile, max_states=limit)
        merged_any += compressed is not profile
        unrestricted = exact.brute_force(profile, cluster, options)
        with monkeypatch.context() as patch:
            patch.setattr(exact, "down_sets", restricted(profile, groups))
            best_whole = exact.brute_force(profile, cluster, options)
        try:
            got = partition(compressed, cluster, options).bottleneck_s
        except UsageError:
            got = math.inf
        assert best_whole >= unrestricted
        if math.isinf(best_whole):
            assert math.isinf(got)
        else:
            assert got == pytest.approx(best_whole, rel=1e-9)
            assert got >= unrestricted * (1 - 1e-12)
    assert merged_any


def test_same_optimum_when_the_best_plan_cuts_no_branch() -> None:
    """Heavy concatenations and cheap branches: the best 3-stage plans cut at concatenations,
    so merging the branches loses nothing."""
    profile = inception(3, 3, 2, seed=7)
    heavy = [x if not x.name.startswith(("concat", "stem")) else LayerProfile(
        name=x.name, forward_s=0.05, backward_s=0.1, activation_bytes=1e3, parameter_bytes=0.0)
        for x in profile.layers]  # fmt: skip
    profile = ModelProfile(layers=heavy, edges=profile.edges)
    compressed, _ = compress_branches(profile, max_states=8)
    cluster = flat_cluster(num_devices=3, bandwidth="10Gb/s")
    options = PartitionOptions(straight=True)
    assert compressed is not profile
    assert partition(compressed, cluster, options).bottleneck_s == pytest.approx(
        partition(profile, cluster, options).bottleneck_s, rel=1e-12)


# ---- counting --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_down_set_count_equals_enumeration(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(15):
        profile = exact.random_profile(rng, rng.randint(1, 12), dag=rng.random() < 0.8)
        enumerated = len(exact.down_sets(profile)) + 1  # the empty set too
        dag = dag_of_profile(profile)
        assert count_down_sets(dag, dag.everything) == enumerated


def test_count_states_stops_at_the_cap() -> None:
    profile = inception(4, 4, 4)
    assert count_states(profile, 10**6) == 1 + 4 * 5**4 + 1
    assert count_states(profile, 100) == 100


def test_limit_must_be_positive() -> None:
    with pytest.raises(UsageError, match="max_states must be at least 1"):
        compress_for_planning(inception(1, 2, 1), max_states=0)


def test_every_group_is_in_topological_order() -> None:
    profile = inception(4, 3, 4, seed=9)
    _, groups = compress_branches(profile, max_states=20)
    position = {i: k for group in groups for k, i in enumerate(group)}
    for producer, consumer in profile.edge_list():
        same = [g for g in groups if producer in g and consumer in g]
        if same:
            assert position[producer] < position[consumer]
    assert any(len(g) > 1 for g in groups)


def test_the_planner_compresses_a_branchy_profile_by_itself(capsys, tmp_path) -> None:
    """``tandem plan`` on an Inception-style profile of hundreds of nodes: planned, reported,
    and the plan runs the profile's own layers (the simulator checks it against them)."""
    profile = inception(modules=25, branches=4, length=9)
    path = tmp_path / "inception.json"
    profile.save(str(path))
    code, out, err = run_cli(capsys, "plan", "--profile", str(path), "--devices", "8",
                             "--bandwidth", "10Gb/s", "--json")
    assert code == 0, err
    assert "merged" in err and "cut states" in err
    plan = Plan.from_dict(json.loads(out))
    assert sorted(plan.layers()) == list(range(profile.num_layers))
    cluster = flat_cluster(num_devices=8, bandwidth="10Gb/s")
    check_plan(plan, profile, cluster)
    assert simulate(plan, profile, cluster).step_time_s == pytest.approx(plan.bottleneck_s)
