"""Sparsification: send ``k`` of a tensor's elements (top-k by magnitude, or random-k).

Top-k (as in Deep Gradient Compression) sends each selected element's value and index, so
workers' payloads cover different positions and are exchanged by allgather. Random-k draws its
positions from a generator seeded identically on every worker for each tensor and step, so
every worker selects the same positions: the payload is the values alone, and workers' payloads
add up elementwise (an allreduce sums them). Both are biased alone; the registry wraps them in
error feedback unless ``ef=false``.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import torch

from tandem.spec.codec import num_selected
from tandem.compress.codec import Codec, Payload


class TopK(Codec):
    """``[values, indices (int32)]`` of the ``ceil(ratio * n)`` largest magnitudes."""

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio

    def encode(self, grad: torch.Tensor, key: str) -> Payload:
        flat = grad.reshape(-1)
        _, indices = torch.topk(flat.abs(), num_selected(flat.numel(), self.ratio), sorted=False)
        return [flat[indices], indices.to(torch.int32)]

    def decode(self, payload: Sequence[torch.Tensor], like: torch.Tensor, key: str) -> torch.Tensor:
        return self.decode_mean([payload], like, key)

    def decode_mean(self, payloads: Sequence[Sequence[torch.Tensor]], like: torch.Tensor,
                    key: str) -> torch.Tensor:
        values = torch.cat([payload[0] for payload in payloads]).to(like.dtype)
        indices = torch.cat([payload[1] for payload in payloads]).long()
        total = torch.zeros(like.numel(), dtype=like.dtype, device=like.device)
        total.index_add_(0, indices, values)
        if len(payloads) > 1:
            total /= len(payloads)
        return total.view_as(like)


class RandomK(Codec):
    """``[values]`` at ``ceil(ratio * n)`` positions drawn from a generator every worker shares.

    Positions are drawn with replacement (drawing without costs a permutation of all ``n``):
    a position drawn twice is sent twice and decoded once, so about ``k^2 / 2n`` fewer than
    ``k`` distinct elements go. At ratio 1 every element goes, once.

    The generator of a tensor is seeded from ``seed``, the tensor's key and how many times it
    was encoded, so workers agree as long as they encode the same tensors in the same steps.
    """

    summable = True

    def __init__(self, ratio: float, seed: int) -> None:
        self.ratio, self.seed = ratio, seed
        self.calls: dict[str, int] = {}
        self.indices: dict[str, torch.Tensor] = {}

    def encode(self, grad: torch.Tensor, key: str) -> Payload:
        flat = grad.reshape(-1)
        call = self.calls.get(key, 0)
        self.calls[key] = call + 1
        seed = (self.seed * 1_000_003 + zlib.crc32(key.encode()) * 7919 + call) % 2**63
        generator = torch.Generator().manual_seed(seed)
        count = num_selected(flat.numel(), self.ratio)
        if count == flat.numel():
            indices = torch.arange(count)
        else:
            indices = torch.randint(flat.numel(), (count,), generator=generator)
        indices = indices.to(flat.device)
        self.indices[key] = indices
        return [flat[indices]]

    def state_dict(self) -> dict[str, Any]:
        return {"calls": dict(self.calls)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls = dict(state["calls"])

    def decode(self, payload: Sequence[torch.Tensor], like: torch.Tensor, key: str) -> torch.Tensor:
        """Needs this step's :meth:`encode` of ``key`` (the positions are not sent)."""
        total = torch.zeros(like.numel(), dtype=like.dtype, device=like.device)
        total[self.indices[key]] = payload[0].to(like.dtype)
        return total.view_as(like)
