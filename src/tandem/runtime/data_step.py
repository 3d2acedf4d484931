"""The handlers of a data-parallel worker's forwards, backwards and overlapped allreduce, which
the schedule interpreter runs from the plan's one-stage schedule, a sync strategy's own update,
and the worker's noise-scale samples.

Worker ``r`` of ``W`` runs micro-batches ``m = r + W * k`` of each global batch (the generator's
round-robin); ``k`` indexes this worker's share, cut into ``--accumulate`` micro-batches. Every
backward but the last accumulates without communication (DDP's ``no_sync``); the last one's
backward reduces the gradients in DDP's buckets, so the schedule's ``AR`` records that backward's
span rather than running anything.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tandem.data import Batch
from tandem.runtime.executor import Span
from tandem.runtime.noise_scale import NoiseScale, two_batch_estimates
from tandem.runtime.precision import Precision, StagePrecision
from tandem.schedule import Action
from tandem.spec.codec import CodecSpec
from tandem.structures import call_model
from tandem.sync import SyncStrategy
from tandem.sync.allreduce import AllReduce

if TYPE_CHECKING:
    from tandem.runtime.batches import BatchFeed


class DataParallelStep:
    """One worker's F, B and AR handlers, and what they share within a step."""

    def __init__(self, module: nn.Module, precision: Precision | StagePrecision,
                 loss: Callable[[Any, Any], torch.Tensor], beat: Any, *, data_world: int,
                 strategy: SyncStrategy | None = None, slowdown: float = 1.0) -> None:
        self.module, self.strategy, self.precision = module, strategy, precision
        self.loss, self.beat, self.data_world = loss, beat, data_world
        self.slowdown = slowdown
        """``--straggler``: this worker's compute takes this many times as long (1: as is)."""
        self.after_backwards: Callable[[], None] | None = None
        """Called after the step's last backward (the loss watch reads the step's loss)."""
        self.micros: list[Batch] = []
        self.scale = 1.0
        """The factor of each micro-batch's summed loss: workers / samples in the global batch."""
        self.divisor: float | None = None
        """Or its divisor: samples in the global batch (tensor parallelism's workers share each
        sample)."""
        self.loss_total = torch.zeros(())
        self.pending: torch.Tensor | None = None
        """The mean loss of the forward whose backward comes next..."""
        self.pending_size = 0
        """...over this many samples."""
        self.accumulating: contextlib.ExitStack | None = None
        """Open from a non-last micro-batch's forward to the end of its backward."""
        self.backward_span = (0.0, 0.0)
        """Start and end of the last backward (the overlapped allreduce's span)."""
        self.measuring = False
        """This step's noise scale is measured outside a hook: its last backward reads the local
        gradients, and ``AR`` the averaged ones (:meth:`AllReduce.finish_measuring`)."""
        self.forward_start = 0.0
        self.batch = (0, 0, 0)
        """The step's global batch (an asynchronous ps worker's may be another step's), this
        worker's samples of it and all its samples."""

    def begin(self, micros: list[Batch], step: int, device: torch.device, *, scale: float = 1.0,
              divisor: float | None = None) -> None:
        """Start step ``step`` on this worker's ``micros``, whose summed losses are multiplied
        by ``scale`` or divided by ``divisor`` before their backward."""
        self.micros, self.scale, self.divisor = micros, scale, divisor
        self.loss_total = torch.zeros((), device=device)
        self.beat.step = step

    def forward(self, action: Action, span: Span) -> None:
        """Forward and loss (summed over the micro-batch's samples) of micro-batch ``m``."""
        index = action.microbatch // self.data_world  # type: ignore[operator]
        micro = self.micros[index]
        self.beat.phase = "forward"
        self.forward_start = span.start
        if index < len(self.micros) - 1 and self.strategy is not None:
            self.accumulating = contextlib.ExitStack()
            self.accumulating.enter_context(self.strategy.accumulating(self.module))
        elif self.measuring and isinstance(self.strategy, AllReduce):
            self.strategy.arm(self.module)
        with self.precision.autocast():
            output = call_model(self.module, micro.inputs)
            self.pending = self.loss(output, micro.targets)
        self.pending_size = micro.size

    def backward(self, action: Action, span: Span) -> None:
        """Backward of the micro-batch just forwarded (its gradients reduced if it is the last)."""
        loss, self.pending = self.pending, None
        assert loss is not None, "a backward without its forward"
        self.beat.phase = "backward"
        size = self.pending_size  # the mean loss times the samples, scaled: one multiplication
        factor = size * self.scale if self.divisor is None else size / self.divisor
        self.precision.backward(loss if factor == 1.0 else loss * factor)  # 1: DDP's own mean
        if self.accumulating is not None:
            self.accumulating.close()
            self.accumulating = None
        self.loss_total.add_(loss.detach(), alpha=size)
        span.end = time.perf_counter()
        self.backward_span = (span.start, span.end)
        if self.slowdown > 1.0:
            time.sleep((self.slowdown - 1.0) * (span.end - self.forward_start))
        index = action.microbatch // self.data_world  # type: ignore[operator]
        if index == len(self.micros) - 1 and self.after_backwards is not None:
            self.after_backwards()

    def allreduce(self, action: Action, span: Span) -> None:
        """DDP reduced the gradients during the last backward: its span is the allreduce's; on
        a step measured outside DDP's reduction, reduce them now."""
        span.start, span.end = self.backward_span
        if self.measuring and isinstance(self.strategy, AllReduce):
            self.strategy.finish_measuring(self.module)


