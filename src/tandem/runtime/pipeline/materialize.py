"""A pipeline stage's blocks taken off the meta device, with the weights the whole model has.

Usage::

    model = build_model("mlp", info, device="meta")      # no storage
    stage = materialize(model, 2, 4, Initializer(seed, by_name=True), device)

A built-in model's blocks are initialized by their names in the whole model, so a stage
builds its own blocks only. A user's ``nn.Sequential`` with ``--init-fn`` is initialized module
by module in the whole model's order from one seeded generator, as the whole model would be:
every block is built, one at a time, and a block of another stage is freed as soon as it is
complete (a tensor it shares with this stage's blocks, a tied weight, is kept). Blocks that
already hold storage (a user's model built whole) are only moved to ``device``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tandem.models.init import initialize
from tandem.models.pieces import (
    Initializer, materialize as build_in_pieces, on_meta, own_state,
)


def materialize(blocks: nn.Sequential, start: int, end: int, init: Initializer | None,
                device: torch.device) -> nn.Sequential:
    """Blocks ``start`` to ``end - 1`` of ``blocks`` (the whole model's) as one module on
    ``device``, given storage and the weights the whole model built under ``init`` has."""
    if init is not None and not init.by_name and on_meta(blocks):
        build_in_pieces(blocks, init, torch.device("cpu"),
                        units=[str(index) for index in range(len(blocks))],
                        done=_FreeOtherStages(blocks, start, end))
    stage = list(blocks)[start:end]
    for index, block in enumerate(stage, start):
        if on_meta(block):  # initialized on the CPU, as the whole model is, then moved
            if init is None:
                raise RuntimeError("blocks on the meta device need the model's initializer")
            block.to_empty(device="cpu")
            initialize(block, init.seed, prefix=str(index))
    return nn.Sequential(*stage).to(device)


class _FreeOtherStages:
    """``done(unit)`` of a build in pieces: a block of another stage goes back to the meta
    device, its modules' own entries replaced, except a tensor that several entries hold (a
    tied weight): it stays, so that the stages sharing it still find the tie."""

    def __init__(self, blocks: nn.Sequential, start: int, end: int) -> None:
        self.blocks, self.start, self.end = blocks, start, end
        holders: dict[int, int] = {}
        for module in blocks.modules():
            for tensors in own_state(module):
                for tensor in tensors.values():
                    if tensor is not None:
                        holders[id(tensor)] = holders.get(id(tensor), 0) + 1
        self.tied = {(id(module), key) for module in blocks.modules() for tensors in own_state(module)
                     for key, tensor in tensors.items()
                     if tensor is not None and holders[id(tensor)] > 1}
        """The entries (module, key) that hold a tensor another entry holds too."""

    def __call__(self, unit: str) -> None:
        if not unit or self.start <= int(unit) < self.end:
            return
        for module in self.blocks[int(unit)].modules():
            for tensors in own_state(module):
                for key, tensor in tensors.items():
                    if tensor is None or tensor.is_meta or (id(module), key) in self.tied:
                        continue
                    empty = torch.empty_like(tensor, device="meta")
                    tensors[key] = (nn.Parameter(empty, tensor.requires_grad)
                                    if isinstance(tensor, nn.Parameter) else empty)

