"""A user's sampler as the order of each epoch, for tandem's own batches.

tandem addresses every global batch by step (so a run resumes exactly and 1, 2 or 4 workers see
the same batches), cuts each over the data-parallel ranks and records where a checkpoint stands
(epoch, samples into it). A user's sampler — any ``torch.utils.data.Sampler`` or iterable of
dataset indices (``WeightedRandomSampler``, ``RandomSampler``, a curriculum) — gives the
*order*: epoch ``e`` is what one pass of ``iter(sampler)`` yields after ``sampler.set_epoch(e)``
(where it has that method), drawn under torch's and Python's random states seeded by the run's
seed and the epoch. Its length is the epoch's (a ``WeightedRandomSampler``'s ``num_samples``,
repeats and all), the same every epoch; tandem makes batches of ``batch_size`` from it.

Every worker asks the sampler itself, and a resumed run asks it for the epoch it resumes in, so
the sampler must give the same order whenever it is asked for the same epoch: one that draws
from the global random state (torch's samplers without a ``generator``) does; one with a
generator of its own advances it on every pass, and is refused before launch
(:func:`check_order` asks twice for epoch 0). A ``DistributedSampler`` or a batch sampler is
refused: tandem shards and batches itself.

Usage::

    order = SamplerOrder(WeightedRandomSampler(weights, 1000), seed=0, num_items=len(train))
    check_order(order)                   # in the launching process
    GlobalBatchSampler(order.length, global_batch_size=64, seed=0, order=order)
"""

from __future__ import annotations

import operator
import random
from typing import Any

import torch
from torch.utils.data import BatchSampler, DistributedSampler

from tandem.errors import UsageError


class SamplerOrder:
    """Epoch -> the sample indices a user's ``sampler`` gives it (a 1-D ``int64`` tensor)."""

    def __init__(self, sampler: Any, *, seed: int, num_items: int) -> None:
        name = type(sampler).__name__
        if isinstance(sampler, DistributedSampler):
            raise UsageError(f"sampler is a {name}; tandem splits every batch over the workers "
                             f"itself: give a sampler of the whole dataset (or none)")
        if isinstance(sampler, BatchSampler):
            raise UsageError(f"sampler is a {name}, which yields batches; tandem makes batches "
                             f"of batch_size itself: give a sampler that yields indices")
        if not hasattr(sampler, "__iter__"):
            raise UsageError(f"sampler is a {name}, not an iterable of dataset indices; give a "
                             f"torch.utils.data.Sampler (or any iterable of ints)")
        self.sampler, self.seed, self.num_items = sampler, seed, num_items
        self._length: int | None = None

    @property
    def length(self) -> int:
        """Samples in each epoch: the sampler's ``len()``, else the length of epoch 0."""
        if self._length is None:
            try:
                self._length = len(self.sampler)
            except TypeError:
                self._length = len(self(0))
        return self._length

    def __call__(self, epoch: int) -> torch.Tensor:
        """The indices of epoch ``epoch``, checked to be dataset indices."""
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        state = random.getstate()
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed * 1_000_003 + epoch)
                random.seed(self.seed * 1_000_003 + epoch)
                indices = [_index(value, self.sampler) for value in self.sampler]
        finally:
            random.setstate(state)
        order = torch.tensor(indices, dtype=torch.int64)
        if len(order) and not 0 <= int(order.min()) <= int(order.max()) < self.num_items:
            bad = int(order.min()) if int(order.min()) < 0 else int(order.max())
            raise UsageError(f"sampler {type(self.sampler).__name__} gave index {bad}, outside "
                             f"the {self.num_items} samples of the training data; give indices "
                             f"0 to {self.num_items - 1}")
        return order


def _index(value: Any, sampler: Any) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise UsageError(f"sampler {type(sampler).__name__} yields {type(value).__name__} "
                         f"values ({value!r}); give a sampler that yields dataset indices "
                         f"(ints)") from None


def check_order(order: SamplerOrder) -> None:
    """The launcher's check of a user's sampler: it gives samples, as many every epoch as its
    length says, and the same order when asked again for the same epoch (every worker, and a
    resumed run, asks it anew)."""
    name = type(order.sampler).__name__
    first = order(0)
    if not len(first):
        raise UsageError(f"sampler {name} gives no indices; give a sampler with samples")
    if not torch.equal(first, order(0)):
        raise UsageError(f"sampler {name} gives another order when asked again for epoch 0, so "
                         f"the workers (and a resumed run) would not agree on the batches; make "
                         f"its order depend only on the epoch (set_epoch) and torch's random "
                         f"state, which tandem seeds (e.g. no generator of its own)")
    for epoch, indices in ((0, first), (1, order(1))):
        if len(indices) != order.length:
            raise UsageError(f"sampler {name} gives {len(indices)} indices in epoch {epoch} but "
                             f"its len() is {order.length}; give a sampler whose epochs are "
                             f"all of its length")
