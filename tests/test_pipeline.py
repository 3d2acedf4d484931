"""Pipeline parallelism through the real CLI, against single-process references."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from tandem.data import GlobalBatchSampler, build_dataset
from tandem.models import build_model
from tandem.strategy import even_bounds
from tandem.timeline import Timeline, event_action

from tests.conftest import SharedRun, max_abs_diff, run_here, run_json
from tests.test_train_dp import reference_training

COMMON = ("--model", "mlp", "--data", "digits", "--steps", "20", "--batch-size", "32",
          "--lr", "0.05", "--momentum", "0.9", "--seed", "3")


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Plain single-process PyTorch training on the same global batches."""
    path = tmp_path_factory.mktemp("reference") / "final.pt"
    torch.save(reference_training(20, 32, 0.05, 0.9, 3), path)
    return path


@pytest.mark.multiprocess
@pytest.mark.parametrize(("schedule", "layout"), [
    ("gpipe", ("--nproc", "2")),
    ("gpipe", ("--nproc", "4")),
    ("1f1b", ("--nproc", "2")),
    ("1f1b", ("--nproc", "4")),
    ("1f1b", ("--nproc", "3", "--stages", "2", "--replicas", "2,1")),
    ("gpipe", ("--nproc", "3", "--stages", "2", "--replicas", "2,1")),
])
def test_flush_schedules_match_single_process(single: Path, shared_run: SharedRun,
                                              schedule: str, layout: tuple[str, ...]) -> None:
    """(Two of these runs are test_compress_pipeline.py's uncompressed pipelines too.)"""
    out, summary = shared_run(*COMMON, "--strategy", "pipeline", "--schedule", schedule,
                              "--microbatches", "4", *layout)
    assert summary["schedule"] == schedule and summary["steps"] == 20
    assert max_abs_diff(single, out / "final.pt") <= 1e-5
    assert (out / "trace.json").exists()


@pytest.mark.multiprocess
def test_pipeline_from_a_plan(single: Path, tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    result = run_here("plan", "--model", "mlp", "--devices", "3", "--bandwidth", "10Gb/s",
                      "--schedule", "gpipe", "--microbatches", "4", "-o", str(plan), "--json")
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)["config"]
    summary = run_json("train", *COMMON, "--strategy", "pipeline", "--plan", str(plan),
                       "--out", str(tmp_path))
    assert summary["pipeline"] == config and summary["world_size"] == 3
    assert (summary["schedule"], summary["microbatches"]) == ("gpipe", 4)
    assert max_abs_diff(single, tmp_path / "final.pt") <= 1e-5


def pipedream_reference(num_stages: int, steps: int, vertical_sync: bool,
                        restart: int | None = None) -> dict[str, torch.Tensor]:
    """PipeDream's semantics written out sequentially: stage ``s`` computes minibatch ``k`` with
    its weights after ``max(0, k - (S - s) + 1)`` updates (stage 0's count under vertical sync),
    and applies the resulting gradient as its ``k``-th update. Resumed at ``restart``, the
    pipeline fills again: no minibatch uses weights older than the restart's. The optimizer is
    the defaults' (lr 0.05, momentum 0.9) compensated as docs/large_batch.md says: no momentum,
    and the long-run step 0.05 / (1 - 0.9) divided by sqrt(S), or by S with vertical sync."""
    data = build_dataset("digits")
    torch.manual_seed(3)
    model = build_model("mlp", data.info)
    stages = [nn.Sequential(*list(model)[a:b]) for a, b in even_bounds(len(model), num_stages)]
    step = 0.05 / (1 - 0.9) / (num_stages if vertical_sync else num_stages ** 0.5)
    optimizers = [torch.optim.SGD(stage.parameters(), lr=step, momentum=0.0) for stage in stages]
    history = [[{n: p.detach().clone() for n, p in stage.named_parameters()}] for stage in stages]
    sampler = GlobalBatchSampler(len(data.train), global_batch_size=32, seed=3)
    for k in range(steps):
        versions = [max(0, k - (num_stages - s) + 1) for s in range(num_stages)]
        if vertical_sync:
            versions = [versions[0]] * num_stages
        if restart is not None and k >= restart:
            versions = [max(restart, v) for v in versions]
        weights = [{n: t.clone().requires_grad_() for n, t in history[s][versions[s]].items()}
                   for s in range(num_stages)]
        batch = sampler.global_indices(k)
        h = data.train.inputs[batch]
        for stage, stage_weights in zip(stages, weights):
            h = functional_call(stage, stage_weights, (h,))
        loss = F.cross_entropy(h, data.train.targets[batch])
        flat = [t for stage_weights in weights for t in stage_weights.values()]
        grads = iter(torch.autograd.grad(loss, flat))
        for stage, optimizer, past in zip(stages, optimizers, history):
            for p in stage.parameters():
                p.grad = next(grads)
            optimizer.step()
            past.append({n: p.detach().clone() for n, p in stage.named_parameters()})
    return model.state_dict()


