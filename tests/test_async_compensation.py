"""Asynchronous strategies train with the default optimizer settings: the compensation of
stale updates (:mod:`tandem.runtime.asynchrony`), and a step of an asynchronous parameter
server reading a whole global batch."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch

from tandem.runtime.asynchrony import apply_compensation, compensation, restore_momentum
from tandem.runtime.ps.rounds import first_update, next_updates
from tandem.runtime.trainer import async_batch_share
from tests.conftest import SharedRun, run_here


@pytest.mark.pure
def test_parameter_server_updates_take_off_the_implicit_momentum_and_keep_the_step_per_sample() -> None:
    # 4 workers: updates 3 stale, each of a quarter of the batch (Mitliagkas et al.: implicit
    # momentum 1 - 1/4 = 0.75 of the explicit 0.9 leaves 0.15)
    comp = compensation("auto", 0.9, 3, share=0.25)
    assert comp.momentum == pytest.approx(0.15)
    # long-run step per sample: lr * scale / (1 - m') / (B/4) == lr / (1 - 0.9) / B
    assert 0.05 * comp.lr_scale / (1 - comp.momentum) / 16 == pytest.approx(0.05 / 0.1 / 64)


@pytest.mark.pure
def test_pipedream_drops_momentum_and_divides_the_long_run_step() -> None:
    comp = compensation("auto", 0.9, 3)
    assert comp.momentum == 0.0
    assert comp.lr_scale == pytest.approx(1 / 0.1 / math.sqrt(4))
    vertical = compensation("auto", 0.9, 3, every_stage=True)
    assert vertical.lr_scale == pytest.approx(1 / 0.1 / 4)


@pytest.mark.pure
def test_no_delay_or_off_changes_nothing_and_adam_keeps_its_step_size() -> None:
    for comp in (compensation("auto", 0.9, 0), compensation("off", 0.9, 3, share=0.25)):
        assert (comp.momentum, comp.lr_scale) == (0.9, 1.0)
    adam = compensation("auto", 0.9, 3, share=0.25, heavy_ball=False)
    assert (adam.momentum, adam.lr_scale) == (pytest.approx(0.15), 0.25)


@pytest.mark.pure
def test_applied_to_sgd_and_adam_groups() -> None:
    param = torch.nn.Parameter(torch.zeros(2))
    sgd = torch.optim.SGD([param], lr=0.05, momentum=0.9)
    apply_compensation(sgd, compensation("auto", 0.9, 3, share=0.25))
    assert sgd.param_groups[0]["lr"] == pytest.approx(0.05 * 2.125)
    assert sgd.param_groups[0]["momentum"] == pytest.approx(0.15)
    adam = torch.optim.Adam([param], lr=1e-3)
    apply_compensation(adam, compensation("auto", 0.9, 1, heavy_ball=False))
    assert adam.param_groups[0]["betas"] == (pytest.approx(0.4), 0.999)  # 0.9 - 1/2
    assert adam.param_groups[0]["lr"] == pytest.approx(1e-3 / 2 ** 0.5)


@pytest.mark.pure
def test_a_resumed_optimizer_takes_this_runs_momentum_not_the_checkpoints() -> None:
    param = torch.nn.Parameter(torch.zeros(2))
    saved = torch.optim.SGD([param], lr=0.05, momentum=0.9).state_dict()  # a sync run's
    resumed = torch.optim.SGD([param], lr=0.05, momentum=0.9)
    comp = compensation("auto", 0.9, 3, share=0.25)  # resumed asynchronously
    apply_compensation(resumed, comp)
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["momentum"] == 0.9  # what loading alone leaves
    restore_momentum(resumed, comp)
    assert resumed.param_groups[0]["momentum"] == pytest.approx(0.15)


@pytest.mark.pure
@pytest.mark.parametrize("first", [0, 40])
def test_asynchronous_workers_read_every_share_of_every_batch_once(first: int) -> None:
    """The servers number the updates they send workers on to: a first pull's reply, however
    late, and each reply to a push, however many replies one push lets go (bounded staleness
    answers held workers together, on one version: numbered by it, they read one share, as a
    third of the replies did)."""
    workers, version, waiting = 4, first, 0
    pushes: Counter[int] = Counter()
    updates = [first_update(version, pushes, range(workers), worker) for worker in range(3)]

    def push(going: int) -> None:  # a push applied, then ``going`` waiting workers answered
        nonlocal version, waiting
        version, waiting = version + 1, waiting + 1
        pushes[version % 3] += 1
        updates.extend(next_updates(version, workers, waiting=waiting, going=going))
        waiting -= going

    push(1)  # before worker 3's first pull
    updates.append(first_update(version, pushes, range(workers), 3))
    for going in (0, 2, 1, 0, 0, 3, 1, 0, 2, 1):
        push(going)
    reads = [async_batch_share(update, workers=workers) for update in updates]
    assert sorted(reads) == [(first // workers + u // workers, u % workers)
                             for u in range(len(reads))]


DEFAULTS = ("--data", "digits", "--steps", "300", "--batch-size", "64")


@pytest.mark.multiprocess
@pytest.mark.statistical
def test_async_parameter_server_learns_with_the_defaults(shared_run: SharedRun) -> None:
    _, summary = shared_run("--strategy", "ps", "--mode", "async", "--nproc", "5", *DEFAULTS)
    # 0.97-0.975 on seeds 0-2 (benchmarks/async_convergence.py); the order of asynchronous
    # pushes depends on the machine's load, and one run in a loaded suite reached 0.82
    # (uncompensated: 0.09)
    assert summary["test_accuracy"] >= 0.8, summary
    # a step is a global batch: one update per worker's share of it
    assert (summary["steps"], summary["updates"]) == (300, 1200)
    assert summary["async_compensation"] == {"delay": 3, "momentum": 0.15, "lr_scale": 2.125}


@pytest.mark.multiprocess
@pytest.mark.statistical
def test_pipedream_learns_with_the_defaults(shared_run: SharedRun) -> None:
    """4 stages of PipeDream (updates 3 minibatches stale) learn digits with the defaults, but
    their test accuracy after 300 steps depends on the seed: 0.78-0.97 over seeds 0-4 with the
    initialization drawn in sequence, 0.80-0.90 with the initialization by module name (seed 3,
    this test's, is 0.80 now and was 0.97); one process reaches 0.96. The bound is below that
    spread, not at its luckiest end."""
    _, summary = shared_run("--strategy", "pipeline", "--schedule", "pipedream", "--nproc", "4",
                            *DEFAULTS)
    assert summary["test_accuracy"] >= 0.75, summary
    assert summary["final_loss"] < 0.3, summary
    assert summary["async_compensation"]["delay"] == 3


@pytest.mark.multiprocess
def test_async_steps_checkpoint_log_and_evaluate_per_global_batch(shared_run: SharedRun) -> None:
    out, summary = shared_run("--strategy", "ps", "--mode", "ssp", "--nproc", "3", "--steps",
                              "12", "--log-every", "4", "--eval-every", "6",
                              "--checkpoint-every", "6", "--async-compensation", "off")
    assert (summary["steps"], summary["updates"], summary["finished"]) == (12, 24, True)
    assert summary["async_compensation"] is None
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "loss" in r]
    evaluated = [r["step"] for r in records if "test_accuracy" in r]
    assert [r["step"] for r in logged] == [4, 8, 12]
    assert evaluated == [6, 12]
    assert torch.load(out / "server-0.pt", weights_only=False)["step"] == 12


@pytest.mark.pure
def test_bad_compensation_and_mid_run_evaluation_of_split_servers_are_one_line() -> None:
    result = run_here("train", "--strategy", "ps", "--mode", "async", "--nproc", "3",
                        "--async-compensation", "yes")
    assert result.returncode == 2 and "--async-compensation 'yes'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = run_here("train", "--strategy", "dp", "--nproc", "2", "--async-compensation", "off")
    assert result.returncode == 2 and "--async-compensation off" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = run_here("train", "--strategy", "ps", "--mode", "async", "--nproc", "3",
                        "--staleness-lr")
    assert result.returncode == 2 and "--async-compensation off" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = run_here("train", "--strategy", "ps", "--mode", "ssp", "--nproc", "3",
                        "--compress", "topk:ratio=0.1", "--checkpoint-every", "5")
    assert result.returncode == 2 and "--mode sync" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = run_here("train", "--strategy", "ps", "--servers", "2", "--nproc", "4",
                        "--eval-every", "5")
    assert result.returncode == 2 and "--servers 1" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
