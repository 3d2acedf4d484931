"""Deterministic distributed sampling: every rank gets its share of every global batch.

The order of samples depends only on the seed and the epoch, never on the number of ranks, so
training on 1, 2 or 4 ranks sees the same global batches. Within a global batch, rank ``r`` gets
a contiguous shard; shard sizes differ by at most one, so an uneven batch (the last one of an
epoch, or a size not divisible by the ranks) loses and duplicates no sample.

Usage::

    sampler = GlobalBatchSampler(1437, global_batch_size=64, seed=0)
    indices = sampler.local_indices(step=22, rank=0, world_size=4)
    loader = DataLoader(dataset, batch_sampler=RankBatchSampler(sampler, rank=0, world_size=4))
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


def shard_sizes(total: int, num_shards: int) -> list[int]:
    """Split ``total`` items into ``num_shards`` sizes that differ by at most one."""
    base, extra = divmod(total, num_shards)
    return [base + (1 if shard_index < extra else 0) for shard_index in range(num_shards)]


class GlobalBatchSampler:
    """Global batches of a shuffled epoch, addressed by optimizer step."""

    def __init__(
        self, num_samples: int, *, global_batch_size: int, seed: int, shuffle: bool = True,
        drop_last: bool = False,
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
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self._epoch_order: tuple[int, torch.Tensor] | None = None

    @property
    def batches_per_epoch(self) -> int:
        """Number of global batches (optimizer steps) in one pass over the samples."""
        if self.drop_last:
            return self.num_samples // self.global_batch_size
        return -(-self.num_samples // self.global_batch_size)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The order of all sample indices in ``epoch``."""
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                order = torch.randperm(self.num_samples, generator=gen)
            else:
                order = torch.arange(self.num_samples)
            self._epoch_order = (epoch, order)
        return self._epoch_order[1]

    def global_indices(self, step: int) -> torch.Tensor:
        """Sample indices of the global batch of optimizer step ``step`` (0-based)."""
        epoch, batch_index = divmod(step, self.batches_per_epoch)
        start = batch_index * self.global_batch_size
        return self.epoch_order(epoch)[start : start + self.global_batch_size]

    def position(self, step: int) -> dict[str, int]:
        """Where step ``step`` starts: its epoch and the samples of that epoch already read."""
        epoch, batch = divmod(step, self.batches_per_epoch)
        return {"epoch": epoch, "samples_into_epoch": batch * self.global_batch_size}

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
        first = self.epoch * self.sampler.batches_per_epoch
        for step in range(first, first + self.sampler.batches_per_epoch):
            yield self.sampler.local_indices(step, rank=self.rank, world_size=self.world_size).tolist()

    def __len__(self) -> int:
        return self.sampler.batches_per_epoch
