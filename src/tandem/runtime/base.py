"""What every trainer shares: data, sampling, optimizer, logging, outputs and the step loop.

A trainer subclass supplies how one optimizer step runs (``train_step``), how the model is
evaluated, and how its full state is gathered and checkpointed.
"""

from __future__ import annotations

import abc
import bisect
import dataclasses
import json
import math
import statistics
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tandem import strict_json
from tandem.spec.batch_schedule import AUTO, auto_next_batch, format_schedule, parse_batch_schedule
from tandem.data import Batch, Data, GlobalBatchSampler, Samples
from tandem.data.loader import PlannedLoader
from tandem.data.shards import ShardSamples
from tandem.errors import UsageError
from tandem.runtime import memory
from tandem.runtime.faults import maybe_fail
from tandem.runtime.optimizers import Lamb, Lars
from tandem.runtime.noise_scale import NoiseScale
from tandem.output_files import write_text
from tandem.runtime.asynchrony import Compensation, apply_compensation, compensation_for
from tandem.runtime.checkpoint import save_atomic
from tandem.plan import Plan
from tandem.runtime.config import DEFAULT_BASE_BATCH, Job, RunConfig, step_decay
from tandem.runtime.dist import WorkerEnv
from tandem.runtime.divergence import LossWatch
from tandem.runtime.zygote import child_context
from tandem.runtime.precision import Precision, StagePrecision
from tandem.runtime.reporting import Reporter
from tandem.runtime.task import Task
from tandem.runtime.watchdog import Heartbeat
from tandem.strategy import strategy_of
from tandem.spec.sync import ElasticAveragingSync
from tandem.timeline import Event, Timeline, plot_gantt

MAX_TRACED_STEPS = 1000
"""Steps whose actions are recorded in ``trace.json`` (bounds the trace of long runs)."""
GANTT_STEPS = 3
"""``gantt.png`` draws the last this many traced steps (the steady state, readable)."""


def build_optimizer(config: RunConfig,
                    params: Iterable[torch.Tensor | tuple[str, torch.Tensor]], *,
                    nesterov: bool = False) -> torch.optim.Optimizer:
    """The optimizer named in ``config`` over ``params`` (tensors, or ``(name, tensor)`` pairs
    as ``named_parameters()`` gives them), at :func:`scaled_lr` for the run's first batch;
    ``nesterov``: SGD with Nesterov momentum (EAMSGD's workers;
    :class:`~tandem.runtime.config.Job` has checked that the optimizer is SGD with momentum).

    LARS and LAMB get two groups, always in this order (a pipeline stage's checkpoint matches
    groups by position): the weights (``ndim >= 2``), with trust ratio and weight decay, then the
    biases and normalization parameters (``ndim <= 1``), with neither, as in both papers. Their
    norms are taken per whole parameter, which every worker holds: data-parallel replicas hold
    the whole model, a pipeline stage whole parameters, and a parameter server a shard of whole
    parameters (:func:`tandem.sync.ps_protocol.shard_ranges` cuts between tensors)."""
    tensors = [p[1] if isinstance(p, tuple) else p for p in params]
    lr = scaled_lr(config)
    if config.optimizer == "sgd":
        return torch.optim.SGD(tensors, lr=lr, momentum=config.momentum,
                               weight_decay=config.weight_decay, nesterov=nesterov)
    if config.optimizer in ("lars", "lamb"):
        groups = [{"params": [p for p in tensors if p.ndim > 1]},
                  {"params": [p for p in tensors if p.ndim <= 1], "weight_decay": 0.0,
                   "trust": False}]
        if config.optimizer == "lars":
            return Lars(groups, lr=lr, momentum=config.momentum,
                        weight_decay=config.weight_decay)
        return Lamb(groups, lr=lr, weight_decay=config.weight_decay)
    cls = torch.optim.Adam if config.optimizer == "adam" else torch.optim.AdamW
    return cls(tensors, lr=lr, weight_decay=config.weight_decay)


