"""Measure every top-level block of an ``nn.Sequential`` on the local device into a ModelProfile.

Usage::

    profile = profile_model(model, inputs, warmup=2, repeats=5)

Any other model is profiled as the blocks of its automatic split (:mod:`tandem.split`): a
block takes and returns tuples of tensors, and the last returns the model's own output.

Each block runs on the previous block's real output: forward is timed alone, backward is timed
from a fixed random output gradient back to the block's input and parameters. Times are the
median of ``repeats`` runs after ``warmup`` runs; CUDA work is synchronized before each reading.

The fixed cost per call (kernel launches, framework dispatch: what a micro-batch pays however
small it is) is fitted per block: the block is also timed on the first half, quarter and eighth
of the batch (at least 2 samples; :func:`fit_batches`), and a least-squares line
``t(b) = fixed + per_sample * b`` through the medians gives ``fixed``, clamped to
``[0, t(batch)]``. A batch too small for two sizes gets the documented defaults
(:func:`tandem.profile.with_default_fixed`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from tandem.errors import UsageError
from tandem.profile import LayerProfile, ModelProfile, with_default_fixed


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


def fit_batches(batch: int) -> list[int]:
    """Batch sizes a block is timed at to fit its fixed cost: ``batch`` and its half, quarter
    and eighth (at least 2 samples, as batch normalization needs), smallest first."""
    return sorted({batch} | {batch >> shift for shift in (1, 2, 3) if batch >> shift >= 2})


def fit_fixed_s(points: Sequence[tuple[float, float]]) -> float:
    """The intercept of the least-squares line through ``(batch, seconds)`` points, clamped to
    ``[0, seconds at the largest batch]``: the fixed cost of a call."""
    if len({b for b, _ in points}) < 2:
        raise ValueError(f"fitting a fixed cost needs two distinct batch sizes (got {points})")
    mean_b = statistics.fmean(b for b, _ in points)
    mean_t = statistics.fmean(t for _, t in points)
    slope = (sum((b - mean_b) * (t - mean_t) for b, t in points)
             / sum((b - mean_b) ** 2 for b, _ in points))
    largest = max(points)[1]
    return min(max(mean_t - slope * mean_b, 0.0), largest)


def _fixed_costs(block: nn.Module, inputs: Any, batch: int, full: tuple[float, float],
                 warmup: int, repeats: int, device: torch.device) -> tuple[float, float]:
    """``(forward, backward)`` fixed seconds of ``block`` per call, fitted over
    :func:`fit_batches` (``full``: its times at ``batch``, already measured)."""
    timings = {batch: full}
    for size in fit_batches(batch)[:-1]:
        forward_s, backward_s, _ = _measure_block(block, _first(inputs, size), warmup, repeats,
                                                  device)
        timings[size] = (forward_s, backward_s)
    forward = fit_fixed_s([(size, times[0]) for size, times in timings.items()])
    backward = fit_fixed_s([(size, times[1]) for size, times in timings.items()])
    return forward, backward


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
    batch = _tensors(inputs)[0].shape[0] if _tensors(inputs) else None
    fit = batch is not None and len(fit_batches(batch)) >= 2
    for index, block in enumerate(model):
        forward_s, backward_s, output = _measure_block(block, value, warmup, repeats, device)
        params = sum(p.numel() * p.element_size() for p in block.parameters())
        layer = LayerProfile(
            name=f"{index}: {getattr(block, 'label', type(block).__name__)}",
            forward_s=forward_s, backward_s=backward_s,
            activation_bytes=float(_nbytes(output)), parameter_bytes=float(params))  # fmt: skip
        if fit and batch is not None:
            forward_fixed, backward_fixed = _fixed_costs(block, value, batch, (forward_s, backward_s),
                                                         warmup, repeats, device)
            layers.append(replace(layer, forward_fixed_s=forward_fixed,
                                  backward_fixed_s=backward_fixed))
        else:
            layers.append(with_default_fixed(layer))
        value = _detached(output)
    return ModelProfile(layers=layers, model=model_name, batch_size=batch,
                        source=f"tandem profile on {device}",
                        fixed_costs="measured" if fit else "default")  # fmt: skip
