"""The fastest plan of each synchronization family, which ``tandem search`` reports beside the
best allreduce or pipeline plan of its Metropolis–Hastings search.

Usage::

    best = best_of_families(profile, cluster, sim)
    best["ps"].plan.sync, best["ps"].result.step_time_s

Each family is one stage on the cluster's devices, tried over a small grid of its options:

- ``ps``: ``sync`` and ``async`` with 1, 2, 4, ... servers (up to half the devices), the other
  devices training;
- ``gossip``: D-PSGD on ``ring``, ``torus``, ``exponential`` and ``complete`` topologies, and
  AD-PSGD on a ring (an even number of workers);
- ``localsgd`` and ``easgd``: averaging every ``period`` steps (4, as ``tandem train``).

The families are compared on time per step only (for the asynchronous ones a worker's time
between its updates): the simulator does not model convergence, and stale updates (async
servers), disagreeing workers (gossip, local SGD, EASGD) or longer periods usually need more
steps than a synchronous method. That is why the search does not mix them into its own chain
and reports them apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from tandem.cluster import Cluster
from tandem.errors import UsageError
from tandem.plan import Plan
from tandem.planning.search.flexflow import Candidate
from tandem.planning.simulate.simulator import SimOptions, data_parallel_plan, simulate
from tandem.profile import ModelProfile
from tandem.spec.kinds import PsMode
from tandem.spec.trainable import staleness
from tandem.spec.sync import (
    SYNC_METHODS,
    ElasticAveragingSync,
    GossipSync,
    LocalSGDSync,
    ParameterServerSync,
    SyncSpec,
)

PERIOD = 4
"""Averaging period of local SGD and EASGD (``tandem train``'s default)."""

Options = Iterator[tuple[SyncSpec, int]]


def _ps_options(num_devices: int) -> Options:
    servers = 1
    while servers <= num_devices // 2:
        for mode in (PsMode.SYNC, PsMode.ASYNC):
            yield ParameterServerSync(servers=servers, mode=mode), num_devices - servers
        servers *= 2


def _gossip_options(num_devices: int) -> Options:
    for topology in ("ring", "torus", "exponential", "complete"):
        yield GossipSync(topology=topology), num_devices
    if num_devices % 2 == 0 and num_devices > 1:
        yield GossipSync(topology="ring", asynchronous=True), num_devices


def _localsgd_options(num_devices: int) -> Options:
    yield LocalSGDSync(period=PERIOD), num_devices


def _easgd_options(num_devices: int) -> Options:
    yield ElasticAveragingSync(period=PERIOD), num_devices


FAMILY_OPTIONS: dict[type[SyncSpec], Callable[[int], Options]] = {
    ParameterServerSync: _ps_options, GossipSync: _gossip_options,
    LocalSGDSync: _localsgd_options, ElasticAveragingSync: _easgd_options,
}
"""Sync-spec class -> the options of it tried on a number of devices."""

FAMILIES = tuple(cls.method for cls in FAMILY_OPTIONS)
"""Families :func:`best_of_families` can try, by their methods' names."""


def family_specs(method: str, num_devices: int) -> Options:
    """``(sync spec, workers)`` of every option of ``method`` tried on ``num_devices``."""
    cls = SYNC_METHODS.get(method)
    if cls not in FAMILY_OPTIONS:
        raise UsageError(f"unknown family {method!r}; choose among: {', '.join(FAMILIES)}")
    yield from FAMILY_OPTIONS[cls](num_devices)


def best_of_families(profile: ModelProfile, cluster: Cluster, sim: SimOptions | None = None,
                     methods: tuple[str, ...] = FAMILIES,
                     batch_samples: int | None = None, *,
                     staleness_cost: float = 0.0) -> dict[str, Candidate]:
    """Per family of ``methods``, its fastest plan that fits in memory (families with none are
    left out); ``batch_samples`` rules out plans with more workers than samples.
    ``staleness_cost``: compare step times times ``(1 + staleness_cost d)`` for a plan ``d``
    updates stale (:func:`~tandem.spec.trainable.staleness`: asynchronous servers), as
    ``--objective time-to-accuracy`` does."""
    sim = dataclasses.replace(sim or SimOptions(), record=False)
    best: dict[str, Candidate] = {}

    def cost(candidate: Candidate) -> float:
        return candidate.result.step_time_s * (1 + staleness_cost * staleness(candidate.plan))

    for method in methods:
        for sync, workers in family_specs(method, cluster.num_devices):
            if batch_samples is not None and workers > batch_samples:
                continue
            plan = dataclasses.replace(data_parallel_plan(profile, workers),
                                       num_devices=cluster.num_devices, sync=sync)
            candidate = _simulated(plan, profile, cluster, sim)
            if candidate is None or not candidate.result.fits_memory:
                continue
            if method not in best or cost(candidate) < cost(best[method]):
                best[method] = candidate
    return best


def _simulated(plan: Plan, profile: ModelProfile, cluster: Cluster,
               sim: SimOptions) -> Candidate | None:
    try:
        return Candidate(plan=plan, result=simulate(plan, profile, cluster, sim))
    except UsageError:  # e.g. a torus that the device count cannot make
        return None


def describe_sync(sync: SyncSpec, workers: int) -> str:
    """``ps async, 2 servers, 14 workers`` / ``gossip ring`` / ``localsgd every 4``."""
    if isinstance(sync, ParameterServerSync):
        return f"ps {sync.mode}, {sync.servers} server(s), {workers} workers"
    if isinstance(sync, GossipSync):
        return f"gossip {sync.topology}{' (AD-PSGD)' if sync.asynchronous else ''}, {workers} workers"
    if isinstance(sync, (LocalSGDSync, ElasticAveragingSync)):
        return f"{sync.method} every {sync.period} steps, {workers} workers"
    return f"{sync.method}, {workers} workers"
