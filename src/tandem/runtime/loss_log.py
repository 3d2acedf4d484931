"""A worker's metrics line at each ``--log-every`` step: the mean loss and the bytes sent per step
since the last line (summed across workers in the background), the rate, the worker's memory
and the share of its time it waited for data, and the gradient noise scale whose sums ride on
the same allreduce."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tandem.data import GlobalBatchSampler
from tandem.runtime.component import Component, StepEnd
from tandem.runtime.memory import rss_bytes
from tandem.runtime.noise_scale import NoiseScale

Pending = tuple[Any, torch.Tensor, int, dict[str, Any]]
"""A report whose cross-worker sum is under way: (its work, the summed tensor, the loss terms
it counts, the metrics fields so far)."""


class LossLog(Component):
    """The losses a worker's steps return, reported at log steps.

    The cross-worker sum runs in the background and is read at the next report (at once for
    the last step), so logging never makes the workers wait for one another — which would
    drain an asynchronous pipeline every ``--log-every`` steps. The hooks are read at each
    report, ``record`` writes the line; ``step_times`` are the steps' durations (the last ones
    time the rate and the data wait).
    """

    def __init__(self, sampler: GlobalBatchSampler, device: torch.device, *,
                 terms_per_sample: int, first_step: int, step_times: list[float],
                 hooks: LogHooks) -> None:
        self.sampler = sampler
        self.device = device
        self.hooks = hooks
        self.step_times = step_times
        self.total = torch.zeros((), device=device)
        """The summed loss of the steps since the last report."""
        self.loss = float("nan")
        """The mean loss of the last report read."""
        self.terms_per_sample = terms_per_sample
        """Terms one sample adds to the summed loss a step returns: 1 where the loss is a
        per-sample mean weighted by samples (:mod:`tandem.loss`), else its predictions (its
        positions, for a language model); the worker sets it."""
        self.collective = True
        """False for strategies without global rounds: each worker logs its own loss."""
        self.local_predictions = 0
        """Without collective logging: the loss terms this worker summed since the report."""
        self.noise_window: torch.Tensor | None = None
        """Where a worker that measures the noise scale sums its estimates until the next
        report: ``[sum of |G|² estimates, sum of tr(Σ) estimates, their count]`` (float64)."""
        self.logged = first_step
        self.logged_bytes = 0.0
        self.logged_wait_s = 0.0
        self.pending: Pending | None = None

    def add(self, loss_sum: torch.Tensor) -> None:
        """Count a step's summed loss (no synchronization)."""
        self.total += loss_sum

    def after_step(self, end: StepEnd) -> None:
        if end.logging:
            self.report(end.done, final=end.final)

    def report(self, done: int, final: bool) -> None:
        """Report the steps since the last report, up to ``done``: start their sum across
        workers (read at the next report; now if ``final``)."""
        steps = range(self.logged, done)
        fields = {"step": done, "lr": self.hooks.lr(),
                  "batch_size": self.sampler.batch_size_at(done - 1),
                  "samples_per_s": self._samples_per_s(steps), **self._resources(steps)}
        sent = self.hooks.sent_bytes()
        total = torch.stack([self.total.to(torch.float64),
                             torch.tensor(sent - self.logged_bytes, dtype=torch.float64,
                                          device=self.total.device)])
        fields["steps_logged"] = len(steps)
        if self.noise_window is not None:  # rides on the loss's allreduce
            total = torch.cat([total, self.noise_window.to(total.device)])
            self.noise_window = torch.zeros_like(self.noise_window)
        self.logged_bytes = sent
        if self.collective:
            count = sum(self.sampler.batch_samples(s) for s in steps)
            count *= self.terms_per_sample
            work = dist.all_reduce(total, async_op=True)
        else:
            count, work = max(self.local_predictions, 1), None
            self.local_predictions = 0
        self.total.zero_()
        self.logged = done
        previous, self.pending = self.pending, (work, total, count, fields)
        if previous is not None:
            self._record(previous)
        if final:
            self._record(self.pending)
            self.pending = None

    def _record(self, pending: Pending) -> None:
        work, total, count, fields = pending
        if work is not None:
            work.wait()
        self.loss = float(total[0]) / count
        steps_logged = fields.pop("steps_logged")
        fields["sent_bytes_per_step"] = float(total[1]) / max(1, steps_logged)
        if len(total) > 2:
            noise = self.hooks.noise()
            sq_norm, trace, measured = (float(x) for x in total[2:5])
            if measured > 0:
                noise.update(sq_norm / measured, trace / measured, steps=steps_logged)
            fields["noise_scale"] = noise.estimate()
        self.hooks.record(loss=self.loss, **fields)

    def _resources(self, steps: range) -> dict[str, Any]:
        """This worker's memory now (resident; on CUDA also the most its tensors have held) and
        the share of ``steps``' time (those timed) it waited for batches."""
        waited = self.hooks.data_wait_s()
        window = self.step_times[-len(steps):] if len(steps) else []
        fields: dict[str, Any] = {
            "rss_bytes": rss_bytes(),
            "data_wait_fraction": round((waited - self.logged_wait_s) / max(sum(window), 1e-12), 6)}
        self.logged_wait_s = waited
        if self.device.type == "cuda":
            fields["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return fields

    def _samples_per_s(self, steps: range) -> float:
        """Samples per second of ``steps`` (the last ones timed), each at its scheduled batch."""
        window = self.step_times[-len(steps):] if len(steps) else []
        samples = sum(self.sampler.batch_size_at(step) for step in steps[-len(window):])
        return samples / max(sum(window), 1e-12) if window else 0.0


class LogHooks:
    """What a :class:`LossLog` reads from its worker at each report: the learning rate, the
    bytes sent so far, the seconds its steps waited for data so far, the noise scale's
    averages, and where the line goes."""

    def __init__(self, *, lr: Callable[[], float], sent_bytes: Callable[[], float],
                 data_wait_s: Callable[[], float], noise: Callable[[], NoiseScale],
                 record: Callable[..., None]) -> None:
        self.lr, self.sent_bytes, self.data_wait_s = lr, sent_bytes, data_wait_s
        self.noise, self.record = noise, record
