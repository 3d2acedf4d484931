"""Clusters: devices grouped in hierarchy levels with bandwidth, latency, memory and speed.

Usage::

    cluster = flat_cluster(num_devices=4, bandwidth="10Gb/s")
    cluster = parse_cluster("8x300GB/s,4x25Gb/s,memory=32GB")   # 4 servers x 8 devices
    cluster = parse_cluster("cluster.yaml")                       # the same, from YAML

Compact spec: comma-separated items, levels innermost first. A level is
``COUNTxBANDWIDTH[@LATENCY]`` (``8x300GB/s@2us``); the other items are ``memory=SIZE`` (per
device) and ``speed=FACTOR`` (relative device speed, 1.0 = the profiled device).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from tandem.errors import UsageError

_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"

BANDWIDTH_UNITS: dict[str, float] = {
    "B/s": 1.0, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12,
    "Kb/s": 1e3 / 8, "Mb/s": 1e6 / 8, "Gb/s": 1e9 / 8, "Tb/s": 1e12 / 8,
    "Kbps": 1e3 / 8, "Mbps": 1e6 / 8, "Gbps": 1e9 / 8, "Tbps": 1e12 / 8,
}  # fmt: skip
"""Accepted bandwidth units (SI, case-sensitive: ``B`` is bytes, ``b`` is bits) in bytes/s."""

SIZE_UNITS: dict[str, float] = {
    "B": 1.0, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
    "KiB": 2.0**10, "MiB": 2.0**20, "GiB": 2.0**30, "TiB": 2.0**40,
}  # fmt: skip
"""Accepted memory-size units in bytes."""

TIME_UNITS: dict[str, float] = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
"""Accepted latency units in seconds."""


def _parse_quantity(text: str, units: dict[str, float], what: str, example: str) -> float:
    match = re.fullmatch(_NUMBER + r"\s*(\S*)", str(text).strip())
    accepted = ", ".join(units)
    if match is None or match.group(2) not in units:
        raise UsageError(
            f"cannot read {what} {text!r}: write a number and one of the units "
            f"{accepted} (e.g. {example})"
        )
    value = float(match.group(1)) * units[match.group(2)]
    if not math.isfinite(value):
        raise UsageError(f"{what} {text!r} is not finite")
    return value


def parse_bandwidth(text: str) -> float:
    """Bytes per second of ``text`` such as ``10Gb/s`` (1.25e9) or ``300GB/s`` (3e11)."""
    value = _parse_quantity(text, BANDWIDTH_UNITS, "bandwidth", "10Gb/s or 300GB/s")
    if value <= 0:
        raise UsageError(f"bandwidth {text!r} must be positive (e.g. 10Gb/s)")
    return value


def parse_size(text: str) -> float:
    """Bytes of ``text`` such as ``16GB`` or ``32GiB``."""
    value = _parse_quantity(text, SIZE_UNITS, "memory size", "16GB or 32GiB")
    if value <= 0:
        raise UsageError(f"memory size {text!r} must be positive (e.g. 16GB)")
    return value


def parse_duration(text: str | float, flag: str) -> float:
    """Seconds of a duration option's value: a number with a unit (``1ms``, ``20us``, ``0.5s``,
    ``300s``) or a bare number of seconds (``300``); ``flag`` names it in errors."""
    raw = str(text).strip()
    try:
        value = float(raw)
    except ValueError:
        match = re.fullmatch(_NUMBER + r"\s*(\S*)", raw)
        if match is None or match.group(2) not in TIME_UNITS:
            raise UsageError(f"{flag} {raw!r} is not a duration; write seconds or a number with "
                             f"a unit ({', '.join(TIME_UNITS)}), e.g. {flag} 1ms") from None
        value = float(match.group(1)) * TIME_UNITS[match.group(2)]
    if not math.isfinite(value) or value < 0:
        raise UsageError(f"{flag} {raw!r} must be a finite duration of at least 0, e.g. "
                         f"{flag} 1ms")
    return value


def parse_latency(text: str) -> float:
    """Seconds of ``text`` such as ``5us`` or ``1ms``."""
    value = _parse_quantity(text, TIME_UNITS, "latency", "5us or 1ms")
    if value < 0:
        raise UsageError(f"latency {text!r} must not be negative")
    return value


@dataclass(kw_only=True, slots=True, frozen=True)
class Level:
    """One level of the hierarchy: ``num_units`` units of the level below, linked together."""

    num_units: int
    """Devices (innermost level) or groups of the level below (e.g. servers) at this level."""
    bandwidth_Bps: float
    """Bandwidth of one link between units of this level, bytes per second."""
    latency_s: float = 0.0
    """Latency of one message between units of this level, seconds."""

    def __post_init__(self) -> None:
        if not isinstance(self.num_units, int) or self.num_units < 1:
            raise UsageError(
                f"a cluster level needs at least 1 device (got {self.num_units}): "
                "use e.g. --devices 4"
            )
        if not self.bandwidth_Bps > 0 or not math.isfinite(self.bandwidth_Bps):
            raise UsageError(f"bandwidth must be positive (got {self.bandwidth_Bps} B/s)")
        if self.latency_s < 0:
            raise UsageError(f"latency must not be negative (got {self.latency_s} s)")


@dataclass(kw_only=True, slots=True, frozen=True)
class Cluster:
    """Devices in hierarchy levels, innermost first (e.g. 8 GPUs per server, then 4 servers)."""

    levels: tuple[Level, ...]
    """The levels, innermost first; the cluster has the product of their counts as devices."""
    memory_bytes: float | None = None
    """Memory of one device in bytes, or None for no memory limit."""
    speed: float = 1.0
    """Device speed relative to the profiled device: 2.0 halves every compute time."""
    name: str = field(default="")
    """The preset or spec this cluster was built from, for display."""

    def __post_init__(self) -> None:
        if not self.levels:
            raise UsageError("a cluster needs at least one level of devices")
        if self.memory_bytes is not None and not self.memory_bytes > 0:
            raise UsageError(f"device memory must be positive (got {self.memory_bytes} bytes)")
        if not self.speed > 0:
            raise UsageError(f"device speed must be positive (got {self.speed})")

    @property
    def num_devices(self) -> int:
        """Total number of devices."""
        return math.prod(level.num_units for level in self.levels)

    def devices_per_unit(self, level_index: int) -> int:
        """Devices inside one unit of level ``level_index`` (1 at the innermost level)."""
        return math.prod(level.num_units for level in self.levels[:level_index])

    def describe(self) -> str:
        """A one-line human description, e.g. ``4 x 8 devices (8 @ 300 GB/s, 4 @ 25 Gb/s)``."""
        parts = ", ".join(
            f"{lv.num_units} @ {format_bandwidth(lv.bandwidth_Bps)}" for lv in self.levels
        )
        memory = f", {self.memory_bytes / 1e9:g} GB each" if self.memory_bytes else ""
        return f"{self.num_devices} devices ({parts}{memory})"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dictionary."""
        return {
            "levels": [
                {"devices": lv.num_units, "bandwidth_Bps": lv.bandwidth_Bps, "latency_s": lv.latency_s}
                for lv in self.levels
            ],
            "memory_bytes": self.memory_bytes,
            "speed": self.speed,
            "name": self.name,
        }


