"""Micro-batch counts of the pipelines ``tandem scale`` draws: whole numbers that divide the
step's samples, as ``tandem train`` requires.

Usage::

    micro_plan(plan, samples=512, per_stage=4)        # 1F1B, 4 micro-batches per stage
    accumulated(one_stage, 512, 4, fastest)           # the fewest micro-batches that fit
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tandem.plan import Plan
from tandem.spec.kinds import ScheduleKind

MAX_MICROBATCHES = 2048
"""Most micro-batches per step a pipeline is simulated with."""


def micro_plan(plan: Plan, samples: int | None, per_stage: int) -> Plan | str:
    """``plan`` on 1F1B with ``per_stage`` micro-batches per stage and per replica of its
    widest stage, or the nearest count below that divides the step's ``samples`` (a one-stage
    plan's: a multiple of its replicas), at most :data:`MAX_MICROBATCHES`; or why no count
    does."""
    counts = _counts(plan, samples)
    if isinstance(counts, str):
        return counts
    target = per_stage * _least_count(plan)
    count = max((m for m in counts if m <= target), default=counts[0])
    return dataclasses.replace(plan, schedule=ScheduleKind.ONE_F_ONE_B, num_microbatches=count)


def accumulated(plan: Plan, samples: int | None, per_stage: int,
                fastest: Callable[[list[Plan]], Plan]) -> Plan | str:
    """The one-stage ``plan`` (the whole model on one device) as ``fastest`` picks it among its
    counts up to :func:`micro_plan`'s, fitting ones first: the whole minibatch at once (the
    one-device baseline itself) when that fits, else the fewest micro-batches that do (gradient
    accumulation); or why no count divides the ``samples``."""
    counts = _counts(plan, samples)
    if isinstance(counts, str):
        return counts
    most = per_stage * _least_count(plan)
    return fastest([dataclasses.replace(plan, schedule=ScheduleKind.ONE_F_ONE_B,
                                        num_microbatches=count)
                    for count in counts if count <= most or count == counts[0]])


def _least_count(plan: Plan) -> int:
    """Micro-batches ``plan`` needs at least: one per stage and per replica of its widest."""
    return max(len(plan.stages), max(stage.replicas for stage in plan.stages))


def _counts(plan: Plan, samples: int | None) -> list[int] | str:
    """The counts ``plan`` can run on 1F1B, ascending: at least :func:`_least_count`, dividing
    ``samples`` (a one-stage plan's a multiple of its replicas), at most
    :data:`MAX_MICROBATCHES`; or why none can."""
    widest = max(stage.replicas for stage in plan.stages)
    needed = _least_count(plan)
    step = widest if len(plan.stages) == 1 else 1
    counts = [m for m in range(needed, min(MAX_MICROBATCHES, samples or MAX_MICROBATCHES) + 1)
              if m % step == 0 and (samples is None or samples % m == 0)]
    if not counts:
        return (f"{plan.config}: no micro-batch count from {needed} up divides the batch of "
                f"{samples} samples{f' into a multiple of {step}' if step > 1 else ''}")
    return counts
