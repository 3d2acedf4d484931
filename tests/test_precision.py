"""Mixed precision (``--precision bf16|fp16``) and ``--clip-grad-norm`` through the real CLI,
against fp32 and against a hand-written clipped training loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.data import GlobalBatchSampler, build_dataset
from tandem.models import build_model
from tests.conftest import SharedRun, max_abs_diff, run_here, run_json

DIGITS = ("--steps", "600", "--nproc", "2", "--seed", "0", "--lr-schedule", "cosine",
          "--no-progress")


@pytest.mark.multiprocess
@pytest.mark.statistical
def test_bf16_on_digits_is_within_one_point_of_fp32() -> None:
    fp32 = run_json("train", *DIGITS)
    bf16 = run_json("train", *DIGITS, "--precision", "bf16")
    assert bf16["precision"] == "bf16" and bf16["skipped_steps"] == 0
    assert abs(bf16["test_accuracy"] - fp32["test_accuracy"]) <= 0.01, (bf16, fp32)
    assert fp32["test_accuracy"] >= 0.95


@pytest.mark.multiprocess
def test_fp16_skips_the_step_whose_gradients_overflow(tmp_path: Path) -> None:
    summary = run_json("train", "--model", "tests.odd_models:overflow:at=3", "--precision",
                       "fp16", "--steps", "20", "--nproc", "2", "--out", str(tmp_path),
                       "--no-progress")
    assert summary["skipped_steps"] == 1, summary
    state = torch.load(tmp_path / "final.pt")
    assert all(torch.isfinite(value).all() for value in state.values())
    assert summary["final_loss"] is not None and summary["test_accuracy"] > 0.5


CLIPPED = ("--model", "mlp", "--steps", "15", "--batch-size", "32", "--lr", "0.5",
           "--momentum", "0", "--seed", "1", "--clip-grad-norm", "0.2", "--no-progress")


@pytest.mark.multiprocess
def test_clipped_data_parallel_run_equals_a_plain_clipped_loop(shared_run: SharedRun) -> None:
    """``--clip-grad-norm`` clips the norm of the *global* (allreduced) gradient: 2 workers
    equal one process running ``clip_grad_norm_`` on the whole batch's gradient."""
    out, _ = shared_run(*CLIPPED, "--nproc", "2")
    data = build_dataset("digits")
    torch.manual_seed(1)
    model = build_model("mlp", data.info)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    sampler = GlobalBatchSampler(len(data.train), global_batch_size=32, seed=1)
    norms = []
    for step in range(15):
        index = sampler.global_indices(step)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(data.train.inputs[index]),
                                          data.train.targets[index]).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2)))
        optimizer.step()
    assert max(norms) > 0.2  # the clip was active
    trained = torch.load(out / "final.pt")
    assert max(float((trained[k] - v).abs().max()) for k, v in model.state_dict().items()) <= 1e-5


@pytest.mark.multiprocess
def test_clipped_sync_parameter_servers_equal_clipped_dp(shared_run: SharedRun,
                                                        tmp_path: Path) -> None:
    """In ``ps --mode sync`` the servers clip the workers' mean gradient by its norm over all
    shards (two servers exchange theirs): the same update as ``dp`` (the run above)."""
    dp, _ = shared_run(*CLIPPED, "--nproc", "2")
    summary = run_json("train", *CLIPPED, "--strategy", "ps", "--servers", "2", "--nproc", "4",
                       "--out", str(tmp_path / "ps"))
    assert summary["clip_grad_norm"] == 0.2 and summary["skipped_steps"] == 0
    assert max_abs_diff(dp / "final.pt", tmp_path / "ps" / "final.pt") <= 1e-5


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_fp16_parameter_servers_skip_an_overflowed_push(tmp_path: Path, mode: str) -> None:
    summary = run_json("train", "--model", "tests.odd_models:overflow:at=3", "--precision",
                       "fp16", "--strategy", "ps", "--mode", mode, "--servers", "2", "--nproc",
                       "3", "--steps", "20", "--out", str(tmp_path), "--no-progress")
    assert summary["skipped_steps"] == 1, summary
    assert all(torch.isfinite(v).all() for v in torch.load(tmp_path / "final.pt").values())


@pytest.mark.multiprocess
def test_fp16_run_resumes_exactly_with_its_loss_scale(tmp_path: Path) -> None:
    common = ("--precision", "fp16", "--steps", "12", "--nproc", "2", "--seed", "2",
              "--no-progress", "--checkpoint-every", "6")
    run_json("train", *common, "--out", str(tmp_path / "whole"))
    run_json("train", *common, "--stop-after", "6", "--out", str(tmp_path / "parts"))
    run_json("train", *common, "--resume", "--out", str(tmp_path / "parts"))
    assert max_abs_diff(tmp_path / "whole" / "final.pt", tmp_path / "parts" / "final.pt") == 0.0


@pytest.mark.multiprocess
@pytest.mark.statistical
@pytest.mark.parametrize("strategy", [("--strategy", "gossip", "--nproc", "2"),
                                      ("--strategy", "localsgd", "--nproc", "2"),
                                      ("--strategy", "easgd", "--nproc", "2")],
                         ids=["gossip", "localsgd", "easgd"])
def test_precision_and_clipping_apply_to_decentralized_strategies(
        strategy: tuple[str, ...]) -> None:
    summary = run_json("train", *strategy, "--precision", "bf16", "--clip-grad-norm", "1.0",
                       "--steps", "150", "--no-progress")
    assert summary["precision"] == "bf16" and summary["clip_grad_norm"] == 1.0
    assert summary["test_accuracy"] > 0.8, summary


@pytest.mark.pure
@pytest.mark.parametrize(("args", "expected"), [
    (("--precision", "fp8"), "--precision 'fp8' is not one of: fp32, bf16, fp16"),
    (("--clip-grad-norm", "0"), "--clip-grad-norm must be a positive finite number (got 0.0)"),
    (("--clip-grad-norm", "nan"), "--clip-grad-norm must be a positive finite number (got nan)"),
])
def test_bad_precision_and_clip_are_one_line_and_status_2(args: tuple[str, ...],
                                                          expected: str) -> None:
    result = run_here("train", "--steps", "2", *args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and expected in lines[0], result.stderr
