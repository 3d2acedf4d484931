"""The optimizer a run builds, and its learning rate at each step and global batch (warm-up,
schedule, ``--lr-scaling`` with the batch)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from tandem.errors import UsageError
from tandem.runtime.config import DEFAULT_BASE_BATCH, RunConfig, step_decay
from tandem.runtime.optimizer_class import (
    check_option_names, check_optimizer, optimizer_class, optimizer_kwargs,
)
from tandem.runtime.param_groups import GroupPlan
from tandem.spec.optimizer import TANDEM_OPTIMIZERS

if TYPE_CHECKING:
    from tandem.sync import SyncStrategy


def build_optimizer(config: RunConfig,
                    params: Iterable[torch.Tensor | tuple[str, torch.Tensor]], *,
                    nesterov: bool = False, groups: GroupPlan | None = None,
                    ) -> torch.optim.Optimizer:
    """The optimizer named in ``config`` over ``params`` (tensors, or ``(name, tensor)`` pairs
    under the whole model's names, as ``named_parameters()`` gives them), at :func:`scaled_lr`
    for the run's first batch, with the keyword arguments of
    :func:`~tandem.runtime.optimizer_class.optimizer_kwargs`; ``nesterov``: SGD with Nesterov
    momentum (EAMSGD's workers; :class:`~tandem.runtime.job.Job` has checked that the optimizer
    is SGD with momentum). ``groups``: the parameter groups by name
    (:mod:`tandem.runtime.param_groups`), every one of them in order; None: one group.

    LARS and LAMB get two groups, always in this order (a pipeline stage's checkpoint matches
    groups by position): the weights (``ndim >= 2``), with trust ratio and weight decay, then the
    biases and normalization parameters (``ndim <= 1``), with neither, as in both papers. Their
    norms are taken per whole parameter: data-parallel replicas hold the whole model, a pipeline
    stage whole parameters, and a parameter server a shard of whole parameters
    (:func:`tandem.runtime.ps.protocol.shard_ranges` cuts between tensors); a tensor-parallel
    share or an FSDP2 shard is a DTensor, whose norm sums the shares (convolutions split by
    channels, plain tensors, are refused with LARS/LAMB: ``check_trust_ratios``)."""
    named = [p if isinstance(p, tuple) else ("", p) for p in params]
    tensors = [tensor for _, tensor in named]
    cls = optimizer_class(config.optimizer)
    kwargs = optimizer_kwargs(config, cls, lr=scaled_lr(config), nesterov=nesterov)
    if config.optimizer in TANDEM_OPTIMIZERS:
        if groups is not None:
            raise UsageError(f"--optimizer {config.optimizer} makes its own parameter groups "
                             f"(weights, then biases and norms); drop param_groups")
        own: list[dict[str, Any]] = [{"params": [p for p in tensors if p.ndim > 1]},
                  {"params": [p for p in tensors if p.ndim <= 1], "weight_decay": 0.0,
                   "trust": False}]
        return cls(own, **kwargs)
    if groups is None:
        return cls(tensors, **kwargs)
    for number, options in enumerate(groups.options):
        check_option_names(cls, list(options), f"param_groups(model): group {number} sets")
    return cls(groups.assign(named), **kwargs)


def scaled_lr(config: RunConfig, batch_size: int | None = None, *,
              noise_scale: float | None = None) -> float:
    """The learning rate at global batch ``batch_size`` (default ``config.batch_size``): ``--lr``
    itself, or with ``--lr-scaling`` the ``--lr`` given for ``--base-batch`` B0 times ``B/B0``
    (linear), ``sqrt(B/B0)`` (sqrt) or :func:`auto_lr_factor` at the measured ``noise_scale``
    (auto); warm-up and schedule multiply it (:func:`lr_factor`)."""
    batch = config.batch_size if batch_size is None else batch_size
    if config.lr_scaling is None:
        return config.lr
    base = config.base_batch or DEFAULT_BASE_BATCH
    if config.lr_scaling == "auto":
        return config.lr * auto_lr_factor(batch, base, noise_scale)
    ratio = batch / base
    return config.lr * (ratio if config.lr_scaling == "linear" else math.sqrt(ratio))


def auto_lr_factor(batch: float, base_batch: float, noise_scale: float | None) -> float:
    """``--lr-scaling auto``: what multiplies the learning rate tuned at ``base_batch`` B0 at
    ``batch`` B, by McCandlish et al.'s model (2018, eqs. 2.6-2.7). A step at batch B makes as
    much progress as ``1 / (1 + B_noise/B)`` steps of a noiseless gradient (the steps to a loss
    are ``S_min (1 + B_noise/B)``), and the best SGD learning rate follows the same gain,
    ``eps_max / (1 + B_noise/B)``; so::

        factor = (1 + B_noise/B0) / (1 + B_noise/B)

    Linear (B/B0) while B is far below the noise scale, flat (1) far above it: always between
    1 and B/B0. While ``noise_scale`` is unknown (None: not measured yet), 1, the learning rate
    as tuned (a larger one before the noise scale says it pays is what makes large batches
    diverge)."""
    if noise_scale is None or not noise_scale > 0:
        return 1.0
    return (1.0 + noise_scale / base_batch) / (1.0 + noise_scale / batch)


def lr_factor(config: RunConfig, step: int) -> float:
    """Learning-rate multiplier at ``step``: linear warm-up, then constant, cosine decay, or
    step decay (``step:FACTOR@STEP,...``: times FACTOR at each STEP reached)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.lr_schedule.startswith("step:"):
        factor, milestones = step_decay(config.lr_schedule, steps=config.steps)
        return factor ** bisect.bisect_right(milestones, step)
    if config.lr_schedule == "cosine":
        progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0


def batch_lr_factor(config: RunConfig, batch_size: int, *,
                    noise_scale: float | None = None) -> float:
    """Learning-rate multiplier for a step of global batch ``batch_size`` against the run's
    first batch (``config.batch_size``) before any noise scale is measured, which
    :func:`build_optimizer` scaled for: 1 without ``--lr-scaling`` (the learning rate does not
    follow a ``--batch-schedule``), else the ratio of :func:`scaled_lr` at the two (``auto``:
    at the measured ``noise_scale``, so the rate follows the estimate as it settles). Every
    trainer's learning rate goes through here
    (:meth:`~tandem.runtime.base.BaseTrainer.setup_optimizer`, the parameter server's step)."""
    if config.lr_scaling is None:
        return 1.0
    return scaled_lr(config, batch_size, noise_scale=noise_scale) / scaled_lr(config)


def constant_lr(config: RunConfig) -> bool:
    """Whether the learning rate never changes during the run: no warm-up, a constant schedule
    and no ``--lr-scaling`` (which follows a growing batch)."""
    return (config.warmup_steps == 0 and config.lr_schedule == "constant"
            and config.lr_scaling is None)


class StepSchedule(torch.optim.lr_scheduler.LambdaLR):
    """``LambdaLR`` over ``multiplier`` that, where the run's rate is constant
    (:func:`constant_lr`), only counts its steps: its state (``last_epoch``) and rates are the
    same as ``LambdaLR``'s, without recomputing them after every optimizer step."""

    def __init__(self, optimizer: torch.optim.Optimizer, multiplier: Callable[[int], float], *,
                 constant: bool, last_epoch: int = -1) -> None:
        self.constant = constant
        super().__init__(optimizer, multiplier, last_epoch=last_epoch)

    def step(self, epoch: int | None = None) -> None:
        if self.constant and epoch is None and self.last_epoch >= 0:
            self.last_epoch += 1
            return
        super().step(epoch)


def schedule_for(config: RunConfig, optimizer: torch.optim.Optimizer,
                 multiplier: Callable[[int], float], last_epoch: int = -1) -> StepSchedule:
    """The run's learning-rate schedule over ``optimizer``: ``multiplier`` of each step."""
    return StepSchedule(optimizer, multiplier, constant=constant_lr(config),
                        last_epoch=last_epoch)


SchedulerFn = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]
"""``scheduler(optimizer)``: a learning-rate scheduler of the user's over the run's optimizer."""


