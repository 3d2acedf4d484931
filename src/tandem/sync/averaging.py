"""Model averaging: local SGD (average every H steps) and elastic averaging SGD (EASGD)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tandem.sync.base import SyncStrategy
from tandem.sync.flat import average_parameters, flatten, unflatten_into


class LocalSGD(SyncStrategy):
    """Workers step on their own and average their parameters every ``period`` steps."""

    name = "localsgd"
    replicas_agree = False

    def __init__(self, period: int) -> None:
        self.period = period
        self.bytes_sent = 0

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        return model.to(device)

    def update(self, module: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> bool:
        self.step_optimizer(optimizer)
        if (step + 1) % self.period == 0:
            with self.action("AR"):
                self.bytes_sent += average_parameters(module)
        return False

    def consensus(self, module: nn.Module) -> None:
        average_parameters(module)

    def stats(self) -> dict[str, float]:
        return {"sync_bytes": self.bytes_sent}


class ElasticAveraging(SyncStrategy):
    """EASGD (Zhang et al.): every ``period`` steps each worker moves toward a center variable
    and the center toward the workers, with moving rate ``alpha = lr * rho``:

        x_i <- x_i - alpha (x_i - c),    c <- c + alpha * sum_i (x_i - c)

    The center is kept on every worker (identical everywhere: it is updated from an allreduce).
    """

    name = "easgd"
    replicas_agree = False

    def __init__(self, period: int, rho: float, lr: float) -> None:
        self.period = period
        self.alpha = lr * rho
        self.center: torch.Tensor | None = None
        self.bytes_sent = 0

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        model = model.to(device)
        self.center = flatten(model.parameters())
        return model

    def update(self, module: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> bool:
        self.step_optimizer(optimizer)
        if (step + 1) % self.period == 0:
            assert self.center is not None
            params = list(module.parameters())
            difference = flatten(params) - self.center
            total = difference.clone()
            with self.action("AR"):
                dist.all_reduce(total)
            unflatten_into(flatten(params) - self.alpha * difference, params)
            self.center += self.alpha * total
            self.bytes_sent += total.numel() * total.element_size()
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"center": self.center}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.center is not None, "load_state_dict before wrap"
        self.center.copy_(state["center"])

    def consensus(self, module: nn.Module) -> None:
        """The center variable is EASGD's model."""
        assert self.center is not None
        unflatten_into(self.center, list(module.parameters()))

    def stats(self) -> dict[str, float]:
        return {"sync_bytes": self.bytes_sent}
