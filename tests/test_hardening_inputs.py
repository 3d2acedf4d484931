"""Every input a user can get wrong is refused before any worker starts: one line naming the
flag or option, the value and the fix, exit status 2 (issue 12, "validation"); workers that will
share the machine's cores are a warning, once; workers that cannot fit in memory are refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.data import build_dataset, load_data
from tandem.errors import UsageError, shown_on_stderr
from tandem.runtime import preflight
from tandem.runtime.config import RunConfig
from tandem.runtime.run import make_job
from tests.conftest import ROOT, VGG, run_cli

ODD = "tests.odd_models"

BAD_TRAIN = {
    # optimizer and run settings (RunConfig)
    "momentum negative": (("--momentum", "-1"), "--momentum must be in [0, 1) (got -1.0)"),
    "momentum one": (("--momentum", "1"), "--momentum must be in [0, 1) (got 1.0)"),
    "weight decay negative": (("--weight-decay", "-1"), "--weight-decay must be a finite number >= 0 (got -1.0)"),
    "weight decay nan": (("--weight-decay", "nan"), "--weight-decay must be a finite number >= 0 (got nan)"),
    "lr nan": (("--lr", "nan"), "--lr must be a positive finite number (got nan)"),
    "lr inf": (("--lr", "inf"), "--lr must be a positive finite number (got inf)"),
    "lr zero": (("--lr", "0"), "--lr must be a positive finite number (got 0.0)"),
    "timeout nan": (("--timeout", "nan"), "--timeout must be a number of seconds above 0 and at most 604800"),
    "timeout inf": (("--timeout", "inf"), "(got inf); e.g. --timeout 300"),
    "seed 2**70": (("--seed", str(2**70)), "--seed must be between 0 and 4294967295 (got 1180591620717411303424)"),
    "seed negative": (("--seed", "-1"), "--seed must be between 0 and 4294967295 (got -1)"),
    "straggler inf": (("--straggler", "1:inf"), "--straggler '1:inf': need a rank >= 0 and a factor between 1 and 1000"),
    "straggler nan": (("--straggler", "1:nan"), "--straggler '1:nan': need a rank >= 0"),
    "threads huge": (("--threads", str(10**11)), "--threads 100000000000 is more than any machine's cores"),
    "warmup beyond steps": (("--warmup-steps", "5"), "--warmup-steps 5 is more than --steps 2, so the learning rate would never reach --lr; use at most 2"),
    "eval beyond steps": (("--eval-every", "5"), "--eval-every 5 is more than --steps 2"),
    "checkpoint beyond steps": (("--checkpoint-every", "5"), "--checkpoint-every 5 is more than --steps 2"),
    # dataset options
    "one sample": (("--data", "images:n=1"), "n=1 with test=0.2 leaves 1 training and 0 test samples, and both splits need at least one; use n=3 or more"),
    "noise nan": (("--data", "images:noise=nan"), "noise must be a finite number >= 0 (got noise=nan)"),
    "digits empty test": (("--data", "digits:test=0.0001"), "test=0.0001 of the 1797 samples leaves 1797 training and 0 test samples"),
    "tokens zero": (("--model", "gpt", "--data", "tokens:n=0"), "n must be a positive finite number (got n=0); e.g. n=2048"),
    "data seed huge": (("--data", f"images:seed={2**70}"), "seed must be between 0 and 4294967295"),
    "data beyond memory": (("--data", "images:size=100000"), "--data images:size=100000 needs about"),
    "batch beyond data": (("--batch-size", "5000"), "--batch-size 5000 is more than the 1438 training samples of --data digits; use at most 1438"),
    # model options
    "vgg width nan": (("--model", "vgg:width=nan"), "width must be a positive finite number (got width=nan); e.g. width=0.25"),
    "vgg width inf": (("--model", "vgg:width=inf"), "width must be a positive finite number (got width=inf)"),
    "mlp hidden zero": (("--model", "mlp:hidden=0"), "hidden must be a positive finite number (got hidden=0); e.g. hidden=128"),
    "gpt dropout nan": (("--model", "gpt:dropout=nan", "--data", "tokens"), "dropout must be in [0, 1) (got nan)"),
    # the model's output against the data
    "3 outputs for 10 classes": (("--model", f"{ODD}:three_outputs"), f"--model {ODD}:three_outputs outputs 3 logits per prediction, but --data digits has 10 classes; make its last layer output 10"),
    "17 outputs for 10 classes": (("--model", f"{ODD}:seventeen_outputs"), "outputs 17 logits per prediction, but --data digits has 10 classes"),
    "output without logits": (("--model", f"{ODD}:named_output"), "returns a dict {'scores': a float32 tensor of shape (1, 10)}, but the loss (cross-entropy) needs float logits (a tensor, or a .logits field), one row per target; make it return them, or give --loss package.module:function"),
    "model rejects the input": (("--model", f"{ODD}:wrong_input"), f"--model {ODD}:wrong_input fails on one sample of --data digits (input shape (1, 1, 8, 8)): RuntimeError"),
    # the plan's options
    "accumulate zero": (("--accumulate", "0"), "--accumulate must be at least 1 (got 0)"),
    "stages zero": (("--strategy", "pipeline", "--nproc", "2", "--stages", "0"), "--stages must be at least 1 (got 0)"),
    "gossip step nan": (("--strategy", "gossip", "--nproc", "2", "--compress", "topk", "--gossip-step", "nan"), "--gossip-step must be in (0, 1] (got nan)"),
    "rho nan": (("--strategy", "easgd", "--nproc", "2", "--rho", "nan"), "--rho must be a positive number (got nan)"),
    "rho inf": (("--strategy", "easgd", "--nproc", "2", "--rho", "inf"), "--rho must be a positive number (got inf)"),
    # the straggler against the plan's workers
    "straggler beyond workers": (("--straggler", "9:2", "--nproc", "2"), "--straggler 9:2 names rank 9, but the job's 2 workers are ranks 0-1; use a rank from 0 to 1"),
    "straggler on a server": (("--strategy", "ps", "--nproc", "3", "--straggler", "0:2"), "workers are ranks 1-2 (parameter servers: rank 0); use a rank from 1 to 2"),
    "straggler in a pipeline": (("--strategy", "pipeline", "--nproc", "2", "--straggler", "1:2"), "--straggler 1:2 is not supported with --strategy pipeline yet"),
    # the machine
    "workers beyond memory": (("--nproc", "1024", "--batch-size", "1024"), "--nproc 1024 needs about"),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", sorted(BAD_TRAIN))
def test_bad_train_input_is_one_line_and_status_2(capsys: pytest.CaptureFixture[str], case: str) -> None:
    args, expected = BAD_TRAIN[case]
    code, out, err = run_cli(capsys, "train", "--steps", "2", *args)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tandem train: error: "), err
    assert expected in lines[0], err
    assert out == ""


@pytest.mark.pure
def test_straggler_is_checked_under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun the plan is built for the launcher's world: a rank outside it is refused
    by the job itself, in every worker, before training."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    from tandem.cli import build_parser
    from tandem.commands.train import job_from_args

    args = build_parser().parse_args(["train", "--straggler", "5:2"])
    with pytest.raises(UsageError, match="--straggler 5:2 names rank 5, but the job's 2 workers"):
        job_from_args(args)


@pytest.mark.pure
def test_a_model_too_big_for_memory_is_refused_before_it_is_built(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its parameters are counted on the meta device; nothing the size of the model is
    allocated (a real build of this MLP would take 270 MB, training it four times that)."""
    monkeypatch.setattr(preflight, "available_memory_bytes", lambda: 2**29)
    run = RunConfig(model="mlp:hidden=8192,layers=3")
    with pytest.raises(UsageError, match=r"--model mlp:hidden=8192,layers=3 needs about 1\.0 GiB "
                                         r"of memory to train but this machine has 512 MiB"):
        preflight.build_checked(run)


