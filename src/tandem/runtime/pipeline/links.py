"""A stage's point-to-point traffic: the handlers of its schedule's sends and receives.

Each direction between two workers has its own process group (a *link*): NCCL runs all
point-to-point operations of one communicator in issue order, so sharing one between the
activations going forward and the gradients coming back could deadlock a 1F1B schedule.
Receives are posted (``irecv``) when their action comes and waited for only by the forward or
backward that consumes them; sends are posted (``isend``) and completed at the end of a step, so
communication overlaps compute wherever the schedule places it early. A receive's trace event
spans from its post to its message's arrival as seen by the computation that waits for it
(under vertical sync, the weight version's message too); a send's, its post.

Where batches vary in shape (a ``collate_fn`` pads each to its longest sample), an activation's
message follows a header with its tensors' shapes (``shape_header.py``), and its receive is
posted when its consumer needs it: the header must arrive before its buffer can be sized, and
NCCL matches a link's messages in the order they were posted. A gradient's shapes are those of
the activation this stage sent for the micro-batch, so it comes without a header.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from tandem.errors import UsageError
from tandem.runtime.executor import Executor, Span
from tandem.runtime.pipeline.shape_header import header_length, read_header, shape_header
from tandem.runtime.pipeline.wire import Traffic, Wire
from tandem.schedule import Action, Kind
from tandem.split import TensorSpec
from tandem.structures import Skeleton, SkeletonMismatch

ACT, GRAD, VERSION, SHAPES = 0, 1, 2, 3
KEYS = {ACT: "activation", GRAD: "gradient"}
"""What the codec is told each channel's tensors are."""


def tag(microbatch: int, channel: int) -> int:
    """Message tag of a micro-batch's activation, gradient, weight version or activation
    shapes (gloo matches on it)."""
    return microbatch * 4 + channel


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StageShapes:
    """The tensors a stage receives and sends per micro-batch."""

    inputs: tuple[TensorSpec, ...] = ()
    """From the previous stage (none for the first)."""
    outputs: tuple[TensorSpec, ...] = ()
    """To the next stage (none for the last); gradients come back for those that require them."""

    input_skeleton: Skeleton | None = None
    """The structure around the received tensors (None: a tensor, or a tuple of them)."""
    output_skeleton: Skeleton | None = None
    """The structure around the sent tensors (None: a tensor, or a tuple of them)."""

    @property
    def returned(self) -> tuple[TensorSpec, ...]:
        """The outputs whose gradients come back."""
        return tuple(spec for spec in self.outputs if spec.requires_grad)

    def assemble(self, received: Sequence[torch.Tensor]) -> Any:
        """What the stage's first block is called with: the received tensors in their
        structure."""
        if self.input_skeleton is not None:
            return self.input_skeleton.fill(received)
        return received[0] if len(received) == 1 else tuple(received)

    def sent(self, output: Any) -> tuple[torch.Tensor, ...]:
        """The tensors of the stage's output, to send; one line if its structure or other
        values differ from the first sample's."""
        if self.output_skeleton is None:
            return output if isinstance(output, tuple) else (output,)
        try:
            return self.output_skeleton.tensors_of(output)
        except SkeletonMismatch as error:
            raise UsageError(
                f"a stage passes {error} to the next one: a pipeline sends the "
                f"tensors between blocks and keeps their other values (None, numbers) as the "
                f"first sample had them; return a value of the same structure for every batch, "
                f"with tensors for what changes") from None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LinkSpec:
    """Who a stage talks to, and how: its schedule worker, the links, the wire."""

    worker: int
    """This stage's worker in the schedule (``links`` are keyed by schedule workers)."""
    links: dict[tuple[int, int], dist.ProcessGroup]
    """``(source, destination)`` worker -> the two-process group of that direction."""
    rank_of: Callable[[int], int]
    """A schedule worker's process rank (with tensor parallelism, the process at this one's
    tensor position)."""
    wire: Wire = dataclasses.field(default_factory=Wire)
    vertical_sync: bool = False
    """Activations carry the weight version stage 0 used (PipeDream's vertical sync)."""
    vary: bool = False
    """Batches vary in shape: activations follow a header with their shapes, and receives
    are posted when their consumer needs them."""


@dataclasses.dataclass(frozen=True, slots=True)
class Receive:
    """A posted receive: the buffer its message lands in and the tensors it will stand for."""

    work: Any
    buffer: torch.Tensor
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    span: Span
    """The trace event of the receive action that posted it."""


