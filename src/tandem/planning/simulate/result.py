"""What a simulation takes besides the plan and the cluster (``SimOptions``) and what it
predicts (``SimResult``, one ``WorkerResult`` per process)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from tandem.errors import UsageError
from tandem.planning.simulate.codecs import CodecSpeed
from tandem.spec.codec import CodecSpec
from tandem.planning.simulate.collectives import ALGORITHMS
from tandem.planning.simulate.costs import DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES
from tandem.spec.kinds import ScheduleKind
from tandem.timeline import Timeline

@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class SimOptions:
    """How to simulate: batch, collectives, overlap, compression, overheads, memory."""

    batch_scale: float = 1.0
    """Global minibatch of one step in units of the profile's minibatch."""
    allreduce: str = "auto"
    """Allreduce algorithm: ``auto``, ``ring``, ``tree`` or ``hierarchical``."""
    allreduce_latency_s: float | None = None
    """Latency of one step of an allreduce; None: the latency of the links it crosses."""
    overlap_allreduce: bool | None = None
    """DDP's bucketed allreduce during the backward; None: for data-parallel plans (one stage under
    1F1B), as the runtime does."""
    gradient_compression: float = 1.0
    """Divide the bytes of every allreduce by this ratio (on top of a stage's codec)."""
    activation_compression: float = 1.0
    """Divide the bytes of activations and gradients sent between stages by this ratio."""
    activation_comm: bool = True
    """False: activations and their gradients sent between stages carry no bytes (they take only
    the link's latency), as PipeDream's optimizer assumes by default (``tandem plan
    --no-activation-comm``)."""
    optimizer_Bps: float | None = None
    """Parameter bytes an optimizer step updates per second; None: steps take no time."""
    optimizer_state_factor: float = 1.0
    """Optimizer state bytes per parameter byte (SGD with momentum 1, Adam 2)."""
    compute_overhead_s: float = 0.0
    """Fixed seconds added to every forward and backward, on top of the profile's own fixed
    costs (e.g. the runtime's cost per action, which a profile of the layers does not see)."""
    tensor_overhead_s: float = 0.0
    """With a tensor degree above 1: seconds each tensor allreduce adds to the compute of the
    forward or backward around it, beyond the collective itself: the framework's work for the
    split layers around it (DTensor wraps, dispatches and redistributes in Python, per call, on
    every device of the group), which a profile of unsplit layers does not see."""
    charge_fixed_costs: bool = True
    """Charge the profile's fixed cost per call (``LayerProfile.forward_fixed_s`` and
    ``backward_fixed_s``) to every forward and backward of a micro-batch, and scale only the
    rest with its share of the minibatch; False scales whole layer times (no fixed cost)."""
    send_overhead_s: float = 0.0
    """Seconds a worker spends posting a send."""
    num_steps: int = 2
    """Flush schedules: steps simulated back to back (the last one is reported)."""
    bucket_bytes: float = DDP_BUCKET_BYTES
    """DDP bucket size."""
    record: bool = True
    """Build the timeline (searches turn it off for speed)."""
    max_replay_actions: int = 40_000
    """A pipeline whose replay would run more actions than this (all workers, all steps; about
    a second on one core) is rated in closed form instead (:mod:`tandem.planning.simulate.steady`):
    time and memory linear in its stages and workers, no timeline."""
    compress: CodecSpec | None = None
    """Gradient codec, ``CODEC[:k=v,...]`` as for ``tandem train --compress`` (e.g.
    ``topk:ratio=0.01``; a text given is parsed once, here): replicas exchange its payloads by its collective and pay its encode
    and decode time (:mod:`tandem.planning.simulate.codecs`); it replaces a stage's ``compression`` for
    gradients (not for activations). None: gradients go by allreduce, divided by the ratios."""
    codec_speedup: float = 1.0
    """Encode and decode this many times faster than ``codec_speed`` (on top of the cluster's
    device speed): the defaults were measured on one CPU thread, so a GPU is some 10-100 times
    faster (an assumption, not a measurement)."""
    codec_speed: CodecSpeed | None = None
    """The codec's encode and decode speed; None: its measured default."""
    server_message_s: float = 0.0
    """Parameter servers: seconds a server spends on each push it handles besides decoding and
    its optimizer step (receiving into Python, summing, bookkeeping)."""

    def __post_init__(self) -> None:
        if self.allreduce not in ALGORITHMS:
            raise UsageError(f"unknown allreduce algorithm {self.allreduce!r} (known: {', '.join(ALGORITHMS)})")
        for name in ("batch_scale", "gradient_compression", "activation_compression", "bucket_bytes"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise UsageError(f"{name.replace('_', '-')} must be a positive number (got {value})")
        if self.allreduce_latency_s is not None and not self.allreduce_latency_s >= 0:
            raise UsageError(f"allreduce latency must not be negative (got {self.allreduce_latency_s})")
        if self.max_replay_actions < 0:
            raise UsageError(f"max_replay_actions must not be negative (got {self.max_replay_actions})")
        if self.num_steps < 1:
            raise UsageError(f"num_steps must be at least 1 (got {self.num_steps})")
        if not (self.compute_overhead_s >= 0 and math.isfinite(self.compute_overhead_s)):
            raise UsageError(f"overhead must be a non-negative number of seconds "
                             f"(got {self.compute_overhead_s})")
        if not (self.server_message_s >= 0 and math.isfinite(self.server_message_s)):
            raise UsageError(f"server message time must be a non-negative number of seconds "
                             f"(got {self.server_message_s})")
        if not (self.codec_speedup > 0 and math.isfinite(self.codec_speedup)):
            raise UsageError(f"codec speed-up must be a positive number (got {self.codec_speedup})")
        if isinstance(self.compress, str):  # frozen: the text is read once, here
            object.__setattr__(self, "compress", CodecSpec.parse(self.compress))
        if self.compress is not None:
            if self.gradient_compression != 1.0:
                raise UsageError(
                    f"give a gradient codec (--compress {self.compress.text}) or a compression "
                    f"ratio (--compression {self.gradient_compression:g}), not both")


@dataclasses.dataclass(kw_only=True, slots=True)
class WorkerResult:
    """One worker's time and memory per step."""

    worker: int
    stage: int
    replica: int
    device: int
    busy_s: float
    """Forward, backward and optimizer-step seconds per step."""
    idle_s: float
    """Step time minus busy and codec time (waiting for inputs, allreduces, the pipeline's
    bubble)."""
    communication_s: float
    """Seconds of transfers this worker sent or received and of its allreduces, per step
    (overlapped with compute or not)."""
    codec_s: float = 0.0
    """Seconds of encoding and decoding a gradient codec per step (device compute, not in
    ``busy_s``)."""
    weight_bytes: float
    gradient_bytes: float
    optimizer_bytes: float
    stashed_weight_bytes: float
    """Weight versions kept besides the current one (PipeDream)."""
    activation_bytes: float
    """Most activation bytes held at once."""
    peak_memory_bytes: float
    role: str = "worker"
    """``worker``, or ``server`` for a parameter server (its figures per update)."""


@dataclasses.dataclass(kw_only=True, slots=True)
class SimResult:
    """A plan's predicted speed, utilization and memory, and its timeline."""

    config: str
    schedule: ScheduleKind
    num_microbatches: int
    """Micro-batches per step (flush) or minibatches replayed (``pipedream``; its closed form,
    for a plan too large to replay, replays none: 1)."""
    step_time_s: float
    """Seconds per optimizer step. Flush schedules: one step is one flush (fill and drain
    included). ``pipedream``: seconds per minibatch in steady state, the period once the
    pipeline is full, its start-up apart in ``fill_s``."""
    steps_per_s: float
    samples_per_s: float | None
    """Throughput in samples, when the profile's minibatch size is known."""
    bubble_fraction: float
    """Share of all workers' time not spent computing."""
    compute_s: float
    """The busiest worker's compute seconds per step."""
    communication_s: float
    """The most communication seconds of any worker per step."""
    codec_s: float = 0.0
    """The most encode and decode seconds of any worker per step (with a gradient codec)."""
    peak_memory_bytes: float
    memory_limit_bytes: float | None
    workers: list[WorkerResult]
    timeline: Timeline
    method: str = "allreduce"
    """The plan's synchronization method (``allreduce``, ``ps``, ``gossip``, ...)."""
    step_meaning: str = ""
    """What ``step_time_s`` measures, when it is not one synchronous step of the schedule."""
    updates_per_s: float | None = None
    """Updates of the model per second, all workers' together (None for schedules whose
    step is the update: 1 / ``step_time_s``)."""
    tensor_degree: int = 1
    """Devices of each worker's tensor group: every worker row stands for that many devices,
    each with the row's figures (its ``device`` is the group's first)."""
    recompute: bool = False
    """The plan recomputes activations in the backward."""
    fill_s: float = 0.0
    """``pipedream``: seconds a run of ``N`` minibatches takes beyond ``N * step_time_s`` (the
    pipeline's fill: its first minibatches cross every stage before it reaches its steady
    state). 0 for flush schedules, whose every step fills and drains."""

    @property
    def fits_memory(self) -> bool:
        """True when every device's peak fits the cluster's memory (or there is no limit)."""
        return self.memory_limit_bytes is None or self.peak_memory_bytes <= self.memory_limit_bytes

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dictionary (without the timeline)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("workers", "timeline")}
        data["fits_memory"] = self.fits_memory
        data["workers"] = [dataclasses.asdict(worker) for worker in self.workers]
        return data
