"""Data, losses and models as a user would write them, for ``--data``/``--loss`` and ``tandem.fit``
tests: map-style and iterable datasets of (input, target) pairs, structured inputs, a loss of a
structured output, and the failures the command line must report in one line."""

from __future__ import annotations

import errno
import os
import signal

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from tandem.data import DataInfo


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits (``load_digits``'s arrays, read without importing scikit-learn,
    which cost every worker that built these datasets 2-3 s of CPU)."""
    from tandem.data.digits import digits_arrays

    images, labels = digits_arrays()
    return (torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0,
            torch.tensor(labels, dtype=torch.int64))


class DigitPairs(Dataset):
    """The digits as a map-style dataset: item i is ``(image 1x8x8, label)`` (label an int)."""

    def __init__(self, part: str) -> None:
        images, labels = _digits()
        cut = 1437
        self.images, self.labels = ((images[:cut], labels[:cut]) if part == "train"
                                    else (images[cut:], labels[cut:]))

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], int(self.labels[index])


class DigitDicts(DigitPairs):
    """Inputs as a dict, the way tokenizers give them: ``({"pixels": ..., "scale": ...}, y)``."""

    def __getitem__(self, index: int) -> tuple[dict[str, torch.Tensor], int]:
        image, label = super().__getitem__(index)
        return {"pixels": image, "scale": torch.tensor(2.0)}, label


class DigitStream(IterableDataset):
    """The training digits as an iterable dataset (read in order)."""

    def __init__(self, part: str = "train") -> None:
        self.pairs = DigitPairs(part)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return (self.pairs[i] for i in range(len(self.pairs)))


def digit_pairs(test_size: int = 360) -> tuple[Dataset, Dataset]:
    """``--data tests.user_data:digit_pairs``: map-style train and test datasets."""
    return DigitPairs("train"), DigitPairs("test")


CALLS = {"digit_dicts": 0}
"""How often this process called each data function (a launcher in the test's process)."""


def digit_dicts() -> tuple[Dataset, Dataset]:
    """``--data tests.user_data:digit_dicts``: inputs are dicts of tensors."""
    CALLS["digit_dicts"] += 1
    return DigitDicts("train"), DigitDicts("test")


def broken(n: int = 10) -> tuple[Dataset, Dataset]:
    """A data function that fails."""
    raise FileNotFoundError(f"no such file: shard-{n}.bin")


def not_datasets() -> int:
    """Returns something that is not (train, test)."""
    return 42


class MissingFiles(DigitPairs):
    """Item ``i`` from ``at`` on cannot be read: its image file is missing."""

    def __init__(self, part: str, at: int) -> None:
        super().__init__(part)
        self.at = at

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if index >= self.at:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory",
                                    f"/data/digits/{index}.png")
        return super().__getitem__(index)


DIGITS_INFO = DataInfo(task="classify", input_shape=(1, 8, 8), num_classes=10)


def missing_files(at: int = 0, info: bool = True) -> tuple[Dataset, ...]:
    """``--data tests.user_data:missing_files:at=N``: training items from ``N`` on fail (with
    the info given, the launching process reads only the first; with ``info=False`` it reads
    every target to count the classes)."""
    return (MissingFiles("train", at), DigitPairs("test"), *([DIGITS_INFO] if info else []))


class KilledInLoader(DigitPairs):
    """Reading item ``at`` kills the loader process that reads it (as the kernel's out-of-memory
    killer would); read anywhere else, the digits."""

    def __init__(self, at: int) -> None:
        super().__init__("train")
        self.at = at

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if index >= self.at and get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(index)


def killed_in_loader(at: int = 1000) -> tuple[Dataset, Dataset, DataInfo]:
    """``--data tests.user_data:killed_in_loader`` (with ``--loader-workers``)."""
    return KilledInLoader(at), DigitPairs("test"), DIGITS_INFO


class SkipNet(nn.Module):
    """A conv net with a skip connection and BatchNorm, taking a dict of inputs."""

    def __init__(self, norm: bool = True) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8) if norm else nn.Identity()
        self.mix = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8 * 64, 10)

    def forward(self, pixels: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm(self.conv(pixels * scale[:, None, None, None])))
        x = x + F.relu(self.mix(x))
        return self.head(x.flatten(1))


def skip_net(norm: bool = True) -> nn.Module:
    """``--model tests.user_data:skip_net[:norm=False]``."""
    return SkipNet(norm)


class PairNet(nn.Module):
    """Returns ``{"logits": ..., "features": ...}``: an output that is not a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU())
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        features = self.body(x)
        return {"logits": self.head(features), "features": features}


def pair_net() -> nn.Module:
    """``--model tests.user_data:pair_net``."""
    return PairNet()


def smoothed_loss(output: dict[str, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """Label-smoothed cross-entropy plus a small penalty on the features (a structured output)."""
    return (F.cross_entropy(output["logits"], targets, label_smoothing=0.1)
            + 1e-4 * output["features"].pow(2).mean())


def per_sample_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Forgets to reduce: returns one loss per sample."""
    return F.cross_entropy(output, targets, reduction="none")
