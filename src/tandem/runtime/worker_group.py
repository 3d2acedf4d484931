"""One torchrun worker group's own part of the agent's store: a name its workers agree on, and
the job's restarts and resizes counted where every group of the job sees them.

A torchrun agent that shares its store with the workers (torch's default; not with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, where each group's rank 0 hosts a new store and none of
this runs) keeps one store for all the worker groups it starts, and it numbers its
restarts itself (``TORCHELASTIC_RESTART_COUNT``): a group restarted because a node joined keeps
the previous group's number, and a node that joins later counts from 0 while the others count
their failures. So that a group never reads a previous group's keys (gloo's addresses of dead
workers, their heartbeats), rank 0 makes a new name for the group and hands it to each other
rank by a handshake that stale keys cannot fool: rank ``r`` writes a fresh nonce, rank 0
answers every nonce it sees with the name, and ``r`` takes the answer to its own nonce.

Usage::

    group = join_group(store, rank=rank, world_size=world, deadline=deadline)
    dist.init_process_group("gloo", store=group.store, rank=rank, world_size=world)
"""

from __future__ import annotations

import dataclasses
import time
import uuid

import torch.distributed as dist

from tandem.errors import WorkerFailure

PREFIX = "/tandem/groups"
"""Where the handshake's keys and every group's own keys live in the agent's store."""
_LED = False
"""Whether this process has led a group already (a second ``tandem.fit`` in one worker)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WorkerGroup:
    """The group this worker joined: its own store, and what rank 0 counted of the job."""

    store: dist.Store
    name: str
    groups: int
    """Worker groups the agent's store has seen start (1 in a job's first)."""
    resizes: int
    """Times a group started with another number of workers than the group before it."""

    @property
    def restarts(self) -> int:
        """Times the job's workers started again (after a failure or a node joining)."""
        return self.groups - 1


def join_group(store: dist.Store, *, rank: int, world_size: int,
               deadline: float) -> WorkerGroup:
    """Agree with the other ranks on a new group's name (see the module docstring), at most
    until ``deadline`` (``time.monotonic()``); a rank that does not answer in time is named in
    a :class:`WorkerFailure`."""
    if rank == 0:
        name, groups, resizes = _lead(store, world_size, deadline)
    else:
        name = _follow(store, rank, world_size, deadline)
        groups, resizes = (int(store.get(f"{PREFIX}/{name}/{key}")) for key in ("groups", "resizes"))
    return WorkerGroup(store=dist.PrefixStore(f"{PREFIX}/{name}", store), name=name,
                       groups=groups, resizes=resizes)


def _lead(store: dist.Store, world_size: int, deadline: float) -> tuple[str, int, int]:
    """Rank 0: name the group, count it, and answer every other rank's nonce with the name."""
    global _LED  # once per process: a second run in it is no restart
    name = uuid.uuid4().hex
    groups = store.add(f"{PREFIX}/count", 0 if _LED else 1)
    _LED = True
    last = store.get(f"{PREFIX}/world").decode() if store.check([f"{PREFIX}/world"]) else None
    resized = last is not None and int(last) != world_size
    resizes = store.add(f"{PREFIX}/resizes", 1 if resized else 0)
    store.set(f"{PREFIX}/world", str(world_size))
    store.set(f"{PREFIX}/{name}/groups", str(groups))
    store.set(f"{PREFIX}/{name}/resizes", str(resizes))
    answered: dict[int, str] = {}
    waiting = set(range(1, world_size))
    pause = 0.002
    while waiting:
        for rank in sorted(waiting):
            if not store.check([f"{PREFIX}/nonce/{rank}"]):
                continue
            nonce = store.get(f"{PREFIX}/nonce/{rank}").decode()
            if answered.get(rank) != nonce:  # a stale nonce is answered too, harmlessly
                store.set(f"{PREFIX}/answer/{rank}", f"{nonce}:{name}")
                answered[rank] = nonce
            joined = f"{PREFIX}/{name}/joined/{rank}"
            # joined by the rank whose nonce is the latest: a worker left over from a group
            # before (still polling with its old nonce) may take an answer, but not the place
            if store.check([joined]) and store.get(joined).decode() == nonce:
                waiting.discard(rank)
        if waiting:
            _wait(deadline, pause, waiting, world_size)
            pause = min(pause * 2, 0.05)
    return name, groups, resizes


def _follow(store: dist.Store, rank: int, world_size: int, deadline: float) -> str:
    """Rank ``rank`` > 0: write a fresh nonce and wait for rank 0's answer to it."""
    nonce = uuid.uuid4().hex
    store.set(f"{PREFIX}/nonce/{rank}", nonce)
    pause = 0.002
    while True:
        if store.check([f"{PREFIX}/answer/{rank}"]):
            answer = store.get(f"{PREFIX}/answer/{rank}").decode()
            if answer.startswith(f"{nonce}:"):
                name = answer[len(nonce) + 1:]
                store.set(f"{PREFIX}/{name}/joined/{rank}", nonce)
                if store.get(f"{PREFIX}/nonce/{rank}").decode() != nonce:
                    raise WorkerFailure(f"worker rank {rank}: another process joined this "
                                        f"job as rank {rank} (a worker of a group before "
                                        f"this one that is still running?)")
                return name
        _wait(deadline, pause, {0}, world_size)
        pause = min(pause * 2, 0.05)


def _wait(deadline: float, pause: float, missing: set[int], world_size: int) -> None:
    """Sleep ``pause`` seconds, or fail naming the ``missing`` ranks past ``deadline``."""
    if time.monotonic() + pause > deadline:
        names = ", ".join(str(rank) for rank in sorted(missing))
        raise WorkerFailure(f"worker rank{'s' if len(missing) > 1 else ''} {names} of "
                            f"{world_size} did not join this worker group in time (--timeout); "
                            f"their node may have left the job or not started")
    time.sleep(pause)
