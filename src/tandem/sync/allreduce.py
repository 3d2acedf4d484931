"""Synchronous data parallelism by gradient allreduce, through PyTorch's DistributedDataParallel."""

from __future__ import annotations

from typing import ContextManager, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tandem.sync.base import SyncStrategy


class AllReduce(SyncStrategy):
    """DDP: gradients are averaged in buckets during backward, overlapping with compute."""

    name = "dp"

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        model = model.to(device)
        device_ids = [device] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)

    def unwrap(self, module: nn.Module) -> nn.Module:
        return cast(DistributedDataParallel, module).module

    def accumulating(self, module: nn.Module) -> ContextManager[None]:
        return cast(DistributedDataParallel, module).no_sync()
