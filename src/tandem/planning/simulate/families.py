"""The simulator for one-stage plans that do not synchronize by allreduce: what they share.

Usage::

    result = simulate_family(plan, profile, cluster, options)   # plan.sync: ps, gossip, ...

:func:`tandem.planning.simulate.simulator.simulate` dispatches here on ``type(plan.sync)``; the methods
themselves are modelled in :mod:`tandem.planning.simulate.servers` (parameter servers) and
:mod:`tandem.planning.simulate.decentralized` (gossip, local SGD, EASGD). This module gives them the
costs of one worker's step (:class:`Costs`), point-to-point transfers over the cluster's ports
(:class:`Network`), per-step records (:class:`Records`) and the :class:`SimResult` they return.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from tandem.cluster import Cluster
from tandem.errors import UsageError
from tandem.plan import Plan
from tandem.planning.simulate.codecs import GRADIENT_ELEMENT_BYTES, CodecModel, codec_model
from tandem.planning.simulate.collectives import link_level, port, unit_sizes
from tandem.planning.simulate.result import SimResult, WorkerResult
from tandem.profile import ModelProfile, scale_call
from tandem.schedule import Action, Kind
from tandem.timeline import Event, Timeline

STEPS = 12
"""Steps (per worker) each method is simulated for; the middle third is reported."""


@dataclasses.dataclass(kw_only=True, slots=True)
class Costs:
    """One worker's step of a one-stage plan, already scaled to its micro-batches and the
    device speed, and the sizes a synchronization method moves."""

    forward_s: float
    """One forward of one micro-batch."""
    backward_s: float
    accumulate: int
    """Micro-batches a worker runs per step."""
    step_s: float
    """One optimizer step over the whole model (parameter bytes / ``optimizer_Bps``)."""
    parameter_bytes: float
    tensor_bytes: list[float]
    """Parameter bytes of each layer (one tensor each), in layer order."""
    activation_bytes: float
    """Activation bytes one micro-batch keeps from its forward to its backward."""
    codec: CodecModel | None
    codec_speedup: float
    """Encode/decode run this many times the codec's measured speed."""
    workers: list[int]
    """Device of each training worker (stage replica)."""
    servers: list[int]
    """Device of each parameter server (none for other methods)."""
    server_message_s: float
    """Seconds a server spends on each message it handles besides its optimizer step."""
    optimizer_Bps: float | None
    optimizer_state_factor: float

    @property
    def compute_s(self) -> float:
        """Forwards and backwards of one step."""
        return self.accumulate * (self.forward_s + self.backward_s)

    def payload_bytes(self, tensors: Sequence[float]) -> float:
        """Bytes of ``tensors`` as sent: float32, or the codec's payloads."""
        if self.codec is None:
            return float(sum(tensors))
        return sum(self.codec.payload_bytes(_numel(b)) for b in tensors if b > 0)

    def encode_s(self, tensors: Sequence[float]) -> float:
        """Seconds to encode ``tensors`` (0 without a codec)."""
        if self.codec is None:
            return 0.0
        return self.codec.encode_s([_numel(b) for b in tensors if b > 0], speedup=self.codec_speedup)

    def decode_s(self, tensors: Sequence[float], messages: int = 1) -> float:
        """Seconds to decode ``messages`` messages of ``tensors`` (0 without a codec)."""
        if self.codec is None or messages < 1:
            return 0.0
        numels = [_numel(b) for b in tensors if b > 0]
        return messages * self.codec.decode_s(numels, 1, speedup=self.codec_speedup)

    def update_s(self, num_bytes: float) -> float:
        """Seconds of an optimizer step (or an elementwise pass) over ``num_bytes`` of parameters."""
        return num_bytes / self.optimizer_Bps if self.optimizer_Bps else 0.0


def _numel(num_bytes: float) -> int:
    return max(1, round(num_bytes / GRADIENT_ELEMENT_BYTES))


