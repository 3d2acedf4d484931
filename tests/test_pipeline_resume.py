"""Pipelines stopped, checkpointed and resumed through the real CLI (issue 16).

Flush schedules (1F1B, GPipe) resume to exactly the uninterrupted run, on their own layout or
resharded by parameter name onto another; each stage writes its state into the checkpoint's
DCP folder (sharded and tensor-parallel stages: test_pipeline_checkpoint.py). PipeDream's checkpoint of step ``c`` holds every
stage's weights after exactly ``c`` updates, and the resumed pipeline fills again from ``c``:
both are checked against PipeDream's semantics written out sequentially.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import test_pipeline
from tests.conftest import SharedRun, max_abs_diff, run_here, run_json

COMMON = ("--model", "mlp", "--data", "digits", "--steps", "20", "--batch-size", "32",
          "--lr", "0.05", "--momentum", "0.9", "--seed", "3")
"""As test_pipeline.py's runs, so that the uninterrupted runs are shared with it."""
STRAIGHT = ("--strategy", "pipeline", "--microbatches", "4", "--nproc", "2")
REPLICATED = ("--strategy", "pipeline", "--microbatches", "4", "--nproc", "3", "--stages", "2",
              "--replicas", "2,1")
THREE = ("--strategy", "pipeline", "--microbatches", "4", "--nproc", "3")
PIPEDREAM = ("--strategy", "pipeline", "--schedule", "pipedream", "--nproc", "3")


