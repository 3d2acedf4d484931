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

from typing import Any

import torch
from torch.utils import _pytree as pytree


def to_device(tree: Any, device: torch.device) -> Any:
    """``tree`` with every tensor moved to ``device`` (other leaves kept)."""
    return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, tree)


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
