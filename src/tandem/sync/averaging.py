"""Model averaging: local SGD (average every H steps) and elastic averaging SGD (EASGD).

Buffers (BatchNorm's running statistics): local SGD averages the floating-point ones with the
parameters; EASGD averages them every period (its center variable holds parameters only), and
its final model is the center with the workers' mean buffers.

EAMSGD (EASGD whose workers use Nesterov momentum, the paper's Algorithm 2) runs on
``torch.optim.SGD(nesterov=True)``, which keeps Sutskever et al.'s form of Nesterov momentum:
its parameters are the point ``y = x + delta v`` where the paper evaluates the gradient, not the
paper's ``x``. The two are the same method under that change of variables (with a constant
learning rate ``eta``: ``v = -eta b`` for torch's momentum buffer ``b``, so ``x = y + eta delta
b``), and :func:`paper_variables` applies it around every elastic exchange, so the elastic move
acts on ``x`` as Algorithm 2 says (tested against a transcription of it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tandem.sync.base import SyncStrategy
from tandem.sync.flat import average_model, average_tensors, float_buffers, flatten, unflatten_into


@contextlib.contextmanager
def paper_variables(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Within: parameters of Nesterov SGD groups hold the paper's ``x = y + lr * delta * b``
    (see the module's docstring), so that an elastic move changes ``x`` and leaves ``v``; on
    exit they hold ``y`` again, moved as ``x`` was. Other parameters are left as they are."""
    shifts: list[tuple[torch.Tensor, torch.Tensor]] = []
    for group in optimizer.param_groups:
        if not group.get("nesterov"):
            continue
        for p in group["params"]:
            buffer = optimizer.state.get(p, {}).get("momentum_buffer")
            if buffer is not None:
                shift = group["lr"] * group["momentum"] * buffer
                p.data.add_(shift)
                shifts.append((p, shift))
    try:
        yield
    finally:
        for p, shift in shifts:
            p.data.sub_(shift)


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
                self.bytes_sent += average_model(module)
        return False

    def consensus(self, module: nn.Module) -> None:
        average_model(module)

    def stats(self) -> dict[str, float]:
        return {"sync_bytes": self.bytes_sent}


class ElasticAveraging(SyncStrategy):
    """EASGD (Zhang et al.): every ``period`` steps each worker moves toward a center variable
    and the center toward the workers, with moving rate ``alpha = lr * rho``:

        x_i <- x_i - alpha (x_i - c),    c <- c + alpha * sum_i (x_i - c)

    The center is kept on every worker (identical everywhere: it is updated from an allreduce).
    The same allreduce averages the workers' floating-point buffers.
    """

    name = "easgd"
    replicas_agree = False
    state_agrees = True

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
            with paper_variables(optimizer):
                self._elastic_round(module)
        return False

    def _elastic_round(self, module: nn.Module) -> None:
        """Move every worker and the center towards each other; average the buffers."""
        assert self.center is not None
        params, buffers = list(module.parameters()), float_buffers(module)
        difference = flatten(params) - self.center
        total = torch.cat([difference, *(b.detach().reshape(-1) for b in buffers)])
        with self.action("AR"):
            dist.all_reduce(total)
        unflatten_into(flatten(params) - self.alpha * difference, params)
        self.center += self.alpha * total[: difference.numel()]
        unflatten_into(total[difference.numel():] / dist.get_world_size(), buffers)
        self.bytes_sent += total.numel() * total.element_size()

    def state_dict(self) -> dict[str, Any]:
        return {"center": self.center}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.center is not None, "load_state_dict before wrap"
        self.center.copy_(state["center"])

    def consensus(self, module: nn.Module) -> None:
        """The center variable is EASGD's model, with the workers' mean buffers."""
        assert self.center is not None
        unflatten_into(self.center, list(module.parameters()))
        average_tensors(float_buffers(module))

    def stats(self) -> dict[str, float]:
        return {"sync_bytes": self.bytes_sent}
