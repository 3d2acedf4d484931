"""Counting the bytes a worker's gradient synchronization sends, compressed and not."""

from __future__ import annotations

import dataclasses

from tandem.spec.codec import ring_bytes

__all__ = ["ByteMeter", "ring_bytes"]


@dataclasses.dataclass(kw_only=True, slots=True)
class ByteMeter:
    """Totals over a run for one worker; the hooks add to it, the strategy reports it."""

    world_size: int
    payload_bytes: int = 0
    """What this worker handed to collectives: the codec's payloads."""
    gradient_bytes: int = 0
    """What it would have handed over uncompressed: its gradient buckets."""
    wire_bytes: float = 0.0
    """What it sent, assuming ring collectives (see :func:`ring_bytes`)."""
    uncompressed_wire_bytes: float = 0.0
    """What it would have sent by a ring allreduce of its uncompressed gradients."""

    def add(self, *, payload_bytes: int, gradient_bytes: int, collective: str) -> None:
        """Count one bucket's exchange."""
        self.payload_bytes += payload_bytes
        self.gradient_bytes += gradient_bytes
        self.wire_bytes += ring_bytes(collective, payload_bytes, self.world_size)
        self.uncompressed_wire_bytes += ring_bytes("allreduce", gradient_bytes, self.world_size)
