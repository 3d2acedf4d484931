"""Resuming keeps every worker's own state: codec residuals and random streams, and the models
of strategies whose workers differ between synchronizations."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tandem.cli import main
from tandem.compress import build_compression

from tests.conftest import max_abs_diff, run_here, run_json

COMMON = ("--model", "mlp", "--data", "digits", "--steps", "12", "--batch-size", "32",
          "--lr", "0.05", "--seed", "5", "--nproc", "2")


def interrupted_and_whole(tmp_path: Path, *args: str) -> tuple[Path, Path]:
    """Run ``args`` for 12 steps at once, and stopped after 7 then resumed; both final.pt."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run_json("train", *COMMON, *args, "--out", str(whole))
    first = run_json("train", *COMMON, *args, "--out", str(parts), "--stop-after", "7")
    assert first["steps"] == 7 and not first["finished"]
    second = run_json("train", *COMMON, *args, "--out", str(parts), "--resume")
    assert second["steps"] == 12 and second["finished"]
    return whole / "final.pt", parts / "final.pt"


@pytest.mark.multiprocess
@pytest.mark.parametrize("args", [
    ("--compress", "topk:ratio=0.1,momentum=0.9", "--momentum", "0"),
    ("--compress", "qsgd:levels=3", "--momentum", "0.9"),
], ids=["topk-ef-dgc", "qsgd"])
def test_compressed_dp_resumes_exactly(tmp_path: Path, args: tuple[str, ...]) -> None:
    """Residuals, velocities and random streams are in the checkpoint: without them the
    resumed run would drop what error feedback still owed, or redraw the same roundings."""
    whole, resumed = interrupted_and_whole(tmp_path, "--strategy", "dp", *args)
    assert max_abs_diff(whole, resumed) <= 1e-6


@pytest.mark.multiprocess
@pytest.mark.parametrize("args", [
    ("--strategy", "easgd", "--period", "4"),
    ("--strategy", "gossip", "--topology", "ring"),
], ids=["easgd", "gossip"])
def test_decentralized_strategies_resume_each_workers_model(tmp_path: Path,
                                                            args: tuple[str, ...]) -> None:
    """Stopped after step 7: the workers' models (and momentum) differ (EASGD mid-period,
    D-PSGD always), and each gets its own back, and EASGD's center variable too."""
    whole, resumed = interrupted_and_whole(tmp_path, *args, "--momentum", "0.9")
    assert max_abs_diff(whole, resumed) <= 1e-6


@pytest.mark.pure
def test_codec_state_round_trips() -> None:
    """A codec restored from its state encodes the next tensor as the original does."""
    torch.manual_seed(0)
    grads = [torch.randn(50) for _ in range(3)]
    original = build_compression("randk:ratio=0.1,momentum=0.5")
    for grad in grads[:2]:
        original.encode(grad, "w")
    restored = build_compression("randk:ratio=0.1,momentum=0.5")
    restored.load_state_dict(original.state_dict())
    sent = [codec.decode(codec.encode(grads[2], "w"), grads[2], "w")
            for codec in (original, restored)]
    assert torch.equal(sent[0], sent[1])


STOPPED = ("--model", "mlp", "--data", "digits", "--steps", "6", "--batch-size", "32")


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-worker topk run stopped after 3 of 6 steps; each test resumes a copy of it."""
    out = tmp_path_factory.mktemp("stopped")
    run_json("train", *STOPPED, "--compress", "topk:ratio=0.1", "--nproc", "2",
             "--stop-after", "3", "--out", str(out))
    return out


@pytest.mark.multiprocess
def test_resume_with_other_worker_count_is_refused(stopped: Path, tmp_path: Path) -> None:
    out = shutil.copytree(stopped, tmp_path / "run")
    result = run_here("train", *STOPPED, "--compress", "topk:ratio=0.1", "--nproc", "4",
                      "--out", str(out), "--resume", "--no-progress")
    assert result.returncode != 0
    assert ("the checkpoint holds 2 workers' codec state (error feedback) for --compress "
            "topk:ratio=0.1, which cannot be split among 4; resume with --nproc 2") in result.stderr


@pytest.mark.multiprocess
def test_resume_with_another_codec_is_refused(stopped: Path, tmp_path: Path) -> None:
    out = shutil.copytree(stopped, tmp_path / "run")
    result = run_here("train", *STOPPED, "--compress", "sign", "--nproc", "2",
                      "--out", str(out), "--resume", "--no-progress")
    assert result.returncode == 2
    assert "made with compress='topk:ratio=0.1', this run has compress='sign'" in result.stderr


@pytest.mark.pure
def test_powersgd_checkpoints_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--steps", "4", "--compress", "powersgd", "--stop-after", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--compress powersgd cannot be resumed" in err


@pytest.mark.multiprocess
def test_a_synchronous_parameter_server_run_stops_after_and_resumes_exactly(tmp_path: Path) -> None:
    """``--stop-after`` used to be ignored by ``ps`` (the servers served every step); now the
    servers stop there with their checkpoints, and the resumed run equals the whole one."""
    common = ("--strategy", "ps", "--nproc", "3", "--steps", "6", "--batch-size", "32",
              "--seed", "4")
    cut = run_json("train", *common, "--out", str(tmp_path / "cut"), "--stop-after", "3")
    assert (cut["steps"], cut["finished"]) == (3, False)
    assert not (tmp_path / "cut" / "final.pt").exists()
    done = run_json("train", *common, "--out", str(tmp_path / "cut"), "--resume")
    assert (done["steps"], done["finished"]) == (6, True)
    run_json("train", *common, "--out", str(tmp_path / "whole"))
    assert max_abs_diff(tmp_path / "cut" / "final.pt", tmp_path / "whole" / "final.pt") == 0.0
