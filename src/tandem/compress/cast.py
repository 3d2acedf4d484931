"""Half-precision casts (fp16, bf16): two bytes per element, summable by allreduce."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.compress.codec import Codec, Payload


class HalfPrecision(Codec):
    """Send the gradient cast to ``dtype``; the allreduce sums in that precision.

    The runtime divides each gradient by the number of workers before encoding a summable
    codec, so the sum of the casts stays in range (as PyTorch's ``fp16_compress_hook`` does).
    """

    summable = True

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def encode(self, grad: torch.Tensor, key: str) -> Payload:
        return [grad.to(self.dtype)]

    def decode(self, payload: Sequence[torch.Tensor], like: torch.Tensor, key: str) -> torch.Tensor:
        return payload[0].to(like.dtype).view_as(like)
