"""The names a trainer's subclasses read, set and call of its run and its components (the
batch feed, the loss log, memory, the noise scale), kept as the trainer's own."""

from __future__ import annotations

from typing import Any

import torch

from tandem.data import Batch, Data, GlobalBatchSampler, Samples
from tandem.plan import Plan
from tandem.runtime.batches import BatchFeed
from tandem.runtime.config import RunConfig
from tandem.runtime.job import Job
from tandem.runtime.loss_log import LossLog
from tandem.runtime.memory import PeakMemory
from tandem.runtime.noise_scale import NoiseScale


class ComponentViews:
    """Mixed into :class:`~tandem.runtime.base.BaseTrainer`: each name reads (or sets) the
    component that holds it, so that subclasses keep reading ``self.sampler``,
    ``self.noise_window``, ``self.loss`` ... ."""

    job: Job
    feed: BatchFeed
    loss_log: LossLog
    memory: PeakMemory
    noise: NoiseScale

    @property
    def plan(self) -> Plan:
        """The job's plan."""
        return self.job.plan

    @property
    def config(self) -> RunConfig:
        """The run's settings."""
        return self.job.run

    @property
    def data(self) -> Data:
        """The run's data."""
        return self.feed.data

    @property
    def train(self) -> Samples:
        """The training split on this worker's device."""
        return self.feed.train

    @property
    def test(self) -> Samples:
        """The test split on this worker's device."""
        return self.feed.test

    @property
    def sampler(self) -> GlobalBatchSampler:
        """The sampler of the run's global batches."""
        return self.feed.sampler

    @property
    def loss(self) -> float:
        """The mean loss last reported."""
        return self.loss_log.loss

    @property
    def loss_terms_per_sample(self) -> int:
        """Terms one sample adds to the summed loss ``train_step`` returns (see
        :attr:`LossLog.terms_per_sample`)."""
        return self.loss_log.terms_per_sample

    @loss_terms_per_sample.setter
    def loss_terms_per_sample(self, value: int) -> None:
        self.loss_log.terms_per_sample = value

    @property
    def collective_logging(self) -> bool:
        """False for strategies without global rounds: each worker logs its own loss."""
        return self.loss_log.collective

    @collective_logging.setter
    def collective_logging(self, value: bool) -> None:
        self.loss_log.collective = value

    @property
    def local_predictions(self) -> int:
        """Without collective logging: the loss terms summed since the last report."""
        return self.loss_log.local_predictions

    @local_predictions.setter
    def local_predictions(self, value: int) -> None:
        self.loss_log.local_predictions = value

    @property
    def noise_window(self) -> torch.Tensor | None:
        """Where a subclass that measures the noise scale sums its estimates until the next
        report (see :attr:`LossLog.noise_window`)."""
        return self.loss_log.noise_window

    @noise_window.setter
    def noise_window(self, value: torch.Tensor | None) -> None:
        self.loss_log.noise_window = value

    @property
    def training_peak_rss_bytes(self) -> int:
        """This process's peak resident memory up to the last step's update (see
        :class:`~tandem.runtime.memory.PeakMemory`)."""
        return self.memory.training_bytes

    def noise_scale(self) -> float | None:
        """The current estimate of the gradient noise scale B_simple = tr(Σ)/|G|² (the ratio of
        moving averages as of the last report whose sums arrived), or None where it is not
        measured or not yet positive (``self.noise.summary()`` says why)."""
        return self.noise.estimate()

    def take_batch(self, indices: torch.Tensor) -> Batch:
        """The training batch of ``indices`` on this worker's device (:meth:`BatchFeed.take`)."""
        return self.feed.take(indices)

    def data_position(self, step: int) -> dict[str, Any]:
        """What a checkpoint after ``step`` steps records of the data (:meth:`BatchFeed.position`)."""
        return self.feed.position(step)

    def restore_batch_schedule(self, recorded: dict[str, Any] | None) -> None:
        """``--batch-schedule auto``: continue with the batches the checkpointed run had grown
        to (:meth:`BatchFeed.restore_schedule`)."""
        self.feed.restore_schedule(recorded)

    def check_data_position(self, recorded: dict[str, Any] | None, path: str) -> None:
        """Refuse to resume streamed data whose order would differ from the checkpoint's."""
        self.feed.check_position(recorded, path)
