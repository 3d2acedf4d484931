"""Schedule generators: expected schedules drawn as tables, text round trip, bad input."""

from __future__ import annotations

import random
import textwrap

import pytest

from tandem.errors import UsageError
from tandem.schedule import (
    GENERATORS,
    SCHEDULE_KINDS,
    Action,
    Kind,
    Schedule,
    generate,
    gpipe,
    grid,
    num_in_flight,
    one_f_one_b,
    pipedream,
)
from tandem.schedule.generators import in_flight_counts

pytestmark = pytest.mark.pure

SMALL_CASES = [([1], 1), ([1], 3), ([1, 1], 2), ([1, 1], 3), ([2, 1], 4), ([1, 2], 6),
               ([1, 1, 1], 6), ([2, 1, 3], 6), ([3, 3], 6), ([1, 1, 1, 1], 8)]  # fmt: skip


def table(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


def computes(schedule: Schedule) -> list[str]:
    """Per worker, its forwards, backwards, allreduces and steps (communication left out)."""
    shown = (Kind.FORWARD, Kind.BACKWARD, Kind.ALLREDUCE, Kind.STEP)
    return [" ".join(str(a) for a in actions if a.kind in shown) for actions in schedule.workers]


def test_gpipe_two_stages_three_microbatches() -> None:
    # Fill, then drain; each receive is posted one computation before the one that needs it.
    assert grid(gpipe([1, 1], 3)) == table("""
        step  w0      w1
        0     0F0     1RA0<0
        1     0SA0>1  1RA1<0
        2     0F1     1F0
        3     0SA1>1  1RA2<0
        4     0RG0<1  1F1
        5     0F2     .
        6     0SA2>1  .
        7     0RG1<1  1F2
        8     .       1B0
        9     .       1SG0>0
        10    0B0     1B1
        11    0RG2<1  1SG1>0
        12    0B1     1B2
        13    .       1SG2>0
        14    0B2     1ST
        15    0ST
    """)


def test_1f1b_two_stages_three_microbatches() -> None:
    # Stage 0 warms up with one forward, then alternates; stage 1 alternates from the start.
    assert grid(one_f_one_b([1, 1], 3)) == table("""
        step  w0      w1
        0     0F0     1RA0<0
        1     0SA0>1  .
        2     0RG0<1  1F0
        3     0F1     1RA1<0
        4     0SA1>1  1B0
        5     .       1SG0>0
        6     0B0     1F1
        7     0RG1<1  1RA2<0
        8     0F2     1B1
        9     0SA2>1  1SG1>0
        10    0RG2<1  1F2
        11    0B1     1B2
        12    .       1SG2>0
        13    0B2     1ST
        14    0ST
    """)


def test_pipedream_three_stages() -> None:
    # Start-up admits S - s minibatches, then one forward / one backward with a weight update
    # after every backward (no flush), then the drain at the end of the run.
    assert computes(pipedream([1, 1, 1], 5)) == [
        "0F0 0F1 0F2 0B0 0ST0 0F3 0B1 0ST1 0F4 0B2 0ST2 0B3 0ST3 0B4 0ST4",
        "1F0 1F1 1B0 1ST0 1F2 1B1 1ST1 1F3 1B2 1ST2 1F4 1B3 1ST3 1B4 1ST4",
        "2F0 2B0 2ST0 2F1 2B1 2ST1 2F2 2B2 2ST2 2F3 2B3 2ST3 2F4 2B4 2ST4",
    ]
    middle = pipedream([1, 1, 1], 5).workers[1]
    assert " ".join(map(str, middle[:11])) == (
        "1RA0<0 1RA1<0 1F0 1SA0>2 1RG0<2 1F1 1SA1>2 1RA2<0 1B0 1SG0>0 1ST0")


def test_gpipe_replicated_two_one() -> None:
    # Stage 0 has two replicas taking micro-batches round-robin (w0: 0, 2; w1: 1); they
    # allreduce together before stepping. Stage 1 (w2) receives from whichever ran the batch.
    assert grid(gpipe([2, 1], 3)) == table("""
        step  w0      w1      w2
        0     0F0     0RG1<2  1RA0<0
        1     0SA0>2  0F1     1RA1<1
        2     0RG0<2  0SA1>2  1F0
        3     0F2     .       1RA2<0
        4     0SA2>2  .       1F1
        5     0RG2<2  .       1F2
        6     .       .       1B0
        7     .       .       1SG0>0
        8     0B0     .       1B1
        9     .       .       1SG1>1
        10    .       0B1     1B2
        11    .       .       1SG2>0
        12    0B2     .       1ST
        13    0AR     0AR
        14    0ST     0ST
    """)


def test_replicated_1f1b_and_pipedream() -> None:
    # 2-1: each stage-0 replica keeps ceil(3 / 2) = 2 micro-batches in flight.
    assert computes(one_f_one_b([2, 1], 4)) == [
        "0F0 0F2 0B0 0B2 0AR 0ST",
        "0F1 0F3 0B1 0B3 0AR 0ST",
        "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3 1ST",
    ]
    assert computes(pipedream([2, 1], 4)) == [
        "0F0 0F2 0B0 0AR0 0ST0 0B2 0AR2 0ST2",
        "0F1 0F3 0B1 0AR1 0ST1 0B3 0AR3 0ST3",
        "1F0 1B0 1ST0 1F1 1B1 1ST1 1F2 1B2 1ST2 1F3 1B3 1ST3",
    ]


def test_num_in_flight_is_noam() -> None:
    assert [num_in_flight([1, 1, 1, 1], s) for s in range(4)] == [4, 3, 2, 1]
    assert [num_in_flight([2, 1], s) for s in range(2)] == [2, 1]
    assert [num_in_flight([1, 3], s) for s in range(2)] == [4, 1]


def test_in_flight_counts_are_num_in_flight_of_every_stage() -> None:
    rng = random.Random(7)
    for _ in range(200):
        replicas = [rng.randint(1, 9) for _ in range(rng.randint(1, 30))]
        assert in_flight_counts(replicas) == [num_in_flight(replicas, s)
                                              for s in range(len(replicas))]


@pytest.mark.parametrize("replicas", [[1], [1, 1], [1, 1, 1], [1, 1, 1, 1, 1]])
@pytest.mark.parametrize("num_microbatches", [5, 8])
def test_1f1b_bounds_activations_in_flight(replicas: list[int], num_microbatches: int) -> None:
    def peak(actions: tuple[Action, ...]) -> int:
        held = best = 0
        for action in actions:
            held += {Kind.FORWARD: 1, Kind.BACKWARD: -1}.get(action.kind, 0)
            best = max(best, held)
        return best

    stages = len(replicas)
    flush = one_f_one_b(replicas, num_microbatches)
    assert [peak(w) for w in flush.workers] == [stages - s for s in range(stages)]
    fill_drain = gpipe(replicas, num_microbatches)
    assert [peak(w) for w in fill_drain.workers] == [num_microbatches] * stages


@pytest.mark.parametrize("kind", SCHEDULE_KINDS)
@pytest.mark.parametrize(("replicas", "count"), SMALL_CASES)
def test_text_round_trip(kind: str, replicas: list[int], count: int) -> None:
    if kind == "1f1b" and count < len(replicas):
        count = len(replicas)
    schedule = generate(kind, replicas, count)
    assert GENERATORS[kind](replicas, count) == schedule
    assert Schedule.parse(schedule.text()) == schedule
    assert schedule.kind == kind and schedule.replicas == tuple(replicas)


@pytest.mark.parametrize("kind", SCHEDULE_KINDS)
@pytest.mark.parametrize(("replicas", "count"), SMALL_CASES)
def test_communication_placement(kind: str, replicas: list[int], count: int) -> None:
    """Peers follow the round-robin; a receive is posted before the computation that precedes
    its consumer (so the transfer overlaps it), unless the consumer is the worker's first."""
    schedule = generate(kind, replicas, max(count, len(replicas)))
    for actions in schedule.workers:
        compute_seen = 0
        posted: dict[tuple[Kind, int | None], int] = {}
        for action in actions:
            stage, m = action.stage, action.microbatch
            if action.kind in (Kind.SEND_ACT, Kind.RECV_GRAD):
                assert action.peer == schedule.worker_for(stage + 1, m)
            if action.kind in (Kind.SEND_GRAD, Kind.RECV_ACT):
                assert action.peer == schedule.worker_for(stage - 1, m)
            if action.kind.is_recv:
                posted[action.kind, m] = compute_seen
            if action.kind.is_compute:
                needed = Kind.RECV_ACT if action.kind is Kind.FORWARD else Kind.RECV_GRAD
                if (needed, m) in posted:
                    assert posted.pop((needed, m)) < compute_seen or compute_seen == 0
                compute_seen += 1
        assert not posted


@pytest.mark.parametrize(("kind", "replicas", "count", "expected"), [
    ("gpipe", [], 4, "gpipe needs at least one stage (replicas: none)"),
    ("1f1b", [2, 0], 4, "every stage needs at least one replica (replicas: 2-0)"),
    ("gpipe", [1, 1], 0, "gpipe needs at least one micro-batch (micro-batches: 0); use 1 or more"),
    ("pipedream", [1], -1, "(minibatches: -1); use 1 or more"),
    ("1f1b", [1, 1, 1, 1], 3, ("1f1b needs at least as many micro-batches as stages "
                               "(micro-batches: 3, stages: 4); use 4 or more, or gpipe")),
    ("gpipe", [1, 3], 2, ("leaves some of stage 1's 3 replicas without work (micro-batches: 2); "
                          "use 3 or more")),
    ("1f1b", [3, 1], 2, ("1f1b with replicas 3-1 leaves some of stage 0's 3 replicas without "
                         "work (micro-batches: 2); use 3 or more")),
    ("pipedream", [2, 3], 8, ("pipedream with replicas 2-3 needs a number of minibatches that "
                              "is a multiple of 6")),
    ("pipedream", [2, 3], 8, "(minibatches: 8); use 12, for example"),
    ("gpipe-ish", [1], 1, "unknown schedule kind 'gpipe-ish' (known: gpipe, 1f1b, pipedream)"),
])  # fmt: skip
def test_bad_input_is_one_clear_line(kind: str, replicas: list[int], count: int,
                                     expected: str) -> None:
    with pytest.raises(UsageError) as caught:
        generate(kind, replicas, count)
    assert expected in str(caught.value)
    assert "\n" not in str(caught.value)