@pytest.mark.pure
@pytest.mark.parametrize(("nproc", "refused"), [(1, False), (2, False), (3, True), (64, True)])
def test_workers_that_cannot_fit_in_memory_are_refused(nproc: int, refused: bool) -> None:
    """Workers of 300 MB in 1 GB available (75% usable): 2 fit; one always may."""
    if not refused:
        preflight.check_memory(nproc, 300 * 2**20, 2**30)
        return
    with pytest.raises(UsageError) as error:
        preflight.check_memory(nproc, 300 * 2**20, 2**30)
    assert str(error.value) == (
        f"--nproc {nproc} needs about {preflight._size(nproc * 300 * 2**20)} of memory ({nproc} "
        f"workers x ~300 MiB: PyTorch, the model and the data in each) but this machine has "
        f"1.0 GiB available; use --nproc 2 or fewer")


@pytest.mark.pure
def test_loss_input_of_a_token_model_needs_a_prediction_per_position() -> None:
    tokens = load_data("tokens:n=8,seq=6,vocab=11")
    run = RunConfig(model="gpt", data="tokens:n=8,seq=6,vocab=11")
    targets = tokens.train.targets[:1]
    preflight.check_loss_input(torch.zeros(1, 6, 11), targets, tokens, run)
    with pytest.raises(UsageError, match=r"makes 1 predictions \(output shape \(1, 11\)\) for a "
                                         r"batch of --data tokens:n=8,seq=6,vocab=11 with 6 targets"):
        preflight.check_loss_input(torch.zeros(1, 11), targets, tokens, run)
    with pytest.raises(UsageError, match="outputs 12 logits per prediction, but --data "
                                         "tokens:n=8,seq=6,vocab=11 has 11 tokens in its vocabulary"):
        preflight.check_loss_input(torch.zeros(1, 6, 12), targets, tokens, run)
    with pytest.raises(UsageError, match="returns an int64 tensor of shape"):
        preflight.check_loss_input(torch.zeros(1, 6, 11, dtype=torch.int64), targets, tokens, run)


