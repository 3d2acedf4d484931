"""The runtime's one schedule interpreter: it runs a worker's actions against handlers keyed by
action kind and traces each action it ran, under the action's own name.

Every allreduce layout (data, tensor, pipeline and their products) is a list of
:class:`~tandem.schedule.Action` per worker, from ``plan.build_schedule()``, the list the
simulator replays; a layout differs only in its handlers. Handlers and trace names are bound to
the actions once per plan (:func:`compile_program`), so a step costs one call per action.

Usage::

    program = compile_program(schedule.workers[worker], {Kind.FORWARD: forward, ...})
    executor = Executor(trace)           # trace(name, start, end, step, num_bytes=, version=)
    executor.run(program, step)          # every action once, in order; one event each

A handler receives its action and the :class:`Span` of its trace event, started when the
handler is called. It may move the span's start (a forward that first waits for its input),
set its end (an allreduce that overlapped the backward before it), its bytes, its weight
version and its step (an asynchronous schedule's minibatch), or keep it open: a receive sets
``waits`` and its consumer calls :meth:`Executor.arrived` when the message is in. Events are
written in action order, each once it and every earlier one have ended.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from tandem.errors import UsageError
from tandem.schedule import Action, Kind


@dataclasses.dataclass(slots=True)
class Span:
    """The trace event of one action: open until its handler (or its last message) ends it."""

    name: str
    """The action's text (``2RA3<1``)."""
    step: int
    """The optimizer step it belongs to."""
    start: float
    end: float = 0.0
    """0 until set: the interpreter ends a span whose handler returns without ending it."""
    num_bytes: int = 0
    version: int = -1
    """The weight version a compute action ran on (-1: the live weights)."""
    waits: int = 0
    """Messages not yet in; the event ends when the last one arrives."""


class Handler(Protocol):
    """Runs one kind of action: ``handler(action, span)``."""

    def __call__(self, action: Action, span: Span, /) -> None: ...


class Trace(Protocol):
    """Where events go: ``trace(name, start, end, step, num_bytes=..., version=...)``."""

    def __call__(self, name: str, start: float, end: float, step: int, *, num_bytes: int = 0,
                 version: int = -1) -> None: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Program:
    """A worker's actions bound to their handlers and trace names (built once per plan)."""

    actions: tuple[Action, ...]
    bound: tuple[tuple[Handler, Action, str], ...]


def compile_program(actions: Sequence[Action], handlers: Mapping[Kind, Handler]) -> Program:
    """``actions`` with the handler of each one's kind; a :class:`UsageError` naming the first
    action no handler runs (a hand-written schedule of another layout's actions)."""
    bound = []
    for action in actions:
        handler = handlers.get(action.kind)
        if handler is None:
            known = " ".join(kind.value for kind in handlers)
            raise UsageError(f"the schedule's action {action} cannot run in this layout (it "
                             f"runs {known}); remove it from the schedule")
        bound.append((handler, action, str(action)))
    return Program(actions=tuple(actions), bound=tuple(bound))


class Executor:
    """Runs programs in order and writes one trace event per action (see the module docstring)."""

    def __init__(self, trace: Trace, clock: Callable[[], float] = time.perf_counter) -> None:
        self.trace = trace
        self.clock = clock
        self.open: collections.deque[Span] = collections.deque()
        """Spans not yet written, in action order; the first is waiting for a message."""

    def run(self, program: Program, step: int) -> None:
        """Run every action of ``program`` (part of optimizer step ``step``) in order."""
        clock, open_spans = self.clock, self.open
        for handler, action, name in program.bound:
            span = Span(name, step, clock())
            handler(action, span)
            if not span.waits and not span.end:
                span.end = clock()
            if open_spans or span.waits:
                open_spans.append(span)
                self.flush()
            else:  # the usual case: nothing earlier waits, so write it now
                self.trace(name, span.start, span.end, span.step, num_bytes=span.num_bytes,
                           version=span.version)

    def arrived(self, span: Span) -> None:
        """One message of ``span``'s receive is in (now): end it if that was the last."""
        span.end = max(span.end, self.clock())
        span.waits -= 1
        self.flush()

    def flush(self) -> None:
        """Write the events of the actions that have ended, up to the first that has not."""
        open_spans = self.open
        while open_spans and not open_spans[0].waits:
            span = open_spans.popleft()
            self.trace(span.name, span.start, span.end, span.step, num_bytes=span.num_bytes,
                       version=span.version)
