"""A DDP communication hook that records each bucket's squared norm before and after the exchange.

It wraps the hook in use (PyTorch's ``allreduce_hook``, or a codec's, see
:mod:`tandem.compress.hooks`): before calling it, it adds up the squared norm of the bucket this
worker hands in — its own gradient, not yet divided by the number of workers (DDP divides only
when no hook is registered; a hook divides itself) — and, once the inner hook's future holds
the averaged bucket, that one's squared norm. No communication is added; the norms feed the
gradient noise scale (:mod:`tandem.runtime.noise_scale`).

Usage::

    norms = BucketNorms()
    ddp.register_comm_hook(MeasuredHookState(norms, None, allreduce_hook), measured_hook)
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
        self.local: list[torch.Tensor] = []
        self.mean: list[torch.Tensor] = []

    def take(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's squared norms ``(local, averaged)`` summed over buckets, and forget them;
        None if no bucket was exchanged since the last call."""
        if not self.local or len(self.mean) != len(self.local):
            self.local, self.mean = [], []
            return None
        local, mean = torch.stack(self.local).sum(), torch.stack(self.mean).sum()
        self.local, self.mean = [], []
        return local, mean


def squared_norm(tensor: torch.Tensor) -> torch.Tensor:
    """``|tensor|²`` as a float64 scalar tensor, on the tensor's device."""
    return torch.linalg.vector_norm(tensor.detach().float()).double().square()


class MeasuredHookState:
    """Where :func:`measured_hook` records, and the hook (with its state) that it wraps."""

    def __init__(self, norms: BucketNorms, state: Any, hook: Hook) -> None:
        self.norms = norms
        self.state = state
        self.hook = hook


def measured_hook(state: MeasuredHookState,
                  bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Record the bucket's squared norm, run the wrapped hook, record its result's."""
    state.norms.local.append(squared_norm(bucket.buffer()))  # before the inner hook divides it
    future = state.hook(state.state, bucket)

    def record(done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        averaged = done.value()
        state.norms.mean.append(squared_norm(averaged))
        return averaged

    return future.then(record)
