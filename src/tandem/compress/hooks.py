"""DDP communication hooks that run a :class:`~tandem.compress.codec.Codec` on every bucket.

Usage::

    state, hook = codec.ddp_hook(model, ByteMeter(world_size=dist.get_world_size()))
    DistributedDataParallel(model).register_comm_hook(state, hook)

Outside DDP, :func:`exchange` runs the same exchange on a list of gradients within a process group
(the data dimension of a tensor-parallel job). Each parameter's gradient in the bucket is encoded
on its own (keyed by the parameter's name,
which survives DDP's rebuilding of buckets after the first step). Summable codecs encode
``g / W`` and allreduce one flat payload per bucket; the others serialize their payloads to
bytes, allgather them and decode the mean of all workers' messages. Every worker decodes the
same messages in the same order, so the replicas stay identical.

(No ``from __future__ import annotations`` here: DDP checks the hook's annotations as objects.)
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tandem.compress.meter import ByteMeter
from tandem.compress.payload import Payload, payload_bytes

if TYPE_CHECKING:  # codec.py builds these hooks
    from tandem.compress.codec import Codec


class CodecHookState:
    """The codec, the meter, and the parameter names the hook keys its state by."""

    def __init__(self, codec: "Codec", meter: ByteMeter, names: dict[int, str],
                 group: Any = None) -> None:
        self.codec = codec
        self.meter = meter
        self.names = names
        self.world_size = meter.world_size
        self.group = group
        """The process group the payloads travel in (None: the default group)."""
        self.started = False

    def keys(self, bucket: dist.GradBucket) -> list[str]:
        """The names of the bucket's parameters."""
        keys = [self.names.get(id(p)) for p in bucket.parameters()]
        assert None not in keys, "a bucket holds a parameter of another module"
        return keys  # type: ignore[return-value]


def codec_hook(state: CodecHookState,
               bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Encode, exchange and decode one bucket; the future holds the averaged gradients."""
    return _exchange(state, bucket.buffer(), bucket.gradients(), state.keys(bucket))


def exchange(state: CodecHookState, grads: Sequence[torch.Tensor], keys: Sequence[str]) -> None:
    """Replace ``grads`` (this worker's, in place) by the mean of every worker's in
    ``state.group``, as the codec's messages carry them (blocking)."""
    if not grads:
        return
    buffer = torch.cat([grad.reshape(-1) for grad in grads])
    views, offset = [], 0
    for grad in grads:
        views.append(buffer[offset: offset + grad.numel()].view_as(grad))
        offset += grad.numel()
    mean = _exchange(state, buffer, views, list(keys)).wait()
    offset = 0
    for grad in grads:
        grad.copy_(mean[offset: offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def _exchange(state: CodecHookState, buffer: torch.Tensor, grads: list[torch.Tensor],
              keys: list[str]) -> torch.futures.Future[torch.Tensor]:
    if not state.started:
        state.codec.start(dist.get_rank(), state.world_size)
        state.started = True
    gradient_bytes = buffer.numel() * buffer.element_size()
    if state.codec.summable:
        return _allreduce(state, buffer, grads, keys, gradient_bytes)
    return _allgather(state, buffer, grads, keys, gradient_bytes)


def _allreduce(state: CodecHookState, buffer: torch.Tensor, grads: list[torch.Tensor],
               keys: list[str], gradient_bytes: int) -> torch.futures.Future[torch.Tensor]:
    codec, world = state.codec, state.world_size
    payloads = [codec.encode(grad / world, key) for grad, key in zip(grads, keys)]
    assert all(len(p) == 1 for p in payloads), "a summable codec sends one tensor per gradient"
    flat = torch.cat([p[0].reshape(-1) for p in payloads])
    state.meter.add(payload_bytes=payload_bytes([flat]), gradient_bytes=gradient_bytes,
                    collective="allreduce")
    sizes = [p[0].numel() for p in payloads]
    shapes = [p[0].shape for p in payloads]

    def decode(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        summed = fut.value()[0]
        result = torch.empty_like(buffer)
        offset = 0
        for grad, key, chunk, shape in zip(grads, keys, torch.split(summed, sizes), shapes):
            mean = codec.decode([chunk.view(shape)], grad, key)
            result[offset : offset + grad.numel()].copy_(mean.reshape(-1))
            offset += grad.numel()
        return result

    work = dist.all_reduce(flat, group=state.group, async_op=True)
    future: torch.futures.Future[torch.Tensor] = work.get_future().then(decode)  # work: Any
    return future


def _allgather(state: CodecHookState, buffer: torch.Tensor, grads: list[torch.Tensor],
               keys: list[str], gradient_bytes: int) -> torch.futures.Future[torch.Tensor]:
    codec = state.codec
    payloads = [codec.encode(grad, key) for grad, key in zip(grads, keys)]
    template = [[(t.shape, t.dtype) for t in payload] for payload in payloads]
    packed = to_bytes([t for payload in payloads for t in payload])
    state.meter.add(payload_bytes=packed.numel(), gradient_bytes=gradient_bytes,
                    collective="allgather")
    gathered = [torch.empty_like(packed) for _ in range(state.world_size)]

    def decode(fut: torch.futures.Future[list[list[torch.Tensor]]]) -> torch.Tensor:
        fut.value()
        per_worker = [from_bytes(data, template) for data in gathered]
        result = torch.empty_like(buffer)
        offset = 0
        for index, (grad, key) in enumerate(zip(grads, keys)):
            mean = codec.decode_mean([worker[index] for worker in per_worker], grad, key)
            result[offset : offset + grad.numel()].copy_(mean.reshape(-1))
            offset += grad.numel()
        return result

    work = dist.all_gather(gathered, packed, group=state.group, async_op=True)
    future: torch.futures.Future[torch.Tensor] = work.get_future().then(decode)  # work: Any
    return future


def to_bytes(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' contents, concatenated as one ``uint8`` tensor."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def from_bytes(data: torch.Tensor,
               template: Sequence[Sequence[tuple[torch.Size, torch.dtype]]]) -> list[Payload]:
    """Split :func:`to_bytes`'s output back into payloads shaped like ``template``."""
    payloads: list[Payload] = []
    offset = 0
    for shapes in template:
        payload: Payload = []
        for shape, dtype in shapes:
            size = shape.numel() * torch.empty((), dtype=dtype).element_size()
            payload.append(data[offset : offset + size].clone().view(dtype).view(shape))
            offset += size
        payloads.append(payload)
    return payloads
