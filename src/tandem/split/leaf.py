"""Modules a split model calls as modules instead of running their traced operations.

Usage::

    blocks = split_model(model, inputs, leaves=["transformer.h.0.attn.c_attn", ...])
    blocks.leaves                   # {"transformer.h.0.attn.c_attn": 7, ...}: the block of each
    blocks[7].get_submodule("transformer.h.0.attn.c_attn")      # the model's own module

A leaf's stretch of the trace (every node its code, hooks included, ran) becomes one call of the
module, so what is done to the module later (a tensor-parallel split that makes its parameters
DTensors and adds collectives around its forward) takes effect in the block. A leaf must run
once, take one tensor and give one tensor back (a linear or convolution layer does); no cut
falls inside it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torch import fx

from tandem.errors import UsageError
from tandem.split.graph import GraphInfo


@dataclasses.dataclass(frozen=True, slots=True)
class LeafCall:
    """A leaf module's stretch of a trace: nodes ``start..end-1``, the tensor they take and the
    one they give back."""

    name: str
    start: int
    end: int
    input: fx.Node
    output: fx.Node


def leaf_calls(info: GraphInfo, leaves: Sequence[str]) -> dict[int, LeafCall]:
    """Each leaf's stretch of ``info``, by its first position; no cut may fall inside one
    (``info.forbidden`` is set). One line naming the module if it cannot be called alone."""
    calls: dict[int, LeafCall] = {}
    for name in leaves:
        path = tuple(name.split("."))
        positions = [p for p, owner in enumerate(info.owners) if owner[:len(path)] == path]
        if not positions:
            raise UsageError(f"module {name!r} never runs in the model's forward, so the split "
                             f"cannot call it; leave it out of the tensor layers")
        start, end = positions[0], positions[-1] + 1
        if positions != list(range(start, end)):
            raise UsageError(f"module {name!r} runs more than once (or between other modules' "
                             f"code) in the model's forward, so a split model cannot call it as "
                             f"one module; leave it out of the tensor layers")
        calls[start] = LeafCall(name=name, start=start, end=end,
                                input=_one(_inputs(info, start, end), name, "takes"),
                                output=_one(_outputs(info, start, end), name, "gives back"))
        for position in range(start + 1, end):
            if info.forbidden[position] is None:
                info.forbidden[position] = f"it is inside module {name} (called as one module)"
    return calls


def _inputs(info: GraphInfo, start: int, end: int) -> list[fx.Node]:
    """The values computed before ``start`` that nodes ``start..end-1`` read (no parameters,
    buffers or size arithmetic: the module holds and computes those itself)."""
    found: dict[fx.Node, None] = {}
    for node in info.nodes[start:end]:
        for arg in node.all_input_nodes:
            if arg in info.first and info.first[arg] < start:
                found[arg] = None
    return list(found)


def _outputs(info: GraphInfo, start: int, end: int) -> list[fx.Node]:
    """The values nodes ``start..end-1`` compute that are read at ``end`` or later."""
    return [node for node in info.nodes[start:end] if info.last[node] >= end]


def _one(values: list[fx.Node], name: str, verb: str) -> fx.Node:
    if len(values) != 1:
        raise UsageError(f"module {name!r} {verb} {len(values)} tensors in the model's forward "
                         f"({', '.join(v.name for v in values) or 'none'}), and a split model "
                         f"calls a module on one tensor; leave it out of the tensor layers")
    return values[0]
