"""Parameter-server training, both sides: the servers (runtime workers that hold the model's
shards) and their workers' clients (sync strategies), with the messages between them.

Modules: :mod:`~tandem.runtime.ps.protocol` (messages, shards, codecs on the wire),
:mod:`~tandem.runtime.ps.client` and :mod:`~tandem.runtime.ps.elastic_client` (the workers'
side), :mod:`~tandem.runtime.ps.server` and :mod:`~tandem.runtime.ps.elastic` (the servers).
"""

from __future__ import annotations

from tandem.runtime.ps.client import ParameterServerClient
from tandem.runtime.ps.elastic import ElasticServer, elastic_update
from tandem.runtime.ps.elastic_client import ElasticClient
from tandem.runtime.ps.server import ParameterServer

__all__ = ["ElasticClient", "ElasticServer", "ParameterServer", "ParameterServerClient",
           "elastic_update"]
