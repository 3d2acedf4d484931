"""Execution of one worker's schedule actions with ``torch.distributed`` point-to-point ops.

Each direction between two workers has its own process group (a *link*): NCCL runs all
point-to-point operations of one communicator in issue order, so sharing one between the
activations going forward and the gradients coming back could deadlock a 1F1B schedule.
Receives are posted (``irecv``) when their action comes and waited for only by the forward or
backward that consumes them; sends are posted (``isend``) and completed at the end of a step,
so communication overlaps compute wherever the schedule places it early. With ``--compress``
every activation and activation gradient goes as one byte message of the codec (see
``wire.py``), encoded when it is sent and decoded by the forward or backward that waits for it.
A boundary may carry several tensors (a skip connection, an attention mask; see
:mod:`tandem.split`): they travel as one message, and gradients come back for those that
require them. A parameter held by several stages (tied weights) has its gradient summed over
them before every optimizer step, so its copies stay equal.
Flush schedules accumulate gradients into the live parameters; the asynchronous schedule binds
a stashed weight version to each minibatch (see ``stash.py``). With ``--precision`` each forward
(and the last stage's loss) runs under autocast and what crosses to the next stage is cast back
to the dtype its boundary was traced with; the optimizer step goes through
:class:`~tandem.runtime.precision.StagePrecision` (fp16's shared loss scale, clipping).
With ``recompute`` each forward keeps only the stage's input and its backward runs it again
(see ``recompute.py``), on the same weight version under PipeDream's weight stashing.
``peak_activation_bytes`` is the most this worker held at once of what autograd saves for
backwards (the stage's weights excepted): every micro-batch in flight's, plus, with
``recompute``, what the backward's recomputation saves.

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

from tandem import structures
from tandem.compress.meter import ring_bytes
from tandem.runtime.pipeline.recompute import Recompute, saved_bytes, storages
from tandem.runtime.pipeline.stash import WeightVersions
from tandem.runtime.pipeline.wire import Traffic, Wire
from tandem.runtime.precision import StagePrecision
from tandem.runtime.tensor_parallel import local_tensor
from tandem.schedule import Action, Kind
from tandem.split import TensorSpec

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
    """Factor of its summed loss: 1 / samples in the whole (global) batch."""
    step: int
    """Optimizer step it belongs to (for the trace)."""
    inputs: Any = None
    """Model inputs (first stage only): a tensor, or a tuple or dict of tensors."""
    targets: Any = None
    """Targets (last stage only), for the loss."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StageShapes:
    """The tensors a stage receives and sends per micro-batch."""

    inputs: tuple[TensorSpec, ...] = ()
    """From the previous stage (none for the first)."""
    outputs: tuple[TensorSpec, ...] = ()
    """To the next stage (none for the last); gradients come back for those that require them."""


@dataclasses.dataclass(frozen=True, slots=True)
class Tie:
    """Parameters this stage shares with other stages, and the group of their workers."""

    group: dist.ProcessGroup
    stages: tuple[int, ...]
    params: list[nn.Parameter]
    scale: float
    """1 / the stage's replicas: after their allreduce each replica holds the stage's sum."""
    num_workers: int


def _select(values: Sequence[Any], specs: Sequence[TensorSpec]) -> list[Any]:
    """The ``values`` whose spec says a gradient comes back for them."""
    return [value for value, spec in zip(values, specs) if spec.requires_grad]


def _as_specs(outputs: Sequence[torch.Tensor],
              specs: Sequence[TensorSpec]) -> tuple[torch.Tensor, ...]:
    """``outputs`` in the dtypes of their boundary (autocast may have computed them in another)."""
    return tuple(t.to(spec.dtype) if t.dtype != spec.dtype else t
                 for t, spec in zip(outputs, specs))


def _or_zeros(grads: Sequence[torch.Tensor | None], like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, like)]


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
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    record: Record
    """The trace event of the receive action that posted it."""


