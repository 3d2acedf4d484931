"""Check a schedule before anything runs: dry-run every worker and reject deadlocks and mistakes.

Usage::

    from tandem.schedule import check, grid, one_f_one_b

    schedule = one_f_one_b([1, 1], 3)
    check(schedule)        # raises ScheduleError, with the step x worker grid, if invalid
    print(grid(schedule))  # one row per step of the dry run, one column per worker

The dry run follows the engine's rules. A send never blocks (it is buffered, like ``isend``);
a receive never blocks (it is posted, like ``irecv``); the forward or backward that consumes a
received tensor waits until the matching send has run; an allreduce waits until every replica
of its stage has reached it (the ``k``-th ``AR`` of each replica pair up); everything else is
local. Sends and receives between two workers match in the order they are issued (as NCCL and
gloo match them), separately for each direction. Each step of the dry run, every worker whose
next action can run runs it (an action that a step enables runs at the next step).

Besides hangs it rejects schedules that would run and train wrongly: a worker that never
steps, steps twice, or steps before its replicas have averaged their gradients (the rules are in
``updates.py``).

What it does not model: time (a step is not a duration: the simulator gives durations),
memory, and buffering limits. NCCL serializes the point-to-point operations between two ranks
on one stream whatever their direction, so an engine on NCCL must keep the two directions on
separate communicators (or group them) for these rules to hold.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

from tandem.errors import UsageError
from tandem.schedule.action import Action, Kind
from tandem.schedule.schedule import Schedule
from tandem.schedule.updates import update_problems

Site = tuple[int, int]
"""``(worker, index)`` of one action in a schedule."""

_Key = tuple[str, int | None]
"""What a send or receive carries: ``("activation" | "gradient", micro-batch)``."""

_WAIT, _DONE = -1, -2
_MAX_LISTED = 12
_TENSOR = {Kind.SEND_ACT: "activation", Kind.RECV_ACT: "activation",
           Kind.SEND_GRAD: "gradient", Kind.RECV_GRAD: "gradient"}


class ScheduleError(UsageError):
    """A schedule that would deadlock or is malformed; the message shows the step x worker
    grid of its dry run with the bad actions marked ``*like this*``."""


def check(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless every worker can run its actions to the end."""
    analysis = _analyze(schedule)
    run = _dry_run(schedule, analysis)
    problems = analysis.problems + _deadlock(schedule, analysis, run)
    if problems:
        raise ScheduleError(_report(schedule, problems, run))


def dry_run_times(schedule: Schedule) -> list[list[int]]:
    """For every worker, the dry-run step at which each of its actions runs.

    Cutting all workers at the same dry-run step gives a consistent cut of a valid execution:
    no action before the cut waits for one after it. Raises :class:`ScheduleError` if invalid.
    """
    check(schedule)
    run = _dry_run(schedule, _analyze(schedule))
    times = [[0] * len(actions) for actions in schedule.workers]
    for step, row in enumerate(run.rows):
        for worker, index in enumerate(row):
            if index >= 0:
                times[worker][index] = step
    return times


def grid(schedule: Schedule) -> str:
    """The step x worker table of the dry run: one row per step, one column per worker.

    A cell is the action a worker runs at that step, ``.`` while it waits, empty once it is
    done. If the dry run gets stuck, the remaining actions follow, the stuck ones marked.
    """
    analysis = _analyze(schedule)
    run = _dry_run(schedule, analysis)
    marks = {(w, run.position[w]) for w in run.stuck}
    return _table(schedule, run, marks)


# -- static analysis ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class _Problem:
    message: str
    marks: tuple[Site, ...] = ()


@dataclasses.dataclass(slots=True)
class _Analysis:
    problems: list[_Problem] = dataclasses.field(default_factory=list)
    consumes: dict[Site, int] = dataclasses.field(default_factory=dict)
    """Compute site -> index of the receive (same worker) whose tensor it consumes."""
    sent_by: dict[Site, Site] = dataclasses.field(default_factory=dict)
    """Receive site -> the send site it matches (the transport's order-based matching)."""
    collective: dict[Site, tuple[Site, ...]] = dataclasses.field(default_factory=dict)
    """AR site -> the AR sites of all replicas that it pairs up with."""

    def add(self, message: str, *marks: Site) -> None:
        self.problems.append(_Problem(message, marks))

    def waits_for(self, site: Site) -> Site | None:
        """The send a compute waits for (None if it has no matching send)."""
        return self.sent_by.get((site[0], self.consumes[site]))


