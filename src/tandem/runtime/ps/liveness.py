"""Fault handling on a parameter server: which workers are done, which died or are stuck, and
fencing those it gives up on (asynchronous modes go on without them)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from tandem.runtime.watchdog import SILENT_AFTER_S, Heartbeat

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
        self.lost_at = float("-inf")
        """When the last worker was lost (:meth:`lost`), on the monotonic clock."""

    def live(self) -> list[int]:
        """The workers neither done nor given up on."""
        return [w for w in self.workers if w not in self.finished and w not in self.dead]

    def remaining(self) -> set[int]:
        """The workers that have not said goodbye and are not given up on."""
        return set(self.workers) - self.finished - self.dead

    def all_gone(self) -> bool:
        """Whether no worker is left: each is done or given up on, the last lost one (its
        process ended) ``SILENT_AFTER_S`` ago or more: its supervisor may be stopping the job
        for a reason of its own (the user's mistake, divergence, a server that failed it),
        which the launcher names rather than this server's "every worker died"."""
        return (set(self.workers) <= self.dead | self.finished
                and time.monotonic() - self.lost_at > SILENT_AFTER_S)

    def due(self) -> bool:
        """Whether the last check is older than :data:`LIVENESS_EVERY_S`."""
        return time.monotonic() - self.checked_at > LIVENESS_EVERY_S

    def check(self, held: set[int]) -> None:
        """Give up on workers whose heartbeat stopped, whose supervising process is stopped, or
        whose heartbeat goes on with no progress for ``--timeout`` while no server holds them
        back (``held``: stuck); each is fenced, so that it ends instead of outliving the job.

        A check that comes ``SILENT_AFTER_S / 2`` after the last one judges nobody: this server
        was itself stopped or starved, and its workers waited for it."""
        now = time.monotonic()
        frozen = now - self.checked_at > SILENT_AFTER_S / 2
        self.checked_at = now
        if frozen:
            return
        live, beats = self.live(), self.beat.read_beats()
        for worker in sorted(self.beat.silent(live, beats)):
            self.give_up(worker, "stopped responding (no heartbeat for "
                                 f"{SILENT_AFTER_S:g}+ s)")
        for worker in sorted(self.beat.parents_stopped(self.live(), beats)):
            self.give_up(worker, "stopped responding (its supervising process has been "
                                 f"stopped for {SILENT_AFTER_S:g}+ s)")
        # before the worker's own wait for a reply gives up (--timeout)
        after_s = max(self.timeout_s - 2 * LIVENESS_EVERY_S, LIVENESS_EVERY_S)
        stuck = self.beat.stalled([w for w in self.live() if w not in held], after_s=after_s,
                                  beats=beats)
        for worker, (step, phase) in sorted(stuck.items()):
            self.give_up(worker, f"is stuck at step {step} ({phase}), no progress for "
                                 f"{after_s:g} s")

    def lost(self, worker: int, error: BaseException, *, stop: bool) -> None:
        """``worker``'s connection failed with ``error`` (its process ended) before it said
        goodbye: raise ``error`` where the run ``stop``s (synchronous modes: the launcher names
        the worker that died), else go on without it. One whose heartbeat had stopped long
        before (a frozen worker its supervisor killed) is named here; another's supervisor
        says that it died."""
        if worker not in self.live():
            return
        if stop:
            raise error
        if self.beat.silent([worker]):
            self.give_up(worker, f"stopped responding (no heartbeat for {SILENT_AFTER_S:g}+ s)")
        self.dead.add(worker)
        self.lost_at = time.monotonic()

    def give_up(self, worker: int, why: str) -> None:
        """Go on without ``worker``: fence it, and say why."""
        self.dead.add(worker)
        self.beat.fence(worker, why)
        self.report(f"worker rank {worker} {why}; asynchronous training goes on without it")
