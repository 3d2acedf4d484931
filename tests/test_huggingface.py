"""A Hugging Face ``transformers`` GPT-2 (from a config: random init, no download) under every
data-parallel family: its output is a ``ModelOutput`` and its embedding is tied to its output
layer. Synchronous strategies end equal to single-process training; the tie holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import max_abs_diff, run_json

pytestmark = pytest.mark.multiprocess

pytest.importorskip("transformers")

GPT2 = ("--model", "tests.hf_models:gpt2", "--data", "tests.hf_models:tokens", "--steps", "20",
        "--batch-size", "16", "--lr", "0.05", "--momentum", "0.9", "--seed", "4",
        "--no-progress")
TIED = ("transformer.wte.weight", "lm_head.weight")


def _tied(path: Path) -> bool:
    state = torch.load(path)
    return all(key in state for key in TIED) and torch.equal(state[TIED[0]], state[TIED[1]])


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gpt2-single")
    summary = run_json("train", *GPT2, "--nproc", "1", "--out", str(out))
    assert summary["test_accuracy"] is not None and summary["loss"] == "cross_entropy"
    return out / "final.pt"


@pytest.mark.parametrize("strategy", [("--strategy", "dp", "--nproc", "2"),
                                      ("--strategy", "ps", "--servers", "1", "--nproc", "3")],
                         ids=["dp", "ps-sync"])
def test_gpt2_synchronous_strategies_equal_single_process(tmp_path: Path, single: Path,
                                                          strategy: tuple[str, ...]) -> None:
    run_json("train", *GPT2, *strategy, "--out", str(tmp_path))
    assert max_abs_diff(single, tmp_path / "final.pt") <= 1e-5
    assert _tied(tmp_path / "final.pt") and _tied(single)


@pytest.mark.statistical
def test_gpt2_learns_with_gossip(tmp_path: Path) -> None:
    summary = run_json("train", "--model", "tests.hf_models:gpt2", "--data",
                       "tests.hf_models:tokens", "--steps", "60", "--batch-size", "32",
                       "--strategy", "gossip", "--nproc", "2", "--optimizer", "adamw",
                       "--lr", "0.003", "--out", str(tmp_path), "--no-progress")
    assert summary["test_accuracy"] > 0.2, summary  # chance is 1/64
    assert _tied(tmp_path / "final.pt")