class StageLinks:
    """Posts a stage's receives and sends, and hands over what arrived."""

    def __init__(self, spec: LinkSpec, shapes: StageShapes, executor: Executor,
                 device: torch.device) -> None:
        self.spec, self.shapes, self.executor, self.device = spec, shapes, executor, device
        self.traffic = Traffic()
        self.receives: dict[tuple[int, int], Receive] = {}
        self.sends: list[tuple[int, Any, torch.Tensor]] = []
        """Posted sends: (step, work, tensor kept alive until the send completes)."""
        self.specs = {Kind.RECV_ACT: (shapes.inputs, ACT), Kind.RECV_GRAD: (shapes.returned, GRAD)}
        """What each kind of receive brings (resolved once)."""
        self.sizes: dict[tuple[int, int], tuple[tuple[tuple[int, ...], ...],
                                                tuple[torch.dtype, ...]]] = {}
        """(channel, samples) -> the shapes and dtypes of its tensors (worked out once)."""
        self.deferred: dict[tuple[int, int], tuple[int, Span]] = {}
        """Where batches vary: (micro-batch, channel) -> (peer, span) of a receive to post
        when its consumer needs it."""
        self.sent_shapes: dict[int, tuple[tuple[int, ...], ...]] = {}
        """Where batches vary: micro-batch -> the shapes of the activations sent for it whose
        gradients come back."""

    def group(self, source: int, destination: int) -> dist.ProcessGroup:
        return self.spec.links[(source, destination)]

    def receive(self, action: Action, span: Span, size: int) -> None:
        """Post the receive of ``action`` (micro-batch of ``size`` samples); ``span`` stays
        open until its consumer has the message."""
        m, peer = action.microbatch, action.peer
        assert m is not None and peer is not None
        spec, source = self.spec, self.spec.rank_of(peer)
        group = self.group(peer, spec.worker)
        span.waits = 1
        specs, channel = self.specs[action.kind]
        if spec.vary:
            if channel == ACT and spec.vertical_sync:
                span.waits += 1
            self.deferred[(m, channel)] = (peer, span)
            return
        if channel == ACT and spec.vertical_sync:
            version = torch.zeros(1, dtype=torch.int64, device=self.device)
            work = dist.irecv(version, src=source, tag=tag(m, VERSION), group=group)
            self.receives[(m, VERSION)] = Receive(work, version, ((1,),), (torch.int64,), span)
            span.waits += 1
        known = self.sizes.get((channel, size))
        if known is None:
            known = self.sizes[(channel, size)] = (tuple(s.shape_at(size) for s in specs),
                                                   tuple(s.dtype for s in specs))
        shapes, dtypes = known
        buffer = spec.wire.receive_many(shapes, dtypes, self.device)
        work = dist.irecv(buffer, src=source, tag=tag(m, channel), group=group)
        self.receives[(m, channel)] = Receive(work, buffer, shapes, dtypes, span)
        span.num_bytes = buffer.numel() * buffer.element_size()

    def _post_deferred(self, m: int, channel: int) -> None:
        """Post a receive deferred until now (batches vary): the weight version's under
        vertical sync, then the activation's header, waited for, then its message; a
        gradient's message has the shapes of the activation sent for ``m``."""
        peer, span = self.deferred.pop((m, channel))
        spec, source = self.spec, self.spec.rank_of(peer)
        group = self.group(peer, spec.worker)
        specs = self.specs[Kind.RECV_ACT if channel == ACT else Kind.RECV_GRAD][0]
        if channel == ACT:
            if spec.vertical_sync:
                version = torch.zeros(1, dtype=torch.int64, device=self.device)
                work = dist.irecv(version, src=source, tag=tag(m, VERSION), group=group)
                self.receives[(m, VERSION)] = Receive(work, version, ((1,),), (torch.int64,),
                                                      span)
            header = torch.empty(header_length(specs), dtype=torch.int64, device=self.device)
            dist.recv(header, src=source, tag=tag(m, SHAPES), group=group)
            shapes = read_header(header, specs)
        else:
            shapes = self.sent_shapes.pop(m)
        dtypes = tuple(s.dtype for s in specs)
        buffer = spec.wire.receive_many(shapes, dtypes, self.device)
        work = dist.irecv(buffer, src=source, tag=tag(m, channel), group=group)
        self.receives[(m, channel)] = Receive(work, buffer, shapes, dtypes, span)
        span.num_bytes = buffer.numel() * buffer.element_size()

    def arrived(self, microbatch: int, channel: int) -> Receive:
        """A posted receive, once its message has arrived."""
        if (microbatch, channel) in self.deferred:
            self._post_deferred(microbatch, channel)
        receive = self.receives.pop((microbatch, channel))
        receive.work.wait()
        self.executor.arrived(receive.span)
        return receive

    def wait(self, microbatch: int, channel: int) -> list[torch.Tensor]:
        """The tensors of a posted receive, once they have arrived (decoded, for a codec)."""
        receive = self.arrived(microbatch, channel)
        return self.spec.wire.unpack_many(receive.buffer, receive.shapes, receive.dtypes,
                                          KEYS[channel])

    def send(self, action: Action, span: Span, tensors: list[torch.Tensor], step: int,
             version: int | None = None) -> None:
        """Post the send of ``action``'s ``tensors`` (of optimizer step ``step``), with the
        weight version under vertical sync."""
        m, peer = action.microbatch, action.peer
        assert m is not None and peer is not None
        spec = self.spec
        destination, group = spec.rank_of(peer), self.group(spec.worker, peer)
        channel = ACT if action.kind is Kind.SEND_ACT else GRAD
        if version is not None:
            stamp = torch.tensor([version], dtype=torch.int64, device=self.device)
            work = dist.isend(stamp, dst=destination, tag=tag(m, VERSION), group=group)
            self.sends.append((step, work, stamp))
            self.traffic.other_bytes += stamp.numel() * stamp.element_size()
        if spec.vary and channel == ACT:
            header = shape_header(tensors, self.device)
            self.sends.append((step, dist.isend(header, dst=destination, tag=tag(m, SHAPES),
                                                group=group), header))
            self.traffic.other_bytes += header.numel() * header.element_size()
            self.sent_shapes[m] = tuple(tuple(t.shape) for t, s in
                                        zip(tensors, self.shapes.outputs) if s.requires_grad)
        message = spec.wire.pack_many(tensors, KEYS[channel], self.device)
        work = dist.isend(message, dst=destination, tag=tag(m, channel), group=group)
        self.sends.append((step, work, message))
        span.num_bytes = message.numel() * message.element_size()
        self.traffic.activation_bytes += sum(t.numel() * t.element_size() for t in tensors)
        self.traffic.message_bytes += span.num_bytes

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
