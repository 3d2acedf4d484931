"""A model built on the meta device given storage one module at a time, each initialized as the
model built whole would be, so that a worker never holds more than its shards and one module.

Usage::

    init = Initializer(seed=3, by_name=False)        # a user's builder: reset_parameters in order
    with torch.device("meta"):
        model = builder()
    materialize(model, init, device, done=shard_unit, units=["blocks.0", "blocks.1"])

Modules that hold state are taken in ``named_modules`` order. Each gets storage on the CPU,
filled with NaN (integers with their most negative value, booleans with False), and is
initialized there (CPU generators draw the same numbers on every
machine): a built-in model's modules by :func:`tandem.models.init.reset_module` under the seed
of their names; a user's model by each module's ``reset_parameters``, or the user's
``init_fn(module)`` (or ``init_fn(module, name)``), in order after the global generator is
seeded with the run's seed. With ``reset_parameters`` that is what a model built whole draws in
its constructors when they initialize that way, as ``torch.nn``'s layers do; with ``init_fn``,
what the model built whole and then initialized module by module holds. A value still NaN (or
the most negative integer) after that is one line naming the module and tensor; a boolean
buffer its initializer does not set is False on every worker. The module then moves to ``device``; when
the last module of a unit is done, ``done(unit)`` shards it (``fully_shard`` keeps this
worker's shard and drops the rest), the innermost unit first, the whole model (``""``) last.
A worker so holds its shards, the modules of units not yet complete, and those of the whole
model's own unit (embeddings, output layer) until the end.

A parameter shared by two modules (tied weights) gets each module's initialization in turn, so
it ends with the last one's, as a model built whole and then initialized module by module does;
for a model whose constructor ties its weights, that equals the model built whole when the tie
takes the later module's tensor (``self.embed.weight = self.head.weight``, nanoGPT's way).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from tandem.errors import UsageError
from tandem.models.init import owns_state, reset_module

ModuleInit = Callable[..., None]
"""A user's ``init_fn(module)`` or ``init_fn(module, name)`` (``name`` as ``named_modules``
gives it): initializes one module's own parameters and buffers."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Initializer:
    """How each module of a model built in pieces is initialized."""

    seed: int
    """The run's seed."""
    by_name: bool
    """Each module under the seed of its name (a built-in model); else in order from the global
    generator seeded once with ``seed`` (a user's model)."""
    function: ModuleInit | None = None
    """A user's ``init_fn(module)``; None: the module's own ``reset_parameters``."""

    def begin(self) -> None:
        """Seed the global generator (a user's model: the draws follow one another)."""
        if not self.by_name:
            torch.manual_seed(self.seed)

    def __call__(self, name: str, module: nn.Module) -> None:
        """Initialize ``module`` (named ``name`` in the whole model), on the CPU."""
        if self.by_name:
            reset_module(module, self.seed, name)
            return
        if self.function is not None:
            with torch.no_grad():
                if _takes_name(self.function):
                    self.function(module, name)
                else:
                    self.function(module)
            return
        reset = getattr(module, "reset_parameters", None)
        if reset is None:
            raise UsageError(
                f"module {name or '(the model)'!r} ({type(module).__name__}) holds weights but "
                f"has no reset_parameters, so the model cannot be built in pieces; give "
                f"--init-fn package.module:function (init_fn= in tandem.fit) that initializes "
                f"one module, or drop --init-fn to build the model whole on every worker")
        with torch.no_grad():
            reset()


def _takes_name(function: ModuleInit) -> bool:
    """Whether ``function`` needs a second positional argument (the module's name): one
    without a default."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: one argument
        return False
    required = [p for p in parameters if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) >= 2  # init(module, std=0.02) takes the module alone


def on_meta(module: nn.Module) -> bool:
    """Whether any of ``module``'s parameters or buffers is on the meta device (no storage)."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


@dataclasses.dataclass(slots=True)
class PieceStats:
    """What building in pieces held at most."""

    peak_whole_bytes: int = 0
    """The most bytes of whole (not yet sharded) tensors held at once."""


