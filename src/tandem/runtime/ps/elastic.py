"""The server side of asynchronous EASGD: hold a shard of the center variable and move it and
each pushing worker towards each other, on that worker's clock (Zhang, Choromanska and LeCun,
"Deep learning with Elastic Averaging SGD", 2015, Algorithm 1).

Usage (ranks ``0..servers-1`` of a ``--strategy easgd --mode async`` job)::

    ElasticServer(job, env, beat).run()      # the summary on server 0, None elsewhere

Every ``period`` local steps a worker pushes its parameters ``x_i`` (its shard to each server)
and waits for the reply. The server computes, with moving rate ``alpha = lr * rho``,

    diff = alpha (x_i - x̃),    x̃ <- x̃ + diff,    reply x_i - diff,

and the worker continues from the reply: Algorithm 1's read of the center, the worker's move
and the server's ``x̃ <- x̃ + diff``, with the read and the update in one step (no other worker's
update falls between them). The server holds no optimizer: the workers keep their own. The
workers start together (their first pulls are answered once all have asked); from then on
nothing waits for anything but the server's reply.

Everything else is the parameter server's (:class:`~tandem.runtime.ps.server.ParameterServer`):
the gloo side group and messages, the workers' liveness (a worker that dies or is stuck is left
behind, as in asynchronous ``ps``), checkpoints of the shard and buffers, the trace, the
evaluation of the gathered model and the summary. Its messages are plain float32: EASGD
refuses ``--compress``, so its codecs hold no state and are not among its components (no
snapshot of them is taken at a checkpoint, and none is saved). The model's buffers are those of
the last push applied (as in asynchronous ``ps``), so ``final.pt`` is the center with them.

Steps: ``--steps K`` is the number of global batches the workers process together, as in
``dp`` and synchronous EASGD: K × workers local steps of a worker's share of the batch in all,
however they fall among the workers. The server counts ``period`` local steps per push, and its
version (the summary's ``steps``) is their number over the workers, so pushes after the last
step (at most ``period`` local steps per worker) are answered with 'stop' and dropped.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from tandem.runtime.job import Job
from tandem.runtime.dist import WorkerEnv
from tandem.runtime.learning_rate import scaled_lr
from tandem.runtime.ps import protocol
from tandem.runtime.ps.server import Pace, ParameterServer
from tandem.runtime.ps.update import UpdateRule
from tandem.runtime.watchdog import Heartbeat
from tandem.spec.sync import ElasticAveragingSync
from tandem.sync.flat import flatten, unflatten_into


def elastic_update(worker: torch.Tensor, center: torch.Tensor,
                   alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One elastic exchange of Algorithm 1: ``diff = alpha (x_i - x̃)``; returns the worker's
    new parameters ``x_i - diff`` and the new center ``x̃ + diff``."""
    diff = alpha * (worker - center)
    return worker - diff, center + diff


class ElasticServer(ParameterServer):
    """Server ``rank`` of asynchronous EASGD: holds a shard of the center; every push moves it
    and answers the pushing worker at once."""

    spec = ElasticAveragingSync

    def __init__(self, job: Job, env: WorkerEnv, beat: Heartbeat) -> None:
        assert job.plan.compress is None, "EASGD refuses --compress (tandem.spec.codec)"
        super().__init__(job, env, beat)
        self.alpha = scaled_lr(job.run) * self.sync.rho
        """The moving rate ``alpha = lr * rho`` (the lr scaled by ``--lr-scaling``)."""
        self.local_steps = self.version * len(self.workers)
        """Local steps of all workers together that the pushes so far stand for."""
        self.moved: dict[int, torch.Tensor] = {}
        """Per worker: its shard after its last push's elastic move, for the reply."""

    # -- the parameter server's hooks --------------------------------------------------------

    def _update_rule(self) -> UpdateRule:
        """No optimizer (the center moves by the workers' differences, not by gradients), no
        compensation (the workers step on their own parameters, never on stale ones), and no
        clipping (each worker clips its own gradients, for its own steps)."""
        return UpdateRule(self.config, self.shard, optimize=False)

    @property
    def sync(self) -> ElasticAveragingSync:
        """The plan's EASGD spec."""
        assert isinstance(sync := self.job.plan.sync, ElasticAveragingSync), sync
        return sync

    def updates(self) -> int:
        """The elastic exchanges applied (one per push)."""
        return sum(self.stats.pushes.values())

    def _pace(self, *, per_step: int | None = None, required: int | None = None) -> Pace:
        """One update per step (the version counts global steps, see :meth:`_advance`); each
        push is answered on its own."""
        return super()._pace(per_step=1, required=1)

    def _reply_values(self, worker: int) -> torch.Tensor:
        """The worker's moved shard after its push; the center otherwise (its first pull, and
        the 'stop' to a push that came after the last step)."""
        moved = self.moved.pop(worker, None)
        return moved if moved is not None else super()._reply_values(worker)

    def _release_waiting(self) -> None:
        """The workers start together: their first pulls (held in :attr:`waiting`) are
        answered once every live worker has asked, so that all start from the center at once
        (the paper's ``x_i = x̃`` at the start) however long each took to start up. After that
        nothing waits: every push is answered as it is applied."""
        live = set(self.liveness.live())
        if self.waiting and live <= set(self.waiting):
            for worker in self.waiting:
                self._reply(worker)
            self.waiting = []

    def mode_summary(self) -> dict[str, Any]:
        return {"mode": self.sync.mode, "period": self.sync.period, "rho": self.sync.rho,
                "moving_rate": self.alpha, "nesterov": self.sync.nesterov,
                "local_steps": self.local_steps}

    # -- pushes --------------------------------------------------------------------------------

    def _handle(self, sender: int, header: protocol.Header, values: torch.Tensor | None) -> None:
        if header.kind == protocol.PULL:
            self.waiting.append(sender)
            self._release_waiting()
        elif header.kind == protocol.BYE:
            self.liveness.finished.add(sender)
        else:
            if not self.stats.pushes:
                self.stats.started = time.perf_counter()  # rates count from the first push
            self.stats.count_push(sender, header)
            self.shard.take_buffers(sender)
            self._move(sender, values)
            self._reply(sender, stop=self.version >= self.pace.last_step)

    def _move(self, sender: int, values: torch.Tensor | None) -> None:
        """The elastic exchange with ``sender``'s pushed shard, then the version it brings."""
        start = time.perf_counter()
        if values is not None:
            center = flatten(self.shard.params)
            if bool(torch.isfinite(values).all()):
                self.moved[sender], center = elastic_update(values, center, self.alpha)
                unflatten_into(center, self.shard.params)
            else:  # a diverged worker: the center keeps clear of it, and it restarts from it
                self.stats.skipped_steps += 1
        self.local_steps += self.sync.period
        self.stats.record_update(start, time.perf_counter(), self.version)
        self._advance()

    def _advance(self) -> None:
        """Count the global steps the local steps so far complete (up to the last one), with
        the metrics and checkpoints that fall on them."""
        reached = min(self.local_steps // len(self.workers), self.pace.last_step)
        while self.version < reached:
            self.version += 1
            self.beat.step = self.version
            self._end_step()
