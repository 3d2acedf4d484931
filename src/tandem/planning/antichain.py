"""Linearization of a profile's DAG into PipeDream's states: the down-sets a pipeline may cut at.

A *state* is a down-set of layers (closed under "feeds into") reachable from the first source:
stage boundaries are a chain of states, so every stage is the difference of two states and no
layer runs before a layer it depends on. This is exactly the set of nodes of PipeDream's
antichain DAG (each antichain is the set of maximal layers of a down-set): starting from the
first source's down-set, a state ``S`` leads to ``S | down(v)`` for every layer ``v`` outside
``S`` with a direct producer in ``S``, and a state precedes another exactly when it is a strict
subset of it. For a chain the states are the prefixes ``0..j``.

The activation a state sends across its boundary is, as in PipeDream, the summed output size of
its *augmented antichain*: its maximal layers plus every layer below some maximal layer ``a``
that feeds a layer outside ``a``'s own down-set.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tandem.errors import UsageError
from tandem.profile import ModelProfile

MAX_STATES = 200_000
"""Refuse DAGs with more states than this (very wide graphs have exponentially many)."""


@dataclass(kw_only=True, slots=True)
class States:
    """The states of a profile in a topological order (smaller sets first)."""

    masks: list[int]
    """Each state's layers as a bit mask over layer indices (bit i = layer i)."""
    below: np.ndarray
    """``below[k, j]``: state k is a strict subset of state j (bool, n x n)."""
    compute_s: np.ndarray
    """Forward + backward seconds of all layers in each state."""
    parameter_bytes: np.ndarray
    """Parameter bytes of all layers in each state."""
    activation_bytes: np.ndarray
    """Summed output activation bytes of all layers in each state (stashed for backward)."""
    cut_bytes: np.ndarray
    """Activation bytes crossing the boundary after each state (augmented antichain)."""

    @property
    def num_states(self) -> int:
        """Number of states; the last one holds every layer."""
        return len(self.masks)

    def layers_between(self, before: int, state: int) -> list[int]:
        """Layer indices in ``state`` but not in ``before`` (-1 for the empty state), ascending."""
        mask = self.masks[state] & ~(self.masks[before] if before >= 0 else 0)
        return [i for i in range(mask.bit_length()) if (mask >> i) & 1]


def build_states(profile: ModelProfile) -> States:
    """The states of ``profile``: prefixes for a chain, reachable down-sets for a DAG."""
    if profile.is_chain:
        return _chain_states(profile)
    return _dag_states(profile)


def _membership(masks: list[int], num_layers: int) -> np.ndarray:
    """``[s, i]``: 1.0 when layer i is in state s."""
    width = (num_layers + 7) // 8
    raw = np.frombuffer(b"".join(m.to_bytes(width, "little") for m in masks), dtype=np.uint8)
    bits = np.unpackbits(raw.reshape(len(masks), width), axis=1, bitorder="little")
    return bits[:, :num_layers].astype(np.float64)


def _sums(profile: ModelProfile, member: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    per_layer = np.array(
        [(lay.forward_s + lay.backward_s, lay.parameter_bytes, lay.activation_bytes)
         for lay in profile.layers], dtype=np.float64)  # fmt: skip
    totals = member @ per_layer
    return totals[:, 0], totals[:, 1], totals[:, 2]


def _chain_states(profile: ModelProfile) -> States:
    n = profile.num_layers
    compute = np.cumsum([lay.forward_s + lay.backward_s for lay in profile.layers])
    params = np.cumsum([lay.parameter_bytes for lay in profile.layers])
    acts = np.array([lay.activation_bytes for lay in profile.layers], dtype=np.float64)
    index = np.arange(n)
    return States(
        masks=[(1 << (j + 1)) - 1 for j in range(n)],
        below=index[:, None] < index[None, :],
        compute_s=np.asarray(compute, dtype=np.float64),
        parameter_bytes=np.asarray(params, dtype=np.float64),
        activation_bytes=np.cumsum(acts),
        cut_bytes=acts.copy(),
    )


def _down_sets(num_layers: int, producers: list[list[int]], order: list[int]) -> list[int]:
    down = [0] * num_layers
    for layer in order:
        mask = 1 << layer
        for producer in producers[layer]:
            mask |= down[producer]
        down[layer] = mask
    return down


def _reachable(num_layers: int, producers: list[list[int]], down: list[int], start: int) -> list[int]:
    inputs = [sum(1 << p for p in producers[layer]) for layer in range(num_layers)]
    seen = {start}
    frontier = [start]
    while frontier:
        state = frontier.pop()
        for layer in range(num_layers):
            if (state >> layer) & 1 or not state & inputs[layer]:
                continue
            grown = state | down[layer]
            if grown not in seen:
                if len(seen) >= MAX_STATES:
                    raise UsageError(
                        f"the profile's DAG has more than {MAX_STATES} cut states (too many "
                        "parallel branches): merge branches into blocks before planning"
                    )
                seen.add(grown)
                frontier.append(grown)
    return sorted(seen, key=lambda mask: (mask.bit_count(), mask))


def _cut_bytes(mask: int, down: list[int], consumers: list[int], acts: list[float]) -> float:
    members = [i for i in range(mask.bit_length()) if (mask >> i) & 1]
    maximal = [a for a in members if not consumers[a] & mask]
    frontier = set(maximal)
    for top in maximal:
        inside = down[top]
        for layer in members:
            if layer != top and (inside >> layer) & 1 and consumers[layer] & ~inside:
                frontier.add(layer)
    return float(sum(acts[i] for i in frontier))


def _dag_states(profile: ModelProfile) -> States:
    from tandem.profile import topological_order

    n = profile.num_layers
    edges = profile.edge_list()
    producers: list[list[int]] = [[] for _ in range(n)]
    consumers = [0] * n
    for producer, consumer in edges:
        producers[consumer].append(producer)
        consumers[producer] |= 1 << consumer
    order = topological_order(n, edges)
    down = _down_sets(n, producers, order)
    first_source = min(i for i in range(n) if not producers[i])
    masks = _reachable(n, producers, down, down[first_source])
    acts = [lay.activation_bytes for lay in profile.layers]
    member = _membership(masks, n)
    compute, params, stash = _sums(profile, member)
    outside = member @ (1.0 - member).T  # [k, j]: layers of k missing from j
    below = (outside == 0) & ~np.eye(len(masks), dtype=bool)
    return States(
        masks=masks,
        below=below,
        compute_s=compute,
        parameter_bytes=params,
        activation_bytes=stash,
        cut_bytes=np.array([_cut_bytes(m, down, consumers, acts) for m in masks]),
    )
