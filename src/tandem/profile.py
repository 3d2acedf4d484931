"""Model profiles: per-layer compute time, activation and parameter sizes, and DAG edges.

Usage::

    profile = ModelProfile.load("vgg.json")            # written by ``tandem profile``
    profile = load_profile("resnet50.graph.txt")       # PipeDream's graph.txt format
    profile.save("copy.json")
"""

from __future__ import annotations

import heapq
import json
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

from tandem import strict_json
from tandem.errors import UsageError
from tandem.output_files import write_text

SCHEMA_VERSION = 2
"""Version of the JSON layout written by :meth:`ModelProfile.to_dict` (2 added the per-call
fixed costs; version 1 files are still read). A layer's optional ``tensor_allreduces`` needs no
new version: readers that do not know it ignore it and use the rule it refines."""

READABLE_VERSIONS = (1, 2)
"""Schema versions :meth:`ModelProfile.from_dict` reads."""

_LAYER_FIELDS = ("name", "forward_s", "backward_s", "activation_bytes", "parameter_bytes")
_FIXED_FIELDS = ("forward_fixed_s", "backward_fixed_s")
_TENSOR_FIELD = "tensor_allreduces"

FIXED_COST_ORIGINS = ("measured", "default", "given")
"""Values of :attr:`ModelProfile.fixed_costs`."""

DEFAULT_FORWARD_FIXED_S = 10e-6
"""Fixed seconds per forward call of a layer, for profiles that do not record it (PipeDream's
``graph.txt``, version 1 JSON): one GPU kernel launch (~5 us of CUDA launch latency) plus
PyTorch's eager dispatch of one operator (~5 us). An order of magnitude, not a measurement of
any profile's device; clamped to the layer's own forward time."""
DEFAULT_BACKWARD_FIXED_S = 20e-6
"""Fixed seconds per backward call of a layer, for profiles that do not record it: about two
kernels (gradients of the input and of the weights) and the autograd engine's node, twice
:data:`DEFAULT_FORWARD_FIXED_S`; clamped to the layer's own backward time."""


@dataclass(kw_only=True, slots=True, frozen=True)
class LayerProfile:
    """Measurements of one layer (one block of an ``nn.Sequential``, or one graph node)."""

    name: str
    """A readable description of the layer, e.g. ``Conv2d(3, 64, ...)``."""
    forward_s: float
    """Forward time of one minibatch, seconds."""
    backward_s: float
    """Backward time of one minibatch, seconds."""
    activation_bytes: float
    """Bytes of the layer's output activation for one minibatch."""
    parameter_bytes: float
    """Bytes of the layer's parameters."""
    forward_fixed_s: float = 0.0
    """The part of ``forward_s`` that does not shrink with the batch: paid once per call, by
    every micro-batch (kernel launches, framework dispatch). A call on a share ``f`` of the
    minibatch takes ``forward_fixed_s + (forward_s - forward_fixed_s) * f``."""
    backward_fixed_s: float = 0.0
    """The part of ``backward_s`` paid once per call, as ``forward_fixed_s``."""
    tensor_allreduces: tuple[int, int] | None = None
    """Allreduces of an output-sized activation that tensor parallelism adds to this layer's
    forward and to its backward, as the model's tensor plan splits it (``tandem profile`` of a
    reference model records them: a GPT block has two each way, an embedding none); ``(0, 0)``:
    the layer stays whole on every device. None: not recorded, and
    :mod:`tandem.planning.simulate.tensor`'s rule decides (a layer with parameters splits with one each
    way)."""

    def __post_init__(self) -> None:
        if self.tensor_allreduces is not None:
            counts = self.tensor_allreduces
            if (not isinstance(counts, tuple) or len(counts) != 2
                    or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts)):
                raise UsageError(f"layer {self.name!r} has tensor_allreduces={counts!r}: it must be "
                                 f"two whole numbers >= 0 (forward, backward), e.g. [2, 2]")
        for key in (*_LAYER_FIELDS[1:], *_FIXED_FIELDS):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise UsageError(
                    f"layer {self.name!r} has {key}={value!r}: it must be a finite number >= 0"
                )
        for fixed, total in (("forward_fixed_s", "forward_s"), ("backward_fixed_s", "backward_s")):
            if getattr(self, fixed) > getattr(self, total):
                raise UsageError(
                    f"layer {self.name!r} has {fixed}={getattr(self, fixed)!r} above its "
                    f"{total}={getattr(self, total)!r}: the fixed cost is part of the time, "
                    f"so it must be at most {total}"
                )

    def scaled_forward_s(self, share: float) -> float:
        """Forward seconds of a call on ``share`` of the profiled minibatch."""
        return scale_call(self.forward_s, self.forward_fixed_s, share)

    def scaled_backward_s(self, share: float) -> float:
        """Backward seconds of a call on ``share`` of the profiled minibatch."""
        return scale_call(self.backward_s, self.backward_fixed_s, share)

    @property
    def compute_s(self) -> float:
        """Forward plus backward seconds."""
        return self.forward_s + self.backward_s


