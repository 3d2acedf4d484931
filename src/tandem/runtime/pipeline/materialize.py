"""A pipeline stage's blocks taken off the meta device, with the weights the whole model has.

Usage::

    model = build_model("mlp", info, device="meta")      # no storage
    stage = materialize(model, 2, 4, Initializer(seed, by_name=True), device)

A built-in model's blocks are initialized by their names in the whole model, so a stage
builds its own blocks only. A user's ``nn.Sequential`` with ``--init-fn`` is initialized module
by module in the whole model's order from one seeded generator, as the whole model would be:
every block is built, one at a time, and a block of another stage is freed as soon as it is
complete (a tensor it shares with this stage's blocks, a tied weight, is kept). A model split
by tracing on the meta device is built so through the model itself, module by module, each
tensor no block of the stage holds freed as soon as its module is done; the blocks then take
the model's new tensors by name and their code the worker's device. Blocks that already hold
storage (a user's model built whole) are only moved to ``device``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from tandem.errors import UsageError
from tandem.models.init import initialize, owns_state
from tandem.models.pieces import (
    Initializer, materialize as build_in_pieces, on_meta, own_state,
)
from tandem.runtime.job import Job
from tandem.runtime.pipeline.setup import batches_vary, example_inputs
from tandem.runtime.pipeline.tensor_split import tensor_blocks
from tandem.split import SplitModel

logger = logging.getLogger(__name__)


def materialize(blocks: nn.Sequential, start: int, end: int, init: Initializer | None,
                device: torch.device, *, model: nn.Module | None = None) -> nn.Sequential:
    """Blocks ``start`` to ``end - 1`` of ``blocks`` (the whole model's) as one module on
    ``device``, given storage and the weights the whole model built under ``init`` has
    (``model``: the model a :class:`~tandem.split.SplitModel` was traced from)."""
    if isinstance(blocks, SplitModel) and init is not None and on_meta(blocks):
        assert model is not None, "a split's blocks are built through its model"
        _build_traced(blocks, model, start, end, init, device)
    elif init is not None and not init.by_name and on_meta(blocks):
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


def traced_blocks(job: Job, model: nn.Module, samples: Any, init: Initializer | None,
                  device: torch.device, *, what: str) -> SplitModel:
    """The blocks of ``model`` (not an ``nn.Sequential``: :func:`~tandem.runtime.pipeline.
    tensor_split.tensor_blocks`), traced where they run: on the meta device if ``model`` is
    there to be built in pieces by ``init`` (:func:`materialize` then builds a stage alone);
    else, or if its forward cannot run on the meta device (it makes a tensor on the CPU, say),
    on ``device``, the model built whole first. ``samples``: the data its example comes from."""
    if init is not None and on_meta(model):
        try:
            return _split(tensor_blocks(job, model, example_inputs(samples, meta=True),
                                        what=what, vary=batches_vary(samples)))
        except (UsageError, RuntimeError) as exc:  # raised again below if not the meta device's
            logger.debug(f"{what} is built whole: its trace on the meta device failed: {exc}")
        build_in_pieces(model, init, torch.device("cpu"))
    model.to(device)
    return _split(tensor_blocks(job, model, example_inputs(samples), what=what,
                                vary=batches_vary(samples)))


def _split(blocks: nn.Sequential) -> SplitModel:
    assert isinstance(blocks, SplitModel), "a model that is not an nn.Sequential is traced"
    return blocks


def _build_traced(blocks: SplitModel, model: nn.Module, start: int, end: int, init: Initializer,
                  device: torch.device) -> None:
    """Give the tensors of blocks ``start`` to ``end - 1`` storage: ``model``'s modules are
    built in turn (its own order, as built whole) and each tensor no block of the stage holds
    is freed as soon as its module is done; then every block holds ``model``'s tensors again
    and runs on ``device``. One line if a stage's block holds a tensor of the trace's own (a
    constant, which the meta device kept no value of)."""
    state = {name: tensor for block in list(blocks)[start:end]
             for name, tensor in (*block.named_parameters(remove_duplicate=False),
                                  *block.named_buffers(remove_duplicate=False))}
    held = {alias for name in state for alias in blocks.model_names(name)}
    constants = sorted(name for name, tensor in state.items()
                       if name.startswith("_constants.") and tensor.is_meta)
    if constants:
        raise UsageError(f"the model's forward makes tensor constants ({', '.join(constants)}) "
                         f"that its trace on the meta device holds no values of, so its stages "
                         f"cannot be built in pieces; drop --init-fn to build it whole")

    def free(unit: str) -> None:
        module = model.get_submodule(unit)
        for tensors in own_state(module):
            for key, tensor in tensors.items():
                if tensor is not None and not tensor.is_meta and \
                        ".".join(filter(None, (unit, key))) not in held:
                    tensors[key] = _meta_like(tensor)

    owners = [name for name, module in model.named_modules() if name and owns_state(module)]
    build_in_pieces(model, init, torch.device("cpu"), units=owners, done=free)
    blocks.bind(model)
    blocks.place_code(device)


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    empty = torch.empty_like(tensor, device="meta")
    return nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty


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
                    tensors[key] = _meta_like(tensor)

