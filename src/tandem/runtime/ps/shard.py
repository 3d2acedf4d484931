"""A server's part of the model: a shard of whole parameters, the model's buffers (server 0),
their gather onto server 0 at the end, and their state in checkpoints."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tandem.runtime.ps import protocol
from tandem.sync.flat import flatten, state_buffers, unflatten_into


class ServerShard:
    """Server ``rank``'s shard of ``model`` (of ``num_servers``: the parameter list cut between
    tensors by :func:`~tandem.runtime.ps.protocol.shard_ranges`); server 0 also holds the
    model's buffers, which travel with its messages."""

    def __init__(self, model: nn.Module, rank: int, num_servers: int) -> None:
        self.model = model
        """The whole model (only this shard is trained here; server 0 gathers the rest)."""
        named = list(model.named_parameters())
        self.ranges = protocol.shard_ranges([p.numel() for _, p in named], num_servers)
        self.rank = rank
        start, end = self.ranges[rank]
        self.params = [p for _, p in named[start:end]]
        self.shapes = [p.shape for p in self.params]
        self.keys = [name for name, _ in named[start:end]]
        self.buffers = protocol.Buffers([b for _, b in state_buffers(model)] if rank == 0 else [])
        """The model's buffers (server 0 holds them; see :mod:`tandem.runtime.ps.server`)."""
        self.pushed: dict[int, torch.Tensor] = {}
        """``sync``: the buffers each worker pushed with the current step's gradient."""

    def flat(self) -> torch.Tensor:
        """The shard's parameters, flat (empty for a server without parameters)."""
        return flatten(self.params) if self.params else torch.zeros(0)

    def set_gradient(self, gradient: torch.Tensor) -> None:
        """Give each parameter its part of the flat ``gradient``."""
        offset = 0
        for param in self.params:
            param.grad = gradient[offset : offset + param.numel()].view_as(param)
            offset += param.numel()

    def keep_buffers(self, worker: int, data: torch.Tensor) -> None:
        """Hold the buffers ``worker`` pushed (``data``) until its push is applied."""
        if self.buffers.num_bytes:
            self.pushed[worker] = data

    def take_buffers(self, worker: int) -> None:
        """The model's buffers become those ``worker`` pushed with its gradient (server 0)."""
        if worker in self.pushed:
            self.buffers.load(self.pushed[worker])
        self.pushed.clear()

    def gather(self, group: dist.ProcessGroup | None) -> None:
        """Servers send their shards to server 0 (server groups only; workers are done)."""
        for server in range(1, len(self.ranges)):
            start, end = self.ranges[server]
            shard = list(self.model.parameters())[start:end]
            if not shard:
                continue
            if self.rank == server:
                dist.send(flatten(shard), dst=0, tag=protocol.GATHER, group=group)
            elif self.rank == 0:
                flat = torch.empty(sum(p.numel() for p in shard))
                dist.recv(flat, src=server, tag=protocol.GATHER, group=group)
                unflatten_into(flat, shard)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds of the shard: its parameters and the buffers."""
        return {"shard": [p.detach() for p in self.params],
                "buffers": [b.detach().clone() for b in self.buffers.tensors]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s parameters and buffers."""
        for p, saved in zip(self.params, state["shard"]):
            p.data.copy_(saved)
        for b, saved in zip(self.buffers.tensors, state.get("buffers", [])):
            b.copy_(saved)
