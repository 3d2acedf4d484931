"""Errors a user can cause, reported as one line and exit status 2."""


class UsageError(ValueError):
    """A mistake in the user's input: the message names the value and the fix.

    The command line prints ``tandem: error: <message>`` and exits with status 2.
    """


class WorkerFailure(RuntimeError):
    """A worker process failed or stopped answering; the message names its rank."""
