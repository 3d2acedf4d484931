"""Synthetic datasets of any size that a model can really learn: class-conditional images and
token sequences from a fixed random Markov chain."""

from __future__ import annotations

import torch

from tandem.data.bundle import DataBundle, split_held_out
from tandem.data.info import DataInfo
from tandem.spec.data import ImagesOptions, TokensOptions


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
