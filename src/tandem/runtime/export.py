"""``final.pt`` written from a sharded run's final shards one tensor at a time, so that no
process ever holds the whole model: at the end of a sharded run, and by ``tandem export
RUN_DIR``.

Usage::

    save_final_shards(out, get_model_state(model))         # collective: OUT/final.dcp
    export_final(out / "final.dcp", out / "final.pt")      # one process, one tensor at a time

The sharded run (FSDP2, tensor parallelism, or both) writes its model's state through
``torch.distributed.checkpoint`` (each rank its own shards, under the model's own names) into
``OUT/final.dcp``, with ``names.json`` (the names in the model's order, and which ``heads``
layers hold their outputs in the shares' order). :func:`export_final` reads
that folder's metadata, writes a ``torch.save`` file of the whole state whose tensors' bytes are
left unwritten (``torch.serialization.skip_data``: the skeleton's tensors are allocated but never
touched, so they take no memory), then loads each tensor alone from the folder (DCP joins its
shards) and writes its bytes where the skeleton left room for them. The result is a plain
``state_dict`` that ``torch.load`` reads; it is written beside the target and renamed over it
once complete. Tensors only: a module's non-tensor extra state is left out and counted.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import warnings
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from tandem.errors import UsageError
from tandem.output_files import write_text
from tandem.runtime.checkpoint import save_atomic

if TYPE_CHECKING:
    from tandem.sync import SyncStrategy

FINAL_SHARDS = "final.dcp"
"""The folder of a sharded run's final model shards in ``OUT``."""
NAMES = "names.json"
"""Beside the shards: the model's state-dict names in its own order, and the row orders of a
tensor-parallel model's ``heads`` layers."""
LOCAL_HEADER_BYTES = 30
"""Bytes of a zip local file header before its name and extra field."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Exported:
    """What :func:`export_final` wrote."""

    num_tensors: int
    num_bytes: int
    largest_tensor_bytes: int
    """The most bytes held at once (one tensor joined from its shards)."""
    skipped: list[str]
    """Entries that are not tensors (a module's extra state), left out."""


@dataclasses.dataclass(frozen=True, slots=True)
class ShardedFinal:
    """A sharded run's final state, written as shards in ``folder`` (rank 0 exports it)."""

    folder: Path


def final_state(strategy: SyncStrategy, model: nn.Module, out: Path | None,
                rank: int) -> dict[str, torch.Tensor] | ShardedFinal | None:
    """The model's final state for rank 0 to write (collective): where ``strategy`` builds and
    holds it in shards (FSDP2), the shards written to ``OUT/final.dcp`` (None without ``OUT``),
    else the whole state dict the strategy gathers; None on the other ranks."""
    if not strategy.builds_in_pieces:
        return strategy.gathered_state(model, rank)
    return shards_written(out, get_model_state(model), rank)


def shards_written(out: Path | None, state: dict[str, Any], rank: int, *,
                   names: list[str] | None = None,
                   row_orders: dict[str, Any] | None = None) -> ShardedFinal | None:
    """``state`` (this rank's part of the model's state, as DCP is to write it) saved into
    ``OUT/final.dcp`` (:func:`save_final_shards`, collective); for rank 0 the folder to export,
    None elsewhere and without ``OUT``."""
    if out is None:
        return None
    folder = save_final_shards(out, state, names=names, row_orders=row_orders)
    return ShardedFinal(folder) if rank == 0 else None


def get_model_state(model: nn.Module) -> dict[str, Any]:
    """``model``'s state dict as DCP saves it (each rank its shards)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model)


def write_final(state: dict[str, torch.Tensor] | ShardedFinal, target: Path) -> None:
    """Write ``final.pt``: a whole state dict at once, or exported from its shards."""
    if isinstance(state, ShardedFinal):
        export_final(state.folder, target)
    else:
        save_atomic(state, target)


def save_final_shards(out: Path, state: dict[str, Any], *, names: list[str] | None = None,
                      row_orders: dict[str, Any] | None = None) -> Path:
    """Write ``state`` (each rank its own part: shards, or whole tensors under the model's own
    names) into ``OUT/final.dcp`` (collective), with rank 0's ``names`` (default: its state's)
    in the model's order and the ``row_orders`` of a tensor-parallel model's ``heads`` layers
    (outputs saved in its shares' order); returns the folder."""
    from torch.distributed.checkpoint.state_dict_saver import save

    folder = out / FINAL_SHARDS
    save({"model": state}, checkpoint_id=str(folder))
    if dist.get_rank() == 0:  # DCP's metadata keeps its own order; final.pt keeps the model's
        write_text(folder / NAMES, json.dumps({"names": list(state) if names is None else names,
                                              "row_orders": row_orders or {}}))
    return folder


def export_final(folder: Path, target: Path) -> Exported:
    """Write ``target`` (a plain ``state_dict`` file) from the final shards in ``folder``, one
    tensor at a time (see the module docstring)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not (folder / ".metadata").is_file():
        raise UsageError(f"{folder} holds no final shards (no .metadata); export a run directory "
                         f"that a sharded run (--shard) finished in")
    entries = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    listed: dict[str, Any] = (json.loads((folder / NAMES).read_text())
                              if (folder / NAMES).is_file()
                              else {"names": [key.removeprefix("model.") for key in entries]})
    names: list[str] = listed["names"]
    orders: dict[str, Any] = listed.get("row_orders", {})
    shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
    skipped = []
    for name in names:
        entry = entries[f"model.{name}"]
        if isinstance(entry, TensorStorageMetadata):
            shapes[name] = (entry.size, entry.properties.dtype)
        else:
            skipped.append(name)
    partial = target.with_name(target.name + ".partial")
    skeleton = {name: torch.empty(size, dtype=dtype) for name, (size, dtype) in shapes.items()}
    with torch.serialization.skip_data():  # untouched tensors: no memory, room in the file
        torch.save(skeleton, partial)
    del skeleton
    offsets = _record_offsets(partial)
    largest = total = 0
    with open(partial, "r+b") as file:
        for index, (name, (size, dtype)) in enumerate(shapes.items()):
            tensor = _load_one(folder, name, size, dtype)
            if name in orders:  # a heads layer's outputs, in the model's order again
                tensor = _natural(tensor, orders[name])
            data = memoryview(cast(Any, tensor.reshape(-1).view(torch.uint8).numpy()))
            offset, length = offsets[str(index)]
            if length != len(data):
                raise RuntimeError(f"export of {name}: the skeleton holds {length} bytes for it, "
                                   f"the shards {len(data)}")
            written = 0
            while written < len(data):  # a large write may be split
                written += os.pwrite(file.fileno(), data[written:], offset + written)
            largest, total = max(largest, len(data)), total + len(data)
            del tensor, data
        os.fsync(file.fileno())
    os.replace(partial, target)
    return Exported(num_tensors=len(shapes), num_bytes=total, largest_tensor_bytes=largest,
                    skipped=skipped)


def _natural(tensor: torch.Tensor, order: int | dict[str, int]) -> torch.Tensor:
    """``tensor`` with the outputs a tensor-parallel run saved in its shares' order put back
    (``order``: its degree, or ``{"degree": T, "dim": D}``)."""
    from tandem.runtime.tensor_parallel import natural_order

    degree, dim = (order, 0) if isinstance(order, int) else (order["degree"], order["dim"])
    return natural_order(tensor, degree, dim)


def _load_one(folder: Path, name: str, size: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Tensor ``name`` of the final shards, joined whole (one process, no process group)."""
    from torch.distributed.checkpoint.state_dict_loader import load

    tensor = torch.empty(size, dtype=dtype)
    state: dict[str, Any] = {"model": {name: tensor}}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        load(state, checkpoint_id=str(folder), no_dist=True)
    return tensor


def _record_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """Where each storage record (``.../data/KEY``) of a ``torch.save`` file starts, and its
    length: the record's data follows its zip local header, name and extra field (torch pads
    the extra field to align the data)."""
    offsets = {}
    with zipfile.ZipFile(path) as archive, open(path, "rb") as file:
        for info in archive.infolist():
            head, _, key = info.filename.rpartition("/")
            if not head.endswith("/data") and head != "data":
                continue
            file.seek(info.header_offset)
            header = file.read(LOCAL_HEADER_BYTES)
            name_length, extra_length = struct.unpack("<HH", header[26:30])
            start = info.header_offset + LOCAL_HEADER_BYTES + name_length + extra_length
            offsets[key] = (start, info.file_size)
    return offsets
