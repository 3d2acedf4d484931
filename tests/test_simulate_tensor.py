"""Tensor parallelism and recomputation on the planning side: the simulator against closed
forms written here, the search's choice of tensor degree and recomputation, the 3d scale curve,
plan files and one-line errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tandem.cluster import flat_cluster, parse_cluster
from tandem.errors import UsageError
from tandem.plan import Plan, Stage
from tandem.planning.partition.memory import stage_memory_bytes
from tandem.planning.search.scaling import ScaleOptions, scale
from tandem.planning.search.flexflow import SearchOptions, search
from tandem.planning.simulate.simulator import SimOptions, simulate
from tandem.profile import LayerProfile, ModelProfile
from tests.conftest import run_cli

pytestmark = pytest.mark.pure

GB = 1e9


def ring(n: int, num_bytes: float, latency_s: float, bandwidth_Bps: float) -> float:
    """Ring allreduce, written out: 2 (n - 1) steps of S / n bytes."""
    return 2 * (n - 1) * (latency_s + num_bytes / (n * bandwidth_Bps))


def layer(name: str, f: float, b: float, act: float, params: float, ff: float = 0.0,
          bf: float = 0.0) -> LayerProfile:
    return LayerProfile(name=name, forward_s=f, backward_s=b, activation_bytes=act,
                        parameter_bytes=params, forward_fixed_s=ff, backward_fixed_s=bf)


# Two layers with parameters (split) around one without (run whole on every tensor device).
LAYERS = [layer("attn", 0.008, 0.016, 3e6, 40e6, ff=0.001, bf=0.002),
          layer("gelu", 0.002, 0.004, 5e6, 0.0, ff=0.0005, bf=0.0005),
          layer("mlp", 0.012, 0.024, 2e6, 80e6, ff=0.001, bf=0.001)]
PROFILE = ModelProfile(layers=LAYERS, batch_size=64)


def call(total: float, fixed: float, share: float, degree: int = 1) -> float:
    """One call on ``share`` of the minibatch: the fixed cost whole, the rest shared T ways."""
    return fixed + (total - fixed) * share / degree


def gpipe(replicas: list[int], ends: list[int], num_devices: int, microbatches: int,
          degree: int = 1, recompute: bool = False) -> Plan:
    starts = [0, *ends[:-1]]
    stages = [Stage(start=s, end=e, replicas=r) for s, e, r in zip(starts, ends, replicas)]
    return Plan(stages=stages,
                num_layers=ends[-1], num_devices=num_devices, schedule="gpipe",
                num_microbatches=microbatches, tensor_degree=degree, recompute=recompute)


@pytest.mark.parametrize("degree", [1, 2, 4])
def test_tensor_step_and_memory_closed_form(degree: int) -> None:
    """One stage on one group of T devices, GPipe with M micro-batches: each forward and backward
    takes the split layers' time over T, the other layer's whole, and one ring allreduce of each
    split layer's output; weights, gradients and momentum of split layers divide by T."""
    bandwidth, latency, m = 2e9, 5e-6, 4
    cluster = parse_cluster("4x16Gb/s@5us")
    options = SimOptions(allreduce="ring", optimizer_state_factor=1.0)
    result = simulate(gpipe([1], [3], 4, m, degree), PROFILE, cluster, options)
    share = 1 / m
    split = [l for l in LAYERS if l.parameter_bytes > 0]
    reduce = sum(ring(degree, l.activation_bytes * share, latency, bandwidth) for l in split) \
        if degree > 1 else 0.0
    forward = sum(call(l.forward_s, l.forward_fixed_s, share, degree if l.parameter_bytes else 1)
                  for l in LAYERS) + reduce
    backward = sum(call(l.backward_s, l.backward_fixed_s, share, degree if l.parameter_bytes else 1)
                   for l in LAYERS) + reduce
    assert result.step_time_s == pytest.approx(m * (forward + backward), rel=1e-12)
    assert result.communication_s == pytest.approx(2 * m * reduce, rel=1e-12)
    weights = sum(l.parameter_bytes for l in split) / degree
    held = sum(l.activation_bytes for l in LAYERS)  # GPipe holds all M micro-batches, whole
    assert result.peak_memory_bytes == pytest.approx(3 * weights + held, rel=1e-12)
    assert result.tensor_degree == degree and result.workers[0].device == 0


