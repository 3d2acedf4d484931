"""The job as ``torchrun`` describes it to each process, in environment variables: whether this
process runs under a launcher, and the job's size (no torch: ``tandem train`` reads them before
it imports torch; :mod:`tandem.runtime.dist` joins the job).
"""

from __future__ import annotations

import os

from tandem.errors import UsageError

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What ``torchrun`` sets for every worker (and what a hand-started worker must set)."""


def under_launcher() -> bool:
    """True when started by ``torchrun``/the elastic agent (all of ``LAUNCHER_VARIABLES`` set).

    Raises ``UsageError`` when only some are set, or when their values disagree (``RANK`` not
    below ``WORLD_SIZE``, a port that is not a number): a job never starts half-configured.
    """
    present = [key for key in LAUNCHER_VARIABLES if key in os.environ]
    if not present:
        return False
    if len(present) < len(LAUNCHER_VARIABLES):
        missing = [key for key in LAUNCHER_VARIABLES if key not in os.environ]
        raise UsageError(
            f"{_listing(present)} {'is' if len(present) == 1 else 'are'} set but "
            f"{_listing(missing)} {'is' if len(missing) == 1 else 'are'} not; start the job with "
            f"torchrun (it sets all four), set all four, or unset {_listing(present, 'and')} to "
            f"run --nproc local workers")
    check_launcher_values()
    return True


def _listing(names: list[str], last: str = "and") -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {last} {names[-1]}"


def _integer(key: str, low: int, high: int | None = None) -> int:
    text = os.environ[key]
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise UsageError(f"{key}={text!r} must be an integer {bound}; fix the environment "
                         f"variable (torchrun sets it)")
    return value


def check_launcher_values() -> None:
    """``UsageError`` for launcher variables that disagree (all of them are set)."""
    size = _integer("WORLD_SIZE", 1)
    rank = _integer("RANK", 0)
    if rank >= size:
        raise UsageError(f"RANK={rank} is not below WORLD_SIZE={size}: ranks run from 0 to "
                         f"{size - 1}; give each of the {size} processes its own RANK in that range")
    _integer("MASTER_PORT", 1, 65535)
    if not os.environ["MASTER_ADDR"].strip():
        raise UsageError("MASTER_ADDR is empty; set it to the host name or address of rank 0")
    if "LOCAL_RANK" in os.environ:
        _integer("LOCAL_RANK", 0)


def world_size() -> int:
    """The job's number of processes under ``torchrun`` (``WORLD_SIZE``)."""
    return int(os.environ["WORLD_SIZE"])
