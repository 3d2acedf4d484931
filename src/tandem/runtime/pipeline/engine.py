"""Execution of one worker's schedule actions with ``torch.distributed`` point-to-point ops.

Each direction between two workers has its own process group (a *link*): NCCL runs all
point-to-point operations of one communicator in issue order, so sharing one between the
activations going forward and the gradients coming back could deadlock a 1F1B schedule.
Receives are posted (``irecv``) when their action comes and waited for only by the forward or
backward that consumes them; sends are posted (``isend``) and completed at the end of a step,
so communication overlaps compute wherever the schedule places it early. With ``--compress``
every activation and activation gradient goes as one byte message of the codec (see
``wire.py``), encoded when it is sent and decoded by the forward or backward that waits for it.
Flush schedules accumulate gradients into the live parameters; the asynchronous schedule binds
a stashed weight version to each minibatch (see ``stash.py``).

The trace names every action the schedule's way (``str(action)``: ``1F3``, ``1SA3>2``,
``2RA3<1``, ``0AR``, ``0ST5``), one event per action in the order they run, so a worker's
event names are its action list. A receive's event spans from its post to its message's
arrival as seen by the computation that waits for it (under vertical sync, the weight version's
message too); a send's, its post. Events wait in a queue until every earlier action's has ended.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from tandem.compress.meter import ring_bytes
from tandem.runtime.base import loss_sum
from tandem.runtime.pipeline.stash import WeightVersions
from tandem.runtime.pipeline.wire import Traffic, Wire
from tandem.schedule import Action, Kind

ACT, GRAD, VERSION = 0, 1, 2
KEYS = {ACT: "activation", GRAD: "gradient"}
"""What the codec is told each channel's tensors are."""


def tag(microbatch: int, channel: int) -> int:
    """Message tag of a micro-batch's activation, gradient or weight version (gloo matches on it)."""
    return microbatch * 3 + channel


@dataclasses.dataclass(frozen=True, slots=True)
class Microbatch:
    """The data a stage needs for one micro-batch."""

    size: int
    """Samples in the micro-batch."""
    scale: float
    """Factor of its summed loss: 1 / predictions in the whole (global) batch."""
    step: int
    """Optimizer step it belongs to (for the trace)."""
    inputs: torch.Tensor | None = None
    """Model inputs (first stage only)."""
    targets: torch.Tensor | None = None
    """Labels (last stage only)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StageShapes:
    """Per-sample shapes and dtypes of a stage's input and output."""

    input_shape: tuple[int, ...]
    input_dtype: torch.dtype
    output_shape: tuple[int, ...]
    output_dtype: torch.dtype = torch.float32
    """Of the output, and so of the gradient that comes back for it."""


@dataclasses.dataclass(slots=True)
class Record:
    """The trace event of one action, written once it and every earlier action have ended."""

    name: str
    """The action's text (``2RA3<1``)."""
    start: float
    step: int
    end: float = 0.0
    num_bytes: int = 0
    version: int = -1
    waits: int = 0
    """Messages of a receive not yet waited for; the event ends when the last one is in."""


@dataclasses.dataclass(frozen=True, slots=True)
class Receive:
    """A posted receive: the buffer its message lands in and the tensor it will stand for."""

    work: Any
    buffer: torch.Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype
    record: Record
    """The trace event of the receive action that posted it."""


