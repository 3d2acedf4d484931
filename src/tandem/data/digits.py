"""The real 8x8 handwritten digits (1,797 samples) from scikit-learn's bundled copy; no download."""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch

from tandem.data.bundle import DataBundle, split_held_out
from tandem.data.info import DataInfo
from tandem.spec.data import DigitsOptions


def load_digits(options: DigitsOptions) -> DataBundle:
    """Load the digits as ``1x8x8`` images in [0, 1] with labels 0-9."""
    images, labels = digits_arrays()
    inputs = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    targets = torch.tensor(labels, dtype=torch.int64)
    train, test = split_held_out(inputs, targets, options.test, options.split_seed)
    info = DataInfo(task="classify", input_shape=(1, 8, 8), num_classes=10)
    return DataBundle(name="digits", train=train, test=test, info=info)


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The digits' ``(1797, 8, 8)`` pixel values 0-16 and their labels, read from the file that
    scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``: 64 pixels then the label per
    row) without importing scikit-learn, which takes seconds of CPU in every process; through
    ``sklearn.datasets.load_digits`` where that file is not found."""
    found = importlib.util.find_spec("sklearn")
    path = (Path(found.origin).parent / "datasets" / "data" / "digits.csv.gz"
            if found is not None and found.origin else None)
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits as sklearn_digits

        raw = sklearn_digits()
        return raw.images, raw.target
    with gzip.open(path, "rt") as text:
        table = np.loadtxt(text, delimiter=",")
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)
