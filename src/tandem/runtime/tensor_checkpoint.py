"""Checkpoints of a tensor-parallel job through ``torch.distributed.checkpoint`` (DCP): each
worker writes and reads only its own shares of the split layers, and the whole layers are
written once.

A checkpoint is two parts in ``OUT``, as a sharded data-parallel run's
(:mod:`tandem.runtime.sharded_checkpoint`): the folder ``checkpoint-STEP.dcp`` with the model's
and the optimizer's state, written collectively, and ``checkpoint.pt``, written by rank 0 last,
which names the folder and holds the step, the schedule, the data position, the tensor degree and
each worker's random stream and components. The replicas of a data x tensor layout hold the same
shares, so DCP writes each once. Split layers are DTensors; the rows of a ``channels``
convolution, which are plain tensors (or FSDP2's shards of them), are given to DCP as one chunk
each at its place in the whole layer, and the fused query/key/value layers, whose shares hold their outputs in another
order, in the model's order (:mod:`tandem.runtime.natural_rows`). So a checkpoint resumes on
any layout: another tensor degree, any number of replicas, sharded or plain ``dp``, or a
pipeline; DCP reshards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tandem.models.tensor import TensorPlan, output_dim
from tandem.runtime.checkpoint import (
    CHECKPOINT_VERSION, load_checkpoint, load_schedule, resume_path, save_checkpoint,
)
from tandem.runtime.export import ShardedFinal, shards_written
from tandem.runtime.faults import announce_resume
from tandem.runtime.natural_rows import PLACEHOLDER, NaturalRows
from tandem.runtime.sharded_checkpoint import (
    apply_group_settings, checked_folder, folder_name, group_settings, holds_groups,
    remove_older, write_shards,
)
from tandem.runtime.tensor_parallel import split_parameters

if TYPE_CHECKING:
    from tandem.runtime.tensor_trainer import TensorParallelTrainer


class TensorCheckpoints:
    """Save and restore one tensor-parallel worker's checkpoints (collective)."""

    def __init__(self, trainer: TensorParallelTrainer) -> None:
        self.trainer = trainer
        split = split_parameters(trainer.model, trainer.tensor_plan)
        self.rows = [name for name, is_dtensor in split.items() if not is_dtensor]
        """Parameters held as plain tensors of this worker's rows (``channels`` layers)."""

    def _state(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        trainer = self.trainer
        orders = row_orders(trainer.model, trainer.tensor_plan, trainer.plan.tensor_degree)
        return dcp_state(trainer.model, trainer.optimizer, self.rows, trainer.mesh, orders)

    def final_state(self) -> ShardedFinal | None:
        """The model's final state as shards in ``OUT/final.dcp`` (collective, its ``heads``
        layers in the model's order); rank 0 exports ``final.pt`` from it, one tensor at a
        time (:mod:`tandem.runtime.export`). None on other ranks and without ``OUT``."""
        state, _, _ = self._state()
        return shards_written(self.trainer.out, state["model"], self.trainer.env.rank)

    def save(self, step: int) -> None:
        """Write the checkpoint taken after ``step`` steps."""
        trainer = self.trainer
        if trainer.out is None:
            return
        state, _, _ = self._state()
        name = folder_name(step)
        sums = write_shards(state, trainer.out / name)
        own = {"rng": torch.get_rng_state(), "components": trainer.components.state_dict()}
        ranks: list[dict[str, Any] | None] = [None] * trainer.env.world_size
        dist.all_gather_object(ranks, own)
        if trainer.env.rank != 0:
            return
        save_checkpoint({
            "version": CHECKPOINT_VERSION, "step": step, "fingerprint": trainer.job.fingerprint(),
            "sharded": name, "sums": sums, "tensor_degree": trainer.plan.tensor_degree,
            "param_groups": group_settings(trainer.optimizer),
            "scheduler": trainer.scheduler.state_dict(), "ranks": ranks,
            "data": trainer.feed.position(step),
        }, trainer.out / "checkpoint.pt", resume=trainer.config.resume)
        remove_older(trainer.out, name)

    def restore(self) -> None:
        """With ``--resume``: load the checkpoint's model and optimizer shares, schedule, step,
        random stream and components' states (which the run hands them)."""
        from torch.distributed.checkpoint.state_dict import set_state_dict
        from torch.distributed.checkpoint.state_dict_loader import load

        from tandem.runtime.natural_rows import load_planner

        trainer = self.trainer
        config, env = trainer.config, trainer.env
        path = resume_path(trainer.job, trainer.out)
        checkpoint = None if path is None else load_checkpoint(
            path, trainer.job.fingerprint(), steps=config.steps, stop_after=config.stop_after)
        announce_resume(env.rank, path, checkpoint["step"] if checkpoint else None)
        if checkpoint is None or path is None:
            return
        trainer.feed.check_position(checkpoint.get("data"), str(config.resume))
        folder = checked_folder(checkpoint, path)
        state, model_state, optimizer_state = self._state()
        if not holds_groups(folder):  # a pipeline's: the groups' settings are in checkpoint.pt
            state = {"model": state["model"], "optimizer": {"state": state["optimizer"]["state"]}}
        load(state, checkpoint_id=str(folder), planner=load_planner())  # into the tensors
        set_state_dict(trainer.model, trainer.optimizer, model_state_dict=model_state,
                       optim_state_dict=optimizer_state)
        apply_group_settings(trainer.optimizer, checkpoint)
        load_schedule(trainer.optimizer, trainer.scheduler, checkpoint["scheduler"],
                      announce=env.rank == 0)
        ranks = checkpoint["ranks"]  # another layout's: the stream of rank r % its world
        own = ranks[env.rank % len(ranks)]
        trainer.first_step = int(checkpoint["step"])
        torch.set_rng_state(own["rng"])
        trainer.resumed_components = own["components"]


def row_orders(model: nn.Module, plan: TensorPlan, degree: int) -> dict[str, int | dict[str, int]]:
    """The parameters of ``model`` whose outputs its shares hold in their own order (``plan``'s
    ``heads`` layers: each share's queries, keys and values together,
    :func:`~tandem.runtime.tensor_parallel.heads_order`), with the tensor ``degree`` that orders
    them, and the dimension it orders where that is not the first (a ``Conv1D``'s weight:
    ``{"degree": 2, "dim": 1}``)."""
    orders: dict[str, int | dict[str, int]] = {}
    for layer in (name for name, style in plan.items() if style == "heads"):
        module = model.get_submodule(layer)
        for key, _ in module.named_parameters(recurse=False):
            dim = output_dim(module, key)
            orders[f"{layer}.{key}"] = {"degree": degree, "dim": dim} if dim else degree
    return orders


class WriteThrough(dict[str, Any]):
    """One parameter's optimizer state as DCP is given it, views in place of its tensors: a
    value set in it that is no tensor (LAMB's ``step``, loaded or copied) is set in the
    optimizer's own entry ``own`` too, which is what ``set_state_dict`` reads."""

    def __init__(self, values: dict[str, Any], own: dict[str, Any]) -> None:
        super().__init__(values)
        self.own = own

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        if not isinstance(value, (torch.Tensor, NaturalRows)) and value is not PLACEHOLDER:
            self.own[key] = value


def dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer, rows: list[str],
              mesh: DeviceMesh | None, orders: dict[str, int | dict[str, int]]
              ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """What DCP writes or reads of ``model`` and ``optimizer`` (``{"model", "optimizer"}``: the
    parameters named in ``rows``, plain tensors of this worker's rows, and their optimizer state
    as chunks of the whole at this worker's place in the tensor ``mesh``
    (:meth:`NaturalRows.row_share`) that view them; those :func:`row_orders`
    names (``orders``), and their optimizer state, as :class:`NaturalRows` in the model's order),
    and the model's and optimizer's state dicts themselves (:func:`get_state_dict`'s, for
    ``set_state_dict``)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    model_io: dict[str, Any] = dict(model_state)
    states: dict[str, Any] = dict(cast(dict[str, Any], optimizer_state["state"]))

    def as_rows(tensor: torch.Tensor) -> NaturalRows:
        assert mesh is not None, "rows are shares of a tensor mesh"
        return NaturalRows.row_share(tensor, mesh.get_local_rank(), mesh.size())

    def in_order(tensor: torch.Tensor, entry: int | dict[str, int]) -> NaturalRows:
        degree, dim = (entry, 0) if isinstance(entry, int) else (entry["degree"], entry["dim"])
        return NaturalRows(tensor, degree, dim)

    for name in rows:
        model_io[name] = as_rows(cast(torch.Tensor, model_state[name]))
        if name in states:
            states[name] = WriteThrough({key: as_rows(value) if isinstance(value, torch.Tensor)
                                         and value.ndim else value
                                         for key, value in states[name].items()}, states[name])
    for name, entry in orders.items():
        parameter = cast(torch.Tensor, model_state[name])
        model_io[name] = in_order(parameter, entry)
        if name in states:
            states[name] = WriteThrough({key: in_order(value, entry) if isinstance(
                value, torch.Tensor) and value.shape == parameter.shape else value
                for key, value in states[name].items()}, states[name])
    optimizer_io = {**optimizer_state, "state": states}
    return ({"model": model_io, "optimizer": optimizer_io}, dict(model_state),
            dict(optimizer_state))
