"""Activation recomputation (``--recompute``) and per-stage materialization of pipelines."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.data import build_dataset
from tandem.errors import UsageError
from tandem.models import build_model
from tandem.plan import Plan, Stage
from tandem.runtime.config import RunConfig
from tandem.runtime.job import Job
from tandem.models.pieces import Initializer
from tandem.runtime.pipeline.materialize import materialize, on_meta

from tests.conftest import SharedRun, max_abs_diff, run_here

MLP = ("--model", "mlp:hidden=256", "--data", "digits", "--steps", "6", "--batch-size", "32",
       "--lr", "0.05", "--momentum", "0.9", "--seed", "3")
RESNET = ("--model", "resnet:depth=8,width=4", "--data", "digits", "--steps", "3",
          "--batch-size", "16", "--lr", "0.05", "--momentum", "0.9", "--seed", "3")
PIPE = ("--strategy", "pipeline", "--nproc", "2", "--microbatches", "4")


@pytest.fixture(scope="module")
def single_mlp(shared_run: SharedRun) -> Path:
    return shared_run(*MLP)[0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_recompute_matches_without(single_mlp: Path, shared_run: SharedRun,
                                   schedule: str) -> None:
    plain, without = shared_run(*MLP, *PIPE, "--schedule", schedule)
    again, with_ = shared_run(*MLP, *PIPE, "--schedule", schedule, "--recompute")
    assert max_abs_diff(plain / "final.pt", again / "final.pt") <= 1e-5
    assert max_abs_diff(single_mlp / "final.pt", again / "final.pt") <= 1e-5
    if schedule == "gpipe":  # stage 0 holds 4 micro-batches; with recompute only their inputs
        before = without["workers"][0]["peak_activation_bytes"]
        after = with_["workers"][0]["peak_activation_bytes"]
        assert 0 < after < before / 2, (after, before)


@pytest.mark.multiprocess
def test_recompute_keeps_batchnorm_statistics(shared_run: SharedRun) -> None:
    """The recomputed forward would update BatchNorm's running statistics (and its count of
    batches) a second time: the buffers must come out as without recomputation. (A pipeline's
    BatchNorm sees micro-batches, so one process's statistics differ either way.)"""
    plain, _ = shared_run(*RESNET, *PIPE, "--schedule", "1f1b")
    again, _ = shared_run(*RESNET, *PIPE, "--schedule", "1f1b", "--recompute")
    state = torch.load(again / "final.pt")
    assert any(key.endswith("running_mean") for key in state)
    assert int(state["0.1.num_batches_tracked"]) == 3 * 4  # steps x micro-batches, once each
    assert max_abs_diff(plain / "final.pt", again / "final.pt") <= 1e-5


@pytest.mark.multiprocess
def test_recompute_with_weight_stashing(shared_run: SharedRun) -> None:
    """PipeDream's backward recomputes on the stashed weight version its forward used."""
    plain, _ = shared_run(*MLP, "--strategy", "pipeline", "--nproc", "2", "--schedule",
                          "pipedream")
    again, _ = shared_run(*MLP, "--strategy", "pipeline", "--nproc", "2", "--schedule",
                          "pipedream", "--recompute")
    assert max_abs_diff(plain / "final.pt", again / "final.pt") <= 1e-5


@pytest.mark.multiprocess
def test_a_plan_file_that_recomputes_runs_it(shared_run: SharedRun, tmp_path: Path) -> None:
    plan = Plan(stages=[Stage(start=0, end=2, replicas=1), Stage(start=2, end=4, replicas=1)],
                num_layers=4, num_devices=2, schedule="gpipe", num_microbatches=4,
                recompute=True)
    path = tmp_path / "plan.json"
    plan.save(str(path))
    flags, _ = shared_run(*MLP, *PIPE, "--schedule", "gpipe", "--recompute")
    out, summary = shared_run(*MLP, "--plan", str(path))
    assert summary["world_size"] == 2 and summary["recompute"] is True
    assert summary["workers"][0]["peak_activation_bytes"] < \
        shared_run(*MLP, *PIPE, "--schedule", "gpipe")[1]["workers"][0]["peak_activation_bytes"]
    assert max_abs_diff(flags / "final.pt", out / "final.pt") <= 1e-5


def _refused(*args: str) -> str:
    result = run_here("train", *args, "--no-progress")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.pure
def test_recompute_refusals(tmp_path: Path) -> None:
    assert "--strategy pipeline" in _refused(*MLP, "--recompute", "--out", str(tmp_path / "a"))
    plan = Plan(stages=[Stage(start=0, end=4, replicas=1)], num_layers=4, num_devices=1,
                schedule="gpipe", num_microbatches=2, recompute=True)
    path = tmp_path / "plan.json"
    plan.save(str(path))
    line = _refused(*MLP, "--plan", str(path), "--out", str(tmp_path / "b"))
    assert "1 stage" in line and "--stages" in line


@pytest.mark.pure
def test_recompute_refused_with_tensor_parallelism_alone() -> None:
    """Tensor parallelism alone is one stage: nothing to checkpoint per stage (a pipeline x
    tensor layout recomputes: tests/test_tensor_parallel.py)."""
    plan = Plan(stages=[Stage(start=0, end=4, replicas=1)], num_layers=4, num_devices=2,
                schedule="1f1b", num_microbatches=1, tensor_degree=2, recompute=True)
    with pytest.raises(UsageError, match="1 stage"):
        Job(run=RunConfig(model="mlp", nproc=2), plan=plan)


# -- per-stage materialization ---------------------------------------------------------------

@pytest.mark.pure
@pytest.mark.parametrize("spec", ["mlp", "resnet:depth=8,width=4", "gpt:layers=2,dim=32"])
def test_a_stage_materialized_from_meta_equals_the_whole_model_slice(spec: str) -> None:
    data = build_dataset("tokens" if spec.startswith("gpt") else "digits")
    whole = build_model(spec, data.info, seed=7)
    meta = build_model(spec, data.info, seed=7, device="meta")
    start, end = 1, 3
    stage = materialize(meta, start, end, Initializer(seed=7, by_name=True), torch.device("cpu"))
    assert not on_meta(stage)
    for index, block in enumerate(meta):  # the other blocks were never allocated
        assert on_meta(block) == (not start <= index < end)
    expected = {f"{int(key.split('.')[0]) + start}.{key.partition('.')[2]}": t
                for key, t in stage.state_dict().items()}
    reference = whole.state_dict()
    for key, tensor in expected.items():
        assert torch.equal(tensor, reference[key]), key


@pytest.mark.pure
def test_initialization_depends_on_the_seed_only() -> None:
    info = build_dataset("digits").info
    torch.manual_seed(1)
    a = build_model("mlp", info, seed=5)
    torch.randn(10)  # the global random state does not matter
    b = build_model("mlp", info, seed=5)
    c = build_model("mlp", info, seed=6)
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    assert not torch.equal(a.state_dict()["0.1.weight"], c.state_dict()["0.1.weight"])


@pytest.mark.multiprocess
def test_a_pipeline_worker_holds_only_its_stage(shared_run: SharedRun) -> None:
    _, summary = shared_run(*MLP, *PIPE, "--schedule", "gpipe")
    info = build_dataset("digits").info
    model = build_model("mlp:hidden=256", info, seed=3)
    total = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    held = [worker["held_model_bytes"] for worker in summary["workers"]]
    assert sum(held) == total and max(held) < total
    assert held == [worker["parameter_bytes"] for worker in summary["workers"]]


@pytest.mark.pure
def test_users_models_are_still_built_whole() -> None:
    info = build_dataset("digits").info
    model = build_model("tests.bn_models:resnet", info, device="meta")
    assert not on_meta(model)  # a user's builder is called as it is
