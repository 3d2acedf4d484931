"""``--precision`` and ``--clip-grad-norm`` in pipelines, through the real CLI, against
``--strategy dp --nproc 1 --accumulate M`` (M = the pipeline's micro-batches)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.runtime.precision import LossScale
from tests.conftest import max_abs_diff, run_cli, run_json

TIED = ("--model", "tests.split_models:tied_lm", "--data", "tokens:n=256,seq=8,vocab=32",
        "--batch-size", "16", "--steps", "20", "--lr", "0.5", "--momentum", "0.9", "--seed", "3",
        "--clip-grad-norm", "0.5")
OVERFLOW = ("--model", "tests.precision_models:overflow:at=3", "--precision", "fp16",
            "--clip-grad-norm", "0.05", "--steps", "10", "--batch-size", "32", "--lr", "0.1",
            "--seed", "5")
"""Its last block's own weight overflows on the 3rd micro-batch (step 1 of 2 micro-batches);
the gradient it sends back to stage 0 stays finite."""


@pytest.mark.multiprocess
def test_clipped_pipeline_equals_clipped_dp(tmp_path: Path) -> None:
    """The norm is the whole model's: stage 0's two replicas count once, and so does the
    embedding that stage 0 (input) and stage 1 (output layer) share. The clip is active (the
    same run without it ends 2.1 away)."""
    run_json("train", *TIED, "--strategy", "dp", "--nproc", "1", "--accumulate", "4",
             "--out", str(tmp_path / "dp"))
    summary = run_json("train", *TIED, "--strategy", "pipeline", "--nproc", "3", "--replicas",
                       "2,1", "--split-points", "layers.1,norm", "--microbatches", "4",
                       "--out", str(tmp_path / "pipeline"))
    assert summary["pipeline"] == "2-1" and summary["clip_grad_norm"] == 0.5
    assert [tie["stages"] for worker in summary["workers"]
            for tie in worker["shared_parameters"]] == [[0, 1]] * 3
    assert max_abs_diff(tmp_path / "dp" / "final.pt", tmp_path / "pipeline" / "final.pt") <= 1e-5


@pytest.mark.multiprocess
def test_fp16_overflow_on_one_stage_skips_the_step_on_every_stage(tmp_path: Path) -> None:
    run_json("train", *OVERFLOW, "--strategy", "dp", "--nproc", "1", "--accumulate", "2",
             "--out", str(tmp_path / "dp"))
    summary = run_json("train", *OVERFLOW, "--strategy", "pipeline", "--nproc", "2",
                       "--schedule", "gpipe", "--microbatches", "2",
                       "--out", str(tmp_path / "pipeline"))
    assert summary["skipped_steps"] == 1 and summary["precision"] == "fp16"
    assert [worker["skipped_steps"] for worker in summary["workers"]] == [1, 1]
    final = torch.load(tmp_path / "pipeline" / "final.pt")
    assert all(torch.isfinite(value).all() for value in final.values())
    # the same step skipped everywhere, the same scale after it: equal to one process
    assert max_abs_diff(tmp_path / "dp" / "final.pt", tmp_path / "pipeline" / "final.pt") <= 1e-5


@pytest.mark.multiprocess
@pytest.mark.statistical
def test_bf16_pipeline_learns_digits() -> None:
    summary = run_json("train", "--strategy", "pipeline", "--nproc", "2", "--precision", "bf16",
                       "--clip-grad-norm", "5", "--steps", "200", "--lr", "0.1",
                       "--lr-schedule", "cosine", "--seed", "0")
    assert summary["precision"] == "bf16" and summary["skipped_steps"] == 0
    assert summary["test_accuracy"] >= 0.9, summary


@pytest.mark.pure
@pytest.mark.parametrize(("flags", "message"), [
    (("--precision", "fp16"), "--precision fp16 needs one loss scale that every stage changes "
                              "at the same step"),
    (("--clip-grad-norm", "1"), "--clip-grad-norm 1 clips the whole model's gradient, which the "
                                "asynchronous pipedream schedule never has"),
])
def test_pipedream_refuses_fp16_and_clipping(capsys: pytest.CaptureFixture[str],
                                             flags: tuple[str, ...], message: str) -> None:
    code, _, err = run_cli(capsys, "train", "--strategy", "pipeline", "--schedule", "pipedream",
                           "--nproc", "2", "--steps", "2", *flags)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert "--schedule 1f1b or gpipe" in lines[0]


@pytest.mark.pure
def test_loss_scale_follows_grad_scaler() -> None:
    """The pipeline's shared scale changes as torch's GradScaler does on the same overflows."""
    ours = LossScale(growth_interval=2)
    theirs = torch.amp.GradScaler("cpu", growth_interval=2)
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    for overflow in [False, True, False, False, False, True, False]:
        grad = torch.tensor([1.0, float("inf") if overflow else 2.0])
        param.grad = theirs.scale(grad)
        theirs.step(optimizer)
        theirs.update()
        mine = [grad * ours.scale]
        assert ours.unscale(mine) == overflow
        assert overflow or torch.equal(mine[0], grad)
        ours.update(overflow)
        assert ours.scale == theirs.get_scale()
