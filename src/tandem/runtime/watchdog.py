"""Heartbeats through the job's store, so that a worker which times out can name the one it
waited for (stuck or dead) instead of only reporting its own timeout.

A worker also records which workers of its machine died, for the workers of other machines
(:mod:`tandem.runtime.death_notice`).
"""

from __future__ import annotations

import contextlib
import multiprocessing.util
import os
import signal
import socket
import subprocess
import threading
import time
from typing import Any

import torch.distributed as dist

from tandem.errors import WorkerFailure
from tandem.runtime.death_notice import DeathNotices

PERIOD_S = 0.5
SILENT_AFTER_S = 10.0
"""A worker whose heartbeat is older than this is taken for dead or hung (a loaded machine can
delay a heartbeat thread by seconds, so this is generous)."""
FRESH_S = 3.0
"""A heartbeat at most this old shows a running heartbeat thread: one older may be a stopped
(SIGSTOP) or dead process's, whose beat ages from then on, and is judged once it is silent."""
WAITING = "pull"
"""The phase of a worker waiting for its parameter servers' replies (never stuck itself: its
wait is bounded by ``--timeout``, and names the server it waited for)."""
PARENT_STOPPED = "stopped"
"""The phase a supervised worker publishes once its supervising process has been stopped
(SIGSTOP) for ``SILENT_AFTER_S``: its servers leave it behind, and it then ends."""
DIAGNOSIS_GRACE_S = 1.0
"""How long a worker whose collective failed waits before it reads the others' heartbeats: a
peer that died is reported by the launcher meanwhile (which then stops this worker, so that the
death, not this worker's view of it, names the failure), and living peers publish fresh
progress (a beat is up to ``PERIOD_S`` old)."""
FENCED_EXIT = 75
"""The exit status of a worker that ended itself because a server fenced it."""

Beats = dict[int, tuple[int, str, float, float]]
"""Per rank: its last published step, phase, wall time, and wall time since that step and
phase (:meth:`Heartbeat.read_beats`)."""