def server_size(cluster: Cluster) -> int | None:
    """Devices per server (the innermost level) of a hierarchical cluster; None for a flat
    one (under torchrun, a server is a node)."""
    return cluster.levels[0].num_units if len(cluster.levels) > 1 else None


def format_bandwidth(value_Bps: float) -> str:
    """``1.25e9`` -> ``10 Gb/s``; ``3e11`` -> ``300 GB/s``."""
    if value_Bps * 8 < 1e11:
        return f"{value_Bps * 8 / 1e9:g} Gb/s"
    return f"{value_Bps / 1e9:g} GB/s"


FLAT_MEMORY = "16GB"
"""Per-device memory of a flat cluster given on the command line (``--devices N --bandwidth
BW``) without ``--memory``: the V100s of the presets ``pipedream-a``, ``pipedream-b`` and
``dgx1``, whose profiles the planning commands ship."""


def flat_cluster(
    *, num_devices: int, bandwidth: str | float, memory: str | None = None, latency: str = "0s"
) -> Cluster:
    """A cluster of ``num_devices`` devices all linked at one bandwidth."""
    if not isinstance(num_devices, int) or num_devices < 1:
        raise UsageError(f"--devices must be at least 1 (got {num_devices})")
    bandwidth_Bps = bandwidth if isinstance(bandwidth, float) else parse_bandwidth(bandwidth)
    level = Level(num_units=num_devices, bandwidth_Bps=bandwidth_Bps, latency_s=parse_latency(latency))
    memory_bytes = parse_size(memory) if memory else None
    return Cluster(levels=(level,), memory_bytes=memory_bytes, name=f"{num_devices} devices")


PRESETS: dict[str, str] = {
    "pipedream-a": "4x16GB/s,4x10Gb/s,memory=16GB",
    "pipedream-b": "8x150GB/s,2x25Gb/s,memory=16GB",
    "dgx1": "8x150GB/s,memory=16GB",
    "dgx-a100": "8x300GB/s,memory=80GB",
    "ethernet-16": "16x10Gb/s",
}
"""Named clusters (nominal link speeds): PipeDream's Cluster-A (4 servers x 4 V100 over PCIe,
10 Gb/s between servers) and Cluster-B (2 servers x 8 V100 over NVLink, 25 Gb/s), one DGX-1,
one DGX A100, and 16 devices on 10 Gb/s Ethernet."""


def parse_cluster(spec: str) -> Cluster:
    """A cluster from a preset name, a YAML file, or a compact spec (see the module docstring)."""
    text = spec.strip()
    if text in PRESETS:
        cluster = _parse_compact(PRESETS[text])
        return Cluster(levels=cluster.levels, memory_bytes=cluster.memory_bytes,
                       speed=cluster.speed, name=text)  # fmt: skip
    if text.endswith((".yaml", ".yml")) or os.path.isfile(text):
        return _load_yaml(text)
    if not text:
        raise UsageError(f"empty --cluster: write e.g. 8x300GB/s,4x25Gb/s or a preset ({', '.join(PRESETS)})")
    return _parse_compact(text)


def _parse_level(item: str, spec: str) -> Level:
    match = re.fullmatch(r"\s*([0-9]+)\s*[xX*]\s*([^@]+?)\s*(?:@\s*(\S+))?\s*", item)
    if match is None:
        raise UsageError(
            f"cannot read cluster level {item!r} in {spec!r}: write COUNTxBANDWIDTH[@LATENCY], "
            f"e.g. 8x300GB/s@2us, or a preset ({', '.join(PRESETS)})"
        )
    latency_s = parse_latency(match.group(3)) if match.group(3) else 0.0
    return Level(num_units=int(match.group(1)), bandwidth_Bps=parse_bandwidth(match.group(2)),
                 latency_s=latency_s)  # fmt: skip


def _parse_compact(spec: str) -> Cluster:
    levels: list[Level] = []
    options: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, eq, value = item.partition("=")
        if eq:
            if key.strip() not in ("memory", "speed"):
                raise UsageError(f"unknown cluster option {key.strip()!r} in {spec!r}: use memory= or speed=")
            options[key.strip()] = value.strip()
        else:
            levels.append(_parse_level(item, spec))
    return _build(levels, options.get("memory"), options.get("speed"), spec)


def _build(levels: list[Level], memory: Any, speed: Any, name: str) -> Cluster:
    memory_bytes = None if memory is None else (
        float(memory) if isinstance(memory, (int, float)) else parse_size(str(memory)))  # fmt: skip
    try:
        speed_value = 1.0 if speed is None else float(speed)
    except ValueError:
        raise UsageError(f"cluster speed {speed!r} is not a number (e.g. speed=1.5)") from None
    return Cluster(levels=tuple(levels), memory_bytes=memory_bytes, speed=speed_value, name=name)


def _load_yaml(path: str) -> Cluster:
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except OSError as exc:
        raise UsageError(f"cannot read cluster file {path!r}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise UsageError(f"cluster file {path!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("levels"), list):
        raise UsageError(
            f"cluster file {path!r} needs a 'levels' list, e.g. "
            "levels: [{devices: 8, bandwidth: 300GB/s}, {devices: 4, bandwidth: 25Gb/s}]"
        )
    levels = [_yaml_level(entry, path) for entry in data["levels"]]
    return _build(levels, data.get("memory"), data.get("speed"), os.path.basename(path))


def _yaml_level(entry: Any, path: str) -> Level:
    if not isinstance(entry, dict) or "devices" not in entry or "bandwidth" not in entry:
        raise UsageError(
            f"each level in {path!r} needs 'devices' and 'bandwidth' (got {entry!r})"
        )
    devices = entry["devices"]
    if not isinstance(devices, int):
        raise UsageError(f"level devices in {path!r} must be an integer (got {devices!r})")
    latency = entry.get("latency", "0s")
    return Level(num_units=devices, bandwidth_Bps=parse_bandwidth(str(entry["bandwidth"])),
                 latency_s=parse_latency(str(latency)))  # fmt: skip
