"""Tensor (intra-layer) parallelism: a model's layers split across the workers of a device mesh.

Usage::

    mesh = init_device_mesh("cpu", (degree,))
    torch.manual_seed(seed)
    model = build_model(...)                    # the whole model, as one process would start it
    plan = tensor_plan("gpt", model, degree)
    split_model(model, plan, mesh)              # each worker keeps its share of every split layer
    ...                                         # train: every worker runs the same batch
    state = gathered_state_dict(model, plan, mesh)   # collective: the whole model, own names

Linear layers are split through PyTorch's DTensor (``parallelize_module`` with
``ColwiseParallel`` and ``RowwiseParallel``, here :class:`Colwise` and :class:`Rowwise`, which
also split a Hugging Face ``Conv1D``), which runs on gloo: their parameters become DTensors
sharded over the mesh, and DTensor inserts the allreduce after a row-wise layer (forward) and
before a column-wise one (backward). A column-wise layer with no row-wise partner gathers its
output (``output_layouts=Replicate()``), a row-wise one with none takes its share of a whole
input (``input_layouts=Replicate()``), see :func:`dtensor_styles`. A fused query/key/value
layer (``heads``) has its outputs (an ``nn.Linear``'s weight rows, a ``Conv1D``'s columns)
reordered first so that each worker's contiguous share holds the queries, keys and values of
whole heads, and the attention that holds it is set to count a worker's share of the heads
(:func:`share_heads`). Convolutions (``channels``) are split with explicit collectives, because
DTensor's convolution rule (torch 2.13) does not shard output channels: each worker keeps its
share of the filters, the input passes through Megatron's *f* (identity forward, allreduce of
the gradient backward) and the output through an all-gather of the channels (backward: each
worker keeps the gradient of its own channels).

Every worker starts from its share of the whole model built with the run's seed, so a
tensor-parallel run starts from the weights single-process training would have.

A job that combines tensor parallelism with data parallelism or a pipeline lays its workers on
one ``DeviceMesh`` of dimensions ``data x pipeline x tensor`` (:func:`layout_mesh`), built from
the plan: the ``T`` workers of a stage replica are adjacent ranks, so the ``tensor`` groups are
the innermost (fastest) links.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module,
)

from tandem.errors import UsageError
from tandem.models.pieces import Initializer, materialize
from tandem.models.tensor import TensorPlan, head_shares, is_conv1d, output_dim

Shares = dict[str, tuple[int, int]]
"""Attributes of attention modules set to a worker's share: full name -> (whole, share)."""


def split_model(model: nn.Module, plan: TensorPlan, mesh: DeviceMesh) -> Shares:
    """Replace the parameters of every layer ``plan`` names by this worker's share (in place);
    the layers it does not name stay whole. ``model`` must hold the same weights on every
    worker of ``mesh`` (build it from the same seed). Returns the attributes of the attention
    modules set to a worker's share of their heads (:func:`share_heads`)."""
    styles = dtensor_styles(model, plan)
    shares = share_heads(model, plan, mesh.size())
    for name in plan:
        _split_layer(model, name, plan[name], mesh, styles)
    return shares


def materialize_split(model: nn.Module, plan: TensorPlan, mesh: DeviceMesh, *, init: Initializer,
                      device: torch.device) -> Shares:
    """Give ``model`` (on the meta device) storage one module at a time, each initialized by
    ``init`` as the model built whole would be (:func:`tandem.models.pieces.materialize`) and,
    if ``plan`` splits it, cut to this worker's share at once: a worker never holds more than
    one split layer whole. Returns what :func:`split_model` returns."""
    styles = dtensor_styles(model, plan)

    def split(name: str) -> None:
        if name:
            _split_layer(model, name, plan[name], mesh, styles)

    materialize(model, init, device, units=list(plan), done=split)
    return share_heads(model, plan, mesh.size())  # after: initializers see the whole counts


