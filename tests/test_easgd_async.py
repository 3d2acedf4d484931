"""Asynchronous EASGD and EAMSGD: a center on servers, workers on their own clocks (Zhang,
Choromanska and LeCun, 2015), checked against a transcription of the paper's algorithms."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from tandem.data import build_dataset
from tandem.models import build_model
from tandem.runtime.ps.elastic import elastic_update
from tandem.sync.averaging import paper_variables
from tests.conftest import ROOT, VGG, SharedRun, run_cli, run_here, run_json

MUST_SHOW = ("--strategy", "easgd", "--mode", "async", "--nproc", "5", "--steps", "300",
             "--batch-size", "64", "--data", "digits")
"""The issue's run: the defaults (SGD, lr 0.05, momentum 0.9), 4 workers and 1 server."""


def paper_algorithm(steps: int, batch_size: int, lr: float, delta: float, rho: float,
                    period: int, seed: int, nesterov: bool) -> dict[str, torch.Tensor]:
    """One worker of the paper's Algorithm 1 (heavy-ball local steps) or Algorithm 2 (EAMSGD),
    transcribed in its own variables: ``v <- delta v - eta g(x + delta v)`` (Nesterov) or
    ``g(x)`` (heavy ball), ``x <- x + v``; every ``period`` steps ``diff = alpha (x - x~)``,
    ``x <- x - diff``, ``x~ <- x~ + diff``. Same init, data order and mean loss as tandem's
    worker; returns the center."""
    data = build_dataset("digits")
    torch.manual_seed(seed)
    model = build_model("mlp", data.info)
    names = [name for name, _ in model.named_parameters()]
    x = [p.detach().clone() for p in model.parameters()]
    center = [t.clone() for t in x]
    v = [torch.zeros_like(t) for t in x]
    alpha = lr * rho
    num_samples = len(data.train)
    per_epoch = -(-num_samples // batch_size)
    for step in range(steps):
        epoch, index = divmod(step, per_epoch)
        order = torch.randperm(num_samples,
                               generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        batch = order[index * batch_size : (index + 1) * batch_size]
        at = [xi + delta * vi for xi, vi in zip(x, v)] if nesterov else x
        for p, value in zip(model.parameters(), at):
            p.data.copy_(value)
            p.grad = None
        F.cross_entropy(model(data.train.inputs[batch]), data.train.targets[batch]).backward()
        v = [delta * vi - lr * p.grad for vi, p in zip(v, model.parameters())]
        x = [xi + vi for xi, vi in zip(x, v)]
        if (step + 1) % period == 0:
            diffs = [alpha * (xi - ci) for xi, ci in zip(x, center)]
            x = [xi - d for xi, d in zip(x, diffs)]
            center = [ci + d for ci, d in zip(center, diffs)]
    return dict(zip(names, center))


@pytest.mark.multiprocess
@pytest.mark.parametrize("nesterov", [False, True], ids=["easgd", "eamsgd"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_one_worker_follows_the_papers_algorithm(tmp_path: Path, mode: str,
                                                 nesterov: bool) -> None:
    """With one worker nothing is left to chance: its center (``final.pt``) is the paper's,
    EAMSGD's Nesterov momentum included (torch's Sutskever form, changed back to the paper's
    variables at every exchange)."""
    processes = "2" if mode == "async" else "1"
    run_json("train", "--strategy", "easgd", "--mode", mode, "--nproc", processes, "--steps",
             "20", "--batch-size", "32", "--period", "4", "--rho", "2", "--seed", "3",
             "--out", str(tmp_path), *(("--nesterov",) if nesterov else ()))
    got = torch.load(tmp_path / "final.pt")
    expected = paper_algorithm(20, 32, lr=0.05, delta=0.9, rho=2.0, period=4, seed=3,
                               nesterov=nesterov)
    assert got.keys() == expected.keys()
    assert max(float((got[k] - expected[k]).abs().max()) for k in got) <= 1e-5


@pytest.mark.pure
def test_the_elastic_exchange_is_the_papers() -> None:
    """The server's update and the worker's move: ``diff = alpha (x_i - x~)``, the worker
    ``x_i - diff``, the center ``x~ + diff`` (their sum unchanged)."""
    worker, center = torch.tensor([1.0, -2.0, 4.0]), torch.tensor([0.0, 2.0, 4.0])
    moved, new_center = elastic_update(worker, center, alpha=0.25)
    assert torch.equal(moved, torch.tensor([0.75, -1.0, 4.0]))
    assert torch.equal(new_center, torch.tensor([0.25, 1.0, 4.0]))
    assert torch.equal(moved + new_center, worker + center)


@pytest.mark.pure
def test_nesterov_sgd_in_the_papers_variables() -> None:
    """Within :func:`paper_variables`, a Nesterov SGD parameter is the paper's ``x``, from which
    ``x + delta v`` is where the next gradient is taken: torch's parameter after the step."""
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    optimizer = torch.optim.SGD([p], lr=0.1, momentum=0.5, nesterov=True)
    x, v = p.detach().clone(), torch.zeros(2)
    for grad_at in ([1.0, -1.0], [0.5, 2.0]):  # gradients at each step's lookahead point
        g = torch.tensor(grad_at)
        p.grad = g.clone()
        optimizer.step()
        v = 0.5 * v - 0.1 * g
        x = x + v
        with paper_variables(optimizer):
            assert torch.allclose(p.detach(), x, atol=1e-7)
        assert torch.allclose(p.detach(), x + 0.5 * v, atol=1e-7)
    with paper_variables(optimizer):
        p.data.sub_(1.0)  # an elastic move of x leaves v as it is
    assert torch.allclose(p.detach(), x - 1.0 + 0.5 * v, atol=1e-7)


@pytest.mark.multiprocess
@pytest.mark.statistical
def test_async_easgd_reaches_90_percent_with_the_defaults(shared_run: SharedRun) -> None:
    """The issue's must-show: 4 workers, 300 steps of 64 on digits, default optimizer."""
    out, summary = shared_run(*MUST_SHOW)
    assert summary["test_accuracy"] >= 0.9, summary
    assert (summary["strategy"], summary["mode"], summary["period"], summary["rho"]) == (
        "easgd", "async", 4, 1.0)
    assert summary["moving_rate"] == pytest.approx(0.05)
    assert summary["steps"] == 300 and summary["finished"] and summary["workers"] == 4
    # --steps counts global batches: 300 x 4 local steps, period 4 per push
    assert summary["local_steps"] == 1200 == 4 * sum(summary["pushes"].values())
    assert set(summary["pushes"]) == {"1", "2", "3", "4"}
    final = torch.load(out / "final.pt")
    model = build_model("mlp", build_dataset("digits").info)
    model.load_state_dict(final)
    names = {event["name"] for event in json.loads((out / "trace.json").read_text())["traceEvents"]
             if "name" in event}
    assert {"0ST", "0PU", "0PL"} <= names, names


@pytest.mark.multiprocess
def test_stop_and_resume_completes(tmp_path: Path) -> None:
    common = ("train", "--strategy", "easgd", "--mode", "async", "--nproc", "3", "--steps",
              "40", "--batch-size", "32", "--out", str(tmp_path))
    first = run_json(*common, "--stop-after", "20")
    assert first["steps"] == 20 and not first["finished"]
    assert (tmp_path / "server-0.pt").is_file() and not (tmp_path / "final.pt").exists()
    second = run_json(*common, "--resume")
    assert second["steps"] == 40 and second["finished"]
    assert second["local_steps"] == 80
    assert (tmp_path / "final.pt").is_file()


@pytest.mark.cli
def test_a_dead_worker_is_named_and_the_others_go_on() -> None:
    """As in asynchronous ``ps``: the dead worker is named (once, by its supervisor) and the
    job ends with the others. (``--timeout 15``, as the ``ps`` test's; the servers no longer
    wait it out at the end: their receive from the dead worker ends with its connection.)"""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TANDEM_FAULT": "2:5",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    result = subprocess.run(
        [sys.executable, "-m", "tandem", "train", "--strategy", "easgd", "--mode", "async",
         "--nproc", "4", "--steps", "60", "--batch-size", "30", "--timeout", "15", "--json",
         "--no-progress"], capture_output=True, text=True, env=env, timeout=180, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    said = " ".join(result.stderr.split())
    assert re.search(r"worker rank 2 died \(killed by signal 9\); asynchronous training goes on "
                     r"without it", said), result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["finished"] and summary["dead_workers"] == [2]


BAD = {
    "ssp": (("--mode", "ssp"), "--mode 'ssp' is not one of: sync, async for --strategy easgd"),
    "servers in sync mode": (("--servers", "1"),
                             "--servers 1 applies to --strategy easgd --mode async only"),
    "no workers": (("--mode", "async", "--servers", "2"), "--servers 2 leaves no workers"),
    "compress": (("--mode", "async", "--compress", "fp16"),
                 "--compress fp16 is not supported with --strategy easgd"),
    "nesterov with adam": (("--nesterov", "--optimizer", "adam"),
                           "--nesterov gives SGD Nesterov momentum, but this run has --optimizer "
                           "adam; use --optimizer sgd or drop --nesterov"),
    "nesterov without momentum": (("--nesterov", "--momentum", "0"),
                                  "--nesterov needs a momentum"),
    "nesterov with dp": (("--strategy", "dp", "--nesterov"),
                         "--nesterov applies to --strategy easgd only (this run has --strategy "
                         "dp); add --strategy easgd or drop it"),
}


@pytest.mark.pure
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_and_status_2(case: str) -> None:
    args, expected = BAD[case]
    result = run_here("train", "--strategy", "easgd", "--nproc", "2", "--steps", "2", *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert result.stdout == ""


@pytest.mark.pure
def test_the_simulator_refuses_asynchronous_easgd(capsys: pytest.CaptureFixture[str]) -> None:
    """It models synchronous EASGD only: one line, not a synchronous prediction."""
    common = ("simulate", "--profile", VGG, "--devices", "5", "--bandwidth", "10Gb/s",
              "--plan", "easgd")
    code, _, err = run_cli(capsys, *common, "--mode", "async")
    assert code == 2 and err.count("\n") == 1
    assert "the simulator models synchronous EASGD only (this plan has --mode async" in err
    code, _, err = run_cli(capsys, *common, "--nesterov", "--json")
    assert code == 0, err
