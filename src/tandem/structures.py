"""Batches of any structure: tensors, or tuples, lists and dicts of them, with the batch in dim 0.

A user's dataset may give a sample as ``(input, target)`` where either part is a tensor or a
nested structure of tensors (``{"input_ids": ..., "attention_mask": ...}``); a model's output
may be a tensor, a tuple, a dict or a Hugging Face ``ModelOutput``. These helpers move, cut and
feed such structures the same way wherever tandem touches a batch.

Usage::

    inputs = to_device(batch.inputs, device)
    for part in split_batch(inputs, 4):           # micro-batches
        output = call_model(model, part)         # model(x), model(*x) or model(**x)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree


def to_device(tree: Any, device: torch.device, *, non_blocking: bool = False) -> Any:
    """``tree`` with every tensor moved to ``device`` (other leaves kept); ``non_blocking``
    from pinned memory to a GPU."""
    return pytree.tree_map(lambda x: x.to(device, non_blocking=non_blocking)
                           if isinstance(x, torch.Tensor) else x, tree)


def tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors of ``tree``, in a fixed (flattening) order."""
    return [leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def batch_size(tree: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (0 for none)."""
    found = tensors(tree)
    return int(found[0].shape[0]) if found and found[0].dim() else 0


def take(tree: Any, index: torch.Tensor | slice | int) -> Any:
    """The rows ``index`` of every tensor of ``tree`` (one row, without its dimension, for an
    ``int``)."""
    return pytree.tree_map(lambda x: x[index] if isinstance(x, torch.Tensor) else x, tree)


def split_batch(tree: Any, parts: int) -> list[Any]:
    """Cut a batch into ``parts`` consecutive pieces along dim 0 (sizes differ by at most one,
    as ``torch.tensor_split``)."""
    if parts == 1:
        return [tree]
    size = batch_size(tree)
    bounds = [size * i // parts for i in range(parts + 1)]
    return [take(tree, slice(bounds[i], bounds[i + 1])) for i in range(parts)]


def call_model(model: torch.nn.Module, inputs: Any) -> Any:
    """``model(inputs)`` for a tensor, ``model(*inputs)`` for a tuple or list and
    ``model(**inputs)`` for a dict: the calling convention of a batch's inputs."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def logits_of(output: Any) -> torch.Tensor | None:
    """The logits in a model's output: the output itself if it is a tensor, else its ``logits``
    attribute or key (Hugging Face models), else its first element if that is a tensor; None
    when there is none."""
    if isinstance(output, torch.Tensor):
        return output
    found = getattr(output, "logits", None)
    if isinstance(found, torch.Tensor):
        return found
    found = output.get("logits") if isinstance(output, dict) else None
    if isinstance(found, torch.Tensor):
        return found
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def describe(tree: Any) -> str:
    """A short text of a structure's kind and tensor shapes, for messages."""
    if isinstance(tree, torch.Tensor):
        dtype = str(tree.dtype).removeprefix("torch.")
        article = "an" if dtype[0] in "aeiou" else "a"
        return f"{article} {dtype} tensor of shape {tuple(tree.shape)}"
    if isinstance(tree, dict):
        inner = ", ".join(f"{key!r}: {describe(value)}" for key, value in list(tree.items())[:4])
        return f"a dict {{{inner}}}"
    if isinstance(tree, (tuple, list)):
        inner = ", ".join(describe(value) for value in list(tree)[:4])
        return f"a {type(tree).__name__} ({inner})"
    return f"a {type(tree).__name__}"


class SkeletonMismatch(ValueError):
    """A value passed between blocks that does not have the structure, or the non-tensor
    leaves, of the one the pipeline was set up with."""


@dataclass(frozen=True, slots=True)
class Skeleton:
    """What a value passed between a model's blocks is besides its tensors: its structure
    (nested tuples, lists and dicts) and its other leaves (None, numbers, strings), which a
    pipeline keeps as the example it was set up with had them while it sends the tensors.

    Usage::

        skeleton = Skeleton.of(value)              # None for a tensor or a tuple of tensors
        tensors = skeleton.tensors_of(output)      # what is sent; the rest checked
        value = skeleton.fill(received)            # the structure again, around them
    """

    spec: pytree.TreeSpec
    leaves: tuple[Any, ...]
    """The example's leaves, None where a tensor goes."""
    slots: tuple[int, ...]
    """The positions of the tensors among the leaves."""

    @classmethod
    def of(cls, value: Any) -> Skeleton | None:
        """``value``'s skeleton; None for a tensor or a tuple of tensors, which pass as they
        are."""
        if isinstance(value, torch.Tensor) or (
                type(value) is tuple and all(isinstance(t, torch.Tensor) for t in value)):
            return None
        leaves, spec = pytree.tree_flatten(value)
        slots = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
        return cls(spec=spec, slots=slots, leaves=tuple(
            None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves))

    def fill(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The structure with ``tensors`` in its tensor slots, in order."""
        leaves = list(self.leaves)
        for slot, tensor in zip(self.slots, tensors, strict=True):
            leaves[slot] = tensor
        return pytree.tree_unflatten(leaves, self.spec)

    def tensors_of(self, value: Any) -> tuple[torch.Tensor, ...]:
        """``value``'s tensors, in order; :class:`SkeletonMismatch` if its structure or any
        other leaf differs from the skeleton's."""
        leaves, spec = pytree.tree_flatten(value)
        if spec != self.spec:
            raise SkeletonMismatch(f"{describe(value)} where the first sample gave "
                                   f"{describe(self.fill([torch.empty(0)] * len(self.slots)))}")
        found = tuple(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))
        for index, (leaf, kept) in enumerate(zip(leaves, self.leaves)):
            if index not in self.slots and (isinstance(leaf, torch.Tensor) or leaf != kept):
                raise SkeletonMismatch(f"{leaf!r} where the first sample gave {kept!r}")
        if len(found) != len(self.slots):
            raise SkeletonMismatch(f"{len(found)} tensors where the first sample gave "
                                   f"{len(self.slots)}")
        return found
