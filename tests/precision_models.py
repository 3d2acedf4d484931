"""Models for mixed precision in pipelines: ``--model tests.precision_models:NAME``."""

from __future__ import annotations

import torch
from torch import nn

from tandem.data.info import DataInfo


class GradientOverflow(nn.Module):
    """The identity, except on its ``at``-th training call: its output is unchanged but the
    gradient of its own weight is ~1e38 times too large, so that only the stage holding it
    overflows (the gradient it sends back stays finite)."""

    def __init__(self, at: int, shape: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shape))
        self.at, self.calls = at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == self.at:
                return x + (self.weight - self.weight.detach()) * 1e38 * x.float()
        return x + 0 * self.weight


def overflow(info: DataInfo, at: int = 3) -> nn.Module:
    """An ``nn.Sequential`` MLP whose last block overflows on its ``at``-th training forward (one
    per micro-batch): an fp16 run must skip that step on every stage."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(),
                         nn.Linear(32, info.num_classes), GradientOverflow(at))


def sharded_overflow(info: DataInfo, at: int = 3) -> nn.Module:
    """:func:`overflow` with a 1-element weight (FSDP2 shards no scalar): on 2 shards the weight
    is the first worker's alone, so only that worker's gradients overflow."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(),
                         nn.Linear(32, info.num_classes), GradientOverflow(at, (1,)))
