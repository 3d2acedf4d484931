"""A pipeline's checkpoints, under the whole model's names, and back into any layout.

Usage::

    save_stage_checkpoint(trainer, step)          # collective; rank 0 writes checkpoint.pt last
    restore_stage(trainer, checkpoint, path)      # collective, with --resume

A flush schedule's (1F1B, GPipe, with replicated, sharded or tensor-parallel stages) is two
parts in ``OUT``, as a sharded data-parallel run's (:mod:`tandem.runtime.sharded_checkpoint`):
the folder ``checkpoint-STEP.dcp``, into which each rank writes the tensors it holds of its
stage's model and optimizer state (:mod:`tandem.runtime.pipeline.dcp`; no rank holds the whole
model), and ``checkpoint.pt``, which names the folder and holds the step, schedule, data
position, layout and each worker's random stream, codec and components. The asynchronous
PipeDream schedule's workers are saved at different moments (each as it applied the step's
update), so its whole state is gathered on rank 0 into ``checkpoint.pt``::

    part = stage_state(module, names, optimizer)      # each stage's replica 0, on its rank
    merged = merge_stages([part, ...])                # rank 0: the whole model's state
    load_stage(module, names, optimizer, merged, path="OUT/checkpoint.pt")

``names`` maps a key of the stage's own ``state_dict`` (``"0.weight"``) to the whole model's
names of that tensor (:func:`~tandem.runtime.pipeline.setup.model_names`). Parameters, buffers
and optimizer state are keyed by those names, never by position, so a checkpoint saved with
one layout (``2-1``, two stages) loads into another (three stages): each stage takes the names
it holds. A tensor that several names share (tied weights) is stored under each of them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from tandem.errors import UsageError
from tandem.runtime.asynchrony import restore_momentum
from tandem.runtime.checkpoint import CHECKPOINT_VERSION, load_schedule, save_checkpoint
from tandem.runtime.pipeline.dcp import load_stage_from_whole, load_stage_shards, save_stage_shards
from tandem.runtime.pipeline.layout import PipelineLayout
from tandem.runtime.sharded_checkpoint import folder_name, group_settings, remove_older

if TYPE_CHECKING:
    from tandem.runtime.pipeline.trainer import PipelineTrainer

Names = Callable[[str], tuple[str, ...]]
"""A stage's ``state_dict`` key -> the whole model's names of that tensor."""


def _cloned(value: Any) -> Any:
    """``value`` with every tensor in it copied to the CPU (a snapshot the run cannot change)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {key: _cloned(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cloned(item) for item in value)
    return copy.deepcopy(value)


def model_state(module: nn.Module, names: Names) -> dict[str, torch.Tensor]:
    """The stage's parameters and buffers under the whole model's names (copies, on the CPU)."""
    return {name: tensor.detach().cpu().clone()
            for key, tensor in module.state_dict().items() for name in names(key)}


def optimizer_state(module: nn.Module, names: Names,
                    optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's per-parameter state keyed by parameter name, and its groups' settings
    (learning rate, momentum, ...) without their parameter lists."""
    keys = {id(param): key for key, param in module.named_parameters()}
    params = [param for group in optimizer.param_groups for param in group["params"]]
    saved = optimizer.state_dict()
    state: dict[str, Any] = {}
    for index, values in saved["state"].items():
        copied = _cloned(values)
        for name in names(keys[id(params[index])]):
            state[name] = copied
    groups = [{key: copy.deepcopy(value) for key, value in group.items() if key != "params"}
              for group in saved["param_groups"]]
    return {"state": state, "param_groups": groups}


def stage_state(module: nn.Module, names: Names,
                optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What one stage contributes to a checkpoint: its model and optimizer state, by name."""
    return {"model": model_state(module, names),
            "optimizer": optimizer_state(module, names, optimizer)}


def merge_stages(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole model's state and optimizer state from every stage's :func:`stage_state`
    (stages that share a tensor hold equal copies; the first stage's wins); the optimizer's
    group settings are the first stage's (every stage's are the same)."""
    model: dict[str, torch.Tensor] = {}
    state: dict[str, Any] = {}
    for part in parts:
        for name, tensor in part["model"].items():
            model.setdefault(name, tensor)
        for name, values in part["optimizer"]["state"].items():
            state.setdefault(name, values)
    groups = parts[0]["optimizer"]["param_groups"]
    return {"model": model, "optimizer": {"state": state, "param_groups": groups}}


def load_stage(module: nn.Module, names: Names, optimizer: torch.optim.Optimizer,
               checkpoint: dict[str, Any], *, path: str) -> None:
    """Load this stage's parameters, buffers and optimizer state by name from a merged
    checkpoint (``model`` and ``optimizer`` as :func:`merge_stages` makes them)."""
    saved_model = checkpoint["model"]
    checkpoint = {**checkpoint, "optimizer": _optimizer_by_name(checkpoint)}
    state = {}
    for key in module.state_dict():
        name = next((name for name in names(key) if name in saved_model), None)
        if name is None:
            raise UsageError(f"checkpoint {path} holds no tensor named {names(key)[0]!r}, which "
                             f"this model has; resume with the model it was saved from")
        state[key] = saved_model[name]
    module.load_state_dict(state)
    _load_optimizer(module, names, optimizer, checkpoint["optimizer"])


def _optimizer_by_name(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A whole checkpoint's optimizer state by parameter name (a data-parallel run's is by
    position, with ``parameter_names`` in that order; a pipeline's is by name)."""
    if "parameter_names" in checkpoint:
        return by_name(checkpoint["optimizer"], checkpoint["parameter_names"])
    return cast(dict[str, Any], checkpoint["optimizer"])


def by_name(saved: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A whole optimizer state dict (``state`` numbered by position) keyed by the parameters'
    ``names`` in that order, its groups' settings without their parameter lists."""
    return {"state": {names[index]: value for index, value in saved["state"].items()},
            "param_groups": [{key: value for key, value in group.items() if key != "params"}
                             for group in saved["param_groups"]]}


def _load_optimizer(module: nn.Module, names: Names, optimizer: torch.optim.Optimizer,
                    saved: dict[str, Any]) -> None:
    """The saved state of each of this stage's parameters (found by any of its names) and the
    saved group settings, through the optimizer's own ``load_state_dict``."""
    keys = {id(param): key for key, param in module.named_parameters()}
    state: dict[int, Any] = {}
    groups = []
    index = 0
    for group, settings in zip(optimizer.param_groups, saved["param_groups"], strict=True):
        indices = []
        for param in group["params"]:
            found = next((saved["state"][name] for name in names(keys[id(param)])
                          if name in saved["state"]), None)
            if found is not None:
                state[index] = found
            indices.append(index)
            index += 1
        groups.append({**settings, "params": indices})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def layout_record(layout: PipelineLayout) -> dict[str, Any]:
    """What a checkpoint records of the layout it was saved with."""
    return {"bounds": [list(bounds) for bounds in layout.bounds],
            "replicas": list(layout.replicas)}


def _own_state(trainer: PipelineTrainer) -> dict[str, Any]:
    """A pipeline worker's own part of a checkpoint: its random stream, codec state and
    components' states (the loss scale)."""
    codec = trainer.wire.codec
    return {"rng": torch.get_rng_state(),
            "wire": copy.deepcopy(codec.state_dict()) if codec is not None else {},
            "components": copy.deepcopy(trainer.components.state_dict())}


def worker_state(trainer: PipelineTrainer) -> dict[str, Any]:
    """An asynchronous pipeline worker's part of a checkpoint as it is now: its own state; on a
    stage's replica 0 the stage's model and optimizer state (replicas agree); on rank 0 the
    learning-rate schedule (every worker's is the same)."""
    own = _own_state(trainer)
    if trainer.place.replica == 0:
        own["stage"] = stage_state(trainer.module, trainer.names, trainer.optimizer)
    if trainer.env.rank == 0:
        own["scheduler"] = copy.deepcopy(trainer.scheduler.state_dict())
    return own


def save_stage_checkpoint(trainer: PipelineTrainer, step: int) -> None:
    """Save the state after ``step`` steps to ``OUT`` (collective; rank 0 writes
    ``checkpoint.pt`` last): a flush schedule's between steps, each stage's model and optimizer
    state written by its own ranks into ``checkpoint-STEP.dcp``; an asynchronous schedule's
    gathered on rank 0 into ``checkpoint.pt`` (:func:`_save_gathered`)."""
    if trainer.out is None:
        return
    if trainer.asynchronous:
        _save_gathered(trainer, step)
        return
    name = folder_name(step)
    sums = save_stage_shards(trainer, trainer.out / name)
    own = _own_state(trainer)
    gathered: list[Any] = [None] * trainer.env.world_size if trainer.env.rank == 0 else []
    dist.gather_object(own, gathered if trainer.env.rank == 0 else None, dst=0)
    if trainer.env.rank != 0:
        return
    save_checkpoint({
        **_record(trainer, step, gathered), "sharded": name, "sums": sums,
        "param_groups": copy.deepcopy(group_settings(trainer.optimizer)),
        "tensor_degree": trainer.place.tensor_degree,
    }, trainer.out / "checkpoint.pt", resume=trainer.config.resume)
    remove_older(trainer.out, name)


def _record(trainer: PipelineTrainer, step: int, gathered: list[dict[str, Any]]
            ) -> dict[str, Any]:
    """What every pipeline checkpoint holds besides the model and optimizer state: the step, the
    run's settings, the schedule, every worker's own state, the data position and the layout."""
    return {"version": CHECKPOINT_VERSION, "step": step, "fingerprint": trainer.job.fingerprint(),
            "scheduler": copy.deepcopy(trainer.scheduler.state_dict()),
            "ranks": [{key: part[key] for key in ("rng", "wire", "components")}
                      for part in gathered],
            "data": trainer.feed.position(step), "layout": layout_record(trainer.layout)}


def _save_gathered(trainer: PipelineTrainer, step: int) -> None:
    """Save the asynchronous schedule's state after ``step`` steps to ``OUT/checkpoint.pt``, the
    whole model and optimizer state gathered on rank 0 (its workers' snapshots are of different
    moments): at the drained end of the run, the state now; within it, each worker's snapshot
    of the moment it applied its ``step``-th update (``PipelineTrainer._snapshot_if_due``)."""
    rank, out = trainer.env.rank, trainer.out
    assert out is not None, "saved with --out only"
    assert step >= trainer.last_step or step in trainer.snapshots, \
        f"no snapshot of step {step} on rank {rank}"
    own = trainer.snapshots.pop(step, None) or worker_state(trainer)
    gathered: list[Any] = [None] * trainer.env.world_size if rank == 0 else []
    dist.gather_object(own, gathered if rank == 0 else None, dst=0)
    if rank != 0:
        return
    merged = merge_stages([part["stage"] for part in gathered if "stage" in part])
    save_checkpoint({**_record(trainer, step, gathered), **merged,
                     "scheduler": own["scheduler"]}, out / "checkpoint.pt",
                    resume=trainer.config.resume)
    remove_older(out, None)


def restore_stage(trainer: PipelineTrainer, checkpoint: dict[str, Any], path: Path) -> None:
    """This stage's parameters, buffers, optimizer state (by name, from any layout) and
    schedule; this rank's random stream, codec and components' states where the layout is the
    same, else rank 0's components' states (the loss scale is every worker's)."""
    if "sharded" in checkpoint:
        load_stage_shards(trainer, checkpoint, path)
    elif trainer.split is not None or trainer.shards is not None:
        load_stage_from_whole(trainer, checkpoint["model"], _optimizer_by_name(checkpoint),
                              path)
    else:
        load_stage(trainer.module, trainer.names, trainer.optimizer, checkpoint, path=str(path))
    restore_momentum(trainer.optimizer, trainer.compensation)
    load_schedule(trainer.optimizer, trainer.scheduler, checkpoint["scheduler"],
                  announce=trainer.env.rank == 0)
    ranks, env = checkpoint["ranks"], trainer.env
    same_layout = (checkpoint.get("layout") == layout_record(trainer.layout)
                   and len(ranks) == env.world_size)
    own = ranks[env.rank if same_layout else 0]
    trainer.resumed_components = own["components"]
    if same_layout:
        torch.set_rng_state(own["rng"])
        if trainer.wire.codec is not None:
            trainer.wire.codec.load_state_dict(own["wire"])
