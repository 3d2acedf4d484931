"""Sharded data parallelism (ZeRO / FSDP): each group of ``S`` data-parallel workers holds the
model's state in ``S`` shards, on PyTorch's own FSDP2 (``fully_shard``) or, for the optimizer
state alone, its ``ZeroRedundancyOptimizer`` over DDP.

Usage::

    strategy = sharded_strategy(degree=4, level=3, units=None, precision="bf16")
    module = strategy.wrap(model, device)        # before the optimizer is built
    optimizer = strategy.shard_optimizer(optimizer)

The levels are ZeRO's stages: 1 shards the optimizer state (each worker steps its share of the
parameters and broadcasts them; gradients are DDP's allreduced ones); 2 also the gradients
(FSDP2 with ``reshard_after_forward=False``: the parameters gathered for a forward stay gathered
until its backward, whose gradients are reduce-scattered); 3 also the parameters
(``reshard_after_forward=True``: gathered again for the backward). With more workers than ``S``
the groups are replicas of each other (hybrid sharding, HSDP): a 2-D mesh ``(replicas, S)``,
where FSDP2 reduce-scatters within a group and allreduces each shard across the groups.

``--precision bf16`` at levels 2 and 3 is FSDP2's mixed precision (``MixedPrecisionPolicy``):
each unit's parameters are gathered in bf16 and its forward and backward compute in bf16, while
the shards the optimizer steps stay in fp32 and the gradients are reduced in fp32; the model's
output is cast back to fp32, so the loss is computed in fp32. No autocast runs around it. A
normalization layer with running statistics (BatchNorm) stays fp32 as a unit of its own (its
input cast to fp32, its output to bf16), as FSDP1 kept it: its fp32 statistics would not mix
with bf16 weights, nor should they be kept in bf16.

A *unit* is gathered and freed as one piece: each block of the model (the children of its
sequence of blocks, :func:`block_units`: gpt's transformer blocks, an ``nn.Sequential``'s
layers, a Hugging Face GPT-2's ``transformer.h.*``) or the submodules a user names, then the
rest of the model as the root unit.

At levels 2 and 3 a model that can be built in pieces (a built-in one, or a user's builder with
``--init-fn``) comes on the meta device and is given storage one module at a time, each unit
sharded as soon as it is complete (:mod:`tandem.models.pieces`): no worker holds it whole.

The update equals DDP's: the workers start from rank 0's parameters and buffers (as DDP
broadcasts them; a model built in pieces has the same weights on every worker by its seed),
each gradient is the mean of the workers', and buffers (BatchNorm's running
statistics) follow DDP's default: rank 0's are broadcast before the first forward of each step
and once more at the end (:meth:`ShardedDataParallel.consensus`).

Every level checkpoints each worker's own shards (:mod:`tandem.runtime.sharded_checkpoint`;
at level 1 the optimizer state of the parameters it steps). Not done here yet: the gradient
noise scale at levels 2 and 3 and compression (each refused in one line by
:class:`tandem.runtime.job.Job`). Sharding x tensor parallelism runs in
:class:`tandem.runtime.tensor_trainer.TensorParallelTrainer`, and sharded pipeline stages in
:mod:`tandem.runtime.pipeline.sharding`; both call :func:`shard_model` on the ``data``
dimension of the job's mesh.
"""

from __future__ import annotations

import contextlib
import difflib
import re
import resource
import warnings
from collections.abc import Iterator
from typing import Any, ContextManager, cast

import torch
import torch.distributed as dist
from torch import nn

from tandem.errors import UsageError
from tandem.models.pieces import PieceStats, materialize, on_meta
from tandem.sync.allreduce import AllReduce
from tandem.sync.base import SyncStrategy
from tandem.sync.flat import flatten, state_buffers, unflatten_into

SHOWN_NAMES = 4
"""Module names a message about ``--shard-units`` lists."""


