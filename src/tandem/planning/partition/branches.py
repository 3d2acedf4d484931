"""Branch compression: merge a DAG profile's parallel branches until its cut states are few.

Usage::

    compression = compress_for_planning(profile)   # the profile itself when its states are few
    plan = compression.expand(make_plan(compression.profile, cluster))   # on the real layers
    compression.report     # None, or "merged 819 layers into 91 branch groups: ..."

A branchy profile (Inception-style modules of parallel branches) has a number of stage
boundaries (*states*) that multiplies across the branches of a module, and the partitioner's
tables grow with its square. As PipeDream's optimizer merges branches before planning, this
module merges sets of layers into single layers until the states are at most ``max_states``:

* a *branch*: a run of layers each fed only by the previous one (PipeDream merges these);
* a *fork region*: everything after a layer with several consumers up to and including the
  first layer every path from it reaches (a whole module, ending at its concatenation);
* a *segment*: everything strictly between two layers comparable with every layer (the
  profile's series points), plus the second one.

Only sets with a single exit are merged (one member, the exit, is fed by all the others
and no other member feeds a layer outside the set). The states of the merged profile are then
exactly the original states that cut through no merged set, with the same compute, parameter,
stashed-activation and boundary-activation totals: a merged layer's activation is its exit's
(what crosses a boundary after it), and the outputs of its other members, which a stage
stashes for backward, are carried by a zero-cost extra input layer (listed with no original
layers in ``groups``). So planning the merged profile is planning the original one with fewer
boundaries to choose from: never a better plan, the same one whenever the best plan cuts no
merged set.

Merges go where the states are: per segment, smallest sets first (innermost first), until no
segment has more than a common number of states and their total is at most ``max_states``;
segments then take back finer merges while the total stays within it.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass

from tandem.errors import UsageError
from tandem.plan import Plan
from tandem.planning.partition.antichain import MAX_STATES, count_states
from tandem.planning.partition.downsets import (
    TOO_MANY, Dag, bits, count_down_sets, count_grown, dag_of_edges, dag_of_profile,
)
from tandem.profile import LayerProfile, ModelProfile

DEFAULT_MAX_STATES = 1_000
"""Merge branches when a profile has more states than this. The partitioner's tables grow with
the square of the states: on the development machine 500 states plan in 0.1 s on 16 devices,
1,000 in about 3 s, 2,500 in 25 s (ResNet-50 has 240, GNMT 99)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Compression:
    """A profile prepared for planning: the original, the one to plan, and how they map."""

    original: ModelProfile
    """The user's profile."""
    profile: ModelProfile
    """The profile to plan: ``original`` itself when nothing was merged."""
    groups: list[list[int]]
    """Per layer of ``profile``, the original layers it stands for, in a topological order
    (empty for a layer that only carries merged members' stashed activations)."""
    states_before: int
    """States of ``original`` (at most ``max_states + 1`` when nothing was merged; a lower bound
    when merging a DAG with several inputs, whose first part is counted up to that cap)."""
    states_after: int
    """States of ``profile``."""
    report: str | None
    """One line saying what was merged, or None when nothing was."""

    @property
    def merged(self) -> bool:
        """True when ``profile`` differs from ``original``."""
        return self.report is not None

    def expand(self, plan: Plan) -> Plan:
        """``plan`` (made for ``profile``) on the original layers; itself when nothing merged."""
        if self.report is None:
            return plan
        expanded = expand_plan(plan, self.groups, self.original)
        expanded.options = {**plan.options, "branch_compression": self.report}
        return expanded


