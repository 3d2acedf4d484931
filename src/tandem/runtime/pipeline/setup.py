"""From a job's plan to a checked pipeline: the model's layout and the schedule that runs."""

from __future__ import annotations

from torch import nn

from tandem.errors import UsageError
from tandem.runtime.config import Job
from tandem.runtime.pipeline.layout import PipelineLayout, layout_from_plan
from tandem.schedule import Schedule
from tandem.schedule.check import check


def pipeline_setup(job: Job, model: nn.Module) -> tuple[PipelineLayout, Schedule]:
    """The layout and the checked schedule of ``job``'s plan on ``model``.

    Raises ``UsageError`` for a model that is not an ``nn.Sequential``, a plan made for another
    model, or a schedule the checker rejects. PipeDream's schedule spans the run's steps.
    """
    if not isinstance(model, nn.Sequential):
        raise UsageError(
            f"--strategy pipeline needs an nn.Sequential of blocks; model {job.run.model!r} "
            f"is a {type(model).__name__}"
        )
    layout = layout_from_plan(job.plan, len(model))
    schedule = job.plan.build_schedule(job.run.steps)
    check(schedule)
    return layout, schedule
