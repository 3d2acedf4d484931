"""Batch-size schedules: ``--batch-schedule 64@0,128@200,256@400`` read, checked and looked up,
and the ``auto`` policy that grows the batch toward the gradient noise scale.

Increasing the batch instead of decaying the learning rate follows Smith, Kindermans, Ying and
Le, "Don't Decay the Learning Rate, Increase the Batch Size" (ICLR 2018). A schedule is plain
data: a tuple of ``(first_step, batch_size)`` pairs, the first at step 0, steps and batches both
increasing. Pure: imports nothing but the standard library and tandem's errors.

Usage::

    schedule = parse_batch_schedule("64@0,128@200", steps=300)   # ((0, 64), (200, 128))
    batch_at(schedule, 250)                                       # 128
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from tandem.errors import UsageError

BatchSchedule = tuple[tuple[int, int], ...]
"""``(first_step, batch_size)`` pairs in increasing order, the first at step 0."""

AUTO = "auto"
"""``--batch-schedule auto``: grow the batch toward the measured gradient noise scale."""

AUTO_GROWTH = 2
"""The ``auto`` policy multiplies the batch by this when the noise scale allows."""

EXAMPLE = "64@0,128@200,256@400"


def parse_batch_schedule(text: str, *, steps: int) -> BatchSchedule:
    """The schedule of ``--batch-schedule TEXT`` (``BATCH@STEP,...``) for a run of ``steps``
    optimizer steps; one :class:`UsageError` naming the entry and the fix if it is malformed,
    does not start at step 0, does not increase, or changes at or after the last step."""
    entries = [part.strip() for part in text.split(",")]
    if not text.strip() or any(not part for part in entries):
        raise UsageError(f"--batch-schedule {text!r} has an empty entry; give BATCH@STEP pairs "
                         f"separated by commas, e.g. {EXAMPLE}")
    schedule = tuple(_entry(part, text) for part in entries)
    if schedule[0][0] != 0:
        raise UsageError(f"--batch-schedule {text!r} starts at step {schedule[0][0]}; its first "
                         f"entry gives the batch from step 0, e.g. {schedule[0][1]}@0")
    for (step, batch), (next_step, next_batch) in zip(schedule, schedule[1:]):
        if next_step <= step:
            raise UsageError(f"--batch-schedule {text!r}: step {next_step} does not come after "
                             f"step {step}; list the steps in increasing order, e.g. {EXAMPLE}")
        if next_batch <= batch:
            raise UsageError(f"--batch-schedule {text!r}: the batch goes from {batch} to "
                             f"{next_batch} at step {next_step}; a batch schedule only grows "
                             f"(to lower the step size, use --lr-schedule step:FACTOR@STEPS)")
    last_step = schedule[-1][0]
    if last_step >= steps:
        raise UsageError(f"--batch-schedule {text!r} changes the batch at step {last_step}, but "
                         f"the run has --steps {steps} (steps 0 to {steps - 1}); use steps "
                         f"below {steps} or more --steps")
    return schedule


def _entry(part: str, text: str) -> tuple[int, int]:
    batch_text, at, step_text = part.partition("@")
    try:
        if not at:
            raise ValueError(part)
        batch, step = int(batch_text), int(step_text)
    except ValueError:
        raise UsageError(f"--batch-schedule {text!r}: entry {part!r} is not BATCH@STEP (two "
                         f"whole numbers); e.g. {EXAMPLE}") from None
    if batch < 1 or step < 0:
        raise UsageError(f"--batch-schedule {text!r}: entry {part!r} needs a batch of at least 1 "
                         f"and a step of at least 0; e.g. {EXAMPLE}")
    return step, batch


def format_schedule(schedule: Sequence[tuple[int, int]]) -> str:
    """The text form of ``schedule`` (parses back to it): ``64@0,128@200``."""
    return ",".join(f"{batch}@{step}" for step, batch in schedule)


def batch_at(schedule: Sequence[tuple[int, int]], step: int) -> int:
    """The global batch of optimizer step ``step`` (0-based) under ``schedule``."""
    starts = [start for start, _ in schedule]
    return schedule[bisect.bisect_right(starts, step) - 1][1]


def auto_next_batch(current: int, noise_scale: float | None, *, workers: int,
                    max_batch: int) -> int:
    """The ``auto`` policy: the batch for the steps after a log interval.

    The gradient noise scale B_noise (McCandlish et al., "An empirical model of large-batch
    training", 2018) is the batch beyond which a larger batch stops shortening training much.
    While the estimate exceeds ``AUTO_GROWTH`` times the current batch, the batch grows by
    ``AUTO_GROWTH`` (once per call, so at most once per log interval): rounded down to a
    multiple of ``workers`` and capped at ``max_batch`` (the training split, rounded down the
    same way). It never shrinks; no estimate (None, or not finite) keeps the batch.
    """
    if noise_scale is None or not noise_scale == noise_scale or noise_scale == float("inf"):
        return current
    if noise_scale <= AUTO_GROWTH * current:
        return current
    cap = max(current, max_batch // workers * workers)
    grown = (current * AUTO_GROWTH) // workers * workers
    return max(current, min(grown, cap))
