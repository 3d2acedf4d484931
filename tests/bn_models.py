"""Small models with buffers and unused parameters, for the data-parallel strategies' tests:
``--model tests.bn_models:NAME``."""

from __future__ import annotations

import torch
from torch import nn

from tandem.data.info import DataInfo


class Residual(nn.Module):
    """A ResNet basic block: conv, BatchNorm, ReLU, conv, BatchNorm, plus the input."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


class BatchNormNet(nn.Module):
    """A ResNet-like conv net with BatchNorm2d and a skip connection (not an nn.Sequential)."""

    def __init__(self, info: DataInfo, channels: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(info.input_shape[0], channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.block = Residual(channels)
        self.head = nn.Linear(channels, info.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block(torch.relu(self.bn(self.stem(x))))
        return self.head(x.mean(dim=(2, 3)))


def resnet(info: DataInfo) -> nn.Module:
    """:class:`BatchNormNet` with 8 channels."""
    return BatchNormNet(info)


class Unused(nn.Module):
    """A linear model with a layer ``forward`` never calls."""

    def __init__(self, info: DataInfo) -> None:
        super().__init__()
        features = 1
        for size in info.input_shape:
            features *= size
        self.used = nn.Linear(features, info.num_classes)
        self.spare = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x.flatten(1))


def unused(info: DataInfo) -> nn.Module:
    """:class:`Unused`: its ``spare`` layer gets no gradient."""
    return Unused(info)