def _analyze(schedule: Schedule) -> _Analysis:
    analysis = _Analysis()
    for worker in range(schedule.num_workers):
        _walk_worker(schedule, worker, analysis)
        for message, marks in update_problems(schedule, worker):
            analysis.add(message, *marks)
    _match_pairs(schedule, analysis)
    _count_computes(schedule, analysis)
    _match_collectives(schedule, analysis)
    return analysis


def _walk_worker(schedule: Schedule, worker: int, analysis: _Analysis) -> None:
    """Checks that need only one worker's list: its stage, peers, and local data flow."""
    stage, _ = schedule.stage_of(worker)
    posted: dict[tuple[Kind, int | None], int] = {}
    done: dict[Kind, set[int]] = {Kind.FORWARD: set(), Kind.BACKWARD: set()}
    for index, action in enumerate(schedule.workers[worker]):
        site, m = (worker, index), action.microbatch
        if action.stage != stage:
            analysis.add(f"w{worker} runs stage {stage}, but its action {action} names stage "
                         f"{action.stage}", site)
            continue
        if m is not None and not 0 <= m < schedule.num_microbatches:
            analysis.add(f"{action} on w{worker}: micro-batch {m} is outside "
                         f"0..{schedule.num_microbatches - 1}", site)
        if action.kind.is_send or action.kind.is_recv:
            _check_peer(schedule, worker, action, analysis, site)
        if action.kind.is_recv:
            if (action.kind, m) in posted:
                analysis.add(f"{action} on w{worker} receives again a tensor whose earlier "
                             "receive no computation has used yet", site)
            posted[action.kind, m] = index
        elif action.kind.is_send:
            source = Kind.FORWARD if action.kind is Kind.SEND_ACT else Kind.BACKWARD
            if m not in done[source]:
                analysis.add(f"{action} on w{worker} sends micro-batch {m}'s "
                             f"{_TENSOR[action.kind]} before computing it "
                             f"({Action(stage, source, m)})", site)
        elif action.kind.is_compute:
            _check_compute(schedule, action, site, posted, done, analysis)
    for index in posted.values():
        analysis.add(f"{schedule.workers[worker][index]} on w{worker} is never used by a "
                     "forward or backward", (worker, index))


def _check_peer(schedule: Schedule, worker: int, action: Action, analysis: _Analysis,
                site: Site) -> None:
    toward_next = action.kind in (Kind.SEND_ACT, Kind.RECV_GRAD)
    expected = action.stage + (1 if toward_next else -1)
    peer = action.peer
    assert peer is not None
    if not 0 <= expected < schedule.num_stages:
        analysis.add(f"{action} on w{worker}: stage {action.stage} has no stage {expected} to "
                     f"{'send to' if action.kind.is_send else 'receive from'}", site)
    elif not 0 <= peer < schedule.num_workers or schedule.stage_of(peer)[0] != expected:
        analysis.add(f"{action} on w{worker} names w{peer}, which does not run stage "
                     f"{expected}", site)


def _check_compute(schedule: Schedule, action: Action, site: Site,
                   posted: dict[tuple[Kind, int | None], int], done: dict[Kind, set[int]],
                   analysis: _Analysis) -> None:
    stage, m, worker = action.stage, action.microbatch, site[0]
    assert m is not None
    forward = action.kind is Kind.FORWARD
    if not forward and m not in done[Kind.FORWARD]:
        analysis.add(f"{action} on w{worker} comes before its forward {stage}F{m} on that "
                     "worker", site)
    needs = stage > 0 if forward else stage < schedule.num_stages - 1
    if needs:
        receive = Kind.RECV_ACT if forward else Kind.RECV_GRAD
        index = posted.pop((receive, m), None)
        if index is None:
            analysis.add(f"{action} on w{worker} has no earlier {stage}{receive.value}{m} to "
                         "receive its input", site)
        else:
            analysis.consumes[site] = index
    done[action.kind].add(m)


