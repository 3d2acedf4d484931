"""Buffers (BatchNorm's running statistics) and parameters without a gradient, in every
data-parallel strategy: ``ps`` ends with ``dp``'s whole state (local and under torchrun),
averaging and gossip strategies average the floating-point buffers with the parameters, and an
unused parameter is one line naming it unless ``--find-unused-parameters`` is given."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.data.info import DataInfo
from tandem.sync import AllReduce, AsyncGossip, ChocoGossip, ElasticAveraging, Gossip, LocalSGD
from tandem.sync.gossip import GossipMixer
from tandem.topology import build_topology, mixing_matrix

from tests.bn_models import resnet, unused
from tests.conftest import ROOT, SOURCE_PATH, max_abs_diff, run_here, run_json
from tests.distributed import run_distributed

BN = ("--model", "tests.bn_models:resnet", "--data", "digits", "--steps", "12",
      "--batch-size", "32", "--lr", "0.05", "--log-every", "4")
UNUSED = ("--model", "tests.bn_models:unused", "--data", "digits", "--steps", "3",
          "--batch-size", "32", "--weight-decay", "0.1")


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``dp`` on 2 workers: DDP broadcasts rank 0's buffers, so ``final.pt`` holds rank 0's."""
    out = tmp_path_factory.mktemp("dp")
    run_json("train", *BN, "--strategy", "dp", "--nproc", "2", "--out", str(out))
    return out / "final.pt"


def _check_buffers_trained(path: Path) -> None:
    """The buffers moved from their initial values, so comparing them means something."""
    state = torch.load(path)
    assert int(state["bn.num_batches_tracked"]) == 12
    assert float(state["block.bn2.running_mean"].abs().max()) > 1e-3
    assert float((state["block.bn2.running_var"] - 1).abs().max()) > 1e-3


