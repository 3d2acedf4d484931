"""Checkpoints of sharded model and optimizer state through ``torch.distributed.checkpoint``
(DCP): each rank writes and reads only the shards it holds, and a checkpoint resumes on another
world size or layout (DCP reshards on load).

A sharded run's checkpoint is two parts in ``OUT``: the folder ``checkpoint-STEP.dcp`` (the
model's and the optimizer's state, one file per rank, written collectively) and
``checkpoint.pt``, which rank 0 writes last, atomically, with everything else (step, schedule,
data position, each rank's random stream and components), the folder's name under
``"sharded"`` and its files' checksums under ``"sums"`` (checked before any rank loads it).
``checkpoint.pt`` therefore always names a complete folder; the folders of older steps are
removed after it is written, but for the previous checkpoint's
(:mod:`tandem.runtime.run_checkpoints`). Any synchronous data-parallel run resumes it (a sharded
run on another shard degree, or a plain ``dp`` run, whose ranks then read whole tensors).

Usage::

    name, sums = save_sharded(out, step, model, optimizer)       # collective
    ...rank 0: save_checkpoint({..., "sharded": name, "sums": sums}, out / "checkpoint.pt", ...)
    remove_older(out, name)
    load_sharded(checked_folder(checkpoint, path), model, optimizer)   # collective
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tandem.errors import UsageError
from tandem.runtime.checksum import folder_sums, verify_folder
from tandem.runtime.run_checkpoints import corrupt, previous_sharded, sharded_folder

if TYPE_CHECKING:
    from tandem.sync import SyncStrategy

PATTERN = "checkpoint-*.dcp"
"""The folders of sharded checkpoints in ``OUT``."""


def folder_name(step: int) -> str:
    """The folder of the sharded checkpoint taken after ``step`` steps."""
    return f"checkpoint-{step}.dcp"


def one_file_per_tensor(state: dict[str, Any]) -> bool:
    """Whether :func:`write_shards` writes ``state`` one file per tensor: where any tensor is off
    the CPU. DCP's file writer copies such tensors to host memory and keeps every copy of a file
    until the file is closed, so one file per rank would stage the rank's whole state in host
    memory at once (1.87 GB for 1.57 GB held, gpt on an H100); one file per tensor holds one
    tensor's copy at a time. CPU tensors need no copy and keep one file per rank."""
    from torch.utils._pytree import tree_leaves

    return any(isinstance(leaf, torch.Tensor) and leaf.device.type != "cpu"
               for leaf in tree_leaves(state))


def write_shards(state: dict[str, Any], folder: Path, *,
                 checksums: bool = True) -> dict[str, str]:
    """DCP's ``save`` of ``state`` into ``folder`` (collective), each rank its own tensors, with
    host memory bounded on an accelerator (:func:`one_file_per_tensor`); with ``checksums``,
    the SHA-256 of each file of the folder, by name, every rank hashing a share of them
    (:func:`~tandem.runtime.checksum.folder_sums`), for ``checkpoint.pt`` to keep."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    from tandem.runtime.natural_rows import save_planner

    whole_files = not one_file_per_tensor(state)
    save(state, storage_writer=FileSystemWriter(str(folder), single_file_per_rank=whole_files),
         planner=save_planner())
    if not checksums:
        return {}
    rank, world = dist.get_rank(), dist.get_world_size()
    shares: list[Any] = [None] * world
    dist.all_gather_object(shares, folder_sums(folder, rank, world))  # DCP wrote every file
    return {name: digest for share in shares for name, digest in share.items()}


def save_sharded(out: Path, step: int, model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> tuple[str, dict[str, str]]:
    """Write ``model``'s and ``optimizer``'s state, each rank its own shards, into ``OUT``'s
    folder for ``step`` (collective); returns the folder's name and its files' checksums."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if _is_zero(optimizer):
        model_state, optimizer_state = model.state_dict(), zero_state(model, optimizer)
    else:
        model_state, optimizer_state = get_state_dict(model, optimizer)
    name = folder_name(step)
    sums = write_shards({"model": model_state, "optimizer": optimizer_state}, out / name)
    return name, sums


