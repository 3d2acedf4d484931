"""Start the workers of a job: N local processes through PyTorch's elastic launcher, or this
process as one worker of an external ``torchrun`` job.

Usage::

    summary = launch(train_worker, config, nproc=4, timeout_s=300)
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from typing import Any, Callable, TypeVar

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from tandem.errors import UsageError, WorkerFailure
from tandem.runtime.dist import under_launcher

R = TypeVar("R")

_NOISY_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")
_USAGE_ERROR = re.compile(r"(?:\w+\.)*UsageError: (.*)", re.DOTALL)
_WORKER_FAILURE = re.compile(r"(?:\w+\.)*WorkerFailure: (.*)", re.DOTALL)


def launch(fn: Callable[[Any], R], arg: Any, *, nproc: int, threads: int = 1) -> R | None:
    """Run ``fn(arg)`` on every worker and return rank 0's result.

    Under ``torchrun`` this process is one worker and ``fn`` runs here. Otherwise ``nproc``
    local workers are started; if one fails, the others are stopped and ``WorkerFailure``
    names the rank and its error (``UsageError`` if the worker found a user mistake).
    """
    if under_launcher():
        return fn(arg)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"tandem-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.1,
        start_method="spawn", logs_specs=DefaultLogsSpecs(), local_addr="127.0.0.1",
    )
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        results = elastic_launch(config, fn)(arg)
    except ChildFailedError as exc:
        raise _failure(exc) from None
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
    return results.get(0)


def _message(failure: ProcessFailure) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    return str(message or "").strip()


def _failure(exc: ChildFailedError) -> Exception:
    """One line naming the worker that caused the job to stop, and why.

    In order of preference: a user mistake a worker found, a worker killed by a signal, a
    worker's diagnosis of a peer that fell silent, then the first failure in time.
    """
    messages = {rank: _message(failure) for rank, failure in exc.failures.items()}
    for message in messages.values():
        if match := _USAGE_ERROR.match(message):
            return UsageError(match.group(1).strip().splitlines()[0])
    for rank, failure in sorted(exc.failures.items()):
        if failure.exitcode < 0 and failure.signal_name() not in ("SIGTERM", "<N/A>"):
            return WorkerFailure(f"worker rank {rank} died: killed by {failure.signal_name()}")
    for message in messages.values():
        if match := _WORKER_FAILURE.match(message):
            return WorkerFailure(match.group(1).strip().splitlines()[0])
    rank, failure = exc.get_first_failure()
    lines = messages[rank].splitlines()
    reason = lines[-1] if lines else f"exit code {failure.exitcode}"
    return WorkerFailure(f"worker rank {rank} failed: {reason}")
