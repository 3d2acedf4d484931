"""The job's restarts and resizes, as a checkpoint carries them from one worker group to the
next: the ``restarts`` and ``resizes`` of the summary.

A torchrun agent counts only its own failures (a group restarted because a node joined keeps
its number, and a node that joins counts from 0), and a worker group started without the
agent's shared store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which a job that grows needs)
sees nothing of the groups before it. The checkpoint a group resumes from does: it records
the job (``TORCHELASTIC_RUN_ID``), its number of workers and its counts, so a group that
resumes a checkpoint of its own job counts one restart more, and one resize more where its
number of workers differs.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from tandem.runtime.component import Component, StepEnd
from tandem.runtime.faults import attempt
from tandem.runtime.launch import LAUNCHED

logger = logging.getLogger(__name__)


class Membership(Component):
    """This worker group's place in the job: its workers, and the restarts and resizes before
    it (the larger of what the launcher or the agent's store counted and what the checkpoint
    it resumes from carries)."""

    __slots__ = ("job", "world_size", "restarts", "resizes", "rank", "done")

    name = "membership"

    def __init__(self, world_size: int, *, rank: int, resizes: int = 0) -> None:
        run_id = os.environ.get("TORCHELASTIC_RUN_ID")
        self.job = None if LAUNCHED in os.environ or run_id in (None, "none") else run_id
        """The torchrun job (its ``--rdzv-id``); None under tandem's own launcher (which counts
        its restarts itself and never resizes, and runs an agent of its own with a new id each
        attempt) and for torchrun's default id ``none``, which every job without
        ``--rdzv-id`` shares."""
        self.world_size = world_size
        self.restarts = attempt()
        self.resizes = resizes
        self.rank = rank
        self.done = 0
        """Steps done (the step a checkpoint of now resumes from)."""

    def after_step(self, end: StepEnd) -> None:
        self.done = end.done

    def state_dict(self) -> dict[str, Any]:
        return {"job": self.job, "world_size": self.world_size, "restarts": self.restarts,
                "resizes": self.resizes, "step": self.done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.job is None or state.get("job") != self.job:
            return  # another job's checkpoint: resuming it is no restart of this one
        before, counted = int(state["world_size"]), self.restarts
        self.restarts = max(self.restarts, int(state["restarts"]) + 1)
        self.resizes = max(self.resizes, int(state["resizes"]) + (before != self.world_size))
        if self.rank != 0 or (before == self.world_size and counted):
            return  # nothing to add to the launcher's "restart N: resuming from step S"
        workers = (f" on {self.world_size} workers (the checkpoint's group had {before}; "
                   f"resize {self.resizes})" if before != self.world_size else "")
        logger.info(f"restart {self.restarts}: the job continues from step "
                    f"{state.get('step', '?')}{workers}")

    def summary(self) -> dict[str, Any]:
        return {"restarts": self.restarts, "resizes": self.resizes}
