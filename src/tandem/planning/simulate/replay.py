"""The discrete-event core of the simulator: replay a schedule's actions on a cost model.

Usage::

    run = replay(schedule, workload, cluster, num_steps=2)
    run.step_ends[0], run.events

It follows the pipeline engine's rules (``tandem.runtime.pipeline.engine``): a worker runs its
actions in order; posting a receive or a send takes no time; a transfer starts once both ends
have posted it and the ports it needs are free (first come, first served); a forward or
backward waits for the transfer of its input; an allreduce starts when every replica of the
stage has reached it and blocks them until it ends; at the end of a step a worker waits for its
sends to arrive (``finish_sends``) and starts the next step. With DDP's overlap on
(``Workload.buckets``), a stage's allreduce is split into buckets that start as soon as the
backward of every replica has produced their gradients, each after the previous bucket.

With a gradient codec (``Workload.codec_s``, ``Workload.bucket_codec_s``) a sync also encodes
before its collectives and decodes after them. Encoding and decoding are compute on the
worker's device, which does one thing at a time (one stream, as DDP's hooks run on the stream of
the backward), while collectives run beside it (as NCCL's own stream does): a bucket's encode
runs as soon as its gradients are ready and pushes the rest of the backward back, its collective
starts when the encode and the previous bucket's collective are done, and its decode runs when
the collective ends, before any backward left (see :func:`overlapped_sync_s`). A blocking sync
encodes, exchanges and decodes one after the other.

Events are processed in time order (a heap of worker wake-up times), so ports are granted in
the order transfers become ready. Each recorded event is named by its action's text (``1F3``,
``2RA3<1``, ``0AR``), as the runtime's trace names them, so that predicted and measured
timelines can be laid side by side.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from tandem.cluster import Cluster
from tandem.planning.simulate.collectives import link_level, port, unit_sizes
from tandem.schedule import Kind, Schedule
from tandem.timeline import Event

_F, _B, _SA, _RA, _SG, _RG, _AR, _ST = range(8)
_CODE = {Kind.FORWARD: _F, Kind.BACKWARD: _B, Kind.SEND_ACT: _SA, Kind.RECV_ACT: _RA,
         Kind.SEND_GRAD: _SG, Kind.RECV_GRAD: _RG, Kind.ALLREDUCE: _AR, Kind.STEP: _ST}
_ACT, _GRAD = 0, 1

_Transfer = tuple[int, int, int, int, int | None]
"""A point-to-point message: (step, sender, receiver, ``_ACT`` or ``_GRAD``, micro-batch)."""
_Message = list[Any]
"""A transfer's ``[send posted, receive posted, arrival (None until booked), bytes]``."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """What each action costs, per stage (durations already scaled to the micro-batch and the
    device speed)."""

    forward_s: Sequence[float]
    """Seconds of one forward of one micro-batch."""
    backward_s: Sequence[float]
    step_s: Sequence[float]
    """Seconds of one optimizer step."""
    output_bytes: Sequence[float]
    """Bytes of one micro-batch's activation sent to the next stage (and of the gradient sent
    back from it)."""
    stash_bytes: Sequence[float]
    """Activation bytes one micro-batch keeps from its forward to its backward."""
    allreduce_s: Sequence[float]
    """Seconds of one blocking allreduce of the stage's gradients among its replicas."""
    buckets: Sequence[Sequence[tuple[float, float]]] | None = None
    """With DDP's overlap: per stage, ``(seconds into the backward when the bucket is ready,
    seconds of its allreduce)`` in order; None for blocking allreduces."""
    devices: Sequence[int]
    """Device of each worker."""
    send_overhead_s: float = 0.0
    """Seconds a worker spends posting a send."""
    codec_s: Sequence[tuple[float, float]] | None = None
    """With a gradient codec: per stage, ``(encode, decode)`` seconds of a blocking sync."""
    bucket_codec_s: Sequence[Sequence[tuple[float, float]]] | None = None
    """With a gradient codec and DDP's overlap: per stage and bucket, ``(encode, decode)``
    seconds."""
    tensor_s: Sequence[tuple[float, float]] | None = None
    """With tensor parallelism: per stage, the seconds of ``forward_s`` and of ``backward_s``
    spent in the tensor group's allreduces (accounted as communication, not busy time)."""
    recompute_bytes: Sequence[float] | None = None
    """With recomputation: per stage, the activation bytes of one micro-batch held on top of
    ``stash_bytes`` (then only the stage's input) while its backward recomputes the forward."""