def scaled_lr(config: RunConfig, batch_size: int | None = None) -> float:
    """The learning rate at global batch ``batch_size`` (default ``config.batch_size``): ``--lr``
    itself, or with ``--lr-scaling`` the ``--lr`` given for ``--base-batch`` B0 times ``B/B0``
    (linear) or ``sqrt(B/B0)`` (sqrt); warm-up and schedule multiply it (:func:`lr_factor`)."""
    batch = config.batch_size if batch_size is None else batch_size
    if config.lr_scaling is None:
        return config.lr
    ratio = batch / (config.base_batch or DEFAULT_BASE_BATCH)
    return config.lr * (ratio if config.lr_scaling == "linear" else math.sqrt(ratio))


def lr_factor(config: RunConfig, step: int) -> float:
    """Learning-rate multiplier at ``step``: linear warm-up, then constant, cosine decay, or
    step decay (``step:FACTOR@STEP,...``: times FACTOR at each STEP reached)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.lr_schedule.startswith("step:"):
        factor, milestones = step_decay(config.lr_schedule, steps=config.steps)
        return factor ** bisect.bisect_right(milestones, step)
    if config.lr_schedule == "cosine":
        progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0


def batch_lr_factor(config: RunConfig, batch_size: int) -> float:
    """Learning-rate multiplier for a step of global batch ``batch_size`` against the run's
    first batch (``config.batch_size``, which :func:`build_optimizer` scaled for): 1 without
    ``--lr-scaling`` (the learning rate does not follow a ``--batch-schedule``), else the ratio
    of :func:`scaled_lr` at the two batches. Every trainer's learning rate goes through here
    (:meth:`BaseTrainer.setup_optimizer`, the parameter server's step)."""
    if config.lr_scaling is None:
        return 1.0
    return scaled_lr(config, batch_size) / scaled_lr(config)


def plan_summary(plan: Plan) -> dict[str, Any]:
    """What every run's summary says of its plan: strategy, layout, schedule, micro-batches."""
    return {"strategy": strategy_of(plan), "plan": plan.config, "schedule": plan.schedule,
            "microbatches": plan.num_microbatches,
            "compress": plan.compress.text if plan.compress else None}


def write_run_files(job: Job, out: Path) -> None:
    """``config.json`` (the run's settings and its plan) and ``plan.json`` (the plan alone, which
    ``tandem train --plan`` and ``tandem simulate --plan`` read back)."""
    settings = {"run": dataclasses.asdict(job.run), "plan": job.plan.to_dict()}
    write_text(out / "config.json", strict_json.dumps(settings, indent=2))
    job.plan.save(str(out / "plan.json"))


WORKER_TRACE = "trace-rank{rank}.json"
"""A worker's own events, for runs whose workers meet in no collective (parameter servers)."""


def save_worker_trace(out: Path, rank: int, clock_start: float, events: list[Event]) -> None:
    """Write ``events`` (timed from ``clock_start``, a ``perf_counter`` reading) with the wall
    clock time of ``clock_start``, so that :func:`merge_worker_traces` can align them."""
    epoch_start = time.time() - (time.perf_counter() - clock_start)
    payload = {"epoch_start_s": epoch_start, "events": [dataclasses.asdict(e) for e in events]}
    write_text(out / WORKER_TRACE.format(rank=rank), strict_json.dumps(payload))


def merge_worker_traces(out: Path, ranks: list[int], clock_start: float,
                        events: list[Event]) -> Timeline:
    """``events`` of this process and those saved by the workers ``ranks``, on this process's
    clock (good to the machines' wall-clock agreement); the saved files are removed."""
    epoch_start = time.time() - (time.perf_counter() - clock_start)
    merged = list(events)
    for rank in ranks:
        path = out / WORKER_TRACE.format(rank=rank)
        if not path.exists():  # a worker that died before writing it
            continue
        saved = json.loads(path.read_text())
        shift = saved["epoch_start_s"] - epoch_start
        merged += [dataclasses.replace(Event(**event), start_s=event["start_s"] + shift,
                                       end_s=event["end_s"] + shift) for event in saved["events"]]
        path.unlink()
    return Timeline(events=merged)


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

    def __init__(self, job: Job, env: WorkerEnv, beat: Heartbeat) -> None:
        config = job.run
        self.job = job
        self.plan = job.plan
        self.config = config
        self.env = env
        self.beat = beat
        self.out = Path(config.out) if config.out else None
        self.task = Task(config, job.objects)
        self.data: Data = self.task.data
        self.train: Samples = self.data.train.to(env.device)
        self.test: Samples = self.data.test.to(env.device)
        self.sampler: GlobalBatchSampler = self.data.train.batch_sampler(
            global_batch_size=config.batch_size, seed=config.seed,
            partitions=self.data_partitions(), schedule=config.parsed_batch_schedule())
        self.loader: PlannedLoader | None = None
        self.data_wait_s = 0.0
        """Seconds this worker's steps waited for their batches (read, or handed over), after
        the first batch."""
        self.first_data_wait_s: float | None = None
        """Seconds the first batch took (with a loader: its processes' start)."""
        first_targets = self.data.train.rows(0, 1).targets
        self.predictions_per_sample = (first_targets[0].numel()
                                       if isinstance(first_targets, torch.Tensor) else 1)
        """Predictions (targets) in one sample: 1, or its positions for a language model."""
        self.loss_terms_per_sample = self.predictions_per_sample
        """Terms one sample adds to the summed loss ``train_step`` returns: 1 where the loss is a
        per-sample mean weighted by samples (:mod:`tandem.loss`), else its predictions."""
        self.first_step = 0
        self.events: list[Event] = []
        self.step_times: list[float] = []
        self.clock_start = time.perf_counter()
        self.loss_total = torch.zeros((), device=env.device)
        self.loss = math.nan
        self.collective_logging = True
        """False for strategies without global rounds: each worker logs its own loss."""
        self.local_predictions = 0
        self.logged = 0
        self.logged_bytes = 0.0
        self.pending_log: tuple[Any, torch.Tensor, int, dict[str, Any]] | None = None
        self.compensation = Compensation(delay=0, momentum=config.momentum, lr_scale=1.0)
        """How this worker's optimizer compensates stale updates (set by setup_optimizer)."""
        self.reporter = Reporter(enabled=False, show_progress=False, metrics_path=None,
                                 total_steps=config.steps, first_step=0)
        self.divergence = LossWatch(config, where=f"worker {env.rank} (rank {env.rank})",
                                    rank=env.rank, device=env.device)
        """This worker's losses, judged for divergence (:mod:`tandem.runtime.divergence`);
        subclasses observe them and may name the worker otherwise."""
        self.noise = NoiseScale.unavailable(
            f"the gradient noise scale is measured in data parallelism only (--strategy dp, "
            f"from each worker's gradient and their allreduced mean); strategy "
            f"{strategy_of(job.plan)} has no such pair")
        """The gradient noise scale's moving averages (see :meth:`noise_scale`)."""
        self.noise_window: torch.Tensor | None = None
        """Where estimates of a subclass that measures them are summed until the next report:
        ``[sum of |G|² estimates, sum of tr(Σ) estimates, their count]`` (float64)."""

    def noise_scale(self) -> float | None:
        """The current estimate of the gradient noise scale B_simple = tr(Σ)/|G|² (the ratio of
        moving averages as of the last report whose sums arrived), or None where it is not
        measured or not yet positive (``self.noise.summary()`` says why)."""
        return self.noise.estimate()

    def data_partitions(self) -> int:
        """Workers that each take a share of every global batch (the data-parallel ranks); 1
        where one worker reads whole batches (a pipeline's first and last stages)."""
        return 1

    def planned_batches(self, first: int, last: int) -> list[torch.Tensor]:
        """The sample indices of every batch this worker takes in steps ``first`` to
        ``last - 1``, in order (read ahead by the loader); none by default."""
        return []

    def take_batch(self, indices: torch.Tensor) -> Batch:
        """The training batch of ``indices`` on this worker's device: handed over by the loader
        when it read it ahead, else read now; the wait counts in ``data_wait_s``."""
        start = time.perf_counter()
        batch = self.loader.take(indices) if self.loader is not None else None
        if batch is None:
            batch = self.train.take(indices)
        waited = time.perf_counter() - start
        if self.first_data_wait_s is None:
            self.first_data_wait_s = waited
        else:
            self.data_wait_s += waited
        return batch

    def data_position(self, step: int) -> dict[str, Any]:
        """What a checkpoint after ``step`` steps records of the data: where the next step
        reads (epoch, samples into it), the ranks the order was cut for, and the shards."""
        train = self.data.train
        return {**self.sampler.position(step), "partitions": self.data_partitions(),
                "shards": train.index.fingerprint if isinstance(train, ShardSamples) else None,
                "batch_size": self.sampler.batch_size_at(step),
                "batch_schedule": format_schedule(self.sampler.schedule)}

    def restore_batch_schedule(self, recorded: dict[str, Any] | None) -> None:
        """``--batch-schedule auto``: continue with the batches the checkpointed run had grown
        to (a fixed schedule is the run's own, and checked by the fingerprint)."""
        if self.config.batch_schedule != AUTO or not recorded or "batch_schedule" not in recorded:
            return
        for step, batch in parse_batch_schedule(recorded["batch_schedule"],
                                                steps=self.config.steps)[1:]:
            self.sampler.extend(step, batch)

    def grow_batch(self, done: int) -> None:
        """``--batch-schedule auto``, after ``done`` steps at a log step: the batch of the steps
        from ``done`` on, by :func:`tandem.spec.batch_schedule.auto_next_batch` (every worker decides
        the same: the largest decision wins)."""
        if self.config.batch_schedule != AUTO or done >= self.config.steps:
            return
        current = self.sampler.batch_size_at(done)
        estimate = self.noise_scale()  # None until measured: the batch stays as it is
        workers = self.data_partitions()
        chosen = auto_next_batch(current, estimate, workers=workers,
                                 max_batch=len(self.data.train))
        agreed = torch.tensor(float(chosen), dtype=torch.float64, device=self.loss_total.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        if int(agreed) > current:
            self.sampler.extend(done, int(agreed))
            # the scheduler set step ``done``'s rate for the old batch: set it again
            self.scheduler.last_epoch -= 1
            self.scheduler.step()

    def check_data_position(self, recorded: dict[str, Any] | None, path: str) -> None:
        """Refuse to resume streamed data whose order would differ from the checkpoint's."""
        if recorded is None or not self.data.train.streams:
            return
        now = self.data_position(0)
        if recorded.get("shards") != now["shards"]:
            raise UsageError(f"checkpoint {path} was trained on other shards than "
                             f"--data {self.config.data} holds now (they were packed again); "
                             f"resume with the shards it was trained on, or start afresh")
        if recorded.get("partitions") != now["partitions"]:
            raise UsageError(f"checkpoint {path} read the shards cut for "
                             f"{recorded.get('partitions')} data-parallel workers, and this run "
                             f"has {now['partitions']}; resume with as many (shards are split "
                             f"among the workers, so their order depends on the count)")

    def start_loading(self, first: int, last: int) -> None:
        """Start the background loader over this worker's batches of steps ``first`` to
        ``last - 1`` (``--loader-workers``; none for data held in memory)."""
        workers = self.task.loader_workers
        plan = self.planned_batches(first, last) if workers else []
        if plan:
            self.loader = PlannedLoader(self.data.train, plan, workers=workers,
                                        device=self.env.device, context=child_context())

    def stop_loading(self) -> None:
        """Stop the background loader (its processes end)."""
        if self.loader is not None:
            self.loader.close()
            self.loader = None

    def setup_optimizer(self, params: Any, delay: int = 0, every_stage: bool = False) -> None:
        """Create the optimizer and learning-rate schedule over ``params`` (with Nesterov
        momentum for EAMSGD's workers), compensated for updates ``delay`` versions stale
        (:mod:`tandem.runtime.asynchrony`)."""
        sync = self.plan.sync
        nesterov = isinstance(sync, ElasticAveragingSync) and sync.nesterov
        self.optimizer = build_optimizer(self.config, params, nesterov=nesterov)
        self.compensation = compensation_for(self.config, delay, every_stage=every_stage)
        apply_compensation(self.optimizer, self.compensation)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.lr_multiplier)

    def lr_multiplier(self, step: int) -> float:
        """The scheduler's factor of the optimizer's learning rate at ``step``: warm-up and
        schedule, times the batch's (``--lr-scaling`` with a ``--batch-schedule``)."""
        return lr_factor(self.config, step) * batch_lr_factor(
            self.config, self.sampler.batch_size_at(step))

    @abc.abstractmethod
    def train_step(self, step: int) -> torch.Tensor:
        """One optimizer step; returns this worker's summed loss (zero if it computes none)."""

    @abc.abstractmethod
    def evaluate(self) -> dict[str, float]:
        """``test_accuracy`` and ``test_loss`` on the test split (same on every worker)."""

    @abc.abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state under its own names on rank 0 (None elsewhere); collective."""

    def end_training(self) -> None:
        """Called on every worker after the last step, before evaluation (may be collective)."""

    def save_checkpoint(self, step: int) -> None:
        """Save a checkpoint after ``step`` steps (collective); default: none."""

    def summary_extra(self) -> dict[str, Any]:
        """Strategy-specific fields of rank 0's summary; called on every rank (may be collective)."""
        return {}

    def run(self) -> dict[str, Any] | None:
        """Train from the first step to the last (or ``--stop-after``); rank 0 returns a summary."""
        config = self.config
        last_step = config.stop_after if config.stop_after is not None else config.steps
        self.logged = self.first_step
        self.reporter = Reporter(
            enabled=self.env.rank == 0, show_progress=config.progress, total_steps=config.steps,
            metrics_path=self.out / "metrics.jsonl" if self.out else None,
            first_step=self.first_step,
        )
        self.training_peak_rss_bytes = 0
        """This process's peak resident memory up to the last step's update, before its
        checkpoint, the evaluation and final.pt (a pipeline gathers the whole model's state on
        rank 0 for them; with ``--checkpoint-every`` the earlier checkpoints count)."""
        with self.reporter:
            self.start_loading(self.first_step, last_step)
            try:
                self.train_steps(self.first_step, last_step)
            finally:
                self.stop_loading()
            self.end_training()
            if not self.training_peak_rss_bytes:
                self.training_peak_rss_bytes = memory.peak_rss_bytes()
            evaluation = self.evaluate()
            self.reporter.record(step=last_step, **evaluation)
        finished = last_step == config.steps
        self._write_outputs(finished)
        extra = self.summary_extra()
        if self.env.rank != 0:
            return None
        return {**self._summary(last_step, evaluation, finished), **extra,
                "training_peak_rss_bytes": self.training_peak_rss_bytes,
                "peak_rss_bytes": memory.peak_rss_bytes(),
                "start_rss_bytes": memory.START_RSS_BYTES}

    def train_steps(self, first: int, last: int) -> None:
        """Optimizer steps ``first`` to ``last - 1``, with logging, evaluation and checkpoints."""
        config, reporter = self.config, self.reporter
        for step in range(first, last):
            maybe_fail(self.env.rank, step)
            start = time.perf_counter()
            self.loss_total += self.train_step(step)
            self.step_times.append(time.perf_counter() - start)
            reporter.advance()
            done = step + 1
            logging = done % config.log_every == 0 or done == last
            saving = done == last or bool(config.checkpoint_every
                                          and done % config.checkpoint_every == 0)
            self.check_divergence(step, thorough=logging or saving)
            if logging:
                self._log(done, final=done == last)
                if done % config.log_every == 0:  # not at a --stop-after, or a resume differs
                    self.grow_batch(done)
            if config.eval_every and done % config.eval_every == 0 and done < last:
                reporter.record(step=done, **self.evaluate())
            if done == last:
                self.training_peak_rss_bytes = memory.peak_rss_bytes()
            if saving:  # never a checkpoint (nor final.pt) of diverged parameters
                self.divergence.check_parameters(self.module.parameters(), step)
                self.save_checkpoint(done)

    def check_divergence(self, step: int, *, thorough: bool) -> None:
        """After step ``step``: stop the run if its loss, or an earlier one not yet read,
        diverged (read now if ``thorough``, else only where reading is free), or if fp16 has
        skipped too many steps in a row (:mod:`tandem.runtime.divergence`)."""
        if thorough:
            self.divergence.poll()
        else:
            self.divergence.poll_if_cheap()
        self.divergence.check_overflows(step, self.precision.skipped_in_a_row)

    def sent_bytes(self) -> float:
        """Bytes this worker has sent to synchronize training so far (activations, gradients,
        parameters; what the codec made of them with ``--compress``)."""
        return 0.0

    def trace(self, name: str, start: float, end: float, step: int, *, num_bytes: int = 0,
              version: int = -1) -> None:
        """Record one action of this worker in the timeline (first ``MAX_TRACED_STEPS`` steps)."""
        if step - self.first_step < MAX_TRACED_STEPS:
            self.events.append(Event(
                worker=self.env.rank, name=name, start_s=start - self.clock_start,
                end_s=end - self.clock_start, step=step, bytes=num_bytes, version=version,
            ))

    def _log(self, done: int, final: bool) -> None:
        """Report the mean loss of the steps since the last report, and the bytes sent per step
        (by all workers; by this worker where logging is not collective).

        The cross-worker sum runs in the background and is read at the next report (at once
        for the last step), so logging never makes the workers wait for one another — which
        would drain an asynchronous pipeline every ``--log-every`` steps.
        """
        steps = range(self.logged, done)
        fields = {"step": done, "lr": self.scheduler.get_last_lr()[0],
                  "batch_size": self.sampler.batch_size_at(done - 1),
                  "samples_per_s": self._samples_per_s(steps)}
        sent = self.sent_bytes()
        total = torch.stack([self.loss_total.to(torch.float64),
                             torch.tensor(sent - self.logged_bytes, dtype=torch.float64,
                                          device=self.loss_total.device)])
        fields["steps_logged"] = len(steps)
        if self.noise_window is not None:  # rides on the loss's allreduce
            total = torch.cat([total, self.noise_window.to(total.device)])
            self.noise_window = torch.zeros_like(self.noise_window)
        self.logged_bytes = sent
        if self.collective_logging:
            count = sum(len(self.sampler.global_indices(s)) for s in steps)
            count *= self.loss_terms_per_sample
            work = dist.all_reduce(total, async_op=True)
        else:
            count, work = max(self.local_predictions, 1), None
            self.local_predictions = 0
        self.loss_total.zero_()
        self.logged = done
        previous, self.pending_log = self.pending_log, (work, total, count, fields)
        if previous is not None:
            self._record_loss(previous)
        if final:
            self._record_loss(self.pending_log)
            self.pending_log = None

    def _record_loss(self, pending: tuple[Any, torch.Tensor, int, dict[str, Any]]) -> None:
        work, total, count, fields = pending
        if work is not None:
            work.wait()
        self.loss = float(total[0]) / count
        steps_logged = fields.pop("steps_logged")
        fields["sent_bytes_per_step"] = float(total[1]) / max(1, steps_logged)
        if len(total) > 2:
            sq_norm, trace, count = (float(x) for x in total[2:5])
            if count > 0:
                self.noise.update(sq_norm / count, trace / count, steps=steps_logged)
            fields["noise_scale"] = self.noise.estimate()
        self.reporter.record(loss=self.loss, **fields)

    def _samples_per_s(self, steps: range) -> float:
        """Samples per second of ``steps`` (the last ones timed), each at its scheduled batch."""
        window = self.step_times[-len(steps):] if len(steps) else []
        samples = sum(self.sampler.batch_size_at(step) for step in steps[-len(window):])
        return samples / max(sum(window), 1e-12) if window else 0.0

    def _write_outputs(self, finished: bool) -> None:
        """Rank 0 writes ``trace.json``, ``gantt.png``, ``config.json`` and ``final.pt``.

        Each worker timed its events from its own start; they are put on rank 0's clock by
        the time each worker reads right after a common barrier (good to the barrier's skew,
        also across machines).
        """
        dist.barrier()
        since_start = time.perf_counter() - self.clock_start
        gathered: list[tuple[float, list[Event]] | None] = [None] * self.env.world_size
        dist.all_gather_object(gathered, (since_start, self.events))
        state = self.full_state_dict() if finished and self.out else None
        if self.env.rank != 0 or self.out is None:
            return
        events = [
            dataclasses.replace(event, start_s=event.start_s + since_start - worker_since,
                                end_s=event.end_s + since_start - worker_since)
            for worker_since, worker_events in (part for part in gathered if part)
            for event in worker_events
        ]
        timeline = Timeline(events=events)
        timeline.write(self.out / "trace.json")
        shown = sorted({event.step for event in events if event.step >= 0})[-GANTT_STEPS:]
        steps = f", steps {shown[0]}-{shown[-1]}" if shown else ""
        plot_gantt(timeline, self.out / "gantt.png", steps=set(shown) or None,
                   title=f"{strategy_of(self.plan)}, {self.config.model.partition(':')[0]}, "
                         f"{self.env.world_size} workers{steps} (measured)")
        write_run_files(self.job, self.out)
        if state is not None:
            save_atomic(state, self.out / "final.pt")

    def _summary(self, last_step: int, evaluation: dict[str, float],
                 finished: bool) -> dict[str, Any]:
        timed = self.step_times[min(len(self.step_times) - 1, 2):]
        train_s = sum(self.step_times)
        return {
            **plan_summary(self.plan), "model": self.config.model, "data": self.config.data,
            "world_size": self.env.world_size, "backend": self.env.backend,
            "steps": last_step, "finished": finished,
            "global_batch_size": self.sampler.batch_size_at(last_step - 1),
            "batch_schedule": self.config.batch_schedule,
            **({"batch_schedule_grown": format_schedule(self.sampler.schedule)}
               if self.config.batch_schedule == AUTO else {}),
            "lr": scaled_lr(self.config),
            "final_loss": self.loss, **evaluation, **self.task.summary_fields(),
            "samples_per_s": sum(self.sampler.batch_size_at(step) for step in range(
                self.first_step, self.first_step + len(self.step_times))) / max(train_s, 1e-12),
            "step_time_s": statistics.median(timed) if timed else 0.0,
            "train_s": round(train_s, 4), "out": str(self.out) if self.out else None,
            "data_wait_fraction": round(
                self.data_wait_s / max(train_s - (self.first_data_wait_s or 0.0), 1e-12), 6),
            "data_first_wait_s": round(self.first_data_wait_s or 0.0, 4),
            "loader_workers": self.task.loader_workers, **self.noise.summary(),
            "async_compensation": (self.compensation.describe() if self.compensation.delay
                                   else None),
        }