def _match_pairs(schedule: Schedule, analysis: _Analysis) -> None:
    """Per ordered pair of workers, sends and receives must carry the same tensors in the
    same order; the transport matches the k-th send with the k-th receive regardless."""
    sends: dict[tuple[int, int], list[Site]] = collections.defaultdict(list)
    receives: dict[tuple[int, int], list[Site]] = collections.defaultdict(list)
    for worker, actions in enumerate(schedule.workers):
        for index, action in enumerate(actions):
            peer = action.peer
            if peer is None or not 0 <= peer < schedule.num_workers or peer == worker:
                continue
            if action.kind.is_send:
                sends[worker, peer].append((worker, index))
            else:
                receives[peer, worker].append((worker, index))
    for pair in sorted(set(sends) | set(receives)):
        _match_pair(schedule, pair, sends[pair], receives[pair], analysis)


def _match_pair(schedule: Schedule, pair: tuple[int, int], sends: list[Site],
                receives: list[Site], analysis: _Analysis) -> None:
    def key(site: Site) -> _Key:
        action = schedule.workers[site[0]][site[1]]
        return _TENSOR[action.kind], action.microbatch

    for send, receive in zip(sends, receives):
        analysis.sent_by[receive] = send
    matched_sends = _unmatched(schedule, sends, [key(s) for s in receives], key, analysis,
                               f"is never received: w{pair[1]} posts no matching receive")
    matched_receives = _unmatched(schedule, receives, [key(s) for s in sends], key, analysis,
                                  f"is never sent: w{pair[0]} has no matching send")
    for send, receive in zip(matched_sends, matched_receives):
        if key(send) != key(receive):
            analysis.add(f"w{pair[0]} sends to w{pair[1]} in another order than w{pair[1]} "
                         f"receives: {_at(schedule, send)} is matched with "
                         f"{_at(schedule, receive)}", send, receive)
            return


def _unmatched(schedule: Schedule, sites: list[Site], other_keys: list[_Key],
               key: Callable[[Site], _Key], analysis: _Analysis, why: str) -> list[Site]:
    """Report the sites whose tensor the other side never mentions; return the others."""
    available = collections.Counter(other_keys)
    matched = []
    for site in sites:
        k = key(site)
        if available[k]:
            available[k] -= 1
            matched.append(site)
        else:
            analysis.add(f"{_at(schedule, site)} {why}", site)
    return matched


def _count_computes(schedule: Schedule, analysis: _Analysis) -> None:
    """Every stage runs the forward and the backward of every micro-batch exactly once."""
    for stage in range(schedule.num_stages):
        sites: dict[tuple[Kind, int | None], list[Site]] = collections.defaultdict(list)
        for replica in range(schedule.replicas[stage]):
            worker = schedule.worker_of(stage, replica)
            for index, action in enumerate(schedule.workers[worker]):
                if action.kind.is_compute and action.stage == stage:
                    sites[action.kind, action.microbatch].append((worker, index))
        for kind in (Kind.FORWARD, Kind.BACKWARD):
            name = kind.name.lower()
            for m in range(schedule.num_microbatches):
                found = sites[kind, m]
                if not found:
                    analysis.add(f"stage {stage} never runs the {name} of micro-batch {m}")
                elif len(found) > 1:
                    analysis.add(f"stage {stage} runs the {name} of micro-batch {m} "
                                 f"{len(found)} times", *found[1:])


def _match_collectives(schedule: Schedule, analysis: _Analysis) -> None:
    """The k-th AR of each replica of a stage pair up; every replica needs as many."""
    for stage, count in enumerate(schedule.replicas):
        workers = [schedule.worker_of(stage, r) for r in range(count)]
        sites = [[(w, i) for i, a in enumerate(schedule.workers[w])
                  if a.kind is Kind.ALLREDUCE and a.stage == stage] for w in workers]
        rounds = min(len(s) for s in sites)
        for k in range(rounds):
            group = tuple(s[k] for s in sites)
            for site in group:
                analysis.collective[site] = group
        extra = [site for s in sites for site in s[rounds:]]
        if extra:
            counts = ", ".join(f"w{w}: {len(s)}" for w, s in zip(workers, sites))
            analysis.add(f"stage {stage}'s replicas run different numbers of allreduces "
                         f"({counts}); the extra ones never pair up", *extra)


def _at(schedule: Schedule, site: Site) -> str:
    return f"{schedule.workers[site[0]][site[1]]} on w{site[0]}"


# -- dry run -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class _Run:
    rows: list[list[int]]
    """Per step, per worker: index of the action run, ``_WAIT`` or ``_DONE``."""
    position: list[int]
    """Index of each worker's next action when the dry run ended."""
    stuck: list[int]
    """Workers with actions left (empty when the schedule ran to the end)."""


