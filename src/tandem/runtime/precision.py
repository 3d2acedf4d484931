"""Mixed precision and gradient clipping around a worker's forward, backward and optimizer step.

``--precision bf16`` or ``fp16`` runs the forward under ``torch.autocast`` (parameters, their
gradients and the optimizer stay in fp32); fp16 adds a ``GradScaler``: the loss is scaled
before the backward, the gradients are unscaled before they are clipped, synchronized or
applied, and a step whose gradients overflowed (inf or NaN) is skipped and counted while the
scale shrinks. ``--clip-grad-norm X`` scales the gradients so that their global L2 norm is at
most X. Where that norm is computed decides what "global" means, so each strategy calls
:meth:`Precision.unscale_and_clip` where its gradient is the one applied (after DDP's allreduce
in data parallelism, a worker's own gradient in local SGD, gossip, EASGD and asynchronous
parameter servers); pipelines sum the squared norms of every stage (:func:`clip_by_total_norm`).

Usage::

    precision = Precision(config.precision, device, clip=config.clip_grad_norm)
    with precision.autocast():
        loss = loss_fn(model(x), y)
    precision.backward(loss)
    precision.unscale_and_clip(optimizer, model.parameters())
    precision.step(optimizer)                  # skipped (and counted) after an overflow
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from typing import Any, ContextManager

import torch

PRECISIONS = ("fp32", "bf16", "fp16")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """One worker's autocast, loss scaler and clipping, with the count of skipped steps."""

    def __init__(self, precision: str, device: torch.device, *, clip: float | None = None) -> None:
        self.precision, self.device, self.clip = precision, device, clip
        self.scaler = (torch.amp.GradScaler(device.type) if precision == "fp16" else None)
        self.skipped_steps = 0
        self.found_inf = False
        self.last_norm: float | None = None
        """The global gradient norm before clipping, at the last :meth:`unscale_and_clip`."""

    def autocast(self) -> ContextManager[Any]:
        """The forward's context: autocast to bf16/fp16, or nothing for fp32."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=DTYPES[self.precision])

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, of the scaled loss with fp16."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale_and_clip(self, optimizer: torch.optim.Optimizer,
                         parameters: Iterable[torch.nn.Parameter]) -> bool:
        """Unscale the gradients (fp16) and clip their global norm (``--clip-grad-norm``);
        returns whether they are finite (False: this step will be skipped)."""
        params = [p for p in parameters if p.grad is not None]
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
            found = sum(float(v.sum()) for v in
                        self.scaler._found_inf_per_device(optimizer).values())  # noqa: SLF001
            self.found_inf = found > 0
        else:
            self.found_inf = False
        if self.clip is not None and params:
            norm = torch.nn.utils.clip_grad_norm_(params, self.clip)
            self.last_norm = float(norm)
            if not math.isfinite(self.last_norm):
                self.found_inf = True
        return not self.found_inf

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Apply the gradients, unless they overflowed (fp16: counted in ``skipped_steps``)."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.finish_step()

    def finish_step(self) -> None:
        """Update the loss scale after a step (or, where a server applies the gradients, after
        the push) and count a skipped one."""
        if self.scaler is None:
            return
        if self.found_inf:
            self.skipped_steps += 1
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state and the skipped-step count, for checkpoints."""
        return {"scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


def clip_by_total_norm(parameters: list[torch.nn.Parameter], max_norm: float,
                       squared_norm: torch.Tensor) -> float:
    """Clip ``parameters``' gradients given the squared global norm ``squared_norm`` (summed
    over every process holding a part of the model); returns the norm before clipping."""
    norm = float(squared_norm.sqrt())
    if math.isfinite(norm) and norm > max_norm:
        factor = max_norm / (norm + 1e-6)
        for p in parameters:
            if p.grad is not None:
                p.grad.mul_(factor)
    return norm
