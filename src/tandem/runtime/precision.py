"""Mixed precision and gradient clipping around a worker's forward, backward and optimizer step.

``--precision bf16`` or ``fp16`` runs the forward under ``torch.autocast`` (parameters, their
gradients and the optimizer stay in fp32); fp16 adds a ``GradScaler``: the loss is scaled
before the backward, the gradients are unscaled before they are clipped, synchronized or
applied, and a step whose gradients overflowed (inf or NaN) is skipped and counted while the
scale shrinks. ``--clip-grad-norm X`` scales the gradients so that their global L2 norm is at
most X. Where that norm is computed decides what "global" means, so each strategy calls
:meth:`Precision.unscale_and_clip` where its gradient is the one applied (after DDP's allreduce
in data parallelism, a worker's own gradient in local SGD, gossip, EASGD and asynchronous
parameter servers); pipelines sum the squared norms of every stage (:class:`StagePrecision`,
whose stages also share one loss scale, :class:`LossScale`).

Usage::

    precision = Precision(config.precision, device, clip=config.clip_grad_norm)
    with precision.autocast():
        loss = loss_fn(model(x), y)
    precision.backward(loss)
    precision.unscale_and_clip(optimizer, model.parameters())
    precision.step(optimizer)                  # skipped (and counted) after an overflow

A pipeline stage (flush schedules) instead::

    precision = StagePrecision(config.precision, device, clip=config.clip_grad_norm,
                               counted=parameters_it_counts_in_the_norm)
    with precision.autocast():
        out = stage(x)                         # last stage: loss * precision.loss_factor
    ...                                        # backwards, replicas' allreduce, tied sums
    precision.step(optimizer, stage.parameters())   # collective: every worker calls it
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from typing import Any, ContextManager

import torch
import torch.distributed as dist

from tandem.runtime.component import Component

PRECISIONS = ("fp32", "bf16", "fp16")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision(Component):
    """One worker's autocast, loss scaler and clipping, with the count of skipped steps."""

    name = "precision"

    def __init__(self, precision: str, device: torch.device, *, clip: float | None = None,
                 autocast: bool = True) -> None:
        self.precision, self.device, self.clip = precision, device, clip
        self.autocasts = autocast and precision != "fp32"
        """Whether the forward runs under autocast (False: fp32, or a strategy that casts the
        parameters itself, FSDP2's mixed precision)."""
        self.scaler = (torch.amp.GradScaler(device.type) if precision == "fp16" else None)
        self.skipped_steps = 0
        self.skipped_in_a_row = 0
        """Skipped steps since the last applied one (many in a row is divergence)."""
        self.found_inf = False
        self.last_norm: float | None = None
        """The global gradient norm before clipping, at the last :meth:`unscale_and_clip`."""

    def autocast(self) -> ContextManager[Any]:
        """The forward's context: autocast to bf16/fp16, or nothing (fp32, or a strategy that
        casts the parameters itself)."""
        if not self.autocasts:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=DTYPES[self.precision])

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, of the scaled loss with fp16."""
        scaled: torch.Tensor = self.scaler.scale(loss) if self.scaler is not None else loss
        torch.autograd.backward(scaled)

    def unscale_and_clip(self, optimizer: torch.optim.Optimizer,
                         parameters: Iterable[torch.nn.Parameter]) -> bool:
        """Unscale the gradients (fp16) and clip their global norm (``--clip-grad-norm``);
        returns whether they are finite (False: this step will be skipped)."""
        if self.scaler is None and self.clip is None:  # fp32/bf16 unclipped: nothing per step
            self.found_inf = False
            return True
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
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if self.found_inf else 0
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state and the skipped-step count, for checkpoints."""
        return {"scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s, or from a pipeline's :class:`StagePrecision`
        (its scale, on the same rule)."""
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        elif self.scaler is not None and state.get("loss_scale"):
            self.scaler.load_state_dict({
                **self.scaler.state_dict(), "scale": float(state["loss_scale"]["scale"]),
                "_growth_tracker": int(state["loss_scale"]["good_steps"])})
        self.skipped_steps = int(state.get("skipped_steps", 0))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this worker holds: a DTensor's local shard (tensor parallelism's
    split layers, without importing DTensor here), else the tensor."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


class LossScale:
    """fp16's dynamic loss scale, updated from a found-inf flag the caller gives: the rule of
    ``torch.amp.GradScaler`` (start at ``2**16``; halve after an overflow; double after
    ``growth_interval`` steps in a row without one). Processes that give it the same flags hold
    the same scale, which is how the stages of a pipeline share one."""

    def __init__(self, init: float = 2.0**16, *, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        self.scale = init
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0
        """Steps without an overflow since the scale last changed."""

    def unscale(self, grads: list[torch.Tensor]) -> bool:
        """Divide ``grads`` by the scale in place; returns whether any is not finite."""
        inverse = 1.0 / self.scale
        finite = []
        for grad in grads:
            grad.mul_(inverse)
            finite.append(torch.isfinite(grad).all())
        return bool(finite) and not bool(torch.stack(finite).all())

    def update(self, found_inf: bool) -> None:
        """Back off after an overflow, grow after ``growth_interval`` good steps."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0


class StagePrecision(Component):
    """Autocast, loss scale and clipping of one pipeline stage (flush schedules: every worker
    steps once per optimizer step, so they can decide together).

    The last stage multiplies its loss by :attr:`loss_factor`, so the gradients of every stage
    carry the same scale. Tensor parallelism's workers use it too (one stage: each counts its
    shares of the split layers, the first the whole layers, so that the norm is the model's). At the step each worker unscales its gradients, and one allreduce over
    all workers sums each stage's squared gradient norm (of its ``counted`` parameters: replica
    0's, and a tied weight on the first stage that holds it, so each is counted once) and the
    workers that found an overflow. Every worker then skips the step and backs off the scale,
    or clips by the same factor, steps and grows it. Without fp16 or clipping no collective
    runs (the asynchronous schedule, which has no common step, may use bf16 only).
    """

    name = "precision"

    def __init__(self, precision: str, device: torch.device, *, clip: float | None = None,
                 counted: Iterable[torch.nn.Parameter] = ()) -> None:
        self.precision, self.device, self.clip = precision, device, clip
        self.loss_scale = LossScale() if precision == "fp16" else None
        self.counted = {id(p) for p in counted}
        self.skipped_steps = 0
        self.skipped_in_a_row = 0
        """Steps skipped since the last applied one (many in a row is divergence)."""
        self.last_norm: float | None = None
        """The whole model's gradient norm before clipping, at the last step (with clipping)."""

    @property
    def agrees(self) -> bool:
        """Whether the step is collective (fp16's overflow flag, or the norm to clip)."""
        return self.loss_scale is not None or self.clip is not None

    def autocast(self) -> ContextManager[Any]:
        """The forward's (and the loss's) context: autocast to bf16/fp16, or nothing."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=DTYPES[self.precision])

    @property
    def loss_factor(self) -> float:
        """What the last stage multiplies its loss by: the loss scale (1 without fp16)."""
        return self.loss_scale.scale if self.loss_scale is not None else 1.0

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, of the loss times :attr:`loss_factor` (a worker that computes
        the loss itself: tensor parallelism's)."""
        factor = self.loss_factor
        torch.autograd.backward(loss if factor == 1.0 else loss * factor)

    def step(self, optimizer: torch.optim.Optimizer,
             parameters: Iterable[torch.nn.Parameter]) -> bool:
        """Unscale, agree with every worker, clip, and step unless a gradient anywhere
        overflowed (counted in ``skipped_steps``); returns whether it stepped. Collective over
        the default group when :attr:`agrees`."""
        if not self.agrees:
            optimizer.step()
            return True
        params = [p for p in parameters if p.grad is not None]
        grads = [_local(g) for g in (p.grad for p in params) if g is not None]
        found = self.loss_scale.unscale(grads) if self.loss_scale is not None else False
        counted = [_local(g) for g in (p.grad for p in params if id(p) in self.counted)
                   if g is not None]
        squared = (float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in counted]))) ** 2 if counted else 0.0)
        totals = torch.tensor([squared, float(found)], dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        overflow = self.loss_scale is not None and (
            totals[1].item() > 0 or not math.isfinite(totals[0].item()))
        if self.clip is not None and not overflow:
            self.last_norm = math.sqrt(totals[0].item())
            factor = min(1.0, self.clip / (self.last_norm + 1e-6))  # as clip_grad_norm_
            for grad in grads if factor < 1.0 else ():
                grad.mul_(factor)
        if not overflow:
            optimizer.step()
        if self.loss_scale is not None:
            self.loss_scale.update(overflow)
            self.skipped_steps += int(overflow)
            self.skipped_in_a_row = self.skipped_in_a_row + 1 if overflow else 0
        return not overflow

    def state_dict(self) -> dict[str, Any]:
        """fp16's shared loss scale (None without fp16) and the count of skipped steps, for
        checkpoints (every worker's are the same)."""
        scale = self.loss_scale
        return {"loss_scale": None if scale is None else {"scale": scale.scale,
                                                          "good_steps": scale.good_steps},
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s, or a data-parallel run's (a checkpoint without
        fp16 leaves the scale at its start)."""
        scale = self.loss_scale
        if scale is not None and state.get("loss_scale"):
            scale.scale = float(state["loss_scale"]["scale"])
            scale.good_steps = int(state["loss_scale"]["good_steps"])
        elif scale is not None and state.get("scaler"):  # a data-parallel run's GradScaler
            scale.scale = float(state["scaler"]["scale"])
            scale.good_steps = int(state["scaler"]["_growth_tracker"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
