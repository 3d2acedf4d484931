"""Which workers a parameter server holds back, and when they go on: the round of pushes a
synchronous step averages, the bound of bounded staleness, and the update each goes on to."""

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


def first_update(version: int, pushes: Counter[int], workers: Sequence[int], worker: int) -> int:
    """Asynchronous modes: the first update of the run (``W`` per step) that ``worker`` (of
    ``workers``) computes, sent with the reply to its first pull at the servers' ``version``,
    after the ``pushes`` applied so far in this run (or its resumption): the version the run
    started at plus the worker's index.

    The servers number every update they send a worker on to, and update ``u`` reads share ``u
    % W`` of batch ``u // W`` (:func:`~tandem.runtime.trainer.async_batch_share`), so that
    every share is read once. Numbered by the version of their reply instead, two workers read
    one share where two replies carry one version: bounded staleness answers several held
    workers after one push (a third of the replies did, on 4 workers under load), and a worker
    whose first pull comes after others' pushes."""
    return version - sum(pushes.values()) + list(workers).index(worker)


def next_updates(version: int, workers: int, *, waiting: int, going: int) -> range:
    """Asynchronous modes: the updates that ``going`` of the ``waiting`` workers (whose pushes
    are not answered) go on to, answered after the push that brought the servers to
    ``version``. Every worker holds one number: the first ``workers`` were given with the
    first pulls, each push applied adds one version and one waiting worker, and each answer
    hands out the next number, so the next is ``version + workers - waiting`` (a worker given
    up on while it waited leaves a number unused, never used twice)."""
    start = version + workers - waiting
    return range(start, start + going)


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
