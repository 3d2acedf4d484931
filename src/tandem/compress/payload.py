"""What a codec sends for one tensor, and its size on the wire."""

from __future__ import annotations

from collections.abc import Sequence

import torch

Payload = list[torch.Tensor]
"""What a codec sends for one tensor: a few tensors whose sizes depend only on its shape."""


def payload_bytes(payload: Sequence[torch.Tensor]) -> int:
    """Bytes of a payload on the wire."""
    return sum(t.numel() * t.element_size() for t in payload)
