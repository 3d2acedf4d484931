"""Packing small unsigned integers (1, 2, 4 or 8 bits each) into bytes and back."""

from __future__ import annotations

import functools

import torch

from tandem.spec.codec import WIDTHS, width_for

__all__ = ["WIDTHS", "pack", "packed_size", "unpack", "width_for"]


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes in ``[0, 2**bits)`` (any integer dtype), ``8 // bits`` to a byte, lowest bits first."""
    assert bits in WIDTHS, bits
    codes = codes.reshape(-1).to(torch.uint8)
    if bits == 8:
        return codes
    per_byte = 8 // bits
    padded = torch.nn.functional.pad(codes, (0, -codes.numel() % per_byte))
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (padded.view(-1, per_byte) << shifts).sum(dim=1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first ``count`` codes of :func:`pack`'s output, as ``uint8``."""
    assert bits in WIDTHS, bits
    if bits == 8:
        return packed[:count]
    table = _table(bits).to(packed.device)
    return torch.index_select(table, 0, packed.int()).reshape(-1)[:count]


@functools.cache
def _table(bits: int) -> torch.Tensor:
    """``[byte, i]``: the ``i``-th code packed in ``byte`` (a lookup beats shifting every byte)."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    return (torch.arange(256, dtype=torch.uint8).unsqueeze(1) >> shifts) & ((1 << bits) - 1)


def packed_size(count: int, bits: int) -> int:
    """Bytes :func:`pack` makes of ``count`` codes."""
    per_byte = 8 // bits
    return -(-count // per_byte)
