"""The micro-batch counts a plan can run: divisors of the minibatch, as ``tandem train`` requires.

Usage::

    batch = minibatch(profile, sim)                     # None when unknown
    counts = microbatch_counts(plan, ScheduleKind.ONE_F_ONE_B, None, batch)

Flush schedules without a given count try the smallest divisor at least each multiple
:data:`MICROBATCH_FACTORS` of the default; with the minibatch unknown (a PipeDream ``graph.txt``
without ``--profile-batch``) the next power of two.
"""

from __future__ import annotations

from tandem.errors import UsageError
from tandem.plan import Plan, default_microbatches
from tandem.planning.simulate.simulator import SimOptions
from tandem.profile import ModelProfile
from tandem.spec.kinds import ScheduleKind

MICROBATCH_FACTORS = (1, 2, 4)
"""Flush schedules without a given count: micro-batches tried, as multiples of the default."""


def minibatch(profile: ModelProfile, sim: SimOptions) -> int | None:
    """Samples in the minibatch the plan runs, when known and whole."""
    if not profile.batch_size:
        return None
    samples = profile.batch_size * sim.batch_scale
    return int(samples) if float(samples).is_integer() and samples >= 1 else None


def microbatch_counts(plan: Plan, schedule: ScheduleKind, given: int | None,
                      batch: int | None) -> list[int | None]:
    """Micro-batch counts to try for ``plan`` under ``schedule``: ``given`` (checked), or the
    smallest divisor of ``batch`` at least each multiple of the default (a multiple of the
    replicas for data parallelism); :class:`UsageError` when none can run."""
    if not schedule.flushes:
        return [None]
    step = plan.stages[0].replicas if len(plan.stages) == 1 and schedule.accumulates else 1
    if given is not None:
        if given % step:
            raise UsageError(f"--microbatches {given} is not a multiple of its {step} replicas")
        if batch is not None and batch % given:
            raise UsageError(f"--microbatches {given} does not divide the minibatch of {batch}")
        return [given]
    if batch is not None and batch % step:
        raise UsageError(f"its {step} replicas do not divide the minibatch of {batch}")
    base = default_microbatches(plan.replicas, schedule)
    counts: list[int | None] = []
    for factor in MICROBATCH_FACTORS:
        count = _count_at_least(base * factor, step, batch)
        if count is not None and count not in counts:
            counts.append(count)
    return counts or [batch]


def _count_at_least(wanted: int, step: int, batch: int | None) -> int | None:
    """The smallest multiple of ``step`` at least ``wanted`` that divides ``batch`` (None when
    there is none); without a batch, the smallest such power-of-two multiple of ``step``."""
    if batch is None:
        count = step
        while count < wanted:
            count *= 2
        return count
    return next((count for count in range(step, batch + 1, step)
                 if count >= wanted and batch % count == 0), None)