def block_units(model: nn.Module) -> list[str]:
    """The default units: the children that hold parameters of the model's sequence of blocks,
    the ``nn.Sequential`` or ``nn.ModuleList`` with the most such children (the model itself
    when it is one; the first met on a tie), as ``named_modules`` names them."""
    best: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Sequential, nn.ModuleList)):
            continue
        holders = [f"{name}.{child}" if name else child
                   for child, sub in module.named_children() if _holds_parameters(sub)]
        if len(holders) > len(best):
            best = holders
    return best


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def check_units(model: nn.Module, names: list[str] | None) -> list[str]:
    """The units of ``model``: ``names`` (``--shard-units``), each checked to name one of its
    submodules, or its blocks (:func:`block_units`), in that order. A parameter shared by two
    units (tied weights) is one line naming both."""
    modules = dict(model.named_modules())
    chosen = block_units(model) if names is None else names
    for name in chosen:
        if name not in modules or not name:
            named = [n for n in modules if n]
            close = difflib.get_close_matches(name, named, n=SHOWN_NAMES)
            shown = close or block_units(model)[:SHOWN_NAMES] or named[:SHOWN_NAMES]
            raise UsageError(f"--shard-units {name!r} is not a submodule of the model; its "
                             f"modules include {', '.join(shown)} (names as named_modules() "
                             f"gives them)")
    units = list(dict.fromkeys(chosen))
    _check_ties(model, units)
    return units


def _check_ties(model: nn.Module, units: list[str]) -> None:
    """One line if a parameter belongs to two units (``fully_shard`` shards each unit's
    parameters on their own, so a tie between units would be broken)."""
    deepest = sorted(units, key=len, reverse=True)
    owners: dict[int, dict[str, str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        unit = next((u for u in deepest if path == u or path.startswith(u + ".")), "")
        for name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), {}).setdefault(unit, f"{path}.{name}" if path else name)
    for places in owners.values():
        if len(places) > 1:
            first, second = list(places.values())[:2]
            raise UsageError(f"--shard-units: parameter {first} is the same as {second}, which "
                             f"another unit holds (tied weights); name a module that holds "
                             f"both as one unit, or leave them out of the units")


def _normalizations(model: nn.Module) -> list[str]:
    """The names of ``model``'s normalization layers that keep running statistics."""
    return [name for name, module in model.named_modules()
            if name and isinstance(module, nn.modules.batchnorm._NormBase)  # noqa: SLF001
            and module.track_running_stats]


def check_offload(offload: str | None, backend: str) -> None:
    """One line if ``--offload`` has nothing to offload: a run on the CPU (gloo, or no GPU)."""
    if offload is not None and (backend == "gloo" or not torch.cuda.is_available()):
        raise UsageError(f"--offload {offload} moves FSDP2's shards from the GPU to CPU memory, "
                         f"and this run is on the CPU, where they already are (it has nothing "
                         f"to offload); drop --offload")


def shard_model(model: nn.Module, mesh: Any, *, units: list[str], level: int,
                param_dtype: torch.dtype | None, offload: bool = False) -> None:
    """FSDP2's ``fully_shard`` over ``mesh`` on each of ``units``, then on the whole model
    (:class:`UnitSharder`)."""
    sharder = UnitSharder(model, mesh, units=units, level=level, param_dtype=param_dtype,
                          offload=offload)
    for name in sorted(sharder.policies, key=lambda unit: -unit.count(".")):  # inner first
        sharder(name)
    sharder("")


