"""Parameter servers in the simulator: pushes, incast at the servers' ports, updates and pulls.

Usage::

    plan = Plan(..., sync=ParameterServerSync(servers=1, mode="async"))
    result = simulate_ps(plan, profile, cluster, SimOptions())     # simulate() calls it
    result.step_time_s, result.updates_per_s, result.step_meaning

It follows ``tandem.runtime.ps.server`` and ``tandem.runtime.ps.client``. Servers are ranks
``0..S-1`` on devices ``0..S-1`` and hold the model in ``S`` shards of whole layers (near-equal
sizes, as ``shard_ranges`` cuts them); the workers follow. Each step a worker runs its
forwards and backwards, encodes its gradient (with a codec), pushes shard ``s`` to server ``s``
(its sends leave one after another through its port) and waits for every server's reply. A
server handles one message at a time, ``server_message_s`` each plus decoding, and then:

- ``sync``: once the step's pushes are in (with ``backup`` workers the first ``W - b``; a push
  for a step already applied is dropped and answered at once), it applies their mean (one
  optimizer step over its shard: bytes / ``optimizer_Bps``) and replies to those workers, one
  reply after another through its port;
- ``async``: it applies each push on arrival and replies to that worker at once;
- ``ssp``: as ``async``, but a worker more than ``staleness`` pushes ahead of the slowest
  unfinished worker gets its reply only once the slowest catches up.

All pushes to a server share its incoming port (incast): with ``W`` workers the ``W`` pushes of
a step take ``W P / (S B)`` there; the replies share its outgoing port alike. Replies carry
float32 parameters, or the codec's payloads (difference tracking; the first, exact reply of a
run is not simulated).

Step time: ``sync`` — seconds between the servers' updates (every worker's step); ``async`` and
``ssp`` — a worker's mean time between its own consecutive updates (``updates_per_s`` counts
all workers' updates of the model).
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections import Counter, deque

from tandem.cluster import Cluster
from tandem.plan import Plan
from tandem.planning.simulate.families import STEPS, Clock, Costs, Network, Records, family_costs, family_result
from tandem.planning.simulate.result import SimOptions, SimResult
from tandem.profile import ModelProfile
from tandem.schedule import Kind
from tandem.spec.sync import ParameterServerSync


def shard_tensors(sizes: list[float], num_shards: int) -> list[list[float]]:
    """``sizes`` (in order) cut into ``num_shards`` contiguous runs of near-equal total, as the
    runtime shards parameters over servers (trailing shards empty when there are fewer tensors)."""
    prefix = list(itertools.accumulate(sizes, initial=0.0))
    total = prefix[-1]
    cuts = [bisect.bisect_left(prefix, total * k / num_shards) for k in range(1, num_shards)]
    bounds = [0, *(min(cut, len(sizes)) for cut in cuts), len(sizes)]
    return [sizes[a:b] for a, b in itertools.pairwise(bounds)]


def simulate_ps(plan: Plan, profile: ModelProfile, cluster: Cluster,
                options: SimOptions) -> SimResult:
    """Simulate a parameter-server plan (see the module docstring); a ``SimResult``."""
    assert isinstance(plan.sync, ParameterServerSync)
    costs = family_costs(plan, profile, cluster, options)
    run = _Run(costs, cluster, plan.sync, options.record)
    run.clock.run()
    workers = range(run.num_servers, run.num_servers + run.num_workers)
    times = run.update_times[0]
    first, last = max(1, len(times) // 3), max(2, 2 * len(times) // 3)
    last = min(last, len(times) - 1)
    per_update = (times[last] - times[first]) / max(1, last - first)
    if not plan.sync.mode.asynchronous:
        step = per_update
        meaning = (f"seconds between the servers' updates: every worker's step (compute, push, "
                   f"the update of {'the first ' + str(run.required) + ' pushes' if plan.sync.backup else 'all pushes'}, pull)")
    else:
        step = sum(run.records.interval(w) for w in workers) / run.num_workers
        meaning = ("a worker's mean time between its own updates (compute, push, pull); the "
                   "servers apply every push, updates_per_s of them in all")
    return family_result(plan, profile, cluster, costs, run.records, step_s=step, meaning=meaning,
                         updates_per_s=1.0 / per_update if per_update > 0 else 0.0,
                         server_steps=range(first, last), batch_scale=options.batch_scale,
                         per_worker=plan.sync.mode.asynchronous)


class _Run:
    """The event-driven run of every worker and server."""

    def __init__(self, costs: Costs, cluster: Cluster, sync: ParameterServerSync,
                 record: bool) -> None:
        self.costs, self.sync = costs, sync
        self.num_servers, self.num_workers = len(costs.servers), len(costs.workers)
        self.required = 1 if sync.mode.asynchronous else self.num_workers - sync.backup
        self.shards = shard_tensors(costs.tensor_bytes, self.num_servers)
        self.shard_bytes = [sum(shard) for shard in self.shards]
        self.message_bytes = [costs.payload_bytes(shard) for shard in self.shards]
        self.clock, self.network = Clock(), Network(cluster)
        self.records = Records(num_processes=self.num_servers + self.num_workers, record=record)
        self.version = [0] * self.num_servers
        self.update_times: list[list[float]] = [[] for _ in range(self.num_servers)]
        self.queue: list[deque[tuple[int, int, float]]] = [deque() for _ in range(self.num_servers)]
        self.idle = [True] * self.num_servers
        self.waiting: list[list[int]] = [[] for _ in range(self.num_servers)]
        self.pushes: list[Counter[int]] = [Counter() for _ in range(self.num_servers)]
        self.finished: set[int] = set()
        self.done: Counter[int] = Counter()
        self.next_step: Counter[int] = Counter()
        self.pending: Counter[int] = Counter()
        self.pushed_at: dict[int, float] = {}
        if sync.backup >= self.num_workers:
            from tandem.errors import UsageError

            raise UsageError(f"--backup {sync.backup} leaves no push to apply among "
                             f"{self.num_workers} workers; use at most {self.num_workers - 1}")
        for worker in range(self.num_workers):
            self.clock.at(0.0, functools.partial(self._start, worker))

    def _rank(self, worker: int) -> int:
        return self.num_servers + worker

    # -- workers ---------------------------------------------------------------------------------

    def _start(self, worker: int, now: float) -> None:
        rank, step = self._rank(worker), self.done[worker]
        end = self.records.compute(rank, self.costs, now, step)
        encode = self.costs.encode_s(self.costs.tensor_bytes)
        self.records.codec[rank][step] += encode
        self.clock.at(end + encode, lambda t: self._push(worker, t))

    def _push(self, worker: int, now: float) -> None:
        rank, step = self._rank(worker), self.done[worker]
        device = self.costs.workers[worker]
        arrivals = []
        for server in range(self.num_servers):
            start, arrival = self.network.send(now, device, self.costs.servers[server],
                                               self.message_bytes[server])
            self.records.communication[rank][step] += arrival - start
            tag = self.next_step[worker]
            self.clock.at(arrival, functools.partial(self._arrive, server, worker, tag))
            arrivals.append(arrival)
        self.records.event(rank, Kind.PUSH, now, max(arrivals), step,
                           num_bytes=sum(self.message_bytes))
        self.pending[worker] = self.num_servers
        self.pushed_at[worker] = max(arrivals)

    def _pulled(self, worker: int, version: int, now: float) -> None:
        rank, step = self._rank(worker), self.done[worker]
        self.pending[worker] -= 1
        if self.pending[worker]:
            return
        decode = self.costs.decode_s(self.costs.tensor_bytes)
        self.records.codec[rank][step] += decode
        end = now + decode
        self.records.event(rank, Kind.PULL, self.pushed_at[worker], now, step,
                           num_bytes=sum(self.message_bytes))
        self.records.ends[rank].append(end)
        self.next_step[worker] = version
        self.done[worker] += 1
        if self.done[worker] < STEPS:
            self.clock.at(end, lambda t: self._start(worker, t))
            return
        self.finished.add(worker)
        for server in range(self.num_servers):
            self.clock.at(end, functools.partial(self._release, server))

    # -- servers ---------------------------------------------------------------------------------

    def _arrive(self, server: int, worker: int, tag: int, now: float) -> None:
        self.queue[server].append((worker, tag, now))
        self.records.communication[server][self.version[server]] += (
            self.message_bytes[server] / self._bandwidth(server, worker))
        if self.idle[server]:
            self._serve(server, now)

    def _bandwidth(self, server: int, worker: int) -> float:
        from tandem.planning.simulate.collectives import link_level

        level = link_level(self.network.cluster, self.costs.servers[server],
                           self.costs.workers[worker], self.network.sizes)
        return self.network.cluster.levels[level].bandwidth_Bps

    def _serve(self, server: int, now: float) -> None:
        """Handle the next queued message (the server does one thing at a time)."""
        if not self.queue[server]:
            self.idle[server] = True
            return
        self.idle[server] = False
        worker, tag, _ = self.queue[server].popleft()
        handle = self.costs.server_message_s + self.costs.decode_s(self.shards[server])
        self.records.busy[server][self.version[server]] += handle
        self.clock.at(now + handle, lambda t: self._handled(server, worker, tag, t))

    def _handled(self, server: int, worker: int, tag: int, now: float) -> None:
        if not self.sync.mode.asynchronous:
            if tag < self.version[server]:  # a backup worker's late push: dropped, answered
                now = self._reply(server, worker, now)
            else:
                self.waiting[server].append(worker)
                if len(self.waiting[server]) == self.required:
                    now = self._update(server, now)
                    for waiter in self.waiting[server]:
                        now = self._reply(server, waiter, now)
                    self.waiting[server] = []
        else:
            self.pushes[server][worker] += 1
            now = self._update(server, now)
            self.waiting[server].append(worker)
            now = self._release(server, now, serving=True)
        self.clock.at(now, lambda t: self._serve(server, t))

    def _update(self, server: int, now: float) -> float:
        seconds = self.costs.update_s(self.shard_bytes[server])
        version = self.version[server]
        self.records.busy[server][version] += seconds
        self.records.event(server, Kind.STEP, now, now + seconds, version)
        self.version[server] += 1
        self.update_times[server].append(now + seconds)
        self.records.ends[server].append(now + seconds)
        return now + seconds

    def _release(self, server: int, now: float, serving: bool = False) -> float:
        """Reply to waiting workers that bounded staleness lets go on (all of them in async);
        the time the server is done encoding those replies."""
        if not self.sync.mode.asynchronous or (not serving and not self.idle[server]):
            return now
        live = [w for w in range(self.num_workers) if w not in self.finished]
        slowest = min((self.pushes[server][w] for w in live), default=0)
        still = []
        for worker in self.waiting[server]:
            ahead = self.pushes[server][worker] - slowest
            if not self.sync.mode.bounded or ahead <= self.sync.staleness:
                now = self._reply(server, worker, now)
            else:
                still.append(worker)
        self.waiting[server] = still
        return now

    def _reply(self, server: int, worker: int, now: float) -> float:
        """Encode a reply to ``worker`` and send it when encoded; when the encoding ends."""
        encode = self.costs.encode_s(self.shards[server])
        version = self.version[server]
        self.records.busy[server][max(0, version - 1)] += encode
        ready = now + encode
        self.clock.at(ready, lambda t: self._send_reply(server, worker, version, t))
        return ready

    def _send_reply(self, server: int, worker: int, version: int, now: float) -> None:
        start, arrival = self.network.send(now, self.costs.servers[server],
                                           self.costs.workers[worker], self.message_bytes[server])
        self.records.communication[self._rank(worker)][self.done[worker]] += arrival - start
        self.records.communication[server][max(0, version - 1)] += arrival - start
        self.clock.at(arrival, lambda t: self._pulled(worker, version, t))
