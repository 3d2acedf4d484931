"""Death notices in the job's store: each worker records which workers of its machine died, so
that a worker on another machine names the one that died, not the ones stopped after it.

Under torchrun, when a worker dies its node's agent stops that node's other workers; a worker
on another node, whose collective then fails, sees every one of them fall silent at once. The
workers of the dead one's machine can tell: its process is gone (not a zombie) and it did not
record that it ended by its own failure or a stop (``tandem/ended/RANK``). They record
``tandem/dead/RANK`` at each heartbeat and as their agent stops them. tandem's own launcher
names a dead worker itself, so its workers do none of this.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import torch.distributed as dist

from tandem.runtime.launch import LAUNCHED


class DeathNotices:
    """One worker's view of its machine's other workers, and the notices in the store."""

    def __init__(self, store: dist.Store, rank: int, world_size: int,
                 lock: threading.Lock) -> None:
        self.store, self.rank, self.world_size, self._lock = store, rank, world_size, lock
        self.active = "TORCHELASTIC_RUN_ID" in os.environ and LAUNCHED not in os.environ
        """Under a torchrun agent (not tandem's launcher, whose workers carry ``LAUNCHED``)."""
        self._neighbours: dict[int, int] | None = None
        """The other workers on this machine, rank -> process id (once every worker said where
        it runs)."""
        self._noticed: set[int] = set()
        """The neighbours whose end this worker has looked at."""

    def joined(self) -> None:
        """Count this worker among those that said where they run (``tandem/where/RANK``)."""
        self.store.add("tandem/where_count", 1)

    def record(self) -> None:
        """Record a notice for each worker of this machine whose process has ended without
        finishing (no store traffic while every neighbour lives)."""
        for rank, pid in self._neighbours_here().items():
            if rank in self._noticed or alive(pid):
                continue
            self._noticed.add(rank)
            with self._lock:
                ended = self.store.check([f"tandem/ended/{rank}"])
                beat = (self.store.get(f"tandem/heartbeat/{rank}").decode().split()
                        if self.store.check([f"tandem/heartbeat/{rank}"]) else [])
            if ended or beat[1:2] == ["done"]:
                continue
            with self._lock:
                self.store.set(f"tandem/dead/{rank}", f"{socket.gethostname()} {pid}")

    def ended(self, how: str) -> None:
        """Say that this worker ends by its own failure or a stop (``how``): not dead."""
        with self._lock:
            self.store.set(f"tandem/ended/{self.rank}", how)

    def read(self) -> dict[int, str]:
        """Every other worker's notice, rank -> the machine it ran on."""
        notices = {}
        with self._lock:
            for rank in range(self.world_size):
                if rank != self.rank and self.store.check([f"tandem/dead/{rank}"]):
                    notices[rank] = self.store.get(f"tandem/dead/{rank}").decode().split()[0]
        return notices

    def _neighbours_here(self) -> dict[int, int]:
        """The other workers on this machine (empty until every worker has said where it runs;
        read from the store once)."""
        if self._neighbours is not None:
            return self._neighbours
        with self._lock:
            if int(self.store.add("tandem/where_count", 0)) < self.world_size:
                return {}
            where = {rank: self.store.get(f"tandem/where/{rank}").decode().split()
                     for rank in range(self.world_size) if rank != self.rank}
        host = socket.gethostname()
        self._neighbours = {rank: int(pid) for rank, (at, pid) in where.items() if at == host}
        return self._neighbours


def alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine is running (not ended, not a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state not in ("Z", "X")