class UnitSharder:
    """FSDP2's ``fully_shard`` of one unit at a time (``sharder(name)``, the whole model as
    ``""``, last): at ``level`` 3 a unit's parameters are freed after its forward, at 2 kept
    until its backward; with ``param_dtype`` (bf16) the units compute in it on fp32 shards,
    reduce in fp32 and the model's output is fp32, normalization layers with running statistics
    staying fp32 in units of their own; with ``offload``, the shards stay in CPU memory, where
    the optimizer steps them (``CPUOffloadPolicy``)."""

    def __init__(self, model: nn.Module, mesh: Any, *, units: list[str], level: int,
                 param_dtype: torch.dtype | None, offload: bool = False) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        check_scalars(model)
        self.model, self.mesh, self.reshard = model, mesh, level == 3
        half = param_dtype
        inner = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
        self.root = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32,
                                         output_dtype=torch.float32 if half else None)
        self.policies = dict.fromkeys(units, inner)
        """Each unit's mixed precision, by name (the whole model's is :attr:`root`)."""
        if half is not None:  # statistics stay fp32, in units of their own
            self.policies.update(dict.fromkeys(_normalizations(model), MixedPrecisionPolicy(
                param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=half)))
        self.where = CPUOffloadPolicy() if offload else OffloadPolicy()

    def __call__(self, name: str) -> None:
        """Shard unit ``name`` (``""``: the whole model; each nested unit before it)."""
        from torch.distributed.fsdp import fully_shard

        module = self.model.get_submodule(name) if name else self.model
        if not name:  # tandem hands the model's output to the loss, writing nothing into it
            warnings.filterwarnings("ignore", category=UserWarning, message=(
                rf"FSDP2-wrapped module \(FSDP{re.escape(type(module).__name__)}\) returned a "
                rf"view tensor"))
        fully_shard(module, mesh=self.mesh, reshard_after_forward=self.reshard,
                    mp_policy=self.policies[name] if name else self.root,
                    offload_policy=self.where)


def check_scalars(model: nn.Module) -> None:
    """One line for a parameter with no dimension (a learned temperature, say), which
    ``fully_shard`` cannot cut into shards."""
    scalar = next((name for name, param in model.named_parameters() if param.dim() == 0), None)
    if scalar is not None:
        raise UsageError(f"parameter {scalar} is a scalar (shape ()), which FSDP2 cannot shard; "
                         f"make it a 1-element tensor (shape (1,)) in the model (plain "
                         f"--strategy dp also takes --shard-level 1, which shards the optimizer "
                         f"state only)")


def shard_mesh(device: torch.device, degree: int) -> Any:
    """The device mesh of ``degree``-way shards over all workers: 1-D ``(shard,)``, or 2-D
    ``(replicate, shard)`` when there are more workers than ``degree`` (HSDP)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world == degree:
        return init_device_mesh(device.type, (degree,), mesh_dim_names=("shard",))
    return init_device_mesh(device.type, (world // degree, degree),
                            mesh_dim_names=("replicate", "shard"))


def broadcast_from_first(tensors: list[torch.Tensor]) -> None:
    """Give every worker rank 0's ``tensors`` (collective; one broadcast per dtype)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for group in by_dtype.values():
        flat = flatten(group)
        dist.broadcast(flat, 0)
        unflatten_into(flat, group)


