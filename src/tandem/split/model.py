"""Splitting a traceable model into an ``nn.Sequential`` of blocks, at module boundaries.

Cuts fall where the module that runs the code changes, at the deepest level of the model's
module tree that gives at most ``max_blocks`` blocks (``transformer.h.0``, ``transformer.h.1``,
... for a transformer), or before the modules the user names. Cuts are placed in the
training-mode and the evaluation-mode trace at the same modules, and must carry the same
tensors in both.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx, nn

from tandem.errors import UsageError
from tandem.split.block import Block, BlockCode, Piece, attach, compile_graph, piece_graph
from tandem.split.graph import GraphInfo, analyse
from tandem.split.leaf import LeafCall, leaf_calls
from tandem.split.spec import TensorSpec, symbolic_dim
from tandem.split.trace import Traced, trace

MAX_BLOCKS = 64
"""Default most blocks of an automatic split (each is profiled and planned separately)."""


class SplitModel(nn.Sequential):
    """A model as a sequence of :class:`~tandem.split.block.Block`; calling it calls the model."""

    boundaries: tuple[tuple[TensorSpec, ...], ...] = ()
    """``boundaries[i]``: the tensors block ``i`` passes to block ``i + 1``."""
    aliases: dict[str, tuple[str, ...]] = {}  # noqa: RUF012 - replaced per instance
    """A block's name of a tensor -> every name the model's ``state_dict`` gives it (tied
    weights have several)."""
    state_order: tuple[str, ...] = ()
    """The model's ``state_dict`` keys, in its order."""
    leaves: dict[str, int] = {}  # noqa: RUF012 - replaced per instance
    """A module the blocks call as a module (:mod:`tandem.split.leaf`) -> the block that
    does."""

    def model_names(self, name: str) -> tuple[str, ...]:
        """The model's names of the tensor a block calls ``name``."""
        return self.aliases.get(name, (name,))

    def bind(self, model: nn.Module) -> None:
        """Hold ``model``'s parameters and buffers as it holds them now, by name: the split was
        made from the model on the meta device, whose tensors were then replaced."""
        for block in self:
            for prefix, module in block.named_modules():
                for tensors in (module._parameters, module._buffers):  # noqa: SLF001 - own only
                    for key, tensor in tensors.items():
                        value = _fetch(model, f"{prefix}.{key}" if prefix else key)
                        if isinstance(value, torch.Tensor) and value is not tensor:
                            tensors[key] = value

    def place_code(self, device: torch.device) -> None:
        """Run every block on ``device`` (the split was traced on the meta device, which its
        code names: :func:`~tandem.split.block.on_device`)."""
        for block in self:
            assert isinstance(block, Block)
            block.place_code(device)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's ``state_dict``, from the blocks, under the model's own names."""
        state: dict[str, torch.Tensor] = {}
        for block in self:
            for name, tensor in block.state_dict().items():
                state.update(dict.fromkeys(self.model_names(name), tensor))
        order = {name: index for index, name in enumerate(self.state_order)}
        return dict(sorted(state.items(), key=lambda item: order.get(item[0], len(order))))


@dataclasses.dataclass(frozen=True, slots=True)
class Anchor:
    """Where a cut falls, in terms that hold in both modes' traces."""

    unit: tuple[str, ...]
    depth: int | None
    """Cut at the ``occurrence``-th start of a run of nodes owned by ``unit`` at this depth;
    None: before the first node run by module ``unit`` (a user's split point)."""
    occurrence: int = 0


def split_model(model: nn.Module, inputs: Any, *, split_points: Sequence[str] | None = None,
                max_blocks: int = MAX_BLOCKS, what: str = "the model",
                leaves: Sequence[str] = (), vary: bool = False) -> SplitModel:
    """``model`` as a :class:`SplitModel` (``inputs``: an example call, batch in dim 0, at
    least 2 samples); cuts before the modules ``split_points`` if given, else automatic; the
    submodules ``leaves`` called as modules (:mod:`tandem.split.leaf`); ``vary``: the inputs'
    sizes besides the batch vary between calls (:func:`~tandem.split.trace.trace`)."""
    traced = trace(model, inputs, what=what, vary=vary)
    infos = {mode: analyse(gm, model) for mode, gm in traced.graphs.items()}
    calls = {mode: leaf_calls(info, leaves) for mode, info in infos.items()}
    anchors = (user_anchors(model, split_points) if split_points
               else auto_anchors(infos[True], max_blocks))
    anchors.sort(key=lambda anchor: locate(infos[True], anchor) or 0)
    cuts = {mode: [locate(info, anchor) for anchor in anchors] for mode, info in infos.items()}
    _check_modes(infos, cuts, anchors)
    depth = max((len(a.unit) if a.depth is None else a.depth for a in anchors), default=1)
    names = _state_names(model)
    blocks = [_block(traced, infos, cuts, index, depth, model, names, calls)
              for index in range(len(anchors) + 1)]
    _keep_unused(model, blocks[-1], blocks)
    split = SplitModel(*blocks)
    split.aliases = {group[0]: tuple(group) for group in names.values() if len(group) > 1}
    split.state_order = tuple(model.state_dict())
    split.leaves = {name: index for index, block in enumerate(blocks)
                    for name in block.leaf_names}
    split.train(model.training)
    split.boundaries = _boundaries(split, infos[True], cuts[True], inputs)
    return split


