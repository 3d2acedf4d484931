"""From a job's model and plan to a checked pipeline: the model's blocks, the layout, the schedule.

Usage::

    blocks = pipeline_blocks(model, example_inputs(data.train), what="model 'pkg:build'")
    layout, schedule = pipeline_setup(job, blocks)
    boundaries, skeletons = boundary_values(blocks, example_inputs(data.train))  # each cut's

An ``nn.Sequential`` is its own blocks; any other model is traced and split
(:func:`tandem.split.split_model`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from tandem import structures
from tandem.errors import UsageError
from tandem.runtime.job import Job
from tandem.runtime.pipeline.layout import PipelineLayout, layout_from_plan
from tandem.schedule import Schedule
from tandem.schedule.check import check
from tandem.split import SplitModel, TensorSpec, split_model
from tandem.structures import Skeleton

EXAMPLE_SAMPLES = 2
"""Samples of the example call a model is traced on (two, so the batch stays symbolic)."""


def example_inputs(samples: Any, *, meta: bool = False) -> Any:
    """The inputs of a split's first samples, as the model is called with them (``meta``: their
    tensors on the meta device, to trace a model that has no storage yet)."""
    inputs = (samples.rows(0, EXAMPLE_SAMPLES).inputs if hasattr(samples, "rows")
              else samples.inputs[:EXAMPLE_SAMPLES])
    return pytree.tree_map_only(torch.Tensor, lambda tensor: tensor.to("meta"),
                                inputs) if meta else inputs


def batches_vary(samples: Any) -> bool:
    """Whether batches of ``samples`` may differ in shape besides their samples (a user's
    ``collate_fn`` makes them: one that pads, say); then a traced model keeps its inputs'
    sizes symbolic and stages send each activation's shapes ahead of it."""
    return getattr(samples, "collate", None) is not None


def pipeline_blocks(model: nn.Module, example: Any, *, what: str,
                    split_points: str | None = None,
                    leaves: list[str] | None = None, vary: bool = False) -> nn.Sequential:
    """``model`` itself if it is an ``nn.Sequential``, else its split: before the submodules
    named in ``split_points`` (comma-separated), or automatic; ``leaves``: the submodules its
    blocks call as modules (:mod:`tandem.split.leaf`); ``vary``: :func:`batches_vary`."""
    names = parse_split_points(split_points)
    if isinstance(model, nn.Sequential):
        if names:
            raise UsageError(f"--split-points {split_points} is for models that are not an "
                             f"nn.Sequential; {what} is one, and its blocks are its layers")
        return model
    return split_model(model, example, what=what, split_points=names, leaves=leaves or (),
                       vary=vary)


def parse_split_points(text: str | None) -> list[str] | None:
    """``"a.b,c"`` -> ``["a.b", "c"]`` (None for none)."""
    if text is None:
        return None
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise UsageError(f"--split-points {text!r} names no submodule; give names like "
                         f"transformer.h.2,transformer.h.4")
    return names


def pipeline_setup(job: Job, blocks: nn.Sequential, *,
                   first_step: int = 0) -> tuple[PipelineLayout, Schedule]:
    """The layout and the checked schedule of ``job``'s plan on ``blocks``.

    Raises ``UsageError`` for a plan made for another model, a schedule the checker rejects,
    or weights shared between stages under PipeDream's schedule (its stages update at different
    times, so the copies could not stay equal). PipeDream's schedule spans the steps this run
    executes, ``first_step`` (a resumed run's) to ``--stop-after`` or ``--steps``: its
    minibatch ``m`` is step ``first_step + m``, and it drains at the end.
    """
    layout = layout_from_plan(job.plan, len(blocks))
    last = job.run.stop_after if job.run.stop_after is not None else job.run.steps
    schedule = job.plan.build_schedule(last - first_step if last > first_step else job.run.steps)
    if schedule.kind.asynchronous:
        _check_pipedream_steps(job, layout)
    check(schedule)
    shared = shared_parameters(blocks, layout.bounds)
    if shared and schedule.kind.asynchronous:
        stages = ", ".join("-".join(map(str, group)) for group in shared)
        raise UsageError(f"stages {stages} share parameters (tied weights), which the "
                         f"asynchronous pipedream schedule cannot keep equal; use --schedule "
                         f"1f1b or gpipe, or put the blocks that share them in one stage")
    return layout, schedule


