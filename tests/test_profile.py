"""ModelProfile JSON, validation, and the PipeDream graph.txt importer."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.errors import UsageError
from tandem.profile import LayerProfile, ModelProfile, from_pipedream_graph, load_profile

pytestmark = pytest.mark.pure

DATA = Path(__file__).parent / "data" / "profiles"


def test_json_round_trip(tmp_path) -> None:
    profile = ModelProfile(
        layers=[LayerProfile(name=f"l{i}", forward_s=0.1 * i, backward_s=0.2, activation_bytes=8.0,
                             parameter_bytes=4.0) for i in range(3)],
        edges=[(0, 1), (0, 2), (1, 2)], model="m", batch_size=8)
    path = tmp_path / "p.json"
    profile.save(str(path))
    again = ModelProfile.load(str(path))
    assert again.to_dict() == profile.to_dict()


def test_pipedream_import_units_and_pruning() -> None:
    profile = load_profile(str(DATA / "gnmt.graph.txt"))
    names = [layer.name for layer in profile.layers]
    assert not any(": Input" in name for name in names)
    assert names[0].startswith("node4: Embedding")
    lstm = next(layer for layer in profile.layers if layer.name.startswith("node7:"))
    assert lstm.forward_s == pytest.approx(3.190e-3)
    assert lstm.activation_bytes == 6291456.0 + 2 * 131072.0
    position = {layer.name.split(":")[0]: i for i, layer in enumerate(profile.layers)}
    assert all(a < b for a, b in profile.edge_list()), "layers are in topological order"
    assert "node9" not in position, "unused __getitem__ outputs are dropped"


@pytest.mark.parametrize("name,layers,edges", [("vgg16", 40, 40), ("resnet50", 176, 192),
                                               ("gnmt", 37, 46)])  # fmt: skip
def test_real_profiles_load(name: str, layers: int, edges: int) -> None:
    profile = load_profile(str(DATA / f"{name}.graph.txt"))
    assert profile.num_layers == layers and len(profile.edge_list()) == edges


@pytest.mark.parametrize("text,words", [
    ("node1 -- A -- forward_compute_time=1.0, backward_compute_time=-2.0, activation_size=1.0, "
     "parameter_size=0.0\n", "backward_compute_time=-2.0"),
    ("node1 -- A -- forward_compute_time=1.0\n", "line 1"),
    ("node1 -- A -- forward_compute_time=1.0, backward_compute_time=1.0, activation_size=1.0, "
     "parameter_size=0.0\n\tnode1 -- node9\n", "unknown node"),
])  # fmt: skip
def test_bad_graph_lines(text: str, words: str) -> None:
    with pytest.raises(UsageError, match=words):
        from_pipedream_graph(text)


def test_wrong_schema_version() -> None:
    with pytest.raises(UsageError, match="schema_version"):
        ModelProfile.from_dict({"schema_version": 99, "layers": []})