def materialize(model: nn.Module, init: Initializer, device: torch.device, *,
                units: Sequence[str] = (), done: Callable[[str], None] | None = None
                ) -> PieceStats:
    """Give ``model`` (built on the meta device) storage on ``device`` one module at a time,
    initialized by ``init``; ``done(unit)`` is called as each of ``units`` (module names) and
    then the whole model (``""``) is complete. Returns what was held at most."""
    owners = [(name, module) for name, module in model.named_modules() if owns_state(module)]
    last = _last_members(owners, units)
    made: dict[int, torch.Tensor | None] = dict.fromkeys(_shared(owners))
    """Tensors held by several modules (tied weights): their storage once made (only these are
    kept, so that a sharded unit's whole tensors are freed)."""
    stats = PieceStats()
    held = 0
    init.begin()
    for index, (name, module) in enumerate(owners):
        held += _materialize_module(name, module, init, device, made)
        stats.peak_whole_bytes = max(stats.peak_whole_bytes, held)
        for unit in last.get(index, []):
            if done is not None:
                done(unit)
            held = _whole_bytes(model) if done is not None else held
    if done is not None:
        done("")
    return stats


def _shared(owners: list[tuple[str, nn.Module]]) -> list[int]:
    """The ids of the tensors that more than one of ``owners`` holds (tied weights)."""
    seen: dict[int, int] = {}
    for _, module in owners:
        for tensors in own_state(module):
            for tensor in tensors.values():
                if tensor is not None:
                    seen[id(tensor)] = seen.get(id(tensor), 0) + 1
    return [key for key, count in seen.items() if count > 1]


def _last_members(owners: list[tuple[str, nn.Module]],
                  units: Sequence[str]) -> dict[int, list[str]]:
    """For each position in ``owners``, the units whose last module it is, innermost first."""
    ends: dict[int, list[str]] = {}
    for unit in sorted(units, key=lambda u: -u.count(".")):
        inside = [i for i, (name, _) in enumerate(owners)
                  if name == unit or name.startswith(unit + ".")]
        if inside:
            ends.setdefault(inside[-1], []).append(unit)
    return ends


def _materialize_module(name: str, module: nn.Module, init: Initializer, device: torch.device,
                        made: dict[int, torch.Tensor | None]) -> int:
    """Storage for ``module``'s own meta tensors, initialized; returns the bytes it added.
    ``made`` maps each tied meta tensor to its new tensor once it has one."""
    tied: dict[str, torch.Tensor] = {}
    originals: dict[str, torch.Tensor] = {}
    for tensors in own_state(module):
        for key, tensor in tensors.items():
            if tensor is None or not tensor.is_meta:
                continue
            shared = made.get(id(tensor))
            if shared is not None:
                tied[key] = shared
            originals[key] = tensor
            fresh = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            fresh.fill_(_unset(fresh.dtype))
            tensors[key] = (nn.Parameter(fresh, tensor.requires_grad)
                            if isinstance(tensor, nn.Parameter) else fresh)
    if not originals:
        return 0
    init(name, module)
    added = 0
    for tensors in own_state(module):
        for key in [k for k in tensors if k in originals]:
            value = tensors[key]
            if _still_unset(value):
                raise UsageError(
                    f"{name + '.' if name else ''}{key} ({type(module).__name__}) is not set by "
                    f"its initializer, so the model cannot be built in pieces; give --init-fn "
                    f"package.module:function (init_fn= in tandem.fit) that sets it, or drop "
                    f"--init-fn to build the model whole on every worker")
            if key in tied:  # the shared tensor takes this module's values, and stays shared
                with torch.no_grad():
                    tied[key].copy_(value)
                tensors[key] = tied[key]
                continue
            with torch.no_grad():
                moved = value.to(device)
            tensors[key] = (nn.Parameter(moved, value.requires_grad)
                            if isinstance(value, nn.Parameter) else moved)
            if id(originals[key]) in made:
                made[id(originals[key])] = tensors[key]
            added += value.numel() * value.element_size()
    return added


def _unset(dtype: torch.dtype) -> float | int | bool:
    """What a tensor of ``dtype`` holds before its initializer runs: NaN, the most negative
    integer, or False (a boolean has no value to spare: one left unset is False everywhere)."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return False
    return torch.iinfo(dtype).min


def _still_unset(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` still holds :func:`_unset`'s value somewhere (never for booleans)."""
    if tensor.dtype == torch.bool:
        return False
    if tensor.is_floating_point() or tensor.is_complex():
        return bool(torch.isnan(tensor).any())
    return bool((tensor == torch.iinfo(tensor.dtype).min).any())


def own_state(module: nn.Module) -> list[dict[str, Any]]:
    """``module``'s own parameters and buffers, by name (not its children's)."""
    return [module._parameters, module._buffers]  # noqa: SLF001 - own state only


def _whole_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s materialized tensors that are not sharded (not DTensors)."""
    from torch.distributed.tensor import DTensor

    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())
               if not t.is_meta and not isinstance(t, DTensor))
