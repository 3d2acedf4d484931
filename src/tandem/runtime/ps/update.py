"""How a parameter server applies a gradient to its shard: the check that it is finite, the
learning rate at the step (with the staleness of asynchronous pushes), clipping by the global
norm across servers, the optimizer, and the compensation of stale updates."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist

from tandem.runtime.asynchrony import (
    Compensation, apply_compensation, compensation_for, restore_momentum,
)
from tandem.runtime.config import RunConfig
from tandem.runtime.divergence import diverged, first_non_finite
from tandem.runtime.learning_rate import (
    batch_lr_factor, build_optimizer, lr_factor, user_scheduler,
)
from tandem.runtime.param_groups import group_plan
from tandem.runtime.ps import protocol
from tandem.runtime.ps.shard import ServerShard
from tandem.runtime.task import UserObjects


@dataclasses.dataclass(frozen=True, slots=True)
class ServerPeers:
    """Where a server is among the servers: its rank, their number, and the group they talk on."""

    rank: int
    num_servers: int
    group: dist.ProcessGroup | None = None

    @property
    def others(self) -> list[int]:
        """The other servers' ranks."""
        return [rank for rank in range(self.num_servers) if rank != self.rank]


class UpdateRule:
    """The optimizer over a server's shard, and how a pushed gradient becomes a step of it.

    ``delay``: the versions an asynchronous push is stale by on average (the other workers'
    pushes between two of one worker's), compensated as :mod:`tandem.runtime.asynchrony` says;
    ``share``: a worker's share of the batch. ``optimize`` False: no optimizer (EASGD's server
    moves its center by the workers' differences); ``clips``: the server clips the step's
    gradient to ``--clip-grad-norm`` by its norm across all servers; ``staleness_lr``: the
    learning rate is divided by each push's staleness.
    """

    def __init__(self, config: RunConfig, shard: ServerShard, *, delay: int = 0,
                 share: float = 1.0, optimize: bool = True, clips: bool = False,
                 staleness_lr: bool = False, objects: UserObjects | None = None) -> None:
        self.config = config
        self.shard = shard
        user = objects or UserObjects()
        self.optimizer = (build_optimizer(config, list(zip(shard.keys, shard.params)),
                                          groups=group_plan(config, shard.model,
                                                            user.param_groups))
                          if optimize and shard.params else None)
        self.compensation: Compensation = compensation_for(config, delay, share=share)
        """How stale updates are compensated (a component of the server: its summary)."""
        self.base_lrs: list[float] = []
        """Each group's learning rate before warm-up and schedule (compensation's scale in)."""
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        """The user's scheduler (``tandem.fit(..., scheduler=...)``; synchronous servers)."""
        if self.optimizer is not None:
            self.compensation = apply_compensation(self.optimizer, self.compensation)
            self.base_lrs = [group["lr"] for group in self.optimizer.param_groups]
            if user.scheduler is not None:
                self.scheduler = user_scheduler(user.scheduler, self.optimizer)
        self.clips = clips
        self.staleness_lr = staleness_lr

    def apply(self, gradient: torch.Tensor | None, *, step: int, batch_size: int,
              staleness: int, peers: ServerPeers) -> bool:
        """Apply ``gradient`` (this shard's, of step ``step`` at global batch ``batch_size``,
        ``staleness`` versions old); False if it was not finite (an overflowed fp16 or a
        diverged gradient, skipped)."""
        if self.clips:
            gradient = clip_across_servers(gradient, self.config.clip_grad_norm or 0.0, peers)
        if gradient is not None and not bool(torch.isfinite(gradient).all()):
            return False
        if self.optimizer is not None and gradient is not None:
            self.shard.set_gradient(gradient)
            if self.scheduler is None:
                factor = lr_factor(self.config, step) * batch_lr_factor(self.config, batch_size)
                if self.staleness_lr:
                    factor /= max(1, staleness)
                for group, base in zip(self.optimizer.param_groups, self.base_lrs):
                    group["lr"] = base * factor
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.scheduler is not None:
                self.scheduler.step()
        return True

    def lr(self) -> float | None:
        """The learning rate of the last update (its first group's; None without an optimizer)."""
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else None

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state (None without one)."""
        return {"optimizer": self.optimizer.state_dict() if self.optimizer else None,
                "scheduler": self.scheduler.state_dict() if self.scheduler else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the optimizer's state, with the momentum its compensation expects, and the
        user's scheduler's."""
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            restore_momentum(self.optimizer, self.compensation)
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])


def clip_across_servers(gradient: torch.Tensor | None, limit: float,
                        peers: ServerPeers) -> torch.Tensor | None:
    """Scale the step's mean gradient to ``limit`` by its global norm: this server's shard's
    squared norm plus the other servers' (exchanged point-to-point; in sync mode every server
    applies every step, in the same order). Collectives the workers are not part of cannot be
    used here."""
    squared = (gradient.double().pow(2).sum().reshape(1) if gradient is not None
               else torch.zeros(1, dtype=torch.float64))
    others = peers.others
    received = [torch.empty_like(squared) for _ in others]
    sends = [dist.isend(squared, dst=rank, tag=protocol.CLIP, group=peers.group)
             for rank in others]
    for rank, buffer in zip(others, received):
        dist.recv(buffer, src=rank, tag=protocol.CLIP, group=peers.group)
    for work in sends:
        if work is not None:
            work.wait()
    norm = float(squared.sum() + sum(buffer.sum() for buffer in received)) ** 0.5
    if gradient is not None and norm > limit and norm == norm:
        scaled: torch.Tensor = gradient * (limit / (norm + 1e-6))
        return scaled
    return gradient


def check_push(config: RunConfig, header: protocol.Header, gradient: torch.Tensor | None, *,
               sender: int, peers: ServerPeers, per_step: int) -> None:
    """Stop the run on a push whose loss or gradient is not finite, naming its worker
    (``sender``, pushing to the server ``peers`` describe): divergence in fp32 and bf16. With
    fp16 it is an overflow, skipped by :meth:`UpdateRule.apply` (the worker stops the run if its
    steps keep overflowing, see :mod:`tandem.runtime.divergence`)."""
    if config.precision == "fp16":
        return
    mean = header.loss / header.count if header.count else 0.0
    if math.isfinite(mean):
        bad = first_non_finite([gradient]) if gradient is not None else None
        if bad is None:
            return
        problem, loss = f"the gradient became {bad}", None
    else:
        problem, loss = f"loss became {mean}", mean
    where = (f"worker {sender - peers.num_servers} (rank {sender}), pushed to server "
             f"{peers.rank}")
    raise diverged(config, problem=problem, step_index=header.step // per_step, where=where,
                   rank=sender, loss=loss)
