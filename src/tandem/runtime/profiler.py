"""Measure every top-level block of an ``nn.Sequential`` on the local device into a ModelProfile.

Usage::

    profile = profile_model(model, inputs, warmup=2, repeats=5)

Any other model is profiled as the blocks of its automatic split (:mod:`tandem.split`): a
block takes and returns tuples of tensors, and the last returns the model's own output.

Each block runs on the previous block's real output: forward is timed alone, backward is timed
from a fixed random output gradient back to the block's input and parameters. Times are the
median of ``repeats`` runs after ``warmup`` runs; CUDA work is synchronized before each reading.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from tandem.errors import UsageError
from tandem.profile import LayerProfile, ModelProfile


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    _sync(device)
    started = time.perf_counter()
    result = fn()
    _sync(device)
    return time.perf_counter() - started, result


def _tensors(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        fresh = value.detach()
        return fresh.requires_grad_(True) if fresh.is_floating_point() else fresh
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(item) for item in value)
    return value


def _measure_block(block: nn.Module, inputs: Any, warmup: int, repeats: int,
                   device: torch.device) -> tuple[float, float, Any]:  # fmt: skip
    forward: list[float] = []
    backward: list[float] = []
    output: Any = None
    for run in range(warmup + repeats):
        block.zero_grad(set_to_none=True)
        fresh = _detached(inputs)
        seconds, output = _timed(lambda: block(fresh), device)
        outs = [t for t in _tensors(output) if t.requires_grad]
        grads = [torch.ones_like(t) for t in outs]
        back_s = _timed(lambda: torch.autograd.backward(outs, grads), device)[0] if outs else 0.0
        if run >= warmup:
            forward.append(seconds)
            backward.append(back_s)
    return statistics.median(forward), statistics.median(backward), output


def _first(inputs: Any, samples: int = 2) -> Any:
    """The first ``samples`` samples of a batch (batch in dim 0 of every tensor)."""
    return pytree.tree_map(lambda t: t[:samples] if isinstance(t, torch.Tensor) else t, inputs)


def profile_model(
    model: nn.Module, inputs: Any, *, warmup: int = 2, repeats: int = 5, model_name: str = "",
    split_points: list[str] | None = None,
) -> ModelProfile:  # fmt: skip
    """Profile each top-level block of ``model`` on one minibatch (``inputs``, as the model is
    called with them); a model that is not an ``nn.Sequential`` is split first (before the
    submodules ``split_points``, or automatically)."""
    if repeats < 1 or warmup < 0:
        raise UsageError(f"need repeats >= 1 and warmup >= 0 (got {repeats}, {warmup})")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if not isinstance(model, nn.Sequential):
        from tandem.split import split_model

        model = split_model(model, _first(inputs), split_points=split_points,
                            what=f"model {model_name or type(model).__name__!r}")
    layers: list[LayerProfile] = []
    value = inputs
    for index, block in enumerate(model):
        forward_s, backward_s, output = _measure_block(block, value, warmup, repeats, device)
        params = sum(p.numel() * p.element_size() for p in block.parameters())
        layers.append(LayerProfile(
            name=f"{index}: {getattr(block, 'label', type(block).__name__)}",
            forward_s=forward_s, backward_s=backward_s,
            activation_bytes=float(_nbytes(output)), parameter_bytes=float(params)))  # fmt: skip
        value = _detached(output)
    batch = _tensors(inputs)[0].shape[0] if _tensors(inputs) else None
    return ModelProfile(layers=layers, model=model_name, batch_size=batch,
                        source=f"tandem profile on {device}")  # fmt: skip
