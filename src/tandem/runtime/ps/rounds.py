"""Which workers a parameter server holds back, and when they go on: the round of pushes a
synchronous step averages, and the bound of bounded staleness."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch


class PushRound:
    """``sync`` mode: the gradients of the current step's pushes, summed until ``required`` of
    them are in (the backup workers' later ones are dropped)."""

    def __init__(self, required: int) -> None:
        self.required = required
        self.count = 0
        self.total: torch.Tensor | None = None

    def add(self, gradient: torch.Tensor | None) -> bool:
        """Count a push (its gradient shard, None on a server without parameters); whether the
        round is complete."""
        if gradient is not None:
            total = None if self.count == 0 else self.total
            self.total = gradient if total is None else total + gradient
        self.count += 1
        return self.count == self.required

    def mean(self) -> torch.Tensor | None:
        """The round's mean gradient, and a new round begins."""
        mean = self.total / self.required if self.total is not None else None
        self.count, self.total = 0, None
        return mean


def released(waiting: Sequence[int], pushes: Counter[int], live: Sequence[int], *,
             bound: int | None, stop: bool) -> tuple[list[int], list[int]]:
    """Of the ``waiting`` workers: those to answer now and those still held. All go on when
    the run stops or without a ``bound``; else a worker goes on while its ``pushes`` are at most
    ``bound`` ahead of the slowest ``live`` worker's (bounded staleness)."""
    slowest = min((pushes[w] for w in live), default=0)
    answer, held = [], []
    for worker in waiting:
        if stop or bound is None or pushes[worker] - slowest <= bound:
            answer.append(worker)
        else:
            held.append(worker)
    return answer, held