@pytest.mark.pure
@pytest.mark.parametrize(("nproc", "threads", "model", "expected"), [
    (64, 1, "mlp", "--nproc 64 on 2 cores: workers will time-share the cores; expect each step to "
                   "take ~32x longer than with one worker per core"),
    (2, 2, "mlp", "--nproc 2 --threads 2 (4 threads) on 2 cores: workers will time-share the "
                  "cores; expect each step to take ~2x longer than with one worker per core"),
    (2, 1, "mlp", None),
    (8, 1, "emulated:profile=p.json", None),  # emulated workers sleep: they share no core
])
def test_sharing_warning(monkeypatch: pytest.MonkeyPatch, nproc: int, threads: int, model: str,
                         expected: str | None) -> None:
    monkeypatch.setattr(preflight, "usable_cores", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run = RunConfig(nproc=nproc, threads=threads, model=model, batch_size=64)
    assert preflight.sharing_warning(run) == expected


@pytest.mark.pure
def test_check_job_warns_once_after_every_check(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.runtime.run import check_job

    monkeypatch.setattr(preflight, "usable_cores", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with shown_on_stderr():  # as the command line shows tandem's warnings
        check_job(make_job("dp", nproc=2, steps=2, batch_size=32))
    assert capsys.readouterr().err == (
        "tandem: warning: --nproc 2 on 1 core: workers will time-share the cores; expect each "
        "step to take ~2x longer than with one worker per core\n")
    with shown_on_stderr(), pytest.raises(UsageError, match="--batch-size 5000"):  # no warning
        check_job(make_job("dp", nproc=2, steps=2, batch_size=5000))
    assert capsys.readouterr().err == ""


@pytest.mark.cli
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs an affinity mask")
def test_train_on_fewer_cores_than_workers_warns_once_before_the_workers_start() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "tandem", "train", "--nproc", "2", "--steps", "2",
         "--batch-size", "32", "--no-progress", "--json"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=180,
        preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}))
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if "warning" in line]
    assert warnings == ["tandem: warning: --nproc 2 on 1 core: workers will time-share the "
                        "cores; expect each step to take ~2x longer than with one worker per "
                        "core"], done.stderr
    assert done.stderr.splitlines()[0] == warnings[0]


