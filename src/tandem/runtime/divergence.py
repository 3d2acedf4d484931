"""Divergence: a worker whose loss (or gradient, or parameters) goes bad stops the run with one
line naming the step, the worker and the likely fix, and a record in ``metrics.jsonl`` (where
``--log-to`` keeps one).

The rules, for each worker's own loss (its share of the step's batch; a pipeline's last stage,
micro-batch by micro-batch):

- **non-finite** (NaN, ±inf): divergence at once. With ``--precision fp16`` a non-finite loss
  or gradient is an overflow that the loss scaler skips by design; there, divergence is
  :data:`OVERFLOWS_IN_A_ROW` skipped steps in a row (the scale has fallen ``2**30``-fold and the
  gradients still do not fit).
- **exploding**: a finite mean loss above :data:`EXPLODING_FACTOR` × max(L0, 1), where L0 is
  the first finite loss the worker computed in this run (a resumed run starts its own: the
  fix for a run that exploded is to resume its last good checkpoint with a lower ``--lr``, whose
  loss may already be far above the first run's L0). Healthy training never multiplies its first
  loss by a thousand (cross-entropy over 10 classes starts near 2.3: the limit is 2303); a run
  whose loss does is lost, however finite.
- **parameters**: before a checkpoint is written (and after the last step) every parameter
  this worker holds must be finite, so ``checkpoint.pt`` is never overwritten with diverged
  parameters: the last good checkpoint stays loadable.
- **gradients** (parameter servers, fp32/bf16): a pushed gradient that is not finite.

Steps count from 1, as ``metrics.jsonl`` does: "step 3" is the third optimizer step.

Cost: no step waits for the device. Each step's loss stays where it was computed, in a list;
:meth:`LossWatch.poll` reads the pending ones at once (one transfer) and names the first bad
one. Trainers poll at each ``--log-every`` step (when the loss is read anyway), before every
checkpoint and at the end, so a run may go on for up to ``--log-every`` steps after the bad one,
and the step named is still the first bad one. A worker that sends its own gradient (parameter
servers, gossip, averaging, tensor parallelism) also polls before each update on CPU, where
reading a tensor costs little, so that a diverged gradient does not leave it.

Usage::

    watch = LossWatch(config, where="worker 1 (rank 1)", rank=1, device=device)
    watch.observe(step, loss_sum, count)        # every step (or micro-batch), no sync
    watch.poll()                                # raises Diverged naming the first bad step
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from tandem import strict_json
from tandem.errors import Diverged
from tandem.output_files import AppendLog
from tandem.runtime.component import Component, StepEnd
from tandem.runtime.config import RunConfig, log_sinks

EXPLODING_FACTOR = 1000.0
"""A loss above this many times max(first loss, 1) has exploded."""
OVERFLOWS_IN_A_ROW = 30
"""fp16: this many skipped (overflowed) steps in a row are divergence, not a loss scale that is
still settling (it halves at each; healthy runs skip a few at the start, then rarely)."""
DEFAULT_LR: float = RunConfig().lr
"""The default ``--lr``, the suggestion for a learning rate far above it."""
MAX_PENDING = 256
"""Losses kept on the device before a poll is forced (bounds memory with a long --log-every)."""


def exploding_limit(first_loss: float) -> float:
    """The loss above which a run whose first finite loss was ``first_loss`` has exploded."""
    return EXPLODING_FACTOR * max(first_loss, 1.0)


class LossRule:
    """The non-finite and exploding rules over one worker's losses, step after step (pure)."""

    def __init__(self, *, skips_overflow: bool = False) -> None:
        self.skips_overflow = skips_overflow
        """fp16: a non-finite loss is an overflow the loss scaler skips, not divergence."""
        self.first: float | None = None
        """The first finite loss seen (L0)."""

    def judge(self, loss: float) -> str | None:
        """What is wrong with a step's mean loss (``"loss became nan"``, ``"loss exploded to
        ..."``), or None if nothing is."""
        if not math.isfinite(loss):
            return None if self.skips_overflow else f"loss became {loss}"
        if self.first is None:
            self.first = loss
            return None
        limit = exploding_limit(self.first)
        if loss > limit:
            return (f"loss exploded to {loss:.4g} (over {EXPLODING_FACTOR:g} x max(its first "
                    f"value {self.first:.4g}, 1))")
        return None


