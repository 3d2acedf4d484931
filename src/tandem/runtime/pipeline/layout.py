"""Which blocks of the model each pipeline stage holds and how many workers replicate it."""

from __future__ import annotations

import dataclasses

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


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StagePlace:
    """Where one process of a pipeline job sits: its worker in the schedule, that worker's
    stage and replica, and its place among the worker's tensor-parallel processes."""

    worker: int
    """This process's worker in the schedule (``rank // tensor_degree``)."""
    stage: int
    replica: int
    """The worker's stage, and which of that stage's replicas it is."""
    tensor_rank: int
    """Its place among the worker's tensor-parallel processes (0 without tensor parallelism)."""
    tensor_degree: int
    """Processes per worker (1 without tensor parallelism)."""

    def rank_of(self, worker: int) -> int:
        """The rank of schedule worker ``worker``'s process at this place's tensor position."""
        return worker * self.tensor_degree + self.tensor_rank


def layout_from_plan(plan: Plan, num_blocks: int) -> PipelineLayout:
    """The stages of a plan, checked against the model's blocks."""
    if plan.layer_order is not None and list(plan.layer_order) != list(range(plan.num_layers)):
        raise UsageError(
            "the plan was made for a graph profile with a reordered layer list; make it from "
            "this model (tandem plan --model ...) so stages are block ranges"
        )
    if plan.num_layers != num_blocks:
        raise UsageError(
            f"the plan covers {plan.num_layers} layers but the model has {num_blocks} blocks; "
            f"plan this model (tandem plan --model ..., with the same --split-points if any)"
        )
    return PipelineLayout(bounds=tuple((s.start, s.end) for s in plan.stages),
                          replicas=tuple(s.replicas for s in plan.stages))