def _is_zero(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is a ``ZeroRedundancyOptimizer`` (ZeRO-1: each rank steps and
    holds the state of its own share of the parameters)."""
    return hasattr(optimizer, "consolidate_state_dict")


def zero_state(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """A ``ZeroRedundancyOptimizer``'s state in the layout of DCP's optimizer state dicts
    (keyed by parameter name): the state of the parameters this rank steps, so that each
    parameter's is written by its owner and read by whichever rank owns it on resume, and every
    group with the names of all its parameters. The values are the optimizer's own tensors
    (created by a step of zero gradients at learning rate 0 if it has none yet), so DCP loads
    into them in place."""
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    local = optimizer.optim
    if not local.state:
        _zero_step(local)
    groups = [{**{key: value for key, value in group.items() if key != "params"},
               "params": [names[id(p)] for p in group["params"]]}
              for group in optimizer.param_groups]
    return {"state": {names[id(p)]: dict(state) for p, state in local.state.items()},
            "param_groups": groups}


def _zero_step(optimizer: torch.optim.Optimizer) -> None:
    """Create ``optimizer``'s state without changing its parameters: one step of zero gradients
    at learning rate 0."""
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for parameter in group["params"]:
            parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
        for parameter in group["params"]:
            parameter.grad = None


def load_sharded(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load the state :func:`save_sharded` wrote into ``model`` and ``optimizer`` as this run
    holds them (sharded or whole; collective)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    existing_folder(folder)
    groups = holds_groups(folder)  # a pipeline's are in its checkpoint.pt

    def read(optimizer_state: dict[str, Any]) -> dict[str, Any]:
        return optimizer_state if groups else {"state": optimizer_state["state"]}

    if _is_zero(optimizer):  # the model's and the optimizer's own tensors, loaded in place
        load({"model": model.state_dict(), "optimizer": read(zero_state(model, optimizer))},
             checkpoint_id=str(folder))
        return
    model_state, optimizer_state = get_state_dict(model, optimizer)
    load({"model": model_state, "optimizer": read(optimizer_state)}, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=model_state,
                   optim_state_dict=optimizer_state)  # loaded in place


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """``optimizer``'s groups' settings (learning rate, momentum, ...) without their parameters:
    what ``checkpoint.pt`` holds beside a folder of shards, so that a layout whose workers hold
    other parameters (a pipeline's stages) continues with them."""
    return [{key: value for key, value in group.items() if key != "params"}
            for group in optimizer.param_groups]


def apply_group_settings(optimizer: torch.optim.Optimizer, checkpoint: dict[str, Any]) -> None:
    """The checkpoint's groups' settings (:func:`group_settings`) on ``optimizer``'s groups."""
    for group, settings in zip(optimizer.param_groups, checkpoint.get("param_groups", ()),
                               strict=False):
        group.update(settings)


def holds_groups(folder: Path) -> bool:
    """Whether the checkpoint in ``folder`` holds its optimizer's group settings (a data-parallel
    run's does; a pipeline's keeps them in ``checkpoint.pt``)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    keys = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return any(key.startswith("optimizer.param_groups") for key in keys)


def existing_folder(folder: Path) -> Path:
    """``folder``, a checkpoint's sharded state, if it is there; else one line."""
    if not folder.is_dir():
        raise UsageError(f"the checkpoint's sharded state {folder} is missing; resume from the "
                         f"run directory as it was written, or start afresh without --resume")
    return folder


def held_state(strategy: SyncStrategy, out: Path, step: int, model: nn.Module,
               optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The model's and optimizer's part of ``checkpoint.pt``: where ``strategy`` shards them,
    the name of the folder into which each rank has written its own shards (collective), else
    the whole state dicts (rank 0's are saved)."""
    if strategy.sharded_checkpoint:
        name, sums = save_sharded(out, step, model, optimizer)
        return {"sharded": name, "sums": sums, "param_groups": group_settings(optimizer)}
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "parameter_names": optimizer_names(model, optimizer)}


def optimizer_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of ``optimizer``'s parameters in the order its state dict numbers them (so
    that a pipeline's stages find theirs in a whole checkpoint)."""
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def load_whole_model(checkpoint: dict[str, Any] | None, model: nn.Module) -> None:
    """A whole checkpoint's model, loaded before wrapping (a sharded one is loaded into the
    wrapped model with the optimizer: :func:`restore_state`; None: no checkpoint)."""
    if checkpoint is not None and "sharded" not in checkpoint:
        model.load_state_dict(checkpoint["model"])


def restore_state(checkpoint: dict[str, Any], own: dict[str, Any], strategy: SyncStrategy,
                  model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a checkpoint's optimizer state (this worker's ``own``, or the common one), or its
    sharded model and optimizer state (collective); a whole model is loaded before wrapping.
    A sharded run cuts a whole optimizer state into its shards (:func:`shard_whole_optimizer`)."""
    if "sharded" in checkpoint:
        load_sharded(checkpoint["sharded"], model, optimizer)
        apply_group_settings(optimizer, checkpoint)  # a pipeline's are not in its folder
        return
    saved = own.get("optimizer", checkpoint["optimizer"])
    if strategy.sharded_checkpoint and not _is_zero(optimizer):
        shard_whole_optimizer(saved, model, optimizer)
    else:
        optimizer.load_state_dict(saved)


def shard_whole_optimizer(saved: dict[str, Any], model: nn.Module,
                          optimizer: torch.optim.Optimizer) -> None:
    """Load a whole optimizer state (``optimizer.state_dict()`` of the same model and optimizer,
    keyed by the parameters' positions in its groups) into ``optimizer`` over ``model``'s
    shards: keyed by the parameters' names, as DCP's state dicts are, then each rank keeps its
    shards (collective)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, set_optimizer_state_dict,
    )

    ordered = optimizer_names(model, optimizer)
    state = {ordered[index]: value for index, value in saved["state"].items()}
    groups = [{**group, "params": [ordered[index] for index in group["params"]]}
              for group in saved["param_groups"]]
    set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": groups},
                             options=StateDictOptions(full_state_dict=True))


def check_sharded_resume(checkpoint: dict[str, Any] | None,
                         path: Path | None) -> dict[str, Any] | None:
    """``checkpoint`` (loaded from ``path``) with its ``"sharded"`` entry pointing at its folder
    (:func:`checked_folder`). Any layout reads any sharded checkpoint: DCP reshards, and
    tensor-parallel runs save their fused layers in the model's order
    (:mod:`tandem.runtime.natural_rows`)."""
    if checkpoint is not None and path is not None and "sharded" in checkpoint:
        checkpoint["sharded"] = checked_folder(checkpoint, path)
    return checkpoint


def checked_folder(checkpoint: dict[str, Any], path: Path) -> Path:
    """The folder of sharded state that ``checkpoint`` (read from ``path``) names, there and
    whole: each of its files matches the checksum ``checkpoint.pt`` keeps (one line naming
    the corrupt one otherwise, :func:`~tandem.runtime.run_checkpoints.corrupt`)."""
    folder = existing_folder(sharded_folder(path, checkpoint["sharded"]))
    bad = verify_folder(folder, checkpoint.get("sums"))
    if bad is not None:
        raise corrupt(path, f"{folder.name}/{bad} does not match the SHA-256 checksum saved "
                            f"in it")
    return folder


def remove_older(out: Path, keep: str | None) -> None:
    """Remove ``OUT``'s sharded checkpoint folders other than ``keep`` and the previous
    checkpoint's (rank 0, after ``checkpoint.pt`` names ``keep``; None after a whole
    checkpoint)."""
    kept = {keep, previous_sharded(out)}
    for folder in out.glob(PATTERN):
        if folder.name not in kept:
            shutil.rmtree(folder, ignore_errors=True)