def test_replicated_tensor_groups_on_two_levels() -> None:
    """Two replicas of a 2-device tensor group, one per server: tensor allreduces on the server's
    link, the gradient allreduce across servers, where the two devices of a group share the port
    and so move both shards: one ring of 2 x (split / 2 + whole) bytes."""
    (b0, a0), (b1, a1) = (300e9, 2e-6), (25e9 / 8, 30e-6)
    cluster = parse_cluster("2x300GB/s@2us,2x25Gb/s@30us")
    result = simulate(gpipe([2], [3], 4, 2, degree=2), PROFILE, cluster,
                      SimOptions(allreduce="ring"))
    share = 1 / 2
    split = [l for l in LAYERS if l.parameter_bytes > 0]
    reduce = sum(ring(2, l.activation_bytes * share, a0, b0) for l in split)
    forward = sum(call(l.forward_s, l.forward_fixed_s, share, 2 if l.parameter_bytes else 1)
                  for l in LAYERS) + reduce
    backward = sum(call(l.backward_s, l.backward_fixed_s, share, 2 if l.parameter_bytes else 1)
                   for l in LAYERS) + reduce
    shard = sum(l.parameter_bytes for l in split) / 2  # the gelu layer has no parameters
    gradients = ring(2, 2 * shard, a1, b1)
    assert [w.device for w in result.workers] == [0, 2]
    assert result.step_time_s == pytest.approx(forward + backward + gradients, rel=1e-12)


def test_recompute_one_stage_closed_form() -> None:
    """Recomputation on one stage: every backward runs the forward again; the stage holds only
    one micro-batch's activations (its input, the data, is not counted either way)."""
    cluster = flat_cluster(num_devices=1, bandwidth="10Gb/s")
    m = 4
    plain = simulate(gpipe([1], [3], 1, m), PROFILE, cluster)
    redo = simulate(gpipe([1], [3], 1, m, recompute=True), PROFILE, cluster)
    forward = sum(call(l.forward_s, l.forward_fixed_s, 1 / m) for l in LAYERS)
    backward = sum(call(l.backward_s, l.backward_fixed_s, 1 / m) for l in LAYERS)
    assert plain.step_time_s == pytest.approx(m * (forward + backward), rel=1e-12)
    assert redo.step_time_s == pytest.approx(m * (2 * forward + backward), rel=1e-12)
    activations = sum(l.activation_bytes for l in LAYERS)
    assert plain.workers[0].activation_bytes == pytest.approx(activations)
    assert redo.workers[0].activation_bytes == pytest.approx(activations / m)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_recompute_in_a_pipeline(schedule: str) -> None:
    """A 2-stage pipeline with recomputation takes exactly as long as one without it on a profile
    whose backwards include their forward; stage 1 holds the input it received per micro-batch in
    flight plus one micro-batch's activations (the memory model's closed form agrees)."""
    cluster = flat_cluster(num_devices=2, bandwidth="10Gb/s")
    m = 4
    plan = dataclasses.replace(gpipe([1, 1], [2, 3], 2, m, recompute=True), schedule=schedule)
    redo = simulate(plan, PROFILE, cluster)
    longer = ModelProfile(layers=[dataclasses.replace(
        l, backward_s=l.backward_s + l.forward_s,
        backward_fixed_s=l.backward_fixed_s + l.forward_fixed_s) for l in LAYERS])
    reference = simulate(dataclasses.replace(plan, recompute=False), longer, cluster)
    assert redo.step_time_s == pytest.approx(reference.step_time_s, rel=1e-12)
    in_flight = m if schedule == "gpipe" else 1  # the last stage of 1F1B holds one
    received = LAYERS[1].activation_bytes  # the output of stage 0's last layer
    assert redo.workers[1].activation_bytes == pytest.approx(
        in_flight * received / m + LAYERS[2].activation_bytes / m)
    assert redo.workers[0].activation_bytes == pytest.approx(
        (LAYERS[0].activation_bytes + LAYERS[1].activation_bytes) / m)
    if schedule == "gpipe":
        closed = stage_memory_bytes("gpipe", parameter_bytes=LAYERS[2].parameter_bytes,
                                    activation_bytes=LAYERS[2].activation_bytes, replicas=1,
                                    downstream=0, num_microbatches=m,
                                    recompute_input_bytes=received)
        assert redo.workers[1].peak_memory_bytes == pytest.approx(closed)


# --- the search ------------------------------------------------------------------------------

BIG = ModelProfile(layers=[layer(f"block{i}", 0.010, 0.020, 0.5 * GB, 8 * GB) for i in range(4)],
                   batch_size=64)
"""Four transformer-like blocks of 8 GB of parameters each: with gradients and momentum one
block needs 24 GB on a device."""


def test_search_splits_layers_that_do_not_fit_one_device() -> None:
    cluster = dataclasses.replace(flat_cluster(num_devices=8, bandwidth="10GB/s"),
                                  memory_bytes=16 * GB)
    assert 3 * BIG.layers[0].parameter_bytes > cluster.memory_bytes  # no T = 1 plan fits
    found = search(BIG, cluster, SearchOptions(max_iterations=200, seed=0))
    assert found.best.plan.tensor_degree > 1 and found.best.result.fits_memory
    assert found.data_parallel is not None and not found.data_parallel.result.fits_memory


