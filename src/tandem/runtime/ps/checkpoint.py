"""A parameter server's checkpoints: its shard, buffers and optimizer, and its components'
states (the codecs') in ``server-K.pt``, with the numbers of servers and workers it was saved
with, written atomically unless the shard diverged, and read back on resume (on as many
servers; compressed, on as many workers)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandem.runtime.checkpoint import (
    CHECKPOINT_VERSION, load_checkpoint, resume_path, save_checkpoint,
)
from tandem.runtime.component import Component, StepEnd
from tandem.runtime.divergence import diverged, first_non_finite
from tandem.runtime.faults import announce_resume
from tandem.runtime.job import Job
from tandem.runtime.ps.shard import ServerShard
from tandem.runtime.ps.update import UpdateRule
from tandem.runtime.run_checkpoints import check_servers, resume_where


class ServerCheckpoint(Component):
    """Server ``rank``'s checkpoint in ``out`` (none without one): its ``shard`` and the
    optimizer of its update ``rule``, with the states ``components()`` gives (the server's
    :meth:`~tandem.runtime.component.Components.state_dict`). As a component, saved after the
    ``--checkpoint-every`` steps; the server saves the last step's itself, after the gather."""

    def __init__(self, job: Job, out: Path | None, rank: int, shard: ServerShard,
                 rule: UpdateRule, *, components: Callable[[], dict[str, Any]]) -> None:
        self.job, self.out, self.rank = job, out, rank
        self.shard, self.rule, self.components = shard, rule, components

    @property
    def path(self) -> Path | None:
        """Where this server's checkpoint is written (None without ``--out``)."""
        return self.out / f"server-{self.rank}.pt" if self.out is not None else None

    def after_step(self, end: StepEnd) -> None:
        if end.saving and not end.final:
            self.save(end.done)

    def save(self, step: int) -> None:
        """Save the state after ``step`` steps (atomically), unless the shard's parameters are
        no longer finite: then the run stops (divergence) and the last good checkpoint
        stays."""
        bad = first_non_finite(self.shard.params)
        if bad is not None:
            raise diverged(self.job.run, problem=f"the parameters became {bad}",
                           step_index=step - 1, at="after", rank=self.rank,
                           where=f"server {self.rank} (rank {self.rank})")
        if self.path is None:
            return
        plan = self.job.plan
        save_checkpoint({"version": CHECKPOINT_VERSION, "step": step,
                         "fingerprint": self.job.fingerprint(), "servers": plan.num_servers,
                         "workers": plan.num_workers - plan.num_servers,
                         **self.shard.state_dict(), **self.rule.state_dict(),
                         "components": self.components()}, self.path, resume=self.job.run.resume)

    def resume(self) -> tuple[int, dict[str, Any]]:
        """Restore the shard and optimizer of the checkpoint ``--resume`` names (with
        ``auto``, this run's own, if any); the steps it was taken after and the components'
        states, for the server's components once it builds them (0 and none without one)."""
        config = self.job.run
        path = resume_path(self.job, self.out, f"server-{self.rank}.pt")
        state = None if path is None else load_checkpoint(path, self.job.fingerprint(),
                                                          steps=config.steps)
        announce_resume(self.rank, path, state["step"] if state else None)
        if state is None or path is None:
            return 0, {}
        assert config.resume is not None
        check_servers(state, path, self.job, resume_where(config.resume, self.out))
        self.shard.load_state_dict(state)
        self.rule.load_state_dict(state)
        return int(state["step"]), state["components"]
