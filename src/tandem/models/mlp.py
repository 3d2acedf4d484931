"""A multi-layer perceptron as an ``nn.Sequential`` of blocks (flatten + linear + ReLU, ...)."""

from __future__ import annotations

import math

from torch import nn

from tandem.data.info import DataInfo
from tandem.spec.model import MLPOptions


def build_mlp(options: MLPOptions, info: DataInfo) -> nn.Sequential:
    """Blocks ``[Flatten, Linear, ReLU]``, ``[Linear, ReLU]`` x (layers - 2), then ``Linear``."""
    in_features = math.prod(info.input_shape)
    blocks: list[nn.Module] = [
        nn.Sequential(nn.Flatten(), nn.Linear(in_features, options.hidden), nn.ReLU())
    ]
    for _ in range(options.layers - 2):
        blocks.append(nn.Sequential(nn.Linear(options.hidden, options.hidden), nn.ReLU()))
    blocks.append(nn.Linear(options.hidden, info.num_classes))
    return nn.Sequential(*blocks)
