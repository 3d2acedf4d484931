"""Restarted jobs: which attempt this is, the progress a worker leaves for its launcher to name a
failure by step, and the fault injection of tests and demos (``TANDEM_FAULT=RANK:STEP``).

``TANDEM_FAULT=2:35`` kills rank 2 with SIGKILL when it reaches step 35 (before running it) in
the first attempt of a job only, so a restarted job runs through: the attempt is tandem's own
launcher's (``TANDEM_ATTEMPT``) or torchrun's (``TORCHELASTIC_RESTART_COUNT``). Every role
fires it (workers, pipeline stages, parameter servers as they complete a step); one that names
no rank or step the job will run is refused in one line (before the workers start, or as a
resumed worker starts past it).

Usage::

    fault = parse_fault(os.environ.get(FAULT))      # checked before the workers start
    check_fault_ahead(rank, first_step)             # as a worker starts (or resumes)
    maybe_fail(rank, step)                          # in the training loop
"""

from __future__ import annotations

import logging
import os
import re
import signal
from pathlib import Path

from tandem.errors import UsageError
from tandem.runtime.component import Component, StepEnd

logger = logging.getLogger(__name__)

FAULT = "TANDEM_FAULT"
ATTEMPT = "TANDEM_ATTEMPT"
"""Set by tandem's launcher in each attempt's workers: 0, 1, ... (restarts so far)."""
GROUP_RESTARTS = "TANDEM_GROUP_RESTARTS"
"""Set in a torchrun worker once its group formed: the job's restarts before this group, as
the agent's store counts them (:mod:`tandem.runtime.worker_group`)."""
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


def check_fault(world_size: int, steps: int, stop_after: int | None = None) -> None:
    """Refuse a ``TANDEM_FAULT`` that names no rank or step of this job (it would never fire):
    its steps end at ``stop_after`` if given, else at ``steps``."""
    fault = parse_fault(os.environ.get(FAULT))
    if fault is None:
        return
    rank, step = fault
    last = steps if stop_after is None else stop_after
    if rank >= world_size or step >= last:
        steps_text = f"steps 0-{last - 1}" + (" (--stop-after)" if stop_after is not None else "")
        raise UsageError(f"TANDEM_FAULT={rank}:{step} names rank {rank} and step {step}, but the "
                         f"job has ranks 0-{world_size - 1} and {steps_text}; pick ones it has, "
                         f"or unset TANDEM_FAULT")


def attempt() -> int:
    """Restarts before this attempt of the job (0 in the first): tandem's launcher's count, or
    the larger of a torchrun agent's and the worker group's (:data:`GROUP_RESTARTS`; an agent
    does not count a restart for a node that joins, nor another node's restarts)."""
    if ATTEMPT in os.environ:
        names: tuple[str, ...] = (ATTEMPT,)
    else:
        names = ("TORCHELASTIC_RESTART_COUNT", GROUP_RESTARTS)
    values = [os.environ.get(name, "") for name in names]
    return max([int(value) for value in values if value.isdigit()], default=0)


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


def maybe_fail(rank: int, step: int, *, since: int | None = None) -> None:
    """Kill this process with SIGKILL if ``TANDEM_FAULT`` names this rank and step and this is
    the job's first attempt (and record the step for the launcher, as every step). A rank whose
    steps may jump (an asynchronous ps worker's are the servers' updates) gives the step it
    reached before as ``since``: the fault fires at the first step past it that reaches its
    own."""
    record_progress(rank, step)
    fault = parse_fault(os.environ.get(FAULT)) if FAULT in os.environ else None
    if fault is None or fault[0] != rank or attempt() != 0:
        return
    if not (fault[1] == step if since is None else since < fault[1] <= step):
        return
    logger.warning(f"TANDEM_FAULT={rank}:{fault[1]}: killing rank {rank} at step {step}")
    os.kill(os.getpid(), signal.SIGKILL)


class StepFaults(Component):
    """``TANDEM_FAULT`` for a rank whose loop is not a training loop (a parameter server's):
    made as the rank starts at ``first_step`` (checked, :func:`check_fault_ahead`, and fired
    if it names that step), then fired after each step the rank completes, as the next step
    it reaches (after the components before it: a checkpoint of that step is saved first)."""

    __slots__ = ("rank",)

    def __init__(self, rank: int, first_step: int) -> None:
        self.rank = rank
        check_fault_ahead(rank, first_step)
        maybe_fail(rank, first_step)

    def after_step(self, end: StepEnd) -> None:
        maybe_fail(self.rank, end.done)


def check_fault_ahead(rank: int, first_step: int) -> None:
    """Before rank ``rank`` runs its first step, ``first_step`` (a resumed run's is its
    checkpoint's): one line refuses a ``TANDEM_FAULT`` for it at a step already passed, which
    would never fire."""
    fault = parse_fault(os.environ.get(FAULT)) if FAULT in os.environ else None
    if fault is None or fault[0] != rank or attempt() != 0 or fault[1] >= first_step:
        return
    raise UsageError(f"TANDEM_FAULT={rank}:{fault[1]} names step {fault[1]}, but rank {rank} "
                     f"starts at step {first_step} (the checkpoint it resumes from), so it would "
                     f"never fire; pick a step from {first_step} on, or unset TANDEM_FAULT")


def announce_resume(rank: int, path: Path | None, step: int | None) -> None:
    """On rank 0 of a restarted attempt, one line: where it resumes."""
    if rank != 0 or attempt() == 0:
        return
    where = (f"resuming from step {step} ({path})" if path is not None
             else "no checkpoint yet, starting afresh")
    logger.info(f"restart {attempt()}: {where}")
