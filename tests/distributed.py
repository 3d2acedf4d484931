"""Run a function on N local gloo processes (one thread each) and collect what each returns."""

from __future__ import annotations

import os
import queue
import signal
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import start_forkserver


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
           results: Any, environ: dict[str, str]) -> None:
    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the forkserver ignores them
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    os.environ.clear()  # the test's, not the forkserver's from whenever it started
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results.put((rank, fn(rank, world_size, *args)))
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any,
                    timeout_s: float = 120) -> list[Any]:
    """``fn(rank, world_size, *args)`` on every rank; the results in rank order.

    ``fn`` must be importable (defined at module level). Fails instead of hanging. Each rank
    is a fresh process, forked from the forkserver tandem's launcher forks its workers from.
    """
    context = mp.get_context("forkserver")
    # one server process per test session imports torch and tandem's runtime once; each rank is
    # a fork of it, ready at once, where a spawned rank would spend ~2 s of CPU importing torch
    start_forkserver()
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_entry,
                                 args=(r, world_size, port, fn, args, results, dict(os.environ)))
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
