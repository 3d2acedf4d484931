"""Decentralized SGD (D-PSGD, Lian et al. 2017): each step, every worker replaces its parameters
by a weighted average with its neighbours' (a doubly stochastic mixing matrix over a topology),
then applies its own gradient. No worker holds a global model; they reach consensus."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from tandem.sync.base import SyncStrategy
from tandem.sync.flat import flatten, unflatten_into
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

    def stats(self) -> dict[str, float]:
        return {"sync_bytes": self.mixer.bytes_sent}
