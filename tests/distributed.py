"""Run a function on N local gloo processes (one thread each) and collect what each returns."""

from __future__ import annotations

import os
import queue
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
           results: Any) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results.put((rank, fn(rank, world_size, *args)))
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any,
                    timeout_s: float = 120) -> list[Any]:
    """``fn(rank, world_size, *args)`` on every rank; the results in rank order.

    ``fn`` must be importable (defined at module level). Fails instead of hanging. Each rank
    is a fresh process (forked from a server process that only imported torch and tandem).
    """
    context = mp.get_context("forkserver")
    # one server process per test session imports torch (and tandem) once; each rank is a fork
    # of it, ready at once, where a spawned rank would spend ~2 s of CPU importing torch again
    context.set_forkserver_preload(["torch", "torch.distributed", "tandem"])
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_entry, args=(r, world_size, port, fn, args, results))
                 for r in range(world_size)]
    for process in processes:
        process.start()
    collected: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, value = results.get(timeout=timeout_s)
            collected[rank] = value
    except queue.Empty:
        raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(collected))} did not "
                           f"finish within {timeout_s} s") from None
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    return [collected[r] for r in range(world_size)]
