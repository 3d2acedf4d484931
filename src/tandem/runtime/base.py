"""What every trainer shares: the step loop, and the components it calls after each step.

A trainer subclass supplies how one optimizer step runs (``train_step``), how the model is
evaluated, and how its full state is gathered and checkpointed. What a trainer does after its
steps (progress and metrics, the loss watch, the batch's growth, evaluations, checkpoints, the
noise scale, compensation, precision, memory) is a
:class:`~tandem.runtime.component.Component` in :attr:`BaseTrainer.components`, whose states a
checkpoint holds under ``components``; the batches the steps take come from the
:class:`~tandem.runtime.batches.BatchFeed` (:attr:`BaseTrainer.feed`), which the steps call.
"""

from __future__ import annotations

import abc
import statistics
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tandem.plan import Plan
from tandem.runtime.asynchrony import Compensation
from tandem.runtime.batches import BatchFeed, BatchGrowth
from tandem.runtime.callbacks import UserCallbacks
from tandem.runtime.checkpoint import Checkpoints
from tandem.runtime.component import Components, StepEnd
from tandem.runtime.config import RunConfig
from tandem.runtime.dist import WorkerEnv
from tandem.runtime.divergence import DivergenceCheck, LossWatch
from tandem.runtime.export import ShardedFinal, write_final
from tandem.runtime.faults import check_fault_ahead, maybe_fail
from tandem.runtime.job import Job
from tandem.runtime.learning import Learning
from tandem.runtime.learning_rate import batch_lr_factor, lr_factor, scaled_lr
from tandem.runtime.loss_log import LogHooks, LossLog
from tandem.runtime.memory import PeakMemory
from tandem.runtime.membership import Membership
from tandem.runtime.noise_scale import NoiseScale
from tandem.runtime.optimizer_setup import worker_optimizer
from tandem.runtime.outputs import (
    MAX_TRACED_STEPS, gather_events, plan_summary, write_run_files, write_timeline,
)
from tandem.runtime.precision import Precision, StagePrecision
from tandem.runtime.reporting import PeriodicEvaluation, Reporter
from tandem.runtime.task import Task
from tandem.runtime.watchdog import Heartbeat
from tandem.spec.batch_schedule import AUTO, format_schedule
from tandem.strategy import strategy_of
from tandem.timeline import Event, Timeline


class Worker(abc.ABC):
    """One process of a job, built from the job, its place in it and its heartbeat; every
    implementation (a trainer of a sync method, a pipeline stage, a parameter server) runs the
    whole job with :meth:`run`."""

    @abc.abstractmethod
    def __init__(self, job: Job, env: WorkerEnv, beat: Heartbeat) -> None:
        """Build this worker's part of the job (collective where it needs to be)."""

    @abc.abstractmethod
    def run(self) -> dict[str, Any] | None:
        """Run the job to its end; rank 0 returns the summary, the others None."""


