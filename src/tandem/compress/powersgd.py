"""PowerSGD (Vogels et al., 2019) through PyTorch's own DDP hook, with its bytes counted.

PowerSGD is not a per-tensor codec: each step it allreduces ``P = M Q`` for every large
gradient matrix ``M``, orthogonalizes ``P``, then allreduces ``Q = M^T P`` — two rounds that
only work summed over workers. PyTorch's ``powerSGD_hook`` does this with error feedback and
warm start; tensors too small to gain ``min_rate`` (biases) and the first ``start`` steps go
through a plain allreduce.
"""

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from tandem.spec.codec import PowerSGDOptions
from tandem.compress.codec import Compression
from tandem.compress.meter import ByteMeter


class PowerSGD(Compression):
    """PyTorch's ``powerSGD_hook`` wrapped to count the elements it allreduces."""

    resumable = False
    """PyTorch keeps its residuals and warm-start factors per DDP bucket index, and a restarted
    job builds its buckets anew (then rebuilds them after the first step)."""

    def __init__(self, options: PowerSGDOptions) -> None:
        self.options = options

    def ddp_hook(self, model: nn.Module, meter: ByteMeter) -> tuple[Any, Callable[..., Any]]:
        o = self.options
        state = powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=o.rank, start_powerSGD_iter=o.start,
            min_compression_rate=o.min_rate, use_error_feedback=o.ef, warm_start=o.warm,
            random_seed=o.seed,
        )
        return CountingState(state, meter), counting_powersgd_hook


class CountingState:
    """PyTorch's PowerSGD state and the meter its hook's payloads are counted into."""

    def __init__(self, state: powersgd.PowerSGDState, meter: ByteMeter) -> None:
        self.state = state
        self.meter = meter


def counting_powersgd_hook(state: CountingState,
                           bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """``powerSGD_hook``; its payload is what its own statistics say it allreduced."""
    inner = state.state
    buffer = bucket.buffer()
    compressing = inner.iter >= inner.start_powerSGD_iter
    before = inner.total_numel_after_compression
    future = powersgd.powerSGD_hook(inner, bucket)
    elements = inner.total_numel_after_compression - before if compressing else buffer.numel()
    state.meter.add(payload_bytes=elements * buffer.element_size(),
                    gradient_bytes=buffer.numel() * buffer.element_size(), collective="allreduce")
    return future