def user_scheduler(make: SchedulerFn, optimizer: torch.optim.Optimizer,
                   ) -> torch.optim.lr_scheduler.LRScheduler:
    """The user's scheduler over ``optimizer`` (``tandem.fit(..., scheduler=make)``), stepped
    after every optimizer step as :class:`StepSchedule` is; one line if ``make`` returns
    something else, or a scheduler that needs a metric at each step."""
    made = make(optimizer)
    if isinstance(made, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise UsageError("scheduler(optimizer) returned ReduceLROnPlateau, which steps on a "
                         "metric that tandem's loop does not pass; use a scheduler stepped "
                         "per step (LambdaLR, OneCycleLR, CosineAnnealingLR, ...)")
    if not isinstance(made, torch.optim.lr_scheduler.LRScheduler):
        raise UsageError(f"scheduler(optimizer) returned {type(made).__name__}; return a "
                         f"torch.optim.lr_scheduler.LRScheduler over the optimizer it is given, "
                         f"e.g. lambda opt: torch.optim.lr_scheduler.StepLR(opt, 100)")
    if made.optimizer is not optimizer:
        raise UsageError("scheduler(optimizer) returned a scheduler of another optimizer; "
                         "build it over the optimizer it is given")
    return made


def sharded_optimizer(strategy: SyncStrategy, optimizer: torch.optim.Optimizer,
                      scheduler: torch.optim.lr_scheduler.LRScheduler,
                      make: SchedulerFn) -> tuple[torch.optim.Optimizer,
                                                  torch.optim.lr_scheduler.LRScheduler]:
    """The optimizer and schedule a worker steps: ``optimizer`` and ``scheduler``, or where
    ``strategy`` shards the optimizer state, its sharded optimizer with a schedule ``make``
    makes over it."""
    sharded = strategy.shard_optimizer(optimizer)
    if sharded is optimizer:
        return optimizer, scheduler
    return sharded, make(sharded)


def check_run_optimizer(run: RunConfig, objects: Any, model: torch.nn.Module, *,
                        stale: bool) -> None:
    """Before launch: the optimizer (:func:`check_optimizer`), and its groups built over
    ``model`` (the whole model, as the launcher builds it): the options each group sets, and
    no group's own momentum or ``beta1`` where ``stale`` updates are compensated (the
    compensation sets one for every group)."""
    from tandem.runtime.param_groups import group_plan

    check_optimizer(run)
    groups = group_plan(run, model, getattr(objects, "param_groups", None))
    if groups is None:
        return
    for number, options in enumerate(groups.options):
        own = [key for key in ("betas", "momentum") if key in options]
        if own and stale:
            raise UsageError(f"param_groups(model): group {number} sets its own {own[0]}, and "
                             f"this run's stale updates are compensated by one momentum for "
                             f"every group (see --async-compensation); drop it from the group, "
                             f"or give --async-compensation off")
    try:
        build_optimizer(run, model.named_parameters(), groups=groups)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, UsageError):
            raise
        lines = str(exc).strip().splitlines()
        raise UsageError(f"param_groups(model): {optimizer_class(run.optimizer).__name__} "
                         f"refused the groups ({lines[0] if lines else type(exc).__name__}); "
                         f"fix their options") from None
