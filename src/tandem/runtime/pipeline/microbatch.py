"""A pipeline stage's micro-batches, taken from the batch feed.

Usage::

    batches = StageBatches(feed, first=stage == 0, last=stage == num_stages - 1, first_step=0)
    batches.step_microbatches(step, parts)   # a flush schedule's micro-batches of one step
    batches.minibatch(m)                     # the asynchronous schedule's minibatch m
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from tandem import structures
from tandem.data import Batch
from tandem.runtime.pipeline.compute import Microbatch

if TYPE_CHECKING:
    from tandem.runtime.batches import BatchFeed


class StageBatches:
    """The batches one stage reads: the inputs on the first stage, the targets on the last
    (the stages between read none)."""

    def __init__(self, feed: BatchFeed, *, first: bool, last: bool, first_step: int) -> None:
        self.feed, self.first, self.last = feed, first, last
        self.first_step = first_step
        """The run's first step, where the asynchronous schedule's minibatch 0 is taken."""

    @property
    def reads_data(self) -> bool:
        """Whether this stage takes batches: the first (inputs) and the last (targets)."""
        return self.first or self.last

    def planned(self, first: int, last: int) -> list[torch.Tensor]:
        """The sample indices of the global batches of steps ``first`` to ``last - 1`` (none
        for a stage that reads no data)."""
        if not self.reads_data:
            return []
        return [self.feed.sampler.global_indices(step) for step in range(first, last)]

    @functools.lru_cache(maxsize=4)  # noqa: B019 - bounded, per stage
    def global_batch(self, step: int) -> Batch:
        """The whole global batch of ``step`` (the stage takes its micro-batches from it)."""
        return self.feed.take(self.feed.sampler.global_indices(step))

    def step_microbatches(self, step: int, parts: int) -> list[Microbatch]:
        """The ``parts`` micro-batches of step ``step``: consecutive rows of its global batch,
        the first ``samples % parts`` one sample larger (as ``torch.tensor_split``); the inputs
        on the first stage, the targets on the last."""
        count = self.feed.sampler.batch_samples(step)
        whole = self.global_batch(step) if self.reads_data else None
        quotient, remainder = divmod(count, parts)
        inputs = whole.inputs if whole is not None and self.first else None
        targets = whole.targets if whole is not None and self.last else None
        micros, start = [], 0
        for m in range(parts):
            size = quotient + (m < remainder)
            rows = slice(start, start + size)
            micros.append(Microbatch(
                size=size, scale=1.0 / count, step=step,
                inputs=None if inputs is None else structures.take(inputs, rows),
                targets=None if targets is None else structures.take(targets, rows),
            ))
            start += size
        return micros

    @functools.lru_cache(maxsize=64)  # noqa: B019 - bounded, per stage
    def minibatch(self, m: int) -> Microbatch:
        """Minibatch ``m`` of the asynchronous schedule: the global batch of step
        ``first_step + m`` (the schedule starts at the run's first step)."""
        return self.step_microbatches(self.first_step + m, 1)[0]
