"""Imported first by tandem's forkserver (:mod:`tandem.runtime.zygote`): it ignores SIGINT,
SIGTERM and SIGHUP there, so that a Ctrl-C sent to the whole process group neither prints a
traceback from the forkserver's imports nor ends it under a launcher that is still stopping its
workers. The forkserver ends when its launcher does; a worker forked from it takes the stop
signals' default actions back (:func:`tandem.runtime.launch.prepare_worker`).

Only the forkserver imports this module.
"""

from __future__ import annotations

import signal

for _signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(_signum, signal.SIG_IGN)