def _dry_run(schedule: Schedule, analysis: _Analysis) -> _Run:
    lengths = [len(actions) for actions in schedule.workers]
    position = [0] * schedule.num_workers
    rows = []
    while True:
        ready = [w for w, n in enumerate(lengths)
                 if position[w] < n and _can_run(schedule, analysis, position, w)]
        if not ready:
            break
        row = [_DONE if position[w] >= n else _WAIT for w, n in enumerate(lengths)]
        for w in ready:
            row[w] = position[w]
        for w in ready:
            position[w] += 1
        rows.append(row)
    stuck = [w for w, n in enumerate(lengths) if position[w] < n]
    return _Run(rows, position, stuck)


def _can_run(schedule: Schedule, analysis: _Analysis, position: list[int], worker: int) -> bool:
    site = (worker, position[worker])
    if site in analysis.consumes:
        send = analysis.waits_for(site)
        return send is not None and position[send[0]] > send[1]
    if schedule.workers[worker][site[1]].kind is Kind.ALLREDUCE:
        group = analysis.collective.get(site)
        return group is not None and all(position[w] == i for w, i in group)
    return True


def _deadlock(schedule: Schedule, analysis: _Analysis, run: _Run) -> list[_Problem]:
    if not run.stuck:
        return []
    lines = [_waiting(schedule, analysis, run, w) for w in run.stuck]
    marks = tuple((w, run.position[w]) for w in run.stuck)
    return [_Problem("deadlock: no worker can go on" + "".join(f"\n    {line}" for line in lines),
                     marks)]


def _waiting(schedule: Schedule, analysis: _Analysis, run: _Run, worker: int) -> str:
    site = (worker, run.position[worker])
    here = _at(schedule, site)
    if site in analysis.consumes:
        send = analysis.waits_for(site)
        if send is None:
            return f"{here} waits for a tensor that no worker sends"
        return f"{here} waits for {_at(schedule, send)}, {_stopped(schedule, run, send[0])}"
    group = analysis.collective.get(site)
    if group is None:
        return f"{here} has no allreduce to pair with on every replica"
    late = [w for w, i in group if run.position[w] != i]
    return f"{here} waits for " + ", ".join(
        f"w{w} ({_stopped(schedule, run, w)})" for w in late)


def _stopped(schedule: Schedule, run: _Run, worker: int) -> str:
    return f"which is stuck at {schedule.workers[worker][run.position[worker]]}"


# -- report ------------------------------------------------------------------------------------

def _report(schedule: Schedule, problems: list[_Problem], run: _Run) -> str:
    unit = schedule.kind.unit
    count = f"{schedule.num_microbatches} {unit}{'es' if schedule.num_microbatches > 1 else ''}"
    head = (f"invalid {schedule.kind} schedule (replicas "
            f"{'-'.join(map(str, schedule.replicas))}, {count}): "
            f"{len(problems)} problem{'s' if len(problems) > 1 else ''}, bad actions marked "
            "*like this* in the dry run below")
    lines = [f"- {p.message}" for p in problems[:_MAX_LISTED]]
    if len(problems) > _MAX_LISTED:
        lines.append(f"- ... and {len(problems) - _MAX_LISTED} more")
    marks = {site for p in problems for site in p.marks}
    return "\n".join([head, *lines, _table(schedule, run, marks)])


def _table(schedule: Schedule, run: _Run, marks: set[Site]) -> str:
    def cell(worker: int, index: int) -> str:
        if index == _WAIT:
            return "."
        if index == _DONE or index >= len(schedule.workers[worker]):
            return ""
        text = str(schedule.workers[worker][index])
        return f"*{text}*" if (worker, index) in marks else text

    workers = range(schedule.num_workers)
    body = [["step", *(f"w{w}" for w in workers)]]
    body += [[str(t), *(cell(w, row[w]) for w in workers)] for t, row in enumerate(run.rows)]
    left = max((len(schedule.workers[w]) - run.position[w] for w in run.stuck), default=0)
    for offset in range(left):
        label = "stuck" if offset == 0 else ""
        body.append([label, *(cell(w, run.position[w] + offset) for w in workers)])
    widths = [max(len(row[c]) for row in body) for c in range(len(body[0]))]
    return "\n".join("  ".join(text.ljust(width) for text, width in zip(row, widths)).rstrip()
                     for row in body)
