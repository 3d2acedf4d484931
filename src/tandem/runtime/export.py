"""``final.pt`` written from a run's final shards a few tensors at a time, so that no process
ever holds the whole model: at the end of a sharded, tensor-parallel or pipeline run, and by
``tandem export RUN_DIR``.

Usage::

    save_final_shards(out, get_model_state(model))         # collective: OUT/final.dcp
    export_final(out / "final.dcp", out / "final.pt")      # one process, a batch at a time

The sharded run (FSDP2, tensor parallelism, or both) writes its model's state through
``torch.distributed.checkpoint`` (each rank its own shards, under the model's own names) into
``OUT/final.dcp``, with ``names.json`` (the names in the model's order, and which ``heads``
layers hold their outputs in the shares' order). :func:`export_final` reads
that folder's metadata, writes a ``torch.save`` file of the whole state whose tensors' bytes are
left unwritten (``torch.serialization.skip_data``: the skeleton's tensors are allocated but never
touched, so they take no memory), then loads the tensors from the folder a batch of at most
:data:`BATCH_BYTES` at a time (a larger tensor alone; DCP joins its shards), writes each one's
bytes where the skeleton left room for them, and sets each record's CRC-32. The result is a plain
``state_dict`` that ``torch.load`` reads; it is written beside the target and renamed over it
once complete. Tensors only: a module's non-tensor extra state is left out and counted.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from tandem.errors import OutputWarning, UsageError
from tandem.output_files import write_failure, write_text
from tandem.runtime.checkpoint import save_atomic

if TYPE_CHECKING:
    from tandem.sync import SyncStrategy

FINAL_SHARDS = "final.dcp"
"""The folder of a sharded run's final model shards in ``OUT``."""
NAMES = "names.json"
"""Beside the shards: the model's state-dict names in its own order."""
LOCAL_HEADER_BYTES = 30
"""Bytes of a zip local file header before its name and extra field."""
CENTRAL_HEADER_BYTES = 46
"""Bytes of a zip central-directory entry before its name, extra field and comment."""
DATA_DESCRIPTOR_FLAG = 0x8
DATA_DESCRIPTOR_SIGNATURE = b"PK\x07\x08"
BATCH_BYTES = 256 * 2**20
"""The most bytes of tensors one load joins from the shards (a larger tensor is loaded alone)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Exported:
    """What :func:`export_final` wrote."""

    num_tensors: int
    num_bytes: int
    largest_tensor_bytes: int
    """The most bytes of tensors held at once: a batch joined from the shards (at most the
    batch size, or one larger tensor; twice a ``heads`` layer's while its outputs are put back
    in order)."""
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
                   names: list[str] | None = None) -> ShardedFinal | None:
    """``state`` (this rank's part of the model's state, as DCP is to write it) saved into
    ``OUT/final.dcp`` (:func:`save_final_shards`, collective); for rank 0 the folder to export,
    None elsewhere and without ``OUT``."""
    if out is None:
        return None
    folder = save_final_shards(out, state, names=names)
    if not _shared(folder):  # per-node --out: rank 0 said so; the run ends without final.pt
        return None
    return ShardedFinal(folder) if rank == 0 else None


def get_model_state(model: nn.Module) -> dict[str, Any]:
    """``model``'s state dict as DCP saves it (each rank its shards)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model)


def write_final(state: dict[str, torch.Tensor] | ShardedFinal | None, out: Path | None) -> None:
    """Write ``OUT/final.pt``: a whole state dict at once, or exported from its shards (nothing
    for None, or without ``OUT``)."""
    if isinstance(state, ShardedFinal):
        export_final(state.folder, state.folder.parent / "final.pt")
    elif state is not None and out is not None:
        save_atomic(state, out / "final.pt")


def save_final_shards(out: Path, state: dict[str, Any], *,
                      names: list[str] | None = None) -> Path:
    """Write ``state`` (each rank its own part: shards, or whole tensors under the model's own
    names, a tensor-parallel model's fused layers in the model's order) into ``OUT/final.dcp``
    (collective), with rank 0's ``names`` (default: its state's) in the model's order; returns
    the folder."""
    from tandem.runtime.sharded_checkpoint import write_shards

    folder = out / FINAL_SHARDS
    write_shards({"model": state}, folder, checksums=False)
    if dist.get_rank() == 0:  # DCP's metadata keeps its own order; final.pt keeps the model's
        write_text(folder / NAMES, json.dumps({"names": list(state) if names is None else names}))
    return folder


