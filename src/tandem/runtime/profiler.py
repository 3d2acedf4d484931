"""Measure every top-level block of an ``nn.Sequential`` on the local device into a ModelProfile.

Usage::

    profile = profile_model(model, inputs, warmup=2, repeats=9)

Any other model is profiled as the blocks of its automatic split (:mod:`tandem.split`): a
block takes and returns tuples of tensors, and the last returns the model's own output.

Each block runs on the previous block's real output: forward is timed alone, backward is timed
from a fixed random output gradient back to the block's input and parameters; CUDA work is
synchronized before each reading. So that two profiles of one model agree on a machine that
other work shares (see docs/planning.md, "How much a profile varies"):

- the measurements run on one thread (``threads``; the caller's setting is restored after);
- the blocks are timed in rounds, each round timing every block once, after ``warmup`` rounds:
  a burst of other load then slows one round of every block instead of every repeat of one;
- a block's time is :func:`robust_s` of its ``repeats``: the least of the medians of
  consecutive groups of three (other load only ever slows a block down, and the median of a
  group ignores one slow repeat in it);
- identical blocks (same type and structure, parameter shapes, input and output shapes: they
  do the same work) share one figure, their median. When they differ by more than
  :data:`AGREE_TOLERANCE` they are measured again; if they still differ, a
  :class:`~tandem.errors.MachineWarning` says so (this machine is busy) before they share it.

The fixed cost per call (kernel launches, framework dispatch: what a micro-batch pays however
small it is) is fitted per block: the block is also timed on the first half, quarter and eighth
of the batch (at least 2 samples; :func:`fit_batches`), and a least-squares line
``t(b) = fixed + per_sample * b`` through those times gives ``fixed``, clamped to
``[0, t(batch)]``. A batch too small for two sizes gets the documented defaults
(:func:`tandem.profile.with_default_fixed`).
"""

from __future__ import annotations

import re
import statistics
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from tandem.errors import MachineWarning, UsageError
from tandem.profile import LayerProfile, ModelProfile, with_default_fixed

GROUP = 3
"""Repeats per group of :func:`robust_s`."""
AGREE_TOLERANCE = 0.5
"""Identical blocks whose times differ by more than this fraction of the smallest (and by more
than :data:`AGREE_FLOOR_S`) are measured again, and a warning is given if they still do."""
AGREE_FLOOR_S = 20e-6
"""Differences below this many seconds are timer and cache noise, never a disagreement."""
OPERATOR = re.compile(r"torch\.ops\.[\w.]+|operator\.\w+")
"""An operator call in a split block's code."""


