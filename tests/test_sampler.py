"""The distributed sampler: shards of every global batch, nothing lost or duplicated."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tandem.data import GlobalBatchSampler, shard_sizes
from tandem.data.sampler import RankBatchSampler

pytestmark = pytest.mark.pure


@pytest.mark.parametrize(("total", "shards", "expected"), [
    (8, 4, [2, 2, 2, 2]), (10, 4, [3, 3, 2, 2]), (3, 4, [1, 1, 1, 0]), (0, 2, [0, 0]),
])
def test_shard_sizes(total: int, shards: int, expected: list[int]) -> None:
    assert shard_sizes(total, shards) == expected


@pytest.mark.parametrize("num_samples", [1, 7, 100, 101])
@pytest.mark.parametrize("batch_size", [1, 8, 30])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ranks_cover_each_global_batch_exactly(num_samples: int, batch_size: int,
                                               world_size: int) -> None:
    sampler = GlobalBatchSampler(num_samples, global_batch_size=batch_size, seed=5)
    seen: list[int] = []
    for step in range(sampler.batches_per_epoch):
        shards = [sampler.local_indices(step, rank=r, world_size=world_size).tolist()
                  for r in range(world_size)]
        joined = [index for shard in shards for index in shard]
        assert joined == sampler.global_indices(step).tolist()
        assert max(map(len, shards)) - min(map(len, shards)) <= 1
        seen += joined
    assert sorted(seen) == list(range(num_samples))


def test_order_depends_on_seed_and_epoch_not_on_world() -> None:
    a = GlobalBatchSampler(50, global_batch_size=10, seed=1)
    b = GlobalBatchSampler(50, global_batch_size=10, seed=1)
    assert torch.equal(a.global_indices(7), b.global_indices(7))
    assert not torch.equal(a.epoch_order(0), a.epoch_order(1))
    assert not torch.equal(a.epoch_order(0), GlobalBatchSampler(50, global_batch_size=10,
                                                                seed=2).epoch_order(0))


def test_drop_last_and_unshuffled() -> None:
    sampler = GlobalBatchSampler(10, global_batch_size=4, seed=0, shuffle=False, drop_last=True)
    assert sampler.batches_per_epoch == 2
    assert sampler.global_indices(1).tolist() == [4, 5, 6, 7]
    assert sampler.global_indices(2).tolist() == [0, 1, 2, 3]


def test_bad_sizes() -> None:
    with pytest.raises(ValueError, match="batch size: 0"):
        GlobalBatchSampler(10, global_batch_size=0, seed=0)
    with pytest.raises(ValueError, match="exceeds the 3 samples"):
        GlobalBatchSampler(3, global_batch_size=4, seed=0, drop_last=True)


def test_rank_batch_sampler_in_a_data_loader() -> None:
    data = TensorDataset(torch.arange(10))
    sampler = GlobalBatchSampler(10, global_batch_size=4, seed=0)
    loaders = [DataLoader(data, batch_sampler=RankBatchSampler(sampler, rank=r, world_size=2))
               for r in range(2)]
    batches = [[batch[0].tolist() for batch in loader] for loader in loaders]
    assert [len(b) for b in batches] == [3, 3]
    assert sorted(i for rank in batches for batch in rank for i in batch) == list(range(10))


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("schedule", [(), ((3, 5), (11, 2))])
def test_batch_samples_counts_the_global_batch(drop_last: bool,
                                               schedule: tuple[tuple[int, int], ...]) -> None:
    """The count the trainers read each step without cutting the order is the batch's length,
    also for an epoch's short last batch and across a batch schedule."""
    for num_samples in (5, 17, 30):
        sampler = GlobalBatchSampler(num_samples, global_batch_size=4, seed=3,
                                     drop_last=drop_last)
        for step, batch in schedule:
            sampler.extend(step, batch)
        for step in range(40):
            assert sampler.batch_samples(step) == len(sampler.global_indices(step)), step
