"""A schedule: for every worker of a pipeline, the ordered list of its actions.

Workers are numbered stage-major: stage 0's replicas first, then stage 1's, and so on.
Micro-batch ``m`` of stage ``s`` runs on replica ``m % replicas[s]`` (round-robin, as in
PipeDream).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tandem.schedule.action import Action

SCHEDULE_KINDS = ("gpipe", "1f1b", "pipedream")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """Per-worker action lists of one training step (flush schedules) or one whole run
    (PipeDream's asynchronous schedule)."""

    kind: str
    """``gpipe``, ``1f1b`` (with a flush per minibatch) or ``pipedream`` (asynchronous)."""
    replicas: tuple[int, ...]
    """Replica count of each stage; their sum is the number of workers."""
    num_microbatches: int
    """Micro-batches per step (flush schedules) or minibatches in the run (``pipedream``)."""
    workers: tuple[tuple[Action, ...], ...]
    """Actions of each worker, in order."""

    def __post_init__(self) -> None:
        assert self.kind in SCHEDULE_KINDS, self.kind
        assert len(self.workers) == self.num_workers, "one action list per worker"

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
        """The schedule written by :meth:`text`."""
        header, *lines = [line for line in text.strip().splitlines() if line.strip()]
        kind, replicas_field, microbatches_field = header.split()
        replicas = tuple(int(r) for r in replicas_field.removeprefix("replicas=").split("-"))
        workers = tuple(
            tuple(Action.parse(item) for item in line.split(":", 1)[1].split())
            for line in lines
        )
        return cls(kind=kind, replicas=replicas,
                   num_microbatches=int(microbatches_field.removeprefix("microbatches=")),
                   workers=workers)


def worker_of(replicas: Sequence[int], stage: int, replica: int) -> int:
    """Worker index of ``replica`` of ``stage`` when workers are numbered stage-major."""
    return sum(replicas[:stage]) + replica


def worker_for(replicas: Sequence[int], stage: int, microbatch: int) -> int:
    """The worker that runs ``microbatch`` on ``stage``: replica ``microbatch % replicas[stage]``
    (round-robin, as in PipeDream)."""
    return worker_of(replicas, stage, microbatch % replicas[stage])


def make_schedule(kind: str, replicas: Sequence[int], num_microbatches: int,
                  workers: Sequence[Sequence[Action]]) -> Schedule:
    """Freeze per-worker action lists into a ``Schedule``."""
    return Schedule(kind=kind, replicas=tuple(replicas), num_microbatches=num_microbatches,
                    workers=tuple(tuple(actions) for actions in workers))
