"""The real 8x8 handwritten digits (1,797 samples) from scikit-learn's bundled copy; no download."""

from __future__ import annotations

import dataclasses

import torch

from tandem.data.bundle import DataBundle, check_split, split_held_out
from tandem.data.info import DataInfo
from tandem.options import check_seed

NUM_SAMPLES = 1797


@dataclasses.dataclass(kw_only=True, slots=True)
class DigitsOptions:
    """Options of ``--data digits:...``."""

    test: float = 0.2
    """Fraction of the samples held out for evaluation."""
    split_seed: int = 0
    """Seed of the train/test split (kept apart from the run's seed so the test set is fixed)."""

    def __post_init__(self) -> None:
        check_split(NUM_SAMPLES, self.test, fixed_n=True)
        check_seed("split_seed", self.split_seed)


def load_digits(options: DigitsOptions) -> DataBundle:
    """Load the digits as ``1x8x8`` images in [0, 1] with labels 0-9."""
    from sklearn.datasets import load_digits as sklearn_digits

    raw = sklearn_digits()
    inputs = torch.tensor(raw.images, dtype=torch.float32).unsqueeze(1) / 16.0
    targets = torch.tensor(raw.target, dtype=torch.int64)
    train, test = split_held_out(inputs, targets, options.test, options.split_seed)
    info = DataInfo(task="classify", input_shape=(1, 8, 8), num_classes=10)
    return DataBundle(name="digits", train=train, test=test, info=info)
