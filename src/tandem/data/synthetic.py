"""Synthetic datasets of any size that a model can really learn: class-conditional images and
token sequences from a fixed random Markov chain."""

from __future__ import annotations

import dataclasses
import math

import torch

from tandem.data.bundle import DataBundle, check_split, split_held_out
from tandem.data.info import DataInfo
from tandem.options import check_seed, positive


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
        """About the most memory :func:`make_images` takes: noise, inputs and the two splits,
        float32."""
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
        """About the most memory :func:`make_tokens` takes: the sequences, the draws and the
        two splits, int64."""
        return 4 * self.n * (self.seq + 1) * 8


def make_images(options: ImagesOptions) -> DataBundle:
    """Generate ``n`` images: the pattern of a random class plus Gaussian noise."""
    gen = torch.Generator().manual_seed(options.seed)
    shape = (options.channels, options.size, options.size)
    patterns = torch.randn((options.classes, *shape), generator=gen)
    targets = torch.randint(options.classes, (options.n,), generator=gen)
    noise = torch.randn((options.n, *shape), generator=gen) * options.noise
    inputs = patterns[targets] + noise
    train, test = split_held_out(inputs, targets, options.test, options.seed)
    info = DataInfo(task="classify", input_shape=shape, num_classes=options.classes)
    return DataBundle(name="images", train=train, test=test, info=info)


def make_tokens(options: TokensOptions) -> DataBundle:
    """Generate ``n`` sequences of ``seq + 1`` tokens; inputs and next-token targets overlap."""
    gen = torch.Generator().manual_seed(options.seed)
    successors = torch.stack(
        [torch.randperm(options.vocab, generator=gen)[: options.branching]
         for _ in range(options.vocab)]
    )
    tokens = torch.empty((options.n, options.seq + 1), dtype=torch.int64)
    tokens[:, 0] = torch.randint(options.vocab, (options.n,), generator=gen)
    choices = torch.randint(options.branching, (options.n, options.seq), generator=gen)
    for position in range(options.seq):
        tokens[:, position + 1] = successors[tokens[:, position], choices[:, position]]
    train, test = split_held_out(tokens[:, :-1], tokens[:, 1:], options.test, options.seed)
    info = DataInfo(task="lm", input_shape=(options.seq,), num_classes=options.vocab)
    return DataBundle(name="tokens", train=train, test=test, info=info)
