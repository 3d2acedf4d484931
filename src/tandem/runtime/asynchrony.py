"""Compensation of asynchronous training's stale updates: the optimizer settings a worker or
stage uses when its gradients are computed on weights ``delay`` updates old.

A stale update is a step of delayed gradient descent, which is stable only for a long-run
step ``lr / (1 - momentum)`` about ``delay + 1`` times smaller than a synchronous one (on a
quadratic, up to ``2 sin(pi / (2 (2d + 1)))`` against 2, nearly whatever the momentum): with
the defaults tuned for synchronous training (lr 0.05, momentum 0.9) four asynchronous workers
stall or diverge. The compensation (``--async-compensation auto``, the default) scales the
learning rate and sets the momentum of every worker or stage whose updates are stale (see
:func:`compensation` for the rules and docs/large_batch.md for the measurements that chose
them): the long-run step per sample is the synchronous run's divided by ``sqrt(delay + 1)``
(by ``delay + 1``, the staleness-aware rate of Zhang, Gupta, Lian and Liu, "Staleness-aware
async-SGD for distributed deep learning", 2016, under PipeDream's vertical sync).

Momentum: Mitliagkas, Zhang, Hadjis and Ré ("Asynchrony begets momentum, with an application
to deep learning", 2016) show that with exponentially distributed delays asynchrony acts as an
implicit momentum ``1 - 1/M`` for ``M`` workers. The delays here are constant instead
(parameter servers' pushes arrive round-robin, nearly all ``W - 1`` updates stale; a
PipeDream stage is always a fixed number of updates behind), which add no momentum along flat
directions; measured, the parameter servers train best keeping the optimizer's momentum (its
average of the quarter-batch gradients smooths what sets the delayed updates oscillating:
taking the implicit momentum off instead gave twice the transient drops in accuracy), and
PipeDream's whole-batch updates without any.

Adam-family optimizers (adam, adamw, lamb and any other with ``betas``) compensate their
first-moment coefficient ``beta1`` as :func:`compensation` says; other ``torch.optim`` classes
with a ``momentum`` option compensate it as SGD's, and those with neither as SGD without
momentum.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import torch

from tandem.runtime.component import Component
from tandem.spec.kinds import CompensationMode

if TYPE_CHECKING:
    from tandem.runtime.config import RunConfig

@dataclasses.dataclass(frozen=True, slots=True)
class Compensation(Component):
    """The settings of a worker whose updates are ``delay`` versions stale."""

    delay: int
    """Versions between the weights a gradient is computed on and those it updates, as
    compensated (0: nothing is, stale or not)."""
    momentum: float
    """The explicit momentum (SGD, LARS) or ``beta1`` (Adam family) to use."""
    lr_scale: float
    """Multiplier of the learning rate."""
    groups: tuple[float | None, ...] = ()
    """Each optimizer group's momentum or ``beta1`` as :func:`apply_compensation` set it."""

    def describe(self) -> dict[str, float]:
        """The summary's account of it."""
        return {"delay": self.delay, "momentum": round(self.momentum, 6),
                "lr_scale": round(self.lr_scale, 6)}

    def summary(self) -> dict[str, Any]:
        """``async_compensation``: :meth:`describe`, or None where updates are not stale."""
        return {"async_compensation": self.describe() if self.delay else None}


