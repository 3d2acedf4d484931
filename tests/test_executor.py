"""The schedule interpreter (runtime/executor.py): every action of a worker's list runs once, in
order, and is traced under its own name; a run's trace is the plan's schedule, action by action.

The interpreter is checked alone on hand-made handlers; the runs are the real command line on
tiny models for two to twenty steps: data parallelism (2 workers, 2 micro-batches each), data 2
x tensor 2, and data 2 x pipeline 2 x tensor 2 (8 processes), whose runs the equivalence tests
in test_plan_strategy.py and test_tensor_parallel.py share within a session.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tandem.errors import UsageError
from tandem.plan import Plan
from tandem.runtime.executor import Executor, Span, compile_program
from tandem.schedule import Action, Kind, Schedule
from tests.conftest import SharedRun
from tests.test_tensor_parallel import GPT

Traced = list[tuple[str, float, float, int]]


def recorder(events: Traced) -> Callable[..., None]:
    """A trace that appends ``(name, start, end, step)`` to ``events``."""

    def trace(name: str, start: float, end: float, step: int, *, num_bytes: int = 0,
              version: int = -1) -> None:
        events.append((name, start, end, step))

    return trace


def ticks() -> Callable[[], float]:
    """A clock that advances by 1 at every reading."""
    count = iter(range(1, 1 << 20))
    return lambda: float(next(count))


@pytest.mark.pure
def test_runs_every_action_once_in_order_and_traces_it_by_name() -> None:
    ran: list[str] = []
    actions = [Action.parse(text) for text in "0F0 0B0 0F2 0B2 0AR 0ST".split()]
    handlers = {kind: (lambda action, span: ran.append(str(action)))
                for kind in (Kind.FORWARD, Kind.BACKWARD, Kind.ALLREDUCE, Kind.STEP)}
    events: Traced = []
    program = compile_program(actions, handlers)
    Executor(recorder(events), clock=ticks()).run(program, step=7)
    assert ran == [str(a) for a in actions]
    assert [(name, step) for name, _, _, step in events] == [(str(a), 7) for a in actions]
    assert all(start < end for _, start, end, _ in events)


@pytest.mark.pure
def test_a_receive_is_written_when_its_message_is_in_and_later_events_wait_for_it() -> None:
    """``1RA0<0`` stays open until its forward has the message; ``1RA1<0``, posted after it,
    is written after it although it ended first; the forward moves its own start past the wait."""
    events: Traced = []
    executor = Executor(recorder(events), clock=ticks())
    posted: dict[int, Span] = {}

    def receive(action: Action, span: Span) -> None:
        span.waits = 1
        posted[action.microbatch] = span  # type: ignore[index]

    def forward(action: Action, span: Span) -> None:
        executor.arrived(posted.pop(action.microbatch))  # type: ignore[arg-type]
        span.start = 100.0

    program = compile_program(Schedule.parse("1f1b replicas=1 microbatches=1\n"
                                             "w0: 1RA0<0 1RA1<0 1F0 1F1").workers[0],
                              {Kind.RECV_ACT: receive, Kind.FORWARD: forward})
    executor.run(program, step=0)
    assert [name for name, *_ in events] == ["1RA0<0", "1RA1<0", "1F0", "1F1"]
    first, second, forward0, _ = events
    assert first[2] < forward0[2] and forward0[1] == 100.0
    assert second[2] > first[2]  # its message came in at the second forward
    assert not executor.open


@pytest.mark.pure
def test_an_action_without_a_handler_is_refused_when_the_program_is_built() -> None:
    with pytest.raises(UsageError, match=r"action 0PU cannot run in this layout"):
        compile_program([Action.parse("0F0"), Action.parse("0PU")],
                        {Kind.FORWARD: lambda action, span: None})


def traced_steps(out: Path) -> dict[int, dict[int, list[str]]]:
    """Rank -> step -> the names of the rank's events of that step, in the order recorded."""
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    ranks: dict[int, dict[int, list[str]]] = collections.defaultdict(
        lambda: collections.defaultdict(list))
    for event in events:
        if event.get("ph") == "X":
            ranks[event["pid"]][event["args"]["step"]].append(event["name"])
    return ranks


def assert_trace_is_the_schedule(out: Path, steps: int) -> None:
    """Every rank's events of every step are its schedule worker's actions, in order."""
    plan = Plan.load(str(out / "plan.json"))
    schedule = plan.build_schedule()
    traced = traced_steps(out)
    assert len(traced) == plan.num_workers
    for rank, by_step in traced.items():
        expected = [str(a) for a in schedule.workers[rank // plan.tensor_degree]]
        assert sorted(by_step) == list(range(steps)), f"rank {rank}"
        for step, names in by_step.items():
            assert names == expected, f"rank {rank}, step {step}"


@pytest.mark.multiprocess
def test_data_parallel_trace_is_the_schedule(shared_run: SharedRun) -> None:
    out, _ = shared_run("--strategy", "dp", "--nproc", "2", "--accumulate", "2", "--steps", "2",
                        "--batch-size", "32")
    assert_trace_is_the_schedule(out, steps=2)


@pytest.mark.multiprocess
def test_tensor_parallel_trace_is_the_schedule(shared_run: SharedRun) -> None:
    """Data 2 x tensor 2: both processes of a replica run (and trace) its worker's actions."""
    out, _ = shared_run(*GPT, "--nproc", "4", "--tensor-parallel", "2")
    assert_trace_is_the_schedule(out, steps=20)


@pytest.mark.multiprocess
def test_pipeline_tensor_data_trace_is_the_schedule(shared_run: SharedRun) -> None:
    """Pipeline 2 stages x 2 replicas x tensor 2: 8 processes, 4 schedule workers."""
    out, summary = shared_run(*GPT, "--strategy", "pipeline", "--replicas", "2,2", "--nproc", "8",
                              "--tensor-parallel", "2")
    assert summary["mesh"] == {"data": 2, "pipeline": 2, "tensor": 2}
    assert_trace_is_the_schedule(out, steps=20)