class Heartbeat:
    """A background thread that publishes this worker's progress every ``PERIOD_S`` seconds.

    The training loop only assigns ``step`` and ``phase`` (no communication on the hot path).
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, *, fenceable: bool = False,
                 mirror: Any = None) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self._step = 0
        self._phase = "start"
        self.fenceable = fenceable
        """Whether this worker ends its own process once a server fences it (:meth:`fence`): a
        supervised one, which also watches its supervisor (:data:`PARENT_STOPPED`)."""
        self.peers: list[int] | None = None
        """The ranks this worker waits for (an asynchronous parameter-server worker: the
        servers), which :meth:`diagnose` considers; None: every other rank."""
        self.peer_kind = "worker"
        """What :meth:`diagnose` calls them (``server`` for :attr:`peers` that serve)."""
        self._parent_stopped_since: float | None = None
        self.mirror = mirror
        """A shared ``multiprocessing.Value('d')`` given the time of every beat, for a
        supervising parent process to see this one freeze."""
        self._lock = threading.Lock()
        """Serializes this process's use of the store client between the threads."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="tandem-heartbeat", daemon=True)
        self._since = time.time()
        self.deaths = DeathNotices(store, rank, world_size, self._lock)
        """Which workers of this machine died, for the other machines' (under torchrun)."""

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        if value != self._step:
            self._step, self._since = value, time.time()

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        if value != self._phase:
            self._phase, self._since = value, time.time()

    def __enter__(self) -> Heartbeat:
        with self._lock:
            self.store.set(f"tandem/where/{self.rank}", f"{socket.gethostname()} {os.getpid()}")
            self.deaths.joined()
        self._publish()
        self._thread.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5 * PERIOD_S)  # never tear the store down under a write
        if self.deaths.active and exc_type is not None:
            with contextlib.suppress(Exception):
                if isinstance(exc_type, type) and issubclass(exc_type, KeyboardInterrupt):
                    self.deaths.record()  # the agent stops this node's workers: one died
                self.deaths.ended(getattr(exc_type, "__name__", ""))  # this one is not dead
        if exc_type is None:  # a finished worker is not a silent one
            self.phase = "done"
            try:
                self._publish()
            except Exception:  # noqa: BLE001 - the job is over for this worker anyway
                pass

    def _publish(self) -> None:
        now = time.time()
        stopped = self._parent_stopped_since
        phase = (PARENT_STOPPED if stopped is not None and now - stopped > SILENT_AFTER_S
                 and self.phase != "done" else self.phase)
        with self._lock:
            self.store.set(f"tandem/heartbeat/{self.rank}",
                           f"{self.step} {phase} {now} {self._since}")
        if self.mirror is not None:
            self.mirror.value = now

    def _beat(self) -> None:
        failures = 0
        while not self._stop.wait(PERIOD_S):
            try:
                if self.fenceable:
                    self._watch_parent()
                self._publish()
                if self.fenceable:
                    self._obey_fence()
                if self.deaths.active:
                    self.deaths.record()
                failures = 0
            except Exception:  # noqa: BLE001 - a busy store; give up only if it is gone
                failures += 1
                if failures * PERIOD_S > SILENT_AFTER_S:
                    return

    def fence(self, rank: int, reason: str) -> None:
        """Declare worker ``rank`` out of the job: a fenceable worker ends its process when it
        sees this (even with its main thread stuck), so that it cannot outlive the job."""
        with self._lock:
            self.store.set(f"tandem/fenced/{rank}", reason)

    def _obey_fence(self) -> None:
        with self._lock:
            fenced = self.store.check([f"tandem/fenced/{self.rank}"])
        if fenced:
            continue_if_stopped(os.getppid())  # a stopped supervisor could not end with it
            os._exit(FENCED_EXIT)  # the main thread may be stuck; nothing is left to save

    def _watch_parent(self) -> None:
        """Note since when the supervising process has been stopped (SIGSTOP, a debugger):
        :meth:`_publish` says so once it has been for ``SILENT_AFTER_S``."""
        if process_state(os.getppid()) in STOPPED_STATES:
            self._parent_stopped_since = self._parent_stopped_since or time.time()
        else:
            self._parent_stopped_since = None

    def silent(self, ranks: list[int], beats: Beats | None = None) -> set[int]:
        """The ranks among ``ranks`` whose heartbeat stopped (dead, hung or stopped), of
        ``beats`` (default: read now)."""
        beats, now = self.read_beats() if beats is None else beats, time.time()
        return {r for r in ranks if r in beats and beats[r][1] != "done"
                and now - beats[r][2] > SILENT_AFTER_S}

    def stalled(self, ranks: list[int], after_s: float,
                beats: Beats | None = None) -> dict[int, tuple[int, str]]:
        """The ranks among ``ranks`` whose heartbeat goes on (is fresh) but whose step and phase
        have not changed for ``after_s`` seconds (a stuck main thread), with where they are
        stuck. Start-up is not judged here (its waits have their own time limits), nor a wait
        for a server (:data:`WAITING`), nor a stale beat (:data:`FRESH_S`: a stopped process
        is silent soon)."""
        beats, now = self.read_beats() if beats is None else beats, time.time()
        return {r: beats[r][:2] for r in ranks if r in beats
                and beats[r][1] not in ("start", "done", WAITING, PARENT_STOPPED)
                and now - beats[r][2] <= FRESH_S and now - beats[r][3] > after_s}

    def parents_stopped(self, ranks: list[int], beats: Beats | None = None) -> set[int]:
        """The ranks among ``ranks`` whose supervising process is stopped
        (:data:`PARENT_STOPPED`)."""
        beats = self.read_beats() if beats is None else beats
        return {r for r in ranks if r in beats and beats[r][1] == PARENT_STOPPED}

    def diagnose(self, error: BaseException) -> WorkerFailure:
        """Explain a failed collective by naming the workers (of :attr:`peers`) that fell
        silent or behind (after ``DIAGNOSIS_GRACE_S``, and once each beat is fresh or silent)."""
        time.sleep(DIAGNOSIS_GRACE_S)
        here = f"rank {self.rank} gave up waiting at step {self.step} ({self.phase})"
        dead = {}
        with contextlib.suppress(Exception):  # no store: judge by the beats below, if any
            if self.deaths.active:
                self.deaths.record()
                dead = self.deaths.read()
        if dead:
            where = "; ".join(f"rank {rank} on {host}" for rank, host in sorted(dead.items()))
            return WorkerFailure(f"worker {where} died (its process ended); {here}")
        peers = [r for r in (range(self.world_size) if self.peers is None else self.peers)
                 if r != self.rank]
        beats = self._settled_beats(peers)
        now = time.time()
        silent = [r for r in peers
                  if r not in beats or (beats[r][1] != "done" and now - beats[r][2] > SILENT_AFTER_S)]
        if silent:
            ranks = ", ".join(map(str, silent))
            for rank in silent:
                self._end_if_local(rank)
            return WorkerFailure(f"{self.peer_kind} rank {ranks} stopped responding (no "
                                 f"heartbeat for {SILENT_AFTER_S:g}+ s); {here}")
        mine = _progress(self.step, self.phase)
        behind = [r for r in peers if r in beats and _progress(*beats[r][:2]) < mine]
        if behind:
            lowest = min(_progress(*beats[r][:2]) for r in behind)
            where = ", ".join(f"rank {r} at step {beats[r][0]} ({beats[r][1]})" for r in behind
                              if _progress(*beats[r][:2]) == lowest)
            return WorkerFailure(f"{self.peer_kind} {where} is stuck; {here}")
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return WorkerFailure(f"{here}: {first_line}")

    def _settled_beats(self, peers: list[int]) -> Beats:
        """The beats, once none of ``peers`` has one between fresh and silent: a peer whose beat
        is stale has just stopped or is late, and is waited for (up to ``SILENT_AFTER_S``) to
        beat again or fall silent, so that a stopped peer is named at any ``--timeout``."""
        deadline = time.monotonic() + SILENT_AFTER_S
        while True:
            beats, now = self.read_beats(), time.time()
            unsettled = [r for r in peers if r in beats and beats[r][1] != "done"
                         and FRESH_S < now - beats[r][2] <= SILENT_AFTER_S]
            if not unsettled or time.monotonic() > deadline:
                return beats
            time.sleep(PERIOD_S)

    def _end_if_local(self, rank: int) -> None:
        """Continue a silent worker on this machine a second after this process has exited:
        a stopped (SIGSTOP) process handles no SIGTERM until it is continued, and the launcher,
        which sends one when this process's failure (and diagnosis) is recorded, would wait
        30 s before killing it. Workers die at SIGTERM's default action."""
        try:
            with self._lock:
                host, pid = self.store.get(f"tandem/where/{rank}").decode().split()
        except Exception:  # noqa: BLE001 - no record: it never started, or the store is gone
            return
        if host == socket.gethostname() and int(pid) != os.getpid():
            # at this process's exit, as ``atexit`` would, but also in a worker forked from
            # the forkserver, which ends without running ``atexit``'s handlers
            multiprocessing.util.Finalize(None, _continue_later, (int(pid),), exitpriority=0)

    def read_beats(self, ranks: list[int] | None = None) -> Beats:
        """Last published ``(step, phase, wall time, wall time since that step and phase)`` of
        every worker (of ``ranks``) that has one."""
        beats: Beats = {}
        for rank in range(self.world_size) if ranks is None else ranks:
            key = f"tandem/heartbeat/{rank}"
            try:
                with self._lock:
                    if not self.store.check([key]):
                        continue
                    step, phase, stamp, since = self.store.get(key).decode().split()
            except Exception:  # noqa: BLE001 - an unreadable beat is itself the diagnosis
                continue
            beats[rank] = (int(step), phase, float(stamp), float(since))
        return beats