def checkpoint(out: Path) -> dict[str, Any]:
    """``OUT/checkpoint.pt``, with the model and optimizer state of a flush schedule's (written
    by each stage into the folder it names) read whole under ``"state"``."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    saved = torch.load(out / "checkpoint.pt", weights_only=False)
    if "sharded" in saved:
        whole = out.parent / f"{out.name}-{saved['sharded']}.pt"
        dcp_to_torch_save(out / saved["sharded"], whole)
        saved["state"] = torch.load(whole, weights_only=False)
    return saved


def stopped_then_resumed(out: Path, first: tuple[str, ...], then: tuple[str, ...],
                         resume: str = "auto") -> tuple[dict[str, Any], dict[str, Any],
                                                        dict[str, Any]]:
    """``first`` stopped after 10 of 20 steps (checkpoints every 5), then ``then`` resumed:
    both summaries, and the checkpoint the stopped run left."""
    stopped = run_json("train", *COMMON, *first, "--checkpoint-every", "5", "--stop-after", "10",
                       "--resume", resume, "--out", str(out))
    saved = checkpoint(out)
    resumed = run_json("train", *COMMON, *then, "--checkpoint-every", "5", "--resume", resume,
                       "--out", str(out))
    return stopped, saved, resumed


@pytest.fixture(scope="module")
def one_f_one_b(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any],
                                                                    dict[str, Any], dict[str, Any]]:
    """1F1B on two stages, both attempts with the same ``--resume auto`` (the first finds no
    checkpoint and starts afresh)."""
    out = tmp_path_factory.mktemp("1f1b")
    args = (*STRAIGHT, "--schedule", "1f1b")
    return out, *stopped_then_resumed(out, args, args)


@pytest.mark.multiprocess
def test_resume_auto_without_a_checkpoint_starts_afresh_and_stops_cleanly(
        one_f_one_b: tuple[Path, dict[str, Any], dict[str, Any], dict[str, Any]]) -> None:
    _, stopped, saved, _ = one_f_one_b
    assert (stopped["steps"], stopped["finished"]) == (10, False)
    assert saved["step"] == 10 and saved["data"]["samples_into_epoch"] == 10 * 32
    assert saved["layout"] == {"bounds": [[0, 2], [2, 4]], "replicas": [1, 1]}
    assert len(saved["ranks"]) == 2
    assert saved["sharded"] == "checkpoint-10.dcp" and "model" not in saved  # each stage wrote
    state = saved["state"]
    assert state["model"].keys() == state["optimizer"]["state"].keys()  # by name, every parameter
    assert set(state["optimizer"]["state"]["0.1.weight"]) == {"momentum_buffer"}


@pytest.mark.multiprocess
def test_1f1b_stopped_and_resumed_equals_the_whole_run(
        one_f_one_b: tuple[Path, dict[str, Any], dict[str, Any], dict[str, Any]],
        shared_run: SharedRun) -> None:
    out, _, _, resumed = one_f_one_b
    whole, _ = shared_run(*COMMON, *STRAIGHT, "--schedule", "1f1b")
    assert (resumed["steps"], resumed["finished"]) == (20, True)
    assert max_abs_diff(whole / "final.pt", out / "final.pt") == 0.0


@pytest.mark.multiprocess
def test_resume_auto_with_another_models_checkpoint_is_one_line_and_status_2(
        one_f_one_b: tuple[Path, dict[str, Any], dict[str, Any], dict[str, Any]]) -> None:
    out = one_f_one_b[0]
    result = run_here("train", *COMMON, *STRAIGHT, "--model", "mlp:hidden=32", "--resume",
                      "auto", "--out", str(out), "--no-progress")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "checkpoint.pt was made with model='mlp'" in lines[0]
    assert "model='mlp:hidden=32'" in lines[0]


@pytest.mark.multiprocess
def test_replicated_2_1_stopped_and_resumed_equals_the_whole_run(
        tmp_path: Path, shared_run: SharedRun) -> None:
    args = (*REPLICATED, "--schedule", "1f1b")
    whole, _ = shared_run(*COMMON, *args)
    _, saved, resumed = stopped_then_resumed(tmp_path, args, args)
    assert saved["layout"] == {"bounds": [[0, 2], [2, 4]], "replicas": [2, 1]}
    assert resumed["pipeline"] == "2-1" and resumed["steps"] == 20
    assert max_abs_diff(whole / "final.pt", tmp_path / "final.pt") == 0.0


@pytest.mark.multiprocess
def test_gpipe_saved_on_2_stages_resumes_on_3_resharded_by_name(
        tmp_path: Path, shared_run: SharedRun) -> None:
    whole, _ = shared_run(*COMMON, *STRAIGHT, "--schedule", "gpipe")
    _, saved, resumed = stopped_then_resumed(tmp_path, (*STRAIGHT, "--schedule", "gpipe"),
                                             (*THREE, "--schedule", "gpipe"))
    assert saved["layout"]["replicas"] == [1, 1]
    assert resumed["pipeline"] == "1-1-1" and resumed["steps"] == 20
    assert max_abs_diff(whole / "final.pt", tmp_path / "final.pt") <= 1e-5
    assert checkpoint(tmp_path)["layout"]["replicas"] == [1, 1, 1]


TIED = ("--model", "tests.split_models:tied_lm", "--data", "tokens:n=256,seq=8,vocab=32",
        "--batch-size", "16", "--lr", "0.5", "--precision", "fp16", "--clip-grad-norm", "0.5",
        "--strategy", "pipeline", "--nproc", "2", "--split-points", "layers.1,norm",
        "--microbatches", "4")
"""A split model whose embedding stage 0 and stage 1 share, in fp16 with clipping (given
after COMMON, its flags win)."""


def precision_of(saved: dict[str, Any]) -> dict[str, Any]:
    """The stages' shared precision state in a checkpoint (every worker's, the same)."""
    states = [rank["components"]["precision"] for rank in saved["ranks"]]
    assert all(state == states[0] for state in states)
    return states[0]


@pytest.mark.multiprocess
def test_tied_fp16_pipeline_resumes_with_its_loss_scale(tmp_path: Path) -> None:
    """The tied weight and its momentum are saved under both its names; the stages' shared
    loss scale continues its count of good steps."""
    run_json("train", *COMMON, *TIED, "--out", str(tmp_path / "whole"))
    _, saved, _ = stopped_then_resumed(tmp_path / "parts", TIED, TIED)
    assert precision_of(saved) == {"loss_scale": {"scale": 2.0**16, "good_steps": 10},
                                   "skipped_steps": 0}
    state = saved["state"]["optimizer"]["state"]
    assert torch.equal(state["embed.weight"]["momentum_buffer"],
                       state["out.weight"]["momentum_buffer"])
    assert precision_of(checkpoint(tmp_path / "parts"))["loss_scale"]["good_steps"] == 20
    assert max_abs_diff(tmp_path / "whole" / "final.pt", tmp_path / "parts" / "final.pt") == 0.0


# -- PipeDream ------------------------------------------------------------------------------------

@functools.cache
def pipedream_reference(steps: int, restart: int | None,
                        vertical_sync: bool) -> dict[str, torch.Tensor]:
    """test_pipeline's sequential PipeDream on 3 stages (COMMON's settings), resumed at
    ``restart``."""
    return test_pipeline.pipedream_reference(3, steps, vertical_sync, restart)


def differs(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    assert got.keys() == expected.keys()
    return max(float((got[k] - expected[k]).abs().max()) for k in got)


@pytest.mark.multiprocess
@pytest.mark.parametrize("vertical_sync", [False, True])
def test_pipedream_stops_drained_and_resumes_filling_again(tmp_path: Path,
                                                           vertical_sync: bool) -> None:
    """Stopped after 10 steps its schedule drains: every stage has applied exactly 10 updates,
    with the weight versions of an uninterrupted run; resumed, minibatches 10 and 11 run on
    those weights at every stage instead of older stashed ones."""
    args = (*PIPEDREAM, *(("--vertical-sync",) if vertical_sync else ()))
    stopped, saved, resumed = stopped_then_resumed(tmp_path, args, args)
    assert (stopped["steps"], saved["step"], resumed["steps"]) == (10, 10, 20)
    assert saved["scheduler"]["last_epoch"] == 10
    assert differs(saved["model"], pipedream_reference(10, None, vertical_sync)) <= 1e-5
    final = torch.load(tmp_path / "final.pt")
    assert differs(final, pipedream_reference(20, 10, vertical_sync)) <= 1e-5
    assert differs(final, pipedream_reference(20, None, vertical_sync)) > 1e-4  # it did refill


@pytest.mark.multiprocess
def test_pipedream_killed_mid_run_restarts_from_each_stage_after_exactly_n_updates(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker killed at step 13 leaves the checkpoint of step 10, taken while minibatches
    10-12 were in flight: each stage as it was when it applied its 10th update. The restarted
    job (the same command line) ends as one stopped at step 10 and resumed does."""
    monkeypatch.setenv("TANDEM_FAULT", "1:13")
    summary = run_json("train", *COMMON, *PIPEDREAM, "--checkpoint-every", "5",
                       "--max-restarts", "1", "--resume", "auto", "--out", str(tmp_path))
    assert (summary["restarts"], summary["steps"]) == (1, 20)
    final = torch.load(tmp_path / "final.pt")
    assert differs(final, pipedream_reference(20, 10, False)) <= 1e-5