@dataclasses.dataclass(kw_only=True, slots=True)
class Replay:
    """Raw results of a replay; :mod:`tandem.planning.simulate.simulator` turns them into metrics."""

    step_ends: list[list[float]]
    """Per worker, the time each of its steps ended (after its sends arrived)."""
    busy_s: list[dict[int, float]]
    """Per worker, compute seconds per step (flush) or per minibatch (``pipedream``)."""
    communication_s: list[dict[int, float]]
    """Per worker, seconds of the transfers it sent or received and of its collectives, keyed
    like ``busy_s``."""
    peak_activation_bytes: list[float]
    """Per worker, the most activation bytes held at once."""
    peak_stashed_versions: list[int]
    """Per worker, the most weight versions kept besides the current one (``pipedream``)."""
    done_s: dict[int, float]
    """``pipedream``: time each minibatch's update ended on stage 0."""
    events: list[Event]
    """The timeline, when recorded."""
    codec_s: list[dict[int, float]] = dataclasses.field(default_factory=list)
    """Per worker, encode and decode seconds of a gradient codec, keyed like ``busy_s``."""


class _Stalled(RuntimeError):
    """The replay cannot go on: the schedule would hang (the checker rejects such schedules)."""


def replay(schedule: Schedule, workload: Workload, cluster: Cluster, *, num_steps: int = 1,
           record: bool = True) -> Replay:
    """Run ``num_steps`` copies of ``schedule`` back to back on every worker."""
    return _Replayer(schedule, workload, cluster, num_steps, record).run()


