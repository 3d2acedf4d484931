"""The order in which an epoch of shards is read: the shards in an order of the seed and the
epoch, cut into one contiguous range per data-parallel rank, each through a seeded shuffle
buffer (see :mod:`tandem.data.shards`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tandem.data.sampler import GlobalBatchSampler, shard_sizes


class ShardBatchSampler(GlobalBatchSampler):
    """Global batches over shards: partition ``p`` (data-parallel rank ``p``) reads one
    contiguous range of the epoch's shard order through its shuffle buffer (see the module
    docstring); ``local_indices(step, rank=p, world_size=partitions)`` is its share."""

    def __init__(self, shard_samples: list[int], *, global_batch_size: int, seed: int,
                 partitions: int, shuffle_buffer: int,
                 schedule: Sequence[tuple[int, int]] | None = None) -> None:
        super().__init__(sum(shard_samples), global_batch_size=global_batch_size, seed=seed,
                         schedule=schedule)
        if partitions < 1:
            raise ValueError(f"need at least one partition (got {partitions})")
        self.shard_samples = list(shard_samples)
        self.partitions = partitions
        self.shuffle_buffer = shuffle_buffer
        self.shard_starts = np.cumsum([0] + self.shard_samples)

    def local_indices(self, step: int, *, rank: int, world_size: int) -> torch.Tensor:
        if world_size != self.partitions:
            raise ValueError(f"the shard order was cut for {self.partitions} ranks, not "
                             f"{world_size}")
        return super().local_indices(step, rank=rank, world_size=world_size)

    def partition_lengths(self, epoch: int) -> list[int]:
        """Samples each partition reads in ``epoch``: its share of every global batch (the
        batches of an epoch differ in size under a batch schedule)."""
        lengths = [0] * self.partitions
        for size in self.epoch_batch_sizes(epoch):
            for p, share in enumerate(shard_sizes(size, self.partitions)):
                lengths[p] += share
        return lengths

    def shard_order(self, epoch: int) -> list[int]:
        """The order of the shards in ``epoch``."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.shard_samples), generator=gen).tolist()

    def partition_stream(self, epoch: int, partition: int) -> np.ndarray:
        """Sample numbers partition ``partition`` reads in ``epoch``, in order."""
        order = self.shard_order(epoch)
        sequence = np.concatenate([np.arange(self.shard_starts[s], self.shard_starts[s + 1])
                                   for s in order]) if order else np.zeros(0, dtype=np.int64)
        lengths = self.partition_lengths(epoch)
        start = sum(lengths[:partition])
        own = sequence[start:start + lengths[partition]]
        rng = np.random.default_rng([self.seed, epoch, partition])
        return _buffer_shuffle(own, self.shuffle_buffer, rng)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The epoch's global batches end to end, each the partitions' shares in rank order."""
        if self._epoch_order is not None and self._epoch_order[0] == epoch:
            return self._epoch_order[1]
        streams = [self.partition_stream(epoch, p) for p in range(self.partitions)]
        taken = [0] * self.partitions
        pieces = []
        for size in self.epoch_batch_sizes(epoch):
            for p, share in enumerate(shard_sizes(size, self.partitions)):
                pieces.append(streams[p][taken[p]:taken[p] + share])
                taken[p] += share
        order = torch.from_numpy(np.concatenate(pieces).astype(np.int64))
        self._epoch_order = (epoch, order)
        return order


def _buffer_shuffle(items: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """``items`` through a shuffle buffer of ``size``: fill it, then for each new item emit a
    random one of the buffer and put the new one in its place; at the end, emit the rest in a
    random order. Samples read close together in the output come from a window of about
    ``size`` samples of the input, so a rank reads its shards nearly in order."""
    if size <= 1 or len(items) <= 1:
        return items.copy()
    buffer = list(items[:size])
    out = np.empty(len(items), dtype=items.dtype)
    picks = rng.integers(0, size, len(items))
    written = 0
    for item, pick in zip(items[size:], picks):
        out[written] = buffer[pick]
        buffer[pick] = item
        written += 1
    rest = np.array(buffer, dtype=items.dtype)
    out[written:] = rest[rng.permutation(len(rest))]
    return out
