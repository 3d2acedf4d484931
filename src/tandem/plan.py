"""Plans: the whole strategy of a run as data — layout, schedule, synchronization and codec.

A plan says how many workers run what: pipeline stages as layer ranges with a replica count
each (one stage replicated on every worker is data parallelism), a tensor degree, a shard
degree (ZeRO / FSDP: data-parallel workers that share the model's state), the schedule kind
and its number of micro-batches, how the replicas synchronize (a typed spec of
:mod:`tandem.spec.sync`) and the compression codec (a :class:`tandem.spec.codec.CodecSpec`).
``tandem plan``, ``tandem search`` and the command-line flags of ``tandem train`` all build a
``Plan``; the simulator and the runtime read it, and nothing else decides how workers cooperate.

Stage ``s`` runs the layers ``plan.layers()[stage.start:stage.end]`` (``end`` exclusive). For an
``nn.Sequential`` profile ``layer_order`` is None and ``start``/``end`` are block indices; for a
DAG profile ``layer_order`` lists layer indices in an order where every stage is contiguous.

A plan is *pipelined* when it has more than one stage or runs GPipe's or PipeDream's schedule;
otherwise it is data parallel: one stage on every worker, each step's global batch split into
``num_microbatches`` micro-batches that the workers share round-robin (``--accumulate`` of them
per worker, run one after another as 1F1B does on one stage).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from tandem.spec.codec import CodecSpec
from tandem import strict_json
from tandem.errors import UsageError
from tandem.output_files import write_text
from tandem.schedule.generators import generate
from tandem.schedule.schedule import SCHEDULE_KINDS, Schedule
from tandem.spec.kinds import ScheduleKind
from tandem.spec.sync import AllReduceSync, SyncSpec, sync_from_dict, sync_to_dict

SCHEMA_VERSION = 2
"""Version of the JSON layout written by :meth:`Plan.to_dict` (1: stages and schedule only,
still read: its sync is allreduce)."""


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
    """Device ranks assigned to this stage, one per replica (with a tensor degree ``T``, the
    first of the replica's ``T`` adjacent devices); None until the runtime assigns them."""
    compression: str | None = None
    """Compression ratio the planner assumed for this stage's gradients (``fp16`` or a number);
    the codec a run uses is the plan's ``compress``."""

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
    """Predicted time per step (one global minibatch) of the plan as it runs: the simulator's
    for ``predicted_schedule`` (``tandem plan`` and ``tandem search``), or the partitioner's
    estimate for a bare partition (:func:`tandem.planning.search.planner.partition_plan`)."""
    single_s: float = 0.0
    """Predicted time per minibatch on one device (the same predictor)."""
    data_parallel_s: float = 0.0
    """Predicted time per minibatch of data parallelism on all devices (the same predictor)."""
    estimate_s: float | None = None
    """The partitioner's cost-model estimate of the time per minibatch (PipeDream's steady
    state), shown beside the simulator's ``bottleneck_s``; None when no partitioner ran."""
    samples_per_s: float | None = None
    """Predicted samples per second, when the minibatch's sample count is known."""
    candidates: list[dict[str, Any]] = field(default_factory=list)
    """The plans the planner compared (its partition, the flat plan at the slowest link, data
    parallelism, one device): each with its estimate, its simulated step time and memory."""
    layer_order: list[int] | None = None
    """Layer indices in stage order; None means 0..num_layers-1 (an ``nn.Sequential``)."""
    level_configs: list[str] = field(default_factory=list)
    """PipeDream's text form per cluster level, innermost first (for hierarchical clusters)."""
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B
    """Schedule kind the runtime runs: ``1f1b``, ``gpipe`` or ``pipedream`` (a name given is
    read into its :class:`ScheduleKind`)."""
    num_microbatches: int | None = None
    """Micro-batches per step; None: :func:`default_microbatches` (decided there only). Always
    1 for ``pipedream`` (each minibatch is a whole global batch)."""
    schedule_text: str | None = None
    """A schedule written by hand (``Schedule.text`` form) that the run executes instead of the
    generated one; ``schedule`` and ``num_microbatches`` are its own."""
    vertical_sync: bool = False
    """``pipedream``: every stage uses the weight version stage 0 used for a minibatch."""
    tensor_degree: int = 1
    """Devices each layer is split across (intra-layer parallelism; 1: none): every stage
    replica runs on this many adjacent devices."""
    tensor_layers: dict[str, str] | None = None
    """With ``tensor_degree`` above 1, the layers to split and how: module name (as the model's
    ``named_modules`` gives it) -> style, one of :data:`TENSOR_STYLES`
    (``{"encoder.0.fc1": "colwise", "encoder.0.fc2": "rowwise"}``); layers it does not name
    stay whole. None: the reference model's own plan (:mod:`tandem.models.tensor`)."""
    sharded: bool = False
    """Sharded data parallelism (ZeRO / FSDP): the workers keep the model's state in FSDP2's
    (or ZeRO's) sharded form, in groups of ``shard_degree`` (set whenever that is above 1; with
    1, each worker's group is itself: FSDP2's mixed precision on one device)."""
    shard_degree: int = 1
    """With ``sharded``: the data-parallel workers are split into groups of this many, each
    group sharding the model's state among its workers (1 and not ``sharded``: none; every
    worker holds all of it). Workers beyond one group replicate the groups (hybrid sharding,
    HSDP): ``replicas / shard_degree`` groups. In a pipeline, every stage's replicas: they
    shard their stage's state."""
    shard_level: int = 3
    """With ``sharded``, what is sharded: 1 the optimizer state, 2 also the
    gradients, 3 also the parameters (ZeRO's stages)."""
    shard_units: list[str] | None = None
    """With ``sharded``, the submodules (``named_modules`` names) sharded as one
    unit each, gathered for their forward and backward only; None: each block of the model (the
    children of its sequence of blocks), then the rest of the model."""
    recompute: bool = False
    """Activation recomputation: each stage keeps only its input per micro-batch in flight and
    runs its forward again before each backward."""
    sync_batchnorm: bool = False
    """Data parallelism: BatchNorm layers normalize over the global batch (every worker's
    samples; :mod:`tandem.sync.sync_batchnorm`), as one process would, not each worker's share."""
    sync: SyncSpec = field(default_factory=AllReduceSync)
    """How the replicas of a stage synchronize (pipelines: allreduce only)."""
    compress: CodecSpec | None = None
    """Codec of what the workers exchange (gradients, pushes, parameters or activations)."""
    predicted_schedule: ScheduleKind | None = None
    """The schedule ``bottleneck_s`` assumes (the plan's own once ``tandem plan`` or ``tandem
    search`` simulated it; ``pipedream``, its steady state, for a bare partition); None when
    the plan predicts nothing."""
    solve_s: float = 0.0
    """Seconds spent solving."""
    options: dict[str, Any] = field(default_factory=dict)
    """Planner options the plan was solved with, for the record."""
    devices_per_server: int | None = None
    """Devices per server (the innermost level) of the hierarchical cluster the plan was made
    for; None for a flat cluster. Under torchrun a node is a server: the job must run this
    many workers per node (:mod:`tandem.runtime.placement`)."""

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
        if self.num_workers > self.num_devices:
            raise UsageError(f"plan {self.config} needs {self.num_workers} workers but has "
                             f"{self.num_devices} devices")
        self.schedule = _schedule_kind(self.schedule)
        if self.predicted_schedule is not None:
            self.predicted_schedule = _schedule_kind(self.predicted_schedule)
        if isinstance(self.tensor_degree, bool) or not isinstance(self.tensor_degree, int) \
                or self.tensor_degree < 1:
            raise UsageError(f"tensor degree must be a whole number of at least 1 (got "
                             f"{self.tensor_degree!r})")
        self._check_tensor_layers()
        self._check_shard()
        if not isinstance(self.recompute, bool):
            raise UsageError(f"a plan's recompute must be true or false (got {self.recompute!r})")
        if self.sync_batchnorm and (self.pipelined or self.tensor_degree > 1
                                    or not isinstance(self.sync, AllReduceSync)):
            raise UsageError("--sync-batchnorm normalizes over the workers of synchronous data "
                             "parallelism (--strategy dp, with or without --shard, no "
                             "--tensor-parallel); drop it for this plan")
        if self.num_microbatches is None:
            self.num_microbatches = default_microbatches(self.replicas, self.schedule)
        self._check_schedule()
        if self.schedule_text is not None:
            self.build_schedule()
        if self.pipelined and not isinstance(self.sync, AllReduceSync):
            raise UsageError(f"a pipeline's stage replicas synchronize by allreduce; sync method "
                             f"{self.sync.method!r} needs a one-stage plan (no --strategy pipeline)")

    def _check_tensor_layers(self) -> None:
        layers = self.tensor_layers
        if layers is None:
            return
        if not isinstance(layers, dict) or not layers:
            raise UsageError(f"a plan's tensor_layers maps module names to styles, e.g. "
                             f'{{"fc1": "colwise", "fc2": "rowwise"}} (got {layers!r})')
        for name, style in layers.items():
            if not isinstance(name, str) or style not in TENSOR_STYLES:
                raise UsageError(f"tensor layer {name!r} has style {style!r}; use one of "
                                 f"{', '.join(TENSOR_STYLES)}")
        if self.tensor_degree == 1:
            raise UsageError(f"the plan names {len(layers)} tensor layers but its tensor degree "
                             f"is 1, which splits none; add --tensor-parallel T (tensor_degree "
                             f"in a plan file), or drop the tensor layers")

    def _check_shard(self) -> None:
        degree, level, units = self.shard_degree, self.shard_level, self.shard_units
        if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
            raise UsageError(f"a plan's shard degree must be a whole number of at least 1 (got "
                             f"{degree!r}); e.g. 4, or 1 for none")
        if not isinstance(self.sharded, bool):
            raise UsageError(f"a plan's sharded must be true or false (got {self.sharded!r})")
        self.sharded = self.sharded or degree > 1
        if level not in SHARD_LEVELS or isinstance(level, bool):
            raise UsageError(f"shard level {level!r} is not one of 1 (optimizer state), "
                             f"2 (+ gradients), 3 (+ parameters)")
        if units is not None and (not isinstance(units, list) or not units
                                  or not all(isinstance(name, str) and name for name in units)):
            raise UsageError(f"a plan's shard_units lists submodule names, e.g. "
                             f'["transformer.h.0", "transformer.h.1"] (got {units!r})')
        if not self.sharded:
            if units is not None or level != 3:
                raise UsageError("the plan sets shard_level or shard_units but is not sharded; "
                                 "add --shard S (sharded and shard_degree in a plan file), or "
                                 "drop them")
            return
        if not isinstance(self.sync, AllReduceSync):
            raise UsageError(f"shard degree {degree} is sharded data parallelism, which runs on "
                             f"allreduce's plans only (this plan is {self.sync.method}); use "
                             f"--strategy dp or pipeline")
        replicas = self.stages[0].replicas
        if self.tensor_degree > 1 and level == 1:
            raise UsageError(f"shard level 1 with tensor degree {self.tensor_degree}: level 1 "
                             f"is torch's ZeroRedundancyOptimizer, which has no rule for "
                             f"tensor parallelism's DTensor shares; set shard_level to 2 or 3")
        if replicas % degree:
            raise UsageError(f"shard degree {degree} does not divide the plan's {replicas} "
                             f"data-parallel workers; use a divisor of {replicas}")

    def _check_schedule(self) -> None:
        count = self.num_microbatches
        if count is None or count < 1:
            raise UsageError(f"--microbatches must be at least 1 (got {count})")
        if self.schedule.whole_minibatches and count != 1:
            raise UsageError(f"the pipedream schedule runs whole minibatches: --microbatches "
                             f"{count} does not apply; drop it or use --schedule 1f1b or gpipe")
        if self.vertical_sync and not self.schedule.asynchronous:
            raise UsageError(f"--vertical-sync applies to --schedule pipedream only (the plan runs "
                             f"{self.schedule}); drop it or use --schedule pipedream")
        if not self.pipelined and count % self.stages[0].replicas:
            replicas = self.stages[0].replicas
            raise UsageError(f"a data-parallel plan shares its {count} micro-batches among "
                             f"{replicas} workers round-robin: use a multiple of {replicas}")

    @property
    def replicas(self) -> list[int]:
        """Replica count of each stage."""
        return [stage.replicas for stage in self.stages]

    @property
    def pipelined(self) -> bool:
        """More than one stage, or GPipe's or PipeDream's schedule (see the module docstring)."""
        return len(self.stages) > 1 or not self.schedule.accumulates

    @property
    def num_servers(self) -> int:
        """Parameter-server processes besides the stages' workers."""
        return self.sync.num_servers

    @property
    def num_workers(self) -> int:
        """Processes the plan runs on: every stage's replicas, and the parameter servers."""
        return sum(self.replicas) * self.tensor_degree + self.num_servers

    @property
    def data_degree(self) -> int:
        """Replicas of the (only) stage of a data-parallel plan; of the widest stage otherwise."""
        return max(self.replicas)

    @property
    def accumulate(self) -> int:
        """Data-parallel plans: micro-batches each worker runs per step."""
        return int(self.num_microbatches or 1) // self.stages[0].replicas if not self.pipelined else 1

    def build_schedule(self, num_minibatches: int = 1) -> Schedule:
        """The schedule this plan runs: its hand-written one, or generated from its replicas and
        micro-batches; PipeDream's asynchronous schedule spans ``num_minibatches`` minibatches
        (the whole run). :class:`UsageError` for a hand-written one of another layout."""
        if self.schedule_text is None:
            count = num_minibatches if self.schedule.whole_minibatches else self.num_microbatches
            return generate(self.schedule, self.replicas, int(count or 1))
        try:
            schedule = Schedule.parse(self.schedule_text)
        except ValueError as exc:
            raise UsageError(f"the plan's schedule is not in tandem's text form ({exc})") from None
        foreign = next((action for actions in schedule.workers for action in actions
                        if action.kind.value in _DATA_PARALLEL_ONLY), None)
        if foreign is not None:
            raise UsageError(f"the schedule's action {foreign} is not a pipeline's (pipelines run "
                             f"F, B, SA, RA, SG, RG, AR and ST); remove it")
        if list(schedule.replicas) != self.replicas:
            raise UsageError(f"the schedule is for replicas {'-'.join(map(str, schedule.replicas))} "
                             f"but the pipeline is {self.config}; write it for this layout")
        if (schedule.kind, schedule.num_microbatches) != (self.schedule, self.num_microbatches):
            raise UsageError(f"the plan says {self.schedule} with {self.num_microbatches} "
                             f"micro-batches but its schedule is {schedule.kind} with "
                             f"{schedule.num_microbatches}")
        return schedule

    def rescheduled(self, schedule: ScheduleKind | str | None = None,
                    num_microbatches: int | None = None) -> Plan:
        """This plan with another schedule and/or micro-batch count (defaults re-decided)."""
        changes: dict[str, Any] = {}
        if schedule is not None:
            changes["schedule"] = schedule
            changes["num_microbatches"] = num_microbatches
        if num_microbatches is not None:
            changes["num_microbatches"] = num_microbatches
        return dataclasses.replace(self, **changes)

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
            "speedup_vs_single": self.speedup_vs_single if self.bottleneck_s > 0 else None,
            "speedup_vs_dp": self.speedup_vs_dp if self.bottleneck_s > 0 else None,
            "solve_s": self.solve_s,
            "single_s": self.single_s,
            "data_parallel_s": self.data_parallel_s,
            "num_layers": self.num_layers,
            "num_devices": self.num_devices,
            "layer_order": self.layer_order,
            "level_configs": self.level_configs,
            "schedule": self.schedule,
            "num_microbatches": self.num_microbatches,
            "schedule_text": self.schedule_text,
            "vertical_sync": self.vertical_sync,
            "tensor_degree": self.tensor_degree,
            "tensor_layers": self.tensor_layers,
            "sharded": self.sharded,
            "shard_degree": self.shard_degree,
            "shard_level": self.shard_level,
            "shard_units": self.shard_units,
            "recompute": self.recompute,
            "sync_batchnorm": self.sync_batchnorm,
            "sync": sync_to_dict(self.sync),
            "compress": self.compress.text if self.compress else None,
            "predicted_schedule": self.predicted_schedule,
            "estimate_s": self.estimate_s,
            "samples_per_s": self.samples_per_s,
            "candidates": self.candidates,
            "options": self.options,
            "devices_per_server": self.devices_per_server,
        }

    @classmethod
    def from_dict(cls, data: Any) -> Plan:
        """Read :meth:`to_dict`'s layout."""
        version = data.get("schema_version") if isinstance(data, dict) else None
        if version not in (1, SCHEMA_VERSION):
            raise UsageError(f"not a tandem plan of schema_version {SCHEMA_VERSION} (got "
                             f"{version!r}); write it with tandem plan -o or tandem search -o")
        try:
            stages = [Stage(**{k: v for k, v in s.items() if k in _STAGE_KEYS}) for s in data["stages"]]
            keys = {k: data[k] for k in _PLAN_KEYS if k in data}
            if version == 1:  # its predicted times were PipeDream's steady state
                keys["predicted_schedule"] = (ScheduleKind.PIPEDREAM if keys.get("bottleneck_s")
                                              else None)
            if "sync" in data:
                keys["sync"] = sync_from_dict(data["sync"])
            if data.get("compress") is not None:
                keys["compress"] = CodecSpec.parse(str(data["compress"]))
            return cls(stages=stages, **keys)
        except (KeyError, TypeError) as exc:
            raise UsageError(f"malformed plan: {exc}") from None

    def save(self, path: str) -> None:
        """Write the plan as strict JSON, atomically."""
        write_text(path, strict_json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str) -> Plan:
        """Read a plan written by :meth:`save`."""
        try:
            with open(path, encoding="utf-8") as handle:
                return cls.from_dict(json.load(handle))
        except (OSError, json.JSONDecodeError) as exc:
            raise UsageError(f"cannot read plan {path!r}: {exc}") from None


