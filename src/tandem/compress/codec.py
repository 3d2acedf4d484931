"""The interface of gradient compression: per-tensor codecs and whole-hook compressions.

A :class:`Codec` turns one gradient tensor into a short list of payload tensors and back. The
data-parallel runtime sends the payloads of every worker (by allreduce when the codec is
``summable``, else by allgather) and decodes their mean. A :class:`Compression` that is not a
per-tensor codec (PowerSGD's two-round protocol) supplies its own DDP communication hook.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from tandem.compress.hooks import CodecHookState, codec_hook
from tandem.compress.payload import Payload, payload_bytes

if TYPE_CHECKING:
    from tandem.compress.meter import ByteMeter

__all__ = ["Codec", "Compression", "Payload", "payload_bytes"]


class Compression(abc.ABC):
    """A way to shrink the gradients data parallelism exchanges every step."""

    spec: str = ""
    """The ``CODEC[:k=v,...]`` text it was built from (set by the registry)."""
    momentum_correction: float = 0.0
    """Momentum the compression applies itself (DGC); the optimizer must then apply none."""

    resumable: bool = True
    """Whether :meth:`state_dict` captures everything a resumed run needs."""

    @abc.abstractmethod
    def ddp_hook(self, model: nn.Module, meter: ByteMeter) -> tuple[Any, Callable[..., Any]]:
        """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook`` of ``model``
        (the module DDP wraps), counting into ``meter`` the bytes it sends."""

    def state_dict(self) -> dict[str, Any]:
        """This worker's state (error-feedback residuals, random streams), for checkpoints."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s output (before the first step of a resumed run)."""


class Codec(Compression):
    """Encode a gradient into payload tensors and decode it back, one tensor at a time.

    ``key`` names the tensor (its parameter), so that stateful codecs keep one state per
    parameter: error-feedback residuals, momentum, shared random indices. Every worker calls
    ``encode`` once per key per step, in the same order.
    """

    summable: bool = False
    """Payloads of different workers add up elementwise to the payload of the summed
    gradient (``decode(p1 + p2) == decode(p1) + decode(p2)``), so an allreduce can sum them."""

    def start(self, rank: int, world_size: int) -> None:
        """Called once in each worker before the first step (seeds per-worker randomness)."""

    @abc.abstractmethod
    def encode(self, grad: torch.Tensor, key: str) -> Payload:
        """The payload of ``grad``."""

    @abc.abstractmethod
    def decode(self, payload: Sequence[torch.Tensor], like: torch.Tensor, key: str) -> torch.Tensor:
        """The tensor ``payload`` stands for, with the shape and dtype of ``like``."""

    def decode_mean(self, payloads: Sequence[Sequence[torch.Tensor]], like: torch.Tensor,
                    key: str) -> torch.Tensor:
        """The mean of the tensors that every worker's payload stands for."""
        total = self.decode(payloads[0], like, key)
        for payload in payloads[1:]:
            total += self.decode(payload, like, key)
        return total / len(payloads)

    def ddp_hook(self, model: nn.Module, meter: ByteMeter) -> tuple[Any, Callable[..., Any]]:
        names = {id(p): name for name, p in model.named_parameters()}
        return CodecHookState(self, meter, names), codec_hook

