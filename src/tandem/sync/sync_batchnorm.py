"""BatchNorm over the global batch of synchronous data parallelism (``--sync-batchnorm``): each
BatchNorm layer normalizes with the mean and variance of every worker's samples, so the update
equals one process's on the whole batch.

On GPUs this is torch's ``nn.SyncBatchNorm`` (``convert_sync_batchnorm``). torch's layer runs on
CUDA (and XPU) inputs only, so on CPUs (gloo) tandem converts to :class:`GlobalBatchNorm`, which
sums each channel's values, then squared deviations, over the workers with the differentiable
``torch.distributed.nn`` allreduce: autograd carries the statistics' gradients back to every
worker, as torch's layer does by hand.

Usage::

    model = sync_batchnorms(model, device)   # before DDP or FSDP2 wraps it
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from tandem.errors import UsageError


class GlobalBatchNorm(_BatchNorm):
    """A BatchNorm layer (any number of spatial dimensions) whose training statistics are
    those of the global batch: every worker's samples in the default process group."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
        if self.dims is not None and input.dim() not in self.dims:
            raise ValueError(f"expected {' or '.join(f'{d}D' for d in self.dims)} input (got "
                             f"{input.dim()}D input), as the BatchNorm layer it replaced")

    dims: tuple[int, ...] | None = None
    """The input dimensions the replaced layer took (``BatchNorm2d``: 4); None: any."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training or not dist.is_initialized() or dist.get_world_size() == 1:
            return super().forward(input)
        values = input.float()  # statistics in fp32 whatever the input (fp16 counts overflow)
        dims = [0, *range(2, input.dim())]
        shape = [1, input.shape[1], *([1] * (input.dim() - 2))]
        count = torch.tensor([input.numel() // input.shape[1]], dtype=torch.float32,
                             device=input.device)
        sums = _summed(torch.cat([values.sum(dims), count]))
        total = sums[-1]
        mean = sums[:-1] / total
        centered = values - mean.view(shape)
        var = _summed(centered.square().sum(dims)) / total
        output = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            output = output * self.weight.float().view(shape) + self.bias.float().view(shape)
        if self.track_running_stats:
            self._update_running(mean.detach(), var.detach() * total / (total - 1).clamp(min=1))
        return output.to(input.dtype)

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, unbiased: torch.Tensor) -> None:
        """Running statistics as ``nn.BatchNorm`` keeps them (the variance unbiased)."""
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                  else self.momentum)
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)


def _summed(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed over the workers; its gradient summed back over them (autograd)."""
    from torch.distributed.nn.functional import all_reduce

    return cast(torch.Tensor, cast(Any, all_reduce)(tensor))


def check_batchnorms(model: nn.Module) -> None:
    """One line if ``model`` has no BatchNorm layer for ``--sync-batchnorm`` to synchronize."""
    if not any(isinstance(module, _BatchNorm) for module in model.modules()):
        raise UsageError("--sync-batchnorm: the model has no BatchNorm layer to synchronize; "
                         "drop --sync-batchnorm")


def sync_batchnorms(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` with each BatchNorm layer normalizing over the global batch (torch's
    ``SyncBatchNorm`` on CUDA, :class:`GlobalBatchNorm` elsewhere), its parameters and buffers
    the same tensors; one line if it has none."""
    check_batchnorms(model)
    if device.type == "cuda":
        convert = cast(Any, nn.SyncBatchNorm).convert_sync_batchnorm
        return cast(nn.Module, convert(model))
    return _converted(model)


_DIMS: dict[type, tuple[int, ...]] = {nn.BatchNorm1d: (2, 3), nn.BatchNorm2d: (4,),
                                      nn.BatchNorm3d: (5,)}
"""The input dimensions torch's BatchNorm layers take."""


def _converted(module: nn.Module) -> nn.Module:
    """``module`` with every ``_BatchNorm`` (itself included) replaced by a
    :class:`GlobalBatchNorm` holding its parameters and buffers."""
    if isinstance(module, _BatchNorm) and not isinstance(module, GlobalBatchNorm):
        layer = GlobalBatchNorm.__new__(GlobalBatchNorm)
        nn.Module.__init__(layer)
        for key in ("num_features", "eps", "momentum", "affine", "track_running_stats"):
            setattr(layer, key, getattr(module, key))
        for key in ("weight", "bias"):  # None where not affine
            layer.register_parameter(key, getattr(module, key))
        for key in ("running_mean", "running_var", "num_batches_tracked"):
            layer.register_buffer(key, getattr(module, key, None))
        layer.dims = _DIMS.get(type(module))
        layer.train(module.training)
        return layer
    for name, child in module.named_children():
        converted = _converted(child)
        if converted is not child:
            setattr(module, name, converted)
    return module
