"""Models that are not an nn.Sequential, for automatic pipeline splitting:
``--model tests.split_models:NAME``."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from tandem.data.info import DataInfo


class SkipBatchNorm(nn.Module):
    """Conv stem, two residual stages with BatchNorm (the skip tensor crosses every cut inside
    a stage), and a linear head."""

    def __init__(self, channels: int, num_classes: int, width: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(channels, width, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.stem(x)))
        skip = x
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.head(torch.relu(y + skip).mean(dim=(2, 3)))


def skip_bn(info: DataInfo) -> nn.Module:
    """:class:`SkipBatchNorm` for the data's images."""
    return SkipBatchNorm(info.input_shape[0], info.num_classes)


class TiedLM(nn.Module):
    """A token model whose output layer is its input embedding (the same nn.Parameter)."""

    def __init__(self, vocab: int, dim: int = 16, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.out(self.norm(h))


def tied_lm(info: DataInfo, layers: int = 3) -> nn.Module:
    """:class:`TiedLM` for the data's vocabulary."""
    return TiedLM(info.num_classes, layers=layers)


class InPlace(nn.Module):
    """In-place updates of tensors that cross block boundaries, and a dict output."""

    def __init__(self, features: int, num_classes: int) -> None:
        super().__init__()
        self.first = nn.Linear(features, 16)
        self.second = nn.Linear(16, 16)
        self.third = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.first(x.flatten(1))
        g = self.second(torch.tanh(h))
        h.add_(g)           # h crossed the cuts before `second`
        h = torch.relu_(h)
        logits = self.third(h)
        logits.mul_(0.5)
        return {"logits": logits, "hidden": h}


def in_place(info: DataInfo) -> nn.Module:
    """:class:`InPlace` for the data's inputs."""
    return InPlace(math.prod(info.input_shape), info.num_classes)


class ValueBranch(nn.Module):
    """Branches on a tensor's value: torch.export cannot trace it."""

    def __init__(self, features: int, num_classes: int) -> None:
        super().__init__()
        self.first = nn.Linear(features, 8)
        self.second = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x.flatten(1))
        if h.sum() > 0:
            h = F.relu(h)
        return self.second(h)


def value_branch(info: DataInfo) -> nn.Module:
    """:class:`ValueBranch` for the data's inputs."""
    return ValueBranch(math.prod(info.input_shape), info.num_classes)


class Unbalanced(nn.Module):
    """Light linear layers and one block about ten times heavier than all of them together: a
    wide square weight applied several times (its own parameters, so it stays one block)."""

    def __init__(self, features: int, num_classes: int, width: int = 16, wide: int = 384,
                 repeats: int = 6) -> None:
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.up = nn.Linear(width, wide)
        self.heavy = Repeated(wide, repeats)
        self.down = nn.Linear(wide, width)
        self.light = nn.ModuleList(nn.Linear(width, width) for _ in range(4))
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(self.heavy(self.up(self.embed(x.flatten(1)))))
        for layer in self.light:
            h = torch.tanh(layer(h))
        return self.head(h)


class Repeated(nn.Module):
    """One square linear map and tanh, applied ``repeats`` times."""

    def __init__(self, width: int, repeats: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.repeats = repeats

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for _ in range(self.repeats):
            h = torch.tanh(F.linear(h, self.weight))
        return h


def unbalanced(info: DataInfo) -> nn.Module:
    """:class:`Unbalanced` for the data's inputs."""
    return Unbalanced(math.prod(info.input_shape), info.num_classes)


class Residual(nn.Module):
    """``x + relu(bn(linear(x)))`` with an in-place ReLU: a skip connection inside a block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu_(self.bn(self.linear(x)))


def tied_blocks(info: DataInfo) -> nn.Module:
    """An ``nn.Sequential`` of blocks with skip connections, BatchNorm and in-place ReLUs, the
    first residual block's layer tied to the last hidden layer (two stages apart)."""
    features = 1
    for size in info.input_shape:
        features *= size
    first, last = Residual(32), nn.Linear(32, 32)
    last.weight = first.linear.weight
    return nn.Sequential(nn.Flatten(), nn.Linear(features, 32), first, Residual(32), last,
                         nn.Linear(32, info.num_classes))
