"""The preloaded process local workers fork from: a ``multiprocessing`` forkserver that has
imported torch and tandem's runtime once, so that a worker starts in milliseconds instead of
importing torch again (seconds of CPU each).

What differs between jobs and attempts (the environment: ``TANDEM_ATTEMPT``, the progress
directory, ``TANDEM_FAULT``, the launcher's mark) travels with the job in :class:`Carried`;
the rank's own variables come from the elastic agent as before, and the forkserver's
preparation data carries ``sys.path`` and the working directory. Stop signals never reach the
forkserver's imports (:mod:`tandem.runtime.zygote_boot`); it ends when its launcher does.

Usage::

    start()                                   # early, before the launcher imports torch
    elastic_launch(config(start_method=START_METHOD), Carried.of(fn))(arg)

Not torch: this module imports only the standard library, so the forkserver's imports can run
while the launcher still reads its arguments.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any, Callable

START_METHOD = "forkserver"
"""How tandem's launcher starts local workers (elastic agent's ``start_method``)."""
PRELOAD = ["tandem.runtime.zygote_boot", "torch", "torch.distributed", "torch._dynamo",
           "torch.nn.parallel", "tandem.runtime.worker",
           "tandem.runtime.pipeline.trainer"]
"""Imported once by the forkserver, in this order (the first keeps stop signals away from the
rest); a worker forked from it finds them imported."""
AGENT_VARIABLES = frozenset({
    "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
})
"""Variables the elastic agent sets in each worker (with every ``TORCHELASTIC_*``): the
rank's own, kept over the launcher's environment."""


def available() -> bool:
    """Whether this platform has a forkserver (Linux and macOS do; Windows does not)."""
    return START_METHOD in multiprocessing.get_all_start_methods()


def start_method() -> str:
    """The start method for local workers: the forkserver where there is one, else spawn."""
    return START_METHOD if available() else "spawn"


def start() -> None:
    """Start this process's forkserver now, if it is not running, so that its imports overlap
    the launcher's own work; a no-op where there is none. Idempotent and cheap."""
    if not available():
        return
    if not _running():
        multiprocessing.set_forkserver_preload(PRELOAD)
    with _interrupts_ignored_by_children():
        multiprocessing.forkserver.ensure_running()


@contextlib.contextmanager
def _interrupts_ignored_by_children() -> Iterator[None]:
    """Start the forkserver with SIGINT ignored, as its own ``main`` then keeps it: a Ctrl-C to
    the terminal's process group while it imports would otherwise print a KeyboardInterrupt
    traceback of its own (an ignored signal stays ignored across ``exec``). This process ignores
    SIGINT only for the fork and exec (its own handler is back at once)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def _running() -> bool:
    server = multiprocessing.forkserver._forkserver  # noqa: SLF001 - no public accessor
    return getattr(server, "_forkserver_pid", None) is not None


def _agent_variable(name: str) -> bool:
    return name in AGENT_VARIABLES or name.startswith("TORCHELASTIC_")


class Carried:
    """A worker's function with the launcher's environment at the moment of the launch: the
    worker takes that environment (keeping the variables the agent gave its rank), then runs
    the function. It pickles as the function does, and bears its name (the elastic agent names
    the job's role and events after it)."""

    def __init__(self, fn: Callable[[Any], Any], environ: dict[str, str]) -> None:
        self.fn, self.environ = fn, environ
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)

    @classmethod
    def of(cls, fn: Callable[[Any], Any]) -> Carried:
        """``fn`` with this process's environment now."""
        return cls(fn, {k: v for k, v in os.environ.items() if not _agent_variable(k)})

    def __call__(self, arg: Any) -> Any:
        _let_go_of_the_forkserver()
        for name in [name for name in os.environ if not _agent_variable(name)]:
            if name not in self.environ:
                del os.environ[name]
        os.environ.update({k: v for k, v in self.environ.items() if not _agent_variable(k)})
        return self.fn(arg)


def _let_go_of_the_forkserver() -> None:
    """In a worker: close this process's copy of the forkserver's "alive" pipe, so that the
    forkserver ends (and every worker with it, see :mod:`tandem.runtime.zygote_boot`) as soon as
    the launcher ends, however it ends; a worker that kept it would keep the forkserver, and so
    itself, alive after a killed launcher. A worker's own children fork (:func:`child_context`)."""
    server: Any = multiprocessing.forkserver._forkserver  # noqa: SLF001 - no public accessor
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None and multiprocessing.parent_process() is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None  # noqa: SLF001


def child_context() -> Any:
    """The ``multiprocessing`` context for a worker's own children (its loader processes, the
    supervised trainer of an asynchronous worker): fork where the platform has it — the worker
    is already preloaded, and a spawned child would import torch again (seconds of CPU) — else
    the platform's default. Fork before the worker starts threads or uses CUDA."""
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else methods[0])


def stop() -> None:
    """End this process's forkserver now, if it runs, and reap it: a command line's last act
    (a forkserver left to end by itself stays a zombie until init collects it, and one still
    importing would make the command wait for its imports). Its children end with it."""
    if not (available() and _running()):
        return
    server: Any = multiprocessing.forkserver._forkserver  # noqa: SLF001 - no public stop
    with contextlib.suppress(ProcessLookupError):
        os.kill(server._forkserver_pid, signal.SIGKILL)  # noqa: SLF001
    server._stop()  # noqa: SLF001 - closes its pipe and socket, and reaps it
    tracker: Any = multiprocessing.resource_tracker._resource_tracker  # started with the server
    if getattr(tracker, "_fd", None) is not None:
        tracker._stop()  # noqa: SLF001 - it cleans up what is left, and is reaped
