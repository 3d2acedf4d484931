"""Batch-size schedules: parsing, the sampler across batch changes, the auto policy, step
learning-rate decay, and training with a schedule (data parallel and pipelined against one
process, resumed across a change), and the bad inputs refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem.spec.batch_schedule import (
    auto_next_batch, batch_at, format_schedule, parse_batch_schedule,
)
from tandem.data import GlobalBatchSampler
from tandem.data.sampler import RankBatchSampler
from tandem.errors import UsageError
from tandem.runtime.learning_rate import lr_factor
from tandem.runtime.config import RunConfig, resolve_batch_size

from tests.conftest import SharedRun, max_abs_diff, run_cli, run_json

# 20 steps of digits (1438 training samples): the batch of 256 from step 14 crosses the end of
# the first epoch (8*32 + 6*64 + 3*256 = 1408; step 17 takes the 30 left, step 18 a new epoch)
SCHEDULE = "32@0,64@8,256@14"
COMMON = ("--model", "mlp", "--data", "digits", "--steps", "20", "--batch-schedule", SCHEDULE,
          "--lr", "0.05", "--momentum", "0.9", "--seed", "3", "--log-every", "5")


# -- parsing ---------------------------------------------------------------------------------


@pytest.mark.pure
def test_parse_and_look_up() -> None:
    schedule = parse_batch_schedule("64@0, 128@200,256@400", steps=500)
    assert schedule == ((0, 64), (200, 128), (400, 256))
    assert format_schedule(schedule) == "64@0,128@200,256@400"
    assert [batch_at(schedule, s) for s in (0, 199, 200, 399, 400, 499)] == [
        64, 64, 128, 128, 256, 256]


@pytest.mark.pure
@pytest.mark.parametrize(("text", "message"), [
    ("64@x", "not BATCH@STEP"), ("64", "not BATCH@STEP"), ("@0", "not BATCH@STEP"),
    ("", "empty entry"), ("64@0,,128@5", "empty entry"), ("-64@0", "at least 1"),
    ("64@-1", "at least 0"), ("64@5,128@10", "starts at step 5"),
    ("64@0,128@10,256@10", "does not come after"), ("128@0,64@10", "only grows"),
    ("64@0,128@100", "--steps 100"),
])
def test_malformed_schedules(text: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        parse_batch_schedule(text, steps=100)


@pytest.mark.pure
def test_batch_size_comes_from_the_schedule() -> None:
    settings = resolve_batch_size({"batch_size": None, "batch_schedule": "32@0,64@5"})
    assert RunConfig(**settings).batch_size == 32
    with pytest.raises(UsageError, match="--batch-size is 16"):
        RunConfig(batch_size=16, batch_schedule="32@0,64@5")


# -- the sampler -----------------------------------------------------------------------------


@pytest.mark.pure
def test_steps_walk_epochs_across_batch_changes() -> None:
    sampler = GlobalBatchSampler(10, global_batch_size=2, seed=0, shuffle=False,
                                 schedule=((0, 2), (3, 4)))
    # epoch 0: 2, 2, 2 (step 0-2), then 4 and the 0 left... drawn as (epoch, first, size)
    table = [(sampler.position(s)["epoch"], sampler.position(s)["samples_into_epoch"],
              len(sampler.global_indices(s))) for s in range(7)]
    assert table == [
        (0, 0, 2), (0, 2, 2), (0, 4, 2), (0, 6, 4),
        (1, 0, 4), (1, 4, 4), (1, 8, 2),
    ]
    assert sampler.epoch_steps(0) == range(0, 4)
    assert sampler.epoch_steps(1) == range(4, 7)
    assert sampler.epoch_batch_sizes(1) == [4, 4, 2]
    assert sampler.global_indices(6).tolist() == [8, 9]


@pytest.mark.pure
@pytest.mark.parametrize("schedule", [((0, 8),), ((0, 8), (5, 16)), ((0, 4), (3, 24), (9, 50))])
@pytest.mark.parametrize("num_samples", [64, 101])
def test_every_epoch_reads_every_sample_once(schedule: tuple[tuple[int, int], ...],
                                             num_samples: int) -> None:
    sampler = GlobalBatchSampler(num_samples, global_batch_size=schedule[0][1], seed=7,
                                 schedule=schedule)
    for epoch in range(4):
        seen = [i for step in sampler.epoch_steps(epoch)
                for i in sampler.global_indices(step).tolist()]
        assert sorted(seen) == list(range(num_samples))
        assert sum(sampler.epoch_batch_sizes(epoch)) == num_samples


@pytest.mark.pure
def test_ranks_share_each_scheduled_batch() -> None:
    sampler = GlobalBatchSampler(50, global_batch_size=4, seed=1, schedule=((0, 4), (4, 12)))
    for step in range(12):
        shards = [sampler.local_indices(step, rank=r, world_size=2).tolist() for r in range(2)]
        assert shards[0] + shards[1] == sampler.global_indices(step).tolist()
    loader = RankBatchSampler(sampler, rank=1, world_size=2)
    assert len(list(loader)) == len(sampler.epoch_steps(0))


@pytest.mark.pure
def test_fixed_batch_is_unchanged_and_resume_math_agrees() -> None:
    fixed = GlobalBatchSampler(100, global_batch_size=30, seed=2)
    scheduled = GlobalBatchSampler(100, global_batch_size=30, seed=2, schedule=((0, 30),))
    for step in range(9):
        assert torch.equal(fixed.global_indices(step), scheduled.global_indices(step))
    assert fixed.position(5) == {"epoch": 1, "samples_into_epoch": 30}
    # a sampler grown step by step (auto) lands where one given the whole schedule does
    grown = GlobalBatchSampler(100, global_batch_size=10, seed=2)
    grown.extend(4, 20)
    grown.extend(9, 40)
    whole = GlobalBatchSampler(100, global_batch_size=10, seed=2,
                               schedule=((0, 10), (4, 20), (9, 40)))
    for step in range(20):
        assert grown.position(step) == whole.position(step)
        assert torch.equal(grown.global_indices(step), whole.global_indices(step))
    with pytest.raises(ValueError, match="after step 9"):
        grown.extend(9, 80)


@pytest.mark.pure
def test_shard_epochs_are_cut_for_the_schedule() -> None:
    """Shards: each partition reads its share of every scheduled batch from its own stream."""
    from tandem.data.shards import ShardBatchSampler

    sampler = ShardBatchSampler([10, 7, 13], global_batch_size=4, seed=0, partitions=2,
                                shuffle_buffer=4, schedule=((0, 4), (3, 8)))
    for epoch in range(3):
        steps = sampler.epoch_steps(epoch)
        for rank in range(2):
            taken = [i for step in steps
                     for i in sampler.local_indices(step, rank=rank, world_size=2).tolist()]
            assert taken == sampler.partition_stream(epoch, rank).tolist()
        seen = [i for step in steps for i in sampler.global_indices(step).tolist()]
        assert sorted(seen) == list(range(30))


# -- the auto policy -------------------------------------------------------------------------


@pytest.mark.pure
@pytest.mark.parametrize(("current", "estimate", "workers", "cap", "expected"), [
    (64, None, 2, 1437, 64),        # no estimate yet: keep
    (64, float("nan"), 2, 1437, 64),
    (64, 128.0, 2, 1437, 64),       # not above twice the batch: keep
    (64, 129.0, 2, 1437, 128),      # above: double
    (64, 1e6, 3, 1437, 126),        # rounded down to a multiple of the 3 workers
    (1024, 1e6, 4, 1437, 1436),     # capped at the split, a multiple of the workers
    (1436, 1e6, 4, 1437, 1436),     # at the cap: stays
])
def test_auto_next_batch(current: int, estimate: float | None, workers: int, cap: int,
                         expected: int) -> None:
    assert auto_next_batch(current, estimate, workers=workers, max_batch=cap) == expected


# -- step learning-rate decay ----------------------------------------------------------------


@pytest.mark.pure
def test_step_decay() -> None:
    config = RunConfig(steps=500, lr_schedule="step:0.2@200,400")
    assert [lr_factor(config, s) for s in (0, 199, 200, 399, 400, 499)] == pytest.approx(
        [1, 1, 0.2, 0.2, 0.04, 0.04])


@pytest.mark.pure
@pytest.mark.parametrize(("text", "message"), [
    ("step:0.2", "not step:FACTOR"), ("step:x@200", "not step:FACTOR"),
    ("step:0.2@200,x", "not step:FACTOR"), ("step:0@200", "other than 1"),
    ("step:0.2@300,200", "must increase"), ("step:0.2@500", "--steps 500"),
])
def test_bad_step_decay(text: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        RunConfig(steps=500, lr_schedule=text)


# -- bad input on the command line: one line, exit 2 -----------------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize(("args", "message"), [
    (("--batch-schedule", "64@x"), "not BATCH@STEP"),
    (("--batch-schedule", "128@0,64@10"), "only grows"),
    (("--batch-schedule", "64@0,128@40"), "--steps 20"),
    (("--batch-schedule", "64@0,128@10", "--batch-size", "32"), "--batch-size is 32"),
    (("--batch-schedule", "64@0,126@10", "--nproc", "4"), "the batch 126 of --batch-schedule"),
    (("--batch-schedule", "64@0,2000@10"), "more than the 1438 training samples"),
    (("--batch-schedule", "64@0,132@10", "--strategy", "pipeline", "--nproc", "2",
      "--microbatches", "8"), "--microbatches 8 does not divide the batch 132"),
    (("--batch-schedule", "auto", "--strategy", "ps", "--nproc", "3"), "use --strategy dp"),
    (("--lr-schedule", "step:0.2@x"), "not step:FACTOR"),
])
def test_bad_input_is_one_line(capsys: pytest.CaptureFixture[str], args: tuple[str, ...],
                               message: str) -> None:
    code, _, err = run_cli(capsys, "train", "--steps", "20", "--no-progress", *args)
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1


# -- training with a schedule ----------------------------------------------------------------


@pytest.mark.multiprocess
def test_single_process_logs_the_batch(shared_run: SharedRun) -> None:
    out, summary = shared_run(*COMMON, "--nproc", "1")
    assert summary["batch_schedule"] == SCHEDULE
    assert summary["global_batch_size"] == 256
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["batch_size"]) for r in logged if "batch_size" in r] == [
        (5, 32), (10, 64), (15, 256), (20, 256)]


@pytest.mark.multiprocess
def test_dp_with_a_schedule_matches_one_process(shared_run: SharedRun) -> None:
    single, _ = shared_run(*COMMON, "--nproc", "1")
    dp, summary = shared_run(*COMMON, "--nproc", "2", "--accumulate", "2")
    assert summary["global_batch_size"] == 256
    assert max_abs_diff(single / "final.pt", dp / "final.pt") <= 1e-5


@pytest.mark.multiprocess
def test_pipeline_with_a_schedule_matches_one_process(shared_run: SharedRun) -> None:
    single, _ = shared_run(*COMMON, "--nproc", "1")
    piped, summary = shared_run(*COMMON, "--strategy", "pipeline", "--nproc", "2",
                                "--schedule", "1f1b", "--microbatches", "4")
    assert summary["batch_schedule"] == SCHEDULE
    assert max_abs_diff(single / "final.pt", piped / "final.pt") <= 1e-5


@pytest.mark.multiprocess
def test_resume_across_a_batch_change(shared_run: SharedRun, tmp_path: Path) -> None:
    single, _ = shared_run(*COMMON, "--nproc", "1")
    stopped = run_json("train", *COMMON, "--nproc", "1", "--stop-after", "11",
                       "--out", str(tmp_path))
    assert stopped["global_batch_size"] == 64
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert checkpoint["data"]["samples_into_epoch"] == 8 * 32 + 3 * 64
    assert checkpoint["fingerprint"]["batch_schedule"] == SCHEDULE
    resumed = run_json("train", *COMMON, "--nproc", "1", "--resume", "--out", str(tmp_path))
    assert resumed["steps"] == 20
    assert max_abs_diff(single / "final.pt", tmp_path / "final.pt") <= 1e-6


@pytest.mark.multiprocess
def test_auto_runs_under_dp_and_records_its_schedule(tmp_path: Path) -> None:
    """Without a noise-scale estimate in the trainer the batch stays at --batch-size; the
    decision runs at every log step on every worker (a collective) and is checkpointed."""
    summary = run_json("train", "--steps", "10", "--log-every", "5", "--batch-size", "32",
                       "--batch-schedule", "auto", "--nproc", "2", "--out", str(tmp_path))
    assert summary["batch_schedule"] == "auto"
    assert summary["batch_schedule_grown"] == "32@0"
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert checkpoint["data"]["batch_schedule"] == "32@0"


@pytest.mark.multiprocess
def test_sync_ps_with_a_schedule_matches_one_process(shared_run: SharedRun) -> None:
    single, _ = shared_run(*COMMON, "--nproc", "1")
    ps, summary = shared_run(*COMMON, "--strategy", "ps", "--nproc", "3", "--servers", "1")
    assert (summary["batch_schedule"], summary["global_batch_size"]) == (SCHEDULE, 256)
    assert max_abs_diff(single / "final.pt", ps / "final.pt") <= 1e-5


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", [
    ("--strategy", "ps", "--nproc", "3", "--servers", "1", "--mode", "async"),
    ("--strategy", "gossip", "--nproc", "2", "--async-gossip"),
    ("--strategy", "pipeline", "--nproc", "2", "--schedule", "pipedream"),
])
def test_asynchronous_strategies_follow_the_schedule(shared_run: SharedRun,
                                                     strategy: tuple[str, ...]) -> None:
    out, summary = shared_run(*COMMON, *strategy)
    assert (summary["batch_schedule"], summary["global_batch_size"]) == (SCHEDULE, 256)
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["batch_size"] for r in logged if "batch_size" in r][-1] == 256
