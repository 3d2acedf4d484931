"""Imported first by tandem's forkserver (:mod:`tandem.runtime.zygote`): it ignores SIGINT,
SIGTERM and SIGHUP there, so that a Ctrl-C sent to the whole process group neither prints a
traceback from the forkserver's imports nor ends it under a launcher that is still stopping its
workers, and it makes every process forked from it die with it. The forkserver ends when its
launcher does; a worker forked from it takes the stop signals' default actions back
(:func:`tandem.runtime.launch.prepare_worker`).

A worker that cannot start says so in one line instead of a traceback, and says nothing when
its launcher stopped while handing it its job (it was abandoned, not broken).

Only the forkserver imports this module.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from types import TracebackType

ABANDONED_WAIT_S = 2.0
"""How long a worker that failed to read its job waits to see its launcher end (then the
launcher stopped during the hand-over, and the failure is not worth a line)."""


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:
        os._exit(1)


def _launcher_ended(forkserver: int) -> bool:
    """Whether the forkserver's own parent (the launcher) has ended, seen from its child."""
    try:
        with open(f"/proc/{forkserver}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return True
    return fields[1] == "1"  # its parent is now init


def _one_line(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
    """The forkserver's child failed before its worker ran (reading its job, say)."""
    forkserver = os.getppid()
    deadline = time.monotonic() + ABANDONED_WAIT_S
    while os.path.exists("/proc") and time.monotonic() < deadline:
        if _launcher_ended(forkserver):
            return
        time.sleep(0.05)
    print(f"tandem: a worker process could not start: {kind.__name__}: {error}", file=sys.stderr,
          flush=True)


for _signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(_signum, signal.SIG_IGN)
os.register_at_fork(after_in_child=_die_with_parent)
sys.excepthook = _one_line
