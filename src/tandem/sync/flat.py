"""Parameters and gradients as one flat tensor, for strategies that communicate them whole."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def flatten(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """One contiguous copy of ``tensors``, concatenated."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: Iterable[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors`` in place."""
    offset = 0
    for tensor in tensors:
        tensor.data.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


def average_parameters(module: torch.nn.Module) -> int:
    """Replace every worker's parameters by their mean over all workers; returns bytes sent."""
    import torch.distributed as dist

    params = list(module.parameters())
    flat = flatten(params)
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    unflatten_into(flat, params)
    return flat.numel() * flat.element_size()
