"""A block of a split model: one stretch of the traced graph, as an ``nn.Module``.

A block takes the tensors live at its start (the first block: the model's own inputs) and
returns the tuple live at its end (the last block: the model's own output, any structure). It
holds the parameters and buffers its nodes use under the model's names, and runs the
training-mode or evaluation-mode graph of its stretch as ``self.training`` says. A tensor it
receives and updates in place is cloned first, so a received tensor (a leaf of autograd) is
never modified.
"""

from __future__ import annotations

import dataclasses
import linecache
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.fx import _pytree as fx_pytree
from torch.utils import _pytree as pytree

from tandem.split.graph import GraphInfo, alias_root, written
from tandem.split.leaf import LeafCall
from tandem.split.spec import symbolic_dim
from tandem.split.trace import call_args


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
    """Nodes ``start..end-1`` of a traced graph, the values they receive and return."""

    info: GraphInfo
    start: int
    end: int
    inputs: list[fx.Node]
    outputs: list[fx.Node] | None
    """None for the last block: the model's outputs."""
    calls: Mapping[int, LeafCall] = dataclasses.field(default_factory=dict)
    """Stretches run as one call of a module (:mod:`tandem.split.leaf`), by first position."""


def piece_graph(piece: Piece, attribute: Callable[[fx.Node], str]) -> fx.Graph:
    """A graph of ``piece`` alone; ``attribute`` names each ``get_attr`` target in the block."""
    info, graph = piece.info, fx.Graph()
    env: dict[fx.Node, Any] = {}
    for value in piece.inputs:
        env[value] = graph.placeholder(value.name)
        env[value].meta = dict(value.meta)
    updated = {alias_root(w) for node in info.nodes[piece.start:piece.end] for w in written(node)}
    for value in piece.inputs:
        if value in updated:
            env[value] = graph.call_function(torch.ops.aten.clone.default, (env[value],))
    attributes: dict[str, fx.Node] = {}

    def lookup(node: fx.Node) -> Any:
        if node in env:
            return env[node]
        if node.op == "get_attr":
            name = attribute(node)
            if name not in attributes:
                attributes[name] = graph.get_attr(name)
            return attributes[name]
        assert node in info.scalars, f"{node.name} is neither received nor computed here"
        env[node] = _size(node, graph, env, piece, lookup)
        return env[node]

    position = piece.start
    while position < piece.end:
        call = piece.calls.get(position)
        if call is None:
            node = info.nodes[position]
            env[node] = graph.node_copy(node, lookup)
            position += 1
            continue
        env[call.output] = graph.call_module(call.name, (lookup(call.input),))
        env[call.output].meta = dict(call.output.meta)
        position = call.end
    if piece.outputs is not None:
        graph.output(tuple(lookup(value) for value in piece.outputs))
    else:
        (output,) = info.graph.find_nodes(op="output")
        graph.output(fx.map_arg(output.args[0], lookup))
    graph.lint()
    return graph


def _size(node: fx.Node, graph: fx.Graph, env: dict[fx.Node, Any], piece: Piece,
          lookup: Callable[[fx.Node], Any]) -> Any:
    """Size arithmetic recomputed in the block: from a tensor it has with the same size."""
    value = node.meta["val"]
    if isinstance(value, int):
        return value
    if node.target != torch.ops.aten.sym_size.int:
        return graph.node_copy(node, lookup)
    tensor, dim = node.args
    assert isinstance(tensor, fx.Node)  # sym_size.int(tensor, dim)
    if tensor not in env:
        wanted = symbolic_dim(value, piece.info.symbols)
        tensor, dim = next((v, d) for v in piece.inputs for d, size in
                           enumerate(v.meta["val"].shape)
                           if symbolic_dim(size, piece.info.symbols) == wanted)
    size = graph.call_function(torch.ops.aten.sym_size.int, (env[tensor], dim))
    size.meta = dict(node.meta)
    return size


def compile_graph(graph: fx.Graph, label: str) -> tuple[Callable[..., Any], str]:
    """The function ``forward(self, *inputs)`` of ``graph`` (``get_attr`` reads ``self``) and
    its source."""
    code = graph.python_code(root_module="self")
    filename = f"<tandem block {label}>"
    linecache.cache[filename] = (len(code.src), None, code.src.splitlines(True), filename)
    namespace = dict(code.globals)
    exec(compile(code.src, filename, "exec"), namespace)  # noqa: S102 - fx's own code
    return namespace["forward"], code.src