def family_costs(plan: Plan, profile: ModelProfile, cluster: Cluster, options: Any) -> Costs:
    """The :class:`Costs` of a one-stage ``plan`` under ``options`` (a ``SimOptions``);
    :class:`UsageError` if the workers and servers do not fit the cluster."""
    stage = plan.stages[0]
    servers = plan.num_servers
    if stage.replicas + servers > cluster.num_devices:
        raise UsageError(
            f"plan {plan.config} with {servers} parameter server(s) needs "
            f"{stage.replicas + servers} devices but the cluster has {cluster.num_devices}; "
            f"use fewer workers or servers, or a larger cluster")
    layers = [profile.layers[i] for i in plan.stage_layers(0)]
    share = options.batch_scale / int(plan.num_microbatches or stage.replicas)
    fixed = 1.0 if options.charge_fixed_costs else 0.0  # the layers' cost per call, or none
    speed = cluster.speed
    parameter_bytes = float(sum(layer.parameter_bytes for layer in layers))
    spec = options.compress or plan.compress
    workers, server_devices = _devices(plan, cluster)
    return Costs(
        forward_s=sum(scale_call(l.forward_s, l.forward_fixed_s * fixed, share) for l in layers)
        / speed + options.compute_overhead_s,
        backward_s=sum(scale_call(l.backward_s, l.backward_fixed_s * fixed, share) for l in layers)
        / speed + options.compute_overhead_s,
        accumulate=plan.accumulate,
        step_s=parameter_bytes / options.optimizer_Bps if options.optimizer_Bps else 0.0,
        parameter_bytes=parameter_bytes,
        tensor_bytes=[float(l.parameter_bytes) for l in layers if l.parameter_bytes > 0],
        activation_bytes=sum(l.activation_bytes for l in layers) * share,
        codec=codec_model(spec, options.codec_speed) if spec else None,
        codec_speedup=options.codec_speedup * speed,
        workers=workers, servers=server_devices,
        server_message_s=options.server_message_s, optimizer_Bps=options.optimizer_Bps,
        optimizer_state_factor=options.optimizer_state_factor,
    )


def _devices(plan: Plan, cluster: Cluster) -> tuple[list[int], list[int]]:
    """Workers' and servers' devices: servers are ranks ``0..S-1`` (devices ``0..S-1``) and the
    workers follow, as the runtime numbers them, unless the plan assigns the workers' devices
    (then the servers take the lowest devices left)."""
    stage, servers = plan.stages[0], plan.num_servers
    if stage.devices is not None:
        if len(stage.devices) != stage.replicas:
            raise UsageError(f"stage {stage.start}..{stage.end} lists {len(stage.devices)} "
                             f"devices for {stage.replicas} replicas")
        free = [d for d in range(cluster.num_devices) if d not in set(stage.devices)]
        return list(stage.devices), free[:servers]
    return list(range(servers, servers + stage.replicas)), list(range(servers))


