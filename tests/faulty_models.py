"""Models that fail on purpose, for tests of how a job stops: ``tests.faulty_models:NAME``."""

from __future__ import annotations

import os
import signal
import time

import torch
from torch import nn

from tandem.data.info import DataInfo


class _Faulty(nn.Module):
    """A linear classifier whose forward misbehaves on ``rank`` from call ``after`` on; each
    training forward first sleeps ``delay`` seconds (paced workers, as :class:`_Recorded`)."""

    def __init__(self, info: DataInfo, rank: int, after: int, how: str,
                 delay: float = 0.0) -> None:
        super().__init__()
        self.linear = nn.Linear(64, info.num_classes)
        self.rank, self.after, self.how, self.calls = rank, after, how, 0
        self.delay = delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.training:
            time.sleep(self.delay)
        if self.training and int(os.environ.get("RANK", "0")) == self.rank and self.calls > self.after:
            if self.how == "raise":
                raise RuntimeError(f"injected failure in forward call {self.calls}")
            if self.how == "hang":
                time.sleep(3600)
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
        return self.linear(x.flatten(1))


def crash(info: DataInfo, rank: int = 1, after: int = 3) -> nn.Module:
    """Raises an exception on ``rank``."""
    return _Faulty(info, rank, after, "raise")


def hang(info: DataInfo, rank: int = 1, after: int = 3, delay: float = 0.0) -> nn.Module:
    """Sleeps for an hour on ``rank`` (a stuck worker); every training forward before that,
    on every rank, sleeps ``delay`` seconds (so that the others' training lasts a known time
    whatever the machine, at little CPU)."""
    return _Faulty(info, rank, after, "hang", delay)


def kill(info: DataInfo, rank: int = 1, after: int = 3) -> nn.Module:
    """Kills its own process on ``rank`` (a dead worker)."""
    return _Faulty(info, rank, after, "kill")


class _FaultyBlock(nn.Module):
    """A block that misbehaves like :class:`_Faulty` but computes ``x`` unchanged otherwise."""

    def __init__(self, rank: int, after: int, how: str) -> None:
        super().__init__()
        self.rank, self.after, self.how, self.calls = rank, after, how, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.training and int(os.environ.get("RANK", "0")) == self.rank and self.calls > self.after:
            if marker := os.environ.get("TANDEM_TEST_FAULT_AT"):
                with open(marker, "w") as handle:  # when the fault began, for tests to time
                    handle.write(str(time.time()))
            if self.how == "hang":
                time.sleep(3600)
            if self.how == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
        return x


def pipeline_hang(info: DataInfo, rank: int = 1, after: int = 3, how: str = "hang") -> nn.Module:
    """Two linear blocks (a pipeline splits them into two stages); the second sleeps for an
    hour (``how=hang``) or stops its process with SIGSTOP (``how=stop``) on ``rank`` after
    ``after`` forward calls (micro-batches)."""
    return nn.Sequential(
        nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU()),
        nn.Sequential(_FaultyBlock(rank, after, how), nn.Linear(32, info.num_classes)),
    )


class _InfiniteGradient(torch.autograd.Function):
    """The identity forward; the backward multiplies the gradient by infinity."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf")


class _InfiniteGradientAt(nn.Module):
    """Passes its input on; on its ``at``-th training call the gradient through it is not
    finite (the loss stays finite)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == self.at:
                return _InfiniteGradient.apply(x)
        return x


def inf_gradient(info: DataInfo, at: int = 3) -> nn.Module:
    """A linear classifier whose gradients are not finite on its ``at``-th training forward
    (every rank), with a finite loss: divergence only a gradient shows."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, info.num_classes), _InfiniteGradientAt(at))


class _Recorded(nn.Module):
    """A linear classifier whose training forward sleeps ``delay`` seconds (so that a job's
    length hardly depends on the machine), and which records the process it runs in."""

    def __init__(self, info: DataInfo, delay: float) -> None:
        super().__init__()
        self.linear = nn.Linear(64, info.num_classes)
        self.delay, self.trained = delay, False
        self._record("")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            if not self.trained:
                self.trained = True
                self._record(".trains")
            time.sleep(self.delay)
        return self.linear(x.flatten(1))

    @staticmethod
    def _record(suffix: str) -> None:
        rank, folder = os.environ.get("RANK"), os.environ.get("TANDEM_TEST_PIDS")
        if rank is None or not folder:  # the launcher's checks, or no test asked
            return
        path = os.path.join(folder, rank + suffix)
        with open(path + ".tmp", "w") as handle:
            handle.write(f"{os.getpid()} {os.getppid()}")
        os.replace(path + ".tmp", path)


def recorded(info: DataInfo, delay: float = 0.0) -> nn.Module:
    """A linear classifier that writes ``PID PPID`` of each process that builds it to
    ``$TANDEM_TEST_PIDS/RANK`` (a parameter server's process; an asynchronous worker's
    training child, whose parent is its supervisor), and again to ``RANK.trains`` at its first
    training forward, for a test to signal; each training forward sleeps ``delay`` seconds."""
    return _Recorded(info, delay)
