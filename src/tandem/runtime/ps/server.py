"""The server side of parameter-server training: hold a shard of the model and its optimizer,
apply the workers' gradient pushes (synchronously, asynchronously or with bounded staleness),
send parameters back, and at the end gather the model on server 0 to evaluate and save it.

With ``--compress``, the server decodes compressed pushes and sends each worker compressed
differences from the copy of the shard that worker holds (see :mod:`tandem.runtime.ps.protocol`).
Server 0 sums the traffic the workers report in their headers into the metrics and summary,
and holds the model's buffers: in ``sync`` mode it takes those of the lowest-ranked worker
whose push the step applies (as DDP broadcasts rank 0's), in ``async`` and ``ssp`` mode those of
each push it applies, and sends them back with the parameters, so ``final.pt`` holds both.

The server's model and optimizer live on the CPU, and all its messages travel on a gloo group
(:func:`~tandem.sync.side_group.cpu_group`), also when the workers train on GPUs with NCCL.
"""

from __future__ import annotations

import dataclasses
import queue
import time
from pathlib import Path
from typing import Any

import torch

from tandem.errors import WorkerFailure
from tandem.runtime.base import Worker
from tandem.runtime.component import Components, StepEnd
from tandem.runtime.faults import StepFaults
from tandem.runtime.config import RunConfig
from tandem.runtime.job import Job
from tandem.runtime.dist import WorkerEnv
from tandem.runtime.outputs import save_worker_trace
from tandem.runtime.ps import protocol
from tandem.runtime.ps.checkpoint import ServerCheckpoint
from tandem.runtime.ps.codecs import WireCodecs
from tandem.runtime.ps.liveness import LIVENESS_EVERY_S, Liveness
from tandem.runtime.ps.mailbox import ServerWire, WorkerLost
from tandem.runtime.ps.rounds import PushRound, first_update, next_updates, released
from tandem.runtime.ps.shard import ServerShard
from tandem.runtime.ps.stats import ServerLog, ServerStats
from tandem.runtime.ps.summary import NO_NOISE_SCALE, finish
from tandem.runtime.ps.update import ServerPeers, UpdateRule, check_push
from tandem.runtime.learning import Learning
from tandem.runtime.noise_scale import NoiseScale
from tandem.runtime.reporting import PeriodicEvaluation, Reporter
from tandem.runtime.task import Task
from tandem.runtime.watchdog import Heartbeat
from tandem.spec.batch_schedule import batch_at
from tandem.spec.sync import ElasticAveragingSync, ParameterServerSync
from tandem.sync.side_group import cpu_group


@dataclasses.dataclass(frozen=True, slots=True)
class Pace:
    """How far a server serves, in updates (its ``version``) and steps."""

    per_step: int
    """Updates per step (one in ``sync`` mode, one per worker otherwise)."""
    last_step: int
    """Steps to serve before stopping (``--stop-after``, else ``--steps``)."""
    required: int
    """``sync`` mode: the pushes a step applies (all but the backup workers')."""
    batch_schedule: tuple[tuple[int, int], ...]
    """The run's ``(step, global batch)`` pairs (``--batch-schedule``)."""
    log_every: int = 1
    checkpoint_every: int = 0
    """``--log-every`` and ``--checkpoint-every`` (0: none), in steps."""

    @classmethod
    def of(cls, config: RunConfig, *, per_step: int, required: int) -> Pace:
        """The pace of a run of ``config`` at ``per_step`` updates per step."""
        return cls(per_step=per_step, required=required,
                   last_step=config.stop_after if config.stop_after is not None else config.steps,
                   batch_schedule=config.parsed_batch_schedule() or ((0, config.batch_size),),
                   log_every=config.log_every, checkpoint_every=config.checkpoint_every or 0)

    @property
    def last_update(self) -> int:
        """Updates to serve before stopping."""
        return self.last_step * self.per_step

    def batch_at(self, step: int) -> int:
        """The global batch of step ``step`` (the workers take their share of the batch of the
        step the servers are at)."""
        return batch_at(self.batch_schedule, step)

    def step_end(self, version: int) -> StepEnd:
        """What the update to ``version``, the last of a step, tells the components (as a
        trainer's steps do: a metrics line at ``--log-every`` steps and the last, a checkpoint
        at ``--checkpoint-every`` steps and the last)."""
        done = version // self.per_step
        final = done == self.last_step
        return StepEnd(done=done, last=self.last_step,
                       logging=done % self.log_every == 0 or final,
                       saving=final or bool(self.checkpoint_every
                                            and done % self.checkpoint_every == 0))


