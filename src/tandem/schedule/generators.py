"""Schedule generators: GPipe, 1F1B with a flush, and PipeDream's asynchronous 1F1B, from integers.

Usage::

    from tandem.schedule import check, generate, grid

    schedule = generate("1f1b", replicas=[2, 1], num_microbatches=4)
    check(schedule)            # raises ScheduleError (with the step x worker grid) if invalid
    print(grid(schedule))

Every generator takes the replica count of each stage and a number of micro-batches
(minibatches for ``pipedream``), and returns a :class:`Schedule` whose workers are numbered
stage-major; micro-batch ``m`` of stage ``s`` runs on replica ``m % replicas[s]``.

Communication is placed the same way by all of them. Stage ``s > 0`` receives micro-batch
``m``'s activation (``sRAm<peer``) from the worker of stage ``s - 1`` that ran ``m``; stage
``s < S - 1`` sends it on (``sSAm>peer``) right after the forward; gradients flow back with
``SG``/``RG`` the same way. The engine posts a receive (``irecv``) when it reaches it and waits
only in the forward or backward that consumes it, so each receive is placed one computation
ahead of its consumer: the transfer overlaps the computation in between. Each worker's
forwards, and its backwards, run in increasing micro-batch order, so every pair of workers
sends and receives in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from tandem.errors import UsageError
from tandem.schedule.action import Action, Kind
from tandem.schedule.schedule import SCHEDULE_KINDS, Schedule, make_schedule, worker_for
from tandem.spec.kinds import ScheduleKind

Ops = list[Action]


def gpipe(replicas: Sequence[int], num_microbatches: int) -> Schedule:
    """GPipe: every worker runs all its forwards, then all its backwards (fill, then drain),
    then allreduces its gradients with its stage's other replicas (if any) and steps."""
    replicas = _validate(ScheduleKind.GPIPE, replicas, num_microbatches)
    return _build(ScheduleKind.GPIPE, replicas, num_microbatches, _fill_drain)


def one_f_one_b(replicas: Sequence[int], num_microbatches: int) -> Schedule:
    """1F1B with a flush per step (PipeDream-Flush, Megatron's schedule).

    Each worker runs a warm-up of ``num_in_flight - 1`` forwards, then alternates one forward
    and one backward, then runs the remaining backwards, allreduces (if its stage is
    replicated) and steps. In a straight pipeline stage ``s`` of ``S`` thus keeps at most
    ``S - s`` micro-batches in flight (activations stored), against ``M`` in GPipe.

    With replicated stages the in-flight count is PipeDream's NOAM, generalized from the input
    stage to every stage: ``ceil(workers in stages s..S-1 / replicas[s])``. In the steady
    state each worker of stages ``s..S-1`` is busy with one micro-batch that stage ``s`` has
    forwarded and not yet backwarded; the ``replicas[s]`` replicas of stage ``s`` share those
    micro-batches round-robin, so each must hold that many to keep every later worker busy.
    Fewer would leave later stages idle; more would only cost activation memory. For a
    straight pipeline this is ``S - s``.
    """
    replicas = _validate(ScheduleKind.ONE_F_ONE_B, replicas, num_microbatches)
    return _build(ScheduleKind.ONE_F_ONE_B, replicas, num_microbatches, _interleaved)


def pipedream(replicas: Sequence[int], num_minibatches: int) -> Schedule:
    """PipeDream's asynchronous 1F1B over a whole run of ``num_minibatches`` minibatches.

    Start-up: stage ``s`` admits ``num_in_flight`` minibatches (``S - s`` in a straight
    pipeline, NOAM with replicas). Steady state: one forward, one backward, no flush; every
    backward is followed by its gradient send, an allreduce among the stage's replicas
    (``AR{m}``, replicated stages only) and a weight update (``ST{m}``). The run ends with a
    drain of the remaining backwards. The forward of a minibatch thus runs on older weights
    than its backward would see: the engine stashes weight versions (one per minibatch in
    flight) so that each backward uses its forward's weights.

    The replicas of a stage allreduce once per round of the round-robin (their ``k``-th ``AR``
    actions pair up), so ``num_minibatches`` must be a multiple of every replica count.
    """
    replicas = _validate(ScheduleKind.PIPEDREAM, replicas, num_minibatches)
    return _build(ScheduleKind.PIPEDREAM, replicas, num_minibatches, _interleaved)


GENERATORS: dict[ScheduleKind, Callable[[Sequence[int], int], Schedule]] = {
    ScheduleKind.GPIPE: gpipe, ScheduleKind.ONE_F_ONE_B: one_f_one_b,
    ScheduleKind.PIPEDREAM: pipedream,
}
"""Each schedule kind's generator."""


def generate(kind: ScheduleKind | str, replicas: Sequence[int], num_microbatches: int) -> Schedule:
    """The schedule of ``kind`` (``gpipe``, ``1f1b`` or ``pipedream``, or its name)."""
    known = ScheduleKind.parse(kind)
    if known is None:
        raise UsageError(f"unknown schedule kind {kind!r} (known: {', '.join(SCHEDULE_KINDS)})")
    return GENERATORS[known](replicas, num_microbatches)


def num_in_flight(replicas: Sequence[int], stage: int) -> int:
    """Micro-batches a replica of ``stage`` holds at once in 1F1B and PipeDream (NOAM):
    ``ceil(workers in stages stage..S-1 / replicas[stage])``; ``S - stage`` when straight.
    In ``pipedream`` it is also the number of weight versions that replica must stash."""
    return math.ceil(sum(replicas[stage:]) / replicas[stage])


