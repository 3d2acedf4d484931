"""Scalability analysis: clusters grown level by level, DP on VGG-16 flattening on 25 Gb/s,
what compression changes, and ``tandem scale`` end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.cluster import parse_cluster
from tandem.planning.scaling import ScaleOptions, device_counts, resized, scale
from tandem.planning.simulate import SimOptions
from tandem.profile import load_profile
from tests.conftest import PROFILES, VGG, run_cli

DATA = PROFILES
SERVERS = "8x300GB/s,128x25Gb/s"


def counts(spec: str, devices: int) -> list[int]:
    return [level.num_units for level in resized(parse_cluster(spec), devices).levels]


def test_clusters_grow_outermost_level_last() -> None:
    assert counts(SERVERS, 64) == [8, 8]
    assert counts(SERVERS, 4) == [4, 1]
    assert counts(SERVERS, 1) == [1, 1]
    assert counts("1024x25Gb/s", 16) == [16]
    assert counts("4x16GB/s,4x10Gb/s,8x1Gb/s", 32) == [4, 4, 2]  # 2 racks of 4 servers
    assert device_counts(1024) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    assert device_counts(48) == [1, 2, 4, 8, 16, 32, 48]


@pytest.fixture(scope="module")
def vgg_on_servers():  # type: ignore[no-untyped-def]
    """VGG-16, 8 of its minibatches per step, servers of 8 devices on 25 Gb/s, up to 128."""
    return scale(load_profile(VGG), parse_cluster(SERVERS),
                 ScaleOptions(max_devices=128, compressions=(2.0, 32.0)),
                 SimOptions(batch_scale=8))


def speedup(result, strategy: str, devices: int) -> float:  # type: ignore[no-untyped-def]
    return next(p.speedup for p in result.series(strategy) if p.num_devices == devices)


def test_data_parallelism_flattens_on_25_gbps(vgg_on_servers) -> None:  # type: ignore[no-untyped-def]
    result = vgg_on_servers
    # Inside one server (300 GB/s) data parallelism scales linearly...
    assert speedup(result, "dp", 8) == pytest.approx(8, rel=0.02)
    # ...across servers VGG-16's 553 MB of gradients take ~350 ms per step on 25 Gb/s, so the
    # speedup stops growing once compute per device falls below that: a few dozen devices.
    assert speedup(result, "dp", 128) < 1.1 * speedup(result, "dp", 32)
    assert 16 <= result.crossover["dp"] <= 64
    dp = {p.num_devices: p for p in result.simulated_series("dp")}  # on exactly that many
    assert dp[128].communication_s > 5 * dp[128].compute_s


def test_compression_moves_the_limit(vgg_on_servers) -> None:  # type: ignore[no-untyped-def]
    result = vgg_on_servers
    assert speedup(result, "dp+2x", 128) > 1.7 * speedup(result, "dp", 128)
    assert speedup(result, "dp+32x", 128) > 6 * speedup(result, "dp", 128)
    assert result.crossover["dp+32x"] is None or result.crossover["dp+32x"] > result.crossover["dp"]


def test_pipeline_and_hybrid_points(vgg_on_servers) -> None:  # type: ignore[no-untyped-def]
    result = vgg_on_servers
    assert [p.num_devices for p in result.series("pipeline")] == device_counts(128)
    assert result.simulated_series("pipeline")[-1].config.count("-") == 39  # a stage per layer
    hybrid = {p.num_devices: p.config for p in result.simulated_series("hybrid")}
    assert sum(int(r) for r in hybrid[64].split("-")) <= 64


run = run_cli


def test_cli_table_json_and_plot(capsys, tmp_path: Path) -> None:
    plot = tmp_path / "scale.png"
    code, out, err = run(capsys, "scale", "--profile", VGG, "--cluster", SERVERS,
                         "--max-devices", "32", "--profile-batch", "128", "--batch-size", "512",
                         "--json", "--plot", str(plot))
    assert code == 0, err
    data = json.loads(out)
    assert data["batch_samples"] == 512 and data["batch_scale"] == 4
    assert data["device_counts"] == [1, 2, 4, 8, 16, 32]
    assert {"dp", "dp+2x", "dp+32x", "pipeline", "hybrid", "ps", "gossip",
            "localsgd"} == {p["strategy"] for p in data["points"]}
    assert "communication overtakes compute" in err and "dp compute ms" in err
    assert plot.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(("argv", "words"), [
    (["--batch-size", "512"], "--profile-batch"),
    (["--compress", "two"], "--compress"),
    (["--max-devices", "0"], "--max-devices"),
    (["--batch-size", "8", "--minibatches", "2"], "not both"),
])
def test_cli_errors(capsys, argv: list[str], words: str) -> None:
    code, out, err = run(capsys, "scale", "--profile", VGG, "--cluster", SERVERS, "--plot",
                         "none", *argv)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert words in err
