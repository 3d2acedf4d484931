"""From a training config to a checked pipeline: layout, micro-batches and schedule."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from tandem.errors import UsageError
from tandem.plan import Plan
from tandem.runtime.config import PIPELINE_SCHEDULES, TrainConfig
from tandem.runtime.pipeline.layout import PipelineLayout, build_layout, parse_replicas
from tandem.schedule import Schedule
from tandem.schedule.check import check
from tandem.schedule.generators import generate


def pipeline_setup(config: TrainConfig, model: nn.Module,
                   world_size: int) -> tuple[PipelineLayout, Schedule]:
    """The layout and the checked schedule of ``config`` on ``world_size`` workers.

    Raises ``UsageError`` for a model that is not an ``nn.Sequential``, more stages than blocks,
    replicas that do not add up to the workers, micro-batches that do not divide the batch, or
    a schedule the checker rejects.
    """
    if not isinstance(model, nn.Sequential):
        raise UsageError(
            f"--strategy pipeline needs an nn.Sequential of blocks; model {config.model!r} "
            f"is a {type(model).__name__}"
        )
    plan = Plan.load(config.plan) if config.plan else None
    layout = build_layout(
        num_blocks=len(model), world_size=world_size, stages=config.stages, plan=plan,
        replicas=parse_replicas(config.replicas) if config.replicas else None,
    )
    if config.schedule not in PIPELINE_SCHEDULES:
        schedule = load_schedule(config.schedule, layout)
    elif config.schedule == "pipedream":
        schedule = generate("pipedream", layout.replicas, config.steps)
    else:
        microbatches = config.microbatches or layout.num_stages
        if config.batch_size % microbatches:
            raise UsageError(
                f"--microbatches {microbatches} does not divide --batch-size {config.batch_size}; "
                f"choose a batch size that is a multiple of {microbatches}"
            )
        schedule = generate(config.schedule, layout.replicas, microbatches)
    check(schedule)
    return layout, schedule


def load_schedule(path: str, layout: PipelineLayout) -> Schedule:
    """A schedule written in its text form (``Schedule.text``) by hand or by a tool."""
    try:
        schedule = Schedule.parse(Path(path).read_text())
    except OSError as exc:
        raise UsageError(
            f"--schedule {path!r} is neither gpipe, 1f1b, pipedream nor a readable schedule "
            f"file ({exc.strerror})"
        ) from None
    except (ValueError, AssertionError) as exc:
        raise UsageError(f"--schedule {path}: not a schedule in tandem's text form ({exc})") from None
    if schedule.replicas != layout.replicas:
        raise UsageError(
            f"--schedule {path} is for replicas {'-'.join(map(str, schedule.replicas))} but the "
            f"pipeline is {layout.text()}; write it for this layout"
        )
    return schedule
