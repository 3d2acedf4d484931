"""A multi-layer perceptron as an ``nn.Sequential`` of blocks (flatten + linear + ReLU, ...)."""

from __future__ import annotations

import math

from torch import nn

from tandem.data.info import DataInfo
from tandem.spec.model import MLPOptions


class ReLULinear(nn.Linear):
    """An ``nn.Linear`` that a ReLU follows, initialized for it (He, Zhang, Ren and Sun,
    "Delving deep into rectifiers", 2015): weights normal with variance ``2 / in_features``,
    biases zero, so that the signal keeps its scale through the ReLU layers.

    ``nn.Linear``'s own initialization (uniform, variance ``1 / (3 in_features)``) shrinks it
    by about ``sqrt(6)`` a layer: the 4-layer mlp then starts on a plateau at the chance loss
    that synchronous SGD leaves after 50-75 steps on digits, and asynchronous training (stale
    gradients, little momentum) after 100-200 steps or, on some seeds, not in 300
    (docs/large_batch.md, "Asynchronous training")."""

    def reset_parameters(self) -> None:
        """He's initialization of the weight (fan in, ReLU gain); a zero bias."""
        nn.init.kaiming_normal_(self.weight, nonlinearity="relu")
        if self.bias is not None:
            nn.init.zeros_(self.bias)


def build_mlp(options: MLPOptions, info: DataInfo) -> nn.Sequential:
    """Blocks ``[Flatten, Linear, ReLU]``, ``[Linear, ReLU]`` x (layers - 2), then ``Linear``;
    the layers a ReLU follows are :class:`ReLULinear` (He's initialization), the last keeps
    ``nn.Linear``'s."""
    in_features = math.prod(info.input_shape)
    blocks: list[nn.Module] = [
        nn.Sequential(nn.Flatten(), ReLULinear(in_features, options.hidden), nn.ReLU())
    ]
    for _ in range(options.layers - 2):
        blocks.append(nn.Sequential(ReLULinear(options.hidden, options.hidden), nn.ReLU()))
    blocks.append(nn.Linear(options.hidden, info.num_classes))
    return nn.Sequential(*blocks)
