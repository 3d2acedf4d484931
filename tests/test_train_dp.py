"""Synchronous data parallelism through the real CLI, against single-process references."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from tandem.data import build_dataset
from tandem.models import build_model
from tandem.timeline import Timeline

from tests.conftest import ROOT, SharedRun, max_abs_diff, run_json

COMMON = ("--model", "mlp", "--data", "digits", "--steps", "20", "--batch-size", "32",
          "--lr", "0.05", "--momentum", "0.9", "--seed", "3")


def reference_training(steps: int, batch_size: int, lr: float, momentum: float,
                       seed: int) -> dict[str, torch.Tensor]:
    """Plain single-process PyTorch: same init seed, same shuffled global batches, mean loss."""
    data = build_dataset("digits")
    torch.manual_seed(seed)
    model = build_model("mlp", data.info)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    num_samples = len(data.train)
    per_epoch = -(-num_samples // batch_size)
    for step in range(steps):
        epoch, index = divmod(step, per_epoch)
        order = torch.randperm(num_samples,
                               generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        batch = order[index * batch_size : (index + 1) * batch_size]
        loss = F.cross_entropy(model(data.train.inputs[batch]), data.train.targets[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.state_dict()


@pytest.fixture(scope="module")
def single(shared_run: SharedRun) -> Path:
    """(The one-process run test_tensor_parallel.py compares with too.)"""
    return shared_run(*COMMON, "--nproc", "1")[0]


@pytest.mark.multiprocess
def test_single_worker_matches_plain_pytorch(single: Path) -> None:
    expected = reference_training(20, 32, 0.05, 0.9, 3)
    got = torch.load(single / "final.pt")
    assert got.keys() == expected.keys()
    assert max(float((got[k] - expected[k]).abs().max()) for k in got) <= 1e-6


@pytest.mark.multiprocess
@pytest.mark.parametrize("nproc", [2, 4])
def test_dp_matches_single_process(single: Path, shared_run: SharedRun, nproc: int) -> None:
    """(The 2-worker run is also the ``dp`` that test_strategies.py's servers must equal.)"""
    out, summary = shared_run(*COMMON, "--nproc", str(nproc))
    assert summary["world_size"] == nproc and summary["steps"] == 20
    assert max_abs_diff(single / "final.pt", out / "final.pt") <= 1e-5


@pytest.mark.multiprocess
def test_gradient_accumulation_matches_single_process(single: Path, tmp_path: Path) -> None:
    run_json("train", *COMMON, "--nproc", "2", "--accumulate", "4", "--out", str(tmp_path))
    assert max_abs_diff(single / "final.pt", tmp_path / "final.pt") <= 1e-5


@pytest.mark.multiprocess
def test_training_moves_the_weights(single: Path) -> None:
    data = build_dataset("digits")
    torch.manual_seed(3)
    initial = build_model("mlp", data.info).state_dict()
    final = torch.load(single / "final.pt")
    assert max(float((final[k] - initial[k]).abs().max()) for k in final) > 1e-2


@pytest.mark.multiprocess
def test_resume_gives_the_uninterrupted_result(single: Path, tmp_path: Path) -> None:
    first = run_json("train", *COMMON, "--nproc", "2", "--out", str(tmp_path), "--stop-after", "10")
    assert first["steps"] == 10 and not first["finished"]
    assert not (tmp_path / "final.pt").exists() and (tmp_path / "checkpoint.pt").exists()
    second = run_json("train", *COMMON, "--nproc", "2", "--out", str(tmp_path), "--resume")
    assert second["steps"] == 20 and second["finished"]
    assert max_abs_diff(single / "final.pt", tmp_path / "final.pt") <= 1e-6


@pytest.mark.multiprocess
def test_outputs_and_summary(single: Path) -> None:
    settings = json.loads((single / "config.json").read_text())
    assert settings["run"]["model"] == "mlp" and settings["plan"]["sync"] == {"method": "allreduce"}
    lines = [json.loads(line) for line in (single / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "loss" in line] == [10, 20]
    assert "test_accuracy" in lines[-1]
    timeline = Timeline.from_json(json.loads((single / "trace.json").read_text()))
    # the one-stage schedule's actions: forward, backward and the optimizer step (one worker
    # has no allreduce in its schedule: w0: 0F0 0B0 0ST)
    assert {event.name for event in timeline.events} == {"0F0", "0B0", "0ST"}
    assert len([e for e in timeline.events if e.name == "0ST"]) == 20
    assert all(event.end_s >= event.start_s for event in timeline.events)


@pytest.mark.multiprocess
def test_json_summary_fields(shared_run: SharedRun) -> None:
    """Of the 2-worker run above (any run's summary has them)."""
    _, summary = shared_run(*COMMON, "--nproc", "2")
    for key in ("test_accuracy", "steps", "samples_per_s", "wall_s", "final_loss",
                "step_time_s", "world_size"):
        assert key in summary, key
    assert 0.0 <= summary["test_accuracy"] <= 1.0 and summary["samples_per_s"] > 0


@pytest.mark.multiprocess
@pytest.mark.statistical
def test_demo_reaches_95_percent() -> None:
    summary = run_json("demo")
    assert summary["world_size"] == 2 and summary["strategy"] == "dp"
    assert summary["test_accuracy"] >= 0.95


@pytest.mark.cli
def test_runs_as_a_worker_of_torchrun(single: Path, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "tandem", "train", *COMMON, "--out", str(tmp_path), "--json", "--no-progress"],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    summaries = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(summaries) == 1 and summaries[0]["world_size"] == 2
    assert max_abs_diff(single / "final.pt", tmp_path / "final.pt") <= 1e-5
