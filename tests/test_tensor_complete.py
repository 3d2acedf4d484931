"""Tensor parallelism takes what data parallelism takes: clipping by the model's global norm and
fp16 with one loss scale for all workers (both agreed by one allreduce per step), and
checkpoints through ``torch.distributed.checkpoint`` — stop and resume, on fewer replicas too,
and a restart after a killed worker — each against the run it must equal."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, SharedRun, max_abs_diff, run_json

MLP = ("--model", "mlp", "--data", "digits", "--steps", "20", "--batch-size", "32",
       "--lr", "0.05", "--momentum", "0.9", "--seed", "3")
GPT = ("--model", "gpt:layers=2,dim=32,heads=4,dropout=0", "--data", "tokens:n=256,seq=12,vocab=32",
       "--steps", "12", "--batch-size", "16", "--lr", "0.05", "--momentum", "0.9", "--seed", "3",
       "--log-every", "2")
DATA_X_TENSOR = ("--nproc", "4", "--tensor-parallel", "2")


@pytest.mark.multiprocess
def test_clipping_takes_the_whole_models_norm(shared_run: SharedRun) -> None:
    """Each worker counts its shares of the split layers and the first its whole layers: the
    clipped run ends where one process clipping the same norm does, and clipping changed it."""
    clip = ("--clip-grad-norm", "0.05")
    single, _ = shared_run(*MLP, "--nproc", "1")
    clipped, _ = shared_run(*MLP, *clip, "--nproc", "1")
    out, summary = shared_run(*MLP, *clip, "--nproc", "2", "--tensor-parallel", "2")
    assert summary["clip_grad_norm"] == 0.05 and summary["tensor_parallel"] == 2
    assert max_abs_diff(clipped / "final.pt", out / "final.pt") <= 1e-5
    assert max_abs_diff(single / "final.pt", clipped / "final.pt") > 1e-3


@pytest.mark.multiprocess
def test_fp16_runs_with_one_loss_scale(shared_run: SharedRun) -> None:
    """Data 2 x tensor 2 in fp16 ends within fp16's rounding of one process in fp16 (4e-5
    apart here; one process in fp16 is as far from the fp32 run), skipping the same steps."""
    fp16 = ("--precision", "fp16")
    single, one = shared_run(*GPT, *fp16, "--nproc", "1")
    out, summary = shared_run(*GPT, *fp16, *DATA_X_TENSOR)
    assert summary["precision"] == "fp16" and summary["finished"]
    assert summary["skipped_steps"] == one["skipped_steps"]
    assert max_abs_diff(single / "final.pt", out / "final.pt") <= 1e-3


@pytest.mark.multiprocess
def test_a_stopped_run_resumes_on_fewer_replicas(shared_run: SharedRun, tmp_path: Path) -> None:
    """Data 2 x tensor 2 stopped after 6 of 12 steps writes each worker's shares (one folder,
    no rank holding the whole model), then resumes as tensor 2 alone (one replica) and ends
    within 1e-6 of the uninterrupted run. The same checkpoint resumes as sharded data
    parallelism (``--shard 2``, whose shards cut the fused query/key/value rows elsewhere),
    stopped after 9 steps, and that checkpoint as tensor 4: it ends within 1e-6 too (plain dp
    reads it whole: tests/test_sharded.py)."""
    whole, _ = shared_run(*GPT, *DATA_X_TENSOR)
    out, other = tmp_path / "run", tmp_path / "other"
    run_json("train", *GPT, *DATA_X_TENSOR, "--out", str(out), "--stop-after", "6")
    checkpoint = torch.load(out / "checkpoint.pt", weights_only=False)
    assert checkpoint["step"] == 6 and checkpoint["tensor_degree"] == 2
    assert "model" not in checkpoint and (out / checkpoint["sharded"]).is_dir()
    shutil.copytree(out, other)
    summary = run_json("train", *GPT, "--nproc", "2", "--tensor-parallel", "2", "--out",
                       str(out), "--resume", "auto")
    assert summary["finished"] and summary["mesh"] == {"data": 1, "pipeline": 1, "tensor": 2}
    assert max_abs_diff(whole / "final.pt", out / "final.pt") <= 1e-6
    sharded = run_json("train", *GPT, "--nproc", "2", "--shard", "2", "--out", str(other),
                       "--resume", "--stop-after", "9")
    assert (sharded["steps"], sharded["finished"]) == (9, False)
    run_json("train", *GPT, "--nproc", "4", "--tensor-parallel", "4", "--out", str(other),
             "--resume")
    assert max_abs_diff(whole / "final.pt", other / "final.pt") <= 1e-6


@pytest.mark.cli
def test_a_killed_worker_is_restarted_and_ends_as_if_uninterrupted(shared_run: SharedRun,
                                                                   tmp_path: Path) -> None:
    whole, _ = shared_run(*GPT, "--nproc", "2", "--tensor-parallel", "2")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TANDEM_FAULT": "1:7",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}  # this checkout's
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    result = subprocess.run(
        [sys.executable, "-m", "tandem", "train", *GPT, "--nproc", "2", "--tensor-parallel", "2",
         "--out", str(tmp_path), "--checkpoint-every", "4", "--max-restarts", "1", "--resume",
         "auto", "--json", "--no-progress"],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert f"tandem: restart 1: resuming from step 4 ({tmp_path / 'checkpoint.pt'})" in \
        result.stderr.splitlines()
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["restarts"] == 1 and summary["finished"]
    assert max_abs_diff(whole / "final.pt", tmp_path / "final.pt") <= 1e-6
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*.dcp")) == [
        "checkpoint-12.dcp", "checkpoint-8.dcp"]  # the latest and the previous checkpoint's
    shutil.rmtree(tmp_path, ignore_errors=True)