class BaseTrainer(Worker):
    """State of one worker's run; :meth:`run` trains, evaluates and writes the outputs."""

    module: torch.nn.Module
    """The part of the model this worker trains (set by the subclass)."""
    precision: Precision | StagePrecision
    """Its mixed precision and clipping (set by the subclass)."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    """Set by :meth:`setup_optimizer`."""

    def __init__(self, job: Job, env: WorkerEnv, beat: Heartbeat) -> None:
        config = job.run
        self.job = job
        self.env = env
        self.beat = beat
        self.out = Path(config.out) if config.out else None
        self.task = Task(config, job.objects)
        self.feed = BatchFeed(self.task, config, env.device, self.data_partitions())
        """The batch schedule and the loader (:mod:`tandem.runtime.batches`)."""
        self.first_step = 0
        self.events: list[Event] = []
        self.step_times: list[float] = []
        self.clock_start = time.perf_counter()
        first_targets = self.feed.data.train.rows(0, 1).targets
        self.loss_log = LossLog(
            self.feed.sampler, env.device, first_step=0, step_times=self.step_times,
            terms_per_sample=(first_targets[0].numel()
                              if isinstance(first_targets, torch.Tensor) else 1),
            hooks=LogHooks(lr=lambda: float(self.scheduler.get_last_lr()[0]),
                           sent_bytes=self.sent_bytes, data_wait_s=lambda: self.feed.wait_s,
                           noise=lambda: self.noise,
                           record=lambda **fields: self.reporter.record(**fields)))
        """The metrics line at log steps (:mod:`tandem.runtime.loss_log`)."""
        self.compensation = Compensation(delay=0, momentum=config.momentum, lr_scale=1.0)
        """How this worker's optimizer compensates stale updates (set by setup_optimizer)."""
        self.reporter = Reporter(enabled=False, show_progress=False, out=None,
                                 total_steps=config.steps, first_step=0)
        self.divergence = LossWatch(config, where=f"worker {env.rank} (rank {env.rank})",
                                    rank=env.rank, device=env.device)
        """This worker's losses, judged for divergence (:mod:`tandem.runtime.divergence`);
        subclasses observe them and may name the worker otherwise."""
        self.noise = NoiseScale.unavailable(
            f"the gradient noise scale is measured in data parallelism only (--strategy dp, "
            f"from each worker's gradient and their allreduced mean); strategy "
            f"{strategy_of(job.plan)} has no such pair")
        """The gradient noise scale's moving averages (:mod:`tandem.runtime.noise_scale`)."""
        self.memory = PeakMemory()
        self.components = Components()
        """The components :meth:`train_steps` calls after each step (built by :meth:`run`)."""
        self.resumed_components: dict[str, Any] = {}
        """A resumed run's components' states (set by the subclass; :meth:`start_components`)."""

    @property
    def plan(self) -> Plan:
        """The job's plan."""
        return self.job.plan

    @property
    def config(self) -> RunConfig:
        """The run's settings."""
        return self.job.run

    # -- data and the optimizer ------------------------------------------------------------------

    def data_partitions(self) -> int:
        """Workers that each take a share of every global batch (the data-parallel ranks); 1
        where one worker reads whole batches (a pipeline's first and last stages)."""
        return 1

    def planned_batches(self, first: int, last: int) -> list[torch.Tensor]:
        """The sample indices of every batch this worker takes in steps ``first`` to
        ``last - 1``, in order (read ahead by the loader); none by default."""
        return []

    def start_loading(self, first: int, last: int) -> None:
        """Start the background loader over this worker's batches of steps ``first`` to
        ``last - 1`` (``--loader-workers``; none for data held in memory)."""
        self.feed.start_loading(lambda: self.planned_batches(first, last))

    def stop_loading(self) -> None:
        """Stop the background loader (its processes end)."""
        self.feed.stop_loading()

    def setup_optimizer(self, params: Iterable[tuple[str, torch.Tensor]], *, model: nn.Module,
                        delay: int = 0, every_stage: bool = False) -> None:
        """Create the optimizer over ``params``, its compensation and the run's schedule
        (:func:`~tandem.runtime.optimizer_setup.worker_optimizer`)."""
        self.optimizer, self.compensation, self.scheduler = worker_optimizer(
            self.job, params, model=model, multiplier=self.lr_multiplier, delay=delay,
            every_stage=every_stage)

    def lr_multiplier(self, step: int) -> float:
        """The scheduler's factor of the optimizer's learning rate at ``step``: warm-up and
        schedule, times the batch's (``--lr-scaling`` with a ``--batch-schedule``; ``auto``: at
        the noise scale measured so far)."""
        return lr_factor(self.config, step) * batch_lr_factor(
            self.config, self.feed.sampler.batch_size_at(step), noise_scale=self.noise.estimate())

    # -- what a subclass supplies ----------------------------------------------------------------

    @abc.abstractmethod
    def train_step(self, step: int) -> torch.Tensor:
        """One optimizer step; returns this worker's summed loss (zero if it computes none)."""

    @abc.abstractmethod
    def evaluate(self) -> dict[str, float | None]:
        """``test_accuracy`` and ``test_loss`` on the test split (same on every worker)."""

    @abc.abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor] | ShardedFinal | None:
        """The model's state for rank 0's ``final.pt`` (:func:`tandem.runtime.export.final_state`)."""

    def end_training(self) -> None:
        """Called on every worker after the last step, before evaluation (may be collective)."""

    def save_checkpoint(self, step: int) -> None:
        """Save a checkpoint after ``step`` steps (collective); default: none."""

    def summary_extra(self) -> dict[str, Any]:
        """Strategy-specific fields of rank 0's summary; called on every rank (may be
        collective)."""
        return {}

    def sent_bytes(self) -> float:
        """Bytes this worker has sent to synchronize training so far (activations, gradients,
        parameters; what the codec made of them with ``--compress``)."""
        return 0.0

    # -- the run ---------------------------------------------------------------------------------

    def build_components(self) -> Components:
        """The components of this run, in the order they act after a step: progress, the loss
        watch, the metrics line, the batch's growth, evaluations, memory, checkpoints (those
        off are left out); then those that only give the summary its fields or hold state."""
        config, told = self.config, self.reporter.callbacks  # the user's callbacks
        return Components(
            # first: the step a checkpoint of this step records
            Membership(self.env.world_size, rank=self.env.rank, resizes=self.env.resizes),
            self.reporter,
            DivergenceCheck(self.divergence, lambda: self.precision.skipped_in_a_row),
            self.loss_log,
            (BatchGrowth(self.feed, self.noise.estimate, lambda: self.scheduler)
             if config.batch_schedule == AUTO else None),
            (PeriodicEvaluation(config.eval_every, self.evaluate, self.reporter)
             if config.eval_every else None),
            self.memory,
            Checkpoints(told.telling(self.memory.measured(self.save_checkpoint), self.out),
                        check=lambda step: self.divergence.check_parameters(
                            self.module.parameters(), step)),
            told if told.active else None,
            self.noise, self.compensation, self.precision,
            Learning(self.reporter, self.plan, config),
        )

    def start_components(self) -> Components:
        """The run's components (:meth:`build_components`) with a resumed run's states."""
        components = self.build_components()
        components.load_state_dict(self.resumed_components)
        return components

    def run(self) -> dict[str, Any] | None:
        """Train from the first step to the last (or ``--stop-after``); rank 0 returns a summary."""
        config = self.config
        last_step = config.stop_after if config.stop_after is not None else config.steps
        check_fault_ahead(self.env.rank, self.first_step)
        self.loss_log.logged = self.first_step
        self.reporter = Reporter(
            enabled=self.env.rank == 0, show_progress=config.progress, total_steps=config.steps,
            out=self.out, log_to=config.log_to, first_step=self.first_step,
            callbacks=UserCallbacks(self.task.callbacks, self.env.rank,
                                    lr=lambda: float(self.scheduler.get_last_lr()[0])),
        )
        self.memory.training_bytes = 0
        self.components = self.start_components()
        with self.reporter:
            self.start_loading(self.first_step, last_step)
            try:
                self.train_steps(self.first_step, last_step)
            finally:
                self.stop_loading()
            self.end_training()
            self.memory.training_done()
            evaluation = self.evaluate()
            self.reporter.evaluated(last_step, evaluation)
        finished = last_step == config.steps
        final = self._write_outputs(finished)
        extra = self.summary_extra()
        write_final(final, self.out)  # rank 0, after the collectives: no rank waits on it
        if self.env.rank != 0:
            return None
        return {**run_summary(self, last_step, evaluation, finished), **extra}

    def train_steps(self, first: int, last: int) -> None:
        """Optimizer steps ``first`` to ``last - 1``, each followed by the components' step hook
        (logging, evaluation and checkpoints among them), for which the run's last step is
        final, not ``last``: a caller training in pieces gets no log or checkpoint per piece."""
        config, components, loss_log = self.config, self.components, self.loss_log
        if not components:  # called without run(): the components of a run
            components = self.components = self.start_components()
        end = config.stop_after if config.stop_after is not None else config.steps
        for step in range(first, last):
            maybe_fail(self.env.rank, step)
            start = time.perf_counter()
            loss_log.add(self.train_step(step))
            self.step_times.append(time.perf_counter() - start)
            done = step + 1
            components.after_step(StepEnd(
                done=done, last=end, logging=done % config.log_every == 0 or done == end,
                saving=done == end or bool(config.checkpoint_every
                                           and done % config.checkpoint_every == 0)))

    def trace(self, name: str, start: float, end: float, step: int, *, num_bytes: int = 0,
              version: int = -1) -> None:
        """Record one action of this worker in the timeline (first ``MAX_TRACED_STEPS`` steps)."""
        if step - self.first_step < MAX_TRACED_STEPS:
            self.events.append(Event(
                worker=self.env.rank, name=name, start_s=start - self.clock_start,
                end_s=end - self.clock_start, step=step, bytes=num_bytes, version=version,
            ))

    def _write_outputs(self, finished: bool) -> dict[str, torch.Tensor] | ShardedFinal | None:
        """Rank 0 writes ``trace.json``, ``gantt.png``, ``config.json`` (events gathered on its
        clock: :func:`~tandem.runtime.outputs.gather_events`); returns ``final.pt``'s state."""
        events = gather_events(self.env, self.clock_start, self.events)
        state = self.full_state_dict() if finished and self.out else None
        if events is None or self.out is None:
            return None
        write_timeline(self.out, Timeline(events=events),
                       title=f"{strategy_of(self.plan)}, {self.config.model.partition(':')[0]}, "
                             f"{self.env.world_size} workers")
        write_run_files(self.job, self.out)
        return state


