"""Values of any structure between a model's blocks (issue 29): a dict holding a 0-dim tensor (a
running auxiliary loss), a None and an int besides the activations (tests/aux_models.py), in a
user's ``nn.Sequential`` and in a module tandem traces to split. The profiler, ``tandem plan
--model``, the automatic split and the GPipe and 1F1B pipelines take it, and the pipelines end
where one process does; a stage whose non-tensor values change is one line."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from tandem.data.builtin import build_dataset
from tandem.errors import UsageError
from tandem.runtime.pipeline.links import StageShapes
from tandem.runtime.profiler import profile_model
from tandem.structures import Skeleton, SkeletonMismatch
from tests.aux_models import aux_mlp, aux_net
from tests.conftest import SharedRun, max_abs_diff, run_here

AUX = ("--data", "digits", "--loss", "tests.aux_models:aux_loss", "--steps", "4",
       "--batch-size", "32", "--lr", "0.05", "--seed", "1")


@pytest.mark.pure
def test_a_skeleton_keeps_the_structure_and_checks_the_other_leaves() -> None:
    value = {"hidden": torch.ones(2, 3), "aux": torch.tensor(0.5), "mask": None, "depth": 2}
    skeleton = Skeleton.of(value)
    assert skeleton is not None and Skeleton.of((torch.ones(1), torch.ones(2))) is None
    tensors = skeleton.tensors_of(value)
    assert [tuple(t.shape) for t in tensors] == [(2, 3), ()]
    again = skeleton.fill([torch.zeros(2, 3), torch.zeros(())])
    assert again["mask"] is None and again["depth"] == 2 and again["hidden"].shape == (2, 3)
    with pytest.raises(SkeletonMismatch, match="3 where the first sample gave 2"):
        skeleton.tensors_of({**value, "depth": 3})
    with pytest.raises(SkeletonMismatch, match="where the first sample gave a dict"):
        skeleton.tensors_of({"hidden": torch.ones(2, 3)})
    shapes = StageShapes(output_skeleton=skeleton)
    with pytest.raises(UsageError, match="a stage passes 3 where the first sample gave 2 to "
                                         "the next one: a pipeline sends the tensors"):
        shapes.sent({**value, "depth": 3})


@pytest.mark.pure
@pytest.mark.parametrize("build", [aux_mlp, aux_net], ids=["sequential", "traced"])
def test_the_profiler_measures_blocks_that_pass_dicts_with_scalars(build: Any) -> None:
    data = build_dataset("digits")
    torch.manual_seed(0)
    model = build(data.info)
    profile = profile_model(model, data.train.inputs[:16], warmup=0, repeats=1)
    assert len(profile.layers) >= 5 and profile.batch_size == 16
    assert all(layer.forward_s > 0 for layer in profile.layers)
    # a block's output: 16 x 32 floats and the 0-dim auxiliary loss (the int and None: nothing)
    assert 16 * 32 * 4 + 4 in {layer.activation_bytes for layer in profile.layers}


@pytest.mark.multiprocess
@pytest.mark.parametrize("model, schedule", [("tests.aux_models:aux_mlp", "gpipe"),
                                             ("tests.aux_models:aux_net", "1f1b")],
                         ids=["sequential-gpipe", "traced-1f1b"])
def test_pipelines_carry_them_and_equal_one_process(shared_run: SharedRun, model: str,
                                                    schedule: str) -> None:
    """The traced model is split automatically (by a profile measured at launch)."""
    single, _ = shared_run("--model", model, *AUX, "--nproc", "1")
    out, summary = shared_run("--model", model, *AUX, "--strategy", "pipeline", "--stages",
                              "2", "--schedule", schedule, "--nproc", "2")
    assert summary["finished"]
    assert max_abs_diff(single / "final.pt", out / "final.pt") <= 1e-5


@pytest.mark.pure
def test_plan_takes_the_model() -> None:
    result = run_here("plan", "--model", "tests.aux_models:aux_net", "--data", "digits",
                      "--batch-size", "32", "--devices", "2", "--bandwidth", "10Gb/s", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout.strip().splitlines()[-1])
    assert plan["num_layers"] >= 5 and plan["stages"], plan
