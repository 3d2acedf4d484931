"""Sequences of different lengths, as a language-model user has them, for ``collate_fn`` tests:
a dataset whose items are token tensors, a collate that pads each batch to its longest item
(inputs with 0, targets with -100, cross-entropy's ``ignore_index``), a loss that is a mean over
sequences, a sampler, a small per-token model, and a collate that fails."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, Sampler

from tests.hf_models import SEQ, VOCAB

PAD, IGNORED = 0, -100


class Sequences(Dataset):
    """``n`` token sequences of 3 to ``SEQ + 1`` tokens from a fixed Markov chain; item ``i``
    is a 1-D ``int64`` tensor (the model reads all but the last token, and predicts each next
    one)."""

    def __init__(self, n: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(0)
        transition = torch.softmax(torch.randn(VOCAB, VOCAB, generator=generator) * 3, dim=-1)
        generator.manual_seed(seed)
        lengths = torch.randint(3, SEQ + 2, (n,), generator=generator).tolist()
        self.items = []
        for length in lengths:
            tokens = torch.empty(length, dtype=torch.int64)
            tokens[0] = torch.randint(VOCAB, (1,), generator=generator)
            for t in range(1, length):
                tokens[t] = torch.multinomial(transition[tokens[t - 1]], 1, generator=generator)
            self.items.append(tokens)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.items[index]


def pad(items: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``items``, padded to the longest: inputs with 0, targets with -100."""
    longest = max(len(item) for item in items) - 1
    inputs = torch.full((len(items), longest), PAD, dtype=torch.int64)
    targets = torch.full((len(items), longest), IGNORED, dtype=torch.int64)
    for row, item in enumerate(items):
        inputs[row, :len(item) - 1] = item[:-1]
        targets[row, :len(item) - 1] = item[1:]
    return inputs, targets


def sequence_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy averaged over each sequence's own tokens, then over the sequences: a mean
    over samples, as tandem weighs a batch's loss by its samples (a mean over all the batch's
    tokens would weigh a sequence by its length, and differ with the way the batch is cut)."""
    logits = output.logits if hasattr(output, "logits") else output
    tokens = F.cross_entropy(logits.transpose(1, 2).float(), targets, ignore_index=IGNORED,
                             reduction="none")
    counted = (targets != IGNORED).sum(1).clamp(min=1)
    return (tokens.sum(1) / counted).mean()


def sequences(n: int = 96) -> tuple[Dataset, Dataset, Any]:
    """``--data tests.padded_data:sequences``: train and test sequences with their collate."""
    return Sequences(n, seed=1), Sequences(24, seed=2), pad


def broken_pad(items: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A collate that fails: stacks sequences of different lengths."""
    stacked = torch.stack(items)
    return stacked[:, :-1], stacked[:, 1:]


def broken_sequences(n: int = 32) -> dict[str, Any]:
    """``--data tests.padded_data:broken_sequences``: a dict with a collate that fails."""
    return {"train": Sequences(n, seed=1), "test": Sequences(8, seed=2),
            "collate_fn": broken_pad}


class Longest(Sampler[int]):
    """The longest sequences first, ties in index order (a curriculum): the same order every
    epoch, whatever the random state."""

    def __init__(self, data: Sequences) -> None:
        self.lengths = [len(item) for item in data.items]

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(range(len(self.lengths)), key=lambda i: (-self.lengths[i], i)))


class TokenNet(nn.Module):
    """Next-token logits from each token alone (an embedding and a linear layer): a model
    small enough for runs that test the data, not the model."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.out = nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.embed(tokens)))
