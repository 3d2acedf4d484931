"""Where a traced graph may be cut into blocks, and which values cross each cut.

The graph's computing nodes, in execution order, are numbered ``0..N-1``; a *cut at p* starts
a new block with node ``p``. Every node is owned by the module whose code ran it (from the
tracer's ``nn_module_stack``), so cuts can fall between modules at any depth of the model's
tree (``transformer.h.3`` is depth 3). Parameters and buffers (``get_attr``) belong to no
block: each block that uses one holds it. Shape arithmetic on the batch size (and on the
inputs' other sizes where batches vary, see :func:`~tandem.split.trace.trace`; ``SymInt``
nodes) is recomputed in every block that needs it, from the tensors the block receives.

No cut may fall where it would change what the model computes: inside an in-place update of a
tensor and its views, between the uses of a parameter or buffer that is updated in place
(BatchNorm's statistics stay with one block), inside a ``no_grad`` region, or where a value
that is not a tensor (a list, a context) or a tensor whose size is not a function of the
inputs' sizes would have to cross.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import defaultdict
from typing import Any

import sympy
import torch
from torch import fx, nn

from tandem.split.spec import symbolic_dim
from tandem.split.trace import size_symbols

UPDATED_STATISTICS = ("running_mean", "running_var")
"""Arguments that BatchNorm-like ops update in training although their schema does not say so."""
GUARDS = "_guards_fn"
"""The call_module node torch.export adds to check its guards; not part of the model."""


@dataclasses.dataclass(slots=True)
class GraphInfo:
    """The computing nodes of a traced graph, their owners and the cuts allowed between them."""

    graph: fx.Graph
    nodes: list[fx.Node]
    """Computing nodes in execution order (no placeholders, get_attrs, output, scalars)."""
    owners: list[tuple[str, ...]]
    """Path of the module that ran each node (``("transformer", "h", "0")``; ``()``: top)."""
    forbidden: list[str | None]
    """Per position ``p``: why no cut may fall before ``nodes[p]`` (None: a cut may)."""
    symbols: dict[sympy.Symbol, sympy.Symbol]
    """The trace's symbols of the inputs' sizes -> tandem's (:func:`~tandem.split.trace.
    size_symbols`)."""
    scalars: set[fx.Node]
    """Size arithmetic on the inputs' sizes, recomputed by every block that needs it."""
    placeholders: list[fx.Node]
    first: dict[fx.Node, int]
    """Value -> index of its definition (placeholders: -1)."""
    last: dict[fx.Node, int]
    """Value -> index of its last use (``len(nodes)``: the output)."""

    def crossing(self, position: int) -> list[fx.Node]:
        """The values computed before ``position`` and used at or after it, in order."""
        return [v for v, start in self.first.items() if start < position <= self.last[v]]

    def depth(self) -> int:
        """Depth of the deepest module that owns a node."""
        return max((len(owner) for owner in self.owners), default=0)

    def run_starts(self, depth: int) -> list[tuple[int, tuple[str, ...], int]]:
        """``(position, unit, occurrence)`` where the owning module, cut at ``depth``, changes:
        ``occurrence`` counts the earlier runs of the same unit."""
        starts = []
        seen: dict[tuple[str, ...], int] = defaultdict(int)
        previous: tuple[str, ...] | None = None
        for position, owner in enumerate(self.owners):
            unit = owner[:depth]
            if unit != previous:
                starts.append((position, unit, seen[unit]))
                seen[unit] += 1
            previous = unit
        return starts


def analyse(gm: fx.GraphModule, model: nn.Module) -> GraphInfo:
    """The computing nodes of ``gm`` (a trace of ``model``) and where cuts may fall."""
    graph = gm.graph
    symbols = size_symbols(graph)
    scalars = _scalars(graph, symbols)
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "get_attr", "output")
             and n.target != GUARDS and n not in scalars]
    index = {node: i for i, node in enumerate(nodes)}
    placeholders = list(graph.find_nodes(op="placeholder"))
    first = {**{p: -1 for p in placeholders}, **index}
    last = {value: _last_use(value, index, len(nodes)) for value in first}
    info = GraphInfo(graph=graph, nodes=nodes, owners=[_owner(n, model) for n in nodes],
                     forbidden=[None] * (len(nodes) + 1), symbols=symbols, scalars=scalars,
                     placeholders=placeholders, first=first, last=last)
    info.forbidden[0] = info.forbidden[-1] = "a block cannot be empty"
    _forbid_non_tensors(info)
    _forbid_in_place(info, index)
    _forbid_no_grad(info)
    _forbid_lost_sizes(info, index, scalars)
    return info


def _scalars(graph: fx.Graph, symbols: dict[sympy.Symbol, sympy.Symbol]) -> set[fx.Node]:
    found: set[fx.Node] = set()
    for node in graph.nodes:
        value = node.meta.get("val")
        if node.op != "call_function" or not isinstance(value, (torch.SymInt, int)) or \
                isinstance(value, bool) or symbolic_dim(value, symbols) is None:
            continue
        args = [a for a in _node_args(node)]
        if node.target == torch.ops.aten.sym_size.int or all(a in found for a in args):
            found.add(node)
    return found


def _node_args(node: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.map_arg((node.args, node.kwargs), lambda a: found.append(a) or a)  # type: ignore[func-returns-value]
    return found


def _last_use(value: fx.Node, index: dict[fx.Node, int], end: int) -> int:
    """Position of the last computing node (or the output, ``end``) that reads ``value``;
    size arithmetic does not count: it is recomputed from whatever tensor a block has."""
    last = index.get(value, -1)
    for user in value.users:
        if user.op == "output":
            last = end
        elif user in index:
            last = max(last, index[user])
    return last


def _owner(node: fx.Node, model: nn.Module) -> tuple[str, ...]:
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        if not path:
            return ()
        try:
            model.get_submodule(path)
        except AttributeError:
            continue
        return tuple(path.split("."))
    return ()


def _forbid(info: GraphInfo, start: int, end: int, reason: str) -> None:
    """No cut at positions ``start + 1 .. end``: nodes ``start..end`` stay in one block."""
    for position in range(max(start + 1, 1), min(end, len(info.nodes) - 1) + 1):
        if info.forbidden[position] is None:
            info.forbidden[position] = reason


def _forbid_non_tensors(info: GraphInfo) -> None:
    for value, start in info.first.items():
        meta = value.meta.get("val")
        if not isinstance(meta, torch.Tensor):
            _forbid(info, start, info.last[value],
                    f"{value.name} (a {type(meta).__name__}, not a tensor) would cross it")
        elif any(symbolic_dim(size, info.symbols) is None for size in meta.shape):
            _forbid(info, start, info.last[value],
                    f"{value.name}'s shape {tuple(meta.shape)} would cross it and depends on "
                    f"more than the inputs' sizes")


def alias_source(node: fx.Node) -> fx.Node | None:
    """The value ``node``'s result is a view of, or updates in place (None for a new tensor)."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        base = node.args[0]
        return alias_source(base) if isinstance(base, fx.Node) else None
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns or schema.returns[0].alias_info is None:
        return None
    returned = set(schema.returns[0].alias_info.before_set)
    for argument, value in _bound(node, schema):
        if argument.alias_info is not None and isinstance(value, fx.Node) and \
                returned & set(argument.alias_info.before_set):
            return value
    return None


def alias_root(node: fx.Node) -> fx.Node:
    """The tensor whose memory ``node`` shares, following views and in-place results."""
    while (source := alias_source(node)) is not None:
        node = source
    return node


def written(node: fx.Node) -> list[fx.Node]:
    """The values ``node`` updates in place."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None:
        return []
    found: list[fx.Node] = []
    for argument, value in _bound(node, schema):
        if (argument.alias_info is not None and argument.alias_info.is_write) or \
                argument.name in UPDATED_STATISTICS:
            values = value if isinstance(value, (list, tuple)) else [value]
            found += [v for v in values if isinstance(v, fx.Node)]
    return found


def _bound(node: fx.Node, schema: Any) -> list[tuple[Any, Any]]:
    pairs = []
    for position, argument in enumerate(schema.arguments):
        if position < len(node.args):
            pairs.append((argument, node.args[position]))
        elif argument.name in node.kwargs:
            pairs.append((argument, node.kwargs[argument.name]))
    return pairs


def _forbid_in_place(info: GraphInfo, index: dict[fx.Node, int]) -> None:
    """An in-place update stays in one block with the views it goes through; a parameter or
    buffer updated in place stays in one block with all its uses."""
    members: dict[fx.Node, list[int]] = defaultdict(list)
    state_uses: dict[str, list[int]] = defaultdict(list)
    for node, position in index.items():
        root = alias_root(node)
        if root is not node:
            members[root].append(position)
        for arg in _node_args(node):
            arg_root = alias_root(arg)
            if arg_root.op == "get_attr":
                state_uses[str(arg_root.target)].append(position)
    for node, position in index.items():
        for value in written(node):
            root = alias_root(value)
            if root.op == "get_attr":
                uses = state_uses[str(root.target)]
                _forbid(info, min(uses), max(uses),
                        f"{root.target} is updated in place ({node.name}) and used on both sides")
            else:
                group = [p for p in members[root] if p <= position] + [position]
                _forbid(info, min(group), position,
                        f"{node.name} updates a view of {root.name} in place")


def _forbid_no_grad(info: GraphInfo) -> None:
    disabled_at = None
    for position, node in enumerate(info.nodes):
        if node.target is torch._C._set_grad_enabled:
            if not node.args[0] and disabled_at is None:
                disabled_at = position
            elif node.args[0] and disabled_at is not None:
                _forbid(info, disabled_at, position, "it is inside a no_grad region")
                disabled_at = None
    if disabled_at is not None:
        _forbid(info, disabled_at, len(info.nodes), "it is inside a no_grad region")


def _forbid_lost_sizes(info: GraphInfo, index: dict[fx.Node, int], scalars: set[fx.Node]) -> None:
    """A block recomputes the inputs' size arithmetic from a tensor it receives: some crossing
    tensor must have every size that later nodes read from tensors computed earlier."""
    end = len(info.nodes)
    reads: dict[int, set[tuple[sympy.Expr, int]]] = defaultdict(set)
    users = [*index.items(), *((n, end) for n in info.graph.find_nodes(op="output"))]
    for node, position in users:
        for leaf in _size_leaves(node, scalars):
            expr = symbolic_dim(leaf.meta["val"], info.symbols)
            if not isinstance(expr, int):
                reads[position].add((expr, info.first.get(leaf.args[0], -1)))  # type: ignore[arg-type]
    alive = _alive_sizes(info)
    pending: set[tuple[Any, int]] = set()
    for position in range(end, 0, -1):
        pending |= reads.get(position, set())
        if position == end or info.forbidden[position] is not None:
            continue
        needed = {expr for expr, defined in pending if defined < position}
        if needed - alive[position]:
            info.forbidden[position] = "no tensor crossing it carries the inputs' sizes"


def _alive_sizes(info: GraphInfo) -> list[set[Any]]:
    """Per position, the sizes of the tensors that cross it."""
    starts: dict[int, list[fx.Node]] = defaultdict(list)
    for value, defined in info.first.items():
        if isinstance(value.meta.get("val"), torch.Tensor):
            starts[defined + 1].append(value)
    counts: dict[Any, int] = defaultdict(int)
    ends: dict[int, list[Any]] = defaultdict(list)
    sizes: list[set[Any]] = []
    for position in range(len(info.nodes) + 1):
        for value in starts.get(position, []):
            if info.last[value] < position:
                continue
            dims = {symbolic_dim(size, info.symbols) for size in value.meta["val"].shape}
            for dim in dims:
                counts[dim] += 1
            ends[info.last[value] + 1].append(dims)
        for dims in ends.pop(position, []):
            for dim in dims:
                counts[dim] -= 1
        sizes.append({dim for dim, count in counts.items() if count > 0})
    return sizes


def _size_leaves(node: fx.Node, scalars: set[fx.Node]) -> list[fx.Node]:
    """The ``sym_size`` nodes the scalar arguments of ``node`` are computed from."""
    leaves, stack = [], [a for a in _node_args(node) if a in scalars]
    while stack:
        scalar = stack.pop()
        if scalar.target == torch.ops.aten.sym_size.int:
            leaves.append(scalar)
        else:
            stack += [a for a in _node_args(scalar) if a in scalars]
    return leaves
