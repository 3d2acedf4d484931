"""Activation recomputation for a pipeline stage: its forward under non-reentrant checkpointing.

Usage::

    recompute = Recompute(stage_module)
    out = recompute(forward, x)            # keeps only ``x`` for the backward
    recompute.bytes = 0
    torch.autograd.backward(out, grad)     # runs ``forward`` again, then its backward
    recompute.bytes                        # what that recomputation saved for the backward

Each micro-batch in flight keeps only the stage's input; its backward runs the forward again
(:func:`torch.utils.checkpoint.checkpoint`, ``use_reentrant=False``, with the random state of
the first run, so dropout draws the same masks) and then differentiates it. The recomputation
puts the stage's buffers back as it found them, so BatchNorm's running statistics are updated
once per forward, as without recomputation. The bytes the recomputation saves are counted
through a saved-tensors hook stacked on the checkpoint's own (the stage's weights excepted).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint


def saved_bytes(tensor: torch.Tensor, weights: set[int]) -> int:
    """Bytes ``tensor`` adds to what autograd keeps: none for a view of the weights (their
    storage is held anyway), else its size (a DTensor's: its local shard's)."""
    tensor = _local(tensor)
    if tensor.device.type == "meta" or tensor.untyped_storage().data_ptr() in weights:
        return 0
    return tensor.numel() * tensor.element_size()


def storages(tensors: Any) -> set[int]:
    """The storage addresses of ``tensors`` (parameters, stashed weight versions; a DTensor's
    local shard's)."""
    return {_local(t).untyped_storage().data_ptr() for t in tensors}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel parameter's local shard (its DTensor has no storage of its own)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class Recompute:
    """Runs a stage's forward so that its backward recomputes it; counts what that saves."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.weights: set[int] = set()
        """Storages of the weights the forward runs on (not counted as saved bytes)."""
        self.bytes = 0
        """Bytes saved for the backward by the recomputations since it was last reset."""

    def __call__(self, forward: Callable[[Any], Any], x: Any) -> Any:
        """``forward(x)``, keeping only ``x`` (and the random state) for the backward."""
        return checkpoint(forward, x, use_reentrant=False, preserve_rng_state=True,
                          context_fn=lambda: (contextlib.nullcontext(), self._recomputing()))

    @contextlib.contextmanager
    def _recomputing(self) -> Iterator[None]:
        """The context of a recomputation: count what it saves, keep the buffers unchanged."""
        kept = [(buffer, buffer.detach().clone()) for buffer in self.module.buffers()]
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if hooks is None:  # pragma: no cover - the checkpoint always has its hook in place
            raise RuntimeError("recomputation without torch.utils.checkpoint's saved-tensor hook")
        outer_pack, outer_unpack = hooks

        def pack(tensor: torch.Tensor) -> Any:
            self.bytes += saved_bytes(tensor, self.weights)
            return outer_pack(tensor)

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, outer_unpack):
                yield
        finally:
            with torch.no_grad():
                for buffer, value in kept:
                    buffer.copy_(value)
