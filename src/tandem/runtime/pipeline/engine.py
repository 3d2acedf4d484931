"""One pipeline worker's handlers of its schedule's actions, run by the schedule interpreter.

A stage's work divides by what its actions do: point-to-point sends and receives
(``links.py``), forwards and backwards (``compute.py``), and the replicas' allreduce and the
optimizer step (``update.py``). :class:`StageEngine` binds them to the worker's actions once per
plan and runs a step's actions with :class:`~tandem.runtime.executor.Executor`, whose trace
names every action the schedule's way (``str(action)``: ``1F3``, ``1SA3>2``, ``2RA3<1``,
``0AR``, ``0ST5``), one event per action in the order they run, so a worker's event names are
its action list. A boundary may carry several tensors (a skip connection, an attention mask;
see :mod:`tandem.split`): they travel as one message, and gradients come back for those that
require them. With ``--compress`` every activation and activation gradient goes as one byte
message of the codec (see ``wire.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from tandem.runtime.executor import Executor, Handler, Program, Span, Trace, compile_program
from tandem.runtime.pipeline.compute import ComputeSpec, Microbatch, StageCompute
from tandem.runtime.pipeline.links import LinkSpec, StageLinks, StageShapes
from tandem.runtime.pipeline.stash import WeightVersions
from tandem.runtime.pipeline.update import StageUpdate, Tie, UpdateSpec
from tandem.runtime.pipeline.wire import Traffic
from tandem.schedule import Action, Kind

__all__ = ["ComputeSpec", "LinkSpec", "Microbatch", "StageEngine", "StageShapes", "Tie",
           "UpdateSpec"]

Batches = Callable[[int], Microbatch]
"""Micro-batch (or minibatch) index -> its data, for the step being run."""


class StageEngine:
    """Runs the actions of one worker, which holds one stage (or a replica of it)."""

    def __init__(self, *, links: LinkSpec, compute: ComputeSpec, update: UpdateSpec,
                 shapes: StageShapes, asynchronous: bool, trace: Trace, beat: Any,
                 device: torch.device) -> None:
        self.executor = Executor(trace)
        self.links = StageLinks(links, shapes, self.executor, device)
        self.stash = (WeightVersions(compute.module, vertical_sync=links.vertical_sync)
                      if asynchronous else None)
        self.compute = StageCompute(compute, shapes, self.links, self.stash, beat, device)
        self.update = StageUpdate(update, self.links.traffic, self.stash,
                                  self.compute.param_grads, beat)
        self.device = device
        self.batch: Batches = _no_batches
        """The data of the step being run (set by :meth:`execute`)."""
        self.handlers: dict[Kind, Handler] = {
            Kind.FORWARD: self._forward, Kind.BACKWARD: self._backward,
            Kind.SEND_ACT: self._send, Kind.SEND_GRAD: self._send,
            Kind.RECV_ACT: self._receive, Kind.RECV_GRAD: self._receive,
            Kind.ALLREDUCE: self._allreduce, Kind.STEP: self._step,
        }

    @property
    def traffic(self) -> Traffic:
        return self.links.traffic

    @property
    def ties(self) -> Sequence[Tie]:
        return self.update.spec.ties

    @property
    def peak_activation_bytes(self) -> int:
        return self.compute.peak_activation_bytes

    def program(self, actions: Sequence[Action]) -> Program:
        """``actions`` bound to this engine's handlers (compile once, run every step)."""
        return compile_program(actions, self.handlers)

    def execute(self, program: Program, batch: Batches, step: int) -> torch.Tensor:
        """Run ``program`` (part of optimizer step ``step``) in order; returns the loss computed
        here, summed over samples (unscaled)."""
        self.batch = batch
        self.compute.loss_total = torch.zeros((), device=self.device)
        self.executor.run(program, step)
        return self.compute.loss_total

    def finish_sends(self) -> None:
        """Wait until every posted send has been received."""
        self.links.finish_sends()

    def prune_sends(self, before_step: int) -> None:
        """Complete the sends of steps before ``before_step`` (see
        :meth:`StageLinks.prune_sends`)."""
        self.links.prune_sends(before_step)

    # -- handlers: each action's micro-batch gives the step its event belongs to ---------------

    def _micro(self, action: Action, span: Span) -> Microbatch:
        micro = self.batch(action.microbatch)  # type: ignore[arg-type]
        span.step = micro.step
        return micro

    def _forward(self, action: Action, span: Span) -> None:
        self.compute.forward(action, span, self._micro(action, span))

    def _backward(self, action: Action, span: Span) -> None:
        self.compute.backward(action, span, self._micro(action, span))

    def _receive(self, action: Action, span: Span) -> None:
        self.links.receive(action, span, self._micro(action, span).size)

    def _send(self, action: Action, span: Span) -> None:
        step = self._micro(action, span).step
        m = action.microbatch
        assert m is not None
        if action.kind is Kind.SEND_ACT:
            version = self.compute.versions[m] if self.links.spec.vertical_sync else None
            self.links.send(action, span, self.compute.outputs(m), step, version)
        else:
            self.links.send(action, span, self.compute.input_grads.pop(m), step)

    def _allreduce(self, action: Action, span: Span) -> None:
        if action.microbatch is not None:
            self._micro(action, span)
        self.update.allreduce(action, span)

    def _step(self, action: Action, span: Span) -> None:
        if action.microbatch is not None:
            self._micro(action, span)
        self.update.step(action, span)


def _no_batches(microbatch: int) -> Microbatch:
    raise RuntimeError(f"micro-batch {microbatch} asked for outside a step")
