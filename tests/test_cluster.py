"""Cluster parsing: strict SI units, compact specs, YAML files and presets."""

from __future__ import annotations

import pytest

from tandem.cluster import PRESETS, flat_cluster, parse_bandwidth, parse_cluster, parse_size
from tandem.errors import UsageError

pytestmark = pytest.mark.pure


@pytest.mark.parametrize("text,expected", [
    ("10Gb/s", 1.25e9), ("10Gbps", 1.25e9), ("300GB/s", 3e11), ("1.5MB/s", 1.5e6),
    ("800B/s", 800.0), ("2KB/s", 2e3), ("100Mb/s", 1.25e7),
])  # fmt: skip
def test_bandwidth_units(text: str, expected: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["10", "10gb/s", "10GB", "10 Gibit/s", "0Gb/s", "-1GB/s", ""])
def test_bad_bandwidth_names_value_and_units(text: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_bandwidth(text)
    assert repr(text) in str(info.value)


def test_compact_spec_innermost_first() -> None:
    cluster = parse_cluster("8x300GB/s@2us,4x25Gb/s,memory=32GB,speed=2")
    assert [lv.num_units for lv in cluster.levels] == [8, 4]
    assert cluster.num_devices == 32 and cluster.devices_per_unit(1) == 8
    assert cluster.levels[0].latency_s == pytest.approx(2e-6)
    assert cluster.memory_bytes == 32e9 and cluster.speed == 2.0


def test_yaml_file(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("memory: 16GiB\nlevels:\n  - {devices: 4, bandwidth: 16GB/s}\n"
                    "  - {devices: 2, bandwidth: 10Gb/s, latency: 5us}\n")
    cluster = parse_cluster(str(path))
    assert cluster.num_devices == 8 and cluster.memory_bytes == parse_size("16GiB")


def test_presets_parse() -> None:
    for name in PRESETS:
        assert parse_cluster(name).num_devices >= 8


@pytest.mark.parametrize("spec", ["8x", "x10Gb/s", "8x10Gb/s,color=red", "0x10Gb/s"])
def test_bad_specs(spec: str) -> None:
    with pytest.raises(UsageError):
        parse_cluster(spec)


def test_flat_cluster_rejects_zero_devices() -> None:
    with pytest.raises(UsageError, match="at least 1"):
        flat_cluster(num_devices=0, bandwidth="10Gb/s")
