"""A tensor-parallel layer's tensors handed to ``torch.distributed.checkpoint`` (DCP) in the
model's own order, so that a checkpoint reads back on any layout: another tensor degree, sharded
or plain data parallelism, or a pipeline stage.

A split fused query/key/value layer holds its outputs in its shares' order (each worker's
queries, keys and values together, :func:`~tandem.runtime.tensor_parallel.heads_order`), so a
worker's rows are not one block of the layer in its own order but three (one each of queries,
keys and values). :class:`NaturalRows` gives DCP those blocks, each a view of the worker's own
tensor, as chunks of the layer in the model's order (DCP's checkpointable hooks), and
:func:`save_planner` and :func:`load_planner` resolve DCP's reads and writes of a chunk to its
view: saving writes the model's order, loading reads whatever chunks this layout holds, in
place. A ``channels`` convolution's share (a block of rows in rank order, possibly sharded again
by FSDP2) is one chunk (:meth:`NaturalRows.row_share`). :func:`copy_from_whole` fills the same
state from whole tensors (a checkpoint of a run that held the whole model).

Usage::

    state["model"][name] = NaturalRows(parameter, degree, dim)   # before DCP's save or load
    state["model"][conv] = NaturalRows.row_share(rows, rank, degree)
    save(state, storage_writer=..., planner=save_planner())
    load(state, checkpoint_id=..., planner=load_planner())
    copy_from_whole(state, whole_state)    # or: each rank's parts of a whole checkpoint's tensors
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, MetadataIndex, TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from tandem.errors import UsageError
from tandem.runtime.tensor_parallel import heads_order


class NaturalRows:
    """``tensor`` (a DTensor share of a ``heads`` layer's weight or bias, possibly sharded again
    over replicas, or one worker's whole tensor), its outputs along ``dim`` in the order of
    ``degree`` tensor-parallel shares, shown to DCP as chunks of the tensor in the model's own
    order; each chunk is a view of the worker's local tensor."""

    def __init__(self, tensor: torch.Tensor, degree: int, dim: int = 0) -> None:
        self.global_size = torch.Size(tensor.shape)
        local, offsets = _local_part(tensor)
        first, count = offsets[dim], local.shape[dim]
        natural = heads_order(self.global_size[dim], degree)[first : first + count]
        # a new chunk wherever the next row is not the one after this one in the model's order
        starts = [0, *(torch.nonzero(natural.diff() != 1).flatten() + 1).tolist()]
        self.chunks: dict[torch.Size, torch.Tensor] = {}
        for start, end in zip(starts, [*starts[1:], count]):
            if end > start:
                at = list(offsets)
                at[dim] = int(natural[start])
                self.chunks[torch.Size(at)] = local.narrow(dim, start, end - start)

    @classmethod
    def row_share(cls, tensor: torch.Tensor, rank: int, degree: int) -> NaturalRows:
        """``tensor`` as one chunk of the whole: the ``rank``-th of ``degree`` equal blocks of
        rows (a ``channels`` convolution's share, in rank order), held whole or sharded again by
        FSDP2 over a stage's replicas (a DTensor; its rows lie at its shard's offset within the
        block). An empty shard (more replicas than rows) gives no chunk."""
        local, offsets = _local_part(tensor)
        share = cls.__new__(cls)
        share.global_size = torch.Size((tensor.shape[0] * degree, *tensor.shape[1:]))
        at = torch.Size((offsets[0] + rank * tensor.shape[0], *offsets[1:]))
        share.chunks = {at: local} if local.numel() else {}
        return share

    def size(self) -> torch.Size:
        """The whole tensor's size (DCP checks it against the checkpoint's)."""
        return self.global_size

    def __create_write_items__(self, fqn: str, _object: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=offsets, sizes=view.shape),
                              properties=TensorProperties.create_from_tensor(view),
                              size=self.global_size))
                for offsets, view in self.chunks.items()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=view.shape)
                for offsets, view in self.chunks.items()]

    def chunk(self, index: MetadataIndex) -> torch.Tensor:
        """The view of the chunk DCP's ``index`` names (by its offsets)."""
        if index.offset is None or torch.Size(index.offset) not in self.chunks:
            raise ValueError(f"{index.fqn} holds no chunk at {index.offset}")
        return self.chunks[torch.Size(index.offset)]