def user_anchors(model: nn.Module, split_points: Sequence[str]) -> list[Anchor]:
    """One cut before each named submodule."""
    anchors = []
    for name in split_points:
        try:
            model.get_submodule(name)
        except AttributeError:
            raise UsageError(f"split point {name!r} is not a submodule of the model; name one "
                             f"such as {_example_names(model)}") from None
        anchors.append(Anchor(unit=tuple(name.split(".")), depth=None))
    return anchors


def _example_names(model: nn.Module) -> str:
    names = [name for name, _ in model.named_modules() if name][:3]
    return ", ".join(names) or "(the model has no submodules)"


def auto_anchors(info: GraphInfo, max_blocks: int) -> list[Anchor]:
    """Cuts at every change of module at the deepest level with at most ``max_blocks`` blocks."""
    best: list[Anchor] = []
    for depth in range(1, info.depth() + 1):
        anchors = [Anchor(unit=unit, depth=depth, occurrence=k)
                   for position, unit, k in info.run_starts(depth)
                   if info.forbidden[position] is None]
        if len(anchors) + 1 > max_blocks:
            if not best:  # even the top level has too many: keep an even selection
                best = [anchors[i * len(anchors) // (max_blocks - 1)] for i in range(max_blocks - 1)]
            break
        best = anchors
    return best


def locate(info: GraphInfo, anchor: Anchor) -> int | None:
    """The position of ``anchor``'s cut in a trace (None if it has no such place)."""
    if anchor.depth is None:
        size = len(anchor.unit)
        position = next((p for p, owner in enumerate(info.owners) if owner[:size] == anchor.unit),
                        None)
        name = ".".join(anchor.unit)
        if position is None:
            raise UsageError(f"split point {name!r} never runs in the model's forward; name a "
                             f"submodule that does")
        if info.forbidden[position] is not None:
            raise UsageError(f"cannot split before {name!r}: {info.forbidden[position]}; "
                             f"choose another split point")
        return position
    return next((p for p, unit, k in info.run_starts(anchor.depth)
                 if (unit, k) == (anchor.unit, anchor.occurrence)), None)


def _check_modes(infos: dict[bool, GraphInfo], cuts: dict[bool, list[int | None]],
                 anchors: list[Anchor]) -> None:
    """Each cut exists in both modes and carries the same tensors there."""
    if len(set(cuts[True])) != len(cuts[True]):
        raise UsageError("two split points fall at the same place; give each block boundary "
                         "once")
    if cuts[False] != sorted(cuts[False], key=lambda p: -1 if p is None else p):
        raise UsageError("the model runs its modules in another order in evaluation mode; "
                         "give split points that keep their order")
    for anchor, train, evaluate in zip(anchors, cuts[True], cuts[False]):
        name = ".".join(anchor.unit) or "the model's own code"
        if evaluate is None or infos[False].forbidden[evaluate] is not None:
            raise UsageError(f"the model runs {name} differently in evaluation mode, so it "
                             f"cannot be split there; give split points elsewhere")
        assert train is not None
        specs = [_shapes(infos[mode], position)
                 for mode, position in ((True, train), (False, evaluate))]
        if specs[0] != specs[1]:
            raise UsageError(f"before {name} the model passes {specs[0]} in training but "
                             f"{specs[1]} in evaluation; give split points elsewhere")


def _shapes(info: GraphInfo, position: int) -> list[tuple[Any, ...]]:
    return [(tuple(symbolic_dim(s, info.symbols) for s in v.meta["val"].shape), v.meta["val"].dtype)
            for v in info.crossing(position)]


def _state_names(model: nn.Module) -> dict[int, list[str]]:
    """``id(tensor)`` -> the model's names of each parameter and buffer (tied ones have
    several; the first is the one blocks use)."""
    names: dict[int, list[str]] = defaultdict(list)
    for name, tensor in model.state_dict(keep_vars=True).items():
        names[id(tensor)].append(name)
    for name, tensor in model.named_buffers(remove_duplicate=False):
        if id(tensor) not in names:
            names[id(tensor)].append(name)
    return names


def _block(traced: Traced, infos: dict[bool, GraphInfo], cuts: dict[bool, list[Any]],
           index: int, depth: int, model: nn.Module, names: dict[int, list[str]],
           calls: dict[bool, dict[int, LeafCall]]) -> Block:
    """Block ``index``: its graphs in both modes, compiled, with the modules it calls and the
    state its graphs use."""
    persistent = {name for group in names.values() for name in group} & \
        set(model.state_dict(keep_vars=True))
    block_state: dict[str, Any] = {}
    graphs, functions, sources = {}, {}, {}
    leaves: dict[str, None] = {}
    label = ""
    for mode, info in infos.items():
        bounds = [0, *cuts[mode], len(info.nodes)]
        start, end = bounds[index], bounds[index + 1]
        last = index == len(bounds) - 2
        piece = Piece(info=info, start=start, end=end,
                      inputs=info.placeholders if index == 0 else info.crossing(start),
                      outputs=None if last else info.crossing(end),
                      calls={p: call for p, call in calls[mode].items() if start <= p < end})
        leaves.update(dict.fromkeys(call.name for call in piece.calls.values()))
        gm = traced.graphs[mode]

        def attribute(node: fx.Node, gm: fx.GraphModule = gm, mode: bool = mode) -> str:
            value = _fetch(model, str(node.target))
            if value is not None and id(value) in names:
                name = names[id(value)][0]
            else:
                value = _fetch(gm, str(node.target))
                name = f"_constants.{'train' if mode else 'eval'}_mode.{node.target}"
            block_state[name] = value
            return name

        if mode:
            label = _label(info.owners[start:end], info.nodes[start], depth, model)
        graphs[mode] = piece_graph(piece, attribute)
        functions[mode], sources[mode] = compile_graph(
            graphs[mode], f"{index} {label} ({'train' if mode else 'eval'})")
    code = BlockCode(label=label, graphs=graphs, functions=functions, sources=sources,
                     in_spec=traced.in_spec if index == 0 else None,
                     out_spec=traced.out_spec if index == len(cuts[True]) else None)
    block = Block(code)
    order = {name: position for position, (name, _) in enumerate(model.named_modules())}
    block.leaf_names = tuple(sorted(leaves, key=order.__getitem__))
    for name in block.leaf_names:
        attach(block, name, model.get_submodule(name))
    for name, value in block_state.items():
        attach(block, name, value, persistent=name in persistent)
    return block


def _keep_unused(model: nn.Module, last: Block, blocks: list[Block]) -> None:
    """Parameters and buffers the forward never uses go with the last block, so that the
    blocks hold the model's whole ``state_dict``."""
    held = {id(t) for block in blocks for t in [*block.parameters(), *block.buffers()]}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in held:
            attach(last, name, tensor)
            held.add(id(tensor))


def _fetch(root: nn.Module, target: str) -> Any:
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value


def _label(owners: list[tuple[str, ...]], first: fx.Node, depth: int, model: nn.Module) -> str:
    """The modules a block runs: ``transformer.h.0``, ``stem..bn``; ``top:relu`` for code of
    the model's (or a module's) own ``forward`` between its submodules."""
    def glue(unit: tuple[str, ...]) -> bool:  # a module's own code between its submodules
        return len(unit) < depth and next(model.get_submodule(".".join(unit)).children(),
                                          None) is not None

    units = list(dict.fromkeys(owner[:depth] for owner in owners))
    start = (".".join(units[0]) or "top") + (f":{first.name}" if glue(units[0]) else "")
    if len(units) == 1:
        return start
    end = next((unit for unit in reversed(units[1:]) if not glue(unit)), units[-1])
    return f"{start}..{'.'.join(end) or 'top'}"


def _boundaries(split: SplitModel, info: GraphInfo, cuts: list[Any],
                inputs: Any) -> tuple[tuple[TensorSpec, ...], ...]:
    """What crosses each cut; whether a gradient comes back is seen on one training forward of
    ``inputs`` (the model's buffers and random state are left as they were)."""
    flags = []
    with _scratch(split), torch.enable_grad():
        was_training = split.training
        split.train()
        x = inputs
        for block in list(split)[:-1]:
            x = block(x)
            flags.append([isinstance(t, torch.Tensor) and t.requires_grad for t in x])
        split.train(was_training)
    boundaries = []
    for position, grads in zip(cuts, flags):
        specs = [TensorSpec(shape=tuple(symbolic_dim(s, info.symbols) for s in v.meta["val"].shape),
                            dtype=v.meta["val"].dtype, requires_grad=grad)
                 for v, grad in zip(info.crossing(position), grads)]
        boundaries.append(tuple(specs))
    return tuple(boundaries)


@contextmanager
def _scratch(module: nn.Module) -> Iterator[None]:
    """Run ``module`` without a trace on its buffers or on the random streams."""
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    devices = sorted({b.device.index or 0 for b, _ in saved if b.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, value in saved:
                    buffer.copy_(value)
