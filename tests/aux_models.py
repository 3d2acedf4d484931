"""A user's model whose blocks pass a dict between them holding a 0-dim tensor (a running
auxiliary loss), a None and an int besides the activations, and return a dict with the logits
and the auxiliary loss: nothing in it was written for tandem."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tandem.data import DataInfo


class AuxBlock(nn.Module):
    """A residual block that adds its activations' mean square to the running auxiliary loss."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, state: dict[str, Any]) -> dict[str, Any]:
        hidden = state["hidden"] + torch.tanh(self.linear(state["hidden"]))
        return {"hidden": hidden, "aux": state["aux"] + 1e-3 * hidden.pow(2).mean(),
                "mask": None, "depth": state["depth"] + 1}


class Embed(nn.Module):
    """Inputs to the blocks' dict: the activations, a zero auxiliary loss, no mask, depth 0."""

    def __init__(self, features: int, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(features, dim)

    def forward(self, inputs: torch.Tensor) -> dict[str, Any]:
        hidden = self.linear(inputs.flatten(1))
        return {"hidden": hidden, "aux": hidden.new_zeros(()), "mask": None, "depth": 0}


class Head(nn.Module):
    """The logits and the auxiliary loss, as a dict."""

    def __init__(self, dim: int, classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, classes)

    def forward(self, state: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {"logits": self.linear(state["hidden"]), "aux": state["aux"]}


def aux_mlp(info: DataInfo, *, dim: int = 32, blocks: int = 3) -> nn.Sequential:
    """``Embed``, ``blocks`` ``AuxBlock``s, ``Head``: an ``nn.Sequential`` whose blocks pass
    dicts."""
    features = 1
    for size in info.input_shape:
        features *= size
    return nn.Sequential(Embed(features, dim), *(AuxBlock(dim) for _ in range(blocks)),
                         Head(dim, info.num_classes))


def aux_loss(output: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy plus the auxiliary loss."""
    return nn.functional.cross_entropy(output["logits"], target) + output["aux"]


class AuxNet(nn.Module):
    """The same blocks called in a loop by a module of the user's (not an ``nn.Sequential``:
    tandem traces it to split it)."""

    def __init__(self, info: DataInfo, dim: int = 32, blocks: int = 3) -> None:
        super().__init__()
        layers = aux_mlp(info, dim=dim, blocks=blocks)
        self.embed, self.head = layers[0], layers[-1]
        self.blocks = nn.ModuleList(layers[1:-1])

    def forward(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self.embed(inputs)
        for block in self.blocks:
            state = block(state)
        return self.head(state)


def aux_net(info: DataInfo) -> AuxNet:
    """:class:`AuxNet` with 3 blocks of width 32."""
    return AuxNet(info)
