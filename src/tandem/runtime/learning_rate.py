"""The optimizer a run builds, and its learning rate at each step and global batch (warm-up,
schedule, ``--lr-scaling`` with the batch)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from typing import Any

import torch

from tandem.runtime.config import DEFAULT_BASE_BATCH, RunConfig, step_decay
from tandem.runtime.optimizers import Lamb, Lars


def build_optimizer(config: RunConfig,
                    params: Iterable[torch.Tensor | tuple[str, torch.Tensor]], *,
                    nesterov: bool = False) -> torch.optim.Optimizer:
    """The optimizer named in ``config`` over ``params`` (tensors, or ``(name, tensor)`` pairs
    as ``named_parameters()`` gives them), at :func:`scaled_lr` for the run's first batch;
    ``nesterov``: SGD with Nesterov momentum (EAMSGD's workers;
    :class:`~tandem.runtime.job.Job` has checked that the optimizer is SGD with momentum).

    LARS and LAMB get two groups, always in this order (a pipeline stage's checkpoint matches
    groups by position): the weights (``ndim >= 2``), with trust ratio and weight decay, then the
    biases and normalization parameters (``ndim <= 1``), with neither, as in both papers. Their
    norms are taken per whole parameter, which every worker holds: data-parallel replicas hold
    the whole model, a pipeline stage whole parameters, and a parameter server a shard of whole
    parameters (:func:`tandem.runtime.ps.protocol.shard_ranges` cuts between tensors)."""
    tensors = [p[1] if isinstance(p, tuple) else p for p in params]
    lr = scaled_lr(config)
    if config.optimizer == "sgd":
        return torch.optim.SGD(tensors, lr=lr, momentum=config.momentum,
                               weight_decay=config.weight_decay, nesterov=nesterov)
    if config.optimizer in ("lars", "lamb"):
        groups: list[dict[str, Any]] = [{"params": [p for p in tensors if p.ndim > 1]},
                  {"params": [p for p in tensors if p.ndim <= 1], "weight_decay": 0.0,
                   "trust": False}]
        if config.optimizer == "lars":
            return Lars(groups, lr=lr, momentum=config.momentum,
                        weight_decay=config.weight_decay)
        return Lamb(groups, lr=lr, weight_decay=config.weight_decay)
    cls = torch.optim.Adam if config.optimizer == "adam" else torch.optim.AdamW
    return cls(tensors, lr=lr, weight_decay=config.weight_decay)


def scaled_lr(config: RunConfig, batch_size: int | None = None) -> float:
    """The learning rate at global batch ``batch_size`` (default ``config.batch_size``): ``--lr``
    itself, or with ``--lr-scaling`` the ``--lr`` given for ``--base-batch`` B0 times ``B/B0``
    (linear) or ``sqrt(B/B0)`` (sqrt); warm-up and schedule multiply it (:func:`lr_factor`)."""
    batch = config.batch_size if batch_size is None else batch_size
    if config.lr_scaling is None:
        return config.lr
    ratio = batch / (config.base_batch or DEFAULT_BASE_BATCH)
    return config.lr * (ratio if config.lr_scaling == "linear" else math.sqrt(ratio))


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


def batch_lr_factor(config: RunConfig, batch_size: int) -> float:
    """Learning-rate multiplier for a step of global batch ``batch_size`` against the run's
    first batch (``config.batch_size``, which :func:`build_optimizer` scaled for): 1 without
    ``--lr-scaling`` (the learning rate does not follow a ``--batch-schedule``), else the ratio
    of :func:`scaled_lr` at the two batches. Every trainer's learning rate goes through here
    (:meth:`~tandem.runtime.base.BaseTrainer.setup_optimizer`, the parameter server's step)."""
    if config.lr_scaling is None:
        return 1.0
    return scaled_lr(config, batch_size) / scaled_lr(config)
