"""The squared norms of a step's gradient, this worker's and the averaged one, for the gradient
noise scale (:mod:`tandem.runtime.noise_scale`); with a codec, read by a DDP communication hook.

:func:`measured_hook` wraps a codec's hook (:mod:`tandem.compress.hooks`): before calling it,
it adds up the squared norm of the bucket this worker hands in — its own gradient, not yet
divided by the number of workers (a hook divides itself) — and keeps the inner hook's future,
whose averaged bucket's squared norm is taken after the backward. No communication is added.
Without a codec, :class:`~tandem.sync.allreduce.AllReduce` reads the norms itself and
:meth:`BucketNorms.record` keeps them.

Usage::

    norms = BucketNorms()
    ddp.register_comm_hook(MeasuredHookState(norms, codec_state, codec_hook), measured_hook)
    ...backward...
    local_sq, mean_sq = norms.take()        # this step's, as float64 tensors (no host sync)

(No ``from __future__ import annotations`` here: DDP checks the hook's annotations as objects.)
"""

from typing import Any, Callable

import torch
import torch.distributed as dist

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


class BucketNorms:
    """The squared norms of one step's buckets: this worker's, and the averaged ones."""

    def __init__(self) -> None:
        self.enabled = True
        """False: the hook measures nothing (the noise scale is not measured: one worker)."""
        self.local: list[torch.Tensor] = []
        self.measured: tuple[torch.Tensor, torch.Tensor] | None = None
        """Both norms of a step measured without the hook (:meth:`record`)."""
        self.exchanged: list[torch.futures.Future[torch.Tensor]] = []
        """The buckets' exchanges: their averaged norms are read after the backward (in the
        caller's thread, rather than in a callback on the communication thread)."""

    def take(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's squared norms ``(local, averaged)`` summed over buckets, and forget them;
        None if no bucket was exchanged since the last call."""
        if self.measured is not None:
            measured, self.measured = self.measured, None
            return measured
        local, exchanged = self.local, self.exchanged
        self.local, self.exchanged = [], []
        if not local or len(exchanged) != len(local) or not all(f.done() for f in exchanged):
            return None
        mean = torch.stack([squared_norm(future.value()) for future in exchanged]).sum()
        return torch.stack(local).sum(), mean


    def record(self, local: torch.Tensor, averaged: torch.Tensor) -> None:
        """A step's squared norms measured outside the hook (``AllReduce.finish_measuring``)."""
        self.measured = (local, averaged)


def squared_norm(tensor: torch.Tensor) -> torch.Tensor:
    """``|tensor|²`` as a float64 scalar tensor, on the tensor's device."""
    norm: torch.Tensor = torch.linalg.vector_norm(tensor.detach().float())
    return norm.double().square()


def squared_sum(norms: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``sum(norm²)`` of float32 scalar ``norms`` (each squared in float64, as
    :func:`squared_norm` does), in three operations whatever their number."""
    return torch.stack(norms).double().square().sum()


class MeasuredHookState:
    """Where :func:`measured_hook` records, and the hook (with its state) that it wraps."""

    def __init__(self, norms: BucketNorms, state: Any, hook: Hook) -> None:
        self.norms = norms
        self.state = state
        self.hook = hook


def measured_hook(state: MeasuredHookState,
                  bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Record the bucket's squared norm, run the wrapped hook, keep its future (whose result's
    norm :meth:`BucketNorms.take` reads)."""
    if not state.norms.enabled:
        return state.hook(state.state, bucket)
    state.norms.local.append(squared_norm(bucket.buffer()))  # before the inner hook divides it
    future = state.hook(state.state, bucket)
    state.norms.exchanged.append(future)
    return future
