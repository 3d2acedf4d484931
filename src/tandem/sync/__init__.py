"""Synchronization strategies of data-parallel training, by name.

Usage::

    strategy = build_strategy(config, rank=0, world_size=4)
    module = strategy.wrap(model, device)
"""

from __future__ import annotations

from tandem.errors import UsageError
from tandem.sync.allreduce import AllReduce
from tandem.sync.averaging import ElasticAveraging, LocalSGD
from tandem.sync.base import SyncStrategy
from tandem.sync.gossip import AsyncGossip, ChocoGossip, Gossip, GossipMixer
from tandem.sync.parameter_server import ParameterServerClient

__all__ = ["STRATEGIES", "AllReduce", "AsyncGossip", "ChocoGossip", "ElasticAveraging", "Gossip",
           "LocalSGD", "ParameterServerClient", "SyncStrategy", "build_strategy"]

STRATEGIES = ("dp", "ps", "gossip", "easgd", "localsgd")


def build_strategy(config: "TrainConfig", rank: int, world_size: int) -> SyncStrategy:  # noqa: F821
    """The synchronization strategy ``config.strategy`` for ``rank`` of ``world_size``."""
    if config.strategy == "dp":
        return AllReduce(config.compress)
    if config.strategy == "ps":
        return ParameterServerClient(config.servers, config.compress, rank=rank,
                                     num_workers=world_size)
    if config.strategy == "gossip":
        from tandem.topology import build_topology, mixing_matrix

        graph = build_topology(config.topology, world_size)
        if config.asynchronous_gossip:
            return AsyncGossip(graph, rank, config.seed)
        matrix = mixing_matrix(graph, config.mixing)
        if config.compress is not None:
            return ChocoGossip(graph, matrix, rank, config.compress, config.gossip_step)
        return Gossip(GossipMixer(graph, matrix, rank))
    if config.strategy == "easgd":
        return ElasticAveraging(config.period, config.rho, config.lr)
    if config.strategy == "localsgd":
        return LocalSGD(config.period)
    raise UsageError(f"unknown strategy {config.strategy!r}; choose one of: {', '.join(STRATEGIES)}")
