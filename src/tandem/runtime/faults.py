"""Restarted jobs: which attempt this is, the progress a worker leaves for its launcher to name a
failure by step, and the fault injection of tests and demos (``TANDEM_FAULT=RANK:STEP``).

``TANDEM_FAULT=2:35`` kills rank 2 with SIGKILL when it reaches step 35 (before running it) in
the first attempt of a job only, so a restarted job runs through: the attempt is tandem's own
launcher's (``TANDEM_ATTEMPT``) or torchrun's (``TORCHELASTIC_RESTART_COUNT``).

Usage::

    fault = parse_fault(os.environ.get(FAULT))      # checked before the workers start
    maybe_fail(rank, step)                          # in the training loop
"""

from __future__ import annotations

import logging
import os
import re
import signal
from pathlib import Path

from tandem.errors import UsageError

logger = logging.getLogger(__name__)

FAULT = "TANDEM_FAULT"
ATTEMPT = "TANDEM_ATTEMPT"
"""Set by tandem's launcher in each attempt's workers: 0, 1, ... (restarts so far)."""
PROGRESS_DIR = "TANDEM_PROGRESS_DIR"
"""Set by tandem's launcher: where each worker leaves the step it reached (``rank-N``)."""


def parse_fault(text: str | None) -> tuple[int, int] | None:
    """``(rank, step)`` of ``TANDEM_FAULT=RANK:STEP``, None if unset; raises ``UsageError`` for
    anything else."""
    if text is None or text == "":
        return None
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if match is None:
        raise UsageError(f"TANDEM_FAULT={text!r} is not RANK:STEP; e.g. TANDEM_FAULT=2:35 kills "
                         f"rank 2 when it reaches step 35 (first attempt only), or unset it")
    return int(match.group(1)), int(match.group(2))


def check_fault(world_size: int, steps: int) -> None:
    """Refuse a ``TANDEM_FAULT`` that names no rank or step of this job (it would never fire)."""
    fault = parse_fault(os.environ.get(FAULT))
    if fault is None:
        return
    rank, step = fault
    if rank >= world_size or step >= steps:
        raise UsageError(f"TANDEM_FAULT={rank}:{step} names rank {rank} and step {step}, but the "
                         f"job has ranks 0-{world_size - 1} and steps 0-{steps - 1}; pick ones "
                         f"it has, or unset TANDEM_FAULT")


def attempt() -> int:
    """Restarts before this attempt of the job (0 in the first)."""
    for name in (ATTEMPT, "TORCHELASTIC_RESTART_COUNT"):
        value = os.environ.get(name)
        if value and value.isdigit():
            return int(value)
    return 0


_progress_files: dict[tuple[str, int], int] = {}
"""Each worker's progress file, open for the run (a step rewrites it in place: one system
call, where opening and closing it cost ~0.1 ms a step)."""
STEP_WIDTH = 20
"""Characters a recorded step takes (right-aligned), so a smaller number overwrites a larger."""


def record_progress(rank: int, step: int) -> None:
    """Leave ``step`` where the launcher reads it if this worker fails (best effort)."""
    folder = os.environ.get(PROGRESS_DIR)
    if not folder:
        return
    try:
        fd = _progress_files.get((folder, rank))
        if fd is None:
            fd = _progress_files[(folder, rank)] = os.open(
                Path(folder, f"rank-{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(fd, f"{step:>{STEP_WIDTH}}".encode(), 0)
    except OSError:
        pass


def last_progress(folder: str | Path, rank: int) -> int | None:
    """The step worker ``rank`` last recorded in ``folder`` (None if none)."""
    try:
        return int(Path(folder, f"rank-{rank}").read_text())
    except (OSError, ValueError):
        return None


def maybe_fail(rank: int, step: int) -> None:
    """Kill this process with SIGKILL if ``TANDEM_FAULT`` names this rank and step and this is
    the job's first attempt (and record the step for the launcher, as every step)."""
    record_progress(rank, step)
    fault = parse_fault(os.environ.get(FAULT)) if FAULT in os.environ else None
    if fault is None or fault != (rank, step) or attempt() != 0:
        return
    logger.warning(f"TANDEM_FAULT={rank}:{step}: killing rank {rank} at step {step}")
    os.kill(os.getpid(), signal.SIGKILL)


def announce_resume(rank: int, path: Path | None, step: int | None) -> None:
    """On rank 0 of a restarted attempt, one line: where it resumes."""
    if rank != 0 or attempt() == 0:
        return
    where = (f"resuming from step {step} ({path})" if path is not None
             else "no checkpoint yet, starting afresh")
    logger.info(f"restart {attempt()}: {where}")