def compress_for_planning(
    profile: ModelProfile, max_states: int = DEFAULT_MAX_STATES
) -> Compression:
    """``profile`` with branches merged when it has more than ``max_states`` states.

    When merging cannot bring the states down to ``max_states`` (a long model rather than a
    wide one), the profile is left alone if the partitioner accepts it as it is, and merged as
    far as possible otherwise.
    """
    if max_states < 1:
        raise UsageError(f"max_states must be at least 1 (got {max_states})")
    if profile.is_chain:
        return _unchanged(profile, min(profile.num_layers, max_states + 1))
    counted = count_states(profile, max_states + 1)
    if counted <= max_states:
        return _unchanged(profile, counted)
    dag = dag_of_profile(profile)
    post_dominators = _post_dominators(dag)
    segments = [_with_counts(dag, post_dominators, segment, max_states + 1)
                for segment in _segments(dag)]  # fmt: skip
    before = sum(segment.counts[0] for segment in segments)
    merges = _choose(segments, max_states)
    if merges is None:
        exact = count_states(profile, MAX_STATES + 1)
        if exact <= MAX_STATES:
            return _unchanged(profile, exact)
        merges = [len(segment.candidates) for segment in segments]
    groups = [group for segment, k in zip(segments, merges)
              for group in _outermost(segment.candidates[:k])]  # fmt: skip
    if not groups:
        return _unchanged(profile, before)
    compressed, members = _compressed_profile(profile, dag, groups)
    after = count_states(compressed, MAX_STATES + 1)
    merged_layers = sum(group.bit_count() for group in groups)
    shown = "too many to count" if before >= TOO_MANY else f"{before:,}"
    if segments[0].grown and segments[0].counts[0] > max_states:
        shown = f"at least {before:,}"  # counting stopped at the cap
    report = (f"merged {merged_layers} layers into {len(groups)} branch groups: {shown} cut states "
              f"-> {after:,} (limit {max_states:,})")
    return Compression(original=profile, profile=compressed, groups=members, states_before=before,
                       states_after=after, report=report)  # fmt: skip


def compress_branches(
    profile: ModelProfile, max_states: int = DEFAULT_MAX_STATES
) -> tuple[ModelProfile, list[list[int]]]:
    """The profile to plan and, per layer of it, the original layers it covers (see
    :func:`compress_for_planning`)."""
    compression = compress_for_planning(profile, max_states)
    return compression.profile, compression.groups


def expand_plan(plan: Plan, groups: list[list[int]], original: ModelProfile) -> Plan:
    """A plan made for a compressed profile, on ``original``'s layers: each stage runs the
    original layers of its merged layers, in a topological order of ``original``."""
    compressed_order = plan.layers()
    if len(compressed_order) != len(groups):
        raise UsageError(f"the plan covers {len(compressed_order)} layers but the compression has "
                         f"{len(groups)}: expand a plan made for the compressed profile")
    order: list[int] = []
    stages = []
    for stage in plan.stages:
        members = [i for layer in compressed_order[stage.start : stage.end] for i in groups[layer]]
        assert members, "a stage holds only stash carriers, which always go with their layer"
        stages.append(dataclasses.replace(stage, start=len(order), end=len(order) + len(members)))
        order.extend(members)
    if sorted(order) != list(range(original.num_layers)):
        raise UsageError("the compression's groups do not cover the original profile's layers "
                         "once each: expand with the groups made for this profile")
    identity = order == list(range(original.num_layers))
    return dataclasses.replace(plan, stages=stages, num_layers=original.num_layers,
                               layer_order=None if identity else order)  # fmt: skip


def _unchanged(profile: ModelProfile, states: int) -> Compression:
    return Compression(original=profile, profile=profile,
                       groups=[[i] for i in range(profile.num_layers)],
                       states_before=states, states_after=states, report=None)  # fmt: skip


# ---- segments and their candidate merges ----------------------------------------------------


@dataclass(kw_only=True, slots=True)
class _Segment:
    """The layers strictly between two series points, and the merges that shrink its states."""

    start: int | None
    """The series point before (None for the part before the first one)."""
    interior: int
    """The layers strictly between the two series points (mask)."""
    exit: int | None
    """The series point after (None for the part after the last one)."""
    grown: bool = False
    """Its states are counted by growing them (the part before the first series point of a
    DAG with several inputs), up to a cap."""
    candidates: list[int] = dataclasses.field(default_factory=list)
    """Mergeable sets, smallest first; each either contains or avoids every earlier one."""
    counts: list[int] = dataclasses.field(default_factory=list)
    """``counts[k]``: the segment's states once its first ``k`` candidates are merged."""