_COMMUNICATION_SIGNS = ("timed out", "timeout", "connection closed", "connection reset",
                        "broken pipe", "peer")


def is_communication_error(error: BaseException) -> bool:
    """Whether ``error`` came from a collective or point-to-point operation with a peer."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error).lower()
    return any(sign in text for sign in _COMMUNICATION_SIGNS)


PHASES = ("start", "forward", "backward", "step", WAITING, "evaluate", "save", "done")
STOPPED_STATES = ("T", "t")
"""States of ``/proc/PID/stat`` of a stopped process (by a signal, or by a debugger)."""


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` (``R``, ``S``, ``T``, ...); None where it is gone
    or there is no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def continue_if_stopped(pid: int) -> None:
    """Send SIGCONT to process ``pid`` if it is stopped: a stopped process cannot end (SIGTERM
    waits until it runs, and its children stay unreaped), so whoever ends its part of the job
    continues it."""
    if process_state(pid) in STOPPED_STATES:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGCONT)


def _continue_later(pid: int) -> None:
    """SIGCONT to ``pid`` in a second, from a short-lived process of its own session (this one
    is exiting)."""
    subprocess.Popen(["/bin/sh", "-c", f"sleep 1; kill -CONT {pid} 2>/dev/null"],
                     start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _progress(step: int, phase: str) -> tuple[int, int]:
    return step, PHASES.index(phase) if phase in PHASES else 0
