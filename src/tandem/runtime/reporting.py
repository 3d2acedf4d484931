"""What rank 0 shows and writes while training: a progress bar and the metrics lines, with the
evaluations at ``--eval-every`` steps, in the logs ``--log-to`` names (``metrics.jsonl``, strict
JSON, one whole line at a time; ``metrics.csv``; TensorBoard's event files: see
:mod:`tandem.runtime.log_sinks`). A failed write stops the run with one line naming the file.
Every line is told to the user's callbacks."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn,
)

from tandem.runtime.callbacks import UserCallbacks
from tandem.runtime.component import Component, StepEnd
from tandem.runtime.config import log_sinks
from tandem.runtime.log_sinks import LogSink, close_sinks, open_sinks


class Reporter(Component):
    """Progress bar (stderr) and logs of rank 0 (``log_to``, in ``out``; none without it);
    other ranks get a silent one. The logs are open inside its ``with`` block, and closed
    (flushed) when it ends, however it ends. As a component, it advances the bar after every
    step, and gives the summary the logs it writes (``logs``); :meth:`watch` shows every line it
    records to another (the judge of the loss, :class:`~tandem.runtime.learning.Learning`)."""

    def __init__(self, *, enabled: bool, show_progress: bool, out: Path | None,
                 log_to: str = "jsonl", total_steps: int, first_step: int,
                 callbacks: UserCallbacks | None = None) -> None:
        self.enabled = enabled
        self.callbacks = callbacks if callbacks is not None else UserCallbacks([], 0, float)
        """The user's callbacks, told of every line on every rank (they choose their ranks)."""
        self._logs = (log_sinks(log_to), out) if enabled and out is not None else None
        self._first_step = first_step
        self.sinks: list[LogSink] = []
        """The open logs (:mod:`tandem.runtime.log_sinks`)."""
        self._progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]} samples/s"),
            TextColumn("{task.fields[evaluation]}"), TimeElapsedColumn(), TimeRemainingColumn(),
            console=Console(stderr=True), disable=not (enabled and show_progress),
        )
        self._task = self._progress.add_task(
            "train", total=total_steps, completed=first_step, loss="-", rate="-", evaluation=""
        )
        self._start = time.perf_counter()
        self._watchers: list[Callable[[dict[str, Any]], None]] = []

    def watch(self, watcher: Callable[[dict[str, Any]], None]) -> None:
        """Call ``watcher`` with the fields of every line recorded from now on (rank 0's)."""
        self._watchers.append(watcher)

    def __enter__(self) -> Reporter:
        if self._logs is not None:
            self.sinks = open_sinks(*self._logs, first_step=self._first_step)
        self._progress.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._progress.stop()
        try:
            close_sinks(self.sinks)
        except Exception:
            if kind is None:  # else the error that ended the block is the one to report
                raise

    def advance(self) -> None:
        """One optimizer step done."""
        if self.enabled:
            self._progress.advance(self._task)

    def after_step(self, end: StepEnd) -> None:
        self.advance()

    def summary(self) -> dict[str, Any]:
        return {"logs": {sink.name: str(sink.path) for sink in self.sinks}}

    def record(self, **fields: Any) -> None:
        """Write a training line (its ``step``, loss, rate, ...) to the logs and refresh the
        bar's loss and rate; tell the callbacks."""
        self.callbacks.logged(dict(fields))
        self._write(fields, "train")
        if self.enabled and "loss" in fields:
            self._progress.update(self._task, loss=f"{fields['loss']:.4f}",
                                  rate=f"{fields.get('samples_per_s', 0):.0f}")

    def evaluated(self, step: int, evaluation: dict[str, Any]) -> None:
        """Write the evaluation after ``step`` steps (``test_loss``, ``test_accuracy``, the
        user's metrics), show it on the bar and tell the callbacks."""
        self.callbacks.evaluated(step, dict(evaluation))
        self._write({"step": step, **evaluation}, "eval")
        if self.enabled:
            shown = [f"{key.removeprefix('test_')} {value:.4g}" for key, value in evaluation.items()
                     if key.startswith("test_") and isinstance(value, (int, float))]
            self._progress.update(self._task, evaluation=" ".join(shown))

    def _write(self, fields: dict[str, Any], section: str) -> None:
        if not self.enabled:
            return
        fields["time_s"] = round(time.perf_counter() - self._start, 4)
        for sink in self.sinks:
            sink.write(fields, section)
        for watcher in self._watchers:
            watcher(fields)

    def message(self, text: str) -> None:
        """A line for the user, above the bar: one line, never wrapped at the console's width
        (stderr that is not a terminal is 80 columns to rich), nor read as markup."""
        if self.enabled:
            self._progress.console.print(text, soft_wrap=True, markup=False, highlight=False)


class PeriodicEvaluation(Component):
    """Evaluate every ``every`` steps before the last, into the metrics (``--eval-every``; the
    run's last step is evaluated at its end)."""

    def __init__(self, every: int, evaluate: Callable[[], dict[str, Any]],
                 reporter: Reporter) -> None:
        self.every, self.evaluate, self.reporter = every, evaluate, reporter

    def after_step(self, end: StepEnd) -> None:
        if end.done % self.every == 0 and not end.final:
            self.reporter.evaluated(end.done, self.evaluate())
