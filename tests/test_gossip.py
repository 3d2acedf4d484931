"""Gossip mixing against the mixing matrix, and the topology command."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tandem.sync.gossip import GossipMixer
from tandem.topology import build_topology, mixing_matrix, spectral_gap

from tests.conftest import run_here
from tests.distributed import run_distributed

ROUNDS = 12


def _gossip_rounds(rank: int, world_size: int, kind: str, weights: str) -> list[list[float]]:
    """Mixing only (no gradient steps): each rank's vector after every round."""
    graph = build_topology(kind, world_size)
    mixer = GossipMixer(graph, mixing_matrix(graph, weights), rank)
    x = torch.randn(5, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64)
    history = [x.tolist()]
    for _ in range(ROUNDS):
        x = mixer.mix(x)
        history.append(x.tolist())
    return history


def _consensus_distance(states: np.ndarray) -> float:
    return float(np.linalg.norm(states - states.mean(axis=0, keepdims=True)))


@pytest.mark.multiprocess
@pytest.mark.parametrize(("kind", "world_size", "weights"), [
    ("ring", 4, "metropolis"), ("ring", 5, "uniform"), ("complete", 3, "uniform"),
    ("custom:0-1,1-2,2-3,0-2", 4, "metropolis"),
])
def test_gossip_shrinks_disagreement_exactly_as_the_mixing_matrix_predicts(
        kind: str, world_size: int, weights: str) -> None:
    histories = np.array(run_distributed(_gossip_rounds, world_size, kind, weights))
    matrix = mixing_matrix(build_topology(kind, world_size), weights)
    states = histories[:, 0, :]
    for round_index in range(1, ROUNDS + 1):
        states = matrix @ states
        measured = histories[:, round_index, :]
        np.testing.assert_allclose(measured, states, atol=1e-12)
        assert _consensus_distance(measured) == pytest.approx(_consensus_distance(states), rel=1e-9)
    mean = histories[:, 0, :].mean(axis=0)
    np.testing.assert_allclose(histories[:, -1, :].mean(axis=0), mean, atol=1e-12)
    first, last = _consensus_distance(histories[:, 0, :]), _consensus_distance(histories[:, -1, :])
    assert last <= (1 - spectral_gap(matrix)) ** ROUNDS * first * (1 + 1e-9)


@pytest.mark.pure
def test_mixing_matrices_are_doubly_stochastic() -> None:
    for kind in ("ring", "torus", "exponential", "complete"):
        for weights in ("uniform", "metropolis"):
            matrix = mixing_matrix(build_topology(kind, 16), weights)
            np.testing.assert_allclose(matrix.sum(axis=0), 1.0)
            np.testing.assert_allclose(matrix.sum(axis=1), 1.0)
            assert np.allclose(matrix, matrix.T) and (matrix >= 0).all()


@pytest.mark.pure
def test_spectral_gap_of_a_ring_matches_the_closed_form() -> None:
    gap = spectral_gap(mixing_matrix(build_topology("ring", 16), "uniform"))
    assert gap == pytest.approx(1 - (1 + 2 * np.cos(2 * np.pi / 16)) / 3)


@pytest.mark.pure
def test_topology_command() -> None:
    result = run_here("topology", "--kind", "ring", "--n", "16", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert len(data["matrix"]) == 16 and data["spectral_gap"] == pytest.approx(0.0507, abs=1e-4)
    text = run_here("topology", "--kind", "torus", "--n", "16")
    assert "spectral gap 0.4000" in text.stdout


@pytest.mark.pure
@pytest.mark.parametrize(("args", "expected"), [
    (("--kind", "custom:0-1,2-3", "--n", "4"), "is not connected: workers [2, 3]"),
    (("--kind", "torus", "--n", "7"), "a torus of 7 workers"),
    (("--kind", "star", "--n", "4"), "unknown topology 'star'"),
    (("--kind", "custom:0-0", "--n", "4"), "needs two different workers"),
])
def test_bad_topologies(args: tuple[str, ...], expected: str) -> None:
    result = run_here("topology", *args)
    assert result.returncode == 2 and expected in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
