"""Sharded and tensor-parallel pipeline stages checkpointed through DCP, through the real CLI.

gpt (2 blocks, 8 SGD steps with momentum, as test_sharded_pipeline.py's runs) on 2 stages, laid
out on 4 workers as a sharded pipeline (``--shard 2``: each stage's replicas hold half of it)
and as a pipeline x tensor layout (``--tensor-parallel 2``: each worker its shares of its
stage's split layers). The sharded pipeline stopped after 4 steps and resumed, and the pipeline
x tensor layout with a worker killed and the job restarted, end within 1e-6 of their
uninterrupted runs; each rank writes exactly the tensors
it holds into ``checkpoint-STEP.dcp``, and no checkpoint raises a rank's peak memory by more
than that; a checkpoint resumes on another layout (a plain pipeline reads whole tensors, the
fused query/key/value rows put back in order), or is refused in one line. vgg's convolutions
split by channels on sharded stages (3-D) checkpoint and resume too.
"""

from __future__ import annotations

import math
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import SharedRun, max_abs_diff, run_json
from tests.test_sharded import GPT

SHARDED = ("--strategy", "pipeline", "--stages", "2", "--shard", "2", "--nproc", "4")
TENSOR = ("--strategy", "pipeline", "--stages", "2", "--tensor-parallel", "2", "--nproc", "4")
PLAIN = ("--strategy", "pipeline", "--stages", "2", "--nproc", "2")


def stopped_then_resumed(out: Path, layout: tuple[str, ...],
                         model: tuple[str, ...] = GPT) -> dict[str, Any]:
    """``model`` on ``layout`` stopped after 4 of 8 steps (checkpoints every 2), then resumed
    on it: the checkpoint the stopped run left."""
    run_json("train", *model, *layout, "--checkpoint-every", "2", "--stop-after", "4",
             "--out", str(out))
    saved = torch.load(out / "checkpoint.pt", weights_only=False)
    shutil.copytree(out, out.with_name(f"{out.name}-stopped"))
    resumed = run_json("train", *model, *layout, "--checkpoint-every", "2", "--resume",
                       "--out", str(out))
    assert (resumed["steps"], resumed["finished"]) == (8, True)
    return saved


