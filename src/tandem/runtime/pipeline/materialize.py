"""A pipeline stage's blocks taken off the meta device, with the weights the whole model has.

Usage::

    model = build_model("mlp", info, device="meta")      # no storage
    stage = materialize(list(model)[2:4], 2, seed, device)

Blocks that already hold storage (a user's model, built whole) are only moved to ``device``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tandem.models.init import initialize
from tandem.models.pieces import on_meta


def materialize(blocks: Sequence[nn.Module], start: int, seed: int,
                device: torch.device) -> nn.Sequential:
    """``blocks`` (the model's blocks ``start``, ``start + 1``, ...) as one module on ``device``:
    blocks on the meta device get storage there and are initialized under ``seed`` by their
    names in the whole model (``"5.0.weight"`` for block 5), as
    :func:`~tandem.models.build_model` initializes the whole model."""
    for index, block in enumerate(blocks, start):
        if on_meta(block):  # initialized on the CPU, as the whole model is, then moved
            block.to_empty(device="cpu")
            initialize(block, seed, prefix=str(index))
    return nn.Sequential(*blocks).to(device)
