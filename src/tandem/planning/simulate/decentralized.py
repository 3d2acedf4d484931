"""Gossip, local SGD and elastic averaging in the simulator: workers that keep their own models.

Usage::

    plan = Plan(..., sync=GossipSync(topology="ring"))
    result = simulate_gossip(plan, profile, cluster, SimOptions())   # simulate() calls these
    result = simulate_averaging(plan_with_localsgd, profile, cluster, SimOptions())

- D-PSGD (``GossipSync``): every step each worker computes, then exchanges its parameters with
  every neighbour of the topology (``tandem.topology.build_topology``) and mixes them, then
  steps (``tandem.sync.gossip.Gossip``). A transfer starts when both ends have posted it, so a
  worker's exchange starts once it and its neighbours are done computing. Every port carries
  the bytes of all the edges through it (``degree x P`` for a worker alone on its device's
  port; more for a server's port that several workers' edges cross); the exchange ends when the
  busiest port of the worker's and its neighbours' edges has moved its bytes, plus a latency
  (bandwidth shared fairly: a fluid model, not a schedule of packets). With a codec
  (CHOCO-gossip) the payloads are the codec's, encoded once and decoded per neighbour and for
  the worker's own public copy.
- AD-PSGD (``GossipSync(asynchronous=True)``): the topology is two-coloured; after each step's
  compute an *active* worker sends its model to one random *passive* neighbour, which averages
  it on a background thread (one request at a time) and sends its own back; the active worker
  averages and steps. Passive workers only compute and step. Transfers queue for ports first
  come, first served. The step time is the active workers' mean time between updates.
- Local SGD (``LocalSGDSync``): workers step on their own; every ``period`` steps they allreduce
  their parameters (blocking, the cluster's collective costs). EASGD (``ElasticAveragingSync``)
  sends the same: one allreduce of the parameters' difference from the center every ``period``
  steps (``tandem.sync.averaging``), plus two elementwise passes. The step time is the mean over
  one period. Neither uses a codec (the runtime's averaging sends float32).

Mixing and averaging arithmetic take parameter bytes / ``optimizer_Bps`` per pass (free without).
"""

from __future__ import annotations

import functools
import random
from collections import defaultdict

from tandem.cluster import Cluster
from tandem.errors import UsageError
from tandem.plan import Plan
from tandem.planning.simulate.collectives import allreduce_s, link_level, port
from tandem.planning.simulate.families import STEPS, Clock, Costs, Network, Records, family_costs, family_result
from tandem.planning.simulate.result import SimOptions, SimResult
from tandem.profile import ModelProfile
from tandem.schedule import Kind
from tandem.spec.sync import ElasticAveragingSync, GossipSync, LocalSGDSync
from tandem.topology import Graph, build_topology, two_colouring


def simulate_gossip(plan: Plan, profile: ModelProfile, cluster: Cluster,
                    options: SimOptions) -> SimResult:
    """Simulate a gossip plan, D-PSGD or AD-PSGD (see the module docstring); a ``SimResult``."""
    sync = plan.sync
    assert isinstance(sync, GossipSync)
    costs = family_costs(plan, profile, cluster, options)
    graph = build_topology(sync.topology, len(costs.workers))
    records = Records(num_processes=len(costs.workers), record=options.record)
    if sync.asynchronous:
        active = _ad_psgd(graph, costs, cluster, records)
        intervals = [records.interval(w) for w in range(len(graph))]
        step = sum(intervals[w] for w in active) / max(1, len(active)) if active else max(intervals)
        rate = sum(1.0 / t for t in intervals if t > 0)
        meaning = ("an active worker's mean time between its updates (compute, send its model "
                   "to a random passive neighbour, receive that one's, average, step); passive "
                   "workers compute and step while they answer; updates_per_s counts every "
                   "worker's updates")
        return family_result(plan, profile, cluster, costs, records, step_s=step,
                             meaning=meaning, updates_per_s=rate, per_worker=True,
                             extra_weights=costs.parameter_bytes, batch_scale=options.batch_scale)
    _d_psgd(graph, costs, cluster, records)
    step = max(records.interval(w) for w in range(len(graph)))
    degree = max((len(n) for n in graph), default=0)
    return family_result(plan, profile, cluster, costs, records, step_s=step,
                         meaning="seconds per synchronous gossip round (every worker's step: "
                                 "compute, exchange with its neighbours, mix, step)",
                         updates_per_s=1.0 / step if step > 0 else 0.0,
                         extra_weights=degree * costs.parameter_bytes,
                         batch_scale=options.batch_scale)


