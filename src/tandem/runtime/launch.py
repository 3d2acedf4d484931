"""Start the workers of a job: N local processes through PyTorch's elastic launcher, or this
process as one worker of an external ``torchrun`` job.

Usage::

    summary = launch(train_worker, config, nproc=4, timeout_s=300)
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import uuid
from types import FrameType
from typing import Any, Callable, TypeVar


from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import (
    ChildFailedError, ProcessFailure, get_error_handler,
)
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.multiprocessing.spawn import start_processes as start_worker_processes

from tandem.errors import Diverged, Interrupted, UsageError, WorkerFailure, show_on_stderr
from tandem.runtime import divergence
from tandem.runtime.faults import ATTEMPT, PROGRESS_DIR, last_progress
from tandem.runtime.launcher_env import under_launcher
from tandem.runtime.main_guard import check_main_guard
from tandem.runtime.zygote import Carried, start, start_method

R = TypeVar("R")

_NOISY_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")
_USAGE_ERROR = re.compile(r"(?:\w+\.)*UsageError: (.*)", re.DOTALL)
_WORKER_FAILURE = re.compile(r"(?:\w+\.)*WorkerFailure: (.*)", re.DOTALL)
_DIVERGED = re.compile(r"(?:\w+\.)*Diverged: (.*)", re.DOTALL)
_SIGNALLED = re.compile(r"^Signal \d+ \((SIG\w+)\) received by PID \d+$")
"""How the elastic agent records a worker that a signal ended."""
_NO_REPORT = "To enable traceback see:"
"""How it records a worker that ended without recording its error (a PyTorch URL)."""
LAUNCHED = "TANDEM_LAUNCHED"
"""Set in the environment of the workers this module starts (to the job's run id)."""
SHUTDOWN_S = 3
"""Seconds a stopping worker gets after SIGTERM before SIGKILL (a frozen one never answers)."""
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
SIGNALS_VARIABLE = "TORCHELASTIC_SIGNALS_TO_HANDLE"
"""The signals the elastic agent handles itself (it reads this variable)."""
RESEND_S = 0.05
"""How soon a stop signal that came while the workers were being started is sent again."""
_START_PROCESSES = start_worker_processes.__code__

logger = logging.getLogger(__name__)


def launch(fn: Callable[[Any], R], arg: Any, *, nproc: int, threads: int = 1,
           max_restarts: int = 0) -> R | None:
    """Run ``fn(arg)`` on every worker and return rank 0's result.

    Under ``torchrun`` this process is one worker and ``fn`` runs here. Otherwise ``nproc``
    local workers are started; if one fails, the others are stopped and ``WorkerFailure``
    names the rank and its error (``UsageError`` if the worker found a user mistake,
    ``Diverged`` if training diverged). With
    ``max_restarts``, a failed worker group (not a user mistake, nor divergence, which a restart
    from the last checkpoint would only repeat) is started again, up to that
    many times, each failure and restart named in one line on stderr; the workers see the
    attempt in ``TANDEM_ATTEMPT`` (:mod:`tandem.runtime.faults`).
    """
    if under_launcher():
        return fn(arg)
    check_main_guard()  # each worker runs the main script again as it starts
    progress = tempfile.mkdtemp(prefix="tandem-progress-") if max_restarts else None
    try:
        for restarts in range(max_restarts + 1):
            os.environ[ATTEMPT] = str(restarts)
            if progress is not None:
                os.environ[PROGRESS_DIR] = progress
            try:
                return _launch_once(fn, arg, nproc=nproc, threads=threads)
            except Diverged:
                raise
            except WorkerFailure as failure:
                if restarts == max_restarts:
                    if max_restarts:
                        raise WorkerFailure(f"{failure} (after {max_restarts} restart"
                                            f"{'s' if max_restarts > 1 else ''})") from None
                    raise
                logger.warning(f"{_with_step(str(failure), progress)}; restarting the {nproc} "
                               f"workers (restart {restarts + 1} of {max_restarts})")
        return None
    finally:
        os.environ.pop(ATTEMPT, None)
        os.environ.pop(PROGRESS_DIR, None)
        if progress is not None:
            shutil.rmtree(progress, ignore_errors=True)


def _with_step(message: str, progress: str | None) -> str:
    """``message`` with the step its worker last reached, where it left one."""
    match = re.match(r"worker rank (\d+)", message)
    step = last_progress(progress, int(match.group(1))) if match and progress else None
    if step is None or match is None:
        return message
    return message.replace(f"worker rank {match.group(1)}",
                           f"worker rank {match.group(1)} at step {step}", 1)


def _shutdown_option() -> dict[str, Any]:
    """``shutdown_timeout`` where the elastic agent takes it (torch 2.13; 2.11 does not)."""
    names = {field.name for field in dataclasses.fields(LaunchConfig)}
    return {"shutdown_timeout": SHUTDOWN_S} if "shutdown_timeout" in names else {}


def _launch_once(fn: Callable[[Any], R], arg: Any, *, nproc: int, threads: int) -> R | None:
    """One attempt: ``nproc`` workers through PyTorch's elastic agent, forked from the
    preloaded forkserver (:mod:`tandem.runtime.zygote`)."""
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    start()
    run_id = f"tandem-{uuid.uuid4().hex[:8]}"
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=run_id,
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.1,
        start_method=start_method(), logs_specs=DefaultLogsSpecs(), local_addr="127.0.0.1",
        **_shutdown_option(),
    )
    loggers = [logging.getLogger(name) for name in sorted(logging.root.manager.loggerDict)
               if name.startswith(_NOISY_LOGGERS)]  # each module's own, which sets its level
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    handlers = _catch_stop_signals()
    os.environ[LAUNCHED] = run_id
    try:
        results = elastic_launch(config, Carried.of(fn))(arg)
    except SignalException as exc:  # the agent has stopped every worker
        raise Interrupted(int(exc.sigval)) from None
    except ChildFailedError as exc:
        raise _failure(exc) from None
    finally:
        del os.environ[LAUNCHED]
        _restore(handlers)
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
    result: R | None = results.get(0)  # elastic_launch's results: rank -> return value
    return result