def on_device(graph: fx.Graph, device: torch.device) -> fx.Graph:
    """A copy of ``graph`` whose meta-device arguments name ``device``: a trace on the meta
    device bakes the device into the calls that make or check tensors (``arange(...,
    device=meta)``, ``_assert_tensor_metadata``)."""
    def retarget(value: Any) -> Any:
        return device if isinstance(value, torch.device) and value.type == "meta" else value

    copy, env = fx.Graph(), dict[fx.Node, fx.Node]()
    for node in graph.nodes:
        env[node] = copy.node_copy(node, env.__getitem__)
        env[node].args = fx.node.map_aggregate(env[node].args, retarget)
        env[node].kwargs = fx.node.map_aggregate(env[node].kwargs, retarget)
    return copy


@dataclasses.dataclass(frozen=True, slots=True)
class BlockCode:
    """How a block runs: its compiled graphs and, at the ends of the model, the pytree specs."""

    label: str
    graphs: dict[bool, fx.Graph]
    """``self.training`` -> the block's graph."""
    functions: dict[bool, Callable[..., Any]]
    """``self.training`` -> ``forward(self, *tensors)``, compiled from its graph."""
    sources: dict[bool, str]
    in_spec: pytree.TreeSpec | None
    """First block: how the model's ``(args, kwargs)`` flatten into its inputs."""
    out_spec: pytree.TreeSpec | None
    """Last block: how its outputs build the model's output."""

    def __deepcopy__(self, memo: dict[int, Any]) -> BlockCode:
        return self  # immutable: a copied block runs the same code on its own tensors

    def on_device(self, device: torch.device) -> BlockCode:
        """This code with its graphs' meta-device arguments on ``device`` (:func:`on_device`)."""
        graphs = {mode: on_device(graph, device) for mode, graph in self.graphs.items()}
        compiled = {mode: compile_graph(graph, f"{self.label} ({'train' if mode else 'eval'})")
                    for mode, graph in graphs.items()}
        return dataclasses.replace(self, graphs=graphs,
                                   functions={mode: c[0] for mode, c in compiled.items()},
                                   sources={mode: c[1] for mode, c in compiled.items()})


class Block(nn.Module):
    """One block of a model split by :func:`tandem.split.split_model`."""

    leaf_names: tuple[str, ...] = ()
    """The modules it calls as modules (:mod:`tandem.split.leaf`), in the model's order."""

    def __init__(self, code: BlockCode) -> None:
        super().__init__()
        self._code = code

    @property
    def label(self) -> str:
        """The modules the block runs, e.g. ``transformer.h.3``."""
        return self._code.label

    @property
    def code(self) -> str:
        """The Python source of the block's training-mode graph."""
        return self._code.sources[True]

    def forward(self, inputs: Any) -> Any:
        """The tensors live at the block's end (the model's output for the last block)."""
        code = self._code
        if code.in_spec is not None:
            flat: Sequence[Any] = fx_pytree.tree_flatten_spec(call_args(inputs), code.in_spec)
        else:
            flat = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        result = code.functions[self.training](self, *flat)
        if code.out_spec is not None:
            return pytree.tree_unflatten(list(result), code.out_spec)
        return tuple(result)

    def extra_repr(self) -> str:
        return self.label

    def place_code(self, device: torch.device) -> None:
        """Run on ``device`` what a trace on the meta device made (:func:`on_device`)."""
        self._code = self._code.on_device(device)


def attach(block: nn.Module, name: str, value: Any, *, persistent: bool = True) -> None:
    """Register ``value`` (a parameter, a buffer, a constant or a module) at the dotted
    ``name`` of ``block``, creating empty modules along the path."""
    *path, leaf = name.split(".")
    owner = block
    for part in path:
        child = owner._modules.get(part)
        if child is None:
            child = nn.Module()
            owner.add_module(part, child)
        owner = child
    if isinstance(value, nn.Parameter):
        owner.register_parameter(leaf, value)
    elif isinstance(value, torch.Tensor):
        owner.register_buffer(leaf, value, persistent=persistent)
    elif isinstance(value, nn.Module):
        owner.add_module(leaf, value)
    else:
        setattr(owner, leaf, value)
