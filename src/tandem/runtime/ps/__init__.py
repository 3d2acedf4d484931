"""Parameter-server training, both sides: the servers (runtime workers that hold the model's
shards) and their workers' clients (sync strategies), with the messages between them.

Modules:

- both sides: :mod:`~tandem.runtime.ps.protocol` (messages, how shards travel in them, how the
  parameters are sharded over servers);
- the workers' side: :mod:`~tandem.runtime.ps.client` (push gradients, pull parameters) and
  :mod:`~tandem.runtime.ps.elastic_client` (asynchronous EASGD's exchanges);
- the servers: :mod:`~tandem.runtime.ps.server` (the serving loop and its pace) and
  :mod:`~tandem.runtime.ps.elastic` (asynchronous EASGD's), made of
  :mod:`~tandem.runtime.ps.shard` (a server's part of the model),
  :mod:`~tandem.runtime.ps.update` (how a push updates it),
  :mod:`~tandem.runtime.ps.rounds` (which workers wait, and when they go on),
  :mod:`~tandem.runtime.ps.mailbox` (messages received and replies sent),
  :mod:`~tandem.runtime.ps.codecs` (per-worker codecs and their state),
  :mod:`~tandem.runtime.ps.liveness` (workers done, dead or stuck),
  :mod:`~tandem.runtime.ps.stats` (counts and the metrics line),
  :mod:`~tandem.runtime.ps.checkpoint` (``server-K.pt``) and
  :mod:`~tandem.runtime.ps.summary` (server 0's outputs and the run's summary).
"""

from __future__ import annotations

from tandem.runtime.ps.client import ParameterServerClient
from tandem.runtime.ps.elastic import ElasticServer, elastic_update
from tandem.runtime.ps.elastic_client import ElasticClient
from tandem.runtime.ps.server import ParameterServer

__all__ = ["ElasticClient", "ElasticServer", "ParameterServer", "ParameterServerClient",
           "elastic_update"]