def robust_s(samples: Sequence[float], group: int = GROUP) -> float:
    """The least of the medians of consecutive groups of ``group`` samples (one group, their
    median, when there are fewer than ``2 * group``)."""
    if not samples:
        raise ValueError("robust_s needs at least one sample")
    count = max(1, len(samples) // group)
    cuts = [len(samples) * index // count for index in range(count + 1)]
    return min(statistics.median(samples[a:b]) for a, b in zip(cuts, cuts[1:]))


@contextmanager
def threads_set(threads: int) -> Iterator[None]:
    """Run the body with ``torch.set_num_threads(threads)``, restoring the setting after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


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
    """``value`` with every tensor a fresh leaf, floating-point ones requiring a gradient."""
    def fresh(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        tensor = leaf.detach()
        return tensor.requires_grad_(True) if tensor.is_floating_point() else tensor
    return pytree.tree_map(fresh, value)


def _run_once(block: nn.Module, inputs: Any, device: torch.device) -> tuple[float, float, Any]:
    """Forward and backward seconds of one call of ``block`` on ``inputs``, and its output."""
    block.zero_grad(set_to_none=True)
    fresh = _detached(inputs)
    forward_s, output = _timed(lambda: block(fresh), device)
    outs = [t for t in _tensors(output) if t.requires_grad]
    grads = [torch.ones_like(t) for t in outs]
    backward_s = _timed(lambda: torch.autograd.backward(outs, grads), device)[0] if outs else 0.0
    return forward_s, backward_s, output


@dataclass(slots=True)
class Samples:
    """One block's timed repeats, in the order they ran."""

    forward_s: list[float]
    backward_s: list[float]

    def robust(self) -> tuple[float, float]:
        """``(forward, backward)`` seconds by :func:`robust_s`."""
        return robust_s(self.forward_s), robust_s(self.backward_s)


def measure_rounds(blocks: Sequence[nn.Module], inputs: Sequence[Any], *, warmup: int,
                   repeats: int, device: torch.device) -> list[Samples]:
    """Time ``blocks[i]`` on ``inputs[i]`` in ``warmup + repeats`` rounds, each round every
    block once in order; the repeats of the last ``repeats`` rounds, per block."""
    samples = [Samples([], []) for _ in blocks]
    for run in range(warmup + repeats):
        for block, value, into in zip(blocks, inputs, samples):
            forward_s, backward_s, _ = _run_once(block, value, device)
            if run >= warmup:
                into.forward_s.append(forward_s)
                into.backward_s.append(backward_s)
    return samples


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


def _first(inputs: Any, samples: int = 2) -> Any:
    """The first ``samples`` samples of a batch (batch in dim 0 of every tensor that has a
    dimension; a 0-dim one, such as a running auxiliary loss, is kept whole)."""
    return pytree.tree_map(
        lambda t: t[:samples] if isinstance(t, torch.Tensor) and t.dim() else t, inputs)


def _shapes(value: Any) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    return tuple((tuple(t.shape), t.dtype) for t in _tensors(value))


def signature(block: nn.Module, inputs: Any, output: Any) -> tuple[Any, ...]:
    """What makes two blocks identical, doing the same work: the type and settings (public
    numbers, strings and tuples, such as ``eps`` or ``in_features``) of every module in them,
    not their names; for a split block also the operators its graph calls, in order; the shapes
    and types of their parameters and buffers, inputs and outputs."""
    code = getattr(block, "code", None)
    ops = tuple(OPERATOR.findall(code)) if isinstance(code, str) else ()
    modules = tuple((type(module).__qualname__, _settings(module)) for module in block.modules())
    tensors = [*block.parameters(), *block.buffers()]
    return (modules, ops, _shapes(tensors), _shapes(inputs), _shapes(output))


def _settings(module: nn.Module) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((key, repr(value)) for key, value in vars(module).items()
                        if not key.startswith("_")
                        and isinstance(value, (bool, int, float, str, tuple))))


def _groups(signatures: Sequence[tuple[Any, ...]]) -> list[list[int]]:
    """Indices of identical blocks, groups of two or more, in order of first appearance."""
    found: dict[tuple[Any, ...], list[int]] = {}
    for index, key in enumerate(signatures):
        found.setdefault(key, []).append(index)
    return [members for members in found.values() if len(members) > 1]


def _disagree(values: Sequence[float]) -> bool:
    low, high = min(values), max(values)
    return high - low > AGREE_FLOOR_S and high > low * (1 + AGREE_TOLERANCE)


@dataclass(frozen=True, slots=True)
class _Run:
    """What every measurement of one profile shares."""

    warmup: int
    repeats: int
    device: torch.device


def _agreed(blocks: Sequence[nn.Module], inputs: Sequence[Any], samples: list[Samples],
            members: list[int], run: _Run) -> tuple[float, float]:
    """The figure ``(forward, backward)`` identical ``members`` share: their medians, after
    measuring them again if they disagree, with a warning if they still do."""
    figures, spread = _spread(samples, members)
    if spread:
        again = measure_rounds([blocks[i] for i in members], [inputs[i] for i in members],
                               warmup=0, repeats=run.repeats, device=run.device)
        for index, extra in zip(members, again):
            samples[index].forward_s.extend(extra.forward_s)
            samples[index].backward_s.extend(extra.backward_s)
        figures, spread = _spread(samples, members)
    shared = (statistics.median(f for f, _ in figures), statistics.median(b for _, b in figures))
    if spread:
        _warn_spread(blocks, members, figures, spread[0], shared[spread[0]])
    return shared


def _spread(samples: Sequence[Samples],
            members: list[int]) -> tuple[list[tuple[float, float]], list[int]]:
    """The members' figures, and the directions (0 forward, 1 backward) they disagree in."""
    figures = [samples[index].robust() for index in members]
    return figures, [direction for direction in (0, 1)
                     if _disagree([figure[direction] for figure in figures])]


def _warn_spread(blocks: Sequence[nn.Module], members: list[int],
                 figures: list[tuple[float, float]], direction: int, shared: float) -> None:
    values = [figure[direction] for figure in figures]
    name = getattr(blocks[members[0]], "label", type(blocks[members[0]]).__name__)
    listed = members if len(members) <= 4 else [*members[:2], "...", members[-1]]
    what = ("forward", "backward")[direction]
    warnings.warn(
        f"{len(members)} identical blocks ({', '.join(map(str, listed))}: {name}) took "
        f"{min(values) * 1e3:.3f} to {max(values) * 1e3:.3f} ms {what} even when measured "
        f"again: other work on this machine slowed some of them; each is given their median, "
        f"{shared * 1e3:.3f} ms (profile on a quiet machine, or keep a split with tandem train "
        f"--plan)", MachineWarning, stacklevel=3)


def _fixed(blocks: Sequence[nn.Module], inputs: Sequence[Any], batch: int,
           full: Sequence[tuple[float, float]], run: _Run) -> list[tuple[float, float]]:
    """``(forward, backward)`` fixed seconds per call of every block, fitted over
    :func:`fit_batches` (``full``: their times at ``batch``, already measured)."""
    timings: dict[int, Sequence[tuple[float, float]]] = {batch: full}
    for size in fit_batches(batch)[:-1]:
        sliced = measure_rounds(blocks, [_first(value, size) for value in inputs],
                                warmup=run.warmup, repeats=run.repeats, device=run.device)
        timings[size] = [each.robust() for each in sliced]
    return [(fit_fixed_s([(size, times[index][0]) for size, times in timings.items()]),
             fit_fixed_s([(size, times[index][1]) for size, times in timings.items()]))
            for index in range(len(blocks))]


def _block_values(blocks: Sequence[nn.Module], inputs: Any) -> tuple[list[Any], list[Any]]:
    """Each block's input and output on ``inputs`` (without autograd: for their shapes)."""
    ins, outs, value = [], [], inputs
    with torch.no_grad():
        for block in blocks:
            ins.append(value)
            value = block(value)
            outs.append(value)
    return ins, outs


def _shared_figures(blocks: Sequence[nn.Module], ins: Sequence[Any], groups: list[list[int]],
                    samples: list[Samples], run: _Run) -> list[tuple[float, float]]:
    """Each block's ``(forward, backward)`` seconds, identical blocks' agreed."""
    figures = [each.robust() for each in samples]
    for members in groups:
        shared = _agreed(blocks, ins, samples, members, run)
        for index in members:
            figures[index] = shared
    return figures


def profile_model(
    model: nn.Module, inputs: Any, *, warmup: int = 2, repeats: int = 9, model_name: str = "",
    split_points: list[str] | None = None, threads: int = 1, fit_fixed: bool = True,
) -> ModelProfile:  # fmt: skip
    """Profile each top-level block of ``model`` on one minibatch (``inputs``, as the model is
    called with them) on ``threads`` threads; a model that is not an ``nn.Sequential`` is split
    first (before the submodules ``split_points``, or automatically). ``fit_fixed=False`` skips
    timing the smaller batches that fit the fixed costs (the profile gets the defaults)."""
    if repeats < 1 or warmup < 0 or threads < 1:
        raise UsageError(f"need repeats >= 1, warmup >= 0 and threads >= 1 (got {repeats}, "
                         f"{warmup}, {threads})")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if not isinstance(model, nn.Sequential):
        from tandem.split import split_model

        model = split_model(model, _first(inputs), split_points=split_points,
                            what=f"model {model_name or type(model).__name__!r}")
    with threads_set(threads):
        layers, fit = _measure_model(model, inputs, _Run(warmup, repeats, device), fit_fixed)
    batch = _tensors(inputs)[0].shape[0] if _tensors(inputs) else None
    return ModelProfile(layers=layers, model=model_name, batch_size=batch,
                        source=f"tandem profile on {device}",
                        fixed_costs="measured" if fit else "default")  # fmt: skip


def _measure_model(model: nn.Sequential, inputs: Any, run: _Run,
                   fit_fixed: bool) -> tuple[list[LayerProfile], bool]:
    blocks = list(model)
    ins, outs = _block_values(blocks, inputs)
    groups = _groups([signature(b, i, o) for b, i, o in zip(blocks, ins, outs)])
    samples = measure_rounds(blocks, ins, warmup=run.warmup, repeats=run.repeats,
                             device=run.device)
    figures = _shared_figures(blocks, ins, groups, samples, run)
    batch = _tensors(inputs)[0].shape[0] if _tensors(inputs) else None
    fit = fit_fixed and batch is not None and len(fit_batches(batch)) >= 2
    layers = []
    for index, (block, (forward_s, backward_s)) in enumerate(zip(blocks, figures)):
        params = sum(p.numel() * p.element_size() for p in block.parameters())
        layers.append(LayerProfile(
            name=f"{index}: {getattr(block, 'label', type(block).__name__)}",
            forward_s=forward_s, backward_s=backward_s,
            activation_bytes=float(_nbytes(outs[index])),
            parameter_bytes=float(params)))  # fmt: skip
    if not fit or batch is None:
        return [with_default_fixed(layer) for layer in layers], False
    fixed = _fixed(blocks, ins, batch, figures, run)
    for members in groups:
        shared = (statistics.median(fixed[i][0] for i in members),
                  statistics.median(fixed[i][1] for i in members))
        for index in members:
            fixed[index] = shared
    return [replace(layer, forward_fixed_s=f, backward_fixed_s=b)
            for layer, (f, b) in zip(layers, fixed)], True
