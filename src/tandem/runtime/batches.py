"""A worker's batches: the batch schedule (fixed, or grown with ``--batch-schedule auto`` by the
:class:`BatchGrowth` component), the background loader that reads them ahead, and the data's
position a checkpoint records."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tandem.data import Batch, Data, GlobalBatchSampler, Samples
from tandem.data.loader import PlannedLoader
from tandem.data.shard_sampler import ShardBatchSampler
from tandem.data.shards import ShardSamples
from tandem.errors import UsageError
from tandem.runtime.component import Component, StepEnd
from tandem.runtime.config import RunConfig
from tandem.runtime.task import Task
from tandem.runtime.zygote import child_context
from tandem.spec.batch_schedule import auto_next_batch, format_schedule, parse_batch_schedule

logger = logging.getLogger(__name__)


class BatchFeed:
    """The run's data on this worker's ``device`` and the sampler of its global batches, cut
    for ``partitions`` data-parallel workers; the batches it takes, read ahead by a loader
    where one runs, and the time its steps waited for them. Not a component: the steps call
    it (a grown schedule's state is :class:`BatchGrowth`'s)."""

    def __init__(self, task: Task, config: RunConfig, device: torch.device,
                 partitions: int) -> None:
        self.config = config
        self.data: Data = task.data
        self.train: Samples = self.data.train.to(device)
        self.test: Samples = self.data.test.to(device)
        self.device = device
        self.partitions = partitions
        self.loader_workers = task.loader_workers
        self.options = config.loader
        """The run's ``DataLoader`` options (:class:`tandem.spec.loader.LoaderOptions`)."""
        order = task.order
        self.sampler: GlobalBatchSampler = self.data.train.batch_sampler(
            global_batch_size=config.batch_size, seed=config.seed, partitions=partitions,
            schedule=config.parsed_batch_schedule(), order=order,
            num_samples=None if order is None else order.length,
            shuffle=self.options.shuffle, drop_last=self.options.drop_last)
        self.loader: PlannedLoader | None = None
        self.wait_s = 0.0
        """Seconds the steps waited for their batches (read, or handed over), after the
        first batch."""
        self.first_wait_s: float | None = None
        """Seconds the first batch took (with a loader: its processes' start)."""

    def take(self, indices: torch.Tensor) -> Batch:
        """The training batch of ``indices`` on the device: handed over by the loader when it
        read it ahead, else read now; the wait counts in :attr:`wait_s`."""
        start = time.perf_counter()
        batch = self.loader.take(indices) if self.loader is not None else None
        if batch is None:
            batch = self.train.take(indices)
        waited = time.perf_counter() - start
        if self.first_wait_s is None:
            self.first_wait_s = waited
        else:
            self.wait_s += waited
        return batch

    def start_loading(self, planned: Callable[[], list[torch.Tensor]]) -> None:
        """Start the background loader over the batches ``planned()`` lists
        (``--loader-workers``; none for data held in memory)."""
        plan = planned() if self.loader_workers else []
        if plan:
            self.loader = PlannedLoader(self.data.train, plan, workers=self.loader_workers,
                                        device=self.device, context=child_context(),
                                        prefetch=self.options.prefetch,
                                        pin_memory=self.options.pin_memory)

    def stop_loading(self) -> None:
        """Stop the background loader (its processes end)."""
        if self.loader is not None:
            self.loader.close()
            self.loader = None

    def position(self, step: int) -> dict[str, Any]:
        """What a checkpoint after ``step`` steps records of the data: where the next step
        reads (epoch, samples into it), the ranks the order was cut for, and the shards (with
        the parts of an epoch that a resize re-dealt, ``cuts``)."""
        train, sampler = self.data.train, self.sampler
        where = sampler.position(step)
        cuts = (sampler.epoch_cuts(where["epoch"]) if isinstance(sampler, ShardBatchSampler)
                else None)
        return {**where, "partitions": self.partitions,
                "shards": train.index.fingerprint if isinstance(train, ShardSamples) else None,
                "cuts": cuts, "batch_size": sampler.batch_size_at(step),
                "batch_schedule": format_schedule(sampler.schedule)}

    def check_position(self, recorded: dict[str, Any] | None, path: str) -> None:
        """Refuse to resume streamed data whose order would differ from the checkpoint's; on
        another number of data-parallel ranks, re-deal the shards of the epoch it stopped in
        (:meth:`ShardBatchSampler.resize`)."""
        if recorded is None or not self.data.train.streams:
            return
        now = self.position(0)
        if recorded.get("shards") != now["shards"]:
            raise UsageError(f"checkpoint {path} was trained on other shards than "
                             f"--data {self.config.data} holds now (they were packed again); "
                             f"resume with the shards it was trained on, or start afresh")
        before = recorded.get("partitions")
        cuts = recorded.get("cuts") or [[0, before]]
        if before == now["partitions"] and len(cuts) == 1:
            return
        if not isinstance(self.sampler, ShardBatchSampler) or not isinstance(before, int):
            raise UsageError(f"checkpoint {path} read the data cut for {before} data-parallel "
                             f"workers, and this run has {now['partitions']}; resume with as "
                             f"many (the stream is split among the workers)")
        self.sampler.resize(int(recorded["epoch"]), int(recorded["samples_into_epoch"]), cuts)
        if before != now["partitions"] and (not dist.is_initialized() or dist.get_rank() == 0):
            logger.info(f"the checkpoint's shards were read by {before} data-parallel workers "
                        f"and this run has {now['partitions']}: the rest of epoch "
                        f"{recorded['epoch']} is dealt among them")

    def wait_summary(self, train_s: float) -> dict[str, Any]:
        """The summary's data fields, for a run that trained ``train_s`` seconds."""
        first = self.first_wait_s or 0.0
        return {"data_wait_fraction": round(self.wait_s / max(train_s - first, 1e-12), 6),
                "data_first_wait_s": round(first, 4), "loader_workers": self.loader_workers}


