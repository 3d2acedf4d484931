"""Actions of a pipeline schedule and their compact text form, which parses back exactly.

Text form: ``{stage}{kind}{microbatch}`` with an optional peer worker for communication:

    2F0      stage 2, forward of micro-batch 0
    2B0      stage 2, backward of micro-batch 0
    1SA3>2   stage 1 sends the activation of micro-batch 3 to worker 2
    2RA3<1   stage 2 receives the activation of micro-batch 3 from worker 1
    2SG3>1   stage 2 sends the gradient of micro-batch 3's input to worker 1
    1RG3<2   stage 1 receives that gradient from worker 2
    0AR      stage 0's replicas allreduce their gradients (flush schedules)
    0AR5     ... after micro-batch 5's backward (asynchronous schedules)
    0ST      stage 0 takes an optimizer step; ``0ST5`` after micro-batch 5
    0PU      a data-parallel worker pushes its gradients to the parameter servers (``0PU5``:
             of step 5)
    0PL      ... and pulls the parameters back
    0GX      a gossip worker exchanges parameters with its neighbours (``0GX5``: in step 5)

Data-parallel strategies are one-stage plans, so their actions carry stage 0.
"""

from __future__ import annotations

import dataclasses
import enum
import re

from tandem.errors import UsageError


class ScheduleParseError(UsageError):
    """A schedule or action that is not written in the text form; the message names the bad
    text and shows how it should look."""


class Kind(enum.Enum):
    """What an action does; the value is its code in the text form."""

    FORWARD = "F"
    BACKWARD = "B"
    SEND_ACT = "SA"
    RECV_ACT = "RA"
    SEND_GRAD = "SG"
    RECV_GRAD = "RG"
    ALLREDUCE = "AR"
    STEP = "ST"
    PUSH = "PU"
    PULL = "PL"
    EXCHANGE = "GX"

    @property
    def is_send(self) -> bool:
        return self in (Kind.SEND_ACT, Kind.SEND_GRAD)

    @property
    def is_recv(self) -> bool:
        return self in (Kind.RECV_ACT, Kind.RECV_GRAD)

    @property
    def is_compute(self) -> bool:
        return self in (Kind.FORWARD, Kind.BACKWARD)

    @property
    def optional_microbatch(self) -> bool:
        """Whether the text form may leave the micro-batch out (synchronization actions)."""
        return self in (Kind.ALLREDUCE, Kind.STEP, Kind.PUSH, Kind.PULL, Kind.EXCHANGE)


_DESCRIPTION = {
    Kind.FORWARD: "forward", Kind.BACKWARD: "backward", Kind.SEND_ACT: "send of an activation",
    Kind.RECV_ACT: "receive of an activation", Kind.SEND_GRAD: "send of a gradient",
    Kind.RECV_GRAD: "receive of a gradient", Kind.ALLREDUCE: "allreduce",
    Kind.STEP: "optimizer step", Kind.PUSH: "push", Kind.PULL: "pull",
    Kind.EXCHANGE: "gossip exchange",
}
"""What each kind of action is called in error messages."""

_PATTERN = re.compile(r"(\d+)(F|B|SA|RA|SG|RG|AR|ST|PU|PL|GX)(\d*)(?:([<>])(\d+))?")


@dataclasses.dataclass(frozen=True, slots=True)
class Action:
    """One thing one worker does, in order, during a schedule."""

    stage: int
    """Stage index the worker runs."""
    kind: Kind
    microbatch: int | None = None
    """Micro-batch (or minibatch, in asynchronous schedules); None for a flush's AR/ST."""
    peer: int | None = None
    """Worker index sent to or received from (communication actions only)."""

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem:
            raise ScheduleParseError(problem)

    def _problem(self) -> str | None:
        """What makes this action impossible to run, in one line, or None."""
        needs_peer = self.kind.is_send or self.kind.is_recv
        fields = (("stage", self.stage), ("micro-batch", self.microbatch), ("peer", self.peer))
        name = _DESCRIPTION[self.kind]
        for field, value in fields:
            if value is not None and (not isinstance(value, int) or value < 0):
                return (f"the {field} of a {name} must be a whole number of 0 or more "
                        f"(got {value!r})")
        if needs_peer and self.peer is None:
            arrow = ">" if self.kind.is_send else "<"
            return f"action '{self}': a {name} needs its peer worker (e.g. {self}{arrow}1)"
        if not needs_peer and self.peer is not None:
            return (f"a {name} of stage {self.stage} takes no peer (peer: {self.peer}); "
                    "only sends and receives name one")
        if self.microbatch is None and not self.kind.optional_microbatch:
            return f"action '{self}': a {name} needs a micro-batch (e.g. {self}0)"
        return None

    def __str__(self) -> str:
        text = f"{self.stage}{self.kind.value}{'' if self.microbatch is None else self.microbatch}"
        if self.peer is not None:
            text += f"{'>' if self.kind.is_send else '<'}{self.peer}"
        return text

    @classmethod
    def parse(cls, text: str) -> Action:
        """The action written as ``text`` (inverse of ``str``); :class:`ScheduleParseError`
        (a ``ValueError``) naming the text otherwise."""
        match = _PATTERN.fullmatch(text.strip())
        if not match:
            raise ScheduleParseError(f"not a schedule action: {text!r} (expected e.g. 2F0, "
                                     "1SA3>2, 2RA3<1, 0AR, 0ST)")
        stage, code, microbatch, arrow, peer = match.groups()
        kind = Kind(code)
        if (arrow == ">") != kind.is_send or (arrow == "<") != kind.is_recv:
            raise ScheduleParseError(f"action {text!r}: sends take '>peer' (1SA3>2), receives "
                                     "'<peer' (2RA3<1), other actions none")
        return cls(stage=int(stage), kind=kind, microbatch=int(microbatch) if microbatch else None,
                   peer=int(peer) if peer else None)