def test_search_keeps_whole_layers_with_ample_memory() -> None:
    """Each split block's allreduces (0.5 GB per minibatch, twice, at 10 GB/s) cost more than
    the 15 ms of compute that splitting it in two saves."""
    cluster = flat_cluster(num_devices=8, bandwidth="10GB/s")
    found = search(BIG, cluster, SearchOptions(max_iterations=200, seed=0))
    assert found.best.plan.tensor_degree == 1


def test_search_recomputes_when_activations_do_not_fit() -> None:
    """Two devices, GPipe only: a stage holds all M micro-batches' activations (10 GB) unless
    they are recomputed, then its input and one micro-batch's (``tandem train`` recomputes in
    pipelines of 2 stages or more only)."""
    heavy = ModelProfile(layers=[layer(f"l{i}", 0.01, 0.02, (10 if i % 2 == 0 else 0.01) * GB,
                                       1 * GB) for i in range(4)])
    cluster = dataclasses.replace(flat_cluster(num_devices=2, bandwidth="10GB/s"),
                                  memory_bytes=8 * GB)
    found = search(heavy, cluster, SearchOptions(max_iterations=100, seed=0,
                                                 schedules=("gpipe",), max_microbatches=8))
    assert found.best.plan.recompute and found.best.result.fits_memory
    with pytest.raises(UsageError, match="no plan fits"):
        search(heavy, cluster, SearchOptions(max_iterations=100, seed=0, schedules=("gpipe",),
                                             max_microbatches=8, recompute=False))


# --- the 3d scale curve ------------------------------------------------------------------------

def test_3d_curve_is_monotone_and_not_below_hybrid() -> None:
    profile = ModelProfile(layers=[layer(f"b{i}", 0.01, 0.02, 0.05 * GB, 2 * GB)
                                   for i in range(6)], batch_size=64)
    result = scale(profile, parse_cluster("8x300GB/s,4x25Gb/s"),
                   ScaleOptions(max_devices=32, families=(), compressions=()))
    three_d = [p.speedup for p in result.series("3d")]
    hybrid = [p.speedup for p in result.series("hybrid")]
    assert three_d == sorted(three_d) and len(three_d) == len(hybrid) == 6
    assert all(t >= h * (1 - 1e-12) for t, h in zip(three_d, hybrid))
    assert any("tensor" in p.config for p in result.series("3d"))  # splitting pays here


# --- plan files and the command line -----------------------------------------------------------

def test_plan_files_keep_recompute_and_old_ones_load(tmp_path: Path) -> None:
    plan = gpipe([1], [3], 2, 2, degree=2, recompute=True)
    path = tmp_path / "plan.json"
    plan.save(str(path))
    assert Plan.load(str(path)).recompute and Plan.load(str(path)).tensor_degree == 2
    data = json.loads(path.read_text())
    del data["recompute"]
    assert Plan.from_dict(data).recompute is False
    with pytest.raises(UsageError, match="recompute"):
        Plan.from_dict({**data, "recompute": "yes"})


def profile_file(tmp_path: Path) -> str:
    path = tmp_path / "profile.json"
    PROFILE.save(str(path))
    return str(path)


