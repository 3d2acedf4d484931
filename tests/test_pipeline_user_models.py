"""Pipelines and profiles of models and data as users bring them: a Hugging Face GPT-2 with its
default config (``use_cache=True``), and ``tandem profile --data package.module:function``."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tandem.data.info import DataInfo
from tandem.models.pieces import Initializer, materialize as build_in_pieces, on_meta
from tandem.runtime.config import RunConfig
from tandem.runtime.job import sketch_job
from tandem.runtime.pipeline.materialize import materialize, traced_blocks
from tests import split_models
from tests.conftest import max_abs_diff, run_cli, run_json

GPT2 = ("--model", "tests.hf_models:gpt2", "--data", "tests.hf_models:tokens", "--batch-size", "16",
        "--seed", "4")
SGD = ("--steps", "20", "--lr", "0.05", "--momentum", "0.9")
TIED = ("transformer.wte.weight", "lm_head.weight")


@pytest.mark.multiprocess
def test_gpt2_pipeline_equals_dp(tmp_path: Path) -> None:
    """Traced with its cache off, split into 34 blocks on 2 stages: equal to one process
    accumulating the same 2 micro-batches, its embedding still tied to its output layer."""
    pytest.importorskip("transformers")
    run_json("train", *GPT2, *SGD, "--strategy", "dp", "--nproc", "1", "--accumulate", "2",
             "--out", str(tmp_path / "dp"))
    summary = run_json("train", *GPT2, *SGD, "--strategy", "pipeline", "--nproc", "2",
                       "--microbatches", "2", "--out", str(tmp_path / "pipeline"))
    assert summary["pipeline"] == "1-1"
    final = torch.load(tmp_path / "pipeline" / "final.pt")
    assert torch.equal(final[TIED[0]], final[TIED[1]])
    assert max_abs_diff(tmp_path / "dp" / "final.pt", tmp_path / "pipeline" / "final.pt") <= 1e-5


@pytest.mark.multiprocess
def test_gpt2_on_four_stages_trains_in_bf16_with_clipping() -> None:
    pytest.importorskip("transformers")
    summary = run_json("train", *GPT2, "--strategy", "pipeline", "--nproc", "4", "--stages", "4",
                       "--microbatches", "4", "--steps", "10", "--optimizer", "adamw",
                       "--lr", "0.01", "--precision", "bf16", "--clip-grad-norm", "1",
                       "--log-every", "2")
    assert summary["pipeline"] == "1-1-1-1" and summary["precision"] == "bf16"
    ties = [tie for worker in summary["workers"] for tie in worker["shared_parameters"]]
    assert [tie["stages"] for tie in ties] == [[0, 3], [0, 3]]
    assert all(tie["max_abs_diff"] == 0 for tie in ties)
    assert summary["final_loss"] < 3.8, summary  # ln 64 = 4.16 at the start
    assert summary["test_accuracy"] > 0.1, summary  # chance: 1/64


@pytest.mark.pure
def test_split_traces_without_the_cache_and_restores_the_config() -> None:
    pytest.importorskip("transformers")
    from tandem.split import split_model
    from tests.hf_models import _tokens, gpt2

    model, tokens = gpt2(layers=1), _tokens(4, seed=0).tensors[0]
    assert model.config.use_cache
    blocks = split_model(model, tokens[:2])
    assert model.config.use_cache  # the user's object is as it was
    output = blocks(tokens)
    assert "past_key_values" not in output or output.past_key_values is None
    assert torch.allclose(output.logits, model(tokens).logits, atol=1e-6)


@pytest.mark.pure
def test_profile_takes_a_data_function(capsys: pytest.CaptureFixture[str]) -> None:
    """Dict inputs from the user's dataset reach the model's keyword arguments."""
    code, out, err = run_cli(capsys, "profile", "--model", "tests.user_data:skip_net", "--data",
                             "tests.user_data:digit_dicts", "--batch-size", "8", "--repeats", "1",
                             "--warmup", "0", "--json")
    assert code == 0, err
    profile = json.loads(out)
    assert profile["batch_size"] == 8 and profile["layers"][-1]["name"].endswith("head")


@pytest.mark.multiprocess
def test_a_users_sequential_with_init_fn_is_built_a_stage_at_a_time(tmp_path: Path) -> None:
    """``--init-fn reset``: each worker builds every block in turn on the meta device's shapes
    and frees another stage's as soon as it is complete, keeping the tied weight its stage
    shares; the pipeline ends as one process that built the model whole (1.2e-7 here), and
    each worker holds only its stage's blocks and the tie (13,064 and 10,288 bytes of the
    model's 19,256)."""
    user = ("--model", "tests.split_models:tied_blocks", "--init-fn", "reset", "--steps", "6",
            "--batch-size", "32", "--lr", "0.05", "--momentum", "0.9", "--seed", "3")
    run_json("train", *user, "--nproc", "1", "--accumulate", "2", "--out", str(tmp_path / "one"))
    summary = run_json("train", *user, "--strategy", "pipeline", "--nproc", "2",
                       "--out", str(tmp_path / "pipeline"))
    assert max_abs_diff(tmp_path / "one" / "final.pt", tmp_path / "pipeline" / "final.pt") <= 1e-5
    whole = sum(t.numel() * t.element_size()
                for t in torch.load(tmp_path / "one" / "final.pt").values()) - 4 * 32 * 32
    held = [worker["held_model_bytes"] for worker in summary["workers"]]
    assert all(amount < 0.7 * whole for amount in held), (held, whole)
    assert [worker["shared_parameters"][0]["max_abs_diff"] for worker in summary["workers"]] \
        == [0.0, 0.0]


