"""Synchronous data parallelism by gradient allreduce, through PyTorch's DistributedDataParallel.

Buffers (BatchNorm's running statistics) follow DDP's default: rank 0's are broadcast to the
other workers before every forward, and once more after the last one, so that every worker, and
``final.pt``, holds rank 0's.

With ``--compress CODEC``, a DDP communication hook encodes each bucket's gradients, exchanges
the payloads (allreduce when they can be summed, allgather otherwise) and decodes their mean;
see :mod:`tandem.compress`.

For the gradient noise scale a measured step records its local and averaged squared gradient
norms in :attr:`AllReduce.bucket_norms`. Without a codec DDP reduces with its own allreduce,
overlapped with the backward as always: each parameter's gradient is read as it is accumulated
(before the reduction replaces it), and the averaged ones after the backward. With a codec, the
codec's hook is wrapped by :func:`~tandem.sync.grad_norms.measured_hook`. Either way only the
steps the trainer arms are measured.
"""

from __future__ import annotations

from typing import Any, ContextManager, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tandem.compress import ByteMeter, Compression, build_compression
from tandem.spec.codec import CodecSpec
from tandem.sync.base import SyncStrategy
from tandem.sync.flat import broadcast_buffers
from tandem.sync.grad_norms import BucketNorms, MeasuredHookState, measured_hook, squared_sum


class AllReduce(SyncStrategy):
    """DDP: gradients are averaged in buckets during backward, overlapping with compute."""

    overlapped_allreduce = True

    name = "dp"

    def __init__(self, compress: CodecSpec | str | None = None) -> None:
        self.compression: Compression | None = build_compression(compress) if compress else None
        self.meter = ByteMeter(world_size=1)
        self.steps = 0
        self.bucket_norms = BucketNorms()
        """Squared norms of this worker's gradient and of the averaged one, per step."""
        self._parameters: list[nn.Parameter] | None = None
        self._gradient_bytes: int | None = None
        """Bytes of the gradients DDP reduces each step (all of them, without unused ones)."""
        self._reading: list[Any] = []
        """The hooks reading a measured step's local gradients (see :meth:`arm`)."""
        self._local_norms: list[torch.Tensor] = []
        """Their norms (float32 scalars, squared and summed in float64 at the end)."""

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        model = model.to(device)
        device_ids = [device] if device.type == "cuda" else None
        module = DistributedDataParallel(model, device_ids=device_ids,
                                         find_unused_parameters=self.find_unused_parameters)
        self.meter = ByteMeter(world_size=dist.get_world_size())
        if self.compression is not None:
            state, hook = self.compression.ddp_hook(model, self.meter)
            module.register_comm_hook(MeasuredHookState(self.bucket_norms, state, hook),
                                      measured_hook)
        return module

    @property
    def measures_in_hook(self) -> bool:
        """Whether the noise scale's norms are read by the codec's communication hook (which
        runs on every bucket anyway). Otherwise DDP reduces with its own allreduce, and a
        measured step reads this worker's gradients as they are accumulated (:meth:`arm`) and
        the averaged ones after the backward (:meth:`finish_measuring`)."""
        return self.compression is not None

    def arm(self, module: nn.Module) -> None:
        """The backward that comes next is a measured step's last: read each parameter's
        gradient once it is accumulated, before DDP's reduction replaces it by the average
        (hooks added for this backward only, so that other steps run none)."""
        local = self._local_norms

        def read(param: torch.Tensor) -> None:
            if param.grad is not None:
                local.append(torch.linalg.vector_norm(param.grad.detach().float()))

        self._reading = [param.register_post_accumulate_grad_hook(read)  # type: ignore[no-untyped-call]
                         for param in self._listed(module) if param.requires_grad]

    def finish_measuring(self, module: nn.Module) -> None:
        """After a measured step's last backward (DDP has averaged the gradients): record its
        squared norms, this worker's and the averaged one, for the noise scale."""
        for handle in self._reading:
            handle.remove()
        self._reading = []
        if not self._local_norms:
            return
        local = squared_sum(self._local_norms)
        self._local_norms.clear()
        grads = [p.grad.detach().float() for p in self._listed(module) if p.grad is not None]
        self.bucket_norms.record(local, squared_sum(torch._foreach_norm(grads)))

    def _listed(self, module: nn.Module) -> list[nn.Parameter]:
        """The model's parameters, listed once (they do not change)."""
        if self._parameters is None:
            self._parameters = list(module.parameters())
        return self._parameters

    def state_dict(self) -> dict[str, Any]:
        """The codec's state (error-feedback residuals, random streams)."""
        return {"codec": self.compression.state_dict()} if self.compression else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.compression is not None and "codec" in state:
            self.compression.load_state_dict(state["codec"])

    def unwrap(self, module: nn.Module) -> nn.Module:
        inner: nn.Module = cast(DistributedDataParallel, module).module
        return inner

    def accumulating(self, module: nn.Module) -> ContextManager[None]:
        return cast(DistributedDataParallel, module).no_sync()

    def consensus(self, module: nn.Module) -> None:
        """Rank 0's buffers, as DDP would broadcast them before another forward (each worker's
        last forward updated its own)."""
        broadcast_buffers(self.unwrap(module))

    def update(self, module: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> bool:
        if self.compression is None:
            self._count_plain_allreduce(module)
        self.steps += 1
        return super().update(module, optimizer, step)

    def _count_plain_allreduce(self, module: nn.Module) -> None:
        """DDP's own allreduce sends every gradient that exists (unused parameters have none:
        counted each step with ``--find-unused-parameters``, else once, every parameter having
        one, as :meth:`check_gradients` has made sure)."""
        num_bytes = self._gradient_bytes
        if num_bytes is None or self.find_unused_parameters:
            num_bytes = sum(p.grad.numel() * p.grad.element_size() for p in self._listed(module)
                            if p.grad is not None)
            self._gradient_bytes = num_bytes
        self.meter.add(payload_bytes=num_bytes, gradient_bytes=num_bytes, collective="allreduce")

    def stats(self) -> dict[str, float]:
        """Bytes per step of this worker divided by the number of workers (the summary adds the
        workers' stats up, so it shows their mean), and ``sync_bytes``: all bytes sent.

        ``compressed_bytes_per_step`` is what the worker hands to collectives per step and
        ``uncompressed_bytes_per_step`` its gradient's size; the ``wire_`` figures are what it
        sends assuming ring collectives (an allgather forwards every other worker's payload).
        """
        meter, world = self.meter, self.meter.world_size
        steps = max(1, self.steps)
        ratio = meter.gradient_bytes / meter.payload_bytes if meter.payload_bytes else 1.0
        return {
            "compressed_bytes_per_step": meter.payload_bytes / steps / world,
            "uncompressed_bytes_per_step": meter.gradient_bytes / steps / world,
            "compression_ratio": ratio / world,
            "wire_bytes_per_step": meter.wire_bytes / steps / world,
            "uncompressed_wire_bytes_per_step": meter.uncompressed_wire_bytes / steps / world,
            "sync_bytes": meter.wire_bytes,
        }
