"""The shapes of a message's tensors, sent ahead of it where batches vary in shape.

A ``collate_fn`` that pads each batch to its longest sample gives every step (and every
micro-batch of a data-parallel worker) its own sequence length, so a stage cannot size its
receive buffer from the batch alone. The sender first sends a *header*, one ``int64`` tensor
of the sizes of every tensor of the message in turn; the number of sizes is the receiver's to
know (each tensor's dimensions, from the boundary's specs), so the header's own length is fixed.

Usage::

    header = shape_header(tensors, device)                   # sent just before the message
    buffer = torch.empty(header_length(specs), dtype=torch.int64)   # received into
    shapes = read_header(buffer, specs)                      # then the message, of these shapes
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.split import TensorSpec


def header_length(specs: Sequence[TensorSpec]) -> int:
    """Sizes in the header of a message of ``specs``' tensors (at least one, for an empty
    message)."""
    return max(1, sum(len(spec.shape) for spec in specs))


def shape_header(tensors: Sequence[torch.Tensor], device: torch.device | None) -> torch.Tensor:
    """The header of a message of ``tensors``: their sizes, one after another."""
    sizes = [size for tensor in tensors for size in tensor.shape] or [0]
    return torch.tensor(sizes, dtype=torch.int64, device=device)


def read_header(header: torch.Tensor, specs: Sequence[TensorSpec]) -> tuple[tuple[int, ...], ...]:
    """The shapes a received header gives the tensors of ``specs``."""
    sizes = header.tolist()
    shapes, start = [], 0
    for spec in specs:
        shapes.append(tuple(sizes[start:start + len(spec.shape)]))
        start += len(spec.shape)
    return tuple(shapes)