class _MadeOnTheCPU(nn.Module):
    """Its forward makes a tensor on the CPU, so it cannot be traced on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x) * torch.tensor([1.0, 2.0, 3.0, 4.0]))


@pytest.mark.pure
def test_a_traced_model_with_init_fn_is_built_a_stage_at_a_time() -> None:
    """With ``--init-fn`` a model split by tracing is traced on the meta device, and a stage's
    blocks get the weights of the model built whole (a tie across stages too) while the other
    stages' stay on the meta device; a model whose forward needs a real device is built whole
    first, then traced."""
    job = sketch_job("pipeline", {"--stages": 2}, RunConfig(nproc=2))
    init = Initializer(seed=3, by_name=False)
    tokens = SimpleNamespace(inputs=torch.randint(0, 32, (8, 8)))
    with torch.device("meta"):
        whole = split_models.tied_lm(DataInfo(task="lm", input_shape=(8,), num_classes=32))
    build_in_pieces(whole, init, torch.device("cpu"))
    for start, end in ((0, 4), (4, 9)):
        with torch.device("meta"):
            model = split_models.tied_lm(DataInfo(task="lm", input_shape=(8,), num_classes=32))
        blocks = traced_blocks(job, model, tokens, init, torch.device("cpu"), what="tied_lm")
        assert len(blocks) == 9 and on_meta(blocks[0]) and on_meta(blocks[-1])
        stage = materialize(blocks, start, end, init, torch.device("cpu"), model=model)
        assert not on_meta(stage)
        others = [*blocks[:start], *blocks[end:]]
        assert {name for block in others for name, value in block.state_dict().items()
                if not value.is_meta} == {"embed.weight"}  # the tie, held by both stages
        for name, value in stage.state_dict().items():
            assert torch.equal(value, whole.state_dict()[name.partition(".")[2]]), name
    with torch.device("meta"):
        made = _MadeOnTheCPU()
    x = torch.randn(8, 4)
    blocks = traced_blocks(job, made, SimpleNamespace(inputs=x), init, torch.device("cpu"),
                           what="made")
    assert not on_meta(blocks) and torch.equal(blocks(x), made(x))