def written_bytes(folder: Path) -> dict[int, int]:
    """Bytes of tensor data each rank wrote into a DCP folder (``__RANK_0.distcp``)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    metadata = FileSystemReader(str(folder)).read_metadata()
    written: Counter[int] = Counter()
    for name, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            size = torch.empty((), dtype=entry.properties.dtype).element_size()
            for chunk in entry.chunks:
                where = metadata.storage_data[MetadataIndex(name, chunk.offsets)]
                written[int(where.relative_path.split("_")[2])] += math.prod(chunk.sizes) * size
    return dict(written)


@pytest.mark.multiprocess
def test_a_sharded_pipeline_stopped_and_resumed_equals_the_whole_run(
        shared_run: SharedRun, tmp_path: Path) -> None:
    """Each rank writes its stage's shards of the parameters and of their momentum (twice its
    parameter bytes; a replica writes no copy of the other's), and the run resumed from them
    ends where the uninterrupted one does (0.0 measured). The same checkpoint resumed as a plain
    pipeline, each stage reading whole tensors, ends there too."""
    whole, summary = shared_run(*GPT, *SHARDED)
    out = tmp_path / "sharded"
    saved = stopped_then_resumed(out, SHARDED)
    assert saved["sharded"] == "checkpoint-4.dcp" and "model" not in saved
    held = {worker["worker"]: worker["parameter_bytes"] for worker in summary["workers"]}
    assert written_bytes(out.with_name("sharded-stopped") / "checkpoint-4.dcp") == {
        rank: 2 * held[rank] for rank in range(4)}
    assert sorted(p.name for p in out.glob("checkpoint-*.dcp")) == [
        "checkpoint-6.dcp", "checkpoint-8.dcp"]  # the latest and the previous checkpoint's
    assert max_abs_diff(whole / "final.pt", out / "final.pt") <= 1e-6
    plain = out.with_name("sharded-stopped")
    as_dp = out.with_name("as-dp")
    shutil.copytree(plain, as_dp)
    run_json("train", *GPT, *PLAIN, "--resume", "--out", str(plain))
    assert max_abs_diff(whole / "final.pt", plain / "final.pt") <= 1e-6
    # and as sharded data parallelism: the folder holds the state by name for any layout
    resumed = run_json("train", *GPT, "--nproc", "2", "--shard", "2", "--resume",
                       "--out", str(as_dp))
    assert resumed["strategy"] == "dp" and resumed["finished"]
    assert max_abs_diff(whole / "final.pt", as_dp / "final.pt") <= 1e-5


@pytest.mark.multiprocess
def test_a_sharded_data_parallel_checkpoint_resumes_as_a_pipeline(
        shared_run: SharedRun, tmp_path: Path) -> None:
    """``--shard 2`` on 2 workers stopped after 4 steps resumes as a 2-stage pipeline, each
    stage reading the tensors it holds from the shards by name, and ends where the data-parallel
    run does (0.0 measured on mlp by hand); so does a plain ``dp`` checkpoint (whole tensors,
    its optimizer's state numbered, with the names in that order), on plain stages and on
    sharded ones (each rank copying its shards out of the whole tensors)."""
    warm = (*GPT, "--warmup-steps", "8")  # the learning rate changes every step
    whole, _ = shared_run(*warm, "--nproc", "2", "--shard", "2")
    run_json("train", *warm, "--nproc", "2", "--shard", "2", "--stop-after", "4",
             "--out", str(tmp_path / "sharded"))
    run_json("train", *warm, *PLAIN, "--resume", "--out", str(tmp_path / "sharded"))
    assert max_abs_diff(whole / "final.pt", tmp_path / "sharded" / "final.pt") <= 1e-5
    # a plain dp checkpoint: whole tensors, its optimizer's state named by parameter_names
    dp = tmp_path / "dp"
    run_json("train", *warm, "--nproc", "2", "--stop-after", "4", "--out", str(dp))
    shutil.copytree(dp, tmp_path / "dp-to-sharded")
    run_json("train", *warm, *PLAIN, "--resume", "--out", str(dp))
    assert max_abs_diff(whole / "final.pt", dp / "final.pt") <= 1e-5
    run_json("train", *warm, *SHARDED, "--resume", "--out", str(tmp_path / "dp-to-sharded"))
    assert max_abs_diff(whole / "final.pt", tmp_path / "dp-to-sharded" / "final.pt") <= 1e-5


@pytest.mark.multiprocess
def test_a_pipeline_x_tensor_checkpoint_resumes_as_a_plain_pipeline(
        shared_run: SharedRun, tmp_path: Path) -> None:
    """The fused query/key/value layers, which each tensor share holds in its own order, are
    saved in the model's: stopped after 4 steps, the checkpoint resumes as data x tensor
    (1 x 2), and as a plain pipeline that stops after 6, whose checkpoint the pipeline x tensor
    layout resumes to the end; each ends where the uninterrupted run does."""
    whole, _ = shared_run(*GPT, *TENSOR)
    run_json("train", *GPT, *TENSOR, "--stop-after", "4", "--out", str(tmp_path))
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert saved["tensor_degree"] == 2 and "row_orders" not in saved
    as_dp = tmp_path.with_name(f"{tmp_path.name}-dp")  # and as data x tensor (1 x 2)
    shutil.copytree(tmp_path, as_dp)
    run_json("train", *GPT, "--nproc", "2", "--tensor-parallel", "2", "--resume",
             "--out", str(as_dp))
    assert max_abs_diff(whole / "final.pt", as_dp / "final.pt") <= 1e-5
    plain = run_json("train", *GPT, *PLAIN, "--resume", "--stop-after", "6",
                     "--out", str(tmp_path))
    assert (plain["steps"], plain["finished"]) == (6, False)
    run_json("train", *GPT, *TENSOR, "--resume", "--out", str(tmp_path))
    assert max_abs_diff(whole / "final.pt", tmp_path / "final.pt") <= 1e-6


@pytest.mark.multiprocess
def test_a_killed_pipeline_x_tensor_worker_is_restarted_and_ends_as_if_uninterrupted(
        shared_run: SharedRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 3 (stage 1, tensor share 1) killed at step 7: the job restarts from the checkpoint
    of step 4 on the same layout (each rank's own random stream) and ends where the
    uninterrupted run does (0.0 measured)."""
    whole, _ = shared_run(*GPT, *TENSOR)
    monkeypatch.setenv("TANDEM_FAULT", "3:7")
    summary = run_json("train", *GPT, *TENSOR, "--checkpoint-every", "4", "--max-restarts", "1",
                       "--resume", "auto", "--out", str(tmp_path))
    assert (summary["restarts"], summary["steps"], summary["finished"]) == (1, 8, True)
    assert max_abs_diff(whole / "final.pt", tmp_path / "final.pt") <= 1e-6


VGG = ("--model", "vgg:width=0.0625,hidden=32", "--data", "digits", "--steps", "8",
       "--batch-size", "32", "--lr", "0.05", "--momentum", "0.9", "--seed", "3")
THREE_D = (*SHARDED[:-2], "--tensor-parallel", "2", "--nproc", "8")


@pytest.mark.multiprocess
def test_sharded_stages_with_convolutions_split_by_channels_checkpoint_and_resume(
        shared_run: SharedRun, tmp_path: Path) -> None:
    """vgg in 3-D (2 stages x 2 shards x tensor 2): each convolution split by channels holds
    its rows as a plain tensor that FSDP2 shards again over the stage's replicas, so each rank
    writes its shard of its rows at their place in the whole layer (rows of tensor rank t lie
    after t blocks). Stopped after 4 of 8 steps and resumed, it ends where one process does;
    the same checkpoint resumes as tensor 2 alone (each worker reading its plain block of
    rows, and saving it again at step 6) and ends there too."""
    single, _ = shared_run(*VGG, "--nproc", "1")
    out = tmp_path / "cube"
    saved = stopped_then_resumed(out, THREE_D, VGG)
    assert saved["sharded"] == "checkpoint-4.dcp"
    assert max_abs_diff(single / "final.pt", out / "final.pt") <= 1e-5
    as_tensor = out.with_name("cube-stopped")
    run_json("train", *VGG, "--nproc", "2", "--tensor-parallel", "2", "--resume",
             "--checkpoint-every", "6", "--out", str(as_tensor))
    assert (as_tensor / "checkpoint-8.dcp").is_dir()  # written by the plain blocks of rows
    assert max_abs_diff(single / "final.pt", as_tensor / "final.pt") <= 1e-5


@pytest.mark.multiprocess
def test_a_sharded_pipelines_checkpoint_holds_no_more_than_each_ranks_shard(
        tmp_path: Path) -> None:
    """No rank gathers its stage, or the model, to save it: over the checkpoints of steps 1 and
    2, no rank's peak resident memory rose above the peak before by more than its shard of the
    parameters and momentum (a gpt of 3.2M parameters: 6.4 MB per rank; measured 0-2.7 MB of
    growth, the first save's own buffers)."""
    summary = run_json("train", "--model", "gpt:layers=4,dim=256,heads=4,dropout=0", "--data",
                       "tokens:n=256,seq=12,vocab=32", "--steps", "2", "--checkpoint-every", "1",
                       "--batch-size", "16", "--lr", "0.05", "--momentum", "0.9", *SHARDED,
                       "--out", str(tmp_path))
    for worker in summary["workers"]:
        assert worker["checkpoint_peak_growth_bytes"] <= 2 * worker["parameter_bytes"], worker


@pytest.mark.pure
def test_the_fp16_loss_scale_carries_between_data_parallelism_and_pipelines() -> None:
    """A pipeline's shared loss scale and a data-parallel worker's GradScaler follow one rule,
    so a checkpoint of either resumes the other's scale and its count of good steps."""
    from tandem.runtime.precision import Precision, StagePrecision

    cpu = torch.device("cpu")
    stage = StagePrecision("fp16", cpu)
    assert stage.loss_scale is not None
    stage.loss_scale.scale, stage.loss_scale.good_steps = 1024.0, 17
    worker = Precision("fp16", cpu)
    worker.load_state_dict(stage.state_dict())
    assert worker.scaler is not None and worker.scaler.get_scale() == 1024.0
    assert worker.scaler.state_dict()["_growth_tracker"] == 17
    again = StagePrecision("fp16", cpu)
    again.load_state_dict(worker.state_dict())
    assert again.loss_scale is not None
    assert (again.loss_scale.scale, again.loss_scale.good_steps) == (1024.0, 17)
