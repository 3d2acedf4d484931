"""Messages between parameter servers and workers, and how parameters are sharded over servers.

Every message is a small float64 header, followed for pushes and replies by a float32 payload:

    worker -> server   PUSH  [kind, step, version seen, loss sum, predictions, 0]  + gradient shard
                       PULL  [kind, ...]                                             (no payload)
                       BYE   [kind, ...]                                             (no payload)
    server -> worker   PARAMS [kind, version, 0, 0, 0, stop]                          + parameter shard
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

import torch

PUSH, PULL, BYE, PARAMS = 1.0, 2.0, 3.0, 4.0
HEADER_SIZE = 6
TO_SERVER, TO_SERVER_PAYLOAD, TO_WORKER, TO_WORKER_PAYLOAD = 11, 12, 13, 14


def header(kind: float, step: int = 0, version: int = 0, loss: float = 0.0, count: int = 0,
           stop: bool = False) -> torch.Tensor:
    """A message header."""
    return torch.tensor([kind, step, version, loss, count, float(stop)], dtype=torch.float64)


def shard_ranges(sizes: Sequence[int], num_shards: int) -> list[tuple[int, int]]:
    """Split parameters (by element count, in order) into ``num_shards`` contiguous index ranges
    of near-equal total size; trailing shards are empty when there are more servers than tensors."""
    prefix = list(itertools.accumulate(sizes, initial=0))
    total = prefix[-1]
    cuts = [bisect.bisect_left(prefix, total * k / num_shards) for k in range(1, num_shards)]
    bounds = [0, *(min(cut, len(sizes)) for cut in cuts), len(sizes)]
    return list(zip(bounds[:-1], bounds[1:]))
