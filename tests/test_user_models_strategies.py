"""A model nobody wrote for tandem — a token model whose output layer *is* its input embedding,
with skip connections and LayerNorm — under every data-parallel family, through the CLI and
through ``tandem.fit``: synchronous strategies end equal to one process, the tie holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tandem
from tandem.data import load_data
from tests.conftest import max_abs_diff, run_json
from tests.split_models import TiedLM

TIED = ("--model", "tests.split_models:tied_lm", "--data", "tokens:n=256,seq=12,vocab=24",
        "--steps", "20", "--batch-size", "16", "--lr", "0.1", "--momentum", "0.9",
        "--seed", "6", "--no-progress")


def _tied(path: Path) -> bool:
    state = torch.load(path)
    return torch.equal(state["embed.weight"], state["out.weight"])


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tied-single")
    run_json("train", *TIED, "--nproc", "1", "--out", str(out))
    return out / "final.pt"


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", [("--strategy", "dp", "--nproc", "2"),
                                      ("--strategy", "ps", "--servers", "2", "--nproc", "4")],
                         ids=["dp", "ps-2-servers"])
def test_tied_model_synchronous_strategies_equal_one_process(tmp_path: Path, single: Path,
                                                             strategy: tuple[str, ...]) -> None:
    run_json("train", *TIED, *strategy, "--out", str(tmp_path))
    assert max_abs_diff(single, tmp_path / "final.pt") <= 1e-5
    assert _tied(tmp_path / "final.pt")


@pytest.mark.multiprocess
@pytest.mark.statistical
def test_tied_model_learns_with_gossip_through_the_api(tmp_path: Path) -> None:
    data = load_data("tokens:n=512,seq=12,vocab=24")
    torch.manual_seed(0)
    result = tandem.fit(TiedLM(24), data.train, data.test, strategy="gossip", nproc=2,
                        steps=80, batch_size=32, optimizer="adam", lr=0.01, out=tmp_path)
    assert result.summary["test_accuracy"] > 2 / 24, result.summary
    assert _tied(tmp_path / "final.pt")
    assert result.model.out.weight is result.model.embed.weight
