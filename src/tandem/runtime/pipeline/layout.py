"""Which blocks of the model each pipeline stage holds and how many workers replicate it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tandem.errors import UsageError
from tandem.plan import Plan


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PipelineLayout:
    """Stages as block ranges ``[start, end)`` of an ``nn.Sequential``, with replica counts."""

    bounds: tuple[tuple[int, int], ...]
    replicas: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.bounds)

    @property
    def num_workers(self) -> int:
        return sum(self.replicas)

    def text(self) -> str:
        """PipeDream's form, e.g. ``2-1``."""
        return "-".join(map(str, self.replicas))


def even_bounds(num_blocks: int, num_stages: int) -> tuple[tuple[int, int], ...]:
    """Split ``num_blocks`` blocks into ``num_stages`` contiguous ranges of near-equal length."""
    if num_stages > num_blocks:
        raise UsageError(
            f"more stages ({num_stages}) than layers ({num_blocks}) in the model; "
            f"use --stages {num_blocks} or fewer, or a model with more blocks"
        )
    base, extra = divmod(num_blocks, num_stages)
    bounds, start = [], 0
    for stage in range(num_stages):
        end = start + base + (1 if stage < extra else 0)
        bounds.append((start, end))
        start = end
    return tuple(bounds)


def parse_replicas(text: str) -> tuple[int, ...]:
    """``2,1`` (or ``2-1``) into ``(2, 1)``."""
    try:
        replicas = tuple(int(part) for part in text.replace("-", ",").split(",") if part.strip())
    except ValueError:
        raise UsageError(f"--replicas {text!r} is not a list of integers like 2,1") from None
    if not replicas or min(replicas) < 1:
        raise UsageError(f"--replicas {text!r}: every stage needs at least 1 replica, e.g. 2,1")
    return replicas


def layout_from_plan(plan: Plan, num_blocks: int) -> PipelineLayout:
    """The stages of a ``tandem plan`` output, checked against the model."""
    if plan.layer_order is not None and list(plan.layer_order) != list(range(plan.num_layers)):
        raise UsageError(
            "the plan was made for a graph profile with a reordered layer list; make it from "
            "this model (tandem plan --model ...) so stages are block ranges"
        )
    if plan.num_layers != num_blocks:
        raise UsageError(
            f"the plan covers {plan.num_layers} layers but the model has {num_blocks} blocks; "
            f"plan this model (tandem plan --model ...)"
        )
    return PipelineLayout(bounds=tuple((s.start, s.end) for s in plan.stages),
                          replicas=tuple(s.replicas for s in plan.stages))


def build_layout(*, num_blocks: int, world_size: int, stages: int | None,
                 replicas: Sequence[int] | None, plan: Plan | None) -> PipelineLayout:
    """The layout asked for by ``--plan`` or ``--stages``/``--replicas``, checked against the job."""
    if plan is not None:
        layout = layout_from_plan(plan, num_blocks)
    else:
        num_stages = stages if stages is not None else (len(replicas) if replicas else world_size)
        if num_stages < 1:
            raise UsageError(f"--stages must be at least 1 (got {num_stages})")
        chosen = tuple(replicas) if replicas else (1,) * num_stages
        if len(chosen) != num_stages:
            raise UsageError(
                f"--replicas gives {len(chosen)} stages but --stages is {num_stages}; "
                f"give one replica count per stage"
            )
        layout = PipelineLayout(bounds=even_bounds(num_blocks, num_stages), replicas=chosen)
    if layout.num_workers != world_size:
        raise UsageError(
            f"the stages' replicas ({layout.text()}) add up to {layout.num_workers} workers but "
            f"the job has {world_size}; use --nproc {layout.num_workers} or change --replicas"
        )
    return layout