def scale_call(total_s: float, fixed_s: float, share: float) -> float:
    """Seconds of a call on ``share`` of the minibatch whose whole call takes ``total_s``, of
    which ``fixed_s`` is paid once per call: ``fixed_s + (total_s - fixed_s) * share``."""
    return fixed_s + (total_s - fixed_s) * share


def with_default_fixed(layer: LayerProfile) -> LayerProfile:
    """``layer`` with the documented default fixed costs (:data:`DEFAULT_FORWARD_FIXED_S`,
    :data:`DEFAULT_BACKWARD_FIXED_S`), each at most the layer's own time."""
    return replace(layer, forward_fixed_s=min(DEFAULT_FORWARD_FIXED_S, layer.forward_s),
                   backward_fixed_s=min(DEFAULT_BACKWARD_FIXED_S, layer.backward_s))


@dataclass(kw_only=True, slots=True)
class ModelProfile:
    """One entry per layer plus, for DAGs, the edges between layers (by index)."""

    layers: list[LayerProfile]
    """The layers; for a chain, in execution order."""
    edges: list[tuple[int, int]] | None = None
    """Data-flow edges ``(producer, consumer)`` between layer indices; None for a chain."""
    model: str = ""
    """The model spec or file the profile was measured from."""
    batch_size: int | None = None
    """The minibatch size the times were measured at, if known."""
    source: str = field(default="")
    """Where the profile came from (``tandem profile``, a file name)."""
    fixed_costs: str = "given"
    """Where the layers' fixed costs per call come from: ``measured`` (``tandem profile``'s
    fit), ``default`` (the file did not record them: :data:`DEFAULT_FORWARD_FIXED_S`) or
    ``given`` (built in code, or read from a file that says so)."""

    def __post_init__(self) -> None:
        if not self.layers:
            raise UsageError("a profile needs at least one layer")
        if self.fixed_costs not in FIXED_COST_ORIGINS:
            raise UsageError(f"a profile's fixed_costs is {self.fixed_costs!r}; use one of "
                             f"{', '.join(FIXED_COST_ORIGINS)}")
        if self.edges is not None:
            self.edges = [(int(a), int(b)) for a, b in self.edges]
            _check_edges(self.edges, len(self.layers))
            topological_order(len(self.layers), self.edges)

    @property
    def num_layers(self) -> int:
        """Number of layers."""
        return len(self.layers)

    @property
    def is_chain(self) -> bool:
        """True when the layers run one after another (no explicit DAG)."""
        return self.edges is None

    def edge_list(self) -> list[tuple[int, int]]:
        """The edges, with a chain's implicit ``i -> i+1`` edges made explicit."""
        if self.edges is None:
            return [(i, i + 1) for i in range(self.num_layers - 1)]
        return list(self.edges)

    def total_compute_s(self) -> float:
        """Forward plus backward time of all layers, seconds."""
        return sum(layer.compute_s for layer in self.layers)

    def total_fixed_s(self) -> float:
        """Forward plus backward fixed cost per call of all layers, seconds."""
        return sum(layer.forward_fixed_s + layer.backward_fixed_s for layer in self.layers)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dictionary with a schema version."""
        return {
            "schema_version": SCHEMA_VERSION,
            "model": self.model,
            "batch_size": self.batch_size,
            "source": self.source,
            "fixed_costs": self.fixed_costs,
            "layers": [_layer_to_dict(layer) for layer in self.layers],
            "edges": None if self.edges is None else [list(edge) for edge in self.edges],
        }

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "profile") -> ModelProfile:
        """Read :meth:`to_dict`'s layout (or version 1's), naming the first missing or bad
        field; layers without fixed costs get the documented defaults (:func:`with_default_fixed`)."""
        if not isinstance(data, dict):
            raise UsageError(f"{where} must be a JSON object with 'layers' (got {type(data).__name__})")
        version = data.get("schema_version")
        if version not in READABLE_VERSIONS:
            raise UsageError(
                f"{where} has schema_version {version!r}; this tandem reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}"
            )
        layers = data.get("layers")
        if not isinstance(layers, list):
            raise UsageError(f"{where} is missing the 'layers' list")
        edges = data.get("edges")
        if edges is not None and not (
            isinstance(edges, list) and all(isinstance(e, list) and len(e) == 2 for e in edges)
        ):
            raise UsageError(f"{where}: 'edges' must be a list of [producer, consumer] pairs or null")
        read = [_layer_from_dict(entry, index, where) for index, entry in enumerate(layers)]
        given = [_FIXED_FIELDS[0] in entry for entry in layers]
        recorded = all(given)
        return cls(
            layers=[layer if has else with_default_fixed(layer) for layer, has in zip(read, given)],
            edges=None if edges is None else [(e[0], e[1]) for e in edges],
            model=str(data.get("model", "")),
            batch_size=data.get("batch_size"),
            source=str(data.get("source", where)),
            fixed_costs=str(data.get("fixed_costs", "given")) if recorded else "default",
        )

    def save(self, path: str) -> None:
        """Write the profile as strict JSON, atomically."""
        write_text(path, strict_json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str) -> ModelProfile:
        """Read a JSON profile."""
        try:
            with open(path, encoding="utf-8") as handle:
                data = json.load(handle)
        except OSError as exc:
            raise UsageError(f"cannot read profile {path!r}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise UsageError(f"profile {path!r} is not valid JSON: {exc}") from None
        return cls.from_dict(data, where=f"profile {path!r}")


def _layer_to_dict(layer: LayerProfile) -> dict[str, Any]:
    entry = {key: getattr(layer, key) for key in (*_LAYER_FIELDS, *_FIXED_FIELDS)}
    if layer.tensor_allreduces is not None:
        entry[_TENSOR_FIELD] = list(layer.tensor_allreduces)
    return entry


def _layer_from_dict(entry: Any, index: int, where: str) -> LayerProfile:
    if not isinstance(entry, dict):
        raise UsageError(f"{where}: layer {index} must be an object with {', '.join(_LAYER_FIELDS)}")
    missing = [key for key in _LAYER_FIELDS if key not in entry]
    if missing:
        raise UsageError(f"{where}: layer {index} is missing field {missing[0]!r}")
    fixed = [key for key in _FIXED_FIELDS if key in entry]
    if len(fixed) == 1:
        other = _FIXED_FIELDS[1 - _FIXED_FIELDS.index(fixed[0])]
        raise UsageError(f"{where}: layer {index} has {fixed[0]!r} but not {other!r}; "
                         "give both fixed costs or neither (neither: the documented defaults)")
    values = {key: entry[key] for key in (*_LAYER_FIELDS, *fixed)}
    for key in [*_LAYER_FIELDS[1:], *(k for k in _FIXED_FIELDS if k in values)]:
        if not isinstance(values[key], (int, float)) or isinstance(values[key], bool):
            raise UsageError(f"{where}: layer {index} field {key!r} must be a number (got {values[key]!r})")
        if values[key] < 0:
            raise UsageError(f"{where}: layer {index} ({values['name']!r}) has negative {key}={values[key]}")
    counts = entry.get(_TENSOR_FIELD)
    if counts is not None:
        if not isinstance(counts, list):
            raise UsageError(f"{where}: layer {index} field {_TENSOR_FIELD!r} must be a list of two "
                             f"whole numbers, e.g. [2, 2] (got {counts!r})")
        values[_TENSOR_FIELD] = tuple(counts)
    return LayerProfile(**values)


def _check_edges(edges: list[tuple[int, int]], num_layers: int) -> None:
    for producer, consumer in edges:
        if not (0 <= producer < num_layers and 0 <= consumer < num_layers):
            raise UsageError(
                f"edge {producer} -> {consumer} names a layer outside 0..{num_layers - 1}"
            )
        if producer == consumer:
            raise UsageError(f"edge {producer} -> {consumer} is a cycle: a layer cannot feed itself")


def topological_order(num_layers: int, edges: list[tuple[int, int]]) -> list[int]:
    """Layers in dependency order, ties broken by index; a cycle is a :class:`UsageError`."""
    successors: list[list[int]] = [[] for _ in range(num_layers)]
    in_degree = [0] * num_layers
    for producer, consumer in edges:
        successors[producer].append(consumer)
        in_degree[consumer] += 1
    ready = [index for index in range(num_layers) if in_degree[index] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        index = heapq.heappop(ready)
        order.append(index)
        for consumer in successors[index]:
            in_degree[consumer] -= 1
            if in_degree[consumer] == 0:
                heapq.heappush(ready, consumer)
    if len(order) < num_layers:
        stuck = min(index for index in range(num_layers) if in_degree[index] > 0)
        raise UsageError(
            f"the profile's edges contain a cycle through layer {stuck}: a profile must be a DAG"
        )
    return order


_NODE_LINE = re.compile(
    r"^(?P<id>\S+) -- (?P<desc>.*) -- forward_compute_time=(?P<fwd>[^,]+), "
    r"backward_compute_time=(?P<bwd>[^,]+), activation_size=(?P<act>[^,]+), "
    r"parameter_size=(?P<par>[^,\s]+)(?: -- stage_id=\d+)?$"
)


def _ms_float(text: str, what: str, line_number: int, path: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{path} line {line_number}: {what}={text!r} is not a number") from None
    if value < 0 or not math.isfinite(value):
        raise UsageError(f"{path} line {line_number}: {what}={text} must be a finite number >= 0")
    return value


def _activation(text: str, line_number: int, path: str) -> float:
    parts = text.strip().lstrip("[").rstrip("]").split(";")
    return sum(_ms_float(part.strip(), "activation_size", line_number, path) for part in parts)


def from_pipedream_graph(text: str, *, source: str = "graph.txt") -> ModelProfile:
    """Import PipeDream's ``graph.txt`` (times in ms) as a profile in seconds.

    The format has no fixed cost per call; every node gets the documented defaults
    (:data:`DEFAULT_FORWARD_FIXED_S`, :data:`DEFAULT_BACKWARD_FIXED_S`).

    As PipeDream's optimizer does, nodes described as ``Input...`` (model inputs, no cost)
    are dropped, and so are ``__getitem__`` nodes whose output nobody reads. A multi-output
    node's activation size is the sum of its outputs. Layers are kept in a topological order
    that prefers file order, so the first source is the file's first non-input source.
    """
    nodes: dict[str, tuple[int, str, list[float]]] = {}
    edges: list[tuple[str, str, int]] = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if line.startswith("\t") or line.startswith(" "):
            ends = line.strip().split(" -- ")
            if len(ends) != 2:
                raise UsageError(f"{source} line {line_number}: expected an edge 'nodeA -- nodeB'")
            edges.append((ends[0], ends[1], line_number))
            continue
        match = _NODE_LINE.match(line.strip())
        if match is None:
            raise UsageError(
                f"{source} line {line_number}: expected 'nodeN -- description -- "
                "forward_compute_time=..., backward_compute_time=..., activation_size=..., "
                "parameter_size=...'"
            )
        values = [
            _ms_float(match["fwd"], "forward_compute_time", line_number, source) / 1000.0,
            _ms_float(match["bwd"], "backward_compute_time", line_number, source) / 1000.0,
            _activation(match["act"], line_number, source),
            _ms_float(match["par"], "parameter_size", line_number, source),
        ]
        nodes[match["id"]] = (len(nodes), match["desc"], values)
    return _graph_to_profile(nodes, edges, source)


def _graph_to_profile(
    nodes: dict[str, tuple[int, str, list[float]]], edges: list[tuple[str, str, int]], source: str
) -> ModelProfile:
    for producer, consumer, line_number in edges:
        for end in (producer, consumer):
            if end not in nodes:
                raise UsageError(f"{source} line {line_number}: edge names unknown node {end!r}")
    inputs = {node for node, (_, desc, _) in nodes.items() if desc.startswith("Input")}
    kept_edges = [(a, b) for a, b, _ in edges if a not in inputs and b not in inputs]
    consumers = {a for a, _ in kept_edges}
    unused = {
        node for node, (_, desc, _) in nodes.items()
        if desc.startswith("__getitem__") and node not in consumers and node not in inputs
    }  # fmt: skip
    names = [node for node in nodes if node not in inputs and node not in unused]
    index = {node: position for position, node in enumerate(names)}
    edge_pairs = [(index[a], index[b]) for a, b in kept_edges if a in index and b in index]
    order = topological_order(len(names), edge_pairs)
    rank = {old: new for new, old in enumerate(order)}
    layers = [_layer(names[old], nodes[names[old]]) for old in order]
    return ModelProfile(
        layers=[with_default_fixed(layer) for layer in layers],
        edges=sorted((rank[a], rank[b]) for a, b in edge_pairs),
        model=source,
        source=f"PipeDream graph {source}",
        fixed_costs="default",
    )


def _layer(node: str, entry: tuple[int, str, list[float]]) -> LayerProfile:
    _, desc, (forward_s, backward_s, activation_bytes, parameter_bytes) = entry
    return LayerProfile(
        name=f"{node}: {desc}",
        forward_s=forward_s,
        backward_s=backward_s,
        activation_bytes=activation_bytes,
        parameter_bytes=parameter_bytes,
    )


def load_profile(path: str) -> ModelProfile:
    """Read a profile: PipeDream ``graph.txt`` when the name ends in ``.txt``, else JSON."""
    if path.endswith(".txt"):
        try:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
        except OSError as exc:
            raise UsageError(f"cannot read profile {path!r}: {exc.strerror}") from None
        return from_pipedream_graph(text, source=path)
    return ModelProfile.load(path)
