"""Predicted next to measured: step times read off two timelines the same way, and their Gantt
charts one above the other.

Usage::

    comparison = compare(result, measured_timeline, skip_steps=warmup_steps(plan, timeline))
    comparison.error, comparison.workers[1].measured_step_s
    plot_comparison(result.timeline, measured_timeline, "side_by_side.png", ...)

A worker's time per step is the time between the ends of its consecutive steps: the end of its
last event of step ``k`` minus the end of its last event of the step before (divided by how
many steps apart they are: a replica of a PipeDream stage takes every ``r``-th minibatch). Read
that way it includes everything that happens between two steps (waiting for the pipeline,
loading data, logging), as the step time a run reports and the simulator's ``step_time_s``
(worker 0's last step minus the one before) do; the span of a step's own events would leave
out the gaps between steps. The whole job's step ends when its last worker is done with it.
Both are medians over the steady steps: the first ``skip_steps`` are left out, whose time
includes building the model, starting the communicators and filling the pipeline.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

from tandem.plan import Plan
from tandem.planning.simulate.simulator import SimResult
from tandem.timeline import Timeline, draw_gantt

WARMUP_STEPS = 2
"""Steps of a flush schedule left out of a run's measurement, as ``tandem train``'s own
``step_time_s`` leaves them out: the first builds communicators and caches, the second still
runs slower on this machine (allocator, lazy initialization)."""
GANTT_STEPS = 3
"""Steady steps drawn of each timeline (flush schedules; PipeDream's: twice its workers)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StepComparison:
    """Predicted and measured seconds per step of one worker (``worker`` -1: the whole job)."""

    worker: int
    stage: int
    predicted_step_s: float
    measured_step_s: float
    role: str = "worker"
    """``worker``, or ``server`` for a parameter server."""

    @property
    def error(self) -> float:
        """``predicted / measured - 1``: +0.1 predicts 10% slower than it ran."""
        return self.predicted_step_s / self.measured_step_s - 1 if self.measured_step_s else float("nan")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dictionary with the error."""
        return {**dataclasses.asdict(self), "error": self.error}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Comparison:
    """A run's measured step times next to the simulator's prediction of the same plan."""

    overall: StepComparison
    workers: list[StepComparison]
    measured_steps: list[int]
    """The run's steps the measurement covers (after the warm-up)."""

    @property
    def error(self) -> float:
        return self.overall.error

    def to_dict(self) -> dict[str, Any]:
        """``predicted_step_s``, ``measured_step_s``, ``error`` and ``workers`` (a list of
        dictionaries with the same keys, plus ``worker`` and ``stage``)."""
        return {"predicted_step_s": self.overall.predicted_step_s,
                "measured_step_s": self.overall.measured_step_s, "error": self.error,
                "measured_steps": self.measured_steps,
                "workers": [worker.to_dict() for worker in self.workers]}


def step_ends(timeline: Timeline, worker: int | None = None) -> dict[int, float]:
    """When each step ends: its last event's end, on ``worker`` (None: on any worker). Events
    outside steps (``step`` -1) are left out."""
    ends: dict[int, float] = {}
    for event in timeline.events:
        if event.step >= 0 and (worker is None or event.worker == worker):
            ends[event.step] = max(ends.get(event.step, event.end_s), event.end_s)
    return ends


def step_times(timeline: Timeline, *, worker: int | None = None,
               skip_steps: int = WARMUP_STEPS) -> dict[int, float]:
    """Seconds per step of each step ``k >= skip_steps`` (see the module docstring): the end of
    step ``k`` minus the end of the previous step taken, over how many steps apart they are."""
    ends = sorted(step_ends(timeline, worker).items())
    return {k: (end - before) / (k - previous)
            for (previous, before), (k, end) in zip(ends, ends[1:]) if k >= skip_steps}


def warmup_steps(plan: Plan, num_steps: int) -> int:
    """Steps to leave out of a run of ``num_steps``: :data:`WARMUP_STEPS`, and for PipeDream's
    schedule its fill too (a third of the run, at least one minibatch per worker)."""
    if plan.schedule.asynchronous:
        return max(WARMUP_STEPS, plan.num_workers, num_steps // 3)
    return WARMUP_STEPS


def simulated_skip(result: SimResult) -> int:
    """Simulated steps before the steady state: the first (flush), the first third of the
    minibatches (PipeDream, as the simulator measures it)."""
    return result.num_microbatches // 3 if result.schedule.asynchronous else 1


def compare(result: SimResult, measured: Timeline, *, skip_steps: int) -> Comparison:
    """The median seconds per step of every worker of ``measured`` (after ``skip_steps``) next
    to the same read off the simulator's timeline; overall, the job's steps next to
    ``result.step_time_s``. :class:`ValueError` when the run has no steady step to measure."""
    overall = step_times(measured, skip_steps=skip_steps)
    if not overall:
        raise ValueError(f"no step after the first {skip_steps} to measure")
    rows = []
    for worker in result.workers:
        times = step_times(measured, worker=worker.worker, skip_steps=skip_steps)
        predicted = step_times(result.timeline, worker=worker.worker,
                               skip_steps=simulated_skip(result))
        rows.append(StepComparison(
            worker=worker.worker, stage=worker.stage, role=worker.role,
            predicted_step_s=statistics.median(predicted.values()) if predicted else result.step_time_s,
            measured_step_s=statistics.median(times.values()) if times else float("nan")))
    whole = StepComparison(worker=-1, stage=-1, predicted_step_s=result.step_time_s,
                           measured_step_s=statistics.median(overall.values()))
    return Comparison(overall=whole, workers=rows, measured_steps=sorted(overall))


def gantt_window(timeline: Timeline, *, skip_steps: int, count: int) -> list[int]:
    """The ``count`` steps of ``timeline`` after ``skip_steps`` drawn in a comparison (fewer if
    it has fewer; the last ones if none is that late)."""
    steps = sorted(step_ends(timeline))
    later = [step for step in steps if step >= skip_steps]
    return later[:count] if later else steps[-count:]


def plot_comparison(predicted: Timeline, predicted_steps: Collection[int], measured: Timeline,
                    measured_steps: Collection[int], path: str | Path, *, titles: Iterable[str],
                    width_in: float = 12.0) -> None:
    """The two Gantt charts one above the other (predicted first), each of its own steps, on
    one time scale: both axes span the longer of the two windows."""
    from matplotlib.figure import Figure

    charts = [(predicted, set(predicted_steps)), (measured, set(measured_steps))]
    spans = [_span_ms(timeline, steps) for timeline, steps in charts]
    rows = [len({e.worker for e in t.events if e.step in s}) for t, s in charts]
    fig = Figure(figsize=(width_in, 2.4 + 0.55 * sum(max(1, r) for r in rows)), dpi=110)
    axes = fig.subplots(2, 1, height_ratios=[max(1, r) + 1 for r in rows])
    for ax, (timeline, steps), title in zip(axes, charts, titles):
        draw_gantt(ax, timeline, steps=steps, title=title, span_ms=max(spans))
    fig.tight_layout()
    fig.savefig(path)


def _span_ms(timeline: Timeline, steps: Collection[int]) -> float:
    events = [e for e in timeline.events if e.step in steps]
    if not events:
        return 1e-6
    return (max(e.end_s for e in events) - min(e.start_s for e in events)) * 1e3