def _shared(folder: Path) -> bool:
    """Whether rank 0 sees every file the ranks wrote into ``folder`` (collective). Where it
    does not (each node its own ``--out``), rank 0 warns once, naming a missing file and how to
    assemble ``final.pt`` from the nodes' shards: the training itself is whole."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    missing: list[Any] = [None]
    if dist.get_rank() == 0:
        storage = FileSystemReader(str(folder)).read_metadata().storage_data
        files = sorted({info.relative_path for info in storage.values()})
        missing[0] = [name for name in files if not (folder / name).is_file()]
    dist.broadcast_object_list(missing, src=0)
    if missing[0] and dist.get_rank() == 0:
        warnings.warn(f"final.pt not written: rank 0 cannot read {', '.join(missing[0][:3])} in "
                      f"{folder}, which other nodes wrote to their own --out; copy each node's "
                      f"{FINAL_SHARDS} files into it and run tandem export {folder.parent} (or "
                      f"give every node one shared --out)", OutputWarning, stacklevel=2)
    return not missing[0]


def export_final(folder: Path, target: Path, *, batch_bytes: int = BATCH_BYTES) -> Exported:
    """Write ``target`` (a plain ``state_dict`` file) from the final shards in ``folder``, a
    batch of at most ``batch_bytes`` of tensors (or one larger tensor) at a time (see the
    module docstring)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not (folder / ".metadata").is_file():
        raise UsageError(f"{folder} holds no final shards (no .metadata); export the --out of a "
                         f"finished sharded, tensor-parallel or pipeline run")
    entries = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    listed: dict[str, Any] = (json.loads((folder / NAMES).read_text())
                              if (folder / NAMES).is_file()
                              else {"names": [key.removeprefix("model.") for key in entries]})
    shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
    skipped = []
    for name in listed["names"]:
        entry = entries[f"model.{name}"]
        if isinstance(entry, TensorStorageMetadata):
            shapes[name] = (entry.size, entry.properties.dtype)
        else:
            skipped.append(name)
    partial = target.with_name(target.name + ".partial")
    try:
        largest, total = _write_skeleton_then_tensors(folder, partial, shapes,
                                                      batch_bytes)
        os.replace(partial, target)
    except BaseException as exc:
        partial.unlink(missing_ok=True)
        if isinstance(exc, OSError) and Path(exc.filename or partial).parent != folder:
            raise write_failure(target, exc) from None  # not a read of the shards
        raise
    return Exported(num_tensors=len(shapes), num_bytes=total, largest_tensor_bytes=largest,
                    skipped=skipped)


def _write_skeleton_then_tensors(folder: Path, path: Path,
                                 shapes: dict[str, tuple[torch.Size, torch.dtype]],
                                 batch_bytes: int) -> tuple[int, int]:
    """``path``: a ``torch.save`` file of ``shapes`` whose room is reserved, then filled with
    the tensors loaded from ``folder`` a batch of at most ``batch_bytes`` (or one tensor) at a
    time, each record's CRC-32 set; returns the most bytes held at once and the total."""
    skeleton = {name: torch.empty(size, dtype=dtype) for name, (size, dtype) in shapes.items()}
    with torch.serialization.skip_data():  # untouched tensors: no memory, room in the file
        torch.save(skeleton, path)
    del skeleton
    records = _records(path)
    keys = {name: str(index) for index, name in enumerate(shapes)}  # torch.save's storage order
    held = total = 0
    crcs: dict[str, int] = {}
    with open(path, "r+b") as file:
        for batch in _batches(shapes, batch_bytes):
            loaded = _load(folder, {name: shapes[name] for name in batch})
            held = max(held, sum(t.numel() * t.element_size() for t in loaded.values()))
            for name, tensor in loaded.items():
                data = memoryview(cast(Any, tensor.reshape(-1).view(torch.uint8).numpy()))
                record = records[keys[name]]
                if record.length != len(data):
                    raise RuntimeError(f"export of {name}: the skeleton holds {record.length} "
                                       f"bytes for it, the shards {len(data)}")
                written = 0
                while written < len(data):  # a large write may be split
                    written += os.pwrite(file.fileno(), data[written:], record.start + written)
                crcs[keys[name]] = zlib.crc32(data)
                total += len(data)
            del loaded
        _set_crcs(file, records, crcs)
        os.fsync(file.fileno())
    return held, total