def test_cli_simulates_a_tensor_parallel_plan(capsys,  # type: ignore[no-untyped-def]
                                              tmp_path: Path) -> None:
    code, out, err = run_cli(capsys, "simulate", "--plan", "dp", "--profile",
                             profile_file(tmp_path), "--devices", "8", "--bandwidth", "100GB/s",
                             "--tensor-parallel", "4", "--recompute", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert (data["config"], data["tensor_degree"], data["recompute"]) == ("2", 4, True)
    assert [w["device"] for w in data["workers"]] == [0, 4]
    assert "x tensor 4" in err and "recompute" in err


@pytest.mark.parametrize("argv, words", [
    (["--plan", "dp", "--tensor-parallel", "3"],
     "--tensor-parallel 3 does not divide the 8 devices"),
    (["--plan", "dp", "--tensor-parallel", "0"], "--tensor-parallel must be at least 1"),
    (["--plan", "ps", "--tensor-parallel", "2"], "not to sync method 'ps'"),
    (["--plan", "gossip", "--recompute"], "recomputation is simulated for allreduce plans"),
])
def test_cli_bad_input_is_one_line(capsys, tmp_path: Path,  # type: ignore[no-untyped-def]
                                   argv: list[str], words: str) -> None:
    code, out, err = run_cli(capsys, "simulate", "--profile", profile_file(tmp_path),
                             "--devices", "8", "--bandwidth", "100GB/s", *argv)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert words in err


def test_cli_plan_file_too_wide_for_its_degree(capsys,  # type: ignore[no-untyped-def]
                                               tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    gpipe([2, 1], [2, 3], 4, 2).save(str(path))
    code, out, err = run_cli(capsys, "simulate", "--plan", str(path), "--profile",
                             profile_file(tmp_path), "--devices", "4", "--bandwidth", "10Gb/s",
                             "--tensor-parallel", "2")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "needs 6 devices but the cluster has 4" in err


def test_recorded_allreduces_and_whole_layers_closed_form() -> None:
    """A profile that records its tensor plan (``tensor_allreduces``, as ``tandem profile``
    writes for gpt): a block with two column/row pairs pays two allreduces each way, and a layer
    with parameters recorded ``(0, 0)`` (an embedding, the vocabulary projection) runs whole on
    every device, its parameters undivided. One stage, one micro-batch, T = 2."""
    latency, bandwidth, degree = 5e-6, 2e9, 2
    embed = dataclasses.replace(LAYERS[0], name="embed", tensor_allreduces=(0, 0))
    block = dataclasses.replace(LAYERS[2], name="block", tensor_allreduces=(2, 2))
    profile = ModelProfile(layers=[embed, LAYERS[1], block], batch_size=64)
    result = simulate(gpipe([1], [3], 2, 1, degree), profile, parse_cluster("2x16Gb/s@5us"),
                      SimOptions(allreduce="ring", optimizer_state_factor=1.0))
    reduce = 2 * ring(degree, block.activation_bytes, latency, bandwidth)
    forward = (embed.forward_s + LAYERS[1].forward_s
               + call(block.forward_s, block.forward_fixed_s, 1, degree) + reduce)
    backward = (embed.backward_s + LAYERS[1].backward_s
                + call(block.backward_s, block.backward_fixed_s, 1, degree) + reduce)
    assert result.step_time_s == pytest.approx(forward + backward, rel=1e-12)
    assert result.communication_s == pytest.approx(2 * reduce, rel=1e-12)
    weights = embed.parameter_bytes + block.parameter_bytes / degree
    held = sum(l.activation_bytes for l in profile.layers)
    assert result.peak_memory_bytes == pytest.approx(3 * weights + held, rel=1e-12)


def test_tensor_allreduces_round_trip_and_bad_values(tmp_path: Path) -> None:
    """The recorded counts survive JSON; anything but two whole numbers >= 0 is one error."""
    block = dataclasses.replace(LAYERS[2], tensor_allreduces=(2, 2))
    path = tmp_path / "p.json"
    ModelProfile(layers=[LAYERS[0], block], batch_size=64).save(str(path))
    loaded = ModelProfile.load(str(path))
    assert [l.tensor_allreduces for l in loaded.layers] == [None, (2, 2)]
    with pytest.raises(UsageError, match="two whole numbers"):
        dataclasses.replace(LAYERS[2], tensor_allreduces=(1, -1))
    data = json.loads(path.read_text())
    data["layers"][1]["tensor_allreduces"] = 2
    path.write_text(json.dumps(data))
    with pytest.raises(UsageError, match="list of two"):
        ModelProfile.load(str(path))


def test_gpt_plan_counts_two_allreduces_per_block_each_way() -> None:
    """The gpt plan's pairs per block (attention, MLP): two forward allreduces (after the
    row-wise layers) and two backward (before the column-wise ones); embedding and head none."""
    from tandem.data.info import DataInfo
    from tandem.models.gpt import GPTOptions, build_gpt
    from tandem.models.tensor import block_allreduces, tensor_plan

    model = build_gpt(GPTOptions(layers=2, dim=16, heads=2),
                      DataInfo(task="lm", input_shape=(8,), num_classes=11))
    counts = block_allreduces(tensor_plan("gpt", model, 2), len(model))
    assert counts == [(0, 0), (2, 2), (2, 2), (0, 0)]


def test_tensor_overhead_is_charged_per_tensor_allreduce() -> None:
    """``tensor_overhead_s`` adds to the compute once per tensor allreduce: the block's two each
    way, none for the whole embedding, and nothing at T = 1."""
    embed = dataclasses.replace(LAYERS[0], tensor_allreduces=(0, 0))
    block = dataclasses.replace(LAYERS[2], tensor_allreduces=(2, 2))
    profile = ModelProfile(layers=[embed, LAYERS[1], block], batch_size=64)
    cluster = parse_cluster("2x16Gb/s@5us")

    def step(degree: int, overhead: float) -> float:
        options = SimOptions(allreduce="ring", tensor_overhead_s=overhead)
        return simulate(gpipe([1], [3], 2, 1, degree), profile, cluster, options).step_time_s

    assert step(2, 0.003) - step(2, 0.0) == pytest.approx(4 * 0.003, rel=1e-9)
    assert step(1, 0.003) == step(1, 0.0)
