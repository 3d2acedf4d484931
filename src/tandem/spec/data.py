"""What a ``--data`` spec means, without torch: the built-in datasets' names and options, and
the options of ``folder:PATH`` (their loaders, in :mod:`tandem.data`, need torch).

Usage::

    name, options = read_dataset_spec("images:n=4096,size=32")   # ("images", ImagesOptions(...))
    check_data_spec("folder:./images:size=32")   # a spec's syntax and options, none of its files
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from tandem.errors import UsageError
from tandem.spec.options import check_seed, fill_options, path_spec, positive, split_spec

DIGITS_SAMPLES = 1797
"""Samples of the real digits (:mod:`tandem.data.digits`)."""


def held_out_count(num_samples: int, test_fraction: float) -> int:
    """Samples :func:`tandem.data.bundle.split_held_out` holds out for the test split."""
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


@dataclasses.dataclass(kw_only=True, slots=True)
class DigitsOptions:
    """Options of ``--data digits:...``."""

    test: float = 0.2
    """Fraction of the samples held out for evaluation."""
    split_seed: int = 0
    """Seed of the train/test split (kept apart from the run's seed so the test set is fixed)."""

    def __post_init__(self) -> None:
        check_split(DIGITS_SAMPLES, self.test, fixed_n=True)
        check_seed("split_seed", self.split_seed)


@dataclasses.dataclass(kw_only=True, slots=True)
class ImagesOptions:
    """Options of ``--data images:...``: each class is a fixed random pattern plus noise."""

    n: int = 4096
    """Number of samples (train and test together)."""
    size: int = 32
    """Height and width in pixels."""
    channels: int = 3
    classes: int = 10
    noise: float = 1.0
    """Standard deviation of the per-pixel noise around the class pattern."""
    test: float = 0.2
    seed: int = 0
    """Seed of the generated data and of the split."""

    def __post_init__(self) -> None:
        for name in ("n", "size", "channels", "classes"):
            positive(name, getattr(self, name), ImagesOptions.__dataclass_fields__[name].default)
        if self.classes < 2:
            raise ValueError(f"classes must be at least 2 (got {self.classes})")
        if not (self.noise >= 0 and math.isfinite(self.noise)):
            raise ValueError(f"noise must be a finite number >= 0 (got noise={self.noise}); "
                             f"e.g. noise=1")
        check_split(self.n, self.test)
        check_seed("seed", self.seed)

    def memory_bytes(self) -> int:
        """About the most memory :func:`~tandem.data.synthetic.make_images` takes: noise,
        inputs and the two splits, float32."""
        return 3 * self.n * self.channels * self.size * self.size * 4


@dataclasses.dataclass(kw_only=True, slots=True)
class TokensOptions:
    """Options of ``--data tokens:...``: sequences from a sparse random Markov chain."""

    n: int = 2048
    """Number of sequences (train and test together)."""
    seq: int = 64
    """Sequence length."""
    vocab: int = 128
    branching: int = 2
    """Number of possible successors of each token (lower is easier to predict)."""
    test: float = 0.2
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("n", "seq", "vocab", "branching"):
            positive(name, getattr(self, name), TokensOptions.__dataclass_fields__[name].default)
        if self.seq < 2:
            raise ValueError(f"seq must be at least 2 (got {self.seq})")
        if self.branching > self.vocab:
            raise ValueError(f"branching ({self.branching}) exceeds vocab ({self.vocab})")
        check_split(self.n, self.test)
        check_seed("seed", self.seed)

    def memory_bytes(self) -> int:
        """About the most memory :func:`~tandem.data.synthetic.make_tokens` takes: the
        sequences, the draws and the two splits, int64."""
        return 4 * self.n * (self.seq + 1) * 8


@dataclasses.dataclass(kw_only=True, slots=True)
class FolderOptions:
    """Options of ``--data folder:PATH:key=value,...``."""

    test: float = 0.2
    """Fraction held out for evaluation (when the folder has no ``train/``/``test/`` split)."""
    split_seed: int = 0
    """Seed of that held-out split."""
    size: int = 0
    """Resize every image to ``size x size`` (0: keep the size; all images must share it)."""

    def __post_init__(self) -> None:
        check_seed("split_seed", self.split_seed)
        if self.size < 0:
            raise UsageError(f"folder option size={self.size} must be 0 (keep) or a number of "
                             f"pixels, e.g. size=32")


DATASET_OPTIONS: dict[str, type] = {
    "digits": DigitsOptions, "images": ImagesOptions, "tokens": TokensOptions,
}
"""Built-in dataset name -> its options dataclass."""


def read_dataset_spec(spec: str) -> tuple[str, Any]:
    """The name and options of the built-in dataset ``spec`` (``name[:key=value,...]``); one-line
    :class:`UsageError` for an unknown dataset or a bad option."""
    name, raw = split_spec(spec, what="dataset")
    if name not in DATASET_OPTIONS:
        raise UsageError(
            f"unknown dataset {name!r}; choose one of: {', '.join(sorted(DATASET_OPTIONS))}, or "
            f"folder:PATH, or your own as package.module:function"
        )
    return name, fill_options(DATASET_OPTIONS[name], raw, spec=spec, what="dataset")


def read_folder_spec(spec: str) -> tuple[str, FolderOptions]:
    """The directory and options of ``folder:PATH[:key=value,...]``."""
    return path_spec(spec, FolderOptions, what="folder", example="folder:./images")


def is_user_data(spec: str) -> bool:
    """Whether ``spec`` names a user's ``package.module:function`` (not a built-in dataset,
    ``folder:`` or ``shards:``)."""
    head, _, rest = spec.partition(":")
    return (head not in (*DATASET_OPTIONS, "folder", "shards") and bool(rest)
            and "=" not in rest.split(":")[0])


def check_data_spec(spec: str) -> None:
    """One-line :class:`UsageError` for a built-in or ``folder:`` spec whose syntax or options are
    wrong; what needs the files (the folder's images, the shards, a user's function) is checked
    when the data is loaded."""
    head = spec.partition(":")[0]
    if head == "folder":
        read_folder_spec(spec)
    elif head != "shards" and not is_user_data(spec):
        read_dataset_spec(spec)
