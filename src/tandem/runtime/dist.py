"""Start-up of one worker: rank, world size, device, backend and the default process group.

Under ``torchrun`` the job is described by four environment variables; they are checked
together (a partial or inconsistent set is the user's mistake, named with its fix), and joining
the job is bounded by ``--timeout`` like every later wait.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import re
import socket
import tempfile
import time
from typing import Iterator

import torch
import torch.distributed as dist

from tandem.errors import UsageError, WorkerFailure
from tandem.runtime.faults import GROUP_RESTARTS
from tandem.runtime.launcher_env import (  # re-exported: the launcher's view of the job
    LAUNCHER_VARIABLES, check_launcher_values, under_launcher, world_size,
)
from tandem.runtime.worker_group import WorkerGroup, join_group


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WorkerEnv:
    """Where this worker stands in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    resizes: int = 0
    """Times the job started again on another number of workers before this start, as a
    torchrun agent's shared store counts them (see :mod:`tandem.runtime.worker_group`; 0
    elsewhere). Its restarts go to :func:`tandem.runtime.faults.attempt`."""


def new_group(ranks: list[int], *, timeout_s: float) -> dist.ProcessGroup:
    """A process group over ``ranks`` (every rank of the job must call this) whose operations
    give up after ``timeout_s`` seconds, like the default group's (``--timeout``); without it
    torch gives a new gloo group 30 minutes."""
    group: dist.ProcessGroup = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s))
    return group


def choose_backend(requested: str) -> str:
    """Resolve ``auto`` to NCCL when CUDA is available and gloo otherwise."""
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise UsageError("--backend nccl needs CUDA GPUs, and none is available; use gloo")
    return requested


def init_worker(*, backend: str, timeout_s: float, threads: int) -> WorkerEnv:
    """Join the job described by the environment and pick this worker's device.

    Joining waits at most ``timeout_s`` for the master and the other workers; a job that does
    not assemble raises ``WorkerFailure`` saying who is missing (``UsageError`` for a port that
    is taken).
    """
    backend = choose_backend(backend)
    check_launcher_values()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(threads)
    group: WorkerGroup | None = None
    if not dist.is_initialized():
        deadline = time.monotonic() + timeout_s
        if rank != 0:
            _wait_for_master(rank, deadline, timeout_s)
        try:
            timeout = datetime.timedelta(seconds=max(1.0, deadline - time.monotonic()))
            group = _agent_group(rank, world_size, timeout, deadline)
            with _quiet_native_stderr():
                dist.init_process_group(
                    backend, rank=rank, world_size=world_size, timeout=timeout,
                    device_id=device if backend == "nccl" else None,
                    store=None if group is None else group.store,
                )
        except WorkerFailure:
            raise
        except (dist.DistError, RuntimeError) as exc:
            raise _startup_failure(exc, rank, world_size, timeout_s) from None
    if group is not None:
        os.environ[GROUP_RESTARTS] = str(group.restarts)
    return WorkerEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=device,
                     backend=backend, resizes=0 if group is None else group.resizes)


def _agent_group(rank: int, world_size: int, timeout: datetime.timedelta,
                 deadline: float) -> WorkerGroup | None:
    """Under a torchrun agent: the agent's store, under a name of this worker group's own
    (:func:`tandem.runtime.worker_group.join_group`). The agent keeps one store for all the
    groups it starts, and ``init_process_group``'s own (unprefixed) use of it would hand a
    restarted worker the addresses of the previous group's dead ones (gloo: "Connection
    refused"). None elsewhere: ``init_process_group`` as usual."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timeout)
    return join_group(store, rank=rank, world_size=world_size, deadline=deadline)


def _wait_for_master(rank: int, deadline: float, timeout_s: float) -> None:
    """Wait until the master's port accepts connections, at most until ``deadline`` (torch's
    own connection retries can overrun the timeout by their back-off)."""
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    while True:
        try:
            with socket.create_connection((address, port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise _startup_failure(ConnectionError("could not connect"), rank,
                                       int(os.environ["WORLD_SIZE"]), timeout_s) from None
            time.sleep(0.2)


@contextlib.contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    """Keep the C++ log lines torch writes while joining (retries, stack frames) off the
    terminal; a failure is reported as one line from the exception instead."""
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _startup_failure(error: BaseException, rank: int, world_size: int,
                     timeout_s: float) -> Exception:
    """One line for a job that did not assemble: who was missing, and what to do."""
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    text = str(error)
    if "address already in use" in text.lower():
        return UsageError(f"MASTER_PORT {os.environ.get('MASTER_PORT')} is taken on this machine "
                          f"(rank {rank} listens there); choose a free MASTER_PORT")
    if joined := re.search(r"(\d+)/(\d+) clients joined", text):
        return WorkerFailure(
            f"worker rank {rank}: only {joined.group(1)} of {world_size} workers joined the job at "
            f"{where} within --timeout {timeout_s:g} s; start the other ranks with the same "
            f"MASTER_ADDR, MASTER_PORT and WORLD_SIZE={world_size} (or raise --timeout)")
    if "connect" in text.lower() and rank != 0:
        return WorkerFailure(
            f"worker rank {rank} could not reach the job's master at {where} within --timeout "
            f"{timeout_s:g} s; start rank 0 there (it listens on MASTER_PORT), or fix "
            f"MASTER_ADDR and MASTER_PORT")
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return WorkerFailure(f"worker rank {rank} could not join the job at {where} within "
                         f"--timeout {timeout_s:g} s ({type(error).__name__}: {first})")