def apply_update(strategy: SyncStrategy, module: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, precision: Precision,
                 step: int) -> bool:
    """Unscale and clip the gradients of ``step``, then let ``strategy`` synchronize them and
    apply the update; returns whether the strategy says stop (a parameter server's)."""
    finite = precision.unscale_and_clip(optimizer, module.parameters())
    if not finite and not strategy.local_optimizer:
        # an overflow anywhere skips the whole step: every server sees non-finite numbers
        for p in module.parameters():
            if p.grad is not None:
                p.grad.fill_(float("nan"))
    stopped = strategy.update(module, optimizer, step)
    if not strategy.local_optimizer:  # a server applies the pushed gradients
        precision.finish_step()
    if strategy.local_optimizer:
        scheduler.step()
    return stopped


class NoiseSamples:
    """Each step's squared norms of this worker's gradient and of the averaged one, kept on the
    device and turned into estimates of ``|G|²`` and ``tr(Σ)`` all at once when the next report
    reads them (per-step work: two appends)."""

    def __init__(self, *, data_world: int, population: int | None, log_every: int,
                 last_step: int, every: int) -> None:
        self.data_world = data_world
        self.log_every, self.last_step = log_every, last_step
        """The steps whose report reads the estimates: every ``log_every``-th, and the last."""
        self.every = every
        """The steps measured: every ``every``-th, and the last."""
        self.population = population
        """Samples the batches are drawn from without replacement (None: streamed shards)."""
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.scales: list[float] = []
        """The loss scale of each pending step (1 without fp16's scaler)."""
        self.counts: tuple[int, int] | None = None
        """``(local, global)`` samples of the pending steps (a change flushes them first)."""
        self.window: torch.Tensor | None = None
        """Estimates of flushed steps not yet read: ``[sum |G|², sum tr(Σ), count]``."""

    def wanted(self, step: int) -> bool:
        """Whether step ``step``'s norms are measured."""
        done = step + 1
        return done % self.every == 0 or done == self.last_step

    def measure(self, step: int, norms: tuple[torch.Tensor, torch.Tensor] | None,
                local_count: int, global_count: int, loss_scale: float) -> torch.Tensor | None:
        """Keep step ``step``'s norms (None, or a worker without samples: none); at a log step,
        the sums of every kept step's estimates (see :meth:`take`), else None."""
        if norms is not None and 0 < local_count < global_count:
            self.add(norms, local_count, global_count, loss_scale)
        done = step + 1
        return self.take() if done % self.log_every == 0 or done == self.last_step else None

    def add(self, norms: tuple[torch.Tensor, torch.Tensor], local_count: int, global_count: int,
            loss_scale: float) -> None:
        """Step's norms ``(local, averaged)`` read by the hook before the loss scale is removed,
        from this worker's ``local_count`` samples and all ``global_count``."""
        if self.counts != (local_count, global_count):
            self.flush()
            self.counts = (local_count, global_count)
        self.pending.append(norms)
        self.scales.append(loss_scale)

    def flush(self) -> None:
        """Turn the pending norms into estimates, summed into :attr:`window`."""
        if not self.pending or self.counts is None:
            return
        local_count, global_count = self.counts
        local_sq, mean_sq = (torch.stack([entry[i] for entry in self.pending]) for i in (0, 1))
        scale = torch.tensor(self.scales, dtype=local_sq.dtype, device=local_sq.device)
        self.pending, self.scales = [], []
        # each worker's loss is scaled by data_world / global_count (see Trainer.train_step), so
        # its gradient is its samples' mean times data_world * local_count / global_count
        share = self.data_world * local_count / global_count
        sq_norm, trace = two_batch_estimates(local_sq / (share * scale) ** 2, mean_sq / scale**2,
                                             local_count, global_count,
                                             population=self.population)
        finite = torch.isfinite(sq_norm) & torch.isfinite(trace)
        zero = torch.zeros_like(sq_norm)
        sums = torch.stack([torch.where(finite, sq_norm, zero).sum(),
                            torch.where(finite, trace, zero).sum(), finite.double().sum()])
        self.window = sums if self.window is None else self.window + sums

    def take(self) -> torch.Tensor | None:
        """The sums of every step's estimates since the last call (None: no step measured)."""
        self.flush()
        window, self.window = self.window, None
        return window


