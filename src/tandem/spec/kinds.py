"""The names users write for schedules and synchronization modes, read once into enums whose
properties the rest of tandem asks (no torch).

Usage::

    kind = ScheduleKind.parse("pipedream")     # ScheduleKind.PIPEDREAM
    kind.asynchronous, kind.flushes            # (True, False)
    f"{kind}"                                  # "pipedream": the name as the user wrote it
    PsMode.parse("ssp").bounded                # True

This is the only module that spells these names: everything else compares members or reads
their properties, never a name string. Each enum is a ``str`` enum whose value is the name, so
f-strings, JSON and plan files print exactly what the user wrote.
"""

from __future__ import annotations

import enum


class ScheduleKind(enum.StrEnum):
    """How a pipeline's workers order their forwards, backwards and optimizer steps."""

    GPIPE = "gpipe"
    """GPipe: every micro-batch's forward, then every backward, then a flush."""
    ONE_F_ONE_B = "1f1b"
    """1F1B with a flush per minibatch (PipeDream-Flush); on one stage, data parallelism."""
    PIPEDREAM = "pipedream"
    """PipeDream's asynchronous 1F1B with weight stashing: no flush, whole minibatches."""

    @classmethod
    def parse(cls, text: str) -> ScheduleKind | None:
        """The kind named ``text``; None when ``text`` names none (the caller says what else it
        may be, e.g. a schedule file)."""
        try:
            return cls(text)
        except ValueError:
            return None

    @property
    def asynchronous(self) -> bool:
        """Stages step on their own, on stale weights (PipeDream); otherwise every step ends
        with a flush that all workers share."""
        return self is ScheduleKind.PIPEDREAM

    @property
    def flushes(self) -> bool:
        """Every step drains the pipeline before the optimizer steps (GPipe, 1F1B)."""
        return not self.asynchronous

    @property
    def whole_minibatches(self) -> bool:
        """Each unit in flight is a whole global minibatch (PipeDream), not a micro-batch of it;
        a schedule of this kind counts minibatches of the whole run."""
        return self is ScheduleKind.PIPEDREAM

    @property
    def unit(self) -> str:
        """What one schedule index counts: ``minibatch`` or ``micro-batch``."""
        return "minibatch" if self.whole_minibatches else "micro-batch"

    @property
    def accumulates(self) -> bool:
        """On one stage, the micro-batches of a worker run one after another and their gradients
        add up before one allreduce: data parallelism with accumulation (1F1B only)."""
        return self is ScheduleKind.ONE_F_ONE_B

    @property
    def forwards_first(self) -> bool:
        """All forwards of a step run before any backward (GPipe)."""
        return self is ScheduleKind.GPIPE


class PsMode(enum.StrEnum):
    """When parameter servers apply the workers' pushes."""

    SYNC = "sync"
    """Every step waits for the pushes (or the first ``workers - backup`` of them)."""
    ASYNC = "async"
    """Each push is applied on arrival."""
    SSP = "ssp"
    """Asynchronous, with a bound on how far ahead of the slowest a worker may run."""

    @classmethod
    def parse(cls, text: str) -> PsMode | None:
        """The mode named ``text``; None when it names none."""
        try:
            return cls(text)
        except ValueError:
            return None

    @property
    def asynchronous(self) -> bool:
        """Each push is an update of its own (``async`` and ``ssp``), so updates may be stale."""
        return self is not PsMode.SYNC

    @property
    def bounded(self) -> bool:
        """A worker may run at most ``staleness`` updates ahead of the slowest (``ssp``)."""
        return self is PsMode.SSP


class ElasticMode(enum.StrEnum):
    """How EASGD's workers meet the center variable."""

    SYNC = "sync"
    """Every worker meets the others every period; each holds the center."""
    ASYNC = "async"
    """A server holds the center; each worker exchanges with it on its own clock."""

    @classmethod
    def parse(cls, text: str) -> ElasticMode | None:
        """The mode named ``text``; None when it names none."""
        try:
            return cls(text)
        except ValueError:
            return None

    @property
    def asynchronous(self) -> bool:
        """The center lives on servers and no barrier joins the workers."""
        return self is ElasticMode.ASYNC


class CompensationMode(enum.StrEnum):
    """Whether asynchronous updates get their momentum and learning rate compensated for
    staleness (``--async-compensation``)."""

    AUTO = "auto"
    """Compensate by the measured rules (:func:`tandem.runtime.asynchrony.compensation`)."""
    OFF = "off"
    """Leave the optimizer's settings as given."""

    @property
    def compensates(self) -> bool:
        """Stale updates get compensated settings."""
        return self is CompensationMode.AUTO
