"""A pipeline stage's tensor split: its share of the model's tensor plan, cut on the job's mesh.

Usage::

    blocks = tensor_blocks(job, model, example, what="model 'pkg:build'")
    mesh = layout_mesh(device.type, replicas=..., stages=..., degree=T, worker_of=...)
    split = split_stage(job, module, model, blocks, start=start, end=end, place=place,
                        mesh=mesh)
    split.mesh["data"], split.plan, split.whole_layers, split.whole_bytes

A model that is not an ``nn.Sequential`` is traced and split (:mod:`tandem.split`), and a trace
bakes in the numbers its code reads from attributes (GPT-2's attention splits its fused
query/key/value output by ``split_size``). So, with tensor parallelism, it is traced as a
worker's share computes (:func:`share_view`: a layer that hands its rowwise partner a share
gives a share, that partner takes one, the attention counts a share of its heads), with its
tensor layers called as modules (:mod:`tandem.split.leaf`), which the split then turns into
DTensor layers as it does an ``nn.Sequential``'s. The pairs a stage boundary cuts are lone
layers there (:func:`~tandem.runtime.tensor_parallel.stage_plan`), and traced as such.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tandem.errors import PlanWarning
from tandem.models.tensor import TensorPlan, head_shares, tensor_plan
from tandem.runtime.job import Job
from tandem.runtime.pipeline.layout import StagePlace, layout_from_plan
from tandem.runtime.pipeline.setup import pipeline_blocks
from tandem.runtime.tensor_parallel import (
    Shares, check_trust_ratios, describe_shares, parameter_bytes, share_heads, share_sides,
    split_model, stage_plan,
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


def tensor_blocks(job: Job, model: nn.Module, example: Any, *, what: str,
                  vary: bool = False) -> nn.Sequential:
    """``model``'s blocks (:func:`~tandem.runtime.pipeline.setup.pipeline_blocks`, ``vary``
    as there); with tensor parallelism, a traced model's as a worker's share computes them,
    its tensor layers called as modules (traced again, as lone layers, where a stage boundary
    cuts a pair)."""
    split_points = job.run.split_points
    degree = job.plan.tensor_degree
    if degree == 1 or isinstance(model, nn.Sequential):
        return pipeline_blocks(model, example, what=what, split_points=split_points, vary=vary)
    plan = model_plan(job, model)
    sides = share_sides(plan)
    for _ in range(2):
        with share_view(model, plan, sides, degree):
            blocks = pipeline_blocks(model, example, what=what, split_points=split_points,
                                     leaves=list(plan), vary=vary)
        assert isinstance(blocks, SplitModel)
        bounds = layout_from_plan(job.plan, len(blocks)).bounds
        parts = [traced_stage_plan(blocks, plan, start, end) for start, end in bounds]
        staged = {name: side for part, _ in parts for name, side in share_sides(part).items()}
        if staged == sides:
            return blocks
        sides = staged  # pairs cut by a stage boundary: lone layers, traced again as such
    raise AssertionError("the second trace has the first one's blocks")


def model_plan(job: Job, model: nn.Module) -> TensorPlan:
    """The whole model's tensor plan, in the model's module order."""
    own = job.objects is not None and job.objects.model is not None
    plan = tensor_plan(None if own else job.run.model, model, job.plan.tensor_degree,
                       job.plan.tensor_layers)
    return {name: plan[name] for name, _ in model.named_modules() if name in plan}


def traced_stage_plan(blocks: SplitModel, plan: TensorPlan, start: int,
                      end: int) -> tuple[TensorPlan, list[str]]:
    """:func:`~tandem.runtime.tensor_parallel.stage_plan` of a traced split: the part of
    ``plan`` whose layers blocks ``start`` to ``end - 1`` call, under the model's names, in the
    order the stage runs them; the layers left whole."""
    indexed = {f"{blocks.leaves[name]}.{name}": style for name, style in
               sorted(plan.items(), key=lambda item: blocks.leaves[item[0]])}
    part, whole = stage_plan(indexed, start, end)
    return ({name.partition(".")[2]: style for name, style in part.items()},
            [name.partition(".")[2] for name in whole])


@contextlib.contextmanager
def share_view(model: nn.Module, plan: TensorPlan, sides: dict[str, str],
               degree: int) -> Iterator[Shares]:
    """While tracing: each layer of ``plan`` that hands on a share (``sides``,
    :func:`~tandem.runtime.tensor_parallel.share_sides`) gives the first ``1 / degree`` of its
    outputs, its partner takes that share (and computes as if whole), and the attention
    modules of the ``heads`` layers count a worker's share of their heads; then all as it was.
    What the layers compute is replaced by calls of the layers, which the split makes compute
    shares; what runs between them is traced as it runs on a share."""
    def narrow(_: nn.Module, __: Any, out: torch.Tensor) -> torch.Tensor:
        return out.narrow(-1, 0, out.shape[-1] // degree)

    def widen(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (torch.cat([args[0]] * degree, dim=-1), *args[1:])

    handles = [model.get_submodule(name).register_forward_hook(narrow) if side == "output"
               else model.get_submodule(name).register_forward_pre_hook(widen)
               for name, side in sides.items()]
    heads = {name: "heads" for name, style in plan.items()
             if style == "heads" and sides.get(name) == "output"}
    shares = share_heads(model, heads, degree)
    try:
        yield shares
    finally:
        for handle in handles:
            handle.remove()
        for full, (whole, _) in shares.items():
            owner, _, attribute = full.rpartition(".")
            setattr(model.get_submodule(owner), attribute, whole)


def split_stage(job: Job, module: nn.Module, model: nn.Module, blocks: nn.Sequential, *,
                start: int, end: int, place: StagePlace, mesh: DeviceMesh) -> StageSplit:
    """Keep this process's share of the stage's (``module``, blocks ``start`` to ``end``)
    split layers, split over the ``tensor`` dimension of the job's ``data x pipeline x
    tensor`` ``mesh`` (:func:`~tandem.runtime.tensor_parallel.layout_mesh`); a traced model's
    blocks must come from :func:`tensor_blocks`."""
    whole_plan = model_plan(job, model)
    check_trust_ratios(whole_plan, job.run.optimizer)
    part: TensorPlan = {}
    if isinstance(blocks, SplitModel):  # its layers are the blocks' calls of the model's modules
        part, whole_layers = traced_stage_plan(blocks, whole_plan, start, end)
        plan = {f"{blocks.leaves[name] - start}.{name}": style for name, style in part.items()}
    else:
        plan, whole_layers = stage_plan(whole_plan, start, end)
    if whole_layers and place.tensor_rank == 0 and place.replica == 0:
        warnings.warn(f"layers {', '.join(whole_layers)} stay whole: a heads layer needs its "
                      f"row-wise layer in its stage", PlanWarning, stacklevel=2)
    whole_bytes = parameter_bytes(module)
    shares = split_model(module, plan, mesh["tensor"])
    if isinstance(blocks, SplitModel):  # share_view's trace took the attention's share of heads
        shares = head_shares(model, {name: style for name, style in part.items()
                                     if style == "heads"}, place.tensor_degree)
    if shares and place.tensor_rank == 0 and place.replica == 0:
        logger.info(f"tensor parallelism, stage {place.stage}: {describe_shares(shares)}")
    return StageSplit(mesh=mesh, plan=plan, whole_layers=whole_layers, whole_bytes=whole_bytes)