def likely_fix(config: RunConfig, *, step_index: int = 1, overflow: bool = False) -> str:
    """What the user should most likely change. A first step of a fresh run that is already
    non-finite had no update yet: the data, the model or the loss is to blame, not the
    learning rate."""
    if step_index == 0 and not overflow:
        return ("the model gives a non-finite loss before any update; check the inputs and "
                "targets for nan or inf, the model's initialization and a custom --loss")
    lr = config.lr
    suggestion = min(lr / 10, DEFAULT_LR)
    remedies = [flag for flag, missing in (("--warmup-steps", config.warmup_steps == 0),
                                           ("--clip-grad-norm", config.clip_grad_norm is None))
                if missing]
    text = (f"the learning rate {lr:g} is likely too large for this model; lower --lr "
            f"(e.g. {suggestion:g})")
    if remedies:
        text += f", add {' or '.join(remedies)}"
    if overflow:
        text += ", or train with --precision bf16"
    return text


def diverged(config: RunConfig, *, problem: str, step_index: int, where: str, rank: int,
             loss: float | None = None, overflow: bool = False, at: str = "at") -> Diverged:
    """The error that stops the run, after writing its record to ``OUT/metrics.jsonl`` (with
    ``--log-to jsonl``, the default).

    ``step_index`` counts from 0 (the message says ``step_index + 1``); ``at`` is how the step
    relates to the problem (``"at"``, ``"after"`` or ``"from"``).
    """
    step = step_index + 1
    message = (f"{problem} {at} step {step} on {where}: "
               f"{likely_fix(config, step_index=step_index, overflow=overflow)}")
    if config.out is not None and "jsonl" in log_sinks(config.log_to):
        record = {"step": step, "diverged": problem, "rank": rank, "worker": where,
                  "loss": loss, "message": message}
        log = AppendLog(Path(config.out) / "metrics.jsonl")
        try:
            log.write_line(strict_json.dumps(record))
        finally:
            log.close()
    return Diverged(message)


def order(message: str) -> tuple[int, int]:
    """``(step, rank)`` a divergence message names, to pick the first of several workers'."""
    step = re.search(r"\bstep (\d+)", message)
    rank = re.search(r"\(rank (\d+)\)", message)
    return (int(step.group(1)) if step else 1 << 62, int(rank.group(1)) if rank else 1 << 62)


