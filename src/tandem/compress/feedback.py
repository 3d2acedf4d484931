"""Error feedback (1-bit SGD, EF-SGD): what a biased codec fails to send is added to the next step.

For each key, ``corrected = g + residual`` is encoded, and ``residual = corrected - sent``
keeps the part the message missed, so that over any number of steps::

    sum(sent) == sum(g) - residual

With ``momentum`` m > 0 the worker applies momentum before compressing, and the codec sends
the velocity ``u <- m u + g`` instead of ``g`` (the identity holds with ``u`` in place of
``g``); the optimizer must then apply no momentum of its own. For sparse codecs this is DGC's
momentum correction, with momentum factor masking (``masking``: ``u`` is cleared where a value
was sent); for sign it is the blockwise EF-SGD with momentum of Zheng et al. (2019).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tandem.compress.codec import Codec, Payload


class ErrorFeedback(Codec):
    """``inner`` with a residual (and optionally a velocity) per key."""

    def __init__(self, inner: Codec, momentum: float = 0.0, masking: bool = False) -> None:
        self.inner = inner
        self.summable = inner.summable
        self.momentum_correction = momentum
        self.masking = masking
        self.residuals: dict[str, torch.Tensor] = {}
        self.velocities: dict[str, torch.Tensor] = {}

    def start(self, rank: int, world_size: int) -> None:
        self.inner.start(rank, world_size)

    def encode(self, grad: torch.Tensor, key: str) -> Payload:
        update = self._velocity(grad, key) if self.momentum_correction else grad
        residual = self.residuals.get(key)
        if residual is not None and residual.device != update.device:
            residual = residual.to(update.device)  # restored from a checkpoint on the CPU
        corrected = update.clone() if residual is None else residual.add_(update)
        payload = self.inner.encode(corrected, key)
        sent = self.inner.decode(payload, corrected, key)
        self.residuals[key] = corrected.sub_(sent)
        if self.masking and self.momentum_correction:
            update.masked_fill_(sent != 0, 0.0)
        return payload

    def _velocity(self, grad: torch.Tensor, key: str) -> torch.Tensor:
        """``u <- m u + g`` for ``key`` (a new tensor the first time: ``grad`` is not changed)."""
        velocity = self.velocities.get(key)
        if velocity is not None and velocity.device != grad.device:
            velocity = self.velocities[key] = velocity.to(grad.device)
        if velocity is None:
            velocity = self.velocities[key] = grad.clone()
            return velocity
        return velocity.mul_(self.momentum_correction).add_(grad)

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": dict(self.residuals), "velocities": dict(self.velocities),
                "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = {key: value.clone() for key, value in state["residuals"].items()}
        self.velocities = {key: value.clone() for key, value in state["velocities"].items()}
        self.inner.load_state_dict(state["inner"])

    def decode(self, payload: Sequence[torch.Tensor], like: torch.Tensor, key: str) -> torch.Tensor:
        return self.inner.decode(payload, like, key)

    def decode_mean(self, payloads: Sequence[Sequence[torch.Tensor]], like: torch.Tensor,
                    key: str) -> torch.Tensor:
        return self.inner.decode_mean(payloads, like, key)