def compensation(mode: str, momentum: float, delay: int, *, share: float = 1.0,
                 heavy_ball: bool = True, every_stage: bool = False) -> Compensation:
    """The compensated settings for updates ``delay`` versions stale, each computed on
    ``share`` of the global batch, under ``mode`` (``off``: none).

    Rules (``auto``), chosen by measurement (docs/large_batch.md, "Asynchronous training"):
    the synchronous run's long-run step ``lr / (1 - m)`` per sample, divided by ``sqrt(d + 1)``
    (by ``d + 1`` with vertical sync, the staleness-aware rate of Zhang et al.):

    - updates of a part of the batch (parameter servers, ``share = 1/W``, ``delay = W - 1``):
      the optimizer's momentum, and the learning rate scaled by the update's ``share`` (the
      linear scaling rule of Goyal et al.): ``lr_scale = share / sqrt(d + 1)``;
    - updates of whole batches (PipeDream, ``delay = S - 1``): no explicit momentum and
      ``lr_scale = 1 / ((1 - m) sqrt(d + 1))``; with vertical sync (``every_stage``: the last
      stages, which PipeDream alone keeps fresh, are ``d`` versions stale too) ``d + 1``
      instead of ``sqrt(d + 1)``.

    Adam's first moment is an average, not a sum (its step does not grow by ``1 / (1 -
    beta1)``), so without ``heavy_ball`` PipeDream's ``1 / (1 - m)`` is left out and PipeDream
    keeps ``beta1' = max(0, beta1 - d/(d+1))`` (with no first moment at all, Adam trained a
    compressed PipeDream worse: docs/large_batch.md).
    """
    if not CompensationMode(mode).compensates or delay <= 0:
        return Compensation(delay=0, momentum=momentum, lr_scale=1.0)  # nothing compensated
    if share < 1.0:
        return Compensation(delay=delay, momentum=momentum,
                            lr_scale=share / math.sqrt(delay + 1))
    divisor = delay + 1 if every_stage else math.sqrt(delay + 1)
    if not heavy_ball:
        kept = max(0.0, momentum - delay / (delay + 1))
        return Compensation(delay=delay, momentum=kept, lr_scale=1 / divisor)
    return Compensation(delay=delay, momentum=0.0, lr_scale=1 / ((1 - momentum) * divisor))


def compensation_for(config: RunConfig, delay: int, *, share: float = 1.0,
                     every_stage: bool = False) -> Compensation:
    """:func:`compensation` for a run's optimizer: SGD's and LARS's momentum, another's
    ``beta1`` or ``momentum`` (:func:`~tandem.runtime.optimizer_class.momentum_coefficient`)."""
    from tandem.runtime.optimizer_class import momentum_coefficient  # it imports the config

    coefficient, heavy_ball = momentum_coefficient(config)
    return compensation(config.async_compensation, coefficient, delay, share=share,
                        heavy_ball=heavy_ball, every_stage=every_stage)


def apply_compensation(optimizer: torch.optim.Optimizer, comp: Compensation) -> Compensation:
    """Scale ``optimizer``'s learning rate and, where updates are stale, set its momentum (or
    ``beta1``); call before a learning-rate scheduler is made over it (the scheduler starts
    from these rates). Returns ``comp`` holding each group's momentum as set, for
    :func:`restore_momentum`."""
    for group in optimizer.param_groups:
        group["lr"] *= comp.lr_scale
    if comp.delay:
        restore_momentum(optimizer, comp)
    return dataclasses.replace(comp, groups=tuple(_momentum(group)
                                                  for group in optimizer.param_groups))


def restore_momentum(optimizer: torch.optim.Optimizer, comp: Compensation) -> None:
    """Set ``optimizer``'s momentum (or ``beta1``) to ``comp``'s: after loading a checkpoint's
    optimizer state, whose groups carry the momentum of the run that saved it (another mode,
    schedule or number of workers compensates differently). Where nothing is compensated,
    each group gets back the momentum :func:`apply_compensation` found in it (groups may have
    their own)."""
    for number, group in enumerate(optimizer.param_groups):
        value = comp.momentum if comp.delay or number >= len(comp.groups) else comp.groups[number]
        if value is None:
            continue
        if "betas" in group:
            group["betas"] = (value, group["betas"][1])
        elif "momentum" in group:
            group["momentum"] = value


def _momentum(group: dict[str, Any]) -> float | None:
    """A group's momentum or ``beta1`` (None where it has neither)."""
    if "betas" in group:
        return float(group["betas"][0])
    return float(group["momentum"]) if "momentum" in group else None
