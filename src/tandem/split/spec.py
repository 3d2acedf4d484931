"""What crosses a block boundary: each tensor's shape as a function of the batch, and its dtype.

Usage::

    spec = TensorSpec(shape=(BATCH, 16, 32), dtype=torch.float32, requires_grad=True)
    spec.shape_at(8)          # (8, 16, 32)
    spec.bytes_at(8)          # 16384
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, TypeAlias

import sympy
import torch

BATCH = sympy.Symbol("batch", integer=True, positive=True)
"""The number of samples of a call, in the shapes of :class:`TensorSpec`."""

Dim: TypeAlias = "int | sympy.Expr"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TensorSpec:
    """One tensor of a boundary: its shape in terms of :data:`BATCH`, dtype, and whether a
    gradient flows back through it."""

    shape: tuple[Dim, ...]
    """Sizes: integers, or expressions of :data:`BATCH` (``BATCH``, ``16 * BATCH``)."""
    dtype: torch.dtype
    requires_grad: bool
    """A gradient comes back for it (floating point and computed from parameters)."""

    def shape_at(self, batch: int) -> tuple[int, ...]:
        """The sizes for a call on ``batch`` samples."""
        return tuple(d if isinstance(d, int) else int(d.subs(BATCH, batch)) for d in self.shape)

    def bytes_at(self, batch: int) -> int:
        """Bytes of the tensor for ``batch`` samples."""
        return math.prod(self.shape_at(batch)) * self.dtype.itemsize

    @classmethod
    def per_sample(cls, tensor: torch.Tensor, *, requires_grad: bool) -> TensorSpec:
        """The spec of ``tensor``'s kind with the batch in dim 0 (its dim 0 is ignored)."""
        return cls(shape=(BATCH, *tensor.shape[1:]), dtype=tensor.dtype,
                   requires_grad=requires_grad)


def symbolic_dim(size: Any, batch: sympy.Symbol | None) -> Dim | None:
    """``size`` (an int or a ``SymInt`` of a trace) in terms of :data:`BATCH`, where the trace
    named the batch ``batch``; None if it depends on any other symbol."""
    if isinstance(size, int):
        return size
    expr = sympy.sympify(size.node.expr)
    if expr.free_symbols - ({batch} if batch is not None else set()):
        return None
    expr = expr.subs(batch, BATCH) if batch is not None else expr
    return int(expr) if expr.is_Integer else expr
