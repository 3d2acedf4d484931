"""The schedule checker: every generated schedule passes; broken ones are rejected with the
step x worker grid of their dry run, the bad actions marked."""

from __future__ import annotations

import itertools
import random
import textwrap

import pytest

from tandem.errors import UsageError
from tandem.schedule import SCHEDULE_KINDS, Schedule, ScheduleError, check, generate, grid

pytestmark = pytest.mark.pure


def table(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


def rejected(text: str) -> str:
    """The checker's message for the schedule written as ``text``."""
    with pytest.raises(ScheduleError) as caught:
        check(Schedule.parse(text))
    assert isinstance(caught.value, UsageError)
    return str(caught.value)


def combinations() -> list[tuple[tuple[int, ...], int]]:
    """Replicas 1..3 per stage and 1..9 micro-batches: every case up to 3 stages, every
    straight pipeline up to 5, and a fixed sample of 4 and 5 stages (the full sweep of 5
    stages takes seconds)."""
    small = [r for s in range(1, 4) for r in itertools.product(range(1, 4), repeat=s)]
    straight = [(1,) * s for s in (4, 5)]
    large = [r for s in (4, 5) for r in itertools.product(range(1, 4), repeat=s)]
    cases = [(r, m) for r in small + straight for m in range(1, 10)]
    return cases + random.Random(4).sample([(r, m) for r in large for m in range(1, 10)], 300)


def test_every_generated_schedule_passes_the_checker() -> None:
    checked = 0
    for (replicas, count), kind in itertools.product(combinations(), SCHEDULE_KINDS):
        try:
            schedule = generate(kind, replicas, count)
        except UsageError:
            continue  # the generators' own validation, tested in test_schedule.py
        check(schedule)
        cells = grid(schedule).split()[1 + schedule.num_workers:]
        actions = [str(a) for w in schedule.workers for a in w]
        assert sorted(c for c in cells if not c.isdigit() and c != ".") == sorted(actions)
        checked += 1
    assert checked > 1000


def test_deadlock_from_a_misordered_send() -> None:
    # Stage 0 sends micro-batch 0's activation only after its backward, which needs stage 1's
    # gradient, which needs that activation.
    assert rejected("""
        gpipe replicas=1-1 microbatches=1
        w0: 0F0 0RG0<1 0B0 0SA0>1 0ST
        w1: 1RA0<0 1F0 1B0 1SG0>0 1ST
    """) == table("""
        invalid gpipe schedule (replicas 1-1, 1 micro-batch): 1 problem, bad actions marked *like this* in the dry run below
        - deadlock: no worker can go on
            0B0 on w0 waits for 1SG0>0 on w1, which is stuck at 1F0
            1F0 on w1 waits for 0SA0>1 on w0, which is stuck at 0B0
        step   w0      w1
        0      0F0     1RA0<0
        1      0RG0<1  .
        stuck  *0B0*   *1F0*
               0SA0>1  1B0
               0ST     1SG0>0
                       1ST
    """)


def test_deadlock_in_a_generated_schedule_with_two_actions_swapped() -> None:
    schedule = generate("gpipe", [1, 1], 2)
    first = list(schedule.workers[0])
    assert " ".join(map(str, first)) == "0F0 0SA0>1 0RG0<1 0F1 0SA1>1 0RG1<1 0B0 0B1 0ST"
    # Swap 0SA1>1 and 0B0: stage 1 must run both forwards before its first backward, so
    # 0B0 waits for a gradient that depends on the activation w0 now sends after it.
    first[4], first[6] = first[6], first[4]
    broken = Schedule(kind="gpipe", replicas=(1, 1), num_microbatches=2,
                      workers=(tuple(first), schedule.workers[1]))
    message = rejected(broken.text())
    assert "\n".join(message.splitlines()[:4]) == table("""
        invalid gpipe schedule (replicas 1-1, 2 micro-batches): 1 problem, bad actions marked *like this* in the dry run below
        - deadlock: no worker can go on
            0B0 on w0 waits for 1SG0>0 on w1, which is stuck at 1F1
            1F1 on w1 waits for 0SA1>1 on w0, which is stuck at 0B0
    """)
    assert "stuck  *0B0*   *1F1*" in message


def test_unmatched_send_and_missing_receive() -> None:
    message = rejected("""
        gpipe replicas=1-1 microbatches=2
        w0: 0F0 0SA0>1 0F1 0SA1>1 0RG0<1 0RG1<1 0B0 0B1 0ST
        w1: 1RA0<0 1F0 1F1 1B0 1SG0>0 1B1 1SG1>0 1ST
    """)
    assert message.splitlines()[0].startswith(
        "invalid gpipe schedule (replicas 1-1, 2 micro-batches): 2 problems")
    assert "- 1F1 on w1 has no earlier 1RA1 to receive its input" in message
    assert "- 0SA1>1 on w0 is never received: w1 posts no matching receive" in message
    assert "3     *0SA1>1*  *1F1*" in message


def test_receive_never_sent() -> None:
    message = rejected("""
        gpipe replicas=1-1 microbatches=2
        w0: 0F0 0SA0>1 0F1 0RG0<1 0RG1<1 0B0 0B1 0ST
        w1: 1RA0<0 1RA1<0 1F0 1F1 1B0 1SG0>0 1B1 1SG1>0 1ST
    """)
    assert "- 1RA1<0 on w1 is never sent: w0 has no matching send" in message
    assert "1F1 on w1 waits for a tensor that no worker sends" in message
    assert "*1RA1<0*" in message and "stuck" in message


def test_pairwise_order_mismatch() -> None:
    # Both micro-batches are sent and received, but not in the same order: the transport
    # would hand micro-batch 0's activation to the receive posted for micro-batch 1.
    message = rejected("""
        gpipe replicas=1-1 microbatches=2
        w0: 0F0 0SA0>1 0F1 0SA1>1 0RG0<1 0RG1<1 0B0 0B1 0ST
        w1: 1RA1<0 1RA0<0 1F0 1F1 1B0 1SG0>0 1B1 1SG1>0 1ST
    """)
    assert ("- w0 sends to w1 in another order than w1 receives: 0SA0>1 on w0 is matched with "
            "1RA1<0 on w1") in message
    assert "0     0F0       *1RA1<0*" in message and "1     *0SA0>1*  1RA0<0" in message


def test_local_mistakes() -> None:
    message = rejected("""
        gpipe replicas=1-1 microbatches=1
        w0: 0SA0>1 0F0 0RG0<1 0B0 1ST
        w1: 1RA0<0 1B0 1F0 1SG0>0 1SA0>0 1ST
    """)
    assert "- 0SA0>1 on w0 sends micro-batch 0's activation before computing it (0F0)" in message
    assert "- w0 runs stage 0, but its action 1ST names stage 1" in message
    assert "- 1B0 on w1 comes before its forward 1F0 on that worker" in message
    assert "- 1SA0>0 on w1: stage 1 has no stage 2 to send to" in message
    message = rejected("""
        gpipe replicas=1-1 microbatches=1
        w0: 0F0 0SA0>1 0RG0<1 0B0 0ST
        w1: 1RA0<0 1F0 1B0 1SG0>0 1RA0<0 1ST
    """)
    assert "- 1RA0<0 on w1 is never used by a forward or backward" in message
    assert "- 1RA0<0 on w1 is never sent: w0 has no matching send" in message


def test_missing_and_repeated_computation() -> None:
    message = rejected("""
        gpipe replicas=2-1 microbatches=2
        w0: 0F0 0SA0>2 0RG0<2 0B0 0B0 0AR 0ST
        w1: 0RG1<2 0AR 0ST
        w2: 1RA0<0 1F0 1B0 1SG0>0 1RG0<2 1SG1>1 1ST
    """)
    assert "- stage 0 never runs the forward of micro-batch 1" in message
    assert "- stage 0 runs the backward of micro-batch 0 2 times" in message
    assert "- 1RG0<2 on w2: stage 1 has no stage 2 to receive from" in message
    assert "*0B0*" in message


def test_allreduce_mismatch_and_collective_deadlock() -> None:
    # w1 allreduces before sending micro-batch 1 on; w0 reaches its allreduce only after its
    # backward, which needs the last stage, which waits for that micro-batch.
    message = rejected("""
        gpipe replicas=2-1 microbatches=2
        w0: 0F0 0SA0>2 0RG0<2 0B0 0AR 0ST
        w1: 0F1 0RG1<2 0AR 0SA1>2 0B1 0ST
        w2: 1RA0<0 1RA1<1 1F0 1F1 1B0 1SG0>0 1B1 1SG1>1 1ST
    """)
    assert "0AR on w1 waits for w0 (which is stuck at 0B0)" in message
    assert "1F1 on w2 waits for 0SA1>2 on w1, which is stuck at 0AR" in message
    message = rejected("""
        gpipe replicas=2-1 microbatches=2
        w0: 0F0 0SA0>2 0RG0<2 0B0 0AR 0ST
        w1: 0F1 0SA1>2 0RG1<2 0B1 0ST
        w2: 1RA0<0 1RA1<1 1F0 1F1 1B0 1SG0>0 1B1 1SG1>1 1ST
    """)
    assert ("- stage 0's replicas run different numbers of allreduces (w0: 1, w1: 0); the extra "
            "ones never pair up") in message
    assert "0AR on w0 has no allreduce to pair with on every replica" in message
    assert "*0AR*" in message


def test_wrong_peer() -> None:
    message = rejected("""
        gpipe replicas=1-2 microbatches=2
        w0: 0F0 0SA0>0 0F1 0SA1>2 0RG0<1 0RG1<2 0B0 0B1 0ST
        w1: 1RA0<0 1F0 1B0 1SG0>0 1AR 1ST
        w2: 1RA1<0 1F1 1B1 1SG1>0 1AR 1ST
    """)
    assert "- 0SA0>0 on w0 names w0, which does not run stage 1" in message


def test_a_flush_schedule_steps_once_after_the_last_backward() -> None:
    # 1F1B on 2 workers with w0's 0ST deleted runs without hanging, and stage 0 never trains.
    message = rejected("""
        1f1b replicas=1-1 microbatches=2
        w0: 0F0 0SA0>1 0RG0<1 0F1 0SA1>1 0RG1<1 0B0 0B1
        w1: 1RA0<0 1F0 1RA1<0 1B0 1SG0>0 1F1 1B1 1SG1>0 1ST
    """)
    assert "- w0 never takes its optimizer step: add 0ST after its last backward" in message
    message = rejected("""
        1f1b replicas=1-1 microbatches=2
        w0: 0F0 0SA0>1 0RG0<1 0F1 0SA1>1 0RG1<1 0B0 0ST 0B1
        w1: 1RA0<0 1F0 1RA1<0 1B0 1SG0>0 1F1 1B1 1SG1>0 1ST 1ST
    """)
    assert "- 0ST on w0 comes before the last backward 0B1: move it to the end" in message
    assert ("- w1 takes 2 optimizer steps; a 1f1b schedule steps once, after the last "
            "backward: keep one 1ST") in message
    assert "*1ST*" in message
    message = rejected("""
        gpipe replicas=1 microbatches=2
        w0: 0F0 0F1 0B0 0B1 0ST1
    """)
    assert ("- 0ST1 on w0: a gpipe schedule updates once per step, after every micro-batch; "
            "write 0ST without a micro-batch") in message


def test_replicas_of_a_flush_schedule_allreduce_between_backward_and_step() -> None:
    message = rejected("""
        gpipe replicas=2-1 microbatches=2
        w0: 0F0 0SA0>2 0RG0<2 0B0 0ST
        w1: 0F1 0SA1>2 0RG1<2 0B1 0ST
        w2: 1RA0<0 1RA1<1 1F0 1F1 1B0 1SG0>0 1B1 1SG1>1 1ST
    """)
    assert ("- w0 never averages its gradients with stage 0's other replicas: add 0AR between "
            "its last backward and 0ST") in message
    message = rejected("""
        gpipe replicas=2-1 microbatches=2
        w0: 0F0 0SA0>2 0RG0<2 0B0 0ST 0AR
        w1: 0F1 0SA1>2 0RG1<2 0B1 0ST 0AR
        w2: 1RA0<0 1RA1<1 1F0 1F1 1B0 1SG0>0 1B1 1SG1>1 1ST
    """)
    assert ("- 0AR on w1 comes after the step 0ST, which would use this replica's gradients "
            "alone: move it before") in message


def test_pipedream_steps_after_each_minibatch() -> None:
    good = generate("pipedream", [2, 1], 2)
    assert good.text().splitlines()[1:] == [
        "w0: 0RG0<2 0F0 0SA0>2 0B0 0AR0 0ST0",
        "w1: 0RG1<2 0F1 0SA1>2 0B1 0AR1 0ST1",
        "w2: 1RA0<0 1F0 1RA1<1 1B0 1SG0>0 1ST0 1F1 1B1 1SG1>1 1ST1",
    ]
    message = rejected("""
        pipedream replicas=2-1 microbatches=2
        w0: 0RG0<2 0F0 0SA0>2 0B0 0AR0 0ST0
        w1: 0RG1<2 0F1 0SA1>2 0B1 0ST1 0AR1
        w2: 1RA0<0 1F0 1RA1<1 1B0 1SG0>0 1F1 1B1 1SG1>1 1ST1 1ST
    """)
    assert ("- 0ST1 on w1 steps before stage 0's replicas average minibatch 1's gradients: put "
            "0AR1 between 0B1 and it") in message
    assert ("- 1ST on w2: pipedream updates after each minibatch's backward; write "
            "1ST<minibatch>, e.g. 1ST0") in message
    assert "- w2 never steps after 1B0: add 1ST0 after it" in message
    message = rejected("""
        pipedream replicas=1-1 microbatches=2
        w0: 0RG0<1 0F0 0SA0>1 0ST1 0RG1<1 0F1 0SA1>1 0B0 0ST0 0B1 0ST1 0ST1
        w1: 1RA0<0 1F0 1RA1<0 1B0 1SG0>0 1ST0 1F1 1B1 1SG1>0 1ST1
    """)
    assert "- 0ST1 on w0 comes before (or without) the backward 0B1 on that worker" in message
    assert "- 0ST1 on w0 is there twice for minibatch 1" in message
