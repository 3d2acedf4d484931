"""A user's evaluation metrics (``tandem.fit(metrics={"macro_f1": f1})``): functions of the whole
evaluation's outputs and targets, computed on rank 0 from what every worker scored.

Each worker keeps, on the CPU, the outputs and targets of the samples it scores (a data-parallel
worker its share, a pipeline's last stage its chunks); rank 0 gathers them, puts them in the
samples' order and calls each metric once on the whole set::

    kept = KeptOutputs(task.metrics)              # empty and free when there are no metrics
    totals = task.score(model, start, end, keep=kept)
    values = kept.values(gather=True)             # collective; rank 0: {"test_macro_f1": 0.93}
    values = reduced_evaluation(totals, kept)     # or with test_loss and test_accuracy

A metric ``name`` appears as ``test_<name>`` beside ``test_loss`` and ``test_accuracy``: in the
summary, the metrics lines and the progress bar. It is given the model's outputs for every
evaluated sample, each tensor of the output concatenated along its first (batch) dimension
(a list of the chunks' tensors where their other sizes differ, as padded batches' do;
0-dimensional tensors, one per scored chunk, stacked; other values from the first chunk), and
the targets likewise, and returns a number. Rank 0 holds the whole evaluation's outputs to do
so: keep the test set to a size whose outputs fit in its memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from tandem.errors import UsageError
from tandem.loss import evaluation

Metric = Callable[[Any, Any], Any]
"""``metric(outputs, targets) -> number`` over the whole evaluation."""


def check_metrics(metrics: Any) -> dict[str, Metric]:
    """``metrics`` as :func:`tandem.fit` takes it (None or a mapping of names to functions),
    refused in one line otherwise; a name must be an identifier, as it becomes a key."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise UsageError(f"metrics= is a {type(metrics).__name__}; give a dict of names to "
                         f"functions, e.g. metrics={{'macro_f1': macro_f1}}")
    for name, function in metrics.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise UsageError(f"metrics= name {name!r} is not an identifier; name each metric "
                             f"like a variable (it is reported as test_<name>)")
        if not callable(function):
            raise UsageError(f"metrics={{{name!r}: ...}} is a {type(function).__name__}, not a "
                             f"function; give metric(outputs, targets) -> number")
    return dict(metrics)


class KeptOutputs:
    """The outputs and targets one worker scored in one evaluation, for the user's metrics
    (keeps nothing when there are none)."""

    def __init__(self, metrics: Mapping[str, Metric] | None) -> None:
        self.metrics = dict(metrics or {})
        self.parts: list[tuple[int, Any, Any]] = []
        """``(first sample, outputs, targets)`` of each scored chunk, on the CPU."""

    def keep(self, start: int, output: Any, targets: Any) -> None:
        """Keep the outputs and targets of the chunk whose first sample is ``start``."""
        if self.metrics:
            self.parts.append((start, _on_cpu(output), _on_cpu(targets)))

    def values(self, *, gather: bool) -> dict[str, float]:
        """Each metric on the whole evaluation, on rank 0, as ``test_<name>`` (nothing
        elsewhere). ``gather``: the workers scored parts of it, and rank 0 gathers them
        (collective: every worker of the job calls it, with or without parts); otherwise this
        worker scored it all."""
        if not self.metrics:
            return {}
        parts = self.parts
        if gather and dist.is_initialized():
            rank = dist.get_rank()
            listed: list[Any] = [None] * dist.get_world_size() if rank == 0 else []
            dist.gather_object(parts, listed if rank == 0 else None, dst=0)
            if rank != 0:
                return {}
            parts = [part for worker in listed if worker for part in worker]
        if not parts:
            return {}
        parts = sorted(parts, key=lambda part: part[0])
        outputs = _joined([part[1] for part in parts])
        targets = _joined([part[2] for part in parts])
        return {f"test_{name}": _value(name, metric, outputs, targets)
                for name, metric in self.metrics.items()}


def reduced_evaluation(totals: torch.Tensor, kept: KeptOutputs) -> dict[str, float | None]:
    """``test_accuracy`` and ``test_loss`` from every worker's :func:`~tandem.loss.score_batch`
    totals, summed in place, and the user's metrics over every worker's kept outputs (rank 0's;
    collective)."""
    dist.all_reduce(totals)
    return {**evaluation(totals), **kept.values(gather=True)}


def _on_cpu(tree: Any) -> Any:
    return pytree.tree_map(
        lambda leaf: leaf.detach().cpu() if isinstance(leaf, torch.Tensor) else leaf, tree)


def _joined(chunks: list[Any]) -> Any:
    """The chunks' trees as one: tensors concatenated along the batch dimension (a list of the
    chunks' tensors where their other dimensions differ: batches padded each to its own
    length), 0-dimensional ones stacked, other values from the first chunk."""
    flat = [pytree.tree_flatten(chunk) for chunk in chunks]
    leaves, spec = flat[0]
    joined: list[Any] = []
    for index, leaf in enumerate(leaves):
        column = [chunk_leaves[index] for chunk_leaves, _ in flat]
        if isinstance(leaf, torch.Tensor) and not leaf.dim():
            joined.append(torch.stack(column))
        elif isinstance(leaf, torch.Tensor):  # chunks padded to their own lengths: a list
            same = all(part.shape[1:] == leaf.shape[1:] for part in column)
            joined.append(torch.cat(column) if same else column)
        else:
            joined.append(leaf)
    return pytree.tree_unflatten(joined, spec)


def _value(name: str, metric: Metric, outputs: Any, targets: Any) -> float:
    """``metric(outputs, targets)`` as a float, or one line naming the metric."""
    try:
        value = metric(outputs, targets)
    except UsageError:
        raise
    except Exception as exc:  # the user's metric failed: name it and what it was given
        lines = str(exc).strip().splitlines()
        raise UsageError(f"metric {name!r} failed: {type(exc).__name__}: "
                         f"{lines[0] if lines else ''}") from None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(f"metric {name!r} returned {type(value).__name__}; it must return a "
                         f"number (a float, or a tensor of one element)")
    return float(value)
