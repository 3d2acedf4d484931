"""The optimizer a worker steps over the parameters it holds: the run's class, options and
parameter groups (:func:`~tandem.runtime.learning_rate.build_optimizer`), compensated for stale
updates (:mod:`tandem.runtime.asynchrony`), and how its learning-rate schedule is made (the
user's scheduler, or tandem's warm-up, schedule and batch scaling)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch
from torch import nn

from tandem.runtime.asynchrony import Compensation, apply_compensation, compensation_for
from tandem.runtime.job import Job
from tandem.runtime.learning_rate import (
    SchedulerFn, build_optimizer, schedule_for, user_scheduler,
)
from tandem.runtime.param_groups import group_plan
from tandem.spec.sync import ElasticAveragingSync


def worker_optimizer(job: Job, params: Iterable[tuple[str, torch.Tensor]], *, model: nn.Module,
                     multiplier: Callable[[int], float], delay: int = 0,
                     every_stage: bool = False) -> tuple[torch.optim.Optimizer, Compensation,
                                                         torch.optim.lr_scheduler.LRScheduler]:
    """The optimizer over ``params`` (this worker's, under the names of the whole ``model``, on
    which the parameter groups are decided), with Nesterov momentum for EAMSGD's workers,
    compensated for updates ``delay`` versions stale (``every_stage``: PipeDream's vertical
    sync); its compensation; and the run's schedule over it (:func:`scheduler_maker`)."""
    config, sync = job.run, job.plan.sync
    groups = group_plan(config, model, getattr(job.objects, "param_groups", None))
    nesterov = isinstance(sync, ElasticAveragingSync) and sync.nesterov
    optimizer = build_optimizer(config, params, nesterov=nesterov, groups=groups)
    compensation = apply_compensation(
        optimizer, compensation_for(config, delay, every_stage=every_stage))
    return optimizer, compensation, scheduler_maker(job, multiplier)(optimizer)


def scheduler_maker(job: Job, multiplier: Callable[[int], float]) -> SchedulerFn:
    """What makes the run's learning-rate schedule over an optimizer: the user's ``scheduler``
    (``tandem.fit(..., scheduler=...)``: :func:`user_scheduler`), else :func:`schedule_for`
    with ``multiplier`` (warm-up, schedule and the batch's scaling at each step)."""
    user = getattr(job.objects, "scheduler", None)
    if user is not None:
        return functools.partial(user_scheduler, user)
    return functools.partial(schedule_for, job.run, multiplier=multiplier)