def share_heads(model: nn.Module, plan: TensorPlan, degree: int) -> Shares:
    """Set the attributes by which the attention modules of ``plan``'s ``heads`` layers count
    their whole heads or width to a worker's share (:func:`tandem.models.tensor.head_shares`,
    read before any layer is split); returns what it set."""
    shares = head_shares(model, plan, degree)
    for full, (_, share) in shares.items():
        owner, _, attribute = full.rpartition(".")
        setattr(model.get_submodule(owner), attribute, share)
    return shares


def describe_shares(shares: Shares) -> str:
    """What :func:`share_heads` set, in one line, the modules set alike together: ``each
    worker's attention counts its share of the heads: num_heads 2 -> 1, split_size 32 -> 16 in
    h.0.attn, h.1.attn``."""
    by_owner: dict[str, list[str]] = {}
    for full, (whole, share) in shares.items():
        owner, _, attribute = full.rpartition(".")
        by_owner.setdefault(owner, []).append(f"{attribute} {whole} -> {share}")
    alike: dict[str, list[str]] = {}
    for owner, changes in by_owner.items():
        alike.setdefault(", ".join(changes), []).append(owner or "the model")
    return "each worker's attention counts its share of the heads: " + "; ".join(
        f"{changes} in {', '.join(owners)}" for changes, owners in alike.items())


def _split_layer(model: nn.Module, name: str, style: str, mesh: DeviceMesh,
                 styles: dict[str, ParallelStyle]) -> None:
    """Cut layer ``name`` of ``model`` to this worker's share in ``style``."""
    layer = model.get_submodule(name)
    if style == "heads":
        with torch.no_grad():
            for key, value in layer.named_parameters(recurse=False):
                dim = output_dim(layer, key)
                order = heads_order(value.shape[dim], mesh.size()).to(value.device)
                value.copy_(value.index_select(dim, order))
    elif style == "channels":
        _split_channels(layer, mesh)
    if name in styles:
        parallelize_module(model, mesh, {name: styles[name]})


MESH_DIMS = ("data", "pipeline", "tensor")
"""The names of a layout mesh's dimensions, outermost first."""
HYBRID_DIMS = ("replicate", "shard", "pipeline", "tensor")
"""A hybrid-sharded layout mesh's dimensions (``data`` is its first two, flattened)."""


def data_mesh(layout: DeviceMesh) -> DeviceMesh:
    """The part of a layout mesh FSDP2 shards over: ``data``, or ``replicate x shard`` when the
    layout is hybrid (:func:`layout_mesh` with ``shards``)."""
    names = layout.mesh_dim_names or ()
    return layout["replicate", "shard"] if "shard" in names else layout["data"]


