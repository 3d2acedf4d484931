"""A dataset as in-memory tensors: a train split, a held-out test split and its ``DataInfo``."""

from __future__ import annotations

import dataclasses

import torch

from tandem.data.info import DataInfo


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


def held_out_count(num_samples: int, test_fraction: float) -> int:
    """Samples :func:`split_held_out` holds out for the test split."""
    return int(round(num_samples * test_fraction))


def check_split(num_samples: int, test_fraction: float, *, fixed_n: bool = False) -> None:
    """Raise ``ValueError`` unless ``test`` is in (0, 1) and both splits get a sample; the
    message suggests a larger ``n`` (or, with ``fixed_n``, another ``test``)."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test must be a fraction in (0, 1) (got test={test_fraction}); "
                         f"e.g. test=0.2")
    held_out = held_out_count(num_samples, test_fraction)
    if 1 <= held_out < num_samples:
        return
    sizes = (f"leaves {num_samples - held_out} training and {held_out} test samples, and "
             f"both splits need at least one")
    if fixed_n:
        raise ValueError(f"test={test_fraction} of the {num_samples} samples {sizes}; "
                         f"use test=0.2")
    raise ValueError(f"n={num_samples} with test={test_fraction} {sizes}; "
                     f"use n={_smallest_n(test_fraction)} or more")


def _smallest_n(test_fraction: float) -> int:
    n = max(2, int(0.5 / min(test_fraction, 1.0 - test_fraction)))
    while not 1 <= held_out_count(n, test_fraction) < n:
        n += 1
    return n


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