def _planning(tmp_path: Path) -> dict[str, tuple[str, ...]]:
    """Planning commands whose output path is bad, and whose input is missing too: the output
    is checked first, before any work (which would fail on the missing input)."""
    missing = str(tmp_path / "no-such-profile.json")
    cluster = ("--devices", "4", "--bandwidth", "10Gb/s")
    return {
        "plan": ("plan", "--profile", missing, *cluster, "-o"),
        "profile": ("profile", "--model", "no-such-model", "--batch-size", "8", "-o"),
        "simulate --trace": ("simulate", "--plan", "dp", "--profile", missing, *cluster, "--trace"),
        "simulate --gantt": ("simulate", "--plan", "dp", "--profile", missing, *cluster, "--gantt"),
        "search": ("search", "--profile", missing, *cluster, "-o"),
        "scale": ("scale", "--profile", missing, "--cluster", "8x10Gb/s", "--plot"),
    }


@pytest.mark.pure
@pytest.mark.parametrize("command", ["plan", "profile", "simulate --trace", "simulate --gantt",
                                     "search", "scale"])
@pytest.mark.parametrize("where", ["/proc", "missing dir", "a directory"])
def test_unwritable_output_is_refused_before_the_work(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str, where: str) -> None:
    argv = _planning(tmp_path)[command]
    path = {"/proc": "/proc/tandem-out.json", "missing dir": str(tmp_path / "no" / "out.json"),
            "a directory": str(tmp_path)}[where]
    code, out, err = run_cli(capsys, *argv, path)
    assert code == 2 and out == "", err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"{argv[-1]} {path}" in lines[0], err
    expected = {"/proc": "cannot be written in /proc", "missing dir": "does not exist",
                "a directory": "is a directory"}[where]
    assert expected in lines[0], err


@pytest.mark.pure
@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_output_in_a_read_only_directory(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    code, _, err = run_cli(capsys, "plan", "--profile", VGG, "--devices", "4", "--bandwidth",
                           "10Gb/s", "-o", str(locked / "plan.json"))
    assert code == 2 and f"-o {locked / 'plan.json'} cannot be written" in err


@pytest.mark.pure
def test_a_writable_output_leaves_no_trace_of_the_check(capsys: pytest.CaptureFixture[str],
                                                        tmp_path: Path) -> None:
    target = tmp_path / "plan.json"
    code, _, err = run_cli(capsys, "plan", "--profile", VGG, "--devices", "4", "--bandwidth",
                           "10Gb/s", "-o", str(target))
    assert code == 0, err
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


@pytest.mark.pure
def test_the_size_check_counts_a_sharded_workers_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """``make_job`` (``tandem.fit``'s path) checks a model against one worker's share: 1 GiB to
    train whole is refused in 512 MiB, a quarter of it with ``--shard 4`` is not (its structure
    read on the meta device)."""
    from tandem.runtime.run import make_job

    monkeypatch.setattr(preflight, "available_memory_bytes", lambda: 2**29)
    settings = {"model": "mlp:hidden=8192,layers=3", "nproc": 4}
    with pytest.raises(UsageError, match=r"needs about 1\.0 GiB of memory"):
        make_job("dp", {}, **settings)
    job = make_job("dp", {"--shard": 4}, **settings)
    assert job.plan.sharded and job.plan.shard_degree == 4
