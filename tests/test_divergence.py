"""Divergence is reported, not hidden: a non-finite or exploding loss (or gradient, or
parameters) stops the run with one line naming the step, the worker and the likely fix, exit
status 1, a record in ``metrics.jsonl``, and the last good checkpoint loadable."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tandem.data import GlobalBatchSampler, build_dataset
from tandem.errors import Diverged, WorkerFailure
from tandem.models import build_model
from tandem.runtime.config import RunConfig
from tandem.runtime.divergence import (
    EXPLODING_FACTOR, OVERFLOWS_IN_A_ROW, LossRule, LossWatch, exploding_limit, likely_fix,
)
from tandem.runtime.launch import _failure
from tests.conftest import run_here, run_json, run_tandem

NAN, INF = math.nan, math.inf


def verdicts(losses: list[float], *, fp16: bool = False) -> list[str | None]:
    rule = LossRule(skips_overflow=fp16)
    return [rule.judge(loss) for loss in losses]


# -- the rules -------------------------------------------------------------------------------


@pytest.mark.pure
def test_the_exploding_limit_is_a_thousand_times_the_first_loss_or_one() -> None:
    assert EXPLODING_FACTOR == 1000
    assert exploding_limit(2.3) == pytest.approx(2300)
    assert exploding_limit(0.02) == 1000  # a small first loss: max(L0, 1)


@pytest.mark.pure
def test_the_rules_step_by_step() -> None:
    exploded = "loss exploded to 2303 (over 1000 x max(its first value 2.3, 1))"
    assert verdicts([2.3, 2.0, 2299.0, 2303.0]) == [None, None, None, exploded]
    assert verdicts([0.02, 999.0, 1001.0]) == [
        None, None, "loss exploded to 1001 (over 1000 x max(its first value 0.02, 1))"]
    assert verdicts([2.3, NAN]) == [None, "loss became nan"]
    assert verdicts([INF]) == ["loss became inf"]  # at once, even on the first step
    assert verdicts([2.3, -INF]) == [None, "loss became -inf"]
    # fp16: a non-finite loss is an overflow the scaler skips; a finite explosion is not
    assert verdicts([NAN, 2.3, INF, 2.1, 5000.0], fp16=True) == [
        None, None, None, None, "loss exploded to 5000 (over 1000 x max(its first value 2.3, 1))"]


def train_curve(lr: float, optimizer: str, steps: int, seed: int = 0) -> list[float]:
    """Per-step losses of a real single-process run: the MLP on digits, one worker's share (32
    of a 64-sample global batch), as a worker of a 2-worker data-parallel job judges them."""
    data = build_dataset("digits")
    torch.manual_seed(seed)
    model = build_model("mlp", data.info)
    opt = (torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9) if optimizer == "sgd"
           else torch.optim.Adam(model.parameters(), lr=lr))
    sampler = GlobalBatchSampler(len(data.train), global_batch_size=64, seed=seed)
    losses = []
    for step in range(steps):
        index = sampler.global_indices(step)
        loss = torch.nn.functional.cross_entropy(model(data.train.inputs[index]),
                                                 data.train.targets[index])
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            losses.append(float(torch.nn.functional.cross_entropy(
                model(data.train.inputs[index[:32]]), data.train.targets[index[:32]])))
    return losses


@pytest.mark.pure
@pytest.mark.parametrize(("lr", "optimizer"), [(0.05, "sgd"), (0.2, "sgd"), (0.01, "adam")])
def test_healthy_runs_are_never_flagged(lr: float, optimizer: str) -> None:
    """Real loss curves (the defaults; a lr 4x larger, whose loss spikes to twice its start
    and recovers; Adam), and synthetic ones with the spikes of healthy training: a
    classifier's, a language model's and a regression's."""
    curve = train_curve(lr, optimizer, steps=300)
    assert curve[-1] < 0.5 * curve[0]  # it trained
    assert verdicts(curve) == [None] * len(curve)
    decay = [0.05 + 2.25 * math.exp(-step / 40) for step in range(500)]
    spiky = [loss * (30 if step % 97 == 50 else 1) for step, loss in enumerate(decay)]
    language = [3.0 + 7.8 * math.exp(-step / 100) * (3 if step == 250 else 1)
                for step in range(500)]
    regression = [0.01 * (5000 if step == 10 else 1) for step in range(100)]  # 50: under 1000
    for losses in (spiky, language, regression):
        assert verdicts(losses) == [None] * len(losses)