def layout_mesh(device_type: str, *, replicas: int, stages: int, degree: int,
                worker_of: Callable[[int, int], int], shards: int | None = None) -> DeviceMesh:
    """The job's ``data x pipeline x tensor`` mesh (collective: every rank builds it): the
    worker of ``replica`` of ``stage`` is ``worker_of(stage, replica)`` (the schedule's
    numbering), and its ``degree`` tensor-parallel processes are ranks ``worker * degree`` to
    ``worker * degree + degree - 1``.

    With ``shards`` below ``replicas`` (hybrid sharding), the replicas are groups of ``shards``
    that shard the state among them and replicate it across the groups: the mesh is
    ``replicate x shard x pipeline x tensor`` (replica ``r`` at ``(r // shards, r %
    shards)``), its first two dimensions flattened into ``data``; FSDP2 takes
    ``mesh["replicate", "shard"]``."""
    ranks = torch.tensor([[[worker_of(stage, replica) * degree + part for part in range(degree)]
                           for stage in range(stages)] for replica in range(replicas)])
    if shards is None or shards >= replicas:
        return DeviceMesh(device_type, ranks, mesh_dim_names=MESH_DIMS)
    hybrid = ranks.reshape(replicas // shards, shards, stages, degree)
    mesh = DeviceMesh(device_type, hybrid, mesh_dim_names=HYBRID_DIMS)
    mesh["replicate", "shard"]._flatten("data")  # noqa: SLF001  (torch's way to name it)
    return mesh


def check_trust_ratios(plan: TensorPlan, optimizer: str) -> None:
    """One line if ``optimizer`` (LARS, LAMB) would take a layer's norm over one worker's share:
    a convolution split by channels holds its share as a plain tensor, not a DTensor whose norm
    sums the shares."""
    channels = [name for name, style in plan.items() if style == "channels"]
    if optimizer in ("lars", "lamb") and channels:
        raise UsageError(f"--optimizer {optimizer} scales each layer's step by the norm of the "
                         f"whole layer, and convolutions split by channels ({', '.join(channels)}"
                         f") hold their shares as plain tensors whose norms would be a share's; "
                         f"use --optimizer sgd, adam or adamw, or drop --tensor-parallel")


def stage_plan(plan: TensorPlan, start: int, end: int) -> tuple[TensorPlan, list[str]]:
    """The part of ``plan`` (names in an ``nn.Sequential`` of blocks) that falls in blocks
    ``start`` to ``end - 1``, renamed as in ``nn.Sequential(*blocks[start:end])``; and the
    names (the whole model's) of its layers left whole.

    A column-wise/row-wise pair cut by the stage boundary is split on both sides as lone layers
    (:func:`dtensor_styles`: the column-wise one gathers its output, the row-wise one takes its
    share of a whole input), since the tensors between stages are whole; a ``heads`` layer cut
    from its row-wise layer stays whole (gathering it would mix its outputs' order)."""
    def inside(name: str) -> bool:
        block = name.partition(".")[0]
        return block.isdigit() and start <= int(block) < end

    whole: list[str] = []
    opened: str | None = None
    for name, style in plan.items():
        if style in ("colwise", "heads"):
            opened = name
        elif style == "rowwise":
            if opened is not None and plan[opened] == "heads" and inside(opened) \
                    and not inside(name):
                whole.append(opened)
            opened = None
    if opened is not None and plan[opened] == "heads" and inside(opened):
        whole.append(opened)  # no row-wise layer after it at all
    part: TensorPlan = {}
    for name, style in plan.items():
        if inside(name) and name not in whole:
            block, _, rest = name.partition(".")
            part[".".join(filter(None, (str(int(block) - start), rest)))] = style
    return part, whole


def dtensor_styles(model: nn.Module, plan: TensorPlan) -> dict[str, ParallelStyle]:
    """DTensor's style for each linear layer of ``plan``, paired in the model's module order
    (:func:`share_sides`): a ``colwise`` layer before a ``rowwise`` one hands it its share; one
    with no ``rowwise`` after it gathers its whole output; a ``rowwise`` layer with no
    ``colwise`` before it takes its share of a whole input."""
    ordered = {name: plan[name] for name, _ in model.named_modules() if name in plan}
    sides = share_sides(ordered)
    styles: dict[str, ParallelStyle] = {}
    for name, style in ordered.items():
        if style in ("colwise", "heads"):
            styles[name] = Colwise() if name in sides else Colwise(output_layouts=Replicate())
        elif style == "rowwise":
            styles[name] = Rowwise() if name in sides else Rowwise(input_layouts=Replicate())
    return styles


def share_sides(ordered: TensorPlan) -> dict[str, str]:
    """The linear layers of ``ordered`` (a plan in the order its layers run) that hand a share
    on or take one: ``"output"`` for a ``colwise`` or ``heads`` layer with a ``rowwise`` layer
    after it (before the next ``colwise``/``heads`` run ends), ``"input"`` for that ``rowwise``
    layer. The others (lone) compute what the whole layer does."""
    sides: dict[str, str] = {}
    feeding: list[str] = []
    for name, style in ordered.items():
        if style in ("colwise", "heads"):
            feeding.append(name)
        elif style == "rowwise":
            sides.update(dict.fromkeys(feeding, "output"))
            if feeding:
                sides[name] = "input"
            feeding = []
    for name in feeding:
        assert ordered[name] == "colwise", f"heads layer {name} has no rowwise layer after it"
    return sides


class Colwise(ColwiseParallel):
    """``ColwiseParallel``, which also splits a ``Conv1D`` (whose weight is ``nn.Linear``'s
    transposed): its weight by columns, its bias alike; its forward then runs on DTensors."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        return _distribute_conv1d(self, module, device_mesh, {"weight": Shard(1),
                                                              "bias": Shard(0)})


class Rowwise(RowwiseParallel):
    """``RowwiseParallel``, which also splits a ``Conv1D``: its weight by rows (its inputs), its
    bias whole, added once to the sum of the workers' partial outputs."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return _distribute_conv1d(self, module, device_mesh, {"weight": Shard(0),
                                                              "bias": Replicate()})