def exchange_s(graph: Graph, costs: Costs, cluster: Cluster, num_bytes: float) -> list[float]:
    """Per worker, seconds of one D-PSGD exchange of ``num_bytes`` with every neighbour once all
    have posted it (see the module docstring's fluid model)."""
    sizes = tuple(cluster.devices_per_unit(i) for i in range(len(cluster.levels)))
    load: dict[int, float] = defaultdict(float)
    edges: dict[tuple[int, int], tuple[int, int, int]] = {}
    for a, neighbours in enumerate(graph):
        for b in neighbours:
            da, db = costs.workers[a], costs.workers[b]
            if da == db:
                continue
            level = link_level(cluster, da, db, sizes)
            out_port, in_port = port(level, da, sizes), -1 - port(level, db, sizes)
            load[out_port] += num_bytes / cluster.levels[level].bandwidth_Bps
            load[in_port] += num_bytes / cluster.levels[level].bandwidth_Bps
            edges[a, b] = (out_port, in_port, level)
    seconds = []
    for a, neighbours in enumerate(graph):
        ends = [0.0]
        for b in neighbours:
            for key in ((a, b), (b, a)):
                if key in edges:
                    out_port, in_port, level = edges[key]
                    ends.append(max(load[out_port], load[in_port])
                                + cluster.levels[level].latency_s)
        seconds.append(max(ends))
    return seconds


def _d_psgd(graph: Graph, costs: Costs, cluster: Cluster, records: Records) -> None:
    payload = costs.payload_bytes(costs.tensor_bytes)
    exchange = exchange_s(graph, costs, cluster, payload)
    encode = costs.encode_s(costs.tensor_bytes)
    start = [0.0] * len(graph)
    for step in range(STEPS):
        posted = []
        for w in range(len(graph)):
            posted.append(records.compute(w, costs, start[w], step) + encode)
            records.codec[w][step] += encode
        for w, neighbours in enumerate(graph):
            begin = max([posted[w], *(posted[j] for j in neighbours)])
            end = begin + exchange[w]
            records.event(w, Kind.EXCHANGE, begin, end, step,
                          num_bytes=len(neighbours) * payload)
            records.communication[w][step] += exchange[w]
            decode = costs.decode_s(costs.tensor_bytes, len(neighbours) + 1) if neighbours else 0.0
            records.codec[w][step] += decode
            mix = costs.update_s(len(neighbours) * costs.parameter_bytes) + costs.step_s
            records.event(w, Kind.STEP, end + decode, end + decode + mix, step)
            records.busy[w][step] += mix
            start[w] = end + decode + mix
            records.ends[w].append(start[w])




