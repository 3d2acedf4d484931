"""Parameter groups by parameter name: ``--no-decay`` or a function of the user's, decided on
the whole model and applied to whatever part of it a worker holds.

A :class:`GroupPlan` names, for every parameter of the whole model (under each of its names,
for tied weights), the group it belongs to, and holds each group's options. Every worker's
optimizer then has every group, in the plan's order, with the parameters it holds (some
groups may be empty): a data-parallel replica all of them, an FSDP2 worker or a
tensor-parallel one its shares of them (found by the same names), a pipeline stage those of its
blocks, a parameter server those of its shard. The groups being the same on every worker, a
checkpoint's groups match by position on any layout.

``--no-decay`` (any of ``norm``, ``bias``, ``embedding``) makes two groups: the rest, with
``--weight-decay``, then those it names, with weight decay 0:

- ``norm``: the parameters of normalization layers, modules that are instances of
  ``torch.nn``'s ``BatchNorm*``, ``SyncBatchNorm``, ``InstanceNorm*``, ``LayerNorm``,
  ``GroupNorm``, ``RMSNorm`` or ``LocalResponseNorm``, or whose class name ends in ``Norm``
  or ``Norm1d``/``Norm2d``/``Norm3d`` (``LlamaRMSNorm``, ``T5LayerNorm``); only the layer's own
  parameters (not those of modules inside it);
- ``bias``: every parameter whose name ends in ``bias`` (``fc.bias``, ``attn.in_proj_bias``);
- ``embedding``: the parameters of ``nn.Embedding`` and ``nn.EmbeddingBag`` layers (a weight
  tied to an embedding, such as a language model's output layer, is one with it).

In Python, ``tandem.fit(..., param_groups=fn)`` gives the groups as ``fn(model)`` returns
them, a list of dicts as ``torch.optim`` takes, over the model given (each ``params`` a list of
its parameters, their names, or ``(name, parameter)`` pairs)::

    def groups(model):
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
        rest = [p for n, p in model.named_parameters() if p.ndim < 2]
        return [{"params": decay}, {"params": rest, "weight_decay": 0.0}]

Every parameter that requires a gradient must be in exactly one group; frozen ones
(``requires_grad=False``) may be left out (they join the first group, and never step).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from tandem.errors import UsageError
from tandem.spec.optimizer import no_decay_kinds

NORM_LAYERS: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()))
"""``torch.nn``'s normalization layers (``_NormBase``: batch, sync-batch and instance norms)."""
_NORM_NAME = re.compile(r"Norm([123]d)?$")
"""A normalization layer's class name, for users' and libraries' own (``LlamaRMSNorm``)."""
MAX_NAMED = 3
"""Parameters named in one line at most."""

GroupsFn = Callable[[nn.Module], Iterable[dict[str, Any]]]
"""``param_groups(model)``: the user's groups (see the module docstring)."""


