"""What rank 0 shows and writes while training: a progress bar and ``metrics.jsonl`` (strict
JSON, one whole line at a time; a failed write stops the run with one line naming the file),
with the evaluations at ``--eval-every`` steps; every line is told to the user's callbacks."""

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

from tandem import strict_json
from tandem.output_files import AppendLog
from tandem.runtime.callbacks import UserCallbacks
from tandem.runtime.component import Component, StepEnd


class Reporter(Component):
    """Progress bar (stderr) and metrics file of rank 0; other ranks get a silent one. As a
    component, it advances the bar after every step."""

    def __init__(self, *, enabled: bool, show_progress: bool, metrics_path: Path | None,
                 total_steps: int, first_step: int, callbacks: UserCallbacks | None = None
                 ) -> None:
        self.enabled = enabled
        self.callbacks = callbacks if callbacks is not None else UserCallbacks([], 0, float)
        """The user's callbacks, told of every line on every rank (they choose their ranks)."""
        self._metrics = AppendLog(metrics_path) if enabled and metrics_path else None
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

    def __enter__(self) -> Reporter:
        self._progress.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._progress.stop()
        if self._metrics:
            self._metrics.close()

    def advance(self) -> None:
        """One optimizer step done."""
        if self.enabled:
            self._progress.advance(self._task)

    def after_step(self, end: StepEnd) -> None:
        self.advance()

    def record(self, **fields: Any) -> None:
        """Write one line to ``metrics.jsonl``, refresh the bar's loss and rate (a training
        line) or its evaluation (a line with ``test_loss``), and tell the callbacks."""
        self.callbacks.logged(dict(fields))
        if not self.enabled:
            return
        fields["time_s"] = round(time.perf_counter() - self._start, 4)
        if self._metrics:
            self._metrics.write_line(strict_json.dumps(fields))
        if "loss" in fields:
            self._progress.update(self._task, loss=f"{fields['loss']:.4f}",
                                  rate=f"{fields.get('samples_per_s', 0):.0f}")
        if "test_loss" in fields:
            shown = [f"{key.removeprefix('test_')} {value:.4g}" for key, value in fields.items()
                     if key.startswith("test_") and isinstance(value, (int, float))]
            self._progress.update(self._task, evaluation=" ".join(shown))

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
            self.reporter.record(step=end.done, **self.evaluate())