class _Replayer:
    def __init__(self, schedule: Schedule, workload: Workload, cluster: Cluster,
                 num_steps: int, record: bool) -> None:
        self.schedule, self.work, self.cluster = schedule, workload, cluster
        self.num_steps, self.record = num_steps, record
        self.pipedream = schedule.kind.asynchronous
        self.num_workers = schedule.num_workers
        self.stage_of = [schedule.stage_of(w)[0] for w in range(self.num_workers)]
        self.first_worker = [schedule.worker_of(s, 0) for s in range(schedule.num_stages)]
        self.actions = [[(_CODE[a.kind], a.microbatch, a.peer) for a in actions]
                        for actions in schedule.workers]
        self.names = ([[str(a) for a in actions] for actions in schedule.workers]
                      if record else [])
        """Event names: each action's text, as the runtime's trace names them (when recording)."""
        self.receive_names: dict[_Transfer, str] = {}
        self.sizes = unit_sizes(cluster)
        self.heap: list[tuple[float, int, int]] = []
        self.counter = 0
        self.pc = [0] * self.num_workers
        self.step = [0] * self.num_workers
        self.waiting: dict[_Transfer, int] = {}
        self.messages: dict[_Transfer, _Message] = {}
        self.unbooked = [0] * self.num_workers
        self.sends_arrive = [0.0] * self.num_workers
        self.parked_for_sends = [False] * self.num_workers
        self.collectives: dict[tuple[int, int, int], list[tuple[int, float]]] = defaultdict(list)
        self.num_ar = [0] * self.num_workers
        self.backward_start = [0.0] * self.num_workers
        self.port_free: dict[int, float] = defaultdict(float)
        self.routes: dict[tuple[int, int], tuple[int, int, float, float]] = {}
        self.last_stage = len(workload.forward_s) - 1
        self.activation = [0.0] * self.num_workers
        self.version = [0] * self.num_workers
        self.pinned: list[dict[int, int]] = [{} for _ in range(self.num_workers)]
        self.version_count: list[dict[int, int]] = [defaultdict(int) for _ in range(self.num_workers)]
        self.out = Replay(
            step_ends=[[] for _ in range(self.num_workers)],
            busy_s=[defaultdict(float) for _ in range(self.num_workers)],
            communication_s=[defaultdict(float) for _ in range(self.num_workers)],
            peak_activation_bytes=[0.0] * self.num_workers,
            peak_stashed_versions=[0] * self.num_workers, done_s={}, events=[],
            codec_s=[defaultdict(float) for _ in range(self.num_workers)],
        )

    def run(self) -> Replay:
        for worker in range(self.num_workers):
            self._push(0.0, worker)
        while self.heap:
            now, _, worker = heapq.heappop(self.heap)
            self._advance(worker, now)
        stuck = [w for w in range(self.num_workers) if len(self.out.step_ends[w]) < self.num_steps]
        if stuck:
            raise _Stalled(f"workers {stuck[:8]} never finish: the schedule would hang")
        return self.out

    def _push(self, when: float, worker: int) -> None:
        self.counter += 1
        heapq.heappush(self.heap, (when, self.counter, worker))

    def _key(self, worker: int, m: int | None) -> int:
        """What busy and communication times are accounted under: the step or the minibatch."""
        return m if self.pipedream and m is not None else self.step[worker]

    def _name(self, worker: int, index: int) -> str:
        """The text of the worker's ``index``-th action ("" when not recording)."""
        return self.names[worker][index] if self.record else ""

    def _event(self, worker: int, name: str, start: float, end: float, m: int | None,
               num_bytes: float = 0.0, version: int = -1) -> None:
        if self.record:
            step = m if self.pipedream and m is not None else self.step[worker]
            self.out.events.append(Event(worker=worker, name=name, start_s=start, end_s=end,
                                         step=step, bytes=int(num_bytes), version=version))

    # -- one worker ------------------------------------------------------------------------------

    def _advance(self, w: int, now: float) -> None:
        """Run worker ``w``'s actions from time ``now`` until it waits or its clock moves on."""
        actions = self.actions[w]
        pc = self.pc
        while True:
            if pc[w] == len(actions):
                if not self._end_step(w, now):
                    return
                if self.step[w] == self.num_steps:
                    return
                continue
            code, m, peer = actions[pc[w]]
            if code <= _B:  # _F or _B
                assert m is not None  # a forward or backward names its micro-batch
                self._compute(w, now, code, m)
                return
            if code == _RA or code == _RG:
                assert peer is not None  # a send or receive names its peer
                key: _Transfer = (self.step[w], peer, w, _ACT if code == _RA else _GRAD, m)
                if self.record:
                    self.receive_names[key] = self.names[w][pc[w]]
                self._post(w, now, key, receiving=True)
            elif code == _SA or code == _SG:
                assert peer is not None
                key = (self.step[w], w, peer, _ACT if code == _SA else _GRAD, m)
                end = now + self.work.send_overhead_s
                message = self._post(w, now, key, receiving=False)
                if self.record:
                    self._event(w, self._name(w, pc[w]), now, end, m, message[3])
                if end > now:
                    pc[w] += 1
                    self._push(end, w)
                    return
            elif code == _AR:
                pc[w] += 1
                self._allreduce(w, now, m)
                return
            else:
                end = now + self.work.step_s[self.stage_of[w]]
                self._event(w, self._name(w, pc[w]), now, end, m)
                self.out.busy_s[w][self._key(w, m)] += end - now
                self._update_versions(w, m, end)
                pc[w] += 1
                self._push(end, w)
                return
            pc[w] += 1

    def _end_step(self, w: int, now: float) -> bool:
        """Wait for the worker's sends (``finish_sends``); True once its step is over."""
        if self.unbooked[w]:
            self.parked_for_sends[w] = True
            return False
        end = max(now, self.sends_arrive[w])
        if end > now:
            self._push(end, w)
            self.sends_arrive[w] = 0.0
            return False
        self.out.step_ends[w].append(now)
        self.step[w] += 1
        self.pc[w] = 0
        self.num_ar[w] = 0
        return True

    def _compute(self, w: int, now: float, code: int, m: int) -> None:
        stage = self.stage_of[w]
        work = self.work
        forward = code == _F
        start = now
        if stage > 0 if forward else stage < self.last_stage:
            neighbour = stage - 1 if forward else stage + 1
            peer = self.first_worker[neighbour] + m % self.schedule.replicas[neighbour]
            key = (self.step[w], peer, w, _ACT if forward else _GRAD, m)
            message = self.messages[key]
            if message[2] is None:
                self.waiting[key] = w
                return
            del self.messages[key]
            start = max(now, message[2])
            if self.record:
                self._event(w, self.receive_names.pop(key), message[1], start, m, message[3])
        duration = (work.forward_s if forward else work.backward_s)[stage]
        end = start + duration
        if self.pipedream or self.record:
            version = self._pin(w, code, m)
            self._event(w, self._name(w, self.pc[w]), start, end, m, version=version)
        account = m if self.pipedream else self.step[w]
        tensor = work.tensor_s[stage][not forward] if work.tensor_s else 0.0
        self.out.busy_s[w][account] += duration - tensor
        if tensor:
            self.out.communication_s[w][account] += tensor
        peaks = self.out.peak_activation_bytes
        if forward:
            self.activation[w] += work.stash_bytes[stage]
            peaks[w] = max(peaks[w], self.activation[w])
        else:
            if work.recompute_bytes is not None:
                peaks[w] = max(peaks[w], self.activation[w] + work.recompute_bytes[stage])
            self.activation[w] -= work.stash_bytes[stage]
            self.backward_start[w] = start
        self.pc[w] += 1
        self.counter += 1
        heapq.heappush(self.heap, (end, self.counter, w))

    # -- weight versions (PipeDream) ----------------------------------------------------------------

    def _pin(self, w: int, code: int, m: int) -> int:
        if not self.pipedream:
            return -1
        if code == _F:
            self.pinned[w][m] = self.version[w]
            self.version_count[w][self.version[w]] += 1
            return self.version[w]
        version = self.pinned[w].pop(m)
        self.version_count[w][version] -= 1
        if not self.version_count[w][version]:
            del self.version_count[w][version]
        return version

    def _update_versions(self, w: int, m: int | None, end: float) -> None:
        if not self.pipedream:
            return
        self.version[w] += 1
        self.out.peak_stashed_versions[w] = max(self.out.peak_stashed_versions[w],
                                                len(self.version_count[w]))
        if self.stage_of[w] == 0 and m is not None:
            self.out.done_s[m] = end

    # -- communication -------------------------------------------------------------------------------

    def _post(self, w: int, now: float, key: _Transfer, *, receiving: bool) -> _Message:
        """Post one end of a transfer; ``[send posted, receive posted, arrival, bytes]``."""
        message = self.messages.get(key)
        if message is None:
            stage = min(self.stage_of[key[1]], self.stage_of[key[2]])
            message = self.messages[key] = [None, None, None, self.work.output_bytes[stage]]
        message[1 if receiving else 0] = now
        if not receiving:
            self.unbooked[w] += 1
        if message[0] is not None and message[1] is not None:
            self._book(key, message, now)
        return message

    def _book(self, key: _Transfer, message: _Message, now: float) -> None:
        """Both ends posted: the transfer takes its ports when they are free."""
        step, src, dst, tensor, m = key
        route = self.routes.get((src, dst))
        if route is None:
            route = self.routes[src, dst] = self._route(src, dst)
        out_port, in_port, bandwidth_Bps, latency_s = route
        num_bytes = message[3]
        port_free = self.port_free
        start = max(now, port_free[out_port], port_free[in_port])
        busy_until = start + num_bytes / bandwidth_Bps
        port_free[out_port] = port_free[in_port] = busy_until
        message[2] = arrival = busy_until + latency_s
        account = m if self.pipedream and m is not None else step
        for worker in (src, dst):
            self.out.communication_s[worker][account] += arrival - start
        self.unbooked[src] -= 1
        self.sends_arrive[src] = max(self.sends_arrive[src], arrival)
        if self.parked_for_sends[src] and not self.unbooked[src]:
            self.parked_for_sends[src] = False
            self._push(now, src)
        waiter = self.waiting.pop(key, None)
        if waiter is not None:
            self._push(max(now, arrival), waiter)

    def _route(self, src: int, dst: int) -> tuple[int, int, float, float]:
        """The ports a transfer from worker ``src`` to ``dst`` takes, and its link's bandwidth
        and latency."""
        a, b = self.work.devices[src], self.work.devices[dst]
        level = link_level(self.cluster, a, b, self.sizes)
        spec = self.cluster.levels[level]
        return (port(level, a, self.sizes), -1 - port(level, b, self.sizes), spec.bandwidth_Bps,
                spec.latency_s)

    def _allreduce(self, w: int, now: float, m: int | None) -> None:
        stage = self.stage_of[w]
        key = (self.step[w], stage, self.num_ar[w])
        self.num_ar[w] += 1
        arrived = self.collectives[key]
        arrived.append((w, now))
        if len(arrived) < self.schedule.replicas[stage]:
            return
        del self.collectives[key]
        end, cost, codec = self._collective_end(stage, arrived)
        for worker, reached in arrived:
            finish = max(end, reached)
            index = self.pc[worker] - 1  # the worker's own AR (replicas pair k-th with k-th)
            self._event(worker, self._name(worker, index), reached, finish,
                        self.actions[worker][index][1])
            self.out.communication_s[worker][self._key(worker, m)] += cost
            if codec:
                self.out.codec_s[worker][self._key(worker, m)] += codec
            self._push(finish, worker)

    def _collective_end(self, stage: int,
                        arrived: list[tuple[int, float]]) -> tuple[float, float, float]:
        """When the stage's gradient sync ends, how long its collectives ran (buckets with
        DDP's overlap), and its encode and decode seconds."""
        last = max(reached for _, reached in arrived)
        if self.work.buckets is None:
            cost = self.work.allreduce_s[stage]
            encode, decode = self.work.codec_s[stage] if self.work.codec_s else (0.0, 0.0)
            return last + encode + cost + decode, cost, encode + decode
        started = max(self.backward_start[worker] for worker, _ in arrived)
        buckets = self.work.buckets[stage]
        cost = sum(bucket_s for _, bucket_s in buckets)
        if self.work.bucket_codec_s is not None:
            codec = self.work.bucket_codec_s[stage]
            end = started + overlapped_sync_s(self.work.backward_s[stage], buckets, codec)
            return end, cost, sum(encode + decode for encode, decode in codec)
        end = 0.0
        for offset_s, bucket_s in buckets:
            end = max(started + offset_s, end) + bucket_s
        return end, cost, 0.0