@pytest.mark.multiprocess
@pytest.mark.statistical
def test_pipedream_stopped_and_resumed_reaches_90_percent_on_digits(tmp_path: Path) -> None:
    """As test_pipeline.py's uninterrupted run (300 steps reach 90%), cut in the middle."""
    args = ("train", "--model", "mlp", "--data", "digits", *PIPEDREAM, "--steps", "300",
            "--batch-size", "64", "--optimizer", "adam", "--lr", "0.002",
            "--checkpoint-every", "50", "--out", str(tmp_path))
    stopped = run_json(*args, "--stop-after", "150")
    assert stopped["steps"] == 150
    saved = checkpoint(tmp_path)
    assert {"exp_avg", "exp_avg_sq", "step"} <= set(saved["optimizer"]["state"]["3.weight"])
    resumed = run_json(*args, "--resume")
    assert resumed["steps"] == 300 and resumed["test_accuracy"] >= 0.9


@pytest.mark.multiprocess
def test_pipedream_checkpoints_between_rounds_of_replicas() -> None:
    result = run_here("train", *COMMON, "--strategy", "pipeline", "--schedule", "pipedream",
                      "--nproc", "3", "--stages", "2", "--replicas", "2,1",
                      "--checkpoint-every", "5")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--checkpoint-every 5: pipedream with replicas 2-1" in lines[0]
    assert "use a multiple of 2, e.g. 6" in lines[0]
