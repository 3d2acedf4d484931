"""Fault handling on a parameter server: which workers are done, which died or are stuck, and
fencing those it gives up on (asynchronous modes go on without them)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from tandem.runtime.watchdog import Heartbeat

LIVENESS_EVERY_S = 0.5
"""How often a server checks its workers' heartbeats, and waits at most for a message."""


class Liveness:
    """The workers of one server: those done (said goodbye), those given up on (dead), and the
    check of the others' heartbeats (``report``: says to the user that one was left behind)."""

    def __init__(self, workers: Iterable[int], beat: Heartbeat, *, timeout_s: float,
                 report: Callable[[str], None]) -> None:
        self.workers = list(workers)
        self.beat = beat
        self.timeout_s = timeout_s
        self.report = report
        self.dead: set[int] = set()
        self.finished: set[int] = set()
        self.checked_at = time.monotonic()

    def live(self) -> list[int]:
        """The workers neither done nor given up on."""
        return [w for w in self.workers if w not in self.finished and w not in self.dead]

    def remaining(self) -> set[int]:
        """The workers that have not said goodbye and are not given up on."""
        return set(self.workers) - self.finished - self.dead

    def all_gone(self) -> bool:
        """Whether no worker is left: each is done or given up on."""
        return set(self.workers) <= self.dead | self.finished

    def due(self) -> bool:
        """Whether the last check is older than :data:`LIVENESS_EVERY_S`."""
        return time.monotonic() - self.checked_at > LIVENESS_EVERY_S

    def check(self, held: set[int]) -> None:
        """Give up on workers whose heartbeat stopped, or whose heartbeat goes on with no
        progress for ``--timeout`` while no server holds them back (``held``: stuck); either is
        fenced, so that it ends instead of outliving the job."""
        self.checked_at = time.monotonic()
        live = self.live()
        for worker in sorted(self.beat.silent(live)):
            self.give_up(worker, "stopped responding")
        # before this server's own receive gives up (--timeout after the last message)
        after_s = max(self.timeout_s - 2 * LIVENESS_EVERY_S, LIVENESS_EVERY_S)
        stuck = self.beat.stalled([w for w in live if w not in self.dead and w not in held],
                                  after_s=after_s)
        for worker, (step, phase) in sorted(stuck.items()):
            self.give_up(worker, f"is stuck at step {step} ({phase}), no progress for "
                                 f"{after_s:g} s")

    def give_up(self, worker: int, why: str) -> None:
        """Go on without ``worker``: fence it, and say why."""
        self.dead.add(worker)
        self.beat.fence(worker, why)
        self.report(f"worker rank {worker} {why}; asynchronous training goes on without it")