def _batches(shapes: dict[str, tuple[torch.Size, torch.dtype]],
             batch_bytes: int) -> list[list[str]]:
    """The tensors in order, in batches of at most ``batch_bytes`` (a larger one alone): one
    DCP load per batch, not per tensor (each reads the folder's metadata)."""
    batches: list[list[str]] = []
    size = 0
    for name, (shape, dtype) in shapes.items():
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        if not batches or size + nbytes > batch_bytes:
            batches.append([])
            size = 0
        batches[-1].append(name)
        size += nbytes
    return batches


def _load(folder: Path, shapes: dict[str, tuple[torch.Size, torch.dtype]]
          ) -> dict[str, torch.Tensor]:
    """The tensors ``shapes`` names, each joined whole from the final shards (one process, no
    process group)."""
    from torch.distributed.checkpoint.state_dict_loader import load

    tensors = {name: torch.empty(size, dtype=dtype) for name, (size, dtype) in shapes.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        load({"model": tensors}, checkpoint_id=str(folder), no_dist=True)
    return tensors


@dataclasses.dataclass(frozen=True, slots=True)
class _Record:
    """A storage record of a ``torch.save`` zip file."""

    header: int
    """Offset of its local header."""
    start: int
    """Offset of its data."""
    length: int
    central: int
    """Offset of its central-directory entry."""


def _records(path: Path) -> dict[str, _Record]:
    """The storage records (``.../data/KEY``) of a ``torch.save`` file by key: stored
    uncompressed, each one's data after its local header, name and extra field (torch pads the
    extra field to align the data)."""
    records = {}
    with zipfile.ZipFile(path) as archive, open(path, "rb") as file:
        central = archive.start_dir
        for info in archive.infolist():
            file.seek(central)
            entry = file.read(CENTRAL_HEADER_BYTES)
            here = central
            central += CENTRAL_HEADER_BYTES + sum(struct.unpack("<HHH", entry[28:34]))
            head, _, key = info.filename.rpartition("/")
            if not head.endswith("/data") and head != "data":
                continue
            if info.compress_type != zipfile.ZIP_STORED:
                raise RuntimeError(f"{path}: record {info.filename} is compressed; torch.save "
                                   f"stores its records, and the export relies on it")
            file.seek(info.header_offset)
            header = file.read(LOCAL_HEADER_BYTES)
            name_length, extra_length = struct.unpack("<HH", header[26:30])
            start = info.header_offset + LOCAL_HEADER_BYTES + name_length + extra_length
            records[key] = _Record(header=info.header_offset, start=start,
                                   length=info.file_size, central=here)
    return records


def _set_crcs(file: Any, records: dict[str, _Record], crcs: dict[str, int]) -> None:
    """Write each record's CRC-32 where zip readers check it: its central-directory entry, and
    its data descriptor after the data (torch's writer sets flag bit 3) or else its local
    header; ``skip_data`` left them 0."""
    for key, crc in crcs.items():
        record, value = records[key], struct.pack("<I", crc)
        file.seek(record.header + 6)
        (flags,) = struct.unpack("<H", file.read(2))
        if flags & DATA_DESCRIPTOR_FLAG:
            end = record.start + record.length
            file.seek(end)
            signed = file.read(4) == DATA_DESCRIPTOR_SIGNATURE
            os.pwrite(file.fileno(), value, end + (4 if signed else 0))
        else:
            os.pwrite(file.fileno(), value, record.header + 14)
        os.pwrite(file.fileno(), value, record.central + 16)
