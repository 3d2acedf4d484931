"""Deterministic distributed sampling: every rank gets its share of every global batch.

The order of samples depends only on the seed and the epoch, never on the number of ranks, so
training on 1, 2 or 4 ranks sees the same global batches (a user's sampler may give the order
of each epoch instead: :mod:`tandem.data.user_sampler`). Within a global batch, rank ``r`` gets
a contiguous shard; shard sizes differ by at most one, so an uneven batch (the last one of an
epoch, or a size not divisible by the ranks) loses and duplicates no sample.

Usage::

    sampler = GlobalBatchSampler(1437, global_batch_size=64, seed=0)
    indices = sampler.local_indices(step=22, rank=0, world_size=4)
    loader = DataLoader(dataset, batch_sampler=RankBatchSampler(sampler, rank=0, world_size=4))
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.utils.data import Sampler


def shard_sizes(total: int, num_shards: int) -> list[int]:
    """Split ``total`` items into ``num_shards`` sizes that differ by at most one."""
    base, extra = divmod(total, num_shards)
    return [base + (1 if shard_index < extra else 0) for shard_index in range(num_shards)]


class GlobalBatchSampler:
    """Global batches of a shuffled epoch, addressed by optimizer step.

    With a batch-size ``schedule`` (``(first_step, batch_size)`` pairs, the first at step 0, see
    :mod:`tandem.spec.batch_schedule`) the batch of a step is the schedule's at that step. A batch
    never straddles an epoch boundary: each epoch is read from its start in batches of the
    current size, and the last batch of an epoch holds what is left of it (fewer samples than
    the schedule's batch, as with a fixed batch that does not divide the epoch); the next step
    starts the next epoch. So every epoch reads every sample exactly once, whatever the schedule.
    """

    def __init__(
        self, num_samples: int, *, global_batch_size: int, seed: int, shuffle: bool = True,
        drop_last: bool = False, schedule: Sequence[tuple[int, int]] | None = None,
        order: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        if num_samples <= 0 or global_batch_size <= 0:
            raise ValueError(
                f"need a positive number of samples and batch size "
                f"(samples: {num_samples}, batch size: {global_batch_size})"
            )
        if drop_last and global_batch_size > num_samples:
            raise ValueError(
                f"batch size {global_batch_size} exceeds the {num_samples} samples with drop_last"
            )
        schedule = tuple(schedule) if schedule is not None else ((0, global_batch_size),)
        if schedule[0] != (0, global_batch_size):
            raise ValueError(f"a batch schedule starts with the batch size at step 0 "
                             f"({global_batch_size}@0), not {schedule[0][1]}@{schedule[0][0]}")
        if drop_last and len(schedule) > 1:
            raise ValueError("drop_last needs a fixed batch size, not a batch schedule")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        """The batch of step 0 (the run's ``--batch-size``)."""
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.order = order
        """Epoch -> its ``num_samples`` sample indices in order (a user's sampler, see
        :mod:`tandem.data.user_sampler`); None: a shuffle by the seed (or, without
        ``shuffle``, the samples in turn)."""
        self._epoch_order: tuple[int, torch.Tensor] | None = None
        self._segments: list[tuple[int, int, int, int]] = []
        """``(first_step, batch, epoch, samples_into_epoch)`` where each schedule entry starts."""
        for step, batch in schedule:
            self.extend(step, batch)

    @property
    def schedule(self) -> tuple[tuple[int, int], ...]:
        """The batch schedule: ``(first_step, batch_size)`` pairs."""
        return tuple((step, batch) for step, batch, _, _ in self._segments)

    def extend(self, step: int, batch_size: int) -> None:
        """Use global batches of ``batch_size`` from optimizer step ``step`` on (after the last
        entry of the schedule; ``--batch-schedule auto`` grows the batch this way)."""
        if batch_size <= 0:
            raise ValueError(f"need a positive batch size (got {batch_size})")
        if not self._segments:
            self._segments.append((step, batch_size, 0, 0))
            return
        last_step = self._segments[-1][0]
        if step <= last_step:
            raise ValueError(f"a batch schedule entry at step {step} must come after step "
                             f"{last_step}")
        epoch, offset = self._locate(step)
        self._segments.append((step, batch_size, epoch, offset))

    def batch_size_at(self, step: int) -> int:
        """The global batch size the schedule gives step ``step`` (the last batch of an epoch
        may hold fewer samples, see :meth:`global_indices`)."""
        return self._segment(step)[1]

    def _segment(self, step: int) -> tuple[int, int, int, int]:
        if len(self._segments) == 1:  # no batch schedule
            return self._segments[0]
        index = bisect.bisect_right([s[0] for s in self._segments], step) - 1
        return self._segments[index]

    def _steps_in_epoch(self, offset: int, batch: int) -> int:
        """Steps of ``batch`` that finish an epoch read up to ``offset``."""
        if self.drop_last:
            return (self.num_samples - offset) // batch
        return -(-(self.num_samples - offset) // batch)

    def _locate(self, step: int) -> tuple[int, int]:
        """``(epoch, samples_into_epoch)`` where step ``step`` starts."""
        first, batch, epoch, offset = self._segment(step)
        ahead = step - first
        finish = self._steps_in_epoch(offset, batch)
        if ahead < finish:
            return epoch, offset + ahead * batch
        ahead -= finish
        full = self._steps_in_epoch(0, batch)
        return epoch + 1 + ahead // full, (ahead % full) * batch

    @property
    def batches_per_epoch(self) -> int:
        """Number of global batches (optimizer steps) in one pass over the samples, for a fixed
        batch size (with a schedule, epochs differ: see :meth:`epoch_steps`)."""
        if len(self._segments) > 1:
            raise ValueError("epochs of a batch schedule differ in steps; use epoch_steps(epoch)")
        return self._steps_in_epoch(0, self.global_batch_size)

    def epoch_steps(self, epoch: int) -> range:
        """The optimizer steps that read epoch ``epoch``."""
        return range(self._first_step(epoch), self._first_step(epoch + 1))

    def _first_step(self, epoch: int) -> int:
        for index, (first, batch, start_epoch, offset) in enumerate(self._segments):
            end = self._segments[index + 1][0] if index + 1 < len(self._segments) else None
            if epoch == start_epoch and offset == 0:
                return first
            if epoch <= start_epoch:
                continue
            step = (first + self._steps_in_epoch(offset, batch)
                    + (epoch - start_epoch - 1) * self._steps_in_epoch(0, batch))
            if end is None or step < end:
                return step
        raise AssertionError(f"epoch {epoch} precedes the schedule")  # epochs start at step 0

    def epoch_batch_sizes(self, epoch: int) -> list[int]:
        """Samples in each global batch of epoch ``epoch``, in order (they sum to the epoch's
        samples; the last may be short)."""
        sizes = []
        for step in self.epoch_steps(epoch):
            offset = self._locate(step)[1]
            sizes.append(min(self.batch_size_at(step), self.num_samples - offset))
        return sizes

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The order of all sample indices in ``epoch``."""
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            if self.order is not None:
                order = self.order(epoch)
            elif self.shuffle:
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                order = torch.randperm(self.num_samples, generator=gen)
            else:
                order = torch.arange(self.num_samples)
            self._epoch_order = (epoch, order)
        return self._epoch_order[1]

    def global_indices(self, step: int) -> torch.Tensor:
        """Sample indices of the global batch of optimizer step ``step`` (0-based)."""
        epoch, start = self._locate(step)
        return self.epoch_order(epoch)[start : start + self.batch_size_at(step)]

    def batch_samples(self, step: int) -> int:
        """Samples in the global batch of step ``step``: ``len(global_indices(step))``, without
        cutting the epoch's order (the last batch of an epoch may be short)."""
        start = self._locate(step)[1]
        return min(self.batch_size_at(step), self.num_samples - start)

    def position(self, step: int) -> dict[str, int]:
        """Where step ``step`` starts: its epoch and the samples of that epoch already read."""
        epoch, start = self._locate(step)
        return {"epoch": epoch, "samples_into_epoch": start}

    def local_indices(self, step: int, *, rank: int, world_size: int) -> torch.Tensor:
        """The shard of step ``step``'s global batch that belongs to ``rank``."""
        batch = self.global_indices(step)
        sizes = shard_sizes(len(batch), world_size)
        start = sum(sizes[:rank])
        return batch[start : start + sizes[rank]]


class RankBatchSampler(Sampler[list[int]]):
    """One epoch of a rank's local batches, for ``DataLoader(batch_sampler=...)``."""

    def __init__(self, sampler: GlobalBatchSampler, *, rank: int, world_size: int) -> None:
        super().__init__()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a world of {world_size}")
        self.sampler = sampler
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose batches ``__iter__`` yields."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        for step in self.sampler.epoch_steps(self.epoch):
            yield self.sampler.local_indices(step, rank=self.rank, world_size=self.world_size).tolist()

    def __len__(self) -> int:
        return len(self.sampler.epoch_steps(self.epoch))