def in_flight_counts(replicas: Sequence[int]) -> list[int]:
    """:func:`num_in_flight` of every stage, in one pass (from the last stage's workers up)."""
    counts: list[int] = []
    workers = 0
    for r in reversed(replicas):
        workers += r
        counts.append(math.ceil(workers / r))
    return counts[::-1]


# -- compute order of one worker ---------------------------------------------------------------

ComputeOrder = Callable[[Sequence[int], int, list[int]], Ops]


def _fill_drain(replicas: Sequence[int], stage: int, local: list[int]) -> Ops:
    return [_forward(stage, m) for m in local] + [_backward(stage, m) for m in local]


def _interleaved(replicas: Sequence[int], stage: int, local: list[int]) -> Ops:
    warmup = min(num_in_flight(replicas, stage) - 1, len(local))
    ops = [_forward(stage, m) for m in local[:warmup]]
    for index, m in enumerate(local[warmup:]):
        ops += [_forward(stage, m), _backward(stage, local[index])]
    return ops + [_backward(stage, m) for m in local[len(local) - warmup:]]


def _forward(stage: int, microbatch: int) -> Action:
    return Action(stage, Kind.FORWARD, microbatch)


def _backward(stage: int, microbatch: int) -> Action:
    return Action(stage, Kind.BACKWARD, microbatch)


# -- communication and synchronization ---------------------------------------------------------

def _build(kind: ScheduleKind, replicas: tuple[int, ...], count: int, order: ComputeOrder) -> Schedule:
    workers = []
    for stage, num_replicas in enumerate(replicas):
        for replica in range(num_replicas):
            local = list(range(replica, count, num_replicas))
            workers.append(_worker(kind, replicas, stage, order(replicas, stage, local)))
    return make_schedule(kind, replicas, count, workers)


def _worker(kind: ScheduleKind, replicas: tuple[int, ...], stage: int, computes: Ops) -> Ops:
    """Receives one computation ahead of their consumer, sends right after their producer,
    then allreduce and step (after every backward in ``pipedream``, at the end otherwise)."""
    replicated = replicas[stage] > 1
    actions = _receive(replicas, computes[0]) if computes else []
    for index, op in enumerate(computes):
        if index + 1 < len(computes):
            actions += _receive(replicas, computes[index + 1])
        actions += [op, *_send(replicas, op)]
        if kind.asynchronous and op.kind is Kind.BACKWARD:
            actions += _update(stage, op.microbatch, replicated)
    if kind.flushes:
        actions += _update(stage, None, replicated)
    return actions


def _update(stage: int, microbatch: int | None, replicated: bool) -> Ops:
    step = Action(stage, Kind.STEP, microbatch)
    return [Action(stage, Kind.ALLREDUCE, microbatch), step] if replicated else [step]


def _receive(replicas: Sequence[int], op: Action) -> Ops:
    """The receive that ``op``'s input needs: activation from the previous stage for a
    forward, gradient from the next stage for a backward; none at the pipeline's ends."""
    stage, m = op.stage, op.microbatch
    assert m is not None
    if op.kind is Kind.FORWARD and stage > 0:
        return [Action(stage, Kind.RECV_ACT, m, worker_for(replicas, stage - 1, m))]
    if op.kind is Kind.BACKWARD and stage < len(replicas) - 1:
        return [Action(stage, Kind.RECV_GRAD, m, worker_for(replicas, stage + 1, m))]
    return []


def _send(replicas: Sequence[int], op: Action) -> Ops:
    """The send of ``op``'s output: activation to the next stage, input gradient to the
    previous one; none at the pipeline's ends."""
    stage, m = op.stage, op.microbatch
    assert m is not None
    if op.kind is Kind.FORWARD and stage < len(replicas) - 1:
        return [Action(stage, Kind.SEND_ACT, m, worker_for(replicas, stage + 1, m))]
    if op.kind is Kind.BACKWARD and stage > 0:
        return [Action(stage, Kind.SEND_GRAD, m, worker_for(replicas, stage - 1, m))]
    return []


# -- validation --------------------------------------------------------------------------------

def _validate(kind: ScheduleKind, replicas: Sequence[int], count: int) -> tuple[int, ...]:
    """The replica counts as a tuple, or a UsageError naming the bad value and the fix."""
    replicas = tuple(replicas)
    text = "-".join(map(str, replicas))
    if not replicas:
        raise UsageError(f"{kind} needs at least one stage (replicas: none); "
                         "give one replica count per stage, e.g. 2,1")
    if any(not isinstance(r, int) or r < 1 for r in replicas):
        raise UsageError(f"every stage needs at least one replica (replicas: {text}); "
                         "give a whole number of 1 or more per stage")
    unit = kind.unit
    if not isinstance(count, int) or count < 1:
        raise UsageError(f"{kind} needs at least one {unit} ({unit}es: {count}); use 1 or more")
    if kind is ScheduleKind.ONE_F_ONE_B and count < len(replicas):
        raise UsageError(f"1f1b needs at least as many micro-batches as stages (micro-batches: "
                         f"{count}, stages: {len(replicas)}); use {len(replicas)} or more, "
                         f"or gpipe")
    if kind.asynchronous:
        rounds = math.lcm(*replicas)
        if count % rounds:
            raise UsageError(f"pipedream with replicas {text} needs a number of minibatches "
                             f"that is a multiple of {rounds}, so that a stage's replicas get "
                             f"equally many and their allreduces pair up (minibatches: {count}); "
                             f"use {count + rounds - count % rounds}, for example")
    elif count < max(replicas):
        stage = replicas.index(max(replicas))
        raise UsageError(f"{kind} with replicas {text} leaves some of stage {stage}'s "
                         f"{replicas[stage]} replicas without work (micro-batches: {count}); "
                         f"use {replicas[stage]} or more")
    return replicas