class BatchGrowth(Component):
    """``--batch-schedule auto``: at each ``--log-every`` step, the batch of the steps from there
    on, by :func:`tandem.spec.batch_schedule.auto_next_batch` from the gradient noise scale
    (``noise_scale()``; every worker decides the same: the largest decision wins). A grown
    batch sets the step's learning rate again (``scheduler()``: the run's scheduler). Its state
    is the schedule grown so far, which a resumed run continues with."""

    name = "batch_schedule"

    def __init__(self, feed: BatchFeed, noise_scale: Callable[[], float | None],
                 scheduler: Callable[[], Any]) -> None:
        self.feed, self.noise_scale, self.scheduler = feed, noise_scale, scheduler

    def after_step(self, end: StepEnd) -> None:
        # at a --log-every step only: not at a --stop-after, or a resumed run would differ
        if end.logging and end.done % self.feed.config.log_every == 0:
            self.grow(end.done)

    def grow(self, done: int) -> None:
        """After ``done`` steps: extend the schedule if the batch should grow (collective)."""
        config, sampler = self.feed.config, self.feed.sampler
        if done >= config.steps:
            return
        current = sampler.batch_size_at(done)
        chosen = auto_next_batch(current, self.noise_scale(), workers=self.feed.partitions,
                                 max_batch=len(self.feed.data.train))
        agreed = torch.tensor(float(chosen), dtype=torch.float64, device=self.feed.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        if int(agreed) > current:
            sampler.extend(done, int(agreed))
            self._set_rate_again()

    def _set_rate_again(self) -> None:
        """The scheduler set the current step's rate for the batch before it grew: set it again
        (its factor of the batch, ``--lr-scaling``)."""
        scheduler = self.scheduler()
        scheduler.last_epoch -= 1
        scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        """The schedule grown so far (``--batch-schedule``'s text)."""
        return {"schedule": format_schedule(self.feed.sampler.schedule)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue with the batches the checkpointed run had grown to."""
        config, sampler = self.feed.config, self.feed.sampler
        grown = parse_batch_schedule(state["schedule"], steps=config.steps)[1:]
        for step, batch in grown:
            sampler.extend(step, batch)
        if grown:
            self._set_rate_again()
