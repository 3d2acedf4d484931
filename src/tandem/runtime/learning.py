"""Whether a run learned: the mean losses of its metrics lines judged ``ok``, ``stalled`` or
``diverged`` (:func:`judge`), the likely cause in one line, and the critical batch from the
gradient noise scale it measured.

The divergence check (:mod:`tandem.runtime.divergence`) stops a run whose loss is not finite or
has grown a thousandfold; a loss that ends above where it started, or stops falling, it lets
through. Rank 0 (server 0 of a parameter-server job) writes every metrics line
(:class:`~tandem.runtime.reporting.Reporter`); :class:`Learning` keeps their mean losses and
judges them for the summary (``learning``, ``learning_note``, ``critical_batch``), and the
process that launched the run warns from the summary in one line (:func:`warn_learning`).

The rule, over the ``n`` finite mean losses of the metrics lines (each the mean over
``--log-every`` steps), in windows of ``w = max(1, n // 4)`` lines compared by their medians,
so that one noisy line decides nothing:

- fewer than :data:`MIN_LINES` lines: not judged (``learning`` null, and no warning);
- ``diverged``: the last window's median is above the lowest window median (or the first line,
  if that is lower) by more than the larger of :data:`GIVEN_BACK` (half) of what the run had
  learned (first line minus lowest) and :data:`RISE` (10%) of the first line: the run gave
  back over half of its progress, or ended 10% above where it started;
- ``stalled``: the last window's median is below that of the window ending at the middle of
  the run by at most :data:`STALL` (1%) of the latter: the second half learned nothing; or it
  is below the first line by at most :data:`LEARNED` (10%) of it: the run as a whole learned
  next to nothing (a run stuck near chance whose loss still creeps down);
- ``ok`` otherwise.

Usage::

    judge([2.30, 2.20, 3.44, 2.33, 15.8])     # "diverged"
    critical_batch([267.0, 55.5, 45.9, 71.9])  # 64: the median measured noise scale
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tandem.errors import LearningWarning
from tandem.runtime.component import Component
from tandem.runtime.config import RunConfig
from tandem.runtime.job import stale_updates
from tandem.strategy import strategy_of

if TYPE_CHECKING:
    from tandem.plan import Plan
    from tandem.runtime.reporting import Reporter

MIN_LINES = 4
"""Metrics lines a run needs to be judged (fewer: ``learning`` is null)."""
GIVEN_BACK = 0.5
"""A run that ends above its lowest loss by more than this share of what it had learned (its
first loss minus its lowest) has diverged."""
RISE = 0.1
"""... or by more than this share of its first loss (a run that learned nothing)."""
STALL = 0.01
"""A second half that lowers the loss by at most this share of the loss has stalled."""
LEARNED = 0.1
"""... and so has a run that ends at most this share of its first loss below it."""
MAX_LINES = 4096
"""Lines :class:`Learning` keeps; beyond, neighbouring lines are averaged in pairs (its state
goes into every checkpoint)."""


def judge(losses: Sequence[float]) -> str | None:
    """``ok``, ``stalled`` or ``diverged`` for the mean losses of a run's metrics lines, in
    order, by the module's rule; None for fewer than :data:`MIN_LINES` finite ones."""
    finite = [loss for loss in losses if math.isfinite(loss)]
    marks = _marks(finite)
    if marks is None:
        return None
    first, best, middle, end = marks
    if end - best > max(GIVEN_BACK * (first - best), RISE * abs(first)):
        return "diverged"
    if middle - end <= STALL * abs(middle) or first - end <= LEARNED * abs(first):
        return "stalled"
    return "ok"


