"""Each pipeline stage's model and optimizer state through ``torch.distributed.checkpoint`` (DCP),
under the whole model's names: every rank writes and reads only the tensors it holds.

Usage::

    save_stage_shards(trainer, out / folder_name(step))     # collective: every rank its own
    load_stage_shards(trainer, checkpoint, path)             # collective, in place
    load_stage_from_whole(trainer, model, optimizer, path)   # a whole checkpoint's parts

The folder holds ``{"model": {name: tensor}, "optimizer": {"state": {name: {...}}}}``, keyed by
the whole model's names (:func:`~tandem.runtime.pipeline.setup.model_names`) as a data-parallel
run's sharded checkpoint is (:mod:`tandem.runtime.sharded_checkpoint`); a tensor that several
names share (tied weights) is written under each. Each rank gives DCP its tensors as it holds
them: whole (from a stage's first replica, buffers included; the stages that share a tied
weight give equal copies, and DCP keeps one writer of each), FSDP2's shards over the stage's
replicas (``--shard``), or DTensor shares (``--tensor-parallel``; a ``channels`` convolution's
rows, sharded or not, as one chunk at their place in the layer, and a split ``heads`` layer's in
the model's order, :mod:`tandem.runtime.natural_rows`). DCP reads into each rank's own tensors the part it holds of
whatever layout wrote them (other stages, shard or tensor degree, data parallelism); the
optimizer's group settings, every stage's the same, travel in ``checkpoint.pt``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed.tensor import DTensor

from tandem.errors import UsageError
from tandem.runtime.natural_rows import NaturalRows, copy_from_whole, load_planner
from tandem.runtime.sharded_checkpoint import apply_group_settings, checked_folder, write_shards
from tandem.runtime.tensor_checkpoint import dcp_state, row_orders

if TYPE_CHECKING:
    from tandem.runtime.pipeline.checkpoint import Names
    from tandem.runtime.pipeline.trainer import PipelineTrainer


def _by_name(state: dict[str, Any], names: Names) -> dict[str, Any]:
    """``state`` (keyed by the stage's ``state_dict`` keys) under the whole model's names."""
    return {name: value for key, value in state.items() for name in names(key)}


def _stage_io(trainer: PipelineTrainer) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """What DCP writes or reads of this stage, by the model's names, and the stage's own model
    and optimizer state dicts (whose tensors it views) for ``set_state_dict``."""
    split, module = trainer.split, trainer.module
    rows = channel_rows(trainer)
    orders = row_orders(module, split.plan, trainer.place.tensor_degree) if split else {}
    io, model_state, optimizer_state = dcp_state(
        module, trainer.optimizer, rows, split.mesh["tensor"] if split is not None else None,
        orders)
    named = {"model": _by_name(io["model"], trainer.names),
             "optimizer": {"state": _by_name(io["optimizer"]["state"], trainer.names)}}
    return named, model_state, optimizer_state


def channel_rows(trainer: PipelineTrainer) -> list[str]:
    """The stage's parameters split by channels: each worker's block of rows (or FSDP2's shard
    of it, on a sharded stage), handed to DCP as one chunk of the whole layer."""
    split = trainer.split
    channels = {name for name, style in split.plan.items() if style == "channels"} if split else ()
    return [name for name, _ in trainer.module.named_parameters()
            if name.rpartition(".")[0] in channels]


def save_stage_shards(trainer: PipelineTrainer, folder: Path) -> dict[str, str]:
    """Write this stage's part of the model and optimizer state into ``folder`` (collective:
    every rank calls it, each with its own tensors); the checksums of the folder's files."""
    state, _, _ = _stage_io(trainer)
    return write_shards(state if trainer.place.replica == 0 else _shares(state), folder)


def _shares(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with only its DTensors (shards and tensor shares): a replica other than a
    stage's first leaves the whole tensors (equal weights, buffers) to the first."""
    kept = {key: _shares(value) if isinstance(value, dict) else value
            for key, value in state.items()}
    return {key: value for key, value in kept.items()
            if isinstance(value, (DTensor, NaturalRows)) or (isinstance(value, dict) and value)}


def load_stage_shards(trainer: PipelineTrainer, checkpoint: dict[str, Any], path: Path) -> None:
    """Load this stage's model and optimizer state from the checkpoint's folder beside ``path``
    (collective), and its optimizer's group settings."""
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    folder = checked_folder(checkpoint, path)
    state, model_state, optimizer_state = _stage_io(trainer)
    load(state, checkpoint_id=str(folder), planner=load_planner())  # into the stage's tensors
    set_state_dict(trainer.module, trainer.optimizer, model_state_dict=model_state,
                   optim_state_dict=optimizer_state)
    apply_group_settings(trainer.optimizer, checkpoint)


def load_stage_from_whole(trainer: PipelineTrainer, model: dict[str, Any],
                          optimizer: dict[str, Any], path: Path) -> None:
    """Load this sharded or tensor-parallel stage's part of a checkpoint that holds the whole
    model (``model`` by name, ``optimizer`` with its state by name: a plain ``dp`` run's or an
    asynchronous pipeline's), each rank copying the parts of the whole tensors it holds."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state, model_state, optimizer_state = _stage_io(trainer)
    absent = next((name for name in state["model"] if name not in model), None)
    if absent is not None:
        raise UsageError(f"checkpoint {path} holds no tensor named {absent!r}, which this model "
                         f"has; resume with the model it was saved from")
    copy_from_whole(state["model"], model)
    copy_from_whole(state["optimizer"]["state"], optimizer["state"], "optimizer")
    set_state_dict(trainer.module, trainer.optimizer, model_state_dict=model_state,
                   optim_state_dict=optimizer_state)
    groups, saved = trainer.optimizer.param_groups, optimizer["param_groups"]
    if len(groups) != len(saved):
        raise UsageError(f"checkpoint {path} holds {len(saved)} optimizer parameter groups, and "
                         f"this run's optimizer has {len(groups)}; resume with the optimizer "
                         f"settings it was saved with")
    for group, settings in zip(groups, saved, strict=True):
        group.update({key: value for key, value in settings.items() if key != "params"})
