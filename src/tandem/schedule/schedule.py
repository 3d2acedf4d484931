"""A schedule: for every worker of a pipeline, the ordered list of its actions.

Workers are numbered stage-major: stage 0's replicas first, then stage 1's, and so on.
Micro-batch ``m`` of stage ``s`` runs on replica ``m % replicas[s]`` (round-robin, as in
PipeDream).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from tandem.schedule.action import Action, ScheduleParseError
from tandem.spec.kinds import ScheduleKind

SCHEDULE_KINDS = tuple(kind.value for kind in ScheduleKind)
"""The schedule kinds' names, as ``--schedule`` takes them."""
_HEADER = re.compile(r"(\S+)\s+replicas=(\d+(?:-\d+)*)\s+microbatches=(\d+)")
_HEADER_EXAMPLE = "'1f1b replicas=2-1 microbatches=4'"
_WORKER = re.compile(r"w(\d+)\s*:(.*)")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """Per-worker action lists of one training step (flush schedules) or one whole run
    (PipeDream's asynchronous schedule)."""

    kind: ScheduleKind
    """``gpipe``, ``1f1b`` (with a flush per minibatch) or ``pipedream`` (asynchronous); a name
    given is read into its :class:`ScheduleKind`."""
    replicas: tuple[int, ...]
    """Replica count of each stage; their sum is the number of workers."""
    num_microbatches: int
    """Micro-batches per step (flush schedules) or minibatches in the run (``pipedream``)."""
    workers: tuple[tuple[Action, ...], ...]
    """Actions of each worker, in order."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", _kind(self.kind))  # frozen: a name is read once, here
        replicas = "-".join(map(str, self.replicas))
        if not self.replicas or any(not isinstance(r, int) or r < 1 for r in self.replicas):
            raise ScheduleParseError(f"every stage needs at least one replica (replicas: "
                                     f"{replicas or 'none'}); write e.g. replicas=2-1")
        if not isinstance(self.num_microbatches, int) or self.num_microbatches < 1:
            raise ScheduleParseError(f"a schedule needs at least one micro-batch "
                                     f"(microbatches: {self.num_microbatches})")
        if len(self.workers) != self.num_workers:
            raise ScheduleParseError(
                f"replicas {replicas} make {self.num_workers} workers but the schedule lists "
                f"{len(self.workers)}; write one line per worker, w0 to w{self.num_workers - 1}"
            )

    @property
    def num_stages(self) -> int:
        return len(self.replicas)

    @property
    def num_workers(self) -> int:
        return sum(self.replicas)

    def worker_of(self, stage: int, replica: int) -> int:
        """Worker index of ``replica`` of ``stage``."""
        return worker_of(self.replicas, stage, replica)

    def stage_of(self, worker: int) -> tuple[int, int]:
        """``(stage, replica)`` that ``worker`` runs."""
        for stage, count in enumerate(self.replicas):
            if worker < count:
                return stage, worker
            worker -= count
        raise IndexError("worker index beyond the schedule's workers")

    def worker_for(self, stage: int, microbatch: int) -> int:
        """The worker that runs ``microbatch`` on ``stage`` (round-robin over replicas)."""
        return worker_for(self.replicas, stage, microbatch)

    def text(self) -> str:
        """One line per worker: ``w0: 0F0 0SA0>1 ...``; :meth:`parse` reads it back."""
        header = f"{self.kind} replicas={'-'.join(map(str, self.replicas))} microbatches={self.num_microbatches}"
        lines = [f"w{index}: {' '.join(map(str, actions))}" for index, actions in enumerate(self.workers)]
        return "\n".join([header, *lines])

    @classmethod
    def parse(cls, text: str) -> Schedule:
        """The schedule written by :meth:`text`; :class:`ScheduleParseError` (a ``ValueError``)
        naming the bad line and how it should look otherwise."""
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if not lines:
            raise ScheduleParseError(f"empty schedule: its first line must be like "
                                     f"{_HEADER_EXAMPLE}, then one line per worker")
        header = _HEADER.fullmatch(lines[0])
        if not header:
            raise ScheduleParseError(f"schedule header {lines[0]!r} is not like "
                                     f"{_HEADER_EXAMPLE}")
        name, replicas, microbatches = header.groups()
        kind = _kind(name)
        workers = tuple(_parse_worker(index, line) for index, line in enumerate(lines[1:]))
        return cls(kind=kind, replicas=tuple(int(r) for r in replicas.split("-")),
                   num_microbatches=int(microbatches), workers=workers)


def _kind(name: ScheduleKind | str) -> ScheduleKind:
    """The schedule kind ``name`` names; :class:`ScheduleParseError` naming the known ones."""
    kind = ScheduleKind.parse(name)
    if kind is None:
        raise ScheduleParseError(f"unknown schedule kind {name!r} (known: "
                                 f"{', '.join(SCHEDULE_KINDS)})")
    return kind


def _parse_worker(index: int, line: str) -> tuple[Action, ...]:
    """The actions of the line ``w{index}: ...``."""
    match = _WORKER.fullmatch(line)
    if not match or int(match[1]) != index:
        raise ScheduleParseError(f"schedule line {line[:60]!r} should be worker {index}'s: "
                                 f"'w{index}: ' and its actions, e.g. 'w{index}: 0F0 0B0 0ST'")
    try:
        return tuple(Action.parse(item) for item in match[2].split())
    except ScheduleParseError as error:
        raise ScheduleParseError(f"w{index}: {error}") from None


def worker_of(replicas: Sequence[int], stage: int, replica: int) -> int:
    """Worker index of ``replica`` of ``stage`` when workers are numbered stage-major."""
    return sum(replicas[:stage]) + replica


def worker_for(replicas: Sequence[int], stage: int, microbatch: int) -> int:
    """The worker that runs ``microbatch`` on ``stage``: replica ``microbatch % replicas[stage]``
    (round-robin, as in PipeDream)."""
    return worker_of(replicas, stage, microbatch % replicas[stage])


def make_schedule(kind: ScheduleKind, replicas: Sequence[int], num_microbatches: int,
                  workers: Sequence[Sequence[Action]]) -> Schedule:
    """Freeze per-worker action lists into a ``Schedule``."""
    return Schedule(kind=kind, replicas=tuple(replicas), num_microbatches=num_microbatches,
                    workers=tuple(tuple(actions) for actions in workers))