@pytest.mark.pure
def test_a_real_divergence_is_flagged_at_its_first_bad_step() -> None:
    curve = train_curve(3.0, "sgd", steps=40)
    flagged = [step for step, verdict in enumerate(verdicts(curve)) if verdict]
    assert flagged and all(loss < 1e3 for loss in curve[:flagged[0]])
    assert not math.isfinite(curve[flagged[0]]) or curve[flagged[0]] > exploding_limit(curve[0])


@pytest.mark.pure
def test_the_likely_fix() -> None:
    assert likely_fix(RunConfig(lr=1e6)) == (
        "the learning rate 1e+06 is likely too large for this model; lower --lr (e.g. 0.05), "
        "add --warmup-steps or --clip-grad-norm")
    assert likely_fix(RunConfig(lr=0.05, warmup_steps=10, clip_grad_norm=1.0)) == (
        "the learning rate 0.05 is likely too large for this model; lower --lr (e.g. 0.005)")
    assert likely_fix(RunConfig(lr=1.0, warmup_steps=10), overflow=True).endswith(
        "lower --lr (e.g. 0.05), add --clip-grad-norm, or train with --precision bf16")
    assert likely_fix(RunConfig(), step_index=0).startswith(
        "the model gives a non-finite loss before any update; check the inputs")


# -- one worker's watch ----------------------------------------------------------------------


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.pure
def test_the_watch_names_the_first_bad_step_and_records_it(tmp_path: Path) -> None:
    watch = LossWatch(RunConfig(lr=1e6, out=str(tmp_path)), where="worker 1 (rank 1)", rank=1,
                      device=torch.device("cpu"))
    for step, total in enumerate([9.2, 8.0, NAN, INF]):  # sums over 4 samples, kept unread
        watch.observe(step, torch.tensor(total), 4)
    with pytest.raises(Diverged) as caught:
        watch.poll()
    message = ("loss became nan at step 3 on worker 1 (rank 1): the learning rate 1e+06 is "
               "likely too large for this model; lower --lr (e.g. 0.05), add --warmup-steps or "
               "--clip-grad-norm")
    assert str(caught.value) == message and isinstance(caught.value, WorkerFailure)
    assert _records(tmp_path) == [{"step": 3, "diverged": "loss became nan", "rank": 1,
                                   "worker": "worker 1 (rank 1)", "loss": None,
                                   "message": message}]


@pytest.mark.pure
def test_fp16_stops_after_too_many_overflows_in_a_row() -> None:
    watch = LossWatch(RunConfig(precision="fp16"), where="worker 0 (rank 1)", rank=1,
                      device=torch.device("cpu"))
    watch.observe(0, torch.tensor(NAN), 1)
    watch.poll()  # an fp16 overflow: skipped, not divergence
    in_a_row = [0, 1, 0] + list(range(1, OVERFLOWS_IN_A_ROW))
    for index, count in enumerate(in_a_row):  # an asynchronous ps worker: steps 0, 2, 4, ...
        watch.check_overflows(2 * index, count)
    with pytest.raises(Diverged, match=re.escape(
            f"overflowed in each of {OVERFLOWS_IN_A_ROW} steps in a row (all skipped, the loss "
            f"scale shrinking each time) from step 7 on worker 0 (rank 1): ")):
        watch.check_overflows(2 * len(in_a_row), OVERFLOWS_IN_A_ROW)


@pytest.mark.pure
def test_parameters_are_checked_before_a_checkpoint() -> None:
    watch = LossWatch(RunConfig(), where="stage 1 (rank 1)", rank=1, device=torch.device("cpu"))
    params = [torch.ones(3), torch.zeros(2, 2)]
    watch.check_parameters(params, 4)
    params[1][0, 1] = INF
    with pytest.raises(Diverged, match=r"^the parameters became inf after step 5 on stage 1 "
                                       r"\(rank 1\): the learning rate 0.05"):
        watch.check_parameters(params, 4)