PLACEHOLDER = "<tandem: NaturalRows standing aside>"
"""What stands in a state for a :class:`NaturalRows` while DCP's load planner is set up."""


class _NaturalSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, writing a :class:`NaturalRows`'s chunks from its views."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, NaturalRows):
            return value.chunk(index)
        return super().lookup_object(index)


class _NaturalLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading a :class:`NaturalRows`'s chunks into its views."""

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None,
                       is_coordinator: bool = False) -> None:
        # DCP's set-up gives meta tensors storage and replaces every object it does not know
        # with None, in place: the views stand aside (as PLACEHOLDER, a string it keeps)
        # meanwhile, then take their places in the state and in its flattened copy again
        held: dict[tuple[Any, ...], NaturalRows] = {}

        def stand_aside(state: dict[Any, Any], path: tuple[Any, ...]) -> None:
            for key, value in state.items():
                if isinstance(value, NaturalRows):
                    held[(*path, key)] = value
                    state[key] = PLACEHOLDER
                elif isinstance(value, dict):
                    stand_aside(value, (*path, key))

        stand_aside(state_dict, ())
        super().set_up_planner(state_dict, metadata, is_coordinator)
        for path, value in held.items():
            owner = state_dict
            for key in path[:-1]:
                owner = owner[key]
            owner[path[-1]] = value
        for flat, path in self.mappings.items():
            if tuple(path) in held:
                self.state_dict[flat] = held[tuple(path)]

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, NaturalRows):
            return value.chunk(index)
        return super().lookup_tensor(index)


def save_planner() -> DefaultSavePlanner:
    """A planner for one DCP save of a state that may hold :class:`NaturalRows` (DCP's default
    one where it holds none)."""
    return _NaturalSavePlanner()


def load_planner() -> DefaultLoadPlanner:
    """A planner for one DCP load of a state that may hold :class:`NaturalRows`."""
    return _NaturalLoadPlanner()


def local_chunks(value: Any) -> list[tuple[torch.Size, torch.Tensor]]:
    """Where in the whole tensor each part of ``value`` that this rank holds lies: the offsets
    and a view of each chunk (a :class:`NaturalRows`'s chunks, a DTensor's local shard, a plain
    tensor whole)."""
    if isinstance(value, NaturalRows):
        return list(value.chunks.items())
    local, offsets = _local_part(value)
    return [(torch.Size(offsets), local)]


def _local_part(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The part of ``tensor`` this rank holds and where it lies in the whole (a DTensor's local
    shard; a plain tensor whole, at the origin)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if isinstance(tensor, DTensor):
        _, offsets = compute_local_shape_and_global_offset(
            tensor.shape, tensor.device_mesh, tensor.placements)
        return tensor.to_local(), tuple(offsets)
    return tensor, (0,) * tensor.dim()


def copy_from_whole(held: dict[str, Any], whole: dict[str, Any], where: str = "") -> None:
    """Copy into each tensor of ``held`` (nested dicts as DCP is given them: whole tensors,
    DTensors, :class:`NaturalRows`) its part of the whole tensor under the same keys in
    ``whole``, and set its other values (an optimizer's scalar ``step``) to ``whole``'s; one
    line for a tensor whose whole size differs (``where``: the path, for the message)."""
    for key, value in list(held.items()):
        if key not in whole:
            continue
        name = f"{where}.{key}" if where else str(key)
        if isinstance(value, dict):
            copy_from_whole(value, whole[key], name)
        elif isinstance(value, (torch.Tensor, NaturalRows)):
            _copy_parts(value, whole[key], name)
        else:
            held[key] = whole[key]


def _copy_parts(held: torch.Tensor | NaturalRows, whole: Any, name: str) -> None:
    """Each part of ``whole`` that ``held`` holds, copied into it."""
    size = held.size() if isinstance(held, NaturalRows) else held.shape
    if not isinstance(whole, torch.Tensor) or tuple(whole.shape) != tuple(size):
        found = tuple(whole.shape) if isinstance(whole, torch.Tensor) else type(whole).__name__
        raise UsageError(f"the checkpoint's {name} is {found}, and this run's is {tuple(size)}; "
                         f"resume with the model and optimizer it was saved from")
    with torch.no_grad():
        for offsets, view in local_chunks(held):
            part = whole[tuple(slice(at, at + size) for at, size in zip(offsets, view.shape))]
            view.copy_(part.to(view.dtype))
