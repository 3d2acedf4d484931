"""Each pipeline stage's model and optimizer state through ``torch.distributed.checkpoint`` (DCP),
under the whole model's names: every rank writes and reads only the tensors it holds.

Usage::

    save_stage_shards(trainer, out / folder_name(step))     # collective: every rank its own
    orders = stage_row_orders(trainer)                       # for the checkpoint's row_orders
    load_stage_shards(trainer, checkpoint, path)             # collective, in place

The folder holds ``{"model": {name: tensor}, "optimizer": {"state": {name: {...}}}}``, keyed by
the whole model's names (:func:`~tandem.runtime.pipeline.setup.model_names`) as a data-parallel
run's sharded checkpoint is (:mod:`tandem.runtime.sharded_checkpoint`); a tensor that several
names share (tied weights) is written under each. Each rank gives DCP its tensors as it holds
them: whole (from a stage's first replica, buffers included; the stages that share a tied
weight give equal copies, and DCP keeps one writer of each), FSDP2's shards over the stage's
replicas (``--shard``), or DTensor shares (``--tensor-parallel``; a ``channels`` convolution's
rows are given as DTensors sharded by rows). DCP reads into each rank's own tensors the part it
holds of whatever layout wrote them (other stages, shard or tensor degree); the optimizer's
group settings, every stage's the same, travel in ``checkpoint.pt``.

The outputs of a split ``heads`` layer (fused queries, keys and values) are saved in its shares'
order (the checkpoint's ``row_orders``): a stage that holds such a layer whole puts them back in
the model's order, one that splits or shards it in another order is refused in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed.tensor import DTensor

from tandem.errors import UsageError
from tandem.runtime.sharded_checkpoint import (
    apply_group_settings, existing_folder, natural_rows, write_shards)
from tandem.runtime.tensor_checkpoint import dcp_state, row_orders

if TYPE_CHECKING:
    from tandem.runtime.pipeline.checkpoint import Names
    from tandem.runtime.pipeline.trainer import PipelineTrainer

Orders = dict[str, int | dict[str, int]]
"""Parameter name -> the tensor degree whose shares order its outputs (see
:func:`~tandem.runtime.tensor_checkpoint.row_orders`)."""


def _by_name(state: dict[str, Any], names: Names) -> dict[str, Any]:
    """``state`` (keyed by the stage's ``state_dict`` keys) under the whole model's names."""
    return {name: value for key, value in state.items() for name in names(key)}


def _stage_io(trainer: PipelineTrainer) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """What DCP writes or reads of this stage, by the model's names, and the stage's own model
    and optimizer state dicts (whose tensors it views) for ``set_state_dict``."""
    split, module = trainer.split, trainer.module
    rows = checkpointable_rows(trainer)
    io, model_state, optimizer_state = dcp_state(
        module, trainer.optimizer, rows, split.mesh["tensor"] if split is not None else None)
    named = {"model": _by_name(io["model"], trainer.names),
             "optimizer": {"state": _by_name(io["optimizer"]["state"], trainer.names)}}
    return named, model_state, optimizer_state


def checkpointable_rows(trainer: PipelineTrainer) -> list[str]:
    """The stage's parameters split by channels (handed to DCP as DTensors sharded by rows);
    one line if the stage is also sharded, which DCP cannot write so yet. The trainer calls it
    at start-up when the run will checkpoint, so that it is refused before training."""
    split = trainer.split
    channels = {name for name, style in split.plan.items() if style == "channels"} if split else ()
    rows = [name for name, _ in trainer.module.named_parameters()
            if name.rpartition(".")[0] in channels]
    if trainer.shards is not None and rows:
        named = ", ".join(trainer.names(name)[0] for name in rows)
        raise UsageError(f"a sharded stage's convolutions split by channels ({named}) cannot be "
                         f"checkpointed yet; drop --shard or --tensor-parallel, or "
                         f"--resume/--stop-after/--checkpoint-every/--max-restarts")
    return rows


def save_stage_shards(trainer: PipelineTrainer, folder: Path) -> None:
    """Write this stage's part of the model and optimizer state into ``folder`` (collective:
    every rank calls it, each with its own tensors)."""
    state, _, _ = _stage_io(trainer)
    write_shards(state if trainer.place.replica == 0 else _shares(state), folder)


def _shares(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with only its DTensors (shards and tensor shares): a replica other than a
    stage's first leaves the whole tensors (equal weights, buffers) to the first."""
    kept = {key: _shares(value) if isinstance(value, dict) else value
            for key, value in state.items()}
    return {key: value for key, value in kept.items()
            if isinstance(value, DTensor) or (isinstance(value, dict) and value)}


