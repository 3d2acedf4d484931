"""Residual networks as an ``nn.Sequential`` of blocks: CIFAR-style (depth 6n+2) and the
ImageNet layouts (ResNet-18/34/50/101/152, ResNet-50 being bottleneck blocks [3, 4, 6, 3])."""

from __future__ import annotations


import torch
from torch import nn

from tandem.data.info import DataInfo
from tandem.spec.model import IMAGENET_LAYOUTS, ResNetOptions


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a shortcut."""

    expansion = 1

    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, channels, 3, stride, 1, bias=False), nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, 1, 1, bias=False), nn.BatchNorm2d(channels),
        )
        self.shortcut = _shortcut(in_channels, channels, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4), with a shortcut."""

    expansion = 4

    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        out = channels * self.expansion
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, channels, 1, bias=False), nn.BatchNorm2d(channels), nn.ReLU(),
            nn.Conv2d(channels, channels, 3, stride, 1, bias=False), nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, out, 1, bias=False), nn.BatchNorm2d(out),
        )
        self.shortcut = _shortcut(in_channels, out, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def _shortcut(in_channels: int, out_channels: int, stride: int) -> nn.Module:
    if stride == 1 and in_channels == out_channels:
        return nn.Identity()
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels)
    )


def _stem(layout: str, in_channels: int, width: int, image_size: int) -> nn.Sequential:
    if layout == "imagenet" and image_size >= 64:
        return nn.Sequential(
            nn.Conv2d(in_channels, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.MaxPool2d(3, 2, 1),
        )
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
    )


def build_resnet(options: ResNetOptions, info: DataInfo) -> nn.Sequential:
    """Stem, one module per residual block, then pooling and the classifier."""
    layout = options.resolved_layout()
    if layout == "imagenet":
        kind, counts = IMAGENET_LAYOUTS[options.depth]
        width = options.width or 64
    else:
        kind, counts = "basic", ((options.depth - 2) // 6,) * 3
        width = options.width or 16
    block_cls = BasicBlock if kind == "basic" else Bottleneck
    in_channels, image_size = info.input_shape[0], info.input_shape[-1]
    blocks: list[nn.Module] = [_stem(layout, in_channels, width, image_size)]
    channels_in = width
    for stage_index, count in enumerate(counts):
        channels = width * 2**stage_index
        for block_index in range(count):
            stride = 2 if stage_index > 0 and block_index == 0 else 1
            blocks.append(block_cls(channels_in, channels, stride))
            channels_in = channels * block_cls.expansion
    blocks.append(
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels_in, info.num_classes))
    )
    return nn.Sequential(*blocks)
