"""The synchronization strategy a data-parallel worker of a job runs, by the type of its plan's
sync spec.

Usage::

    strategy = build_strategy(job, rank=0, world_size=4)
    module = strategy.wrap(model, device)
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.runtime.learning_rate import scaled_lr
from tandem.runtime.job import Job
from tandem.runtime.ps import ElasticClient, ParameterServerClient
from tandem.spec.codec import CodecSpec
from tandem.spec.sync import (
    AllReduceSync,
    ElasticAveragingSync,
    GossipSync,
    LocalSGDSync,
    ParameterServerSync,
)
from tandem.sync import (
    AllReduce,
    AsyncGossip,
    ChocoGossip,
    ElasticAveraging,
    Gossip,
    GossipMixer,
    LocalSGD,
    SyncStrategy,
)
from tandem.sync.sharded import sharded_strategy
from tandem.topology import build_topology, mixing_matrix


def _gossip(job: Job, rank: int, world_size: int) -> SyncStrategy:
    sync = job.plan.sync
    if not isinstance(sync, GossipSync):
        raise TypeError(f"gossip needs a gossip sync spec, not {sync!r}")
    graph = build_topology(sync.topology, world_size)
    if sync.asynchronous:
        return AsyncGossip(graph, rank, job.run.seed, job.run.timeout_s)
    matrix = mixing_matrix(graph, sync.weights)
    if job.plan.compress is not None:
        return ChocoGossip(graph, matrix, rank, job.plan.compress, sync.step)
    return Gossip(GossipMixer(graph, matrix, rank))


def _elastic(job: Job, rank: int, world_size: int) -> SyncStrategy:
    """Synchronous EASGD (an allreduce among the workers), or asynchronous (with servers); the
    moving rate is ``lr * rho`` at the run's lr (scaled by ``--lr-scaling``)."""
    sync = job.plan.sync
    if not isinstance(sync, ElasticAveragingSync):
        raise TypeError(f"easgd needs an elastic-averaging sync spec, not {sync!r}")
    if sync.mode.asynchronous:
        return ElasticClient(job.plan.num_servers, sync.period, rank=rank,
                             num_workers=world_size, timeout_s=job.run.timeout_s)
    return ElasticAveraging(sync.period, sync.rho, scaled_lr(job.run))


def _codec(job: Job) -> CodecSpec | None:
    return job.plan.compress


SYNC_STRATEGIES: dict[type, Callable[[Job, int, int], SyncStrategy]] = {
    AllReduceSync: lambda job, rank, world: AllReduce(_codec(job)),
    ParameterServerSync: lambda job, rank, world: ParameterServerClient(
        job.plan.num_servers, job.plan.compress, rank=rank, num_workers=world,
        timeout_s=job.run.timeout_s),
    GossipSync: _gossip,
    ElasticAveragingSync: _elastic,
    LocalSGDSync: lambda job, rank, world: LocalSGD(job.plan.sync.period),  # type: ignore[union-attr]
}
"""Sync-spec type -> the strategy a data-parallel worker runs for it."""


def build_strategy(job: Job, rank: int, world_size: int) -> SyncStrategy:
    """The synchronization strategy of ``job``'s plan for worker ``rank`` of ``world_size``
    (allreduce's sharded data parallelism with a shard degree above 1)."""
    plan = job.plan
    if plan.sharded:
        strategy = sharded_strategy(plan.shard_degree, plan.shard_level, plan.shard_units,
                                    job.run.precision, offload=job.run.offload is not None)
    else:
        strategy = SYNC_STRATEGIES[type(plan.sync)](job, rank, world_size)
    strategy.find_unused_parameters = job.run.find_unused_parameters
    strategy.memory_limit = job.run.memory_limit_bytes()
    return strategy
