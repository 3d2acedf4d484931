"""Decentralized SGD (D-PSGD, Lian et al. 2017): each step, every worker replaces its parameters
by a weighted average with its neighbours' (a doubly stochastic mixing matrix over a topology),
then applies its own gradient. No worker holds a global model; they reach consensus."""

from __future__ import annotations

import random
import threading

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from tandem.errors import UsageError
from tandem.sync.base import SyncStrategy
from tandem.sync.flat import average_parameters, flatten, unflatten_into
from tandem.topology import Graph


class GossipMixer:
    """One gossip round for this rank: exchange a flat tensor with the neighbours and mix."""

    def __init__(self, graph: Graph, matrix: np.ndarray, rank: int) -> None:
        self.rank = rank
        self.neighbours = sorted(graph[rank])
        self.self_weight = float(matrix[rank, rank])
        self.weights = [float(matrix[rank, j]) for j in self.neighbours]
        self.bytes_sent = 0

    def mix(self, flat: torch.Tensor) -> torch.Tensor:
        """``sum_j W[rank, j] * x_j`` over this rank and its neighbours."""
        received = [torch.empty_like(flat) for _ in self.neighbours]
        operations = [dist.P2POp(dist.isend, flat, peer) for peer in self.neighbours]
        operations += [dist.P2POp(dist.irecv, buffer, peer)
                       for peer, buffer in zip(self.neighbours, received)]
        if operations:
            for work in dist.batch_isend_irecv(operations):
                work.wait()
        self.bytes_sent += len(self.neighbours) * flat.numel() * flat.element_size()
        mixed = flat * self.self_weight
        for weight, other in zip(self.weights, received):
            mixed.add_(other, alpha=weight)
        return mixed


class Gossip(SyncStrategy):
    """D-PSGD: mix parameters with the neighbours, then take the local optimizer step."""

    name = "gossip"

    def __init__(self, mixer: GossipMixer) -> None:
        self.mixer = mixer

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        return model.to(device)

    def update(self, module: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> bool:
        params = list(module.parameters())
        unflatten_into(self.mixer.mix(flatten(params)), params)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return False

    def consensus(self, module: nn.Module) -> None:
        average_parameters(module)

    def stats(self) -> dict[str, float]:
        return {"sync_bytes": self.mixer.bytes_sent}


def two_colouring(graph: Graph) -> list[int]:
    """Colour 0/1 so that every edge joins different colours; ``UsageError`` if impossible."""
    colours = [-1] * len(graph)
    for start in range(len(graph)):
        if colours[start] >= 0:
            continue
        colours[start], frontier = 0, [start]
        while frontier:
            node = frontier.pop()
            for other in graph[node]:
                if colours[other] < 0:
                    colours[other] = 1 - colours[node]
                    frontier.append(other)
                elif colours[other] == colours[node]:
                    raise UsageError(
                        "--async-gossip (AD-PSGD) needs a bipartite topology so that active workers "
                        "only average with passive ones (no deadlock): use a ring with an even "
                        "number of workers or a torus with even sides"
                    )
    return colours


_REQUEST, _STOP = 1.0, 2.0
_TAG_HEADER, _TAG_MINE, _TAG_THEIRS = 21, 22, 23


class AsyncGossip(SyncStrategy):
    """AD-PSGD (Lian et al. 2018): after each gradient, an *active* worker averages its model
    with one random *passive* neighbour, ``x_i = x_j = (x_i + x_j) / 2``, and applies its
    gradient; passive workers answer such requests on a background thread while they train.
    No worker waits for a global round, so a straggler slows only the requests sent to it.
    The topology must be bipartite (active and passive sides), which rules out deadlock.
    """

    name = "gossip"
    synchronous = False

    def __init__(self, graph: Graph, rank: int, seed: int) -> None:
        self.rank = rank
        self.world_size = len(graph)
        colours = two_colouring(graph)
        self.active = colours[rank] == 0
        self.neighbours = sorted(graph[rank])
        self.random = random.Random(seed * 7919 + rank)
        self.lock = threading.Lock()
        self.bytes_sent = 0
        self.averages = 0
        self.params: list[torch.Tensor] = []
        self.server: threading.Thread | None = None
        self.error: BaseException | None = None

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        model = model.to(device)
        self.params = list(model.parameters())
        self.group = dist.new_group(list(range(self.world_size)))
        if not self.active:
            self.server = threading.Thread(target=self._serve, name="tandem-ad-psgd", daemon=True)
            self.server.start()
        return model

    def update(self, module: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> bool:
        if self.error is not None:
            raise self.error
        if self.active and self.neighbours:
            peer = self.random.choice(self.neighbours)
            mine = flatten(self.params)
            theirs = torch.empty_like(mine)
            dist.send(torch.tensor([_REQUEST], dtype=torch.float64), peer, group=self.group,
                      tag=_TAG_HEADER)
            dist.send(mine, peer, group=self.group, tag=_TAG_MINE)
            dist.recv(theirs, peer, group=self.group, tag=_TAG_THEIRS)
            self.bytes_sent += mine.numel() * mine.element_size()
            with self.lock:
                unflatten_into(flatten(self.params) + (theirs - mine) / 2, self.params)
                self.averages += 1
        with self.lock:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return False

    def _serve(self) -> None:
        """Passive side: answer averaging requests until every active neighbour says stop."""
        try:
            remaining = len(self.neighbours)
            while remaining:
                header = torch.empty(1, dtype=torch.float64)
                work = dist.irecv(header, src=None, group=self.group, tag=_TAG_HEADER)
                work.wait()
                peer = dist.get_global_rank(self.group, work._source_rank())
                if header[0] == _STOP:
                    remaining -= 1
                    continue
                theirs = torch.empty(sum(p.numel() for p in self.params))
                dist.recv(theirs, peer, group=self.group, tag=_TAG_MINE)
                with self.lock:
                    mine = flatten(self.params)
                    unflatten_into(mine + (theirs - mine) / 2, self.params)
                    self.averages += 1
                dist.send(mine, peer, group=self.group, tag=_TAG_THEIRS)
                self.bytes_sent += mine.numel() * mine.element_size()
        except BaseException as exc:  # noqa: BLE001 - reported by the training thread
            self.error = exc

    def finish(self) -> None:
        if self.active:
            for peer in self.neighbours:
                dist.send(torch.tensor([_STOP], dtype=torch.float64), peer, group=self.group,
                          tag=_TAG_HEADER)
        elif self.server is not None:
            self.server.join()
            if self.error is not None:
                raise self.error

    def consensus(self, module: nn.Module) -> None:
        average_parameters(module)

    def stats(self) -> dict[str, float]:
        return {"sync_bytes": self.bytes_sent, "pairwise_averages": self.averages}
