"""A run directory knows what it holds: ``--resume`` refuses a checkpoint it cannot continue
exactly (another strategy's, other servers', a compressed ps run's on other workers) in one
line naming both, and a checkpoint whose bytes do not match the checksum saved with it is named
corrupt, with the previous checkpoint (kept beside it) offered instead.

A refusal of a corrupt checkpoint goes through the real command line in a session of its own
(exit status, at most 3 lines on stderr, no process left: the command has started its
forkserver by then); the other refusals, which ``check_job`` makes at the same point before
any worker starts, run in this process (one command line costs ~6 CPU-s), as do the runs
they refuse to continue and the checks of the files themselves."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from tandem.errors import UsageError
from tandem.runtime.checkpoint import CHECKPOINT_VERSION, load_checkpoint, save_atomic, \
    save_checkpoint
from tandem.runtime.checksum import TRAILER_BYTES, folder_sums, verify_file, verify_folder
from tandem.runtime.run_checkpoints import PREVIOUS
from tandem.runtime.sharded_checkpoint import remove_older

from tests.conftest import ROOT, max_abs_diff, run_here, run_json
from tests.test_hardening_waits import finish, start

RUN = ("--model", "mlp", "--data", "digits", "--steps", "12", "--batch-size", "60",
       "--seed", "2", "--no-progress")
SOURCE = {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
"""This checkout's code in the commands the tests start (a worktree's, not the installed)."""


def refused(*args: str) -> str:
    """``tandem train ARGS`` in this process: exit status 2 and one line (at most 3 lines on
    stderr, a warning about this machine's cores included); the line."""
    result = run_here("train", *RUN, *args)
    return _error_line(result.returncode, result.stderr)


def refused_by_the_command(*args: str) -> str:
    """:func:`refused` from the command line, and no process of it left."""
    process, mark = start("train", *RUN, *args, env=SOURCE)
    code, _, err = finish(process, mark, timeout_s=120)
    return _error_line(code, err)


def _error_line(code: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) <= 3, err
    errors = [line for line in lines if line.startswith("tandem train: error: ")]
    assert len(errors) == 1, err
    return errors[0].removeprefix("tandem train: error: ")


def flip(path: Path, count: int = 64) -> None:
    """Flip ``count`` bytes in the middle of ``path``'s data (not its checksum)."""
    data = bytearray(path.read_bytes())
    middle = (len(data) - TRAILER_BYTES) // 2
    for index in range(middle, middle + count):
        data[index] ^= 0xFF
    path.write_bytes(bytes(data))


def _state(step: int) -> dict[str, object]:
    return {"version": CHECKPOINT_VERSION, "step": step, "fingerprint": {"seed": 0},
            "model": {"w": torch.full((256,), float(step))}}


# -- the files themselves --------------------------------------------------------------------


@pytest.mark.pure
def test_a_flipped_byte_is_named_corrupt_and_the_previous_checkpoint_offered(
        tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(_state(5), path, resume=None)
    save_checkpoint(_state(10), path, resume=None)  # step 5 is kept as previous/checkpoint.pt
    previous = tmp_path / PREVIOUS / "checkpoint.pt"
    assert verify_file(path) and load_checkpoint(previous, {"seed": 0})["step"] == 5
    assert torch.load(path, weights_only=False)["step"] == 10  # torch reads it as ever
    flip(path, count=1)
    assert verify_file(path) is False
    with pytest.raises(UsageError) as error:
        load_checkpoint(path, {"seed": 0})
    assert str(error.value) == (
        f"checkpoint {path} is corrupt (its bytes do not match the SHA-256 checksum saved with "
        f"it); resume from the previous one (step 5) with --resume {previous}, or drop "
        f"--resume and add --overwrite to start over")
    flip(previous)
    with pytest.raises(UsageError, match=r"is corrupt \(.*\); drop --resume and add "
                                         r"--overwrite to start over \(no previous checkpoint"):
        load_checkpoint(path, {"seed": 0})


@pytest.mark.pure
def test_a_damaged_checksum_is_corrupt_and_a_file_without_one_still_loads(
        tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(_state(3), path, resume=None)
    data = bytearray(path.read_bytes())
    data[-TRAILER_BYTES + 2] ^= 0xFF  # the trailer's mark: the file no longer looks checksummed
    path.write_bytes(bytes(data))
    assert verify_file(path) is None
    with pytest.raises(UsageError, match="corrupt \\(the checksum saved at its end is damaged"):
        load_checkpoint(path, {"seed": 0})
    older = tmp_path / "older.pt"
    save_atomic(_state(4), older)  # as a tandem before checksums wrote it: no trailer
    assert verify_file(older) is None and load_checkpoint(older, {"seed": 0})["step"] == 4


@pytest.mark.pure
def test_a_run_resumed_from_the_previous_checkpoint_keeps_it(tmp_path: Path) -> None:
    """The checkpoint it replaces is the corrupt one it skipped, not a previous one."""
    path, previous = tmp_path / "checkpoint.pt", tmp_path / PREVIOUS / "checkpoint.pt"
    save_checkpoint(_state(5), path, resume=None)
    save_checkpoint(_state(10), path, resume=None)
    flip(path)
    save_checkpoint(_state(15), path, resume=str(previous))
    assert load_checkpoint(previous, {"seed": 0})["step"] == 5
    assert load_checkpoint(path, {"seed": 0})["step"] == 15


@pytest.mark.pure
def test_a_run_directory_with_only_the_previous_checkpoint_is_not_started_afresh(
        tmp_path: Path) -> None:
    """A removed (say, corrupt) latest checkpoint: resuming afresh would train from step 0 and
    leave the previous one of the old run beside the new run's."""
    from tandem.runtime.checkpoint import resume_path
    from tandem.runtime.run import make_job

    path = tmp_path / "checkpoint.pt"
    save_checkpoint(_state(5), path, resume=None)
    save_checkpoint(_state(10), path, resume=None)
    path.unlink()
    job = make_job("dp", resume="auto", out=str(tmp_path))
    previous = tmp_path / PREVIOUS / "checkpoint.pt"
    with pytest.raises(UsageError) as error:
        resume_path(job, tmp_path)
    assert str(error.value) == (
        f"--out {tmp_path} holds no checkpoint.pt but the previous checkpoint {previous}; resume "
        f"from it with --resume {previous}, or drop --resume and add --overwrite to start over")
    resumed = make_job("dp", resume=str(previous), out=str(tmp_path))
    assert resume_path(resumed, tmp_path) == previous


@pytest.mark.pure
def test_a_sharded_folder_is_checked_file_by_file(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoint-4.dcp"
    folder.mkdir()
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"):
        (folder / name).write_bytes(os.urandom(1000))
    shares = [folder_sums(folder, rank, 3) for rank in range(3)]
    sums = {name: digest for share in shares for name, digest in share.items()}
    assert sorted(sums) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    assert sum(len(share) for share in shares) == 4  # each file hashed by one rank
    assert verify_folder(folder, sums) is None and verify_folder(folder, None) is None
    flip(folder / "__1_0.distcp", count=1)
    assert verify_folder(folder, sums) == "__1_0.distcp"
    (folder / "__2_0.distcp").unlink()
    assert verify_folder(folder, {"__2_0.distcp": sums["__2_0.distcp"]}) == "__2_0.distcp"


@pytest.mark.pure
def test_older_sharded_folders_go_but_the_previous_checkpoints(tmp_path: Path) -> None:
    for step in (4, 8, 12):
        (tmp_path / f"checkpoint-{step}.dcp").mkdir()
    (tmp_path / PREVIOUS).mkdir()
    save_checkpoint({**_state(8), "sharded": "checkpoint-8.dcp"},
                    tmp_path / PREVIOUS / "checkpoint.pt", resume=None)
    remove_older(tmp_path, "checkpoint-12.dcp")
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*.dcp")) == [
        "checkpoint-12.dcp", "checkpoint-8.dcp"]


# -- runs: what the command line refuses, and what it continues ------------------------------


@pytest.mark.multiprocess
def test_dp_and_ps_resume_auto_refuse_each_others_checkpoint(tmp_path: Path) -> None:
    """Each role resumes from its own file name: without the check, either run found none of
    its own and trained afresh, its metrics mixed with the other run's."""
    dp, ps = tmp_path / "dp", tmp_path / "ps"
    run_json("train", *RUN, "--nproc", "3", "--stop-after", "5", "--out", str(dp))
    run_json("train", *RUN, "--nproc", "3", "--strategy", "ps", "--stop-after", "5",
             "--out", str(ps))
    assert refused("--nproc", "3", "--strategy", "ps", "--resume", "auto", "--out", str(dp)) == (
        f"--out {dp} holds a checkpoint of --strategy dp (3 workers, step 5); this run is "
        f"--strategy ps (1 server, 2 workers), which cannot continue it: resume with the "
        f"strategy and layout it was saved with, or drop --resume and add --overwrite to start "
        f"over")
    assert refused("--nproc", "3", "--resume", "auto", "--out", str(ps)) == (
        f"--out {ps} holds a checkpoint of --strategy ps (1 server, 2 workers, step 5); this run "
        f"is --strategy dp (3 workers), which cannot continue it: resume with the strategy and "
        f"layout it was saved with, or drop --resume and add --overwrite to start over")
    # a path to the other kind's file: the same from the file's own settings
    result = run_here("train", *RUN, "--nproc", "3", "--resume", str(ps / "server-0.pt"),
                      "--out", str(tmp_path / "elsewhere"))
    assert result.returncode == 2 and (
        f"checkpoint {ps / 'server-0.pt'} is of --strategy ps, and this run is --strategy dp, "
        f"which cannot continue it") in result.stderr
    assert [p.name for p in dp.iterdir() if p.name.startswith("server")] == []


@pytest.mark.multiprocess
def test_compressed_ps_on_another_worker_count_is_refused(tmp_path: Path) -> None:
    """Each server holds each worker's codec state (the decoder of its pushes, the encoder of
    its replies) and each worker its own: neither splits nor merges."""
    compress = ("--strategy", "ps", "--compress", "topk:ratio=0.1")
    run_json("train", *RUN, *compress, "--nproc", "3", "--stop-after", "5",
             "--out", str(tmp_path))
    assert refused(*compress, "--nproc", "4", "--resume", "auto", "--out", str(tmp_path)) == (
        f"checkpoint {tmp_path / 'server-0.pt'} holds 2 workers' codec state (error feedback, on "
        f"the servers and in worker-K.pt) for --compress topk:ratio=0.1, which cannot be split "
        f"among 3; resume with --nproc 3")


@pytest.mark.multiprocess
def test_another_number_of_servers_is_refused(tmp_path: Path) -> None:
    """Each server holds its own part of the model (was: a worker's ValueError about the
    optimizer's parameter groups, or a new server starting afresh beside resumed ones)."""
    ps = ("--strategy", "ps", "--nproc", "4")
    run_json("train", *RUN, *ps, "--servers", "2", "--stop-after", "5", "--out", str(tmp_path))
    for servers in ("1", "3"):
        result = run_here("train", *RUN, *ps, "--servers", servers, "--resume", "auto",
                          "--out", str(tmp_path))
        assert result.returncode == 2, result.stderr
        assert (f"--out {tmp_path} holds the checkpoint of 2 parameter servers (server-0.pt, "
                f"server-1.pt), and this run has --servers {servers} (each server holds its "
                f"part of the model); resume with --servers 2 --nproc "
                f"{2 + 4 - int(servers)}") in result.stderr.splitlines()[-1]


@pytest.mark.cli
def test_a_corrupt_checkpoint_is_named_and_the_previous_one_resumes(tmp_path: Path) -> None:
    whole = tmp_path / "whole"
    run_json("train", *RUN, "--nproc", "2", "--out", str(whole))
    out = tmp_path / "run"
    run_json("train", *RUN, "--nproc", "2", "--checkpoint-every", "3", "--stop-after", "9",
             "--out", str(out))
    flip(out / "checkpoint.pt")
    previous = out / PREVIOUS / "checkpoint.pt"
    assert refused_by_the_command("--nproc", "2", "--resume", "auto", "--out", str(out)) == (
        f"checkpoint {out / 'checkpoint.pt'} is corrupt (its bytes do not match the SHA-256 "
        f"checksum saved with it); resume from the previous one (step 6) with --resume "
        f"{previous}, or drop --resume and add --overwrite to start over")
    summary = run_json("train", *RUN, "--nproc", "2", "--resume", str(previous), "--out",
                       str(out))
    assert summary["steps"] == 12 and summary["finished"]
    assert max_abs_diff(whole / "final.pt", out / "final.pt") <= 1e-6
    assert load_checkpoint(previous, {})["step"] == 6  # kept: the one it replaced was corrupt


@pytest.mark.multiprocess
def test_a_corrupt_file_of_a_sharded_checkpoint_is_named(tmp_path: Path) -> None:
    run_json("train", *RUN, "--nproc", "2", "--shard", "2", "--checkpoint-every", "4",
             "--stop-after", "8", "--out", str(tmp_path))
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*.dcp")) == [
        "checkpoint-4.dcp", "checkpoint-8.dcp"]  # the latest and the previous checkpoint's
    shard = sorted((tmp_path / "checkpoint-8.dcp").glob("*.distcp"))[1]
    flip(shard, count=1)
    result = run_here("train", *RUN, "--nproc", "2", "--shard", "2", "--resume", "auto",
                      "--out", str(tmp_path))
    assert result.returncode == 2
    assert (f"checkpoint {tmp_path / 'checkpoint.pt'} is corrupt (checkpoint-8.dcp/{shard.name} "
            f"does not match the SHA-256 checksum saved in it); resume from the previous one "
            f"(step 4) with --resume {tmp_path / PREVIOUS / 'checkpoint.pt'}") \
        in result.stderr.splitlines()[-1]
    again = tmp_path.with_name(tmp_path.name + "-previous")
    shutil.copytree(tmp_path, again)
    summary = run_json("train", *RUN, "--nproc", "2", "--shard", "2", "--resume",
                       str(again / PREVIOUS / "checkpoint.pt"), "--out", str(again))
    assert summary["steps"] == 12 and summary["finished"]
