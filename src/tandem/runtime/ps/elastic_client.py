"""The worker side of asynchronous EASGD: local steps with the worker's own optimizer, and every
``period`` of them an exchange with the servers that hold the center (see
:mod:`tandem.runtime.ps.elastic`).

Usage (inside a job whose ranks ``0 .. num_servers-1`` run ``ElasticServer``)::

    client = ElasticClient(1, period=4, rank=0, num_workers=4)
    module = client.wrap(model, device)
    client.pull()                            # ready: starts from the center with the others

The exchange is a parameter-server push and pull (:class:`ParameterServerClient`'s messages
and gloo side group): the push carries the worker's parameters ``x_i`` instead of a gradient,
and the reply carries ``x_i - alpha (x_i - x̃)``, which replaces them.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.runtime.ps import protocol
from tandem.sync.averaging import paper_variables
from tandem.sync.flat import flatten
from tandem.runtime.ps.client import ParameterServerClient


class ElasticClient(ParameterServerClient):
    """A worker of asynchronous EASGD: steps its own optimizer every step and meets the center
    every ``period`` steps, on its own clock."""

    name = "easgd"
    local_optimizer = True
    replicas_agree = False
    pull_on_wrap = False  # the servers start every worker together, once all are ready

    def __init__(self, num_servers: int, period: int, *, rank: int = 0, num_workers: int = 1,
                 timeout_s: float = 300.0) -> None:
        super().__init__(num_servers, None, rank=rank, num_workers=num_workers,
                         timeout_s=timeout_s)
        self.period = period
        self.since_push = 0
        """Local steps since the last exchange."""

    def record_loss(self, loss_sum: torch.Tensor, count: int) -> None:
        """The coming push carries the losses of every local step since the last one."""
        self.loss = (self.loss[0] + float(loss_sum), self.loss[1] + count)

    def update(self, module: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> bool:
        """Local step ``step`` (the worker's own clock); then, every ``period`` of them, the
        elastic exchange. True when a server says the job's steps are done."""
        self.step_optimizer(optimizer)
        self.since_push += 1
        stop = False
        if self.since_push == self.period:
            with paper_variables(optimizer):  # EAMSGD: the exchange moves the paper's x
                stop = self._exchange(protocol.PUSH, step)
            self.since_push, self.loss = 0, (0.0, 0)
        self.next_step = step + 1
        return stop

    def _pushed(self, params: list[torch.Tensor]) -> torch.Tensor:
        """The worker's parameters themselves (the server computes the elastic difference)."""
        return flatten(p.detach() for p in params) if params else torch.zeros(0)
