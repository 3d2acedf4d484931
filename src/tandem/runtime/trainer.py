"""Data-parallel training: every worker holds the whole model; a sync strategy keeps them equal.

The classes here are the data-parallel workers that :mod:`tandem.runtime.worker` starts. The
loss of each step is the mean over the *global* batch, so any number of workers computes the
same update as one process on the same data.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tandem.data import shard_sizes
from tandem.errors import UsageError
from tandem.runtime.asynchrony import restore_momentum
from tandem.runtime.base import BaseTrainer
from tandem.runtime.outputs import save_worker_trace
from tandem.runtime.component import Components, StepEnd
from tandem.runtime.checkpoint import (
    CHECKPOINT_VERSION, load_checkpoint, load_schedule, resume_path, save_checkpoint,
)
from tandem.runtime.config import RunConfig, slowdown
from tandem.runtime.job import Job
from tandem.runtime.data_step import DataParallelStep, apply_update, noise_measure
from tandem.runtime.dist import WorkerEnv
from tandem.runtime.divergence import DivergenceCheck
from tandem.runtime.executor import Executor, Handler, Program, compile_program
from tandem.runtime.faults import announce_resume, check_fault_ahead, maybe_fail
from tandem.runtime.memory import PeakMemory
from tandem.runtime.learning_rate import schedule_for, sharded_optimizer
from tandem.runtime.optimizer_setup import scheduler_maker
from tandem.runtime.sharded_checkpoint import (check_sharded_resume, held_state, load_whole_model,
                                               remove_older, restore_state)
from tandem.runtime.precision import Precision
from tandem.runtime.watchdog import Heartbeat
from tandem.schedule import Action, Kind
from tandem.runtime.strategies import build_strategy
from tandem.runtime.task import Task
from tandem.runtime.user_metrics import KeptOutputs, reduced_evaluation
from tandem.runtime.ps import ElasticClient, ParameterServerClient
from tandem.runtime.export import ShardedFinal, final_state
from tandem.runtime.resize import resized_checkpoint
from tandem.sync import SyncStrategy
from tandem.sync.allreduce import AllReduce
from tandem.sync.sync_batchnorm import sync_batchnorms
from tandem.spec.batch_schedule import AUTO
from tandem.spec.codec import CodecSpec
from tandem.spec.sync import ElasticAveragingSync, ParameterServerSync, SyncSpec


SYNC_NAMES = {kind.value: str(Action(0, kind))
              for kind in (Kind.ALLREDUCE, Kind.STEP, Kind.PUSH, Kind.PULL, Kind.EXCHANGE)}
"""The trace name of each action a sync strategy's own loop reports (``0PU``, ``0GX``; see
:meth:`SyncStrategy.action`)."""


def worker_precision(config: RunConfig, env: WorkerEnv, strategy: SyncStrategy,
                     sync: SyncSpec) -> Precision:
    """A worker's precision: it clips where the gradient it applies is its own (not where a
    server clips), and autocasts unless the strategy casts itself (FSDP2's mixed precision)."""
    server_clips = isinstance(sync, ParameterServerSync) and sync.server_clips
    return Precision(config.precision, env.device, autocast=not strategy.casts_forward,
                     clip=None if server_clips else config.clip_grad_norm)


class Trainer(BaseTrainer):
    """Data-parallel worker: the whole model, wrapped by a synchronization strategy."""

    precision: Precision

    def __init__(self, job: Job, env: WorkerEnv, beat: Heartbeat) -> None:
        super().__init__(job, env, beat)
        config = job.run
        self.loss_log.terms_per_sample = 1
        self.data_rank, self.data_world = self._data_position()
        self.divergence.where = f"worker {self.data_rank} (rank {env.rank})"
        self.strategy: SyncStrategy = build_strategy(job, self.data_rank, self.data_world)
        self.slowdown = slowdown(config, env.rank)
        self.stopped = False
        sync = self.plan.sync
        self.updates_per_step = (sync.updates_per_step(self.data_world)
                                 if isinstance(sync, ParameterServerSync) else 1)
        """Updates of the model per optimizer step: a worker's ``step`` counts updates, and it
        reads the share :meth:`batch_share` gives (asynchronous ps)."""
        self.loss_log.collective = self.strategy.synchronous
        checkpoint = self._load_checkpoint()
        if checkpoint is not None:
            checkpoint = resized_checkpoint(checkpoint, world=env.world_size, rank=env.rank,
                                            strategy=self.strategy, compress=self.plan.compress)
        if self.strategy.builds_in_pieces and (checkpoint is None or "sharded" in checkpoint):
            self.strategy.initializer = self.task.initializer()  # None: built whole
        torch.manual_seed(config.seed)
        model = self.task.build_model(meta=self.strategy.initializer is not None)
        load_whole_model(checkpoint, model)
        model = sync_batchnorms(model, env.device) if self.plan.sync_batchnorm else model
        self.module = self.strategy.wrap(model, env.device)
        self.current_step = 0
        self.strategy.recorder = self._record_sync
        self.module.train()
        self.model = self.strategy.unwrap(self.module)
        self.setup_optimizer(self.model.named_parameters(), model=self.model)
        self.optimizer, self.scheduler = sharded_optimizer(
            self.strategy, self.optimizer, self.scheduler, scheduler_maker(job, self.lr_multiplier))
        self.precision = worker_precision(config, env, self.strategy, self.plan.sync)
        self.strategy.step_fn = self.precision.step
        noise, self.noise_samples = noise_measure(
            self.strategy, self.feed, data_world=self.data_world, compress=self.plan.compress,
            log_every=config.log_every,
            last_step=config.stop_after if config.stop_after is not None else config.steps,
            every=config.noise_every or (1 if config.batch_schedule == AUTO
                                         else config.log_every))
        if noise is not None:  # else BaseTrainer's reason: not data parallelism
            self.noise = noise
        if self.noise_samples is not None:
            self.loss_log.noise_window = torch.zeros(3, dtype=torch.float64, device=env.device)
        if checkpoint is not None:
            self._restore(checkpoint)
        self.work = DataParallelStep(self.module, self.precision, self.task.loss, beat,
                                     data_world=self.data_world, strategy=self.strategy,
                                     slowdown=self.slowdown)
        self.executor = Executor(self.trace)
        self.program = self._program()

    def _program(self) -> Program:
        """This worker's actions of the plan's one-stage schedule, bound once to their handlers.

        DDP's allreduce runs all of it (``F``, ``B``, ``AR``, ``ST``); other strategies run the
        forwards and backwards, then their own loop (:meth:`_update`), which reports its actions
        (``PU``/``PL``, ``GX``, ``AR``, ``ST``) as it takes them.
        """
        actions = self.plan.build_schedule().workers[self.data_rank]
        handlers: dict[Kind, Handler] = {Kind.FORWARD: self.work.forward,
                                         Kind.BACKWARD: self.work.backward}
        if self.interprets_update:
            self.strategy.recorder = None  # the interpreter traces AR and ST
            handlers[Kind.ALLREDUCE] = self.work.allreduce
            handlers[Kind.STEP] = lambda action, span: self._update(self.current_step)
        else:
            actions = tuple(action for action in actions if action.kind.is_compute)
        return compile_program(actions, handlers)

    @property
    def interprets_update(self) -> bool:
        """Whether the schedule's ``AR`` and ``ST`` are this strategy's update (DDP's)."""
        return self.strategy.overlapped_allreduce

    def _record_sync(self, code: str, start: float, end: float) -> None:
        """Trace an action of the strategy's own loop."""
        self.trace(SYNC_NAMES[code], start, end, self.current_step)

    def _measure_noise(self, step: int, global_count: int, local_count: int) -> None:
        """Keep this step's noise-scale norms (:class:`NoiseSamples`); at a log step add their
        estimates to the window that rides on the report's allreduce."""
        if self.noise_samples is None or not isinstance(self.strategy, AllReduce):
            return
        scaler = self.precision.scaler
        window = self.noise_samples.measure(step, self.strategy.bucket_norms.take(), local_count,
                                            global_count,
                                            scaler.get_scale() if scaler is not None else 1.0)
        if window is not None and self.loss_log.noise_window is not None:
            self.loss_log.noise_window += window

    def data_partitions(self) -> int:
        return self._data_position()[1]

    def planned_batches(self, first: int, last: int) -> list[torch.Tensor]:
        rank, world = self._data_position()
        return [self.feed.sampler.local_indices(step, rank=rank, world_size=world)
                for step in range(first, last)]

    def _data_position(self) -> tuple[int, int]:
        """This worker's index among the workers that share each global batch, and their count
        (parameter servers' ranks come first and take no share)."""
        servers = self.plan.num_servers
        return self.env.rank - servers, self.env.world_size - servers

    def _load_checkpoint(self) -> dict[str, Any] | None:
        path = resume_path(self.job, self.out)
        checkpoint = None if path is None else load_checkpoint(
            path, self.job.fingerprint(), steps=self.config.steps,
            stop_after=self.config.stop_after)
        announce_resume(self.env.rank, path, checkpoint["step"] if checkpoint else None)
        return check_sharded_resume(checkpoint, path)

    def _restore(self, checkpoint: dict[str, Any]) -> None:
        """Optimizer, schedule, step and this worker's own state (random stream, strategy state,
        its model and optimizer where workers' differ, and its components' states, which
        :meth:`run` hands them)."""
        self.feed.check_position(checkpoint.get("data"), str(self.config.resume))
        own = checkpoint["ranks"][self.env.rank]
        if "model" in own:
            self.model.load_state_dict(own["model"])
        restore_state(checkpoint, own, self.strategy, self.model, self.optimizer)
        restore_momentum(self.optimizer, self.compensation)
        load_schedule(self.optimizer, self.scheduler, checkpoint["scheduler"],
                      announce=self.env.rank == 0)
        self.first_step = int(checkpoint["step"])
        torch.set_rng_state(own["rng"])
        if own.get("sync"):  # a tensor-parallel checkpoint's ranks have none
            self.strategy.load_state_dict(own["sync"])
        self.resumed_components = own["components"]

    def batch_share(self, step: int) -> tuple[int, int]:
        """The global batch and the share of it (among ``data_world``) that this worker's
        ``step`` reads: its own share of batch ``step``; for an asynchronous ps worker, whose
        ``step`` is the servers' update count it computes on, the share of the update the
        servers' last reply numbered (:func:`async_batch_share`)."""
        if self.updates_per_step == 1:
            return step, self.data_rank
        client = self.strategy
        assert isinstance(client, ParameterServerClient) and client.next_update is not None, \
            "asynchronous servers number every update they send a worker on to"
        return async_batch_share(client.next_update, workers=self.updates_per_step)

    def train_step(self, step: int) -> torch.Tensor:
        """One optimizer step on this worker's share of global batch ``step`` (see
        :meth:`batch_share` for asynchronous parameter servers); returns its loss
        summed over its samples (each micro-batch's mean loss times its samples).

        The interpreter runs this worker's actions of the plan's one-stage schedule:
        ``0F{m}``/``0B{m}`` for each micro-batch ``m = data_rank + data_world * k`` (the workers
        share the global batch's micro-batches round-robin), then ``0AR`` (DDP's, spanning the
        last backward, during which its buckets are reduced) and ``0ST``; another strategy's
        own actions (``0PU``/``0PL``, ``0GX``, ``0AR``, ``0ST``) follow the backwards.
        """
        self.current_step = step
        batch_step, share = self.batch_share(step)
        sampler = self.feed.sampler
        global_count = sampler.batch_samples(batch_step)
        indices = sampler.local_indices(batch_step, rank=share, world_size=self.data_world)
        work = self.work
        work.begin(self.feed.take(indices).split(self.plan.accumulate), step, self.env.device,
                   scale=self.data_world / global_count)
        work.batch = (batch_step, len(indices), global_count)
        if self.noise_samples is not None and isinstance(self.strategy, AllReduce):
            wanted = self.noise_samples.wanted(step)
            self.strategy.bucket_norms.enabled = wanted  # a hook measures only the steps wanted
            work.measuring = wanted and not self.strategy.measures_in_hook
        self.executor.run(self.program, step)
        if not self.interprets_update:
            self._update(step)
        return work.loss_total

    def _update(self, step: int) -> None:
        """After the backwards: judge the loss, measure the noise scale, then synchronize and
        apply the update (the schedule's ``ST``, or the strategy's own loop)."""
        self.beat.phase = "step"
        loss_total = self.work.loss_total
        batch_step, local_count, global_count = self.work.batch
        self.divergence.observe(batch_step, loss_total, local_count)
        if not self.interprets_update:  # on CPU: before a diverged gradient leaves this worker
            self.divergence.poll_if_cheap()  # (DDP's left in the backward: the loop polls)
        self._measure_noise(step, global_count, local_count)
        self.loss_log.local_predictions += local_count
        self.strategy.record_loss(loss_total, local_count)
        self.strategy.check_gradients(self.module, step)
        self.stopped = apply_update(self.strategy, self.module, self.optimizer, self.scheduler,
                                    self.precision, step)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float | None]:
        """Accuracy and mean loss on the test split, each worker scoring its own shard."""
        self.beat.phase = "evaluate"
        sizes = shard_sizes(len(self.feed.test), self.env.world_size)
        kept = KeptOutputs(self.task.metrics)
        with self.strategy.evaluating(self.module):
            totals = score_shard(self.task, self.model, self.feed.test, sizes, self.env.rank,
                                 lockstep=self.strategy.collective_forward,
                                 device=self.env.device, keep=kept)
        return reduced_evaluation(totals, kept)

    def end_training(self) -> None:
        self.strategy.finish()
        self.strategy.consensus(self.module)

    def full_state_dict(self) -> dict[str, torch.Tensor] | ShardedFinal | None:
        return final_state(self.strategy, self.model, self.out, self.env.rank)

    def save_checkpoint(self, step: int) -> None:
        if self.out is None or not self.strategy.checkpoints:
            return
        own: dict[str, Any] = {"rng": torch.get_rng_state(), "sync": self.strategy.state_dict(),
                               "components": self.components.state_dict()}
        if not self.strategy.replicas_agree:
            own.update(model=self.model.state_dict(), optimizer=self.optimizer.state_dict())
        ranks: list[dict[str, Any] | None] = [None] * self.env.world_size
        held = held_state(self.strategy, self.out, step, self.model, self.optimizer)
        dist.all_gather_object(ranks, own)
        if self.env.rank != 0:
            return
        save_checkpoint({
            "version": CHECKPOINT_VERSION, "step": step, "fingerprint": self.job.fingerprint(),
            **held, "scheduler": self.scheduler.state_dict(), "ranks": ranks,
            "data": self.feed.position(step),
        }, self.out / "checkpoint.pt", resume=self.config.resume)
        remove_older(self.out, held.get("sharded"))

    def sent_bytes(self) -> float:
        return self.strategy.sent_bytes()

    def summary_extra(self) -> dict[str, Any]:
        """The model's size and the strategy's stats summed over workers; ``sent_bytes_per_step``
        is what all workers sent per step of this run."""
        summed = summed_over_workers(self.strategy.stats(), self.env.device)
        if "sync_bytes" in summed:
            summed["sent_bytes_per_step"] = summed["sync_bytes"] / max(1, len(self.step_times))
        skipped = torch.tensor(float(self.precision.skipped_steps), dtype=torch.float64,
                               device=self.env.device)
        dist.all_reduce(skipped, op=dist.ReduceOp.MAX)
        return {"parameters": sum(p.numel() for p in self.model.parameters()), **summed,
                "precision": self.config.precision, "clip_grad_norm": self.config.clip_grad_norm,
                "skipped_steps": int(skipped), **self.strategy.summary(),
                "worker_memory": worker_memory(self.env, self.strategy, self.memory)}


