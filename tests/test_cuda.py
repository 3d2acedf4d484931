"""The data-parallel strategies on GPUs with NCCL (``--backend nccl``): the equivalences the CPU
tests check, and the strategies that receive from any source (parameter servers, AD-PSGD),
which run on a gloo side group. Skipped without enough CUDA devices (NCCL takes one per
process)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import max_abs_diff, run_json

pytestmark = pytest.mark.multiprocess

MLP = ("--model", "mlp", "--data", "digits", "--steps", "20", "--batch-size", "32",
       "--lr", "0.05", "--momentum", "0.9", "--seed", "3", "--backend", "nccl")
BN = ("--model", "tests.bn_models:resnet", "--data", "digits", "--steps", "12",
      "--batch-size", "32", "--lr", "0.05", "--backend", "nccl")


def gpus(count: int) -> pytest.MarkDecorator:
    """Skip unless CUDA has at least ``count`` devices."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(have < count, reason=f"needs {count} CUDA devices, has {have}")


@gpus(2)
def test_dp_on_nccl_matches_one_gpu(tmp_path: Path) -> None:
    single = run_json("train", *MLP, "--nproc", "1", "--out", str(tmp_path / "one"))
    double = run_json("train", *MLP, "--nproc", "2", "--out", str(tmp_path / "two"))
    assert single["backend"] == double["backend"] == "nccl"
    assert max_abs_diff(tmp_path / "one" / "final.pt", tmp_path / "two" / "final.pt") <= 1e-5


@gpus(3)
def test_synchronous_ps_on_nccl_matches_dp(tmp_path: Path) -> None:
    """Parameters and BatchNorm buffers; 1e-4 rather than the CPU's 1e-5, for cuDNN's
    convolution algorithms (which may differ from process to process)."""
    run_json("train", *BN, "--strategy", "dp", "--nproc", "2", "--out", str(tmp_path / "dp"))
    summary = run_json("train", *BN, "--strategy", "ps", "--servers", "1", "--nproc", "3",
                       "--out", str(tmp_path / "ps"))
    assert summary["steps"] == 12 and summary["dropped_pushes"] == 0
    assert max_abs_diff(tmp_path / "dp" / "final.pt", tmp_path / "ps" / "final.pt") <= 1e-4


@gpus(3)
def test_asynchronous_ps_runs_on_nccl() -> None:
    summary = run_json("train", *BN, "--strategy", "ps", "--mode", "async", "--nproc", "3")
    assert summary["finished"] and not summary["dead_workers"]


@gpus(2)
def test_ad_psgd_runs_on_nccl() -> None:
    summary = run_json("train", *BN, "--strategy", "gossip", "--async-gossip", "--nproc", "2")
    assert summary["finished"] and summary["pairwise_averages"] > 0