def noise_measure(strategy: SyncStrategy, feed: BatchFeed, *, data_world: int,
                  compress: CodecSpec | None, log_every: int, last_step: int,
                  every: int) -> tuple[NoiseScale | None, NoiseSamples | None]:
    """The gradient noise scale where ``strategy`` is DDP's allreduce among two or more workers,
    and the samples it is estimated from; with one worker, or a strategy that says why it has
    none (:attr:`SyncStrategy.noise_scale_note`), why not (and no samples); with another
    strategy, neither (the trainer's own reason: not data parallelism)."""
    if strategy.noise_scale_note is not None:
        return NoiseScale.unavailable(strategy.noise_scale_note), None
    if not isinstance(strategy, AllReduce):
        return None, None
    if data_world < 2:
        strategy.bucket_norms.enabled = False  # the hook measures nothing
        return NoiseScale.unavailable(
            "one worker: the gradient noise scale needs gradients of two batch sizes (each "
            "worker's own and their mean); run with --nproc 2 or more"), None
    streams = feed.data.train.streams
    noise = NoiseScale(noise_notes(compress, streams=streams))
    # batches are drawn without replacement from the shuffled training set
    return noise, NoiseSamples(data_world=data_world,
                               population=None if streams else len(feed.train),
                               log_every=log_every, last_step=last_step, every=every)


def noise_notes(compress: CodecSpec | None, *, streams: bool) -> str | None:
    """What biases the noise-scale estimate of this run, in one line (None: nothing)."""
    notes = [] if compress is None else [
        f"with --compress {compress.text} the averaged gradient is the codec's decoded mean, "
        f"not the exact one: the compression error adds to its squared norm, so |G|² is "
        f"overestimated and tr(Σ) underestimated, and noise_scale is biased low (error "
        f"feedback moves it further)"]
    if streams:
        notes.append("streamed shards are read in shard order, not drawn at random, so the "
                     "estimate also counts the differences between the workers' shards")
    return "; ".join(notes) or None