@pytest.mark.pure
def test_the_launcher_names_the_first_divergence_over_other_failures() -> None:
    def failure(message: str, exitcode: int = 1, signal: str = "<N/A>") -> SimpleNamespace:
        return SimpleNamespace(message={"message": message}, exitcode=exitcode,
                               signal_name=lambda: signal)

    fix = ": the learning rate 1 is likely too large"
    failures = {
        0: failure("WorkerFailure: worker rank 2 stopped responding; rank 0 gave up waiting"),
        1: failure(f"Diverged: loss became nan at step 4 on worker 1 (rank 1){fix}"),
        2: failure(f"Diverged: loss became nan at step 3 on worker 2 (rank 2){fix}"),
        3: failure(f"Diverged: loss became nan at step 3 on worker 3 (rank 3){fix}"),
        4: failure("", exitcode=-15, signal="SIGTERM"),
    }
    error = _failure(SimpleNamespace(failures=failures))  # type: ignore[arg-type]
    assert isinstance(error, Diverged)
    assert str(error) == f"loss became nan at step 3 on worker 2 (rank 2){fix}"


# -- through the command line ----------------------------------------------------------------

EXPLODED = (r"loss exploded to \S+ \(over 1000 x max\(its first value [0-9.]+, 1\)\) at step "
            r"{step} on {where}: the learning rate 1e\+06 is likely too large for this model; "
            r"lower --lr \(e\.g\. 0\.05\), add --warmup-steps or --clip-grad-norm")
BECAME = EXPLODED.replace(r"loss exploded to \S+ \(over 1000 x max\(its first value [0-9.]+, "
                          r"1\)\)", r"loss became (nan|inf|-inf)")
"""Asynchronous updates: a worker's first bad loss may come after two updates at once, when
the parameters are already non-finite (as timing has it)."""