class LossWatch:
    """One worker's losses, kept on its device until polled, judged by :class:`LossRule`."""

    def __init__(self, config: RunConfig, *, where: str, rank: int,
                 device: torch.device) -> None:
        self.config = config
        self.where = where
        """The worker, as the message names it: ``"worker 1 (rank 1)"``."""
        self.rank = rank
        self.rule = LossRule(skips_overflow=config.precision == "fp16")
        self.every_step = device.type == "cpu"
        """Poll after every step (reading a CPU tensor does not wait for anything)."""
        self.pending: list[tuple[int, torch.Tensor, int]] = []
        """(step index, summed loss, terms summed) not yet judged."""
        self.overflow_run_start: int | None = None
        """fp16: the step the current run of skipped steps started at."""

    def observe(self, step_index: int, loss_sum: torch.Tensor, count: int) -> None:
        """Keep step ``step_index``'s loss, summed over ``count`` terms (no synchronization)."""
        if count > 0:
            self.pending.append((step_index, loss_sum.detach(), count))
        if len(self.pending) >= MAX_PENDING:
            self.poll()

    def poll(self) -> None:
        """Judge the pending losses in order; raise :class:`~tandem.errors.Diverged` naming the
        first bad one."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        if len(pending) == 1 or pending[0][1].device.type == "cpu":  # no transfer: read each
            sums = [loss.item() for _, loss, _ in pending]  # (a stack costs 20x more here)
        else:  # one transfer
            sums = torch.stack([loss.to(torch.float64).reshape(())
                                for _, loss, _ in pending]).cpu().tolist()
        for (step_index, _, count), total in zip(pending, sums):
            mean = total / count
            problem = self.rule.judge(mean)
            if problem is not None:
                raise diverged(self.config, problem=problem, step_index=step_index,
                               where=self.where, rank=self.rank, loss=mean)

    def poll_if_cheap(self) -> None:
        """:meth:`poll` where it costs nothing (on CPU)."""
        if self.every_step:
            self.poll()

    def check_overflows(self, step_index: int, in_a_row: int) -> None:
        """fp16: stop after :data:`OVERFLOWS_IN_A_ROW` skipped steps in a row, the last being
        ``step_index``."""
        if in_a_row <= 1:  # where a run starts (a worker of an asynchronous parameter
            self.overflow_run_start = step_index if in_a_row else None  # server skips steps)
        if in_a_row < OVERFLOWS_IN_A_ROW:
            return
        first = self.overflow_run_start if self.overflow_run_start is not None else step_index
        raise diverged(self.config, step_index=first, where=self.where, rank=self.rank,
                       overflow=True,
                       problem=f"the fp16 gradients overflowed in each of {in_a_row} steps in a "
                               f"row (all skipped, the loss scale shrinking each time)",
                       at="from")

    def check(self, step_index: int, *, thorough: bool, overflows_in_a_row: int) -> None:
        """After step ``step_index``: stop the run if its loss, or an earlier one not yet read,
        diverged (read if ``thorough``: at log and checkpoint steps; a strategy whose worker
        sends its own gradient polls before it does, :meth:`poll_if_cheap`), or if fp16 has
        skipped ``overflows_in_a_row`` steps, too many (:meth:`check_overflows`)."""
        if thorough:
            self.poll()
        self.check_overflows(step_index, overflows_in_a_row)

    def check_parameters(self, parameters: Iterable[torch.Tensor], step_index: int) -> None:
        """Raise :class:`~tandem.errors.Diverged` if any of ``parameters`` is not finite after
        step ``step_index`` (before a checkpoint of them is written)."""
        self.poll()  # a bad loss, if any, is the earlier and clearer cause
        bad = first_non_finite(parameters)
        if bad is not None:
            raise diverged(self.config, problem=f"the parameters became {bad}",
                           step_index=step_index, where=self.where, rank=self.rank, at="after")


def first_non_finite(tensors: Iterable[torch.Tensor]) -> str | None:
    """``"nan"`` or ``"inf"`` if any of ``tensors`` holds one, else None (one transfer)."""
    # a DTensor (tensor parallelism) is checked by its local shard, without importing DTensor
    # (0.7 s) into every worker
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    flags = [torch.stack([t.detach().isnan().any(), t.detach().isinf().any()])
             for t in local if t.is_floating_point()]
    if not flags:
        return None
    nan, inf = torch.stack(flags).any(dim=0).tolist()
    return "nan" if nan else "inf" if inf else None


class DivergenceCheck(Component):
    """The loss watch as a component: after every step, :meth:`LossWatch.check` (thorough at
    log and checkpoint steps, where the loss is read anyway, or at every step where
    ``thorough``), with the fp16 overflows that ``overflows_in_a_row`` counts. It has no state
    to checkpoint: a resumed run judges by its own first loss (see the module's rules)."""

    def __init__(self, watch: LossWatch, overflows_in_a_row: Callable[[], int], *,
                 thorough: bool = False) -> None:
        self.watch, self.overflows_in_a_row = watch, overflows_in_a_row
        self.thorough = thorough

    def after_step(self, end: StepEnd) -> None:
        self.watch.check(end.step, thorough=self.thorough or end.logging or end.saving,
                         overflows_in_a_row=self.overflows_in_a_row())