class StageEngine:
    """Runs the actions of one worker, which holds one stage (or a replica of it)."""

    def __init__(self, *, module: nn.Module, stage: int, num_stages: int, shapes: StageShapes,
                 group: dist.ProcessGroup | None, links: dict[tuple[int, int], dist.ProcessGroup],
                 rank: int, num_replicas: int, optimizer: torch.optim.Optimizer,
                 scheduler: Any, device: torch.device, asynchronous: bool, vertical_sync: bool,
                 trace: Callable[..., None], beat: Any,
                 loss_fn: Callable[[Any, Any], torch.Tensor], wire: Wire | None = None,
                 ties: Sequence[Tie] = (), clone_received: bool = False,
                 precision: StagePrecision | None = None, recompute: bool = False,
                 rank_of: Callable[[int], int] | None = None) -> None:
        self.module, self.stage, self.device = module, stage, device
        self.first, self.last = stage == 0, stage == num_stages - 1
        self.shapes, self.group, self.num_replicas = shapes, group, num_replicas
        self.links, self.rank = links, rank
        self.rank_of = rank_of if rank_of is not None else (lambda worker: worker)
        """A schedule worker's process rank (with tensor parallelism: the process at this one's
        tensor position; ``rank`` and ``links`` are in schedule workers)."""
        self.optimizer, self.scheduler = optimizer, scheduler
        self.asynchronous, self.vertical_sync = asynchronous, vertical_sync
        self.trace, self.beat = trace, beat
        self.loss_fn = loss_fn
        """The last stage's loss: ``loss_fn(output, targets)``, the micro-batch's mean."""
        self.wire = wire if wire is not None else Wire()
        self.traffic = Traffic()
        self.ties = list(ties)
        self.clone_received = clone_received
        """Give the module copies of the received tensors (its first layer may update its
        input in place, which autograd forbids on a received leaf)."""
        self.precision = precision if precision is not None else StagePrecision("fp32", device)
        """Autocast of the forwards, the loss scale and clipping at the step."""
        self.stash = WeightVersions(module, vertical_sync=vertical_sync) if asynchronous else None
        self.recompute = Recompute(module) if recompute else None
        """Runs the forwards so that their backwards recompute them (None: they keep theirs)."""
        self.after_step: Callable[[int], None] | None = None
        """Called after each optimizer step with the step it belongs to (for the asynchronous
        schedule, its minibatch's): where a checkpoint can catch a stage's state in passing."""
        self.on_loss: Callable[[int, torch.Tensor, int], None] | None = None
        """The last stage calls it with each micro-batch's step, summed loss and samples (the
        asynchronous schedule computes a step's loss in another step's chunk of actions)."""
        self.unchanged_until_backward: set[int] = set()
        """Minibatches with no weight update between their forward and backward on this worker
        (PipeDream's last stage): they run on the live parameters, which is the same version."""
        self.on_live: set[int] = set()
        self.receives: dict[tuple[int, int], Receive] = {}
        self.records: collections.deque[Record] = collections.deque()
        """Trace events in action order, the first ones waiting for their receive to end."""
        self.sends: list[tuple[int, Any, torch.Tensor]] = []
        """Posted sends: (step, work, tensor kept alive until the send completes)."""
        self.saved: dict[int, tuple[list[torch.Tensor], Any, int]] = {}
        """Micro-batch -> (tensors received, outputs or scaled loss, weight version)."""
        self.input_grads: dict[int, list[torch.Tensor]] = {}
        self.param_grads: dict[int, list[torch.Tensor | None]] = {}
        self.versions: dict[int, int] = {}
        self.saved_bytes: dict[int, int] = {}
        self.peak_activation_bytes = 0
        self.loss_total = torch.zeros((), device=device)
        self.step = 0

    def execute(self, actions: Sequence[Action], batch: Callable[[int], Microbatch],
                step: int) -> torch.Tensor:
        """Run ``actions`` (part of optimizer step ``step``) in order; returns the loss computed
        here, summed over samples (unscaled)."""
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
            specs, channel = self.shapes.inputs, ACT
            if self.vertical_sync:
                version = torch.zeros(1, dtype=torch.int64, device=self.device)
                work = dist.irecv(version, src=self.rank_of(action.peer),
                                  tag=tag(m, VERSION), group=self.links[(action.peer, self.rank)])
                self.receives[(m, VERSION)] = Receive(work, version, ((1,),), (torch.int64,),
                                                      record)
                record.waits += 1
        else:
            specs, channel = tuple(_select(self.shapes.outputs, self.shapes.outputs)), GRAD
        shapes = tuple(spec.shape_at(micro.size) for spec in specs)
        dtypes = tuple(spec.dtype for spec in specs)
        buffer = self.wire.receive_many(shapes, dtypes, self.device)
        work = dist.irecv(buffer, src=self.rank_of(action.peer), tag=tag(m, channel),
                          group=self.links[(action.peer, self.rank)])
        self.receives[(m, channel)] = Receive(work, buffer, shapes, dtypes, record)
        record.num_bytes = buffer.numel() * buffer.element_size()

    def _arrived(self, microbatch: int, channel: int) -> Receive:
        """A posted receive, once its message has arrived."""
        receive = self.receives.pop((microbatch, channel))
        receive.work.wait()
        record = receive.record
        record.end = max(record.end, time.perf_counter())
        record.waits -= 1
        self._flush()
        return receive

    def _wait(self, microbatch: int, channel: int) -> list[torch.Tensor]:
        """The tensors of a posted receive, once they have arrived (decoded, for a codec)."""
        receive = self._arrived(microbatch, channel)
        return self.wire.unpack_many(receive.buffer, receive.shapes, receive.dtypes, KEYS[channel])

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
            tensors, channel = [t.detach() for t in self.saved[m][1]], ACT
            if self.vertical_sync:
                version = torch.tensor([self.versions[m]], dtype=torch.int64, device=self.device)
                work = dist.isend(version, dst=self.rank_of(action.peer),
                                  tag=tag(m, VERSION), group=self.links[(self.rank, action.peer)])
                self.sends.append((batch(m).step, work, version))
                self.traffic.other_bytes += version.numel() * version.element_size()
        else:
            tensors, channel = self.input_grads.pop(m), GRAD
        message = self.wire.pack_many(tensors, KEYS[channel], self.device)
        work = dist.isend(message, dst=self.rank_of(action.peer), tag=tag(m, channel),
                          group=self.links[(self.rank, action.peer)])
        self.sends.append((batch(m).step, work, message))
        num_bytes = message.numel() * message.element_size()
        self.traffic.activation_bytes += sum(t.numel() * t.element_size() for t in tensors)
        self.traffic.message_bytes += num_bytes
        self._record(action, start, batch(m).step, num_bytes=num_bytes)

    # -- compute --------------------------------------------------------------------------------

    def _weights_version(self, m: int) -> int:
        """The weight version minibatch ``m`` uses here (stage 0's under vertical sync)."""
        assert self.stash is not None
        if self.vertical_sync and not self.first:
            version = int(self._arrived(m, VERSION).buffer)
            self.stash.keep_from(version)
            return version
        return self.stash.version

    def _weights(self, version: int) -> set[int]:
        """Storages of the weights a forward of ``version`` runs on (live and stashed)."""
        stashed = self.stash.snapshots.get(version, {}).values() if self.stash else ()
        return storages([*self.module.parameters(), *stashed])

    def _forward(self, action: Action, batch: Callable[[int], Microbatch]) -> None:
        m = action.microbatch
        assert m is not None
        micro = batch(m)
        self.beat.step, self.beat.phase = micro.step, "forward"
        received: list[torch.Tensor] = []
        if self.first:
            x = micro.inputs
        else:
            received = self._wait(m, ACT)
            for tensor in _select(received, self.shapes.inputs):
                tensor.requires_grad_(True)
            given = [t.clone() if self.clone_received and t.requires_grad else t for t in received]
            x = given[0] if len(given) == 1 else tuple(given)
        assert x is not None
        version = self._weights_version(m) if self.stash else -1
        start = time.perf_counter()
        saved = [0]
        weights = self._weights(version)

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            saved[0] += saved_bytes(tensor, weights)
            return tensor

        params: dict[str, torch.Tensor] | None = None  # None: the live parameters
        if self.stash is not None:
            if m in self.unchanged_until_backward and version == self.stash.version:
                self.on_live.add(m)
            else:
                params = self.stash.acquire(version)

        def forward(x: Any) -> Any:  # run again by a recomputing backward: no side effects
            if params is None:
                return self.module(x)
            return functional_call(self.module, params, (x,))

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), \
                self.precision.autocast():
            if self.recompute is not None:
                self.recompute.weights = weights
                saved[0] += sum(saved_bytes(t, weights) for t in structures.tensors(x))
                out = self.recompute(forward, x)
            else:
                out = forward(x)
            if self.last:
                assert micro.targets is not None
                loss = self.loss_fn(out, micro.targets) * micro.size
                self.loss_total += loss.detach()
                if self.on_loss is not None:
                    self.on_loss(micro.step, loss.detach(), micro.size)
                out = loss * (micro.scale * self.precision.loss_factor)
            else:
                out = _as_specs(out if isinstance(out, tuple) else (out,), self.shapes.outputs)
        self.saved[m] = (received, out, version)
        self.versions[m] = version
        self.saved_bytes[m] = saved[0]
        self.peak_activation_bytes = max(self.peak_activation_bytes, sum(self.saved_bytes.values()))
        self._record(action, start, micro.step, version=version)

    def _backward(self, action: Action, batch: Callable[[int], Microbatch]) -> None:
        m = action.microbatch
        assert m is not None
        micro = batch(m)
        self.beat.step, self.beat.phase = micro.step, "backward"
        grads = [] if self.last else self._wait(m, GRAD)
        received, out, version = self.saved.pop(m)
        start = time.perf_counter()
        inputs = _select(received, self.shapes.inputs)
        outputs = [out] if self.last else _select(out, self.shapes.outputs)
        pairs = [(o, g) for o, g in zip(outputs, grads or [None] * len(outputs)) if o.requires_grad]
        if self.recompute is not None:
            self.recompute.weights = self._weights(version)
            self.recompute.bytes = 0
        if self.stash is not None:
            live = m in self.on_live
            self.on_live.discard(m)
            params = list(self.module.parameters() if live else self.stash.snapshots[version].values())
            found: Sequence[torch.Tensor | None] = [None] * (len(params) + len(inputs))
            if pairs:
                found = torch.autograd.grad([o for o, _ in pairs], [*params, *inputs],
                                            grad_outputs=[g for _, g in pairs], allow_unused=True)
            self.param_grads[m] = list(found[: len(params)])
            self.input_grads[m] = _or_zeros(found[len(params):], inputs)
            if not live:
                self.stash.release(version)
        else:
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            self.input_grads[m] = _or_zeros([t.grad for t in inputs], inputs)
        if self.first:
            self.input_grads.pop(m)
        if self.recompute is not None:
            self.peak_activation_bytes = max(self.peak_activation_bytes,
                                             sum(self.saved_bytes.values()) + self.recompute.bytes)
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
            grads = [local_tensor(p.grad) for p in self.module.parameters() if p.grad is not None]
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
        self._sum_tied()
        self.precision.step(self.optimizer, self.module.parameters())
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.stash is not None:
            self.stash.advance()
        self._record(action, start, step)
        if self.after_step is not None:
            self.after_step(step)

    def _sum_tied(self) -> None:
        """Sum the gradients of parameters shared with other stages over those stages."""
        for tie in self.ties:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in tie.params]
            flat = torch.cat([g.reshape(-1) for g in grads]) * tie.scale
            dist.all_reduce(flat, group=tie.group)
            offset = 0
            for p in tie.params:
                p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
                offset += p.numel()
            self.traffic.other_bytes += ring_bytes("allreduce", flat.numel() * flat.element_size(),
                                                   tie.num_workers)