def _segments(dag: Dag) -> list[_Segment]:
    """The profile cut at its series points (layers comparable with every layer).

    Every state either contains a series point or holds nothing after it, so the states are
    the sum over segments of the down-sets of their interiors.
    """
    first = dag.order[0]
    series = [v for v in dag.order if dag.down[v] | dag.up[v] == dag.everything]
    segments = []
    if not series or series[0] != first:
        end = series[0] if series else None
        inside = dag.down[end] & ~(1 << end) if end is not None else dag.everything
        inside &= ~dag.down[first]
        inputs = sum(1 for producers in dag.producers if not producers)
        segments.append(_Segment(start=None, interior=inside, exit=end, grown=inputs > 1))
    for index, point in enumerate(series):
        end = series[index + 1] if index + 1 < len(series) else None
        inside = dag.up[point] & ~(1 << point)
        if end is not None:
            inside &= dag.down[end] & ~(1 << end)
        segments.append(_Segment(start=point, interior=inside, exit=end))
    return segments


def _with_counts(dag: Dag, post_dominators: list[int], segment: _Segment, cap: int) -> _Segment:
    """The segment with its candidate merges and its states after each."""
    segment.candidates = _candidates(dag, post_dominators, segment) if segment.interior else []
    segment.counts = [_segment_states(dag, segment, segment.candidates[:k], cap)
                      for k in range(len(segment.candidates) + 1)]  # fmt: skip
    return segment


def _candidates(dag: Dag, post_dominators: list[int], segment: _Segment) -> list[int]:
    scope = segment.interior | (1 << segment.exit if segment.exit is not None else 0)
    found = set(_branches(dag, segment.interior))
    forks = bits(segment.interior) + ([segment.start] if segment.start is not None else [])
    for fork in forks:
        join = _first_join(dag, post_dominators, fork)
        if dag.consumers[fork].bit_count() > 1 and join is not None and scope >> join & 1:
            found.add(dag.up[fork] & dag.down[join] & ~(1 << fork))
    found.add(scope)
    rank = {node: position for position, node in enumerate(dag.order)}
    accepted: list[int] = []
    for mask in sorted(found, key=lambda m: (m.bit_count(), min(rank[v] for v in bits(m)))):
        if mask.bit_count() > 1 and _single_exit(dag, mask) and _convex(dag, mask) and all(
            other & mask == 0 or other & ~mask == 0 for other in accepted
        ):
            accepted.append(mask)
    return accepted


def _branches(dag: Dag, interior: int) -> list[int]:
    """Maximal runs of two or more interior layers each fed only by the one before it, that one
    feeding nothing else."""
    runs = []
    for node in bits(interior):
        producers = dag.producers[node]
        if producers.bit_count() != 1:
            continue
        before = producers.bit_length() - 1
        if interior >> before & 1 and dag.consumers[before].bit_count() == 1 and \
                dag.producers[before].bit_count() == 1:  # fmt: skip
            continue  # not the head of its run
        run = 1 << node
        while dag.consumers[node].bit_count() == 1:
            after = dag.consumers[node].bit_length() - 1
            if not interior >> after & 1 or dag.producers[after].bit_count() != 1:
                break
            node = after
            run |= 1 << node
        if run.bit_count() > 1:
            runs.append(run)
    return runs


def _post_dominators(dag: Dag) -> list[int]:
    """Per layer, itself and every layer that all paths from it to the model's end pass."""
    found = [0] * dag.num_nodes
    for layer in reversed(dag.order):
        common = None
        for consumer in bits(dag.consumers[layer]):
            common = found[consumer] if common is None else common & found[consumer]
        found[layer] = (1 << layer) | (common or 0)
    return found


