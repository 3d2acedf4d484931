"""Pipelines of models that are not an nn.Sequential, through the real CLI, against ``dp``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem.runtime.pipeline.wire import Wire
from tests.conftest import max_abs_diff, run_cli, run_here, run_json

BN = ("--model", "tests.split_models:skip_bn", "--data", "digits", "--batch-size", "32")
TIED = ("--model", "tests.split_models:tied_lm", "--data", "tokens:n=256,seq=8,vocab=32",
        "--batch-size", "16")
SGD = ("--steps", "20", "--lr", "0.05", "--momentum", "0.9", "--seed", "3")
MICROBATCHES = 4
"""Each micro-batch has its own BatchNorm statistics: ``dp`` accumulates as many."""


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``final.pt`` of ``--strategy dp --nproc 1`` on each model, micro-batched the same way."""
    found = {}
    for name, model in (("bn", BN), ("tied", TIED)):
        out = tmp_path_factory.mktemp(f"dp-{name}")
        run_json("train", *model, *SGD, "--strategy", "dp", "--nproc", "1",
                 "--accumulate", str(MICROBATCHES), "--out", str(out))
        found[name] = out / "final.pt"
    return found


@pytest.mark.multiprocess
def test_skip_connection_batchnorm_pipeline_matches_dp(reference: dict[str, Path],
                                                       tmp_path: Path) -> None:
    summary = run_json("train", *BN, *SGD, "--strategy", "pipeline", "--nproc", "2",
                       "--microbatches", str(MICROBATCHES), "--out", str(tmp_path))
    assert summary["pipeline"] == "1-1" and summary["steps"] == 20
    final = torch.load(tmp_path / "final.pt")
    assert "bn1.running_mean" in final and int(final["bn1.num_batches_tracked"]) == 20 * 4
    assert max_abs_diff(reference["bn"], tmp_path / "final.pt") <= 1e-5


@pytest.mark.multiprocess
def test_skip_connection_batchnorm_four_stage_pipeline_matches_dp(reference: dict[str, Path],
                                                                  tmp_path: Path) -> None:
    """Split automatically into 4 stages: skip tensors and BatchNorm buffers cross 3 cuts."""
    summary = run_json("train", *BN, *SGD, "--strategy", "pipeline", "--nproc", "4",
                       "--stages", "4", "--microbatches", str(MICROBATCHES),
                       "--out", str(tmp_path))
    assert summary["pipeline"] == "1-1-1-1"
    assert max_abs_diff(reference["bn"], tmp_path / "final.pt") <= 1e-5


def shared(summary: dict) -> list[dict]:
    return [tie for worker in summary["workers"] for tie in worker["shared_parameters"]]


@pytest.mark.multiprocess
def test_tied_embedding_pipeline_matches_dp(reference: dict[str, Path], tmp_path: Path) -> None:
    """Cut before the user's split points: blocks embed..layers.0, layers.1..layers.2, norm..out."""
    summary = run_json("train", *TIED, *SGD, "--strategy", "pipeline", "--nproc", "2",
                       "--split-points", "layers.1,norm", "--microbatches", str(MICROBATCHES),
                       "--out", str(tmp_path))
    assert [worker["layers"] for worker in summary["workers"]] == [[0, 2], [2, 3]]
    ties = shared(summary)
    assert [tie["stages"] for tie in ties] == [[0, 1], [0, 1]]  # reported by both holders
    assert all(tie["parameters"] == ["embed.weight"] and tie["max_abs_diff"] == 0 for tie in ties)
    final = torch.load(tmp_path / "final.pt")
    assert torch.equal(final["embed.weight"], final["out.weight"])
    assert max_abs_diff(reference["tied"], tmp_path / "final.pt") <= 1e-5


