"""The measuring run of ``tandem search --objective time-to-accuracy``: a short data-parallel
training run at a small batch that gives the steps to the target loss and the gradient noise
scale, the two numbers of :class:`~tandem.planning.search.time_to_accuracy.StepsModel`.

Usage::

    model = measure_steps(MeasureOptions(model="mlp", data="digits", target_loss=0.3))
    model.reference_steps, model.noise_scale      # at MeasureOptions.batch (32)

It runs ``tandem train --strategy dp --nproc 2`` (two workers: the noise scale is measured from
each worker's gradient and their mean) with tandem train's defaults (SGD, momentum 0.9) at
``lr``, and reads its metrics lines (every ``log_every`` steps: the mean training loss of those
steps, and the noise scale, a moving average over about 100 steps). The steps to the target are
where those losses first reach it (:func:`loss_crossing`, each line's loss placed at the middle
of its steps); the noise scale is the one of the line that reaches it (``noise_step`` None), the
noise scale of the loss targeted, or of the line at step ``noise_step`` (e.g. 50: the first 50
steps).
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

from tandem.errors import UsageError
from tandem.planning.search.time_to_accuracy import StepsModel, loss_crossing


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class MeasureOptions:
    """What the measuring run trains, how long, and what it measures."""

    model: str
    """Model spec, as ``tandem train --model``."""
    data: str
    """Dataset spec, as ``tandem train --data``."""
    target_loss: float
    batch: int = 32
    """Global batch of the run (``B0``)."""
    lr: float = 0.05
    """Learning rate (tandem train's default)."""
    steps: int = 500
    """Most steps: the run takes them all; the target must be reached within them."""
    seed: int = 0
    workers: int = 2
    log_every: int = 5
    noise_step: int | None = None
    """Take the noise scale at this step (a multiple of ``log_every``); None: where the loss
    reaches the target."""

    def __post_init__(self) -> None:
        for name in ("batch", "steps", "workers", "log_every"):
            if getattr(self, name) < 1:
                raise UsageError(f"the measuring run's {name} must be at least 1 (got "
                                 f"{getattr(self, name)}): see --measure-batch, --measure-steps")
        if not self.lr > 0:
            raise UsageError(f"--lr {self.lr} of the measuring run must be positive")
        if self.batch % self.workers:
            raise UsageError(f"the measuring batch {self.batch} does not split among its "
                             f"{self.workers} workers; give an even --measure-batch")
        if self.noise_step is not None and (self.noise_step % self.log_every
                                            or not 0 < self.noise_step <= self.steps):
            raise UsageError(f"the noise scale is read at logged steps: {self.noise_step} must be "
                             f"a multiple of {self.log_every} within the run's {self.steps} steps")


def measure_steps(options: MeasureOptions, out: str | Path | None = None) -> StepsModel:
    """Train as :class:`MeasureOptions` says (``out``: keep the run's files there) and return
    the steps model of its numbers; one line (:class:`UsageError`) when the loss never reaches
    the target or no noise scale was measured."""
    from tandem.api import fit  # delays torch

    with tempfile.TemporaryDirectory(prefix="tandem-measure-") as scratch:
        directory = Path(out) if out is not None else Path(scratch)
        fit(options.model, data=options.data, strategy="dp", nproc=options.workers,
                   steps=options.steps, batch_size=options.batch, lr=options.lr,
                   seed=options.seed, log_every=options.log_every, out=directory)
        lines = metrics_lines(directory / "metrics.jsonl")
    return steps_model(lines, options)


def metrics_lines(path: Path) -> list[dict[str, Any]]:
    """The lines of a run's ``metrics.jsonl`` that carry a training loss."""
    lines = [json.loads(text) for text in path.read_text().splitlines() if text.strip()]
    return [line for line in lines if line.get("loss") is not None]


def crossing(lines: list[dict[str, Any]], target: float, log_every: int) -> float | None:
    """Steps to ``target`` of a run's metrics lines (:func:`loss_crossing` over each line's mean
    loss placed at the middle of its ``log_every`` steps)."""
    middle = (log_every - 1) / 2
    return loss_crossing([(line["step"] - middle, float(line["loss"])) for line in lines],
                         target)


def steps_model(lines: list[dict[str, Any]], options: MeasureOptions) -> StepsModel:
    """The :class:`StepsModel` of a measuring run's metrics ``lines``."""
    where = (f"the measuring run (--strategy dp --nproc {options.workers} --batch-size "
             f"{options.batch} --lr {options.lr:g} --seed {options.seed})")
    steps = crossing(lines, options.target_loss, options.log_every)
    if steps is None:
        lowest = min((float(line["loss"]) for line in lines), default=float("nan"))
        raise UsageError(f"{where} did not reach --target-loss {options.target_loss:g} in "
                         f"{options.steps} steps (lowest logged loss {lowest:.4g}): raise "
                         f"--measure-steps or --target-loss")
    if options.noise_step is None:
        reached = next(line for line in lines
                       if line["step"] - (options.log_every - 1) / 2 >= steps)
        noise, at = reached.get("noise_scale"), f"at step {reached['step']}, the target's"
    else:
        line = next((line for line in lines if line["step"] == options.noise_step), {})
        noise, at = line.get("noise_scale"), f"at step {options.noise_step}"
    if noise is None or not noise > 0:
        raise UsageError(f"{where} measured no gradient noise scale {at}: run it longer "
                         f"(--measure-steps) or give --learning FILE with noise_scale")
    return StepsModel(target_loss=options.target_loss, reference_batch=options.batch,
                      reference_steps=steps, noise_scale=float(noise), lr=options.lr,
                      source=f"{where}: {steps:.1f} steps, noise scale {noise:.1f} {at}")
