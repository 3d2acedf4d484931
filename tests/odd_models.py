"""Models whose output does not suit the data, for the checks made before training:
``--model tests.odd_models:NAME``."""

from __future__ import annotations

import math

import torch
from torch import nn

from tandem.data.info import DataInfo


def linear(info: DataInfo, outputs: int) -> nn.Module:
    """Flatten and one linear layer with ``outputs`` outputs (whatever the data's classes)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(info.input_shape), outputs))


def three_outputs(info: DataInfo) -> nn.Module:
    """3 logits per sample: fewer than the digits' 10 classes."""
    return linear(info, 3)


def seventeen_outputs(info: DataInfo) -> nn.Module:
    """17 logits per sample: more than the digits' 10 classes."""
    return linear(info, 17)


class _Pair(nn.Module):
    def __init__(self, info: DataInfo) -> None:
        super().__init__()
        self.inner = linear(info, info.num_classes)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.inner(x)
        return logits, logits


def pair_output(info: DataInfo) -> nn.Module:
    """Returns a tuple of two logits tensors instead of one tensor."""
    return _Pair(info)


class _Named(nn.Module):
    def __init__(self, info: DataInfo) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, info.num_classes))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"scores": self.body(x)}


def named_output(info: DataInfo) -> nn.Module:
    """Returns a dict whose tensor is not called ``logits``: the default loss finds none."""
    return _Named(info)


def wrong_input(info: DataInfo) -> nn.Module:
    """Expects 28x28 images (784 features), not the data's own."""
    return nn.Sequential(nn.Flatten(), nn.Linear(784, info.num_classes))


class _Overflow(nn.Module):
    def __init__(self, info: DataInfo, at: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(),
                                  nn.Linear(32, info.num_classes))
        self.at, self.calls = at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.body(x)
        if self.training:
            self.calls += 1
            if self.calls == self.at:  # a forced overflow: this step's gradients are inf
                return logits * torch.tensor(float("inf"), dtype=logits.dtype)
        return logits


def overflow(info: DataInfo, at: int = 3) -> nn.Module:
    """Overflows on its ``at``-th training forward (an fp16 run must skip that step)."""
    return _Overflow(info, at)