def _ad_psgd(graph: Graph, costs: Costs, cluster: Cluster, records: Records) -> list[int]:
    """Run AD-PSGD's workers; the active ones."""
    colours = two_colouring(graph)
    clock, network = Clock(), Network(cluster)
    size = costs.parameter_bytes
    handler_free = [0.0] * len(graph)
    draws = [random.Random(w) for w in range(len(graph))]  # the runtime's draws, seed 0
    done = [0] * len(graph)

    def start(w: int, now: float) -> None:
        end = records.compute(w, costs, now, done[w])
        if colours[w] == 0 and graph[w]:
            clock.at(end, lambda t: request(w, t))
        else:
            finish(w, end, end)

    def request(w: int, now: float) -> None:
        peer = draws[w].choice(sorted(graph[w]))
        begin, arrival = network.send(now, costs.workers[w], costs.workers[peer], size)
        records.communication[w][done[w]] += arrival - begin
        clock.at(arrival, lambda t: answer(w, peer, now, t))

    def answer(w: int, peer: int, asked: float, now: float) -> None:
        ready = max(now, handler_free[peer]) + costs.update_s(size)
        begin, arrival = network.send(ready, costs.workers[peer], costs.workers[w], size)
        handler_free[peer] = arrival
        records.communication[w][done[w]] += arrival - begin
        records.event(w, Kind.EXCHANGE, asked, arrival, done[w], num_bytes=size)
        clock.at(arrival, lambda t: finish(w, t, asked))

    def finish(w: int, now: float, computed: float) -> None:
        work = costs.step_s + (costs.update_s(size) if colours[w] == 0 and graph[w] else 0.0)
        records.event(w, Kind.STEP, now, now + work, done[w])
        records.busy[w][done[w]] += work
        records.ends[w].append(now + work)
        done[w] += 1
        if done[w] < STEPS:
            clock.at(now + work, lambda t: start(w, t))

    for w in range(len(graph)):
        clock.at(0.0, functools.partial(start, w))
    clock.run()
    return [w for w in range(len(graph)) if colours[w] == 0 and graph[w]]


def simulate_averaging(plan: Plan, profile: ModelProfile, cluster: Cluster,
                       options: SimOptions) -> SimResult:
    """Simulate local SGD or EASGD over one period (see the module docstring); a ``SimResult``."""
    sync = plan.sync
    assert isinstance(sync, (LocalSGDSync, ElasticAveragingSync))
    if isinstance(sync, ElasticAveragingSync) and sync.mode.asynchronous:
        raise UsageError(f"the simulator models synchronous EASGD only (this plan has --mode "
                         f"{sync.mode}, whose workers exchange with servers on their own "
                         f"clocks); simulate it with --mode sync, or --plan ps --mode async for "
                         f"the servers' traffic")
    costs = family_costs(plan, profile, cluster, options)
    costs.codec = None  # the runtime averages float32 parameters
    reduce = allreduce_s(cluster, costs.workers, costs.parameter_bytes, options.allreduce,
                         options.allreduce_latency_s)
    passes = 2 if isinstance(sync, ElasticAveragingSync) else 1
    records = Records(num_processes=len(costs.workers), record=options.record)
    for w in range(len(costs.workers)):
        now = 0.0
        for step in range(sync.period):
            now = records.compute(w, costs, now, step)
            records.event(w, Kind.STEP, now, now + costs.step_s, step)
            records.busy[w][step] += costs.step_s
            now += costs.step_s
            if step == sync.period - 1:
                records.event(w, Kind.ALLREDUCE, now, now + reduce, step,
                              num_bytes=costs.parameter_bytes)
                records.communication[w][step] += reduce
                arithmetic = passes * costs.update_s(costs.parameter_bytes)
                records.busy[w][step] += arithmetic
                now += reduce + arithmetic
            records.ends[w].append(now)
    step_s = records.ends[0][-1] / sync.period
    steps = range(sync.period)
    name = "local SGD" if isinstance(sync, LocalSGDSync) else "EASGD"
    meaning = (f"mean seconds per step over one period of {sync.period} ({name}: the workers' "
               f"parameters are {'averaged' if passes == 1 else 'pulled towards the center'} by "
               f"one allreduce every {sync.period} steps)")
    records.fixed_window = steps
    return family_result(plan, profile, cluster, costs, records, step_s=step_s, meaning=meaning,
                         updates_per_s=1.0 / step_s if step_s > 0 else 0.0,
                         extra_weights=costs.parameter_bytes if passes == 2 else 0.0,
                         batch_scale=options.batch_scale)
