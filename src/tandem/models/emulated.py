"""A model that emulates a profiled one: each block waits its layer's profiled time.

Usage::

    model = build_model("emulated:profile=vgg16.graph.txt,batch=128,scale=0.1,bytes_scale=1e-3",
                        info)
    tandem train --model emulated:profile=prof.json,scale=0.5 --strategy pipeline ...

Block ``i`` stands for layer ``i`` of a :class:`~tandem.profile.ModelProfile`. Its forward
sleeps (``time.sleep`` releases the GIL and the CPU, so emulated workers do not compete for
the machine's cores) for the layer's profiled forward time and outputs a float32 tensor of the
layer's profiled activation size; its backward (a custom autograd function) sleeps for the
profiled backward time. A pipeline of emulated stages therefore behaves like one on real
devices: its timing comes from the schedule, the profile and the communication, not from this
machine's CPU.

Options (``emulated:key=value,...``):

- ``profile`` — a JSON profile (``tandem profile``) or PipeDream ``graph.txt``; required.
- ``scale`` — multiplies every profiled time (e.g. 0.1 to run ten times faster).
- ``batch`` — the minibatch size the profile was measured at. Waits then scale with the
  batch of each call: a call pays the layer's fixed cost (``forward_fixed_s``,
  ``backward_fixed_s``: measured by ``tandem profile``, or the documented defaults of
  :mod:`tandem.profile`) once, plus the rest of the profiled time times its share of the
  batch, exactly as the simulator charges it (a micro-batch of ``batch / 8`` samples waits
  ``fixed + (t - fixed) / 8``); activation sizes are per sample (``activation_bytes / batch``).
  Default: the profile's
  own ``batch_size``; if neither is known, every call waits the full profiled time whatever
  its size, and each sample carries the whole profiled activation.
- ``bytes_scale`` — multiplies activation sizes (and, with ``params=profiled``, parameter
  sizes). Real profiles describe GPU tensors of hundreds of MB (VGG16's first layers output
  1.6 GB at batch 128); something like ``1e-3`` keeps them cheap to send over CPU gloo while
  preserving their ratios. Sizes are rounded to whole float32 elements, at least one.
- ``params`` — ``small`` (default): each block has a few trainable parameters, enough for
  optimizers, weight stashing and ``final.pt`` to work; ``profiled``: each block allocates its
  profiled parameter bytes (× ``bytes_scale``), so allreduces and weight stashes cost what the
  profile says.

The model is a chain. For a DAG profile (e.g. PipeDream's ResNet-50 or GNMT graphs) the blocks
follow the profile's topological layer order and each block feeds the next: branches are
serialized, and a layer's profiled output is what travels to the next block even where, in the
real graph, another tensor would cross that point.

Each block's output is a cheap, differentiable function of its input (a per-sample mean, a
gain and a shift), so its gradients are exact. The last block ignores its profiled activation
size and outputs logits for the dataset's classes (per position for token data), so the loss
works on any dataset; its trainable shift learns the class prior. Activation memory is emulated
too: each block saves its output for the backward, so the pipeline engine's saved-tensor
accounting reports the profiled activation bytes of a stage.

Not modelled: GPU memory bandwidth, kernel launches beyond the profile's fixed cost per call,
and any difference between forward and backward data sizes beyond the profile's numbers. The
runtime's own cost per call (autograd, the pipeline engine, the wait's overshoot) comes on top
of the emulated times, as it would on a device; the simulator takes it as ``--overhead``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import torch
from torch import nn

from tandem.data.info import DataInfo
from tandem.spec.model import EmulatedOptions
from tandem.profile import LayerProfile, load_profile, scale_call

CHAIN_GAP_S = 1e-3
"""Two blocks run back to back (their waits are timed as one chain) when the second starts
within this long after the first ended, in the same direction, at the adjacent index."""

SPIN_S = 2e-4
"""A wait sleeps until this long before its deadline and spins the rest: waking from a sleep
takes 0.1-0.3 ms on a loaded machine, which would otherwise lengthen every pass."""

FLOAT_BYTES = 4


class Clock:
    """Sleeps (then spins briefly) until deadlines; back-to-back blocks share one timeline.

    ``time.sleep`` overshoots by tens of microseconds (milliseconds under load). Timing a chain
    of blocks against one timeline (each deadline is the previous block's deadline plus this
    block's time) keeps the overshoot of a whole stage to that of one sleep, instead of one
    per block.
    """

    def __init__(self) -> None:
        self.last: tuple[str, int] | None = None
        self.last_deadline = 0.0
        self.last_end = -math.inf

    def wait(self, direction: str, index: int, seconds: float, start: float) -> None:
        """Block ``index`` started its ``direction`` (``F``/``B``) pass at ``start``; wait."""
        follows = index - 1 if direction == "F" else index + 1
        chained = self.last == (direction, follows) and start - self.last_end < CHAIN_GAP_S
        deadline = (self.last_deadline if chained else start) + seconds
        remaining = deadline - time.perf_counter()
        if remaining > SPIN_S:
            time.sleep(remaining - SPIN_S)
        while time.perf_counter() < deadline:
            pass
        self.last, self.last_deadline, self.last_end = (direction, index), deadline, time.perf_counter()


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BlockTiming:
    """What one emulated block waits for and produces."""

    index: int
    """Position of the block in the model (for chaining waits)."""
    forward_s: float
    """Forward wait of one call at the reference batch (already multiplied by ``scale``)."""
    backward_s: float
    forward_fixed_s: float = 0.0
    """Part of ``forward_s`` every call waits whatever its size (already multiplied by ``scale``)."""
    backward_fixed_s: float = 0.0
    """Part of ``backward_s`` every call waits whatever its size."""
    reference_batch: int | None
    """Samples the waits are for; None: the waits are per call, whatever its size."""
    output_shape: tuple[int, ...]
    """Per-sample output shape."""
    width: int
    """Distinct values along the output's last dimension: 1, or the classes of the logits."""
    clock: Clock = dataclasses.field(compare=False)

    def seconds(self, direction: str, num_samples: int) -> float:
        """Wait of one ``direction`` (``F``/``B``) call on ``num_samples`` samples."""
        base, fixed = ((self.forward_s, self.forward_fixed_s) if direction == "F"
                       else (self.backward_s, self.backward_fixed_s))
        if self.reference_batch is None:
            return base
        return scale_call(base, fixed, num_samples / self.reference_batch)


class _Emulate(torch.autograd.Function):
    """``out[i] = shift + gain * mean(x[i])`` broadcast to the output shape, after a wait."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor,
                timing: BlockTiming) -> torch.Tensor:
        start = time.perf_counter()
        n, width = x.shape[0], timing.width
        shift, gain = weight[:width], weight[width : 2 * width]
        flat = x.detach().reshape(n, -1)
        means = (flat if flat.is_floating_point() else flat.float()).mean(dim=1)
        rows = shift + gain * means[:, None]
        middle = (1,) * (len(timing.output_shape) - 1)
        out = rows.reshape(n, *middle, width).expand(n, *timing.output_shape).contiguous()
        ctx.timing, ctx.input_shape, ctx.input_dtype = timing, x.shape, x.dtype
        ctx.weight_numel = weight.numel()
        ctx.save_for_backward(means, weight[: 2 * width], out)  # out: the emulated activation
        timing.clock.wait("F", timing.index, timing.seconds("F", n), start)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        start = time.perf_counter()
        timing: BlockTiming = ctx.timing
        means, head, _ = ctx.saved_tensors
        n, width = grad.shape[0], timing.width
        per_row = grad.reshape(n, -1, width).sum(dim=1)
        grad_weight = grad_x = None
        if ctx.needs_input_grad[1]:
            grad_weight = torch.zeros(ctx.weight_numel, dtype=grad.dtype, device=grad.device)
            grad_weight[:width] = per_row.sum(dim=0)
            grad_weight[width : 2 * width] = (per_row * means[:, None]).sum(dim=0)
        if ctx.needs_input_grad[0]:
            per_sample = (per_row * head[width:]).sum(dim=1) / math.prod(ctx.input_shape[1:])
            view = (n, *(1,) * (len(ctx.input_shape) - 1))
            grad_x = per_sample.to(ctx.input_dtype).reshape(view).expand(ctx.input_shape).contiguous()
        timing.clock.wait("B", timing.index, timing.seconds("B", n), start)
        return grad_x, grad_weight, None


class EmulatedBlock(nn.Module):
    """One profiled layer: waits its time, outputs its activation size, has trainable weights."""

    def __init__(self, timing: BlockTiming, *, num_params: int, layer_name: str) -> None:
        super().__init__()
        self.timing, self.layer_name = timing, layer_name
        self.weight = nn.Parameter(torch.empty(max(num_params, 2 * timing.width)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Zeros, but for the gains (1) of the per-channel affine map."""
        width = self.timing.width
        with torch.no_grad():
            self.weight.zero_()
            self.weight[width : 2 * width] = 1.0  # gain 1, shift 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's Function.apply is unannotated
        out: torch.Tensor = _Emulate.apply(x, self.weight, self.timing)  # type: ignore[no-untyped-call]
        return out

    def extra_repr(self) -> str:
        t = self.timing
        return (f"{self.layer_name!r}, forward_s={t.forward_s:.3g}, backward_s={t.backward_s:.3g}, "
                f"output={t.output_shape}, params={self.weight.numel()}")


def output_shape(index: int, layer: LayerProfile, *, num_layers: int, options: EmulatedOptions,
                 reference_batch: int | None, info: DataInfo) -> tuple[int, ...]:
    """Per-sample output shape of block ``index``: the scaled profiled size, or logits last."""
    if index == num_layers - 1:
        if info.task == "classify":
            return (info.num_classes,)
        return (*info.input_shape, info.num_classes)
    per_sample = layer.activation_bytes * options.bytes_scale / (reference_batch or 1)
    return (max(1, round(per_sample / FLOAT_BYTES)),)


def build_emulated(options: EmulatedOptions, info: DataInfo) -> nn.Sequential:
    """One :class:`EmulatedBlock` per profile layer, in the profile's (topological) order."""
    profile = load_profile(options.profile)
    reference = options.batch or profile.batch_size or None
    clock = Clock()
    blocks = []
    for index, layer in enumerate(profile.layers):
        last = index == profile.num_layers - 1
        timing = BlockTiming(
            index=index, forward_s=layer.forward_s * options.scale,
            backward_s=layer.backward_s * options.scale,
            forward_fixed_s=layer.forward_fixed_s * options.scale,
            backward_fixed_s=layer.backward_fixed_s * options.scale,
            reference_batch=reference, clock=clock,
            width=info.num_classes if last else 1,
            output_shape=output_shape(index, layer, num_layers=profile.num_layers,
                                      options=options, reference_batch=reference, info=info),
        )
        num_params = (round(layer.parameter_bytes * options.bytes_scale / FLOAT_BYTES)
                      if options.params == "profiled" else 0)
        blocks.append(EmulatedBlock(timing, num_params=num_params, layer_name=layer.name))
    return nn.Sequential(*blocks)