def run_summary(trainer: BaseTrainer, last_step: int, evaluation: dict[str, float | None],
                finished: bool) -> dict[str, Any]:
    """Rank 0's summary of ``trainer``'s run, up to ``last_step`` (strategy-specific fields
    aside: :meth:`BaseTrainer.summary_extra`)."""
    timed = trainer.step_times[min(len(trainer.step_times) - 1, 2):]
    train_s = sum(trainer.step_times)
    config, sampler = trainer.config, trainer.feed.sampler
    return {
        **plan_summary(trainer.plan), "model": config.model, "data": config.data,
        "world_size": trainer.env.world_size, "backend": trainer.env.backend,
        "steps": last_step, "finished": finished,
        "global_batch_size": sampler.batch_size_at(last_step - 1),
        "batch_schedule": config.batch_schedule,
        **({"batch_schedule_grown": format_schedule(sampler.schedule)}
           if config.batch_schedule == AUTO else {}),
        "lr": scaled_lr(config, noise_scale=trainer.noise.estimate()),
        "final_loss": trainer.loss_log.loss, **evaluation, **trainer.task.summary_fields(),
        "samples_per_s": sum(sampler.batch_size_at(step) for step in range(
            trainer.first_step, trainer.first_step + len(trainer.step_times)))
        / max(train_s, 1e-12),
        "step_time_s": statistics.median(timed) if timed else 0.0,
        "train_s": round(train_s, 4), "out": str(trainer.out) if trainer.out else None,
        **trainer.feed.wait_summary(train_s), **trainer.components.summary(),
    }
