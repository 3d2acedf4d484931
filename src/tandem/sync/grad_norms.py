"""A DDP communication hook that records each bucket's squared norm before and after the exchange.

It wraps the hook in use (:func:`mean_allreduce`, or a codec's, see
:mod:`tandem.compress.hooks`): before calling it, it adds up the squared norm of the bucket this
worker hands in — its own gradient, not yet divided by the number of workers (DDP divides only
when no hook is registered; a hook divides itself) — and keeps the inner hook's future, whose
averaged bucket's squared norm is taken after the backward. No communication is added; the norms feed the
gradient noise scale (:mod:`tandem.runtime.noise_scale`).

Usage::

    norms = BucketNorms()
    ddp.register_comm_hook(MeasuredHookState(norms, None, mean_allreduce), measured_hook)
    ...backward...
    local_sq, mean_sq = norms.take()        # this step's, as float64 tensors (no host sync)

(No ``from __future__ import annotations`` here: DDP checks the hook's annotations as objects.)
"""

from typing import Any, Callable, cast

import torch
import torch.distributed as dist

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


class BucketNorms:
    """The squared norms of one step's buckets: this worker's, and the averaged ones."""

    def __init__(self) -> None:
        self.enabled = True
        """False: the hook measures nothing (the noise scale is not measured: one worker)."""
        self.local: list[torch.Tensor] = []
        self.exchanged: list[torch.futures.Future[torch.Tensor]] = []
        """The buckets' exchanges: their averaged norms are read after the backward (in the
        caller's thread, rather than in a callback on the communication thread)."""

    def take(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's squared norms ``(local, averaged)`` summed over buckets, and forget them;
        None if no bucket was exchanged since the last call."""
        local, exchanged = self.local, self.exchanged
        self.local, self.exchanged = [], []
        if not local or len(exchanged) != len(local) or not all(f.done() for f in exchanged):
            return None
        mean = torch.stack([squared_norm(future.value()) for future in exchanged]).sum()
        return torch.stack(local).sum(), mean


def squared_norm(tensor: torch.Tensor) -> torch.Tensor:
    """``|tensor|²`` as a float64 scalar tensor, on the tensor's device."""
    norm: torch.Tensor = torch.linalg.vector_norm(tensor.detach().float())
    return norm.double().square()


def mean_allreduce(group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's allreduce as a Python hook: the bucket divided by the workers, summed over them
    (``group``, or every worker for None). PyTorch's ``allreduce_hook`` computes the same, through
    ``dist.all_reduce``'s Python checks and wrappers; this calls the process group directly,
    which costs about half a millisecond less per step on a small model."""
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    tensor = bucket.buffer().div_(group.size())
    future = group.allreduce([tensor]).get_future()
    return cast(torch.futures.Future[torch.Tensor], future.then(_first))


def _first(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
    return future.value()[0]


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
