"""Synchronization strategies of data-parallel training: allreduce, gossip and model averaging
(the parameter server's clients live with its servers, in :mod:`tandem.runtime.ps`).

A worker of a job builds its strategy with :func:`tandem.runtime.strategies.build_strategy`.
"""

from __future__ import annotations

from tandem.sync.allreduce import AllReduce
from tandem.sync.averaging import ElasticAveraging, LocalSGD
from tandem.sync.base import SyncStrategy
from tandem.sync.gossip import AsyncGossip, ChocoGossip, Gossip, GossipMixer

__all__ = ["AllReduce", "AsyncGossip", "ChocoGossip", "ElasticAveraging", "Gossip",
           "GossipMixer", "LocalSGD", "SyncStrategy"]
