"""The worker side of parameter-server training: push gradient shards, pull parameter shards.

Ranks ``0 .. servers-1`` are servers (see ``tandem.runtime.ps_server``), the others workers.
Each worker pushes its gradient to every server (shard ``k`` to server ``k``) and waits for
the parameters the server sends back; when it sends them back depends on the mode (``sync``:
after all (or, with backup workers, the first N - b) gradients of the step; ``async``: at
once; ``ssp``: once the worker is at most ``staleness`` updates ahead of the slowest).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tandem.sync import ps_protocol as protocol
from tandem.sync.base import SyncStrategy
from tandem.sync.flat import flatten, unflatten_into


class ParameterServerClient(SyncStrategy):
    """A worker's strategy: the servers own the optimizer; the worker only computes gradients."""

    name = "ps"
    local_optimizer = False

    def __init__(self, num_servers: int) -> None:
        self.num_servers = num_servers
        self.versions: list[int] = [0] * num_servers
        """Parameter version (updates applied) of each server's shard in the worker's model."""
        self.next_step = 0
        """The step the servers are at: the next global batch this worker should take."""
        self.loss = (0.0, 0)
        self.bytes_sent = 0
        self.shards: list[list[torch.Tensor]] = []

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        model = model.to(device)
        params = list(model.parameters())
        ranges = protocol.shard_ranges([p.numel() for p in params], self.num_servers)
        self.shards = [params[start:end] for start, end in ranges]
        self._exchange(protocol.PULL, step=0)
        return model

    def record_loss(self, loss_sum: torch.Tensor, count: int) -> None:
        """The coming push carries its loss, for server 0's progress and metrics."""
        self.loss = (float(loss_sum), count)

    def update(self, module: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> bool:
        stop = self._exchange(protocol.PUSH, step)
        optimizer.zero_grad(set_to_none=True)
        return stop

    def finish(self) -> None:
        """Tell every server this worker is done."""
        for server, params in enumerate(self.shards):
            dist.send(protocol.message(protocol.BYE, _numel(params)), dst=server,
                      tag=protocol.TO_SERVER)

    def _exchange(self, kind: float, step: int) -> bool:
        """Send ``kind`` (with gradients for a push) to every server, then take back parameters."""
        sends = []
        for server, params in enumerate(self.shards):
            if kind == protocol.PUSH:
                payload: torch.Tensor | int = flatten(
                    p.grad if p.grad is not None else torch.zeros_like(p) for p in params
                ) if params else 0
                self.bytes_sent += _numel(params) * 4
            else:
                payload = _numel(params)
            outgoing = protocol.message(kind, payload, step=step, version=self.versions[server],
                                        loss=self.loss[0], count=self.loss[1])
            sends.append((dist.isend(outgoing, dst=server, tag=protocol.TO_SERVER), outgoing))
        stop = False
        for server, params in enumerate(self.shards):
            reply = protocol.empty(_numel(params))
            dist.recv(reply, src=server, tag=protocol.TO_WORKER)
            if params:
                unflatten_into(reply[protocol.HEADER_SIZE:], params)
            self.versions[server] = int(reply[1])
            stop = stop or bool(reply[5])
        for work, _ in sends:
            work.wait()
        self.next_step = self.versions[0]
        return stop

    def stats(self) -> dict[str, float]:
        return {"push_bytes": self.bytes_sent}


def _numel(params: list[torch.Tensor]) -> int:
    return sum(p.numel() for p in params)