_STAGE_KEYS = ("start", "end", "replicas", "time_s", "compute_s", "parameter_bytes",
               "memory_bytes", "devices", "compression")  # fmt: skip
_PLAN_KEYS = ("num_layers", "num_devices", "bottleneck_s", "single_s", "data_parallel_s",
              "layer_order", "level_configs", "schedule", "num_microbatches", "schedule_text",
              "vertical_sync", "tensor_degree", "tensor_layers", "sharded",
              "shard_degree", "shard_level", "shard_units", "recompute", "sync_batchnorm",
              "predicted_schedule", "estimate_s", "samples_per_s",
              "candidates", "solve_s", "options", "devices_per_server")  # fmt: skip


SHARD_LEVELS = (1, 2, 3)
"""What sharded data parallelism shards (ZeRO's stages): 1 optimizer state; 2 + gradients;
3 + parameters."""

TENSOR_STYLES = ("colwise", "rowwise", "heads", "channels")
"""How a tensor plan splits a layer (see :mod:`tandem.models.tensor`)."""

_DATA_PARALLEL_ONLY = ("PU", "PL", "GX")
"""Action codes of parameter servers and gossip, which no pipeline schedule may contain."""


def default_microbatches(replicas: list[int], schedule: ScheduleKind) -> int:
    """The number of micro-batches per step when none is given — decided here only.

    ``pipedream``: 1 (a minibatch is a whole global batch). One stage under 1F1B (data
    parallelism): one per worker. A pipeline: enough that every stage has one in flight and
    every replica of every stage gets one, ``max(stages, most replicas)``.
    """
    if schedule.whole_minibatches:
        return 1
    if len(replicas) == 1 and schedule.accumulates:
        return replicas[0]
    return max(len(replicas), max(replicas))


def _schedule_kind(name: ScheduleKind | str) -> ScheduleKind:
    """The kind ``name`` names; :class:`UsageError` naming the known ones otherwise."""
    kind = ScheduleKind.parse(name)
    if kind is None:
        raise UsageError(f"schedule {name!r} is not one of: {', '.join(SCHEDULE_KINDS)}")
    return kind


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