@dataclasses.dataclass(frozen=True, slots=True)
class GroupPlan:
    """Every parameter's group, by name, and the groups' options (besides their ``params``)."""

    options: tuple[dict[str, Any], ...]
    """Each group's options (``{"weight_decay": 0.0}``), in order."""
    index: dict[str, int]
    """Group of each parameter, under every name the whole model gives it."""

    def assign(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[dict[str, Any]]:
        """``torch.optim`` groups of the parameters a worker holds, as ``(name, tensor)`` under
        the whole model's names: every group, in order, even where it holds none of them."""
        groups: list[dict[str, Any]] = [{"params": [], **options} for options in self.options]
        for name, tensor in named:
            if name not in self.index:
                raise KeyError(f"parameter {name!r} is not one the groups were planned on "
                               f"(the whole model's names: {sorted(self.index)[:MAX_NAMED]}...)")
            groups[self.index[name]]["params"].append(tensor)
        return groups


def group_plan(config: Any, model: nn.Module, user_groups: GroupsFn | None) -> GroupPlan | None:
    """The run's groups over ``model`` (the whole model, under its own names): the user's
    (``user_groups``), ``--no-decay``'s (``config.no_decay``), or None for one group."""
    if user_groups is not None:
        if config.no_decay:
            raise UsageError(f"--no-decay {config.no_decay} and param_groups both make the "
                             f"parameter groups; give one (put the weight decay in your groups)")
        return user_plan(model, user_groups)
    if config.no_decay:
        return no_decay_plan(model, no_decay_kinds(config.no_decay))
    return None


def is_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a normalization layer (see the module docstring)."""
    return isinstance(module, NORM_LAYERS) or bool(_NORM_NAME.search(type(module).__name__))


def _names_by_tensor(model: nn.Module) -> dict[int, list[str]]:
    """Every name of each of ``model``'s parameters (several for a tied weight), by identity."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def no_decay_plan(model: nn.Module, kinds: tuple[str, ...]) -> GroupPlan:
    """Two groups: the parameters ``kinds`` do not name, then those they do (weight decay 0)."""
    excluded: set[int] = set()
    for _, module in model.named_modules(remove_duplicate=False):
        own = list(module.parameters(recurse=False))
        if ("norm" in kinds and is_norm(module)) or (
                "embedding" in kinds and isinstance(module, (nn.Embedding, nn.EmbeddingBag))):
            excluded.update(id(p) for p in own)
    if "bias" in kinds:
        excluded.update(id(p) for name, p in model.named_parameters(remove_duplicate=False)
                        if name.endswith("bias"))
    index = {name: int(key in excluded)
             for key, names in _names_by_tensor(model).items() for name in names}
    return GroupPlan(options=({}, {"weight_decay": 0.0}), index=index)


def user_plan(model: nn.Module, user_groups: GroupsFn) -> GroupPlan:
    """The groups ``user_groups(model)`` returns, by name; one line for a group that is not a
    dict with ``params``, a tensor that is not the model's, a name it does not have, a
    parameter in two groups, and a trainable one in none."""
    returned = user_groups(model)
    if isinstance(returned, dict) or not isinstance(returned, Iterable):
        raise UsageError(f"param_groups(model) returned {type(returned).__name__}; return a "
                         f"list of dicts as torch.optim takes, e.g. [{{'params': decay}}, "
                         f"{{'params': rest, 'weight_decay': 0.0}}]")
    names = _names_by_tensor(model)
    by_name = {name: key for key, all_names in names.items() for name in all_names}
    owner: dict[int, int] = {}
    options: list[dict[str, Any]] = []
    for number, group in enumerate(returned):
        if not isinstance(group, dict) or "params" not in group:
            raise UsageError(f"param_groups(model): group {number} is "
                             f"{type(group).__name__}, not a dict with 'params'; e.g. "
                             f"{{'params': [...], 'weight_decay': 0.0}}")
        for item in _as_list(group["params"]):
            key = _identify(item, names, by_name, number)
            if key in owner:
                raise UsageError(f"param_groups(model): parameter {names[key][0]!r} is in "
                                 f"groups {owner[key]} and {number}; put it in one")
            owner[key] = number
        options.append({k: v for k, v in group.items() if k != "params"})
    if not options:
        raise UsageError("param_groups(model) returned no groups; return at least one, e.g. "
                         "[{'params': list(model.parameters())}]")
    params = {id(p): p for p in model.parameters()}
    left = [names[key][0] for key, p in params.items() if key not in owner and p.requires_grad]
    if left:
        more = f" and {len(left) - MAX_NAMED} more" if len(left) > MAX_NAMED else ""
        raise UsageError(f"param_groups(model) leaves out {', '.join(left[:MAX_NAMED])}{more}, "
                         f"which train; add them to a group (e.g. a last group of the rest), "
                         f"or set requires_grad=False on them")
    index = {name: owner.get(key, 0) for key, all_names in names.items() for name in all_names}
    return GroupPlan(options=tuple(options), index=index)


def _as_list(params: Any) -> list[Any]:
    """A group's ``params``: one tensor or any iterable of them (a generator too)."""
    if isinstance(params, (torch.Tensor, str)):
        return [params]
    return list(params)


def _identify(item: Any, names: dict[int, list[str]], by_name: dict[str, int],
              number: int) -> int:
    """The identity of the model's parameter that ``item`` (a tensor, a name or a ``(name,
    tensor)`` pair) stands for; one line if it is none of the model's."""
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
        item = item[1]
    if isinstance(item, str):
        if item not in by_name:
            close = difflib.get_close_matches(item, list(by_name), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UsageError(f"param_groups(model): group {number} names {item!r}, which is no "
                             f"parameter of the model{hint}")
        return by_name[item]
    if not isinstance(item, torch.Tensor) or id(item) not in names:
        shown = (f"a tensor of shape {tuple(item.shape)}" if isinstance(item, torch.Tensor)
                 else type(item).__name__)
        raise UsageError(f"param_groups(model): group {number} holds {shown}, which is not a "
                         f"parameter of the model it was given; return that model's own "
                         f"parameters (or their names)")
    return id(item)