class ShardedDataParallel(SyncStrategy):
    """Levels 2 and 3: FSDP2's ``fully_shard`` on each unit, then on the whole model."""

    name = "dp"
    overlapped_allreduce = True
    sharded_checkpoint = True
    collective_forward = True
    builds_in_pieces = True
    noise_scale_note = (
        "not measured with --shard-level 2 or 3: each worker's gradient is reduce-scattered "
        "unit by unit as the backward computes it, and the noise scale needs the norm of the "
        "whole local gradient beside the averaged one; use --shard-level 1 to measure it")

    def __init__(self, degree: int, level: int, units: list[str] | None = None,
                 param_dtype: torch.dtype | None = None, offload: bool = False) -> None:
        self.shard_degree, self.level, self.unit_names = degree, level, units
        self.param_dtype, self.offload = param_dtype, offload
        """The dtype units compute in (None: their own, fp32)."""
        self.casts_forward = param_dtype is not None
        self.units: list[str] = []
        """The units sharded besides the root (the whole model)."""
        self.mesh: Any = None
        self._buffers: list[torch.Tensor] = []
        self._sync_buffers = True
        """Whether the next training forward broadcasts rank 0's buffers (DDP's rule: before
        the first forward, and after one that synchronized its gradients)."""
        self._accumulating = False
        self._micro_batches = 1
        """Micro-batches of the step so far (each gathers the units again)."""
        self._whole_bytes: int | None = None
        self._sent_bytes = 0.0
        self.build_stats: PieceStats | None = None
        """What building the model in pieces held at most (None: it was built whole)."""
        self.built_rss_bytes: int | None = None
        """The process's peak resident memory once the model was built and sharded."""

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        """Shard ``model``: one built whole starts from rank 0's weights (broadcast); one on
        the meta device is built in pieces by :attr:`initializer`, each unit sharded as soon as
        it is complete (:func:`tandem.models.pieces.materialize`)."""
        # checkpoints and final.pt use these: imported now, a checkpoint's memory is its own
        import torch.distributed.checkpoint.state_dict_loader  # noqa: F401
        import torch.distributed.checkpoint.state_dict_saver  # noqa: F401
        self.units = check_units(model, self.unit_names)
        saved = set(dict(state_buffers(model)))
        self.mesh = shard_mesh(device, self.shard_degree)
        sharder = UnitSharder(model, self.mesh, units=self.units, level=self.level,
                              param_dtype=self.param_dtype, offload=self.offload)
        if on_meta(model):
            if self.initializer is None:
                raise RuntimeError("a model on the meta device needs the strategy's initializer")
            self.build_stats = materialize(model, self.initializer, device,
                                           units=list(sharder.policies), done=sharder)

        else:
            model = model.to(device)
            for tensor in [*model.parameters(), *(b for _, b in state_buffers(model))]:
                dist.broadcast(tensor.detach(), 0)  # one at a time: no flat copy of the model
            shard_model(model, self.mesh, units=self.units, level=self.level,
                        param_dtype=self.param_dtype, offload=self.offload)
        self.built_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self._buffers = [buffer for name, buffer in model.named_buffers() if name in saved]
        if self._buffers:
            model.register_forward_pre_hook(self._before_forward)
            model.register_forward_hook(self._after_forward)
        return model

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled() and self._sync_buffers:
            broadcast_from_first(self._buffers)

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if module.training and torch.is_grad_enabled():
            self._sync_buffers = not self._accumulating

    def accumulating(self, module: nn.Module) -> ContextManager[None]:
        """Gradients accumulate unsharded, without a reduce-scatter (FSDP2's
        ``set_requires_gradient_sync(False)``), until the step's last backward."""
        return self._no_sync(module)

    @contextlib.contextmanager
    def _no_sync(self, module: nn.Module) -> Iterator[None]:
        fsdp = cast(Any, module)
        fsdp.set_requires_gradient_sync(False)
        self._accumulating = True
        self._micro_batches += 1
        try:
            yield
        finally:
            fsdp.set_requires_gradient_sync(True)
            self._accumulating = False

    @contextlib.contextmanager
    def evaluating(self, module: nn.Module) -> Iterator[None]:
        """Level 2 keeps the parameters an evaluation forward gathered (no backward frees
        them): shard them again afterwards."""
        try:
            yield
        finally:
            if self.level == 2:
                from torch.distributed.fsdp import FSDPModule

                for sub in module.modules():
                    if isinstance(sub, FSDPModule):
                        sub.reshard()

    def update(self, module: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> bool:
        self._sent_bytes += self._ring_bytes(module, self._micro_batches)
        self._micro_batches = 1
        return super().update(module, optimizer, step)

    def _ring_bytes(self, module: nn.Module, micro_batches: int) -> float:
        """Bytes a worker sent in a step of ``micro_batches`` (ring collectives): per
        micro-batch an all-gather of the parameters for the forward (and again for the backward
        at level 3), then a reduce-scatter of the gradients and, across replicas, an allreduce
        of its shard of them."""
        if self._whole_bytes is None:
            self._whole_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        whole, shards = self._whole_bytes, self.shard_degree
        replicas = dist.get_world_size() // shards
        gathers = (2 if self.level == 3 else 1) * micro_batches
        within = (gathers + 1) * whole * (shards - 1) / shards
        return within + 2 * (whole / shards) * (replicas - 1) / replicas

    def consensus(self, module: nn.Module) -> None:
        """Rank 0's buffers, as DDP would broadcast them before another forward."""
        if self._buffers:
            broadcast_from_first(self._buffers)

    def gathered_state(self, model: nn.Module, rank: int) -> dict[str, torch.Tensor] | None:
        """The full state dict under the model's own names, gathered shard by shard onto rank
        0's CPU memory (``torch.distributed.checkpoint``'s ``get_model_state_dict``). The
        trainer writes ``final.pt`` without it, from each worker's shards
        (:mod:`tandem.runtime.export`); this is for callers that want the whole state at once."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_model_state_dict,
        )

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                     cpu_offload=True))
        if rank != 0:
            return None
        return {name: value.detach() if isinstance(value, torch.Tensor) else cast(Any, value)
                for name, value in state.items()}  # a module's extra state stays as it is

    def stats(self) -> dict[str, float]:
        """``sync_bytes``: what this worker sent (estimated for ring collectives)."""
        return {"sync_bytes": self._sent_bytes}

    def summary(self) -> dict[str, Any]:
        """The run summary's description of the sharding."""
        stats = self.build_stats
        return {"shard_units": self.units,
                "built": "whole" if stats is None else "pieces",
                "build_peak_whole_bytes": None if stats is None else stats.peak_whole_bytes,
                "build_peak_rss_bytes": self.built_rss_bytes,
                "shard_mesh": dict(zip(self.mesh.mesh_dim_names, self.mesh.shape)),
                "shard_mixed_precision": None if self.param_dtype is None else {
                    "param_dtype": str(self.param_dtype).removeprefix("torch."),
                    "reduce_dtype": "float32"},
                "shard_offload": "optimizer" if self.offload else None,
                "cuda_peak_bytes": (torch.cuda.max_memory_allocated()
                                    if self.mesh.device_type == "cuda" else None)}


class ShardedOptimizer(AllReduce):
    """Level 1 (ZeRO-1): DDP's allreduce, and ``ZeroRedundancyOptimizer`` sharding the
    optimizer state over each group of ``degree`` workers (each steps its share of the
    parameters and broadcasts them within the group). Its stats are DDP's allreduce's (the
    broadcasts of the updated parameters are not counted). Its checkpoints are sharded: each
    worker writes the optimizer state of the parameters it steps
    (:func:`tandem.runtime.sharded_checkpoint.zero_state`)."""

    sharded_checkpoint = True

    def __init__(self, degree: int) -> None:
        super().__init__(None)
        self.shard_degree = degree
        self.mesh: Any = None

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        self.mesh = shard_mesh(device, self.shard_degree)
        return super().wrap(model, device)

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``optimizer``'s class, groups and settings as a ``ZeroRedundancyOptimizer`` over the
        worker's shard group (the defaults its constructor takes: AdamW's hold
        ``decoupled_weight_decay``, which only Adam's constructor takes)."""
        from torch.distributed.optim import ZeroRedundancyOptimizer

        from tandem.spec.optimizer import class_options

        groups = [{key: value for key, value in group.items() if key != "initial_lr"}
                  for group in optimizer.param_groups]
        known, any_name = class_options(type(optimizer))
        defaults = {key: value for key, value in optimizer.defaults.items()
                    if any_name or key in known}
        return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer),
                                       process_group=self.mesh.get_group("shard"), **defaults)

    def summary(self) -> dict[str, Any]:
        """The run summary's description of the sharding."""
        return {"shard_mesh": dict(zip(self.mesh.mesh_dim_names, self.mesh.shape))}


def sharded_strategy(degree: int, level: int, units: list[str] | None,
                     precision: str = "fp32", *, offload: bool = False) -> SyncStrategy:
    """The strategy of ``--shard degree --shard-level level [--shard-units units]`` under
    ``--precision precision`` (levels 2 and 3 compute bf16 by FSDP2's mixed precision; level 1
    leaves the precision to the trainer's autocast)."""
    if level == 1:
        return ShardedOptimizer(degree)
    return ShardedDataParallel(degree, level, units,
                               torch.bfloat16 if precision == "bf16" else None, offload)
