"""Start-up of one worker: rank, world size, device, backend and the default process group."""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist

from tandem.errors import UsageError


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WorkerEnv:
    """Where this worker stands in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def under_launcher() -> bool:
    """True when started by ``torchrun``/the elastic agent (rank and world in the environment)."""
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def world_size() -> int:
    """The job's number of processes under ``torchrun`` (``WORLD_SIZE``)."""
    return int(os.environ["WORLD_SIZE"])


def choose_backend(requested: str) -> str:
    """Resolve ``auto`` to NCCL when CUDA is available and gloo otherwise."""
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise UsageError("--backend nccl needs CUDA GPUs, and none is available; use gloo")
    return requested


def init_worker(*, backend: str, timeout_s: float, threads: int) -> WorkerEnv:
    """Join the job described by the environment and pick this worker's device."""
    backend = choose_backend(backend)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(threads)
    if not dist.is_initialized():
        dist.init_process_group(
            backend, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if backend == "nccl" else None,
        )
    return WorkerEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=device,
                     backend=backend)