def _one_line(stderr: str) -> str:
    """The only line on stderr besides the warning of more workers than cores (of the whole
    command's stderr from :func:`run_tandem`; of the launcher's from :func:`run_here`)."""
    lines = [line for line in stderr.strip().splitlines()
             if not line.startswith("tandem: warning:")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr and "Error:" not in stderr, stderr
    return lines[0]


@pytest.mark.parametrize(
    ("strategy", "step", "where", "run"),
    [pytest.param(("--nproc", "2"), "2", r"worker [01] \(rank [01]\)", run_tandem,
                  marks=pytest.mark.cli, id="dp"),
     # the workers' own stderr is only seen in a subprocess: the data-parallel and
     # parameter-server cases hold them to it (a server stopped mid-receive once aborted
     # with a C++ error there)
     pytest.param(("--strategy", "ps", "--mode", "async", "--nproc", "3"), r"[23]",
                  r"worker [01] \(rank [12]\)", run_tandem, marks=pytest.mark.cli,
                  id="ps-async"),
     pytest.param(("--strategy", "pipeline", "--nproc", "2"), "2", r"stage 1 \(rank 1\)",
                  run_here, marks=pytest.mark.multiprocess, id="pipeline-1f1b"),
     pytest.param(("--strategy", "pipeline", "--schedule", "pipedream", "--nproc", "2"), "2",
                  r"stage 1 \(rank 1\)", run_here, marks=pytest.mark.multiprocess,
                  id="pipedream")])
def test_lr_1e6_stops_the_run_with_one_line(tmp_path: Path, strategy: tuple[str, ...],
                                            step: str, where: str, run: Any) -> None:
    start = time.monotonic()
    result = run("train", *strategy, "--lr", "1e6", "--steps", "50", "--out", str(tmp_path),
                 "--no-progress")
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr
    line = _one_line(result.stderr)
    allowed = [EXPLODED] + ([BECAME] if "async" in strategy else [])
    assert any(re.fullmatch("tandem train: " + form.format(step=step, where=where), line)
               for form in allowed), line
    assert elapsed < 90  # the others stopped at once, not at --timeout (300 s)
    records = [r for r in _records(tmp_path) if "diverged" in r]
    assert line.removeprefix("tandem train: ") in [r["message"] for r in records]
    for r in records:  # another worker may find its loss non-finite (null) instead
        assert r["step"] == int(r["message"].split(" at step ")[1].split()[0]), r
        assert r["loss"] is None if " became " in r["message"] else r["loss"] > 1e3, r


@pytest.mark.multiprocess
def test_fp16_overflowing_at_every_step_stops_the_run() -> None:
    result = run_here("train", "--nproc", "2", "--precision", "fp16", "--lr", "1e6",
                      "--steps", "60", "--no-progress")
    assert result.returncode == 1, result.stderr
    assert re.fullmatch(
        r"tandem train: the fp16 gradients overflowed in each of 30 steps in a row \(all "
        r"skipped, the loss scale shrinking each time\) from step 2 on worker [01] \(rank "
        r"[01]\): the learning rate 1e\+06 is likely too large for this model; lower --lr "
        r"\(e\.g\. 0\.05\), add --warmup-steps or --clip-grad-norm, or train with --precision "
        r"bf16", _one_line(result.stderr))


def _finite(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return not value.is_floating_point() or bool(torch.isfinite(value).all())
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    return True


@pytest.mark.multiprocess
def test_the_last_good_checkpoint_stays_and_resumes_with_a_sane_lr(tmp_path: Path) -> None:
    """``--lr 1`` trains eleven steps, then explodes (at step 12; with ``nn.Linear``'s
    initialization of the mlp it stalled, and ``--lr 3`` exploded at step 11 from a state that
    ``--lr 0.05`` could resume, which with He's it no longer is): ``checkpoint.pt`` holds the
    step before (finite), and ``--resume --lr 0.05`` from it trains on to the end."""
    common = ("train", "--nproc", "2", "--steps", "30", "--checkpoint-every", "1",
              "--out", str(tmp_path), "--no-progress")
    result = run_here(*common, "--lr", "1")
    assert result.returncode == 1, result.stderr
    line = _one_line(result.stderr)
    match = re.fullmatch(r"tandem train: loss exploded to \S+ \(.*\) at step (\d+) on worker "
                         r"[01] \(rank [01]\): the learning rate 1 is likely too large for this "
                         r"model; lower --lr \(e\.g\. 0\.05\), add --warmup-steps or "
                         r"--clip-grad-norm", line)
    assert match, line
    bad_step = int(match.group(1))
    assert bad_step > 3  # some good steps first
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert state["step"] == bad_step - 1
    assert _finite(state["model"]) and _finite(state["optimizer"])
    resumed = run_json(*common, "--lr", "0.05", "--resume")
    assert resumed["finished"] and math.isfinite(resumed["final_loss"])
    assert _finite(torch.load(tmp_path / "final.pt"))
    after = [r for r in _records(tmp_path) if "loss" in r and "diverged" not in r][-2:]
    assert [r["lr"] for r in after] == [0.05, 0.05]


@pytest.mark.cli
def test_a_parameter_server_stops_on_a_non_finite_gradient(tmp_path: Path) -> None:
    """fp32: the loss is finite but the gradient pushed at step 3 is not; the server names the
    worker that pushed it, and keeps its checkpoint of step 2."""
    result = run_tandem("train", "--model", "tests.faulty_models:inf_gradient", "--strategy",
                        "ps", "--nproc", "3", "--steps", "10", "--checkpoint-every", "1",
                        "--out", str(tmp_path), "--no-progress", timeout_s=180)
    assert result.returncode == 1, result.stderr
    assert re.fullmatch(r"tandem train: the gradient became nan at step 3 on worker [01] \(rank "
                        r"[12]\), pushed to server 0: the learning rate 0\.05 is likely too "
                        r"large for this model; lower --lr \(e\.g\. 0\.005\), add "
                        r"--warmup-steps or --clip-grad-norm", _one_line(result.stderr))
    state = torch.load(tmp_path / "server-0.pt", weights_only=False)
    assert state["step"] == 2 and _finite(state["shard"])
