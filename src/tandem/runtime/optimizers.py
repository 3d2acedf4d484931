"""Layer-wise adaptive optimizers for large batches: LARS and LAMB.

Both scale each parameter's step by a *trust ratio* of norms taken over that whole parameter
(a "layer" in the papers). A parameter group whose ``trust`` is False takes no trust ratio
(ratio 1); :func:`tandem.runtime.learning_rate.build_optimizer` puts biases and normalization parameters
(every parameter with ``ndim <= 1``) in such a group with no weight decay, as the papers do::

    optimizer = Lamb([{"params": weights, "weight_decay": 0.01},
                      {"params": biases, "weight_decay": 0.0, "trust": False}], lr=1e-3)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

ParamsT = Iterable[torch.Tensor] | Iterable[dict[str, Any]]


def _where_both_positive(a: torch.Tensor, b: torch.Tensor,
                         ratio: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``ratio()`` if the norms ``a`` and ``b`` are both above 0, else 1 (a fresh zero weight
    or a zero gradient or update: no ratio to trust); stays on the device (no sync)."""
    usable = (a > 0) & (b > 0)
    return torch.where(usable, torch.nan_to_num(ratio(), nan=1.0, posinf=1.0),
                       torch.ones_like(a))


class _PerParameter(torch.optim.Optimizer):
    """An optimizer whose update of each parameter depends on that parameter alone."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None  # type: ignore[override]
             ) -> float | None:
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for w in group["params"]:
                if w.grad is not None:
                    self._update(w, group)
        return loss

    def _update(self, w: torch.Tensor, group: dict[str, Any]) -> None:
        raise NotImplementedError


class Lars(_PerParameter):
    """LARS (You, Gitman and Ginsburg 2017, "Large Batch Training of Convolutional Networks"),
    Algorithm 1, for each parameter ``w`` with gradient ``g``::

        local_lr = eta * ||w|| / (||g|| + beta * ||w||)      (1 if ||w|| or ||g|| is 0)
        v = m * v + lr * local_lr * (g + beta * w)
        w = w - v

    with trust coefficient ``eta``, weight decay ``beta`` and momentum ``m``. A group with
    ``trust=False`` uses ``local_lr = 1``.
    """

    def __init__(self, params: ParamsT, *, lr: float, momentum: float = 0.9,
                 weight_decay: float = 0.0, eta: float = 0.001, trust: bool = True) -> None:
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "eta": eta,
                    "trust": trust}
        super().__init__(params, defaults)

    def _update(self, w: torch.Tensor, group: dict[str, Any]) -> None:
        g, beta = w.grad, group["weight_decay"]
        assert g is not None
        if group["trust"]:
            w_norm, g_norm = torch.linalg.vector_norm(w), torch.linalg.vector_norm(g)
            local_lr = _where_both_positive(
                w_norm, g_norm, lambda: group["eta"] * w_norm / (g_norm + beta * w_norm))
        else:
            local_lr = torch.ones((), dtype=w.dtype, device=w.device)
        step = (g + beta * w) * (local_lr * group["lr"])
        state = self.state[w]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(w)
        buffer = state["momentum_buffer"]
        buffer.mul_(group["momentum"]).add_(step)
        w.sub_(buffer)


class Lamb(_PerParameter):
    """LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76
    minutes"), Algorithm 2 with phi the identity, for each parameter ``w`` with gradient ``g``
    at step ``t`` (from 1)::

        m = beta1 * m + (1 - beta1) * g             v = beta2 * v + (1 - beta2) * g**2
        m_hat = m / (1 - beta1**t)                  v_hat = v / (1 - beta2**t)
        u = m_hat / (sqrt(v_hat) + eps) + lambda * w
        w = w - lr * ||w|| / ||u|| * u              (ratio 1 if ||w|| or ||u|| is 0)

    with weight decay ``lambda``. A group with ``trust=False`` uses ratio 1.
    """

    def __init__(self, params: ParamsT, *, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, trust: bool = True) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "trust": trust}
        super().__init__(params, defaults)

    def _update(self, w: torch.Tensor, group: dict[str, Any]) -> None:
        g = w.grad
        assert g is not None
        beta1, beta2 = group["betas"]
        state = self.state[w]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(w)
            state["exp_avg_sq"] = torch.zeros_like(w)
        state["step"] += 1
        t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        r = (m / (1 - beta1 ** t)) / ((v / (1 - beta2 ** t)).sqrt() + group["eps"])
        u = r + group["weight_decay"] * w
        if group["trust"]:
            w_norm, u_norm = torch.linalg.vector_norm(w), torch.linalg.vector_norm(u)
            ratio = _where_both_positive(w_norm, u_norm, lambda: w_norm / u_norm)
            w.sub_(u * (ratio * group["lr"]))
        else:
            w.sub_(u, alpha=group["lr"])
