"""A dataset as in-memory tensors: a train split, a held-out test split and its ``DataInfo``."""

from __future__ import annotations

import dataclasses

import torch

from tandem.data.info import DataInfo
from tandem.spec.data import held_out_count


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Split:
    """Inputs and targets of one split; row ``i`` of both is sample ``i``."""

    inputs: torch.Tensor
    targets: torch.Tensor

    def __post_init__(self) -> None:
        assert len(self.inputs) == len(self.targets), "inputs and targets differ in length"

    def __len__(self) -> int:
        return len(self.inputs)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DataBundle:
    """Train and test splits of one dataset."""

    name: str
    train: Split
    test: Split
    info: DataInfo


def split_held_out(
    inputs: torch.Tensor, targets: torch.Tensor, test_fraction: float, seed: int
) -> tuple[Split, Split]:
    """Shuffle with ``seed`` and hold out ``test_fraction`` of the samples as the test split."""
    order = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(seed))
    num_test = held_out_count(len(inputs), test_fraction)
    test_index, train_index = order[:num_test], order[num_test:]
    return (
        Split(inputs=inputs[train_index], targets=targets[train_index]),
        Split(inputs=inputs[test_index], targets=targets[test_index]),
    )
