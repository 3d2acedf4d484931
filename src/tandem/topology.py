"""Communication graphs of decentralized training and their doubly stochastic mixing matrices.

Usage::

    graph = build_topology("ring", 16)
    W = mixing_matrix(graph, "metropolis")
    spectral_gap(W)       # 1 - |second largest eigenvalue|: how fast gossip reaches consensus

Pure Python and numpy (planning side).
"""

from __future__ import annotations

import math

import numpy as np

from tandem.errors import UsageError

TOPOLOGIES = ("ring", "torus", "exponential", "complete", "custom")
WEIGHTS = ("uniform", "metropolis")

Graph = list[set[int]]
"""For every node, the set of its neighbours (undirected, no self loops)."""


def _ring(n: int) -> Graph:
    return [{(i - 1) % n, (i + 1) % n} - {i} for i in range(n)]


def _torus_shape(n: int) -> tuple[int, int]:
    rows = max(r for r in range(1, math.isqrt(n) + 1) if n % r == 0)
    if rows < 3:
        raise UsageError(
            f"a torus of {n} workers needs rows x columns with both at least 3 (e.g. 9, 12, 16); "
            f"use --topology ring for {n}"
        )
    return rows, n // rows


def _torus(n: int) -> Graph:
    rows, cols = _torus_shape(n)
    graph: Graph = [set() for _ in range(n)]
    for r in range(rows):
        for c in range(cols):
            node = r * cols + c
            graph[node] |= {((r + 1) % rows) * cols + c, ((r - 1) % rows) * cols + c,
                            r * cols + (c + 1) % cols, r * cols + (c - 1) % cols}
    return graph


def _exponential(n: int) -> Graph:
    hops = [2**k for k in range(max(1, math.ceil(math.log2(n))))]
    return [{(i + h) % n for h in hops} | {(i - h) % n for h in hops} - {i} for i in range(n)]


def _complete(n: int) -> Graph:
    return [set(range(n)) - {i} for i in range(n)]


def _custom(n: int, edges_text: str) -> Graph:
    graph: Graph = [set() for _ in range(n)]
    for item in filter(None, edges_text.split(",")):
        try:
            a, b = (int(x) for x in item.split("-"))
        except ValueError:
            raise UsageError(f"topology edge {item!r} is not of the form A-B, e.g. 0-1") from None
        if not (0 <= a < n and 0 <= b < n) or a == b:
            raise UsageError(f"topology edge {item!r} needs two different workers in 0..{n - 1}")
        graph[a].add(b)
        graph[b].add(a)
    return graph


def build_topology(spec: str, n: int) -> Graph:
    """The graph ``spec`` on ``n`` workers: a kind, or ``custom:0-1,1-2,...`` (an edge list)."""
    if n < 1:
        raise UsageError(f"a topology needs at least 1 worker (got {n})")
    kind, _, rest = spec.partition(":")
    builders = {"ring": _ring, "torus": _torus, "exponential": _exponential, "complete": _complete}
    if kind == "custom":
        graph = _custom(n, rest)
    elif kind in builders and not rest:
        graph = builders[kind](n) if n > 1 else [set()]
    else:
        raise UsageError(f"unknown topology {spec!r}; choose one of: {', '.join(TOPOLOGIES)} "
                         f"(custom:0-1,1-2,... for an edge list)")
    check_connected(graph, spec)
    return graph


def check_connected(graph: Graph, spec: str) -> None:
    """Raise ``UsageError`` unless every worker can reach every other."""
    seen, frontier = {0}, [0]
    while frontier:
        node = frontier.pop()
        for other in graph[node] - seen:
            seen.add(other)
            frontier.append(other)
    if len(seen) != len(graph):
        missing = sorted(set(range(len(graph))) - seen)
        raise UsageError(
            f"topology {spec!r} is not connected: workers {missing[:8]} cannot reach worker 0, so "
            f"gossip never reaches consensus; add edges or use ring"
        )


def mixing_matrix(graph: Graph, weights: str = "metropolis") -> np.ndarray:
    """A symmetric doubly stochastic matrix supported on ``graph`` plus self loops.

    ``uniform``: ``1 / (degree + 1)`` for each neighbour and itself (doubly stochastic only on
    regular graphs); ``metropolis``: Metropolis–Hastings ``1 / (1 + max(d_i, d_j))``, any graph.
    """
    n = len(graph)
    degrees = [len(neighbours) for neighbours in graph]
    if weights == "uniform":
        if len(set(degrees)) > 1:
            raise UsageError("uniform weights need every worker to have as many neighbours; "
                             "use --weights metropolis for this topology")
        matrix = np.zeros((n, n))
        for i, neighbours in enumerate(graph):
            for j in neighbours | {i}:
                matrix[i, j] = 1.0 / (degrees[i] + 1)
        return matrix
    if weights != "metropolis":
        raise UsageError(f"unknown mixing weights {weights!r}; choose one of: {', '.join(WEIGHTS)}")
    matrix = np.zeros((n, n))
    for i, neighbours in enumerate(graph):
        for j in neighbours:
            matrix[i, j] = 1.0 / (1 + max(degrees[i], degrees[j]))
        matrix[i, i] = 1.0 - matrix[i].sum()
    return matrix


def spectral_gap(matrix: np.ndarray) -> float:
    """``1 - max(|λ2|, |λn|)``: the fraction of disagreement one gossip round removes, at least."""
    if len(matrix) == 1:
        return 1.0
    magnitudes = np.sort(np.abs(np.linalg.eigvalsh(matrix)))[::-1]
    return float(1.0 - magnitudes[1])


def two_colouring(graph: Graph) -> list[int]:
    """Colour each worker 0 (active) or 1 (passive) so that every edge joins different colours,
    as AD-PSGD needs (actives only average with passives, so no two wait for each other);
    :class:`UsageError` for a topology that is not bipartite."""
    colours = [-1] * len(graph)
    for first in range(len(graph)):
        if colours[first] >= 0:
            continue
        colours[first], frontier = 0, [first]
        while frontier:
            node = frontier.pop()
            for other in graph[node]:
                if colours[other] < 0:
                    colours[other] = 1 - colours[node]
                    frontier.append(other)
                elif colours[other] == colours[node]:
                    raise UsageError(
                        "--async-gossip (AD-PSGD) needs a bipartite topology so that active workers "
                        "only average with passive ones (no deadlock): use a ring with an even "
                        "number of workers or a torus with even sides")
    return colours
