"""QSGD (Alistarh et al., 2017): unbiased stochastic quantization to ``s`` levels per sign.

The tensor is cut into chunks of ``chunk`` elements; each chunk is sent as its norm ``n`` and,
per element, a signed level ``l`` in ``[-s, s]``, decoded as ``n * l / s``. The level of
``|x| / n * s = f + p`` (``f`` its integer part) is ``f + 1`` with probability ``p`` and ``f``
otherwise, so every element decodes to ``x`` in expectation. Levels are packed into 2, 4 or 8
bits (``2 s + 1`` codes), norms take 4 bytes per chunk.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import torch

from tandem.compress import bits
from tandem.compress.codec import Codec, Payload

class QSGD(Codec):
    """Stochastic quantization; ``norm`` is ``l2`` (the paper's) or ``max`` (lower variance)."""

    def __init__(self, levels: int, chunk: int, norm: str, seed: int) -> None:
        self.levels, self.chunk, self.norm, self.seed = levels, chunk, norm, seed
        self.bits = bits.width_for(2 * levels + 1)
        self.rank = 0
        self.calls: dict[str, int] = {}

    def start(self, rank: int, world_size: int) -> None:
        # Workers draw independent roundings, so their errors average out instead of adding up.
        self.rank = rank

    def _generator(self, key: str) -> torch.Generator:
        """The rounding noise of this worker's next encoding of ``key``: seeded from the seed,
        the rank, the key and the call, so it does not depend on the order tensors come in
        (DDP reorders its buckets after the first step, also after a resume)."""
        call = self.calls.get(key, 0)
        self.calls[key] = call + 1
        mixed = (self.seed * 1_000_003 + self.rank) * 7919 + zlib.crc32(key.encode())
        return torch.Generator().manual_seed((mixed * 1_000_033 + call) % 2**63)

    def state_dict(self) -> dict[str, Any]:
        return {"calls": dict(self.calls)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls = dict(state["calls"])

    def _chunks(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(flat, (0, -flat.numel() % self.chunk)).view(-1, self.chunk)

    def encode(self, grad: torch.Tensor, key: str) -> Payload:
        chunks = self._chunks(grad.reshape(-1))
        if self.norm == "l2":
            norms = torch.linalg.vector_norm(chunks, dim=1, keepdim=True)
        else:
            norms = chunks.abs().amax(dim=1, keepdim=True)
        scaled = chunks.abs() / torch.where(norms > 0, norms, 1.0) * self.levels
        noise = torch.rand(scaled.shape, generator=self._generator(key), dtype=scaled.dtype)
        noise = noise.to(scaled.device)
        level = torch.floor(scaled + noise).clamp_(max=self.levels)
        codes = (torch.sign(chunks) * level + self.levels).to(torch.uint8)
        return [bits.pack(codes.reshape(-1)[: grad.numel()], self.bits), norms.reshape(-1)]

    def decode(self, payload: Sequence[torch.Tensor], like: torch.Tensor, key: str) -> torch.Tensor:
        packed, norms = payload
        codes = bits.unpack(packed, self.bits, like.numel()).to(like.dtype) - self.levels
        levels = self._chunks(codes)
        values = levels * (norms.to(like.dtype).unsqueeze(1) / self.levels)
        return values.reshape(-1)[: like.numel()].view_as(like)