@pytest.mark.multiprocess
def test_profile_plan_and_a_four_stage_run(reference: dict[str, Path], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    profile, plan = tmp_path / "profile.json", tmp_path / "plan.json"
    code, _, err = run_cli(capsys, "profile", *TIED[:4], "--batch-size", "16", "-o", str(profile))
    assert code == 0, err
    layers = [layer["name"] for layer in json.loads(profile.read_text())["layers"]]
    assert layers[0] == "0: embed" and layers[-1] == "8: out" and "3: layers.1" in layers
    code, _, err = run_cli(capsys, "plan", "--profile", str(profile), "--devices", "4",
                           "--bandwidth", "10Gb/s", "--straight", "--schedule", "1f1b",
                           "--microbatches", str(MICROBATCHES), "-o", str(plan))
    assert code == 0, err
    summary = run_json("train", *TIED, *SGD, "--plan", str(plan), "--out", str(tmp_path / "run"))
    assert summary["world_size"] == 4 and summary["pipeline"] == "1-1-1-1"
    assert {tuple(tie["stages"]) for tie in shared(summary)} == {(0, 3)}
    assert all(tie["max_abs_diff"] == 0 for tie in shared(summary))
    assert max_abs_diff(reference["tied"], tmp_path / "run" / "final.pt") <= 1e-5


UNBALANCED = ("--model", "tests.split_models:unbalanced", "--data", "digits", "--batch-size", "32")


@pytest.mark.multiprocess
def test_stages_are_cut_where_the_profile_balances_them(tmp_path: Path) -> None:
    """Block 3 (a wide weight applied six times) outweighs the other 13 blocks together: the
    partitioner gives it the stage with fewer blocks, not 7 blocks to each stage."""
    dp = tmp_path / "dp"
    run_json("train", *UNBALANCED, *SGD, "--strategy", "dp", "--nproc", "1",
             "--accumulate", str(MICROBATCHES), "--out", str(dp))
    summary = run_json("train", *UNBALANCED, *SGD, "--strategy", "pipeline", "--nproc", "2",
                       "--microbatches", str(MICROBATCHES), "--out", str(tmp_path / "run"))
    bounds = [worker["layers"] for worker in summary["workers"]]
    assert bounds != [[0, 7], [7, 14]] and bounds[0][0] == 0 and bounds[-1][1] == 14
    heavy = next(stage for stage, (start, end) in enumerate(bounds) if start <= 3 < end)
    sizes = [end - start for start, end in bounds]
    assert sizes[heavy] < sizes[1 - heavy]
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())  # what --plan reruns
    assert [[stage["start"], stage["end"]] for stage in plan["stages"]] == bounds
    assert max_abs_diff(dp / "final.pt", tmp_path / "run" / "final.pt") <= 1e-5


@pytest.mark.pure
def test_profile_at_split_points(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "profile", *TIED, "--split-points", "layers.1,norm", "--json")
    assert code == 0, err
    assert [layer["name"] for layer in json.loads(out)["layers"]] == [
        "0: embed..layers.0", "1: layers.1..layers.2", "2: norm..out"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("flags", "message"), [
    (("--strategy", "dp"), "--split-points cuts a model into pipeline blocks; it needs --strategy "
                           "pipeline (this run is dp)"),
    (("--strategy", "pipeline", "--nproc", "2"), "split point 'layers.7' is not a submodule"),
])
def test_split_points_mistakes(capsys: pytest.CaptureFixture[str], flags: tuple[str, ...],
                               message: str) -> None:
    code, _, err = run_cli(capsys, "train", *TIED, *flags, "--split-points", "layers.7")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


@pytest.mark.multiprocess
def test_an_untraceable_model_is_one_line_and_exit_2() -> None:
    result = run_here("train", "--model", "tests.split_models:value_branch", "--data", "digits",
                      "--strategy", "pipeline", "--nproc", "2", "--steps", "1")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "cannot trace model 'tests.split_models:value_branch'" in lines[0]
    assert "`if h.sum() > 0:`" in lines[0] and "nn.Sequential" in lines[0]


@pytest.mark.pure
@pytest.mark.parametrize("codec", [None, "bf16"])
def test_several_tensors_travel_as_one_message(codec: str | None) -> None:
    wire = Wire.build(codec, rank=0, world_size=2)
    tensors = [torch.randn(3, 4), torch.arange(6).view(3, 2), torch.ones(1, 5, dtype=torch.bool)]
    shapes, dtypes = [t.shape for t in tensors], [t.dtype for t in tensors]
    message = wire.pack_many(tensors, "activation")
    buffer = wire.receive_many(shapes, dtypes, torch.device("cpu"))
    assert buffer.shape == message.shape and buffer.dtype == message.dtype
    got = wire.unpack_many(message, shapes, dtypes, "activation")
    assert torch.allclose(got[0], tensors[0], atol=1e-2 if codec else 0)
    assert torch.equal(got[1], tensors[1]) and torch.equal(got[2], tensors[2])