class StageEngine:
    """Runs the actions of one worker, which holds one stage (or a replica of it)."""

    def __init__(self, *, module: nn.Module, stage: int, num_stages: int, shapes: StageShapes,
                 group: dist.ProcessGroup | None, links: dict[tuple[int, int], dist.ProcessGroup],
                 rank: int, num_replicas: int, optimizer: torch.optim.Optimizer,
                 scheduler: Any, device: torch.device, asynchronous: bool, vertical_sync: bool,
                 trace: Callable[..., None], beat: Any, wire: Wire | None = None) -> None:
        self.module, self.stage, self.device = module, stage, device
        self.first, self.last = stage == 0, stage == num_stages - 1
        self.shapes, self.group, self.num_replicas = shapes, group, num_replicas
        self.links, self.rank = links, rank
        self.optimizer, self.scheduler = optimizer, scheduler
        self.asynchronous, self.vertical_sync = asynchronous, vertical_sync
        self.trace, self.beat = trace, beat
        self.wire = wire if wire is not None else Wire()
        self.traffic = Traffic()
        self.stash = WeightVersions(module, vertical_sync=vertical_sync) if asynchronous else None
        self.unchanged_until_backward: set[int] = set()
        """Minibatches with no weight update between their forward and backward on this worker
        (PipeDream's last stage): they run on the live parameters, which is the same version."""
        self.on_live: set[int] = set()
        self.receives: dict[tuple[int, int], Receive] = {}
        self.records: collections.deque[Record] = collections.deque()
        """Trace events in action order, the first ones waiting for their receive to end."""
        self.sends: list[tuple[int, Any, torch.Tensor]] = []
        """Posted sends: (step, work, tensor kept alive until the send completes)."""
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self.input_grads: dict[int, torch.Tensor] = {}
        self.param_grads: dict[int, list[torch.Tensor | None]] = {}
        self.versions: dict[int, int] = {}
        self.saved_bytes: dict[int, int] = {}
        self.peak_activation_bytes = 0
        self.loss_total = torch.zeros((), device=device)
        self.step = 0

    def execute(self, actions: Sequence[Action], batch: Callable[[int], Microbatch],
                step: int) -> torch.Tensor:
        """Run ``actions`` (part of optimizer step ``step``) in order; returns the summed
        (unscaled) loss computed here."""
        self.step = step
        self.loss_total = torch.zeros((), device=self.device)
        handlers = {
            Kind.FORWARD: self._forward, Kind.BACKWARD: self._backward,
            Kind.SEND_ACT: self._send, Kind.SEND_GRAD: self._send,
            Kind.RECV_ACT: self._receive, Kind.RECV_GRAD: self._receive,
            Kind.ALLREDUCE: self._allreduce, Kind.STEP: self._step,
        }
        for action in actions:
            handlers[action.kind](action, batch)
        return self.loss_total

    def finish_sends(self) -> None:
        """Wait until every posted send has been received."""
        for _, work, _ in self.sends:
            work.wait()
        self.sends.clear()

    def prune_sends(self, before_step: int) -> None:
        """Complete the sends of steps before ``before_step`` and drop their tensors (keeps
        memory bounded in asynchronous runs).

        gloo reports a send complete only once it has been waited for, so they must be
        waited for. In the asynchronous schedule every receive of minibatch ``m`` is posted
        within its worker's chunk ``m`` or earlier (see ``step_chunks``), so once this worker
        has finished chunk ``k``, waiting for sends of minibatches up to ``k`` cannot deadlock;
        for sends a few minibatches old the wait returns at once.
        """
        pending = []
        for step, work, tensor in self.sends:
            if step < before_step:
                work.wait()
            else:
                pending.append((step, work, tensor))
        self.sends = pending

    # -- communication ------------------------------------------------------------------------

    def _receive(self, action: Action, batch: Callable[[int], Microbatch]) -> None:
        m = action.microbatch
        assert m is not None and action.peer is not None
        micro = batch(m)
        record = Record(str(action), time.perf_counter(), micro.step, waits=1)
        self.records.append(record)
        if action.kind is Kind.RECV_ACT:
            shape, dtype, channel = self.shapes.input_shape, self.shapes.input_dtype, ACT
            if self.vertical_sync:
                version = torch.zeros(1, dtype=torch.int64, device=self.device)
                work = dist.irecv(version, src=action.peer, tag=tag(m, VERSION),
                                  group=self.links[(action.peer, self.rank)])
                self.receives[(m, VERSION)] = Receive(work, version, (1,), torch.int64, record)
                record.waits += 1
        else:
            shape, dtype, channel = self.shapes.output_shape, self.shapes.output_dtype, GRAD
        shape = (micro.size, *shape)
        buffer = self.wire.receive_buffer(shape, dtype, self.device)
        work = dist.irecv(buffer, src=action.peer, tag=tag(m, channel),
                          group=self.links[(action.peer, self.rank)])
        self.receives[(m, channel)] = Receive(work, buffer, shape, dtype, record)
        record.num_bytes = buffer.numel() * buffer.element_size()

    def _wait(self, microbatch: int, channel: int) -> torch.Tensor:
        """The tensor of a posted receive, once it has arrived (decoded, for a codec)."""
        receive = self.receives.pop((microbatch, channel))
        receive.work.wait()
        tensor = receive.buffer
        if channel != VERSION:
            tensor = self.wire.unpack(tensor, receive.shape, receive.dtype, KEYS[channel])
        record = receive.record
        record.end = max(record.end, time.perf_counter())
        record.waits -= 1
        self._flush()
        return tensor

    # -- trace ----------------------------------------------------------------------------------

    def _record(self, action: Action, start: float, step: int, *, num_bytes: int = 0,
                version: int = -1) -> None:
        """Trace ``action`` as having run from ``start`` until now."""
        self.records.append(Record(str(action), start, step, time.perf_counter(),
                                   num_bytes=num_bytes, version=version))
        self._flush()

    def _flush(self) -> None:
        """Write the events of the actions that have ended, up to the first that has not."""
        while self.records and not self.records[0].waits:
            record = self.records.popleft()
            self.trace(record.name, record.start, record.end, record.step,
                       num_bytes=record.num_bytes, version=record.version)

    def _send(self, action: Action, batch: Callable[[int], Microbatch]) -> None:
        m = action.microbatch
        assert m is not None and action.peer is not None
        start = time.perf_counter()
        if action.kind is Kind.SEND_ACT:
            tensor, channel = self.saved[m][1].detach(), ACT
            if self.vertical_sync:
                version = torch.tensor([self.versions[m]], dtype=torch.int64, device=self.device)
                work = dist.isend(version, dst=action.peer, tag=tag(m, VERSION),
                                  group=self.links[(self.rank, action.peer)])
                self.sends.append((batch(m).step, work, version))
                self.traffic.other_bytes += version.numel() * version.element_size()
        else:
            tensor, channel = self.input_grads.pop(m), GRAD
        message = self.wire.pack(tensor, KEYS[channel])
        work = dist.isend(message, dst=action.peer, tag=tag(m, channel),
                          group=self.links[(self.rank, action.peer)])
        self.sends.append((batch(m).step, work, message))
        num_bytes = message.numel() * message.element_size()
        self.traffic.activation_bytes += tensor.numel() * tensor.element_size()
        self.traffic.message_bytes += num_bytes
        self._record(action, start, batch(m).step, num_bytes=num_bytes)

    # -- compute --------------------------------------------------------------------------------

    def _weights_version(self, m: int) -> int:
        """The weight version minibatch ``m`` uses here (stage 0's under vertical sync)."""
        assert self.stash is not None
        if self.vertical_sync and not self.first:
            version = int(self._wait(m, VERSION))
            self.stash.keep_from(version)
            return version
        return self.stash.version

    def _forward(self, action: Action, batch: Callable[[int], Microbatch]) -> None:
        m = action.microbatch
        assert m is not None
        micro = batch(m)
        self.beat.step, self.beat.phase = micro.step, "forward"
        if self.first:
            x = micro.inputs
        else:
            x = self._wait(m, ACT).requires_grad_(True)
        assert x is not None
        version = self._weights_version(m) if self.stash else -1
        start = time.perf_counter()
        saved = [0]

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            saved[0] += tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            if self.stash is not None and m in self.unchanged_until_backward and \
                    version == self.stash.version:
                self.on_live.add(m)
                out = self.module(x)
            elif self.stash is not None:
                out = functional_call(self.module, self.stash.acquire(version), (x,))
            else:
                out = self.module(x)
            if self.last:
                assert micro.targets is not None
                loss = loss_sum(out, micro.targets)
                self.loss_total += loss.detach()
                out = loss * micro.scale
        self.saved[m] = (x, out, version)
        self.versions[m] = version
        self.saved_bytes[m] = saved[0]
        self.peak_activation_bytes = max(self.peak_activation_bytes, sum(self.saved_bytes.values()))
        self._record(action, start, micro.step, version=version)

    def _backward(self, action: Action, batch: Callable[[int], Microbatch]) -> None:
        m = action.microbatch
        assert m is not None
        micro = batch(m)
        self.beat.step, self.beat.phase = micro.step, "backward"
        grad = None if self.last else self._wait(m, GRAD)
        x, out, version = self.saved.pop(m)
        start = time.perf_counter()
        if self.stash is not None:
            live = m in self.on_live
            self.on_live.discard(m)
            params = list(self.module.parameters() if live else self.stash.snapshots[version].values())
            wrt = params if self.first else [*params, x]
            grads = torch.autograd.grad(out, wrt, grad_outputs=grad, allow_unused=True)
            self.param_grads[m] = list(grads[: len(params)])
            if not self.first:
                self.input_grads[m] = grads[-1]
            if not live:
                self.stash.release(version)
        else:
            out.backward(grad)
            if not self.first:
                assert x.grad is not None
                self.input_grads[m] = x.grad
        del self.saved_bytes[m]
        self.versions.pop(m, None)
        self._record(action, start, micro.step, version=version)

    # -- synchronization and update --------------------------------------------------------------

    def _allreduce(self, action: Action, batch: Callable[[int], Microbatch]) -> None:
        step = batch(action.microbatch).step if action.microbatch is not None else self.step
        if self.group is None:  # a stage with one replica: nothing to average
            self._record(action, time.perf_counter(), step)
            return
        self.beat.phase = "step"
        start = time.perf_counter()
        if action.microbatch is None:
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        else:
            grads = [g for g in self.param_grads[action.microbatch] if g is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        if action.microbatch is not None:
            flat /= self.num_replicas
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        num_bytes = flat.numel() * flat.element_size()
        self.traffic.other_bytes += ring_bytes("allreduce", num_bytes, self.num_replicas)
        self._record(action, start, step, num_bytes=num_bytes)

    def _step(self, action: Action, batch: Callable[[int], Microbatch]) -> None:
        step = batch(action.microbatch).step if action.microbatch is not None else self.step
        self.beat.phase = "step"
        start = time.perf_counter()
        if action.microbatch is not None:
            for p, g in zip(self.module.parameters(), self.param_grads.pop(action.microbatch)):
                p.grad = g
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.stash is not None:
            self.stash.advance()
        self._record(action, start, step)
