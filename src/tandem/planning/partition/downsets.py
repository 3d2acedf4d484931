"""Counting the down-sets of a DAG without listing them (the cut states of branchy profiles).

A DAG here is given by each node's producers and consumers as bit masks. The number of
down-sets (sets closed under "is fed by") of a node set is found by splitting: independent
parts multiply, and the down-sets either contain a pivot node (with all its ancestors) or do
not (nor any of its descendants). Series parts (a node comparable with every other) make this a
sum of smaller counts, parallel branches a product, so an Inception-style module of four
9-layer branches (10,000 down-sets) takes a few dozen steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.profile import ModelProfile, topological_order

MAX_STEPS = 200_000
"""Give up counting (report :data:`TOO_MANY`) after this many splits: a DAG with no series or
parallel structure to exploit."""
TOO_MANY = 10**18
"""The count reported when counting gave up (more than any profile can be planned with)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Dag:
    """A DAG's nodes in one topological order, with bit masks of their neighbours and closures."""

    order: list[int]
    """The nodes in a topological order (ties by index)."""
    producers: list[int]
    """``producers[v]``: bit mask of the nodes feeding ``v``."""
    consumers: list[int]
    """``consumers[v]``: bit mask of the nodes ``v`` feeds."""
    down: list[int]
    """``down[v]``: ``v`` and every node it depends on."""
    up: list[int]
    """``up[v]``: ``v`` and every node depending on it."""

    @property
    def num_nodes(self) -> int:
        """Number of nodes."""
        return len(self.order)

    @property
    def everything(self) -> int:
        """The mask of all nodes."""
        return (1 << len(self.order)) - 1


def dag_of_edges(num_nodes: int, edges: list[tuple[int, int]]) -> Dag:
    """The :class:`Dag` of ``edges`` (``(producer, consumer)`` pairs over ``0..num_nodes-1``)."""
    producers = [0] * num_nodes
    consumers = [0] * num_nodes
    for producer, consumer in edges:
        producers[consumer] |= 1 << producer
        consumers[producer] |= 1 << consumer
    order = topological_order(num_nodes, edges)
    down = [0] * num_nodes
    for node in order:
        mask = 1 << node
        for producer in bits(producers[node]):
            mask |= down[producer]
        down[node] = mask
    up = [0] * num_nodes
    for node in reversed(order):
        mask = 1 << node
        for consumer in bits(consumers[node]):
            mask |= up[consumer]
        up[node] = mask
    return Dag(order=order, producers=producers, consumers=consumers, down=down, up=up)


def dag_of_profile(profile: ModelProfile) -> Dag:
    """The :class:`Dag` of a profile's layers (a chain's implicit edges included)."""
    return dag_of_edges(profile.num_layers, profile.edge_list())


def bits(mask: int) -> list[int]:
    """The set bits of ``mask``, ascending."""
    found = []
    while mask:
        low = mask & -mask
        found.append(low.bit_length() - 1)
        mask ^= low
    return found


def count_grown(dag: Dag, first: int, cap: int) -> int:
    """The down-sets grown from ``first`` (a source) by adding, again and again, the down-set of
    a node fed by the set: the partitioner's states. Stops counting at ``cap``."""
    feeds = [0] * dag.num_nodes  # every node fed by the down-set of a node
    for node in dag.order:
        feeds[node] = dag.consumers[node]
        for producer in bits(dag.producers[node]):
            feeds[node] |= feeds[producer]
    fed = {dag.down[first]: feeds[first]}
    frontier = [dag.down[first]]
    while frontier and len(fed) < cap:
        state = frontier.pop()
        for node in bits(fed[state] & ~state):
            grown = state | dag.down[node]
            if grown not in fed:
                fed[grown] = fed[state] | feeds[node]
                frontier.append(grown)
    return min(len(fed), cap)


def count_down_sets(dag: Dag, nodes: int) -> int:
    """Subsets of ``nodes`` closed under producers within ``nodes`` (the empty set included).

    ``nodes`` must be convex (no path leaves it and comes back), so that its own order is the
    DAG's. Returns :data:`TOO_MANY` when the DAG resists splitting for :data:`MAX_STEPS` steps.
    """
    memo: dict[int, int] = {0: 1}
    steps = [0]
    try:
        return _count(dag, nodes, memo, steps)
    except _GaveUp:
        return TOO_MANY


class _GaveUp(Exception):
    pass


def _count(dag: Dag, nodes: int, memo: dict[int, int], steps: list[int]) -> int:
    if nodes in memo:
        return memo[nodes]
    steps[0] += 1
    if steps[0] > MAX_STEPS:
        raise _GaveUp
    parts = _components(dag, nodes)
    if len(parts) > 1:
        total = 1
        for part in parts:
            total *= _count(dag, part, memo, steps)
    else:
        pivot = _pivot(dag, nodes)
        without = _count(dag, nodes & ~dag.up[pivot], memo, steps)
        total = without + _count(dag, nodes & ~dag.down[pivot], memo, steps)
    memo[nodes] = total
    return total


def _components(dag: Dag, nodes: int) -> list[int]:
    """``nodes`` split into parts with no order between them."""
    parts = []
    left = nodes
    while left:
        part = left & -left
        frontier = part
        while frontier:
            node = (frontier & -frontier).bit_length() - 1
            frontier &= frontier - 1
            grown = (dag.down[node] | dag.up[node]) & left & ~part
            part |= grown
            frontier |= grown
        parts.append(part)
        left &= ~part
    return parts


def _pivot(dag: Dag, nodes: int) -> int:
    """The node comparable with the most others, closest to the middle on ties."""
    size = nodes.bit_count()
    best, best_key = -1, (-1, 0)
    for node in bits(nodes):
        below = (dag.down[node] & nodes).bit_count()
        above = (dag.up[node] & nodes).bit_count()
        key = (below + above, -abs(below - above))
        if key > best_key:
            best, best_key = node, key
        if below + above - 1 == size and below - above in (0, 1, -1):
            break
    return best