def _catch_stop_signals() -> dict[str, Any]:
    """Handle the stop signals that are not ignored (``nohup``) with
    :func:`_stop_once_started` instead of the elastic agent's own handler; returns what to
    restore. Off the main thread, where no handler can be set, the agent's rules apply."""
    saved: dict[str, Any] = {SIGNALS_VARIABLE: os.environ.get(SIGNALS_VARIABLE)}
    if threading.current_thread() is not threading.main_thread():
        return saved
    for signum in STOP_SIGNALS:
        saved[signum.name] = signal.getsignal(signum)
        if saved[signum.name] is not signal.SIG_IGN:
            signal.signal(signum, _stop_once_started)
    os.environ[SIGNALS_VARIABLE] = "SIGQUIT"  # the agent leaves the others to this module
    return saved


def _restore(saved: dict[str, Any]) -> None:
    variable = saved.pop(SIGNALS_VARIABLE)
    if variable is None:
        os.environ.pop(SIGNALS_VARIABLE, None)
    else:
        os.environ[SIGNALS_VARIABLE] = variable
    for name, handler in saved.items():  # the agent leaves its SIGQUIT handler installed
        signal.signal(signal.Signals[name], handler)


def _stop_once_started(signum: int, frame: FrameType | None) -> None:
    """Stop the job as the elastic agent's own handler does (it stops every worker with this
    signal), but not while it is starting the worker processes: until it holds all of them it
    could stop none, and those already forked would outlive the job. There the signal is sent
    again a moment later."""
    if _started_some(frame):
        timer = threading.Timer(RESEND_S, os.kill, (os.getpid(), signum))
        timer.daemon = True
        timer.start()
        return
    name = signal.Signals(signum).name
    raise SignalException(f"the launcher got {name}", sigval=signal.Signals(signum))


