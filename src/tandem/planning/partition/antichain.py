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
from tandem.planning.partition.downsets import bits
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


def count_states(profile: ModelProfile, cap: int) -> int:
    """The number of states of ``profile``, or ``cap`` when there are at least that many.

    The states are grown as :func:`build_states` grows them, but only counted, and never more
    than ``cap`` of them: cheap for a profile whose states explode.
    """
    if profile.is_chain:
        return min(profile.num_layers, cap)
    from tandem.planning.partition.downsets import count_grown, dag_of_profile

    dag = dag_of_profile(profile)
    first = min(i for i in range(profile.num_layers) if not dag.producers[i])
    return count_grown(dag, first, cap)


def _words(masks: list[int], num_layers: int) -> np.ndarray:
    """The masks as rows of 64-bit words (``[s, w]``: layers ``64 w .. 64 w + 63`` of state s)."""
    width = 8 * ((num_layers + 63) // 64)
    raw = b"".join(m.to_bytes(width, "little") for m in masks)
    return np.frombuffer(raw, dtype="<u8").reshape(len(masks), width // 8)


def _membership(words: np.ndarray, num_layers: int) -> np.ndarray:
    """``[s, i]``: 1.0 when layer i is in state s."""
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
    return bits[:, :num_layers].astype(np.float64)


def _strict_subsets(words: np.ndarray) -> np.ndarray:
    """``[k, j]``: state k is a strict subset of state j (states are distinct)."""
    outside = np.zeros((len(words), len(words)), dtype=bool)  # [k, j]: k has a layer j lacks
    for column in words.T:
        outside |= (column[:, None] & ~column[None, :]) != 0
    return ~outside & ~np.eye(len(words), dtype=bool)


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


def _layer_masks(num_layers: int, producers: list[list[int]], order: list[int],
                 consumers: list[int]) -> tuple[list[int], list[int], list[int]]:  # fmt: skip
    """Per layer ``a``: its down-set, every layer its down-set feeds, and its augmentation.

    The augmentation of ``a`` is every other layer of ``down(a)`` that feeds a layer outside
    ``down(a)`` (PipeDream's augmented antichain adds these below each maximal layer). Such a
    layer also feeds outside the down-set of the producer of ``a`` it lies under, so the
    candidates are the producers' open layers: those feeding outside their own down-set.
    """
    down = _down_sets(num_layers, producers, order)
    feeds = [0] * num_layers
    open_layers = [0] * num_layers
    for layer in order:
        feeds[layer] = consumers[layer]
        candidates = 0
        for producer in producers[layer]:
            feeds[layer] |= feeds[producer]
            candidates |= open_layers[producer]
        inside = down[layer]
        kept = [i for i in bits(candidates) if consumers[i] & ~inside]
        open_layers[layer] = sum(1 << i for i in kept) | (1 << layer if consumers[layer] else 0)
    augment = [mask & ~(1 << layer) for layer, mask in enumerate(open_layers)]
    return down, feeds, augment


def _reachable(start: int, first: int, down: list[int], feeds: list[int],
               consumers: list[int]) -> dict[int, int]:  # fmt: skip
    """Every state grown from ``start`` (the down-set of layer ``first``), with its maximal layers.

    A state ``S`` grows by ``down(v)`` for each layer ``v`` fed by ``S`` but outside it. The
    maximal layers of the grown state are ``v`` and those of ``S`` that feed nothing in ``down(v)``.
    """
    maximal = {start: 1 << first}
    fed = {start: feeds[first]}
    frontier = [start]
    while frontier:
        state = frontier.pop()
        for layer in bits(fed[state] & ~state):
            grown = state | down[layer]
            if grown in maximal:
                continue
            if len(maximal) >= MAX_STATES:
                raise UsageError(
                    f"the profile's DAG has more than {MAX_STATES} cut states (too many "
                    "parallel branches): plan with make_plan, which merges branches "
                    "(tandem.planning.partition.branches), or merge them into blocks in the profile"
                )
            kept = [a for a in bits(maximal[state]) if not consumers[a] & down[layer]]
            maximal[grown] = sum(1 << a for a in kept) | (1 << layer)
            fed[grown] = fed[state] | feeds[layer]
            frontier.append(grown)
    return maximal


def _cut_bytes(maximal: int, augment: list[int], acts: list[float]) -> float:
    """Summed activations of the augmented antichain: maximal layers and their augmentations."""
    tops = bits(maximal)
    frontier = set(tops)
    for top in tops:
        frontier.update(bits(augment[top]))
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
    down, feeds, augment = _layer_masks(n, producers, topological_order(n, edges), consumers)
    first_source = min(i for i in range(n) if not producers[i])
    maximal = _reachable(down[first_source], first_source, down, feeds, consumers)
    masks = sorted(maximal, key=lambda mask: (mask.bit_count(), mask))
    acts = [lay.activation_bytes for lay in profile.layers]
    words = _words(masks, n)
    compute, params, stash = _sums(profile, _membership(words, n))
    return States(
        masks=masks,
        below=_strict_subsets(words),
        compute_s=compute,
        parameter_bytes=params,
        activation_bytes=stash,
        cut_bytes=np.array([_cut_bytes(maximal[m], augment, acts) for m in masks]),
    )
