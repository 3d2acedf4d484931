"""Errors a user can cause, reported as one line and exit status 2."""


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
