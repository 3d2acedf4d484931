"""A user's ``collate_fn``: how a list of a dataset's items becomes one batch.

As with ``torch.utils.data.DataLoader(collate_fn=...)``, the function gets the items of one
batch (whatever the dataset's ``__getitem__`` gives: token lists, dicts, pairs) and returns the
batch; tandem needs it as ``(inputs, targets)``, each a tensor or a structure of tensors with
the batch in dim 0 (:mod:`tandem.structures`). A collate that pads each batch to its longest
sample gives batches of different shapes, which every strategy takes (pipelines send each
activation's shapes ahead of it: :mod:`tandem.runtime.pipeline.shape_header`).

tandem calls it wherever batches are made: on every worker, in the background loader processes
(``--loader-workers``) and for evaluation, and once in the launching process before any worker
starts (:func:`check_collate`), so that a collate that fails is one line there.

Usage::

    inputs, targets = collated(pad, [dataset[i] for i in indices], what="the training data")
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from tandem import structures
from tandem.errors import UsageError

Collate = Callable[[list[Any]], Any]
"""``collate_fn(items) -> (inputs, targets)``."""

CHECKED_ITEMS = 8
"""Items the launching process collates to check a ``collate_fn`` (fewer if the data has
fewer)."""


def function_label(function: Any) -> str:
    """How messages name a user's function: ``module:qualified_name``."""
    module = getattr(function, "__module__", None)
    name = getattr(function, "__qualname__", None) or type(function).__name__
    return f"{module}:{name}" if module else name


def collated(collate: Collate, items: list[Any], *, what: str) -> tuple[Any, Any]:
    """``collate(items)`` as ``(inputs, targets)`` of ``len(items)`` samples; one line naming
    the function, the error and the fix if it fails or returns anything else."""
    label = function_label(collate)
    try:
        batch = collate(items)
    except UsageError:
        raise
    except Exception as exc:  # the user's function failed on the items: one line, named
        lines = str(exc).strip().splitlines()
        raise UsageError(f"collate_fn {label} fails on {len(items)} items of {what} "
                         f"({_item_kind(items)}): {type(exc).__name__}: "
                         f"{lines[0] if lines else ''}; fix it: it gets a list of the "
                         f"dataset's items and returns (inputs, targets)") from None
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise UsageError(f"collate_fn {label} returned {structures.describe(batch)} for "
                         f"{len(items)} items of {what}; return the batch as (inputs, targets)")
    inputs, targets = batch
    _check_rows(label, inputs, targets, len(items), what)
    return inputs, targets


def _check_rows(label: str, inputs: Any, targets: Any, count: int, what: str) -> None:
    """Every tensor of the batch has one row per item (tandem cuts batches by rows)."""
    for part, tree in (("inputs", inputs), ("targets", targets)):
        tensors = structures.tensors(tree)
        if not tensors:
            raise UsageError(f"collate_fn {label} returned {part} without a tensor "
                             f"({structures.describe(tree)}) for {count} items of {what}; "
                             f"return tensors with one row per item")
        rows = {int(t.shape[0]) if t.dim() else None for t in tensors}
        if rows != {count}:
            raise UsageError(f"collate_fn {label} returned {part} "
                             f"({structures.describe(tree)}) for {count} items of {what}; "
                             f"every tensor needs one row per item (dim 0 of size {count})")


def _item_kind(items: Sequence[Any]) -> str:
    return f"the first is {structures.describe(items[0])}" if items else "none"


def check_collate(samples: Any, *, batch_size: int) -> None:
    """Collate the first items of ``samples`` (at most ``batch_size`` and
    :data:`CHECKED_ITEMS`) in this process, so that a ``collate_fn`` that fails says so in one
    line before any worker starts (a no-op without one)."""
    if getattr(samples, "collate", None) is None:
        return
    count = min(len(samples), batch_size, CHECKED_ITEMS)
    samples.take(torch.arange(count))