def _distribute_conv1d(style: ColwiseParallel | RowwiseParallel, module: nn.Module,
                       mesh: DeviceMesh, placements: dict[str, Placement]) -> nn.Module:
    """``module``'s parameters as DTensors of ``placements`` over ``mesh``, its input and
    output laid out as ``style`` lays out an ``nn.Linear``'s."""
    def partition(_: str, layer: nn.Module, mesh: DeviceMesh) -> None:
        for key, placement in placements.items():
            value = getattr(layer, key, None)
            if isinstance(value, nn.Parameter):
                layer.register_parameter(key, nn.Parameter(
                    distribute_tensor(value, mesh, [placement], src_data_rank=style.src_data_rank),
                    requires_grad=value.requires_grad))

    return distribute_module(
        module, mesh, partition,
        partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
        partial(style._prepare_output_fn, style.output_layouts, style.use_local_output))


def heads_order(out_features: int, degree: int) -> torch.Tensor:
    """Row order of a fused query/key/value layer that puts worker ``r``'s queries, keys and
    values (those of its ``heads / degree`` heads) in its contiguous ``1 / degree`` share."""
    dim = out_features // 3
    share = dim // degree
    return torch.cat([torch.arange(part * dim + rank * share, part * dim + (rank + 1) * share)
                      for rank in range(degree) for part in range(3)])


def natural_order(tensor: torch.Tensor, degree: int, dim: int = 0) -> torch.Tensor:
    """A ``heads`` layer's whole weight or bias, its outputs in its shares' order along ``dim``
    (:func:`heads_order`), with them in the model's own order."""
    order = heads_order(tensor.shape[dim], degree).to(tensor.device)
    return torch.empty_like(tensor).index_copy_(dim, order, tensor)  # its i-th is order[i]


class _CopyToShards(torch.autograd.Function):
    """Megatron's *f*: the input as it is; its gradient summed over the mesh's workers (each
    computed the part that flows back through its own share of the layer)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _GatherChannels(torch.autograd.Function):
    """Every worker's output channels, concatenated in rank order; backward: the gradient of
    this worker's own channels (every worker holds the whole gradient after *f*)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, rank: int,
                degree: int) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(degree)]
        dist.all_gather(parts, x, group=group)
        ctx.rank, ctx.share = rank, x.shape[1]
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad.narrow(1, ctx.rank * ctx.share, ctx.share).contiguous(), None, None, None


