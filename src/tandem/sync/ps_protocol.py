"""Messages between parameter servers and workers, and how parameters are sharded over servers.

Every message is one float32 tensor: a 6-number header, then the shard (one message per
exchange, so each costs one network round trip):

    worker -> server   PUSH   [kind, step, version seen, loss sum, predictions, 0] + gradient shard
                       PULL   [kind, ...]                                          + (unused)
                       BYE    [kind, ...]                                          + (unused)
    server -> worker   PARAMS [kind, version, 0, 0, 0, stop]                       + parameter shard

Integers travel as float32, exact below 2**24 (16.7 million steps).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

import torch

PUSH, PULL, BYE, PARAMS = 1.0, 2.0, 3.0, 4.0
HEADER_SIZE = 6
TO_SERVER, TO_WORKER, GATHER = 11, 13, 15


def message(kind: float, payload: torch.Tensor | int, *, step: int = 0, version: int = 0,
            loss: float = 0.0, count: int = 0, stop: bool = False) -> torch.Tensor:
    """Header and payload in one tensor; an int payload means that many unused zeros."""
    head = torch.tensor([kind, step, version, loss, count, float(stop)], dtype=torch.float32)
    body = torch.zeros(payload) if isinstance(payload, int) else payload.to(torch.float32)
    return torch.cat([head, body])


def empty(payload_numel: int) -> torch.Tensor:
    """A receive buffer for a message with ``payload_numel`` payload elements."""
    return torch.empty(HEADER_SIZE + payload_numel, dtype=torch.float32)


def shard_ranges(sizes: Sequence[int], num_shards: int) -> list[tuple[int, int]]:
    """Split parameters (by element count, in order) into ``num_shards`` contiguous index ranges
    of near-equal total size; trailing shards are empty when there are more servers than tensors."""
    prefix = list(itertools.accumulate(sizes, initial=0))
    total = prefix[-1]
    cuts = [bisect.bisect_left(prefix, total * k / num_shards) for k in range(1, num_shards)]
    bounds = [0, *(min(cut, len(sizes)) for cut in cuts), len(sizes)]
    return list(zip(bounds[:-1], bounds[1:]))
