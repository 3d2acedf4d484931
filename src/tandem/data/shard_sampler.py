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
    docstring); ``local_indices(step, rank=p, world_size=partitions)`` is its share.

    A run resumed on another number of data-parallel ranks in the middle of an epoch
    (:meth:`resize`) re-deals what the ranks before it had not read yet: the rest of each old
    rank's stream, end to end, cut into one contiguous range per new rank. Every sample is
    still read once in the epoch; the epochs after it are cut for the new ranks as usual.
    """

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
        self.cuts: tuple[int, tuple[tuple[int, int], ...]] | None = None
        """``(epoch, ((samples_read, partitions), ...))``: the epoch that changed its number of
        partitions, each part from the samples read when it began (the first from 0); None:
        every epoch is cut for :attr:`partitions` alone."""

    def resize(self, epoch: int, samples_read: int, cuts: Sequence[Sequence[int]]) -> None:
        """Continue ``epoch`` on :attr:`partitions` ranks after ``samples_read`` of its samples,
        which were read by the parts ``cuts`` lists (``(samples_read, partitions)`` from
        :meth:`epoch_cuts` of the run before; at least ``(0, partitions)``)."""
        parts = tuple((int(read), int(count)) for read, count in cuts)
        if not parts or parts[0][0] != 0 or any(b[0] <= a[0] for a, b in zip(parts, parts[1:])):
            raise ValueError(f"cuts {parts} do not start at 0 and grow")
        if samples_read < parts[-1][0]:
            raise ValueError(f"{samples_read} samples read before the last cut {parts[-1]}")
        if parts[-1][0] == samples_read:  # resized again where the last part began
            parts = parts[:-1] + ((samples_read, self.partitions),)
        elif parts[-1][1] != self.partitions:
            parts += ((samples_read, self.partitions),)
        self.cuts = (epoch, parts) if len(parts) > 1 else None
        self._epoch_order = None

    def epoch_cuts(self, epoch: int) -> list[list[int]]:
        """The parts of ``epoch`` (see :attr:`cuts`), for a checkpoint of a step in it."""
        if self.cuts is not None and self.cuts[0] == epoch:
            return [list(part) for part in self.cuts[1]]
        return [[0, self.partitions]]

    def local_indices(self, step: int, *, rank: int, world_size: int) -> torch.Tensor:
        if world_size != self.partitions:
            raise ValueError(f"the shard order was cut for {self.partitions} ranks, not "
                             f"{world_size}")
        return super().local_indices(step, rank=rank, world_size=world_size)

    def partition_lengths(self, epoch: int, partitions: int | None = None,
                          sizes: Sequence[int] | None = None) -> list[int]:
        """Samples each of ``partitions`` (default :attr:`partitions`) reads of the global
        batches ``sizes`` (default: all of ``epoch``'s; they differ in size under a batch
        schedule)."""
        count = self.partitions if partitions is None else partitions
        lengths = [0] * count
        for size in self.epoch_batch_sizes(epoch) if sizes is None else sizes:
            for p, share in enumerate(shard_sizes(size, count)):
                lengths[p] += share
        return lengths

    def shard_order(self, epoch: int) -> list[int]:
        """The order of the shards in ``epoch``."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.shard_samples), generator=gen).tolist()

    def partition_stream(self, epoch: int, partition: int,
                         partitions: int | None = None) -> np.ndarray:
        """Sample numbers partition ``partition`` of ``partitions`` (default
        :attr:`partitions`) reads in ``epoch``, in order, when the whole epoch is cut for them."""
        order = self.shard_order(epoch)
        sequence = np.concatenate([np.arange(self.shard_starts[s], self.shard_starts[s + 1])
                                   for s in order]) if order else np.zeros(0, dtype=np.int64)
        lengths = self.partition_lengths(epoch, partitions)
        start = sum(lengths[:partition])
        own = sequence[start:start + lengths[partition]]
        rng = np.random.default_rng([self.seed, epoch, partition])
        return _buffer_shuffle(own, self.shuffle_buffer, rng)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The epoch's global batches end to end, each the partitions' shares in rank order."""
        if self._epoch_order is not None and self._epoch_order[0] == epoch:
            return self._epoch_order[1]
        parts = list(self.cuts[1]) if self.cuts is not None and self.cuts[0] == epoch else \
            [(0, self.partitions)]
        count = parts[0][1]
        streams = [self.partition_stream(epoch, p, count) for p in range(count)]
        taken = [0] * count
        sizes = self.epoch_batch_sizes(epoch)
        pieces, read, cut = [], 0, 1
        for index, size in enumerate(sizes):
            if cut < len(parts) and read >= parts[cut][0]:
                count = parts[cut][1]
                rest = np.concatenate([s[t:] for s, t in zip(streams, taken)])
                lengths = self.partition_lengths(epoch, count, sizes[index:])
                bounds = np.cumsum([0] + lengths)
                streams = [rest[bounds[p]:bounds[p + 1]] for p in range(count)]
                taken, cut = [0] * count, cut + 1
            for p, share in enumerate(shard_sizes(size, count)):
                pieces.append(streams[p][taken[p]:taken[p] + share])
                taken[p] += share
            read += size
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