class Network:
    """Point-to-point transfers over the cluster's ports, first come first served: a transfer
    takes the sender's outgoing and the receiver's incoming port of the level joining their
    devices once both are free, for bytes / bandwidth, and arrives a latency later."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.sizes = unit_sizes(cluster)
        self.free: dict[int, float] = defaultdict(float)

    def send(self, now: float, src: int, dst: int, num_bytes: float) -> tuple[float, float]:
        """Book a transfer of ``num_bytes`` from device ``src`` to ``dst`` posted at ``now``;
        ``(start, arrival)``."""
        if src == dst:
            return now, now
        level = link_level(self.cluster, src, dst, self.sizes)
        out_port, in_port = port(level, src, self.sizes), -1 - port(level, dst, self.sizes)
        spec = self.cluster.levels[level]
        start = max(now, self.free[out_port], self.free[in_port])
        self.free[out_port] = self.free[in_port] = start + num_bytes / spec.bandwidth_Bps
        return start, self.free[out_port] + spec.latency_s


class Clock:
    """A discrete-event loop: callbacks run in time order (ties in the order scheduled)."""

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, Callable[[float], object]]] = []
        self.count = 0

    def at(self, when: float, callback: Callable[[float], object]) -> None:
        """Run ``callback(when)`` at time ``when``."""
        self.count += 1
        heapq.heappush(self.heap, (when, self.count, callback))

    def run(self) -> None:
        """Run callbacks until none is left."""
        while self.heap:
            when, _, callback = heapq.heappop(self.heap)
            callback(when)


@dataclasses.dataclass(kw_only=True, slots=True)
class Records:
    """Per process (the runtime's ranks: servers, then workers), per step: busy, communication and codec seconds,
    the time each step ended, and the timeline's events."""

    num_processes: int
    record: bool = True
    busy: list[dict[int, float]] = dataclasses.field(default_factory=list)
    communication: list[dict[int, float]] = dataclasses.field(default_factory=list)
    codec: list[dict[int, float]] = dataclasses.field(default_factory=list)
    ends: list[list[float]] = dataclasses.field(default_factory=list)
    events: list[Event] = dataclasses.field(default_factory=list)
    fixed_window: range | None = None
    """Steps every process reports (periodic methods: one period); None: :meth:`window`."""

    def __post_init__(self) -> None:
        self.busy = [defaultdict(float) for _ in range(self.num_processes)]
        self.communication = [defaultdict(float) for _ in range(self.num_processes)]
        self.codec = [defaultdict(float) for _ in range(self.num_processes)]
        self.ends = [[] for _ in range(self.num_processes)]

    def event(self, process: int, kind: Kind, start: float, end: float, step: int,
              microbatch: int | None = None, num_bytes: float = 0.0) -> None:
        """Record an action named in the schedule's vocabulary (``0F0``, ``0PU``, ``0GX``)."""
        if self.record:
            name = str(Action(stage=0, kind=kind, microbatch=microbatch))
            self.events.append(Event(worker=process, name=name, start_s=start, end_s=end,
                                     step=step, bytes=int(num_bytes)))

    def compute(self, process: int, costs: Costs, start: float, step: int) -> float:
        """A worker's forwards and backwards of one step from ``start``; when they end."""
        now = start
        for m in range(costs.accumulate):
            self.event(process, Kind.FORWARD, now, now + costs.forward_s, step, m)
            now += costs.forward_s
            self.event(process, Kind.BACKWARD, now, now + costs.backward_s, step, m)
            now += costs.backward_s
        self.busy[process][step] += now - start
        return now

    def window(self, process: int) -> range:
        """The steps of ``process`` reported: the middle third of those it ended."""
        if self.fixed_window is not None:
            return self.fixed_window
        count = len(self.ends[process])
        first = max(1, count // 3)
        return range(first, max(first + 1, 2 * count // 3))

    def interval(self, process: int) -> float:
        """Mean seconds between the ends of consecutive steps of ``process`` in its window."""
        steps, ends = self.window(process), self.ends[process]
        if len(ends) < 2:
            return ends[-1] if ends else 0.0
        first, last = steps.start - 1, min(steps.stop, len(ends)) - 1
        if last <= first:
            first, last = 0, len(ends) - 1
        return (ends[last] - ends[first]) / (last - first)

    def mean(self, table: list[dict[int, float]], process: int, steps: range) -> float:
        """Mean per step of ``table[process]`` over ``steps``."""
        return sum(table[process].get(k, 0.0) for k in steps) / max(1, len(steps))


def family_result(plan: Plan, profile: ModelProfile, cluster: Cluster, costs: Costs,
                  records: Records, *, step_s: float, meaning: str, updates_per_s: float,
                  extra_weights: float = 0.0, server_steps: range | None = None,
                  batch_scale: float = 1.0, per_worker: bool = False) -> SimResult:
    """The :class:`~tandem.planning.simulate.simulator.SimResult` of a family's run.

    Processes are numbered as the runtime's ranks: servers ``0..S-1``, then the workers.
    ``extra_weights``: parameter bytes a worker keeps besides its model (neighbours' copies,
    EASGD's center). Servers are reported with ``role="server"``:
    their shard, its optimizer state, and their busy and communication time per update
    (``server_steps``: the updates to average over). ``updates_per_s`` counts updates of the
    model: global steps, or with ``per_worker`` each worker's own (one worker's share of the
    batch each: asynchronous methods).
    """
    num_workers, num_servers = len(costs.workers), len(costs.servers)
    rows = []
    ps = bool(costs.servers)
    for process in range(records.num_processes):
        server = process < num_servers
        steps = (server_steps or range(0)) if server else records.window(process)
        busy = records.mean(records.busy, process, steps)
        codec = records.mean(records.codec, process, steps)
        comm = records.mean(records.communication, process, steps)
        if server:
            shard = costs.parameter_bytes / len(costs.servers)
            weights, grads, state, acts, stash = shard, shard, shard * costs.optimizer_state_factor, 0.0, 0.0
            device = costs.servers[process]
        else:
            weights = grads = costs.parameter_bytes
            state = 0.0 if ps else costs.parameter_bytes * costs.optimizer_state_factor
            acts, stash = costs.activation_bytes, extra_weights
            device = costs.workers[process - num_servers]
        rows.append(WorkerResult(
            worker=process, stage=0, replica=process if server else process - num_servers,
            device=device, busy_s=busy, idle_s=max(0.0, step_s - busy - codec),
            communication_s=comm, codec_s=codec, weight_bytes=weights, gradient_bytes=grads,
            optimizer_bytes=state, stashed_weight_bytes=stash, activation_bytes=acts,
            peak_memory_bytes=weights + grads + state + stash + acts,
            role="server" if server else "worker"))
    trainers = rows[num_servers:]
    batch = profile.batch_size
    return SimResult(
        config=plan.config, schedule=plan.schedule, num_microbatches=int(plan.num_microbatches or 1),
        step_time_s=step_s, steps_per_s=1.0 / step_s if step_s > 0 else math.inf,
        samples_per_s=(batch * batch_scale * updates_per_s / (num_workers if per_worker else 1)
                       if batch else None),
        bubble_fraction=(max(0.0, 1.0 - sum(w.busy_s for w in trainers) / (num_workers * step_s))
                         if step_s > 0 else 0.0),
        compute_s=max(w.busy_s for w in trainers),
        communication_s=max(w.communication_s for w in trainers),
        codec_s=max(w.codec_s for w in rows),
        peak_memory_bytes=max(w.peak_memory_bytes for w in rows),
        memory_limit_bytes=cluster.memory_bytes, workers=rows,
        timeline=Timeline(events=records.events, source="simulator"),
        method=plan.sync.method, step_meaning=meaning, updates_per_s=updates_per_s,
    )
