"""Parameters, gradients and buffers as one flat tensor, for strategies that communicate them
whole."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


def flatten(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """One contiguous copy of ``tensors``, concatenated."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: Iterable[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors`` in place."""
    offset = 0
    for tensor in tensors:
        tensor.data.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


def state_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's buffers that its ``state_dict`` holds, with their names: the ones strategies
    keep consistent (non-persistent buffers, such as attention masks, are constants)."""
    saved = module.state_dict(keep_vars=True)
    return [(name, b) for name, b in module.named_buffers() if name in saved]


def float_buffers(module: torch.nn.Module) -> list[torch.Tensor]:
    """The module's floating-point state buffers (BatchNorm's running mean and variance): those
    that averaging and gossip mix with the parameters. Integer buffers (``num_batches_tracked``)
    count the worker's own forward passes, the same number on every worker of these
    strategies, and are left alone."""
    return [b for _, b in state_buffers(module) if b.is_floating_point()]


def model_state(module: torch.nn.Module) -> list[torch.Tensor]:
    """What strategies that average or mix models exchange: the parameters, then the
    floating-point buffers."""
    return [*module.parameters(), *float_buffers(module)]


def average_tensors(tensors: list[torch.Tensor]) -> int:
    """Replace ``tensors`` on every worker by their mean over all workers (collective); returns
    the bytes this worker sent."""
    if not tensors:
        return 0
    flat = flatten(tensors)
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    unflatten_into(flat, tensors)
    return flat.numel() * flat.element_size()


def broadcast_buffers(module: torch.nn.Module, src: int = 0) -> None:
    """Give every worker rank ``src``'s state buffers, all of them (collective; one broadcast
    per dtype)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for _, buffer in state_buffers(module):
        by_dtype.setdefault(buffer.dtype, []).append(buffer)
    for buffers in by_dtype.values():
        flat = flatten(buffers)
        dist.broadcast(flat, src)
        unflatten_into(flat, buffers)


def average_model(module: torch.nn.Module) -> int:
    """Replace every worker's parameters and floating-point buffers by their mean over all
    workers; returns bytes sent."""
    return average_tensors(model_state(module))