@pytest.mark.multiprocess
def test_synchronous_ps_ends_with_dp_parameters_and_buffers(dp_run: Path, tmp_path: Path) -> None:
    """Two servers: the parameters are sharded, the buffers travel with server 0's shard."""
    summary = run_json("train", *BN, "--strategy", "ps", "--servers", "2", "--nproc", "4",
                       "--out", str(tmp_path))
    assert summary["steps"] == 12
    _check_buffers_trained(tmp_path / "final.pt")
    assert max_abs_diff(dp_run, tmp_path / "final.pt") <= 1e-5  # every key, buffers included
    dp_summary = json.loads((dp_run.parent / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary["test_accuracy"] == dp_summary["test_accuracy"]  # dp's workers agree too


@pytest.mark.cli
def test_ps_runs_under_torchrun_and_matches_dp(dp_run: Path, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
         "-m", "tandem", "train", *BN, "--strategy", "ps", "--servers", "1", "--out",
         str(tmp_path), "--json", "--no-progress"],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": SOURCE_PATH})
    assert result.returncode == 0, result.stderr
    summaries = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(summaries) == 1
    summary = summaries[0]
    assert (summary["strategy"], summary["servers"], summary["workers"]) == ("ps", 1, 2)
    assert max_abs_diff(dp_run, tmp_path / "final.pt") <= 1e-5


@pytest.mark.multiprocess
def test_asynchronous_ps_takes_the_pushed_buffers(tmp_path: Path) -> None:
    """With one worker, asynchronous parameter-server training is plain SGD: the server's
    buffers are the ones each push carries, as one process's are after each forward. (With 2
    workers and a cosine schedule, 300 steps, this model scored 0.11 on the test split when the
    server kept its initial buffers, 0.94 with the pushed ones.)"""
    run_json("train", *BN, "--nproc", "1", "--out", str(tmp_path / "one"))
    run_json("train", *BN, "--strategy", "ps", "--mode", "async", "--nproc", "2",
             "--out", str(tmp_path / "ps"))
    _check_buffers_trained(tmp_path / "ps" / "final.pt")
    assert max_abs_diff(tmp_path / "one" / "final.pt", tmp_path / "ps" / "final.pt") <= 1e-5


def _strategy_buffers(rank: int, world_size: int) -> dict[str, Any]:
    """Each strategy's buffers after one averaging step and after its consensus, from buffers
    that differ per rank (float ones ``rank + 1``, counters ``10 * rank``)."""
    graph = build_topology("ring", world_size)
    matrix = mixing_matrix(graph)
    strategies = {
        "localsgd": LocalSGD(period=1), "easgd": ElasticAveraging(period=1, rho=1.0, lr=0.1),
        "gossip": Gossip(GossipMixer(graph, matrix, rank)),
        "choco": ChocoGossip(graph, matrix, rank, "topk:ratio=0.5", step=0.5),
        "ad-psgd": AsyncGossip(graph, rank, seed=0, timeout_s=60), "dp": AllReduce(),
    }
    seen: dict[str, Any] = {}
    info = DataInfo(task="classify", input_shape=(1, 8, 8), num_classes=10)
    for name, strategy in strategies.items():
        torch.manual_seed(0)
        module = strategy.wrap(resnet(info), torch.device("cpu"))
        model = strategy.unwrap(module)
        for buffer in model.buffers():
            buffer.fill_(rank + 1 if buffer.is_floating_point() else 10 * rank)
        # every rank's buffers set before any averaging: AD-PSGD's passive side answers from a
        # thread started in wrap, and answered with unset buffers when the active side was
        # quicker (CI: 0.5 for 1.5)
        torch.distributed.barrier()
        optimizer = torch.optim.SGD(module.parameters(), lr=0.0)
        if name != "dp":  # DDP's own broadcast runs in its forward
            strategy.update(module, optimizer, step=0)
            strategy.finish()
            seen[name] = _buffer_values(model)
            for buffer in model.buffers():
                buffer.add_(rank if buffer.is_floating_point() else 0)
        strategy.consensus(module)
        seen[f"{name} consensus"] = _buffer_values(model)
    return seen


def _buffer_values(model: torch.nn.Module) -> dict[str, float]:
    """Each buffer's value (the buffers are filled with one value each)."""
    return {name: float(b.flatten()[0]) for name, b in model.named_buffers()}


@pytest.mark.multiprocess
def test_averaging_and_gossip_strategies_average_float_buffers_and_keep_counters() -> None:
    ranks = run_distributed(_strategy_buffers, 2)
    float_mean, after_drift = 1.5, 2.0  # (1 + 2) / 2; then rank r adds r: (1.5 + 2.5) / 2
    for name in ("localsgd", "easgd", "gossip", "choco", "ad-psgd"):
        for rank, seen in enumerate(ranks):
            for key, value in seen[name].items():
                expected = 10.0 * rank if key.endswith("num_batches_tracked") else float_mean
                assert value == pytest.approx(expected), (name, rank, key)
            for key, value in seen[f"{name} consensus"].items():
                expected = 10.0 * rank if key.endswith("num_batches_tracked") else after_drift
                assert value == pytest.approx(expected), (name, rank, key)
    for seen in ranks:  # dp: rank 0's buffers, counters included
        assert set(seen["dp consensus"].values()) == {1.0, 0.0}


@pytest.mark.multiprocess
def test_an_unused_parameter_is_one_line_naming_it_and_the_flag() -> None:
    for strategy in (("--strategy", "dp", "--nproc", "2"),
                     ("--strategy", "ps", "--mode", "async", "--nproc", "3")):
        result = run_here("train", *UNUSED, *strategy, "--no-progress")
        lines = [line for line in result.stderr.splitlines() if "warning" not in line]
        assert result.returncode == 2, result.stderr
        assert len(lines) == 1, result.stderr
        assert "spare.weight, spare.bias" in lines[0] and "--find-unused-parameters" in lines[0]


@pytest.mark.multiprocess
def test_find_unused_parameters_trains_with_a_zero_gradient_in_dp_and_ps(tmp_path: Path) -> None:
    """Weight decay moves the unused parameters, the same way in both strategies."""
    run_json("train", *UNUSED, "--strategy", "dp", "--nproc", "2", "--find-unused-parameters",
             "--out", str(tmp_path / "dp"))
    run_json("train", *UNUSED, "--strategy", "ps", "--nproc", "3", "--find-unused-parameters",
             "--out", str(tmp_path / "ps"))
    assert max_abs_diff(tmp_path / "dp" / "final.pt", tmp_path / "ps" / "final.pt") <= 1e-6
    torch.manual_seed(0)  # --seed 0
    initial = unused(DataInfo(task="classify", input_shape=(1, 8, 8), num_classes=10))
    weight = initial.spare.weight
    optimizer = torch.optim.SGD([weight], lr=0.05, momentum=0.9, weight_decay=0.1)
    for _ in range(3):  # --steps 3, each with a zero gradient
        weight.grad = torch.zeros_like(weight)
        optimizer.step()
    final = torch.load(tmp_path / "dp" / "final.pt")["spare.weight"]
    assert torch.allclose(final, weight.detach(), rtol=1e-6, atol=1e-7)
