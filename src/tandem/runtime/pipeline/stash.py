"""Weight stashing for asynchronous pipelines: immutable versions of a stage's parameters.

A forward binds a version functionally (``torch.func.functional_call``) and its backward
differentiates with respect to that same version, never by loading state into live parameters
(which breaks autograd's version checks). Versions are kept while a minibatch in flight, or a
future one under vertical sync, may still need them.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn


class WeightVersions:
    """Version ``v`` is the stage's parameters after ``v`` optimizer steps."""

    def __init__(self, module: nn.Module, *, vertical_sync: bool) -> None:
        self.vertical_sync = vertical_sync
        self.live = dict(module.named_parameters())
        self.version = 0
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {0: self._snapshot()}
        self.in_flight: Counter[int] = Counter()
        self.oldest_needed = 0
        """Under vertical sync, the oldest version a future minibatch can ask for."""
        self.peak_bytes = self.bytes

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone().requires_grad_(p.requires_grad)
                for name, p in self.live.items()}

    @property
    def bytes(self) -> int:
        """Bytes held by all stashed versions (each a full copy of the stage's parameters)."""
        return sum(t.numel() * t.element_size() for snap in self.snapshots.values()
                   for t in snap.values())

    def acquire(self, version: int) -> dict[str, torch.Tensor]:
        """The parameters of ``version`` for a forward; held until :meth:`release`."""
        if version not in self.snapshots:
            raise RuntimeError(
                f"weight version {version} is no longer stashed (have {sorted(self.snapshots)})"
            )
        self.in_flight[version] += 1
        return self.snapshots[version]

    def release(self, version: int) -> None:
        """The backward that used ``version`` is done."""
        self.in_flight[version] -= 1
        if not self.in_flight[version]:
            del self.in_flight[version]
        self._prune()

    def advance(self) -> None:
        """The optimizer stepped the live parameters: stash them as the next version."""
        self.version += 1
        self.snapshots[self.version] = self._snapshot()
        if not self.vertical_sync:
            self.oldest_needed = self.version
        self._prune()
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def keep_from(self, version: int) -> None:
        """No future forward will ask for a version older than ``version`` (vertical sync)."""
        self.oldest_needed = max(self.oldest_needed, version)

    def _prune(self) -> None:
        for version in list(self.snapshots):
            if version < self.version and version < self.oldest_needed and \
                    version not in self.in_flight:
                del self.snapshots[version]