def _started_some(frame: FrameType | None) -> bool:
    """Whether ``frame`` is inside torch's start of the worker processes with one or more of
    them started (its list of processes; where that list is not found, any start counts)."""
    while frame is not None:
        if frame.f_code is _START_PROCESSES:
            started = frame.f_locals.get("processes")
            return not isinstance(started, list) or any(p is not None for p in started)
        frame = frame.f_back
    return False


def prepare_worker() -> None:
    """In a worker this module started: end at once, silently, on SIGINT, SIGTERM and SIGHUP
    (the launcher reports the signal in one line), die with the launcher if it is killed, and
    show tandem's warnings and log records on stderr as the command line does.

    A worker stopped this way writes nothing more; checkpoints are replaced by an atomic rename,
    so the last one stays whole.
    """
    if LAUNCHED not in os.environ:
        return
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    die_with_parent()
    show_on_stderr()  # forked from the forkserver, not from the command line that shows them


def end_diverged(error: Diverged) -> None:
    """In a worker this module started: record ``error`` for the launcher (as the elastic
    agent's ``record`` does) and end the process now, with status 1, skipping the interpreter's
    teardown, where a background receive still waiting in the process group (a parameter
    server's mailbox) aborts the process with a C++ error on stderr. Elsewhere a no-op."""
    if LAUNCHED not in os.environ:
        return
    get_error_handler().record_exception(error)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def die_with_parent() -> None:
    """Ask Linux to kill this process when its parent ends (no orphans); elsewhere a no-op."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent ended before the request
        os._exit(1)


def _message(failure: ProcessFailure) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    return str(message or "").strip()


def _failure(exc: ChildFailedError) -> BaseException:
    """One line naming the worker that caused the job to stop, and why.

    In order of preference: a user mistake a worker found, a worker's divergence (the first
    step's, then the lowest rank's, of those found before the others were stopped), a worker
    killed by a signal, a worker's diagnosis of a peer that fell silent, then the first
    failure in time.
    """
    messages = {rank: _message(failure) for rank, failure in exc.failures.items()}
    stops = {failure.signal_name() for failure in exc.failures.values() if failure.exitcode < 0}
    if stops == {"SIGINT"} and all(f.exitcode < 0 for f in exc.failures.values()):
        return Interrupted(signal.SIGINT)  # Ctrl-C reached the workers before the launcher
    for message in messages.values():
        if match := _USAGE_ERROR.match(message):
            return UsageError(match.group(1).strip().splitlines()[0])
    diverged = [match.group(1).strip().splitlines()[0] for message in messages.values()
                if (match := _DIVERGED.match(message))]
    if diverged:
        return Diverged(min(diverged, key=divergence.order))
    for rank, failure in sorted(exc.failures.items()):
        if failure.exitcode < 0 and failure.signal_name() not in ("SIGTERM", "<N/A>"):
            return WorkerFailure(f"worker rank {rank} died: killed by {failure.signal_name()}")
    for message in messages.values():
        if match := _WORKER_FAILURE.match(message):
            return WorkerFailure(match.group(1).strip().splitlines()[0])
    rank, failure = exc.get_first_failure()
    lines = messages[rank].splitlines()
    reason = lines[-1] if lines else f"exit code {failure.exitcode}"
    if stopped := _SIGNALLED.search(reason):  # the first to end, by a signal not the launcher's
        return WorkerFailure(f"worker rank {rank} died: killed by {stopped.group(1)}")
    if reason.startswith(_NO_REPORT):
        return WorkerFailure(f"worker rank {rank} failed with exit code {failure.exitcode} "
                             f"before it could say why")
    return WorkerFailure(f"worker rank {rank} failed: {reason}")