def worker_memory(env: WorkerEnv, strategy: SyncStrategy,
                  memory: PeakMemory) -> list[dict[str, Any]]:
    """Every worker's memory, in rank order (collective): the state it held after its first
    step (:attr:`SyncStrategy.held_state_bytes`) and its resident memory
    (:meth:`PeakMemory.summary`)."""
    values: list[Any] = [None] * env.world_size
    dist.all_gather_object(values, {"rank": env.rank, "held_state_bytes":
                                    strategy.held_state_bytes, **memory.summary()})
    return values


def score_shard(task: Task, model: torch.nn.Module, test: Any, sizes: list[int], rank: int, *,
                lockstep: bool, device: torch.device | None = None,
                keep: KeptOutputs | None = None) -> torch.Tensor:
    """This worker's evaluation totals (:meth:`Task.score`) on its share ``sizes[rank]`` of
    ``test``. ``lockstep`` (a forward is collective): in as many pieces as every other worker,
    of up to 1024 samples; where the share has fewer samples than pieces, the forward the
    others run is run on one sample and not counted (nor kept: ``keep``, for the user's
    metrics)."""
    start, size = sum(sizes[:rank]), sizes[rank]
    if not lockstep:
        return task.score(model, start, start + size, samples=test, device=device, keep=keep)
    totals: torch.Tensor | None = None
    for piece in shard_sizes(size, max(1, -(-sizes[0] // 1024))):
        part = task.score(model, start, start + piece, samples=test, device=device,
                          keep=keep) if piece \
            else 0 * task.score(model, 0, 1, samples=test, device=device)
        totals = part if totals is None else totals + part
        start += piece
    assert totals is not None
    return totals


def summed_over_workers(stats: dict[str, float], device: torch.device) -> dict[str, float]:
    """Each of ``stats``' numbers summed over all workers (collective)."""
    totals = torch.tensor([float(stats.get(key, 0.0)) for key in sorted(stats)] or [0.0],
                          dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    return {key: totals[i].item() for i, key in enumerate(sorted(stats))}


def async_batch_share(update: int, *, workers: int) -> tuple[int, int]:
    """The global batch and share of it that an asynchronous ps worker reads for the run's
    ``update`` (of ``workers`` per step): share ``update % workers`` of batch ``update //
    workers``. The servers number the updates (:class:`~tandem.runtime.ps.rounds.UpdateNumbers`)
    so that every share of every batch is read once, in whatever order and however many at a
    time they answer the workers."""
    return update // workers, update % workers


class ParameterServerWorker(Trainer):
    """A worker of a parameter-server job: computes gradients until a server says stop.

    It takes no part in collectives: servers log, evaluate and save (from rank 0), and resume
    from their own checkpoints, so a worker loads none.
    """

    def _load_checkpoint(self) -> dict[str, Any] | None:
        """None: the servers hold the model. A compressed worker restores its codec state from
        ``worker-K.pt`` before its first pull, and saves it where the servers checkpoint.

        Before the first pull, too: the client's waits show in the heartbeat, and in
        asynchronous modes a failed one is diagnosed among the servers only (the ranks such a
        worker waits for; in ``sync`` mode it waits for every worker's push)."""
        client = self.strategy
        if isinstance(client, ParameterServerClient):
            client.beat = self.beat
            sync = self.plan.sync
            if isinstance(sync, (ParameterServerSync, ElasticAveragingSync)) and sync.asynchronous:
                self.beat.peers = list(range(self.plan.num_servers))
                self.beat.peer_kind = "server"
        if not isinstance(client, ParameterServerClient) or not self.plan.compress:
            return None
        client.on_pushed = self._save_codec_state
        path = resume_path(self.job, self.out, f"worker-{self.env.rank}.pt")
        if path is not None and (path.is_file() or self.config.resume != "auto"):
            client.resume_state = load_checkpoint(path, self.job.fingerprint(),
                                                  steps=self.config.steps)["codecs"]
        return None

    def _save_codec_state(self, step: int) -> None:
        """After the push of ``step``: the codec state that goes with the servers' checkpoint
        after ``step + 1`` updates (see :meth:`_load_checkpoint`)."""
        config, per_step = self.config, self.updates_per_step
        if (step + 1) % per_step:
            return
        done = (step + 1) // per_step
        if self.out is None or not (done == config.stop_after or (
                config.checkpoint_every and done % config.checkpoint_every == 0)):
            return
        client = self.strategy
        if isinstance(client, ParameterServerClient):
            save_checkpoint({"version": CHECKPOINT_VERSION, "step": done,
                             "fingerprint": self.job.fingerprint(),
                             "codecs": client.codec_state()},
                            self.out / f"worker-{self.env.rank}.pt", resume=config.resume)

    def build_components(self) -> Components:
        """A worker's one component: the loss watch, read after every update (the push read
        the loss anyway); the servers log, evaluate and save."""
        return Components(DivergenceCheck(self.divergence, lambda: self.precision.skipped_in_a_row,
                                          thorough=True))

    def run(self) -> dict[str, Any] | None:
        client = self.strategy
        if not isinstance(client, ParameterServerClient):
            raise TypeError(f"a parameter-server worker needs a ps client, not {client!r}")
        step = client.next_step
        per_step, steps = self.updates_per_step, self.config.steps
        components = self.components = self.start_components()
        self.start_loading(step // per_step, steps)
        reached = None
        check_fault_ahead(self.env.rank, step // per_step)
        try:
            while not self.stopped:
                maybe_fail(self.env.rank, step // per_step, since=reached)
                reached = step // per_step
                self.train_step(step)
                components.after_step(StepEnd(done=step // per_step + 1, last=steps))
                step = client.next_step
        finally:
            self.stop_loading()
        if self.out is not None:  # before saying goodbye: server 0 merges it after the last one
            save_worker_trace(self.out, self.env.rank, self.clock_start, self.events)
        client.finish()
        return None


class ElasticWorker(ParameterServerWorker):
    """A worker of asynchronous EASGD: local steps with its own optimizer, an elastic exchange
    with the servers every period (:class:`~tandem.runtime.ps.ElasticClient`), on its own clock.

    It takes the center when it is ready to train (the servers answer once every worker has
    asked, so that all start together however long each took to set up). Its local steps
    continue from the servers' version, which is also where its learning-rate schedule resumes;
    a resumed worker starts from the saved center with fresh momentum (the servers' checkpoint
    holds the center, not the workers' own variables).
    """

    def run(self) -> dict[str, Any] | None:
        client = self.strategy
        if not isinstance(client, ElasticClient):
            raise TypeError(f"an EASGD worker needs an elastic client, not {client!r}")
        client.pull()
        if client.next_step:
            self.scheduler = schedule_for(self.config, self.optimizer, self.lr_multiplier,
                                          last_epoch=client.next_step - 1)
        return super().run()