def _marks(losses: Sequence[float]) -> tuple[float, float, float, float] | None:
    """``(first, best, middle, end)`` of :func:`judge`'s rule: the first loss, the lowest
    window median (or the first loss), and the medians of the window that ends at the middle
    and of the last window."""
    count = len(losses)
    if count < MIN_LINES:
        return None
    width = max(1, count // 4)
    medians = [statistics.median(losses[i:i + width]) for i in range(count - width + 1)]
    middle = statistics.median(losses[count // 2 - width:count // 2])
    return losses[0], min(losses[0], *medians), middle, medians[-1]


def critical_batch(noise_scales: Sequence[float]) -> int | None:
    """The critical batch, B_crit ~ B_noise ~ B_simple (McCandlish et al. 2018, section 2.2):
    the median of the noise scale as the run's metrics lines measured it (each a moving average
    over about 100 steps; the median is not moved by the first, unsettled ones, nor by those of a
    loss that blew up), rounded; None where none was measured."""
    measured = [value for value in noise_scales if value is not None and math.isfinite(value)]
    return max(1, round(statistics.median(measured))) if measured else None


class Learning(Component):
    """The mean losses of rank 0's metrics lines (and the noise scale, batch and learning rate
    they give), judged for the summary: ``learning`` (:func:`judge`), ``learning_note`` (what
    happened and the likely cause, the warning's text; null when ``ok`` or not judged) and
    ``critical_batch`` (:func:`critical_batch`). Its state is the lines, so that a resumed run
    is judged over the whole run, not from where it resumed."""

    name = "learning"

    def __init__(self, reporter: Reporter, plan: Plan, config: RunConfig) -> None:
        self.plan, self.config = plan, config
        self.steps: list[int] = []
        self.losses: list[float] = []
        self.noise_scales: list[float] = []
        self.batch: int | None = None
        """The global batch of the last line."""
        self.lr: float | None = None
        """The learning rate of the last line that gave one."""
        reporter.watch(self.observe)

    def observe(self, fields: dict[str, Any]) -> None:
        """Take a metrics line's fields (lines without a training loss are left out)."""
        loss = fields.get("loss")
        if loss is None:
            return
        self.steps.append(int(fields["step"]))
        self.losses.append(float(loss))
        if fields.get("noise_scale") is not None:
            self.noise_scales.append(float(fields["noise_scale"]))
        self.batch = fields.get("batch_size", self.batch)
        self.lr = fields.get("lr", self.lr)
        if len(self.losses) > MAX_LINES:
            self.steps, self.losses = self.steps[::2], _pairs(self.losses)  # a pair's last step
            self.noise_scales = _pairs(self.noise_scales)

    def summary(self) -> dict[str, Any]:
        verdict = judge(self.losses)
        return {"learning": verdict, "learning_note": self.note(verdict),
                "critical_batch": critical_batch(self.noise_scales)}

    def note(self, verdict: str | None) -> str | None:
        """What the loss did and the likely cause, in one line; None unless it went wrong."""
        lines = [(s, x) for s, x in zip(self.steps, self.losses) if math.isfinite(x)]
        marks = _marks([x for _, x in lines])
        if verdict not in ("stalled", "diverged") or marks is None:
            return None
        first, best, middle, end = marks
        if verdict == "diverged":
            what = (f"the loss rose to {end:.4g} by step {lines[-1][0]} from {first:.4g} at "
                    f"step {lines[0][0]} (lowest {best:.4g})")
        elif middle - end <= STALL * abs(middle):
            middle_step = lines[len(lines) // 2 - 1][0]
            what = (f"the loss stopped falling: {middle:.4g} by step {middle_step}, {end:.4g} "
                    f"by step {lines[-1][0]}")
        else:
            what = (f"the loss hardly fell: {end:.4g} by step {lines[-1][0]} from {first:.4g} "
                    f"at step {lines[0][0]}")
        return f"learning {verdict}: {what}; likely cause: {self.cause(verdict)}"

    def cause(self, verdict: str) -> str:
        """The likely cause: stale updates, a batch beyond the critical batch, or the
        learning rate, in that order."""
        strategy = strategy_of(self.plan)
        if stale_updates(self.plan):
            return (f"stale updates ({strategy} computes each update on weights some updates "
                    f"old); lower --lr, or train synchronously")
        crit = critical_batch(self.noise_scales)
        lr = f"{self.lr:.3g}" if self.lr is not None else f"{self.config.lr:g}"
        if crit is not None and self.batch is not None and self.batch > crit:
            return (f"batch {self.batch} is beyond the critical batch ~{crit} (the measured "
                    f"gradient noise scale), where a larger batch learns little more per "
                    f"step; lower --batch-size or the learning rate ({lr} at the end)")
        if verdict == "diverged":
            return f"the learning rate ({lr} at the end) is too large; lower --lr"
        return (f"the learning rate ({lr} at the end): lower it or decay it (--lr-schedule "
                f"cosine) if the loss jumps between lines, raise it if it creeps down")

    def state_dict(self) -> dict[str, Any]:
        return {"steps": list(self.steps), "losses": list(self.losses),
                "noise_scales": list(self.noise_scales)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = [int(s) for s in state.get("steps", [])]
        self.losses = [float(x) for x in state.get("losses", [])]
        self.noise_scales = [float(x) for x in state.get("noise_scales", [])]


def _pairs(values: list[float]) -> list[float]:
    """``values`` with the first kept and the rest averaged in neighbouring pairs."""
    rest = values[1:]
    return values[:1] + [sum(rest[i:i + 2]) / len(rest[i:i + 2]) for i in range(0, len(rest), 2)]


def learning_warnings(summary: dict[str, Any], config: RunConfig) -> list[str]:
    """The warnings a run's summary calls for: a loss that diverged or stalled
    (``learning_note``), and ``--lr-scaling linear`` or ``sqrt`` at a batch beyond the measured
    critical batch, where scaling the learning rate with the batch no longer pays."""
    found = [summary["learning_note"]] if summary.get("learning_note") else []
    crit, batch = summary.get("critical_batch"), summary.get("global_batch_size")
    if config.lr_scaling in ("linear", "sqrt") and crit is not None and batch is not None \
            and batch > crit:
        found.append(f"--lr-scaling {config.lr_scaling} scales the learning rate with the batch, "
                     f"but batch {batch} is beyond the critical batch ~{crit} (the measured "
                     f"gradient noise scale), where a larger batch takes about as many steps "
                     f"and a larger rate no longer pays (McCandlish et al. 2018); use "
                     f"--lr-scaling auto, or a smaller batch")
    return found


def warn_learning(summary: dict[str, Any], config: RunConfig) -> None:
    """Warn (a :class:`~tandem.errors.LearningWarning`, one line each) for
    :func:`learning_warnings`; called where the summary arrives, so once per run."""
    for message in learning_warnings(summary, config):
        warnings.warn(message, LearningWarning, stacklevel=2)