def _split_channels(conv: nn.Module, mesh: DeviceMesh) -> None:
    """Keep this worker's share of ``conv``'s filters; gather the channels after it."""
    assert isinstance(conv, nn.Conv2d), f"channels style needs an nn.Conv2d, not {conv}"
    group, rank, degree = mesh.get_group(), mesh.get_local_rank(), mesh.size()
    share = conv.out_channels // degree
    rows = slice(rank * share, (rank + 1) * share)
    conv.weight = nn.Parameter(conv.weight.detach()[rows].clone())
    if conv.bias is not None:
        conv.bias = nn.Parameter(conv.bias.detach()[rows].clone())
    conv.out_channels = share

    def copy_input(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        if not x.requires_grad:
            return args
        copied = _CopyToShards.apply(x, group)  # type: ignore[no-untyped-call]  # torch's
        return (copied, *args[1:])

    def gather_output(_: nn.Module, __: Any, out: torch.Tensor) -> torch.Tensor:
        gathered: torch.Tensor = _GatherChannels.apply(  # type: ignore[no-untyped-call]
            out, group, rank, degree)
        return gathered

    conv.register_forward_pre_hook(copy_input)
    conv.register_forward_hook(gather_output)


def gathered_state_dict(model: nn.Module, plan: TensorPlan,
                        mesh: DeviceMesh) -> dict[str, torch.Tensor]:
    """The whole model's ``state_dict`` under its own names, on every worker of ``mesh``
    (collective): shares gathered, a ``heads`` layer's outputs put back in their order."""
    channels = {name for name, style in plan.items() if style == "channels"}
    heads = {name: model.get_submodule(name) for name, style in plan.items() if style == "heads"}
    state: dict[str, torch.Tensor] = {}
    # a share sharded again over the replicas (--shard) is gathered dimension by dimension,
    # which DTensor reports as suboptimal at each parameter: it runs once, at the end
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    for key, value in model.state_dict().items():
        owner, _, kind = key.rpartition(".")
        tensor = value.detach()
        if isinstance(tensor, DTensor):  # a split layer, or a share FSDP2 sharded again
            tensor = tensor.full_tensor()
        if owner in channels:  # this worker's rows of the whole layer
            parts = [torch.empty_like(tensor) for _ in range(mesh.size())]
            dist.all_gather(parts, tensor.contiguous(), group=mesh.get_group())
            tensor = torch.cat(parts)
        if owner in heads:
            tensor = natural_order(tensor, mesh.size(), output_dim(heads[owner], kind))
        state[key] = tensor.cpu()
    return state


def sum_gradients(parameters: list[nn.Parameter], group: Any) -> int:
    """Sum the gradients of ``parameters`` (each worker's local shares) over ``group`` in one
    flat allreduce; returns the bytes reduced."""
    grads = [local_tensor(p.grad) for p in parameters if p.grad is not None]
    if not grads:
        return 0
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset: offset + grad.numel()].view_as(grad))
        offset += grad.numel()
    return flat.numel() * flat.element_size()


def split_parameters(model: nn.Module, plan: TensorPlan) -> dict[str, bool]:
    """The names of ``model``'s parameters each worker holds a share of, each with whether it
    is a DTensor (split layers; a replicated DTensor, a row-wise layer's bias, is whole) or a
    plain tensor of its rows (``channels`` layers)."""
    channels = {name for name, style in plan.items() if style == "channels"}
    return {name: isinstance(p, DTensor) for name, p in model.named_parameters()
            if (isinstance(p, DTensor) and any(place.is_shard() for place in p.placements))
            or name.rpartition(".")[0] in channels}


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this worker holds (a DTensor's local shard, else itself)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def parameter_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of each parameter of ``model`` that this worker holds, by name."""
    return {name: _bytes(local_tensor(p.detach())) for name, p in model.named_parameters()}


def memory_report(model: nn.Module, optimizer: torch.optim.Optimizer,
                  whole_bytes: dict[str, int]) -> dict[str, float]:
    """Parameter and optimizer-state bytes: this worker's (``worker_bytes``), the unsplit
    model's (``model_bytes``: each parameter at its whole size ``whole_bytes[name]`` with its
    state scaled alike) and those of the parameters every worker holds whole
    (``whole_layer_bytes``: the layers ``plan`` leaves whole, and a row-wise layer's bias).
    Both stay the same from the first step on, so they are the peaks."""
    worker = model_total = whole_layers = 0.0
    for name, parameter in model.named_parameters():
        local = _bytes(local_tensor(parameter.detach()))
        state = sum(_bytes(local_tensor(value)) for value in optimizer.state.get(parameter, {})
                    .values() if isinstance(value, torch.Tensor) and value.dim() > 0)
        worker += local + state
        model_total += (local + state) * whole_bytes[name] / max(local, 1)
        if local == whole_bytes[name]:
            whole_layers += local + state
    return {"worker_bytes": worker, "model_bytes": model_total, "whole_layer_bytes": whole_layers}


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
