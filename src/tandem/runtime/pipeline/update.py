"""A stage's gradient allreduce among its replicas and its optimizer step, the update handlers
of its schedule.

A parameter held by several stages (tied weights) has its gradient summed over them before
every optimizer step, so its copies stay equal. The optimizer step goes through
:class:`~tandem.runtime.precision.StagePrecision` (fp16's shared loss scale, clipping).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tandem.compress.meter import ring_bytes
from tandem.runtime.executor import Span
from tandem.runtime.pipeline.stash import WeightVersions
from tandem.runtime.pipeline.wire import Traffic
from tandem.runtime.precision import StagePrecision
from tandem.runtime.tensor_parallel import local_tensor
from tandem.schedule import Action


@dataclasses.dataclass(frozen=True, slots=True)
class Tie:
    """Parameters this stage shares with other stages, and the group of their workers."""

    group: dist.ProcessGroup
    stages: tuple[int, ...]
    params: list[nn.Parameter]
    scale: float
    """1 / the stage's replicas: after their allreduce each replica holds the stage's sum (1
    for sharded stages, each of whose groups holds one replica of each tied stage)."""
    num_workers: int


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class UpdateSpec:
    """How a stage updates its weights."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    precision: StagePrecision
    group: dist.ProcessGroup | None = None
    """The stage's replicas (None: one replica, nothing to average)."""
    num_replicas: int = 1
    ties: Sequence[Tie] = ()
    reduce: Callable[[], float] | None = None
    """The stage's own reduction of its replicas' gradients, which its ``AR`` runs instead of
    the allreduce (a sharded stage's reduce-scatter); returns the bytes it sent."""


class StageUpdate:
    """Runs a stage's ``AR`` and ``ST`` actions."""

    def __init__(self, spec: UpdateSpec, traffic: Traffic, stash: WeightVersions | None,
                 param_grads: dict[int, list[torch.Tensor | None]], beat: Any) -> None:
        self.spec, self.traffic, self.stash, self.beat = spec, traffic, stash, beat
        self.param_grads = param_grads
        """Micro-batch -> its weight version's gradients (asynchronous schedule)."""
        self.after_step: Callable[[int], None] | None = None
        """Called after each optimizer step with the step it belongs to (for the asynchronous
        schedule, its minibatch's): where a checkpoint can catch a stage's state in passing."""

    def allreduce(self, action: Action, span: Span) -> None:
        """Average (asynchronous) or sum (flush) the gradients over the stage's replicas."""
        spec = self.spec
        if spec.reduce is not None:
            self.beat.phase = "step"
            self.traffic.other_bytes += spec.reduce()
            return
        if spec.group is None:  # a stage with one replica: nothing to average
            return
        self.beat.phase = "step"
        if action.microbatch is None:
            grads = [local_tensor(p.grad) for p in spec.module.parameters() if p.grad is not None]
        else:
            grads = [g for g in self.param_grads[action.microbatch] if g is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=spec.group)
        if action.microbatch is not None:
            flat /= spec.num_replicas
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        span.num_bytes = flat.numel() * flat.element_size()
        self.traffic.other_bytes += ring_bytes("allreduce", span.num_bytes, spec.num_replicas)

    def step(self, action: Action, span: Span) -> None:
        """Apply the update (tied weights' gradients summed first) and advance the schedule."""
        spec = self.spec
        self.beat.phase = "step"
        if action.microbatch is not None:
            for p, g in zip(spec.module.parameters(), self.param_grads.pop(action.microbatch)):
                p.grad = g
        if spec.ties:
            self._sum_tied()
        spec.precision.step(spec.optimizer, spec.module.parameters())
        spec.optimizer.zero_grad(set_to_none=True)
        spec.scheduler.step()
        if self.stash is not None:
            self.stash.advance()
        if self.after_step is not None:
            span.end = time.perf_counter()
            self.after_step(span.step)

    def _sum_tied(self) -> None:
        """Sum the gradients of parameters shared with other stages over those stages."""
        for tie in self.spec.ties:
            grads = []
            for p in tie.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(local_tensor(p.grad))  # a sharded stage's: its shards
            flat = torch.cat([g.reshape(-1) for g in grads]) * tie.scale
            dist.all_reduce(flat, group=tie.group)
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()
            self.traffic.other_bytes += ring_bytes("allreduce", flat.numel() * flat.element_size(),
                                                   tie.num_workers)