class ParameterServer(Worker):
    """Server ``rank`` of the plan's ``sync.servers``: serves pushes until ``config.steps``
    steps (``per_step`` updates each: one in ``sync`` mode, one per worker otherwise)."""

    spec: type[ParameterServerSync | ElasticAveragingSync] = ParameterServerSync
    """The sync spec this server serves (subclasses serve others)."""

    def __init__(self, job: Job, env: WorkerEnv, beat: Heartbeat) -> None:
        config = job.run
        if not isinstance(job.plan.sync, self.spec):
            raise TypeError(f"{type(self).__name__} needs a {self.spec.__name__} plan, not "
                            f"{job.plan.sync!r}")
        self.job, self.env, self.beat = job, env, beat
        self.out = Path(config.out) if config.out else None
        self.task = Task(config, job.objects)
        torch.manual_seed(config.seed)
        self.shard = ServerShard(self.task.build_model(), env.rank, self.sync.num_servers)
        workers = range(self.sync.num_servers, env.world_size)
        self.liveness = Liveness(workers, beat, timeout_s=config.timeout_s,
                                 report=lambda text: self.reporter.message(text))
        self.rule = self._update_rule()
        self.pace = self._pace()
        self.stats = ServerStats(env.rank)
        self.codecs = WireCodecs(job.plan.compress, self.shard.shapes, self.shard.keys)
        self.waiting: list[int] = []
        """Workers whose push (or first pull) is not answered yet."""
        self.round = PushRound(self.pace.required)
        """``sync`` mode: the current step's pushes."""
        self.components = Components()
        """Built by :meth:`run` (:func:`server_components`)."""
        self.checkpoint = ServerCheckpoint(job, self.out, env.rank, self.shard, self.rule,
                                           components=lambda: self.components.state_dict())
        steps, self.resumed_components = self.checkpoint.resume()
        self.version = steps * self.pace.per_step
        group = cpu_group(timeout_s=config.timeout_s)  # where the workers make theirs
        self.peers = ServerPeers(rank=env.rank, num_servers=self.sync.num_servers, group=group)
        self.wire = ServerWire(self.shard, self.codecs, self.workers, group)

    @property
    def config(self) -> RunConfig:
        """The run's settings."""
        return self.job.run

    @property
    def sync(self) -> ParameterServerSync | ElasticAveragingSync:
        """The plan's sync spec (a :attr:`spec`, checked when the server is made)."""
        assert isinstance(sync := self.job.plan.sync, (ParameterServerSync, ElasticAveragingSync))
        return sync

    @property
    def ps(self) -> ParameterServerSync:
        """The plan's ``ps`` spec (ElasticServer overrides each method that reads this)."""
        assert isinstance(sync := self.job.plan.sync, ParameterServerSync), sync
        return sync

    @property
    def workers(self) -> list[int]:
        """The workers' ranks (those above the servers')."""
        return self.liveness.workers

    def _update_rule(self) -> UpdateRule:
        """How pushed gradients update this server's shard: asynchronous ones are as stale as
        the other workers' pushes between two of one's, each of one worker's share of the batch
        (:mod:`tandem.runtime.asynchrony`)."""
        workers, sync = len(self.workers), self.ps
        return UpdateRule(self.config, self.shard,
                          delay=workers - 1 if sync.mode.asynchronous else 0,
                          share=1 / workers, staleness_lr=sync.staleness_lr,
                          clips=self.config.clip_grad_norm is not None and sync.server_clips,
                          objects=self.job.objects)

    def updates(self) -> int:
        """Updates of the model so far (the summary's ``updates``)."""
        return self.version

    def _pace(self, *, per_step: int | None = None, required: int | None = None) -> Pace:
        """How far this server serves: ``per_step`` updates per step (default:
        :meth:`ParameterServerSync.updates_per_step`), ``required`` pushes a synchronous step
        applies (default: all but the backup workers')."""
        workers = len(self.workers)
        return Pace.of(
            self.config, required=workers - self.ps.backup if required is None else required,
            per_step=self.ps.updates_per_step(workers) if per_step is None else per_step)

    def _reply_values(self, worker: int) -> torch.Tensor:
        """The flat shard a reply to ``worker`` carries: the current parameters."""
        return self.shard.flat()

    def mode_summary(self) -> dict[str, Any]:
        """The summary's fields of this kind of server: its mode, backup workers, staleness."""
        return {"mode": self.ps.mode, "backup": self.ps.backup,
                **self.stats.staleness_summary()}

    def _receive(self, poll: bool) -> tuple[int, protocol.Header, torch.Tensor | None] | None:
        """The next message from any worker (:meth:`ServerWire.receive`). With ``poll``, gives
        up after ``LIVENESS_EVERY_S`` to check which workers went silent, and returns None (also
        where one was lost: :meth:`Liveness.lost`); without, raises after ``--timeout``."""
        if poll and self.liveness.due():
            self._check_liveness()  # also while messages flow: a stuck worker sends none
        try:
            sender, header, gradient = self.wire.receive(LIVENESS_EVERY_S if poll else None,
                                                         limit_s=self.config.timeout_s)
        except (queue.Empty, WorkerLost) as missed:
            if isinstance(missed, WorkerLost):  # its process ended before its goodbye
                self.liveness.lost(missed.worker, missed.error, stop=not poll)
            self._check_liveness()
            return None
        self.stats.traffic[sender] = header.traffic
        return sender, header, gradient

    def _reply(self, worker: int, update: int = -1, stop: bool = False) -> None:
        """Send ``worker`` the current parameters and the ``update`` it goes on to (-1: none;
        :meth:`ServerWire.reply`); a worker that died is left behind in asynchronous modes."""
        try:
            self.wire.reply(worker, lambda: self._reply_values(worker), version=self.version,
                            stop=stop, update=update)
        except RuntimeError as error:  # its process ended: as a lost connection
            self.liveness.lost(worker, error, stop=not self.sync.mode.asynchronous)

    def _check_liveness(self) -> None:
        """Asynchronous modes go on without workers that died or are stuck
        (:meth:`Liveness.check`); the run stops if none is left before the last update."""
        self.liveness.check(held=set(self.waiting))
        if self.version < self.pace.last_update and self.liveness.all_gone():
            dead = ", ".join(map(str, sorted(self.liveness.dead)))
            raise WorkerFailure(f"every worker died (ranks {dead}); server {self.env.rank} "
                                f"stops at update {self.version}")
        self._release_waiting()

    def _apply(self, gradient: torch.Tensor | None, seen_version: int) -> None:
        """Apply the gradient of a push made on ``seen_version``; then the step's end if this
        update completes one."""
        start = time.perf_counter()
        staleness = self.version - seen_version
        self.stats.staleness.append(staleness)
        step = self.version // self.pace.per_step
        if not self.rule.apply(gradient, step=step, batch_size=self.pace.batch_at(step),
                               staleness=staleness, peers=self.peers):
            self.stats.skipped_steps += 1  # an overflowed (fp16) or diverged gradient
        self.version += 1
        self.stats.record_update(start, time.perf_counter(), self.version - 1)
        self.beat.step = self.version
        if self.version % self.pace.per_step == 0:
            self._end_step()

    def _end_step(self) -> None:
        """After a step's last update, before its replies: the components' step hooks."""
        self.components.after_step(self.pace.step_end(self.version))

    def serve(self) -> None:
        """Apply pushes until ``steps`` steps (``last_update`` updates), then stop every
        worker."""
        self.stats.started = time.perf_counter()
        self.waiting = []
        while self.version < self.pace.last_update:
            received = self._receive(poll=self.sync.mode.asynchronous)
            if received is not None:
                self._handle(*received)
        self._stop_all()

    def _handle(self, sender: int, header: protocol.Header, gradient: torch.Tensor | None) -> None:
        kind = header.kind
        if kind == protocol.PUSH and not self.stats.pushes:
            self.stats.started = time.perf_counter()  # rates count from the first gradient
        if kind == protocol.PUSH:
            check_push(self.config, header, gradient, sender=sender, peers=self.peers,
                       per_step=self.pace.per_step)
        if kind == protocol.PULL:
            self._reply(sender, first_update(self.version, self.stats.pushes, self.workers, sender))
        elif kind == protocol.BYE:
            self.liveness.finished.add(sender)
        elif not self.sync.mode.asynchronous:
            self._handle_sync(sender, header, gradient)
        else:
            self.stats.count_push(sender, header)
            self.shard.take_buffers(sender)
            self._apply(gradient, header.version)
            self.waiting.append(sender)
            self._release_waiting()

    def _handle_sync(self, sender: int, header: protocol.Header,
                     gradient: torch.Tensor | None) -> None:
        """Average the first ``required`` pushes of the current step; late ones are dropped."""
        if header.step < self.version:
            self.stats.dropped += 1
            self._reply(sender)
            return
        self.stats.count_push(sender, header)
        self.waiting.append(sender)
        if self.round.add(gradient):
            self.shard.take_buffers(min(self.waiting))
            self._apply(self.round.mean(), self.version)
            stop = self.version >= self.pace.last_update
            for worker in self.waiting:
                self._reply(worker, stop=stop)
            self.waiting = []

    def _release_waiting(self) -> None:
        """Reply to waiting workers that bounded staleness lets go on (all of them in async)."""
        if not self.sync.mode.asynchronous:
            return
        stop, sync, waiting = self.version >= self.pace.last_update, self.ps, len(self.waiting)
        answer, self.waiting = released(
            self.waiting, self.stats.pushes, self.liveness.live(), stop=stop,
            bound=sync.staleness if sync.mode.bounded else None)
        updates = next_updates(self.version, len(self.workers), waiting=waiting, going=len(answer))
        for worker, update in zip(answer, updates):
            self._reply(worker, stop=stop, update=-1 if stop else update)

    def _stop_all(self) -> None:
        """After the last update: answer every remaining message with 'stop' until all are done."""
        self._release_waiting()
        while self.liveness.remaining():
            received = self._receive(poll=self.sync.mode.asynchronous)
            if received is None:
                continue
            sender, header, _ = received
            if header.kind == protocol.BYE:
                self.liveness.finished.add(sender)
            elif header.kind in (protocol.PUSH, protocol.PULL):
                self.stats.dropped += int(header.kind == protocol.PUSH)
                self._reply(sender, stop=True)
        self.liveness.dead |= self.wire.finish(left_behind=self.liveness.dead)

    def run(self) -> dict[str, Any] | None:
        """Serve, then gather the model on server 0, evaluate it and write the outputs."""
        rank0, config = self.env.rank == 0, self.config
        self.reporter = Reporter(
            enabled=rank0, show_progress=config.progress, total_steps=config.steps,
            out=self.out, log_to=config.log_to,
            first_step=self.version // self.pace.per_step)
        self.components = server_components(self)
        self.components.load_state_dict(self.resumed_components)
        with self.reporter:
            self.serve()
            if self.out is not None and not rank0:  # before the gather server 0 waits for
                save_worker_trace(self.out, self.env.rank, self.stats.clock_start,
                                  self.stats.events)
            self.shard.gather(self.peers.group)
            steps = self.version // self.pace.per_step
            if not rank0:
                self.checkpoint.save(steps)  # its shard where the run ends (server 0: below)
                return None
            evaluation = self._evaluate()
            self.reporter.evaluated(steps, evaluation)
        self.checkpoint.save(steps)  # after the evaluation
        return finish(self, evaluation)

    def _evaluate(self) -> dict[str, float | None]:
        return self.task.evaluated(self.shard.model)


def server_components(server: ParameterServer) -> Components:
    """A server's components, in the order they act after a step: progress, the metrics line,
    evaluations, the codecs' snapshot (with ``--compress``), checkpoints (with
    ``--checkpoint-every``; the last step's is saved after the gather, by
    :meth:`ParameterServer.run`); then those that only give the summary its fields
    (compensation, noise scale); last ``TANDEM_FAULT`` (:class:`StepFaults`)."""
    config, reporter = server.config, server.reporter
    return Components(
        reporter, ServerLog(server.stats, reporter, server.pace.batch_at, server.rule.lr),
        (PeriodicEvaluation(config.eval_every, server._evaluate, reporter)  # noqa: SLF001
         if config.eval_every else None),
        server.codecs if server.codecs.spec is not None else None,
        server.checkpoint if config.checkpoint_every else None,
        server.rule.compensation, NoiseScale.unavailable(NO_NOISE_SCALE),
        Learning(reporter, server.job.plan, config),
        StepFaults(server.env.rank, server.version // server.pace.per_step),
    )