def _check_pipedream_steps(job: Job, layout: PipelineLayout) -> None:
    """PipeDream's replicas of a stage share rounds of ``lcm(replicas)`` minibatches, so a
    checkpoint (and the schedule a resumed run builds) must fall between two rounds; a
    hand-written schedule cannot be cut at a checkpoint at all."""
    run = job.run
    resumable = run.resume is not None or run.stop_after is not None or run.checkpoint_every
    if resumable and job.plan.schedule_text is not None:
        raise UsageError("a hand-written pipedream schedule spans the whole run and cannot be "
                         "resumed from a checkpoint; drop --resume, --stop-after and "
                         "--checkpoint-every, or use --schedule pipedream")
    rounds = math.lcm(*layout.replicas)
    for flag, value in (("--checkpoint-every", run.checkpoint_every),
                        ("--stop-after", run.stop_after)):
        if value and value % rounds:
            raise UsageError(f"{flag} {value}: pipedream with replicas {layout.text()} "
                             f"checkpoints only between rounds of its replicas' round-robin "
                             f"({rounds} minibatches); use a multiple of {rounds}, e.g. "
                             f"{value + rounds - value % rounds}")


def shared_parameters(blocks: nn.Sequential, bounds: tuple[tuple[int, int], ...]
                      ) -> dict[tuple[int, ...], list[nn.Parameter]]:
    """Stages that hold the same parameters -> those parameters, in the blocks' order."""
    holders: dict[int, set[int]] = defaultdict(set)
    for stage, (start, end) in enumerate(bounds):
        for block in list(blocks)[start:end]:
            for param in block.parameters():
                holders[id(param)].add(stage)
    shared: dict[tuple[int, ...], list[nn.Parameter]] = defaultdict(list)
    for param in blocks.parameters():
        if len(holders[id(param)]) > 1:
            shared[tuple(sorted(holders[id(param)]))].append(param)
    return dict(sorted(shared.items()))


def boundary_values(blocks: nn.Sequential, example: Any
                    ) -> tuple[list[tuple[TensorSpec, ...]], list[Skeleton | None]]:
    """What block ``i`` passes to block ``i + 1``, for every ``i``: the tensors sent, and the
    skeleton around them where the value is more than a tensor or a tuple of tensors (a dict,
    None, numbers: :class:`~tandem.structures.Skeleton`).

    A split model knows; for an ``nn.Sequential`` one sample runs through it in evaluation
    mode, and every floating-point tensor it passes gets a gradient back (a 0-dim one, such as
    a running auxiliary loss, has no batch dimension). Blocks on the meta device (a built-in
    model before its stages are materialized) run on a meta copy of the sample: only shapes and
    dtypes are computed.
    """
    if isinstance(blocks, SplitModel):
        return list(blocks.boundaries), [None] * len(blocks.boundaries)
    specs, skeletons = [], []
    was_training = blocks.training
    blocks.eval()
    meta = any(t.is_meta for t in (*blocks.parameters(), *blocks.buffers()))
    with torch.no_grad():
        x = example[:1].to("meta") if meta else example[:1]
        for block in list(blocks)[:-1]:
            x = block(x)
            skeleton = Skeleton.of(x)
            tensors = (x if isinstance(x, tuple) else (x,)) if skeleton is None else \
                structures.tensors(x)
            specs.append(tuple(_sent(t) for t in tensors))
            skeletons.append(skeleton)
    blocks.train(was_training)
    return specs, skeletons


def _sent(tensor: torch.Tensor) -> TensorSpec:
    """The spec of a tensor passed between blocks: per sample, or whole if it has no
    dimension."""
    if tensor.dim() == 0:
        return TensorSpec(shape=(), dtype=tensor.dtype, requires_grad=tensor.is_floating_point())
    return TensorSpec.per_sample(tensor, requires_grad=tensor.is_floating_point())


def model_names(blocks: nn.Sequential, start: int) -> Any:
    """A function from a stage's ``state_dict`` key (``"0.weight"``, relative to the stage's
    first block ``start``) to the whole model's names of that tensor."""
    def names(key: str) -> tuple[str, ...]:
        index, _, rest = key.partition(".")
        if isinstance(blocks, SplitModel):
            return blocks.model_names(rest)
        return (f"{int(index) + start}.{rest}",)
    return names