def _versions(trace: Path) -> dict[tuple[int, str, int], int]:
    """(worker, 'F' or 'B', minibatch) -> weight version, from a run's trace."""
    timeline = Timeline.from_json(json.loads(trace.read_text()))
    actions = [(e, event_action(e.name)) for e in timeline.events]
    return {(e.worker, a.kind.value, a.microbatch): e.version for e, a in actions
            if a is not None and a.kind.is_compute and a.microbatch is not None}


@pytest.mark.multiprocess
@pytest.mark.parametrize("vertical_sync", [False, True])
def test_pipedream_weight_stashing(tmp_path: Path, vertical_sync: bool) -> None:
    flags = ("--vertical-sync",) if vertical_sync else ()
    run_json("train", *COMMON, "--strategy", "pipeline", "--schedule", "pipedream", "--nproc", "3",
             *flags, "--out", str(tmp_path))
    versions = _versions(tmp_path / "trace.json")
    for stage in range(3):
        for k in range(20):
            forward = versions[(stage, "F", k)]
            assert versions[(stage, "B", k)] == forward, "backward must use its forward's weights"
            expected = max(0, k - (3 - (0 if vertical_sync else stage)) + 1)
            assert forward == expected
            if vertical_sync:
                assert forward == versions[(0, "F", k)]
    assert len({versions[(s, "F", 10)] for s in range(3)}) == (1 if vertical_sync else 3)
    expected_state = pipedream_reference(3, 20, vertical_sync)
    got = torch.load(tmp_path / "final.pt")
    assert max(float((got[k] - expected_state[k]).abs().max()) for k in got) <= 1e-5


@pytest.mark.multiprocess
@pytest.mark.statistical
def test_pipedream_reaches_90_percent_on_digits() -> None:
    summary = run_json("train", "--model", "mlp", "--data", "digits", "--strategy", "pipeline",
                       "--schedule", "pipedream", "--nproc", "3", "--steps", "300",
                       "--batch-size", "64", "--optimizer", "adam", "--lr", "0.002")
    assert summary["test_accuracy"] >= 0.9
    stash = [worker["stash_peak_bytes"] for worker in summary["workers"]]
    params = [worker["parameter_bytes"] for worker in summary["workers"]]
    assert all(s >= p for s, p in zip(stash, params)) and stash[0] > stash[-1] / 2


MISORDERED = """\
gpipe replicas=1-1 microbatches=2
w0: 0F0 0SA0>1 0RG0<1 0B0 0F1 0SA1>1 0RG1<1 0B1 0ST
w1: 1RA0<0 1RA1<0 1F0 1F1 1B0 1SG0>0 1B1 1SG1>0 1ST
"""


@pytest.mark.multiprocess
def test_checker_rejects_a_misordered_schedule_before_running(tmp_path: Path) -> None:
    schedule = tmp_path / "bad.txt"
    schedule.write_text(MISORDERED)
    result = run_here("train", "--strategy", "pipeline", "--schedule", str(schedule),
                      "--nproc", "2", "--batch-size", "32", "--steps", "2", "--out",
                      str(tmp_path / "run"))
    assert result.returncode == 2
    assert "deadlock" in result.stderr and "*0B0*" in result.stderr and "*1F1*" in result.stderr
    assert not (tmp_path / "run" / "trace.json").exists()


@pytest.mark.multiprocess
def test_a_valid_schedule_file_runs(single: Path, tmp_path: Path) -> None:
    from tandem.schedule import one_f_one_b

    schedule = tmp_path / "1f1b.txt"
    schedule.write_text(one_f_one_b([1, 1], 4).text())
    run_json("train", *COMMON, "--strategy", "pipeline", "--schedule", str(schedule),
             "--nproc", "2", "--out", str(tmp_path))
    assert max_abs_diff(single, tmp_path / "final.pt") <= 1e-5


BAD_PIPELINES = {
    "more stages than layers": (("--nproc", "5"), "more stages (5) than layers (4)"),
    "replicas do not add up": (("--nproc", "4", "--stages", "2", "--replicas", "2,1"),
                               "add up to 3 workers but the job has 4"),
    "micro-batches do not divide": (("--nproc", "2", "--batch-size", "30", "--microbatches", "4"),
                                    "--microbatches 4 does not divide --batch-size 30"),
    "1f1b with fewer micro-batches than stages": (("--nproc", "4", "--microbatches", "2"),
                                                  "micro-batches"),
    "resume": (("--nproc", "2", "--resume", "x.pt"), "no checkpoint at x.pt"),
    "unreadable schedule file": (("--nproc", "2", "--schedule", "no/such.txt"),
                                 "--schedule 'no/such.txt' is neither"),
}


NOT_PURE = ("resume",  # a worker finds the checkpoint missing
            "1f1b with fewer micro-batches than stages",  # checked after the forkserver starts
            "more stages than layers")  # the model's blocks are known after it starts


@pytest.mark.parametrize("case", [
    pytest.param(case, marks=pytest.mark.multiprocess if case in NOT_PURE else pytest.mark.pure)
    for case in sorted(BAD_PIPELINES)])
def test_bad_pipeline_input_is_one_line_and_status_2(case: str) -> None:
    args, expected = BAD_PIPELINES[case]
    result = run_here("train", "--strategy", "pipeline", "--steps", "2", *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr
