"""Plans: pipeline stages as layer ranges with replica counts, predicted times, JSON, ``3-1`` text.

Stage ``s`` runs the layers ``plan.layers()[stage.start:stage.end]`` (``end`` exclusive). For an
``nn.Sequential`` profile ``layer_order`` is None and ``start``/``end`` are block indices; for a
DAG profile ``layer_order`` lists layer indices in an order where every stage is contiguous.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tandem.errors import UsageError

SCHEMA_VERSION = 1
"""Version of the JSON layout written by :meth:`Plan.to_dict`."""


@dataclass(kw_only=True, slots=True)
class Stage:
    """One pipeline stage: a contiguous range of layers and the devices replicating it."""

    start: int
    """First layer position (index into the plan's layer order), inclusive."""
    end: int
    """Last layer position, exclusive."""
    replicas: int
    """Number of devices running this stage (data parallel within the stage)."""
    time_s: float = 0.0
    """Predicted time per minibatch of this stage."""
    compute_s: float = 0.0
    """Forward + backward seconds of the stage's layers on one device."""
    parameter_bytes: float = 0.0
    """Parameter bytes of the stage."""
    memory_bytes: float = 0.0
    """Predicted memory per device: weights and stashed activations of minibatches in flight."""
    devices: list[int] | None = None
    """Device ranks assigned to this stage; None until the runtime assigns them."""
    compression: str | None = None
    """Codec for this stage's gradients or activations (e.g. ``fp16``); None for none."""
    sync: str = "allreduce"
    """How the replicas of this stage synchronize."""

    def __post_init__(self) -> None:
        if self.start < 0 or self.end <= self.start:
            raise UsageError(f"stage range {self.start}..{self.end} is empty or negative")
        if self.replicas < 1:
            raise UsageError(f"stage {self.start}..{self.end} needs at least 1 replica")


@dataclass(kw_only=True, slots=True)
class Plan:
    """Stages in pipeline order, predicted times, and room for how to run them."""

    stages: list[Stage]
    """The stages, first to last."""
    num_layers: int
    """Number of layers in the profile the plan was made for."""
    num_devices: int
    """Devices in the cluster (some may be idle with ``--allow-idle``)."""
    bottleneck_s: float = 0.0
    """Predicted time per minibatch of the slowest stage (the pipeline's throughput)."""
    single_s: float = 0.0
    """Predicted time per minibatch on one device."""
    data_parallel_s: float = 0.0
    """Predicted time per minibatch of data parallelism on all devices."""
    layer_order: list[int] | None = None
    """Layer indices in stage order; None means 0..num_layers-1 (an ``nn.Sequential``)."""
    level_configs: list[str] = field(default_factory=list)
    """PipeDream's text form per cluster level, innermost first (for hierarchical clusters)."""
    schedule: str = "1f1b"
    """Schedule kind the runtime should use (``1f1b``, ``gpipe``, ``pipedream``...)."""
    num_microbatches: int | None = None
    """Micro-batches per minibatch; None lets the runtime choose."""
    solve_s: float = 0.0
    """Seconds spent solving."""
    options: dict[str, Any] = field(default_factory=dict)
    """Planner options the plan was solved with, for the record."""

    def __post_init__(self) -> None:
        if not self.stages:
            raise UsageError("a plan needs at least one stage")
        position = 0
        for stage in self.stages:
            if stage.start != position:
                raise UsageError(f"stages must be contiguous: expected a stage starting at {position}, got {stage.start}")
            position = stage.end
        if position != self.num_layers:
            raise UsageError(f"stages cover {position} layers but the profile has {self.num_layers}")
        if sum(stage.replicas for stage in self.stages) > self.num_devices:
            raise UsageError(f"plan {self.config} uses more than its {self.num_devices} devices")

    @property
    def config(self) -> str:
        """PipeDream's text form: replicas per stage joined by ``-`` (``3-1``)."""
        return config_text([stage.replicas for stage in self.stages])

    @property
    def speedup_vs_single(self) -> float:
        """Predicted throughput relative to one device."""
        return self.single_s / self.bottleneck_s if self.bottleneck_s > 0 else float("inf")

    @property
    def speedup_vs_dp(self) -> float:
        """Predicted throughput relative to data parallelism on all devices."""
        return self.data_parallel_s / self.bottleneck_s if self.bottleneck_s > 0 else float("inf")

    def layers(self) -> list[int]:
        """Layer indices in stage order."""
        return list(range(self.num_layers)) if self.layer_order is None else list(self.layer_order)

    def stage_layers(self, stage_index: int) -> list[int]:
        """Layer indices of one stage."""
        stage = self.stages[stage_index]
        return self.layers()[stage.start : stage.end]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dictionary with a schema version."""
        return {
            "schema_version": SCHEMA_VERSION,
            "config": self.config,
            "stages": [_stage_dict(stage) for stage in self.stages],
            "bottleneck_s": self.bottleneck_s,
            "speedup_vs_single": self.speedup_vs_single,
            "speedup_vs_dp": self.speedup_vs_dp,
            "solve_s": self.solve_s,
            "single_s": self.single_s,
            "data_parallel_s": self.data_parallel_s,
            "num_layers": self.num_layers,
            "num_devices": self.num_devices,
            "layer_order": self.layer_order,
            "level_configs": self.level_configs,
            "schedule": self.schedule,
            "num_microbatches": self.num_microbatches,
            "options": self.options,
        }

    @classmethod
    def from_dict(cls, data: Any) -> Plan:
        """Read :meth:`to_dict`'s layout."""
        if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
            raise UsageError(f"not a tandem plan of schema_version {SCHEMA_VERSION}")
        try:
            stages = [Stage(**{k: v for k, v in s.items() if k in _STAGE_KEYS}) for s in data["stages"]]
            keys = {k: data[k] for k in _PLAN_KEYS if k in data}
            return cls(stages=stages, **keys)
        except (KeyError, TypeError) as exc:
            raise UsageError(f"malformed plan: {exc}") from None

    def save(self, path: str) -> None:
        """Write the plan as JSON."""
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.to_dict(), handle, indent=1)
            handle.write("\n")

    @classmethod
    def load(cls, path: str) -> Plan:
        """Read a plan written by :meth:`save`."""
        try:
            with open(path, encoding="utf-8") as handle:
                return cls.from_dict(json.load(handle))
        except (OSError, json.JSONDecodeError) as exc:
            raise UsageError(f"cannot read plan {path!r}: {exc}") from None


_STAGE_KEYS = ("start", "end", "replicas", "time_s", "compute_s", "parameter_bytes",
               "memory_bytes", "devices", "compression", "sync")  # fmt: skip
_PLAN_KEYS = ("num_layers", "num_devices", "bottleneck_s", "single_s", "data_parallel_s",
              "layer_order", "level_configs", "schedule", "num_microbatches", "solve_s", "options")  # fmt: skip


def _stage_dict(stage: Stage) -> dict[str, Any]:
    return {key: getattr(stage, key) for key in _STAGE_KEYS}


def config_text(replicas: list[int]) -> str:
    """``[3, 1]`` -> ``3-1``."""
    return "-".join(str(count) for count in replicas)


def parse_config(text: str) -> list[int]:
    """``3-1`` -> ``[3, 1]``."""
    try:
        counts = [int(part) for part in text.strip().split("-")]
    except ValueError:
        raise UsageError(f"cannot read plan config {text!r}: write replicas per stage, e.g. 3-1") from None
    if any(count < 1 for count in counts):
        raise UsageError(f"plan config {text!r} has a stage with no replicas")
    return counts
