"""Errors a user can cause, reported as one line and exit status 2; the warnings tandem gives;
and how the command line shows those warnings and tandem's log records on stderr.

What a user should know about a result or a setting (and can act on) is a warning of a
:class:`TandemWarning` category, so it filters like any other; what tandem is doing (a
restart, a worker left behind) is a log record of a ``logging`` logger under ``tandem``::

    warnings.warn(message, MachineWarning, stacklevel=2)
    logging.getLogger(__name__).warning("restarting the 4 workers")

    warnings.filterwarnings("ignore", category=TandemWarning)   # a user silences the warnings
    logging.getLogger("tandem").setLevel(logging.ERROR)         # ... and the log records

The command line and its workers show both in the words of :func:`shown_on_stderr`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import TextIO


class UsageError(ValueError):
    """A mistake in the user's input: the message names the value and the fix.

    The command line prints ``tandem: error: <message>`` and exits with status 2.
    """


class WorkerFailure(RuntimeError):
    """A worker process failed or stopped answering; the message names its rank."""


class Interrupted(KeyboardInterrupt):
    """The job was stopped by a signal (Ctrl-C, SIGTERM, SIGHUP) after every worker ended.

    The command line prints one line and exits with status ``128 + signum`` (130, 143, 129).
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class Diverged(WorkerFailure):
    """Training diverged: a worker's loss became non-finite or exploded (or a gradient or the
    parameters did); the message names the step, the worker and the likely fix.

    The command line prints it in one line and exits with status 1 (the job is stopped, not
    refused: the settings were valid). See :mod:`tandem.runtime.divergence`.
    """


class TandemWarning(UserWarning):
    """Something about a run's or a plan's result that the user should know and can act on.

    The command line prints it as ``tandem: warning: <message>``.
    """

    label = "warning"
    """The word the command line puts before the message."""


class MachineWarning(TandemWarning):
    """This machine runs the job as asked, only slower (more workers than cores)."""


class LearningWarning(TandemWarning):
    """A run's loss diverged or stalled without stopping it, or its learning rate is scaled with
    a batch beyond the critical batch (:mod:`tandem.runtime.learning`)."""


class OutputWarning(TandemWarning):
    """A run trained as asked but could not write one of its outputs where the user expects
    it (a ``final.pt`` whose shards other nodes wrote to their own ``--out``)."""


class PlanWarning(TandemWarning):
    """A run does not follow its plan exactly (its devices, its tensor layers), so its time or
    layout may differ from what was planned."""


class PlanNote(TandemWarning):
    """What a planning command's output does not show: something the simulator does not model,
    or a plan faster than the one asked for.

    The command line prints it as ``tandem <command>: note: <message>``: it is about that
    command's own output.
    """

    label = "note"


LOGGER = "tandem"
"""The logger above every tandem module's own (``logging.getLogger(__name__)``)."""


def show_on_stderr(command: str = "") -> None:
    """From now on in this process, tandem's warnings and its log records (INFO and above)
    print on stderr one line each, as the command line words them.

    A warning prints as ``tandem: warning: <message>`` (a note as ``tandem <command>: note:
    <message>``), a log record as ``tandem: <message>``. Filters still apply (``-W``,
    ``PYTHONWARNINGS``); other packages' warnings keep the display they had.
    """
    others = warnings.showwarning
    if isinstance(others, functools.partial) and others.func is _show:  # shown already
        others = others.keywords["others"]
    warnings.showwarning = functools.partial(_show, command=command, others=others)
    logger = logging.getLogger(LOGGER)
    for handler in [h for h in logger.handlers if isinstance(h, _Lines)]:
        logger.removeHandler(handler)
    logger.addHandler(_Lines())
    logger.setLevel(logging.INFO)
    logger.propagate = False  # printed here: not again by a handler of the root logger


@contextlib.contextmanager
def shown_on_stderr(command: str = "") -> Iterator[None]:
    """:func:`show_on_stderr` within, and everything as before after (the command line run
    in-process, by a test or a user's ``main([...])``)."""
    logger = logging.getLogger(LOGGER)
    saved = logger.level, logger.propagate, list(logger.handlers)
    with warnings.catch_warnings():
        show_on_stderr(command)
        try:
            yield
        finally:
            for handler in list(logger.handlers):
                logger.removeHandler(handler)
            for handler in saved[2]:
                logger.addHandler(handler)
            logger.setLevel(saved[0])
            logger.propagate = saved[1]


class _Lines(logging.Handler):
    """Each record as ``tandem: <message>`` on the stderr of the moment (a test's capture)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(f"tandem: {record.getMessage()}", file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - logging's own rule: a failed record never raises
            self.handleError(record)


def _show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
          file: TextIO | None = None, line: str | None = None, *, command: str,
          others: Callable[..., object]) -> None:
    if not issubclass(category, TandemWarning):
        others(message, category, filename, lineno, file, line)
        return
    where = f"tandem {command}" if command and category.label == "note" else "tandem"
    print(f"{where}: {category.label}: {message}", file=sys.stderr if file is None else file,
          flush=True)