def overlapped_sync_s(backward_s: float, buckets: Sequence[tuple[float, float]],
                      codec: Sequence[tuple[float, float]]) -> float:
    """Seconds from the start of a backward of ``backward_s`` until it is over and every
    bucket is exchanged and decoded, with DDP's overlap and a codec.

    ``buckets`` are ``(backward seconds until ready, collective seconds)`` and ``codec`` their
    ``(encode, decode)`` seconds. The device runs one thing at a time: encodes and decodes take
    it in the order they become due (an encode when the backward has produced its bucket, a
    decode when its collective ends) and the backward fills the time between them;
    collectives run one after another beside it.
    """
    due: list[tuple[float, int, float, int]] = []  # (since, order, seconds, bucket or -1 - bucket)
    now = done = comm_free = 0.0
    order = next_bucket = 0
    while True:
        while next_bucket < len(buckets) and done >= min(buckets[next_bucket][0], backward_s):
            heapq.heappush(due, (now, order, codec[next_bucket][0], next_bucket))
            order, next_bucket = order + 1, next_bucket + 1
        if due and due[0][0] <= now:
            _, _, seconds, task = heapq.heappop(due)
            now += seconds
            if task >= 0:  # an encode: its collective, then its decode
                comm_free = max(now, comm_free) + buckets[task][1]
                heapq.heappush(due, (comm_free, order, codec[task][1], -1 - task))
                order += 1
            continue
        upcoming = due[0][0] if due else float("inf")
        if done < backward_s:
            target = buckets[next_bucket][0] if next_bucket < len(buckets) else backward_s
            target = min(target, backward_s)
            if upcoming - now < target - done:
                done, now = done + (upcoming - now), upcoming
            else:
                done, now = target, now + (target - done)
            continue
        if not due:
            return now
        now = upcoming