def _first_join(dag: Dag, post_dominators: list[int], fork: int) -> int | None:
    """The first layer every path from ``fork`` to the model's end passes (None if the paths
    end at different layers)."""
    after = post_dominators[fork] & ~(1 << fork)
    if not after:
        return None
    return min(bits(after), key=lambda v: dag.down[v].bit_count())


def _single_exit(dag: Dag, mask: int) -> bool:
    """One member feeds nothing inside ``mask``; every other member feeds only inside it."""
    exits = [v for v in bits(mask) if not dag.consumers[v] & mask]
    leaving = [v for v in bits(mask) if dag.consumers[v] & ~mask]
    return len(exits) == 1 and set(leaving) <= set(exits)


def _convex(dag: Dag, mask: int) -> bool:
    """No path leaves ``mask`` and comes back."""
    above = below = 0
    for node in bits(mask):
        above |= dag.up[node]
        below |= dag.down[node]
    return above & below & ~mask == 0


def _outermost(candidates: list[int]) -> list[int]:
    """The candidates not inside a later one (the groups merging them all makes)."""
    return [mask for index, mask in enumerate(candidates)
            if not any(mask & ~later == 0 for later in candidates[index + 1 :])]  # fmt: skip


def _segment_states(dag: Dag, segment: _Segment, merged: list[int], cap: int) -> int:
    """States of the segment once ``merged`` are merged: down-sets of its interior in which
    every merged set is whole, and which leave out the exit's set.

    Before the first series point of a DAG with several inputs, not every down-set is a state
    (an input joins a state only with a layer it feeds): those are grown from the first layer
    as the partitioner grows them, and counted up to ``cap``.
    """
    groups = _outermost(merged)
    nodes = segment.interior
    if segment.exit is not None:
        for group in groups:
            if group >> segment.exit & 1:
                nodes &= ~group
    if segment.grown:
        first = dag.order[0]
        nodes |= dag.down[first]
        quotient, unit_of = _quotient(dag, nodes, [g for g in groups if g & nodes])
        return count_grown(quotient, unit_of[first], cap)
    quotient, _ = _quotient(dag, nodes, [group for group in groups if group & nodes])
    return count_down_sets(quotient, quotient.everything)


def _quotient(dag: Dag, nodes: int, groups: list[int]) -> tuple[Dag, dict[int, int]]:
    """The DAG of ``nodes`` with every group (a subset of ``nodes``) made one node, and the
    node each layer went to."""
    units = list(groups) + [1 << v for v in bits(nodes & ~_union(groups))]
    unit_of = {v: index for index, unit in enumerate(units) for v in bits(unit)}
    edges = set()
    for index, unit in enumerate(units):
        for v in bits(unit):
            for consumer in bits(dag.consumers[v] & nodes & ~unit):
                edges.add((index, unit_of[consumer]))
    return dag_of_edges(len(units), sorted(edges)), unit_of


def _union(masks: list[int]) -> int:
    total = 0
    for mask in masks:
        total |= mask
    return total


def _choose(segments: list[_Segment], max_states: int) -> list[int] | None:
    """Per segment, how many candidates to merge: the fewest that bring every segment to at
    most a common count ``t``, for the largest ``t`` whose total is at most ``max_states``;
    then, segment by segment, the fewer merges of the next larger ``t`` while the total stays
    within ``max_states``. None when even merging every candidate leaves too many states."""
    levels = sorted({count for segment in segments for count in segment.counts}, reverse=True)

    def merges(cap: int) -> list[int]:
        return [next((k for k, c in enumerate(s.counts) if c <= cap), len(s.counts) - 1)
                for s in segments]  # fmt: skip

    def total(chosen: list[int]) -> int:
        return sum(s.counts[k] for s, k in zip(segments, chosen))

    low, high = 0, len(levels) - 1  # total(merges(levels[i])) is non-increasing in i
    if total(merges(levels[high])) > max_states:
        return None
    while low < high:
        middle = (low + high) // 2
        if total(merges(levels[middle])) <= max_states:
            high = middle
        else:
            low = middle + 1
    chosen = merges(levels[low])
    if low > 0:
        spare = max_states - total(chosen)
        for index, fewer in enumerate(merges(levels[low - 1])):
            extra = segments[index].counts[fewer] - segments[index].counts[chosen[index]]
            if extra <= spare:
                chosen[index] = fewer
                spare -= extra
    return chosen


