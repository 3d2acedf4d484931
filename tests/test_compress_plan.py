"""The planner's gradient compression ratio: allreduce time divided by it, nothing else."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from tandem.cli import main
from tandem.cluster import Cluster, parse_cluster
from tandem.planning import PartitionOptions
from tandem.planning.partition.pipedream import partition
from tandem.profile import load_profile

pytestmark = pytest.mark.pure

VGG = str(Path(__file__).parent / "data" / "profiles" / "vgg16.graph.txt")


def faster_links(cluster: Cluster, factor: float) -> Cluster:
    levels = tuple(dataclasses.replace(level, bandwidth_Bps=level.bandwidth_Bps * factor)
                   for level in cluster.levels)
    return dataclasses.replace(cluster, levels=levels)


@pytest.mark.parametrize(("spec", "ratio"), [("16x10Gb/s", 32.0), ("4x16GB/s,4x10Gb/s", 2.0),
                                             ("1024x10Gb/s", 32.0)])
def test_compressing_gradients_r_times_is_like_r_times_faster_links(spec: str,
                                                                     ratio: float) -> None:
    """With activations not costed, only allreduces use the links. 1,024 devices take the
    parametric fast path; the others the bounded search."""
    profile = load_profile(VGG)
    cluster = parse_cluster(spec)
    compressed = partition(profile, cluster, PartitionOptions(
        activation_compression=None, gradient_compression=ratio))
    fast = partition(profile, faster_links(cluster, ratio),
                     PartitionOptions(activation_compression=None))
    assert math.isclose(compressed.bottleneck_s, fast.bottleneck_s, rel_tol=1e-9)
    assert math.isclose(compressed.data_parallel_s, fast.data_parallel_s, rel_tol=1e-9)
    plain = partition(profile, cluster, PartitionOptions(activation_compression=None))
    assert compressed.bottleneck_s <= plain.bottleneck_s
    assert compressed.data_parallel_s < plain.data_parallel_s


def test_plan_command_takes_a_gradient_compression_ratio(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--profile", VGG, "--devices", "16", "--bandwidth", "10Gb/s", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*args, "--gradient-compression", "32"]) == 0
    compressed = json.loads(capsys.readouterr().out)
    assert compressed["options"]["gradient_compression"] == 32.0
    assert compressed["bottleneck_s"] <= plain["bottleneck_s"]
    assert compressed["data_parallel_s"] < plain["data_parallel_s"]


@pytest.mark.parametrize("value", ["0", "-2", "inf"])
def test_bad_gradient_compression_is_one_line(capsys: pytest.CaptureFixture[str],
                                              value: str) -> None:
    assert main(["plan", "--profile", VGG, "--devices", "4", "--bandwidth", "10Gb/s",
                 "--gradient-compression", value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--gradient-compression must be a positive number" in err
