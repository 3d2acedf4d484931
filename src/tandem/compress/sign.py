"""1-bit sign compression with a scale (signSGD's message, EF-SignSGD's scale).

Each tensor is sent as one bit per element and one number: ``scale * sign(x)`` with
``scale = mean |x|``, so that the message has the tensor's L1 norm (Karimireddy et al., 2019).
Biased on its own; the registry wraps it in error feedback unless ``ef=false``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.compress import bits
from tandem.compress.codec import Codec, Payload


class Sign(Codec):
    """``[packed sign bits (uint8), scale (1 element)]``; zero is sent as ``+scale``."""

    def encode(self, grad: torch.Tensor, key: str) -> Payload:
        flat = grad.reshape(-1)
        scale = flat.abs().sum() / max(1, flat.numel())
        return [bits.pack(flat >= 0, 1), scale.reshape(1)]

    def decode(self, payload: Sequence[torch.Tensor], like: torch.Tensor, key: str) -> torch.Tensor:
        packed, scale = payload
        positive = bits.unpack(packed, 1, like.numel()).to(like.dtype)
        scale = scale.to(like.dtype)
        return (positive * (2 * scale) - scale).view_as(like)