def stage_row_orders(trainer: PipelineTrainer) -> Orders:
    """The stage's parameters whose outputs it holds in its tensor shares' order, by the
    model's names (none without tensor parallelism)."""
    split = trainer.split
    if split is None:
        return {}
    orders = row_orders(trainer.module, split.plan, trainer.place.tensor_degree)
    return _by_name(orders, trainer.names)


def load_stage_shards(trainer: PipelineTrainer, checkpoint: dict[str, Any], path: Path) -> None:
    """Load this stage's model and optimizer state from the checkpoint's folder beside ``path``
    (collective), its optimizer's group settings, and the outputs of ``heads`` layers in the
    model's order where this stage holds them whole."""
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    folder = existing_folder(path.parent / checkpoint["sharded"])
    natural = _natural_orders(trainer, checkpoint, path)
    state, model_state, optimizer_state = _stage_io(trainer)
    load(state, checkpoint_id=str(folder))  # into the stage's tensors themselves
    set_state_dict(trainer.module, trainer.optimizer, model_state_dict=model_state,
                   optim_state_dict=optimizer_state)
    apply_group_settings(trainer.optimizer, checkpoint)
    natural_rows(trainer.module, trainer.optimizer, natural)


def _natural_orders(trainer: PipelineTrainer, checkpoint: dict[str, Any], path: Path) -> Orders:
    """The stage's parameters (its own keys) whose outputs the checkpoint holds in tensor
    shares' order and this stage whole: they are put back in the model's order. One line for a
    parameter the stage holds in another order, or as shards, than the checkpoint."""
    saved: Orders = checkpoint.get("row_orders", {})
    own = stage_row_orders(trainer)
    natural: Orders = {}
    for key, parameter in trainer.module.named_parameters():
        name = trainer.names(key)[0]
        held, mine = saved.get(name), own.get(name)
        if held == mine:
            continue
        if mine is None and not isinstance(parameter, DTensor):
            natural[key] = held  # type: ignore[assignment] # held is not None here
            continue
        raise UsageError(
            f"checkpoint {path} holds the outputs of {name} {_order(held)}, and this run's "
            f"stage {trainer.place.stage} holds them {_order(mine, parameter)}; resume it "
            f"{_saved_layout(checkpoint)}, or without --tensor-parallel and --shard (each stage "
            f"then reads whole tensors and puts them in order)")
    return natural


def _saved_layout(checkpoint: dict[str, Any]) -> str:
    """The flags of the layout that saved ``checkpoint``, in words (a pipeline's or dp's)."""
    degree = int(checkpoint.get("tensor_degree", 1))
    tensor = f" --tensor-parallel {degree}" if degree > 1 else ""
    layout = checkpoint.get("layout")
    if layout is None:
        return f"as it was saved (--strategy dp{tensor})"
    return f"as it was saved (--stages {len(layout['bounds'])}{tensor})"


def _order(entry: int | dict[str, int] | None, parameter: Any = None) -> str:
    """How a checkpoint or a stage orders a parameter's outputs, in words."""
    if entry is not None:
        degree = entry if isinstance(entry, int) else entry["degree"]
        return f"in the order of {degree} tensor-parallel shares"
    return "as shards" if isinstance(parameter, DTensor) else "in the model's order"
