"""Equivalence with PipeDream's optimizer on its three published profiles.

PipeDream's code cannot run here, so this file carries an independent, literal re-derivation
of its procedure (written from reading ``optimizer_graph_hierarchical.py`` and ``graph.py``,
not copied): the antichain DAG is built by PipeDream's own steps (augment an antichain, replace
one node by a successor, drop nodes below another), and the dynamic program is its loop nest
over (state, machines, predecessor state, machines of the last stage). tandem's partitioner
derives the same states differently (down-sets grown by one producer-connected layer) and
solves them with vectorized tables or a parametric search; both must give the same optimum.
``EXPECTED`` records the optimum bottlenecks in seconds (10 Gb/s, flat) for the record.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from tandem.cluster import flat_cluster
from tandem.planning import PartitionOptions
from tandem.planning.partition.pipedream import partition
from tandem.profile import load_profile

pytestmark = pytest.mark.pure

DATA = Path(__file__).parent / "data" / "profiles"
BANDWIDTH_Bps = 1.25e9

# (model, devices, activation_compression) -> optimum bottleneck_s. Configurations are not
# recorded: many plans tie on the bottleneck (see docs/planning.md, section 5).
EXPECTED = {
    ("vgg16", 2, None): 0.370931, ("vgg16", 2, 1.0): 0.381063,
    ("vgg16", 4, None): 0.1744984992, ("vgg16", 4, 1.0): 0.17634916586666669,
    ("vgg16", 8, None): 0.093357134, ("vgg16", 8, 1.0): 0.10084139337142857,
    ("vgg16", 16, None): 0.04658748873086419, ("vgg16", 16, 1.0): 0.05479489083076923,
    ("resnet50", 2, None): 0.221933, ("resnet50", 2, 1.0): 0.285058,
    ("resnet50", 4, None): 0.111497, ("resnet50", 4, 1.0): 0.15199260319999994,
    ("resnet50", 8, None): 0.05622, ("resnet50", 8, 1.0): 0.0822083584,
    ("resnet50", 16, None): 0.029212, ("resnet50", 16, 1.0): 0.04384779004444447,
    ("gnmt", 2, None): 0.045936, ("gnmt", 2, 1.0): 0.045936,
    ("gnmt", 4, None): 0.025868, ("gnmt", 4, 1.0): 0.025868,
    ("gnmt", 8, None): 0.019032, ("gnmt", 8, 1.0): 0.019285,
    ("gnmt", 16, None): 0.017125, ("gnmt", 16, 1.0): 0.017125,
}  # fmt: skip


# ---- PipeDream's procedure, re-derived -----------------------------------------------------


def read_graph(path: Path):
    nodes, edges = {}, []
    for line in path.read_text().splitlines():
        if line.startswith("\t"):
            edges.append(tuple(line.strip().split(" -- ")))
        elif line.strip():
            node_id, desc, meta = line.strip().split(" -- ")[:3]
            values = dict(item.split("=") for item in meta.split(", "))
            act = values["activation_size"]
            act = sum(float(x) for x in act.strip("[]").split("; "))
            nodes[node_id] = (desc, float(values["forward_compute_time"]),
                              float(values["backward_compute_time"]), act,
                              float(values["parameter_size"]))
    inputs = [n for n, v in nodes.items() if v[0].startswith("Input")]
    for n in inputs:
        del nodes[n]
    edges = [e for e in edges if e[0] in nodes and e[1] in nodes]
    out = {n: [b for a, b in edges if a == n] for n in nodes}
    for n in [n for n in nodes if not out[n] and nodes[n][0].startswith("__getitem__")]:
        del nodes[n]
    edges = [e for e in edges if e[0] in nodes and e[1] in nodes]
    return nodes, edges


class Graph:
    def __init__(self, nodes, edges):
        self.nodes = nodes
        self.succ = {n: [b for a, b in edges if a == n] for n in nodes}
        self.pred = {n: [a for a, b in edges if b == n] for n in nodes}
        self._anc, self._desc = {}, {}

    def ancestors(self, n):
        if n not in self._anc:
            found = set()
            for p in self.pred[n]:
                found |= {p} | self.ancestors(p)
            self._anc[n] = found
        return self._anc[n]

    def descendants(self, n):
        if n not in self._desc:
            found = set()
            for s in self.succ[n]:
                found |= {s} | self.descendants(s)
            self._desc[n] = found
        return self._desc[n]

    def augment(self, antichain):
        extra = set()
        for a in antichain:
            below = self.ancestors(a)
            for p in below:
                if any(o not in below and o != a for o in self.succ[p]):
                    extra.add(p)
        return list(extra) + [a for a in antichain if a not in extra]

    def deaugment(self, nodes):
        keep = []
        for n in nodes:
            if not any(m in self.descendants(n) for m in nodes) and n not in keep:
                keep.append(n)
        return keep

    def next_antichains(self, antichain):
        augmented = self.augment(antichain)
        found = []
        for u in augmented:
            for v in self.succ[u]:
                if v in antichain or any(d in augmented for d in self.descendants(v)):
                    continue
                found.append(self.deaugment([v if x == u else x for x in augmented]))
        return found


def reference_states(path: Path):
    nodes, edges = read_graph(path)
    graph = Graph(nodes, edges)
    first = next(n for n in nodes if not graph.pred[n])
    start = (first,)
    keys, arcs, queue = {start: [first]}, {}, [[first]]
    while queue:
        antichain = queue.pop(0)
        key = tuple(sorted(antichain))
        if key in arcs:
            continue
        arcs[key] = []
        for nxt in graph.next_antichains(antichain):
            nkey = tuple(sorted(nxt))
            keys.setdefault(nkey, nxt)
            arcs[key].append(nkey)
            queue.append(nxt)
    # transitive predecessors in the antichain DAG, and a topological order
    preds = {k: set() for k in keys}
    order, seen = [], set()

    def visit(k):
        if k in seen:
            return
        seen.add(k)
        for nk in arcs.get(k, []):
            visit(nk)
        order.insert(0, k)

    visit(start)
    for k in order:
        for nk in arcs.get(k, []):
            preds[nk] |= preds[k] | {k}
    index = {k: i for i, k in enumerate(order)}
    compute, params, cut = [], [], []
    for k in order:
        augmented = graph.augment(keys[k])
        members = set(augmented)
        for a in augmented:
            members |= graph.ancestors(a)
        compute.append(sum((nodes[m][1] + nodes[m][2]) / 1000.0 for m in members))
        params.append(sum(nodes[m][4] for m in members))
        cut.append(sum(nodes[m][3] for m in augmented))
    pred_ids = [sorted(index[p] for p in preds[k]) for k in order]
    return compute, params, cut, pred_ids


def reference_optimum(states, machines, bandwidth, ratio):
    compute, params, cut, pred_ids = states
    n = len(compute)
    best = [[math.inf] * machines for _ in range(n)]
    for j in range(n):
        for m in range(machines):
            dp = 4 * m * params[j] / (bandwidth * (m + 1))
            best[j][m] = (compute[j] + dp) / (m + 1)
    for m in range(1, machines):
        for j in range(1, n):
            value = best[j][m]
            for k in pred_ids[j]:
                for r in range(1, m + 1):
                    stage = compute[j] - compute[k]
                    stage_params = params[j] - params[k]
                    t = (stage + 4 * (r - 1) * stage_params / (bandwidth * r)) / r
                    t = max(best[k][m - r], t)
                    if ratio is not None:
                        t = max(t, 2.0 * cut[k] / (bandwidth * r) / ratio)
                        if j < n - 1:
                            t = max(t, 2.0 * cut[j] / (bandwidth * r) / ratio)
                    value = min(value, t)
            best[j][m] = value
    return best[n - 1][machines - 1]


# ---- tests ------------------------------------------------------------------------------


def solve(model: str, devices: int, ratio: float | None) -> float:
    profile = load_profile(str(DATA / f"{model}.graph.txt"))
    cluster = flat_cluster(num_devices=devices, bandwidth=BANDWIDTH_Bps)
    return partition(profile, cluster, PartitionOptions(activation_compression=ratio)).bottleneck_s


@pytest.mark.parametrize("key", sorted(EXPECTED, key=str))
def test_recorded_optimum(key) -> None:
    assert solve(*key) == pytest.approx(EXPECTED[key], rel=1e-9)


@pytest.mark.parametrize("model", ["vgg16", "gnmt", "resnet50"])
def test_same_states_as_pipedreams_antichain_dag(model: str) -> None:
    from tandem.planning.partition.antichain import build_states

    compute, params, cut, pred_ids = reference_states(DATA / f"{model}.graph.txt")
    ours = build_states(load_profile(str(DATA / f"{model}.graph.txt")))
    assert ours.num_states == len(compute)
    mine = sorted(zip(ours.compute_s.round(9), ours.parameter_bytes, ours.cut_bytes))
    theirs = sorted(zip([round(c, 9) for c in compute], params, cut))
    assert np.allclose(np.array(mine), np.array(theirs), rtol=1e-12, atol=1e-12)
    assert int(ours.below.sum()) == sum(len(p) for p in pred_ids)


@pytest.mark.parametrize("model,devices", [("vgg16", 2), ("vgg16", 4), ("vgg16", 8), ("vgg16", 16),
                                           ("gnmt", 2), ("gnmt", 4), ("gnmt", 8), ("gnmt", 16),
                                           ("resnet50", 2), ("resnet50", 4), ("resnet50", 8), ("resnet50", 16)])  # fmt: skip
@pytest.mark.parametrize("ratio", [None, 1.0])
def test_equals_reference_transcription(model: str, devices: int, ratio: float | None) -> None:
    states = reference_states(DATA / f"{model}.graph.txt")
    expected = reference_optimum(states, devices, BANDWIDTH_Bps, ratio)
    assert solve(model, devices, ratio) == pytest.approx(expected, rel=1e-9)
    assert EXPECTED[(model, devices, ratio)] == pytest.approx(expected, rel=1e-9)
