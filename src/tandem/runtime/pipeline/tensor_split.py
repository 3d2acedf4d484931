"""A pipeline stage's tensor split: its share of the model's tensor plan, cut on the job's mesh.

Usage::

    mesh = layout_mesh(device.type, replicas=..., stages=..., degree=T, worker_of=...)
    split = split_stage(job, module, model, blocks, start=start, end=end, place=place,
                        mesh=mesh)
    split.mesh["data"], split.plan, split.whole_layers, split.whole_bytes
"""

from __future__ import annotations

import dataclasses
import logging
import warnings

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tandem.errors import PlanWarning, UsageError
from tandem.models.tensor import TensorPlan, tensor_plan
from tandem.runtime.job import Job
from tandem.runtime.pipeline.layout import StagePlace
from tandem.runtime.tensor_parallel import (
    describe_shares, parameter_bytes, split_model, stage_plan,
)
from tandem.split import SplitModel

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StageSplit:
    """What splitting one stage's layers across its worker's tensor-parallel processes made."""

    mesh: DeviceMesh
    """The job's ``data x pipeline x tensor`` mesh."""
    plan: TensorPlan
    """The stage's part of the model's tensor plan: the layers split."""
    whole_layers: list[str]
    """Layers of the model's plan that stay whole in this stage (a heads layer whose row-wise
    layer is in another stage)."""
    whole_bytes: dict[str, int]
    """The stage's parameter bytes by name before the split (its memory report's baseline)."""


def split_stage(job: Job, module: nn.Module, model: nn.Module, blocks: nn.Sequential, *,
                start: int, end: int, place: StagePlace, mesh: DeviceMesh) -> StageSplit:
    """Keep this process's share of the stage's (``module``, blocks ``start`` to ``end``)
    split layers, split over the ``tensor`` dimension of the job's ``data x pipeline x
    tensor`` ``mesh`` (:func:`~tandem.runtime.tensor_parallel.layout_mesh`)."""
    if isinstance(blocks, SplitModel) or blocks is not model:
        raise UsageError(f"--tensor-parallel {place.tensor_degree} in a pipeline needs a model "
                         f"that is an nn.Sequential of blocks (tensor layers are named in "
                         f"it); run this model with --strategy dp --tensor-parallel")
    own = job.objects is not None and job.objects.model is not None
    whole_plan = tensor_plan(None if own else job.run.model, model, place.tensor_degree,
                             job.plan.tensor_layers)
    plan, whole_layers = stage_plan(whole_plan, start, end)
    if whole_layers and place.tensor_rank == 0 and place.replica == 0:
        warnings.warn(f"layers {', '.join(whole_layers)} stay whole: a heads layer needs its "
                      f"row-wise layer in its stage", PlanWarning, stacklevel=2)
    whole_bytes = parameter_bytes(module)
    shares = split_model(module, plan, mesh["tensor"])
    if shares and place.tensor_rank == 0 and place.replica == 0:
        logger.info(f"tensor parallelism, stage {place.stage}: {describe_shares(shares)}")
    return StageSplit(mesh=mesh, plan=plan, whole_layers=whole_layers, whole_bytes=whole_bytes)