# ---- the compressed profile ----------------------------------------------------------------


def _compressed_profile(
    profile: ModelProfile, dag: Dag, groups: list[int]
) -> tuple[ModelProfile, list[list[int]]]:
    """One layer per group and per unmerged layer, in a topological order that starts with the
    original first layer; then one stash carrier per group whose other members' outputs are
    stashed."""
    rank = {node: position for position, node in enumerate(dag.order)}
    units = list(groups) + [1 << v for v in bits(dag.everything & ~_union(groups))]
    unit_of = {v: index for index, unit in enumerate(units) for v in bits(unit)}
    edges = {(unit_of[a], unit_of[b]) for a in range(dag.num_nodes) for b in bits(dag.consumers[a])
             if unit_of[a] != unit_of[b]}  # fmt: skip
    order = _ordered(len(units), edges, [min(rank[v] for v in bits(u)) for u in units])
    position = {unit: index for index, unit in enumerate(order)}
    layers: list[LayerProfile] = []
    members: list[list[int]] = []
    carriers: list[tuple[LayerProfile, int]] = []
    for unit in order:
        nodes = sorted(bits(units[unit]), key=rank.__getitem__)
        layer, stash = _merged_layer(profile, dag, nodes)
        layers.append(layer)
        members.append(nodes)
        if stash > 0:
            carrier = LayerProfile(name=f"stash of {layer.name}", forward_s=0.0, backward_s=0.0,
                                   activation_bytes=stash, parameter_bytes=0.0)
            carriers.append((carrier, len(layers) - 1))
    new_edges = sorted((position[a], position[b]) for a, b in edges)
    for carrier, owner in carriers:
        new_edges.append((len(layers), owner))
        layers.append(carrier)
        members.append([])
    compressed = ModelProfile(layers=layers, edges=new_edges, model=profile.model,
                              batch_size=profile.batch_size,
                              source=f"{profile.source} (branches merged)")  # fmt: skip
    return compressed, members


def _ordered(count: int, edges: set[tuple[int, int]], keys: list[int]) -> list[int]:
    """A topological order of ``count`` nodes, the smallest key first among those ready."""
    waiting = [0] * count
    after: list[list[int]] = [[] for _ in range(count)]
    for a, b in edges:
        waiting[b] += 1
        after[a].append(b)
    ready = [(keys[u], u) for u in range(count) if not waiting[u]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, unit = heapq.heappop(ready)
        order.append(unit)
        for nxt in after[unit]:
            waiting[nxt] -= 1
            if not waiting[nxt]:
                heapq.heappush(ready, (keys[nxt], nxt))
    return order


def _merged_layer(profile: ModelProfile, dag: Dag, nodes: list[int]) -> tuple[LayerProfile, float]:
    """The layer standing for ``nodes`` (its exit's activation) and the rest of their stash."""
    if len(nodes) == 1:
        return profile.layers[nodes[0]], 0.0
    mask = sum(1 << v for v in nodes)
    exit_node = next(v for v in nodes if not dag.consumers[v] & mask)
    layers = [profile.layers[v] for v in nodes]
    merged = LayerProfile(
        name=f"{len(nodes)} layers: {layers[0].name} .. {profile.layers[exit_node].name}",
        forward_s=sum(layer.forward_s for layer in layers),
        backward_s=sum(layer.backward_s for layer in layers),
        activation_bytes=profile.layers[exit_node].activation_bytes,
        parameter_bytes=sum(layer.parameter_bytes for layer in layers),
    )
    stash = sum(layer.activation_bytes for layer in layers) - merged.activation_bytes
    return merged, stash
