"""What crosses a block boundary: each tensor's shape as a function of the batch (and, for
inputs whose sizes vary from batch to batch, of those sizes), and its dtype.

Usage::

    spec = TensorSpec(shape=(BATCH, 16, 32), dtype=torch.float32, requires_grad=True)
    spec.shape_at(8)          # (8, 16, 32)
    spec.bytes_at(8)          # 16384
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, TypeAlias

import sympy
import torch

BATCH = sympy.Symbol("batch", integer=True, positive=True)
"""The number of samples of a call, in the shapes of :class:`TensorSpec`."""

Dim: TypeAlias = "int | sympy.Expr"


def input_size(index: int) -> sympy.Symbol:
    """The ``index``-th size of the model's inputs other than the batch that a trace keeps
    symbolic (a padded sequence's length, when batches vary: see
    :func:`tandem.split.trace.trace`)."""
    return sympy.Symbol(f"size{index}", integer=True, positive=True)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TensorSpec:
    """One tensor of a boundary: its shape in terms of :data:`BATCH`, dtype, and whether a
    gradient flows back through it."""

    shape: tuple[Dim, ...]
    """Sizes: integers, or expressions of :data:`BATCH` (``BATCH``, ``16 * BATCH``)."""
    dtype: torch.dtype
    requires_grad: bool
    """A gradient comes back for it (floating point and computed from parameters)."""

    @property
    def varies(self) -> bool:
        """Whether its shape depends on input sizes besides the batch (then only the tensor
        itself tells its shape)."""
        return any(not isinstance(d, int) and d.free_symbols - {BATCH} for d in self.shape)

    def shape_at(self, batch: int) -> tuple[int, ...]:
        """The sizes for a call on ``batch`` samples (of a spec that does not vary)."""
        if self.varies:
            raise ValueError(f"a tensor of shape {self.shape} has no shape for a batch alone")
        return tuple(d if isinstance(d, int) else int(d.subs(BATCH, batch)) for d in self.shape)

    def bytes_at(self, batch: int) -> int:
        """Bytes of the tensor for ``batch`` samples."""
        return math.prod(self.shape_at(batch)) * self.dtype.itemsize

    @classmethod
    def per_sample(cls, tensor: torch.Tensor, *, requires_grad: bool) -> TensorSpec:
        """The spec of ``tensor``'s kind with the batch in dim 0 (its dim 0 is ignored)."""
        return cls(shape=(BATCH, *tensor.shape[1:]), dtype=tensor.dtype,
                   requires_grad=requires_grad)


def symbolic_dim(size: Any, symbols: Mapping[sympy.Symbol, sympy.Symbol]) -> Dim | None:
    """``size`` (an int or a ``SymInt`` of a trace) in terms of :data:`BATCH` and the inputs'
    other sizes (:func:`input_size`), where ``symbols`` maps the trace's own symbols of the
    inputs' sizes to them; None if it depends on any other symbol."""
    if isinstance(size, int):
        return size
    expr = sympy.sympify(size.node.expr)
    if expr.free_symbols - set(symbols):
        return None
    expr = expr.subs(symbols, simultaneous=True) if symbols else expr
    return int(expr) if expr.is_Integer else expr
