"""fp16 in every sharded and tensor-parallel layout, hybrid sharding x tensor, and what FSDP2
cannot shard, against single-process training.

A 1-element weight whose gradient overflows on one training forward (``precision_models:
sharded_overflow``) is held by one worker alone wherever FSDP2 shards it: at ``--shard 2`` the
first shard holds it and the second none. Every worker must still skip that step (torch's
``GradScaler`` reduces the found-inf flag over the mesh of DTensor gradients; the pipelines' and
tensor trainers' ``StagePrecision`` allreduces it), and the run ends as one process in fp16 that
skipped the same step: measured 3e-6 to 6e-6 apart, fp16's rounding of a different summation
order, held to 1e-4. Then ``--shard 2 --tensor-parallel 2`` on 8 workers (2 groups of 2 shards
x tensor 2, a ``replicate x shard x pipeline x tensor`` mesh) ends within 1e-5 of one process
(1.2e-7 measured).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tandem.errors import UsageError
from tandem.runtime.config import RunConfig
from tandem.runtime.job import sketch_job
from tandem.sync.sharded import check_scalars

from tests.conftest import SharedRun, max_abs_diff
from tests.test_sharded import GPT, _compare

OVERFLOW = ("--model", "tests.precision_models:sharded_overflow:at=3", "--precision", "fp16",
            "--clip-grad-norm", "0.05", "--steps", "5", "--batch-size", "32", "--lr", "0.1",
            "--seed", "5", "--tensor-layers", "1=colwise,3=rowwise")
"""The overflow is on the 3rd forward of each worker: step 2 with one forward a step, step 1
with two (the references: one process, and one process accumulating 2 micro-batches)."""
DEGREE = ("--tensor-parallel", "2")
LAYOUTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # name: (layout, the one-process reference's extra flags)
    "shard 2": (("--strategy", "dp", "--nproc", "2", "--shard", "2"), ()),
    "shard 2 x tensor 2": (("--strategy", "dp", "--nproc", "4", "--shard", "2", *DEGREE), ()),
    "sharded pipeline 2-D": (("--strategy", "pipeline", "--stages", "2", "--nproc", "4",
                              "--shard", "2", "--schedule", "gpipe", "--microbatches", "4"),
                             ("--accumulate", "2")),
    "pipeline x tensor": (("--strategy", "pipeline", "--stages", "2", "--nproc", "4", *DEGREE,
                           "--schedule", "gpipe", "--microbatches", "2"), ("--accumulate", "2")),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_an_overflow_in_one_shard_skips_the_step_on_every_worker(shared_run: SharedRun,
                                                                 name: str) -> None:
    layout, reference = LAYOUTS[name]
    # --tensor-layers needs a tensor degree: the layouts without one drop it
    flags = OVERFLOW if "--tensor-parallel" in layout else OVERFLOW[:-2]
    single, one = shared_run(*OVERFLOW[:-2], "--nproc", "1", *reference)
    out, summary = shared_run(*flags, *layout)
    assert one["skipped_steps"] == 1 and summary["skipped_steps"] == 1, name
    assert all(worker["skipped_steps"] == 1 for worker in summary.get("workers", []))
    final = torch.load(out / "final.pt")
    assert all(torch.isfinite(value).all() for value in final.values())
    assert max_abs_diff(single / "final.pt", out / "final.pt") <= 1e-4, name


@pytest.mark.multiprocess
def test_hybrid_sharding_x_tensor_equals_one_process(shared_run: SharedRun) -> None:
    """8 workers: data 4 (2 groups of 2 shards) x tensor 2; each worker holds about a quarter of
    the model (half of each tensor share)."""
    single, _ = shared_run(*GPT, "--nproc", "1")
    out, summary = shared_run(*GPT, "--nproc", "8", "--shard", "2", *DEGREE)
    assert summary["mesh"] == {"data": 4, "pipeline": 1, "tensor": 2}
    assert summary["shard_mesh"] == {"replicate": 2, "shard": 2}
    rest, keys = _compare(single / "final.pt", out / "final.pt")
    assert max(rest, keys) <= 1e-5
    assert summary["tensor_memory"]["worker_fraction"] < 0.35


class _Temperature(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(()))


@pytest.mark.pure
def test_a_scalar_parameter_is_one_line_naming_it_and_the_fix() -> None:
    with pytest.raises(UsageError) as raised:
        check_scalars(_Temperature())
    message = str(raised.value)
    assert "parameter scale is a scalar" in message and "shape (1,)" in message
    assert "--shard-level 1" in message and "\n" not in message


@pytest.mark.pure
def test_level_1_with_tensor_parallelism_says_why() -> None:
    with pytest.raises(UsageError) as raised:
        sketch_job("dp", {"--shard": 2, "--shard-level": 1, "--tensor-parallel": 2},
                   RunConfig(nproc=4))
    message = str(raised.value)
    assert "ZeroRedundancyOptimizer" in message and "DTensor" in message
    assert "--shard-level 2" in message and "\n" not in message


SMALL_GPT = ("--model", "gpt:layers=2,dim=32,heads=4,dropout=0", "--data",
             "tokens:n=256,seq=12,vocab=32", "--steps", "6", "--batch-size", "16", "--lr", "0.01",
             "--seed", "3")
LAMB = ("lamb", "--optimizer-options", "eps=1e-4")
"""LAMB's moments turn rounding into steps where a gradient is near 0 (as in test_sharded's key
biases): with its default eps (1e-6) the layouts below measured 6e-6 on one CPU and 1.4e-5 on
another (AVX-512), with 1e-4 under 1e-6; the norms over split layers are what is tested."""
TRUST_RATIOS = {
    # name: (optimizer, layout)
    "lamb, tensor 2, a straggler": (LAMB, ("--nproc", "2", *DEGREE, "--straggler", "1:2")),
    "lars, shard 2": (("lars",), ("--nproc", "2", "--shard", "2")),
    "lamb, pipeline x tensor": (LAMB, ("--strategy", "pipeline", "--stages", "2", "--nproc",
                                       "4", *DEGREE)),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(TRUST_RATIOS))
def test_layer_wise_trust_ratios_take_the_whole_layers_norms(shared_run: SharedRun,
                                                             name: str) -> None:
    """LARS and LAMB scale each layer's step by its weight's norm over its gradient's (or
    update's): over a split or sharded layer, the norm of the whole layer (DTensor's norm sums
    the shares), so the run equals one process; a ``--straggler`` slows its worker only."""
    optimizer, layout = TRUST_RATIOS[name]
    single, _ = shared_run(*SMALL_GPT, "--optimizer", *optimizer, "--nproc", "1")
    out, summary = shared_run(*SMALL_GPT, "--optimizer", *optimizer, *layout)
    assert summary["finished"]
    assert max_abs_diff(single / "final.pt", out / "final.pt") <= 1e-5, name


@pytest.mark.pure
def test_trust_ratios_over_convolutions_split_by_channels_are_one_line() -> None:
    """vgg's convolutions split by channels hold plain tensors: LARS/LAMB would take a share's
    norm, so they are refused (SGD is not)."""
    from tandem.data import build_dataset
    from tandem.models import build_model
    from tandem.models.tensor import tensor_plan
    from tandem.runtime.tensor_parallel import check_trust_ratios

    model = build_model("vgg:width=0.0625,hidden=32", build_dataset("digits").info,
                        device="meta")
    plan = tensor_plan("vgg", model, 2)
    check_trust_ratios(plan, "sgd")
    with pytest.raises(UsageError) as raised:
        check_trust_ratios(plan, "lars")
    assert "split by channels" in str(raised.value) and "\n" not in str(raised.value)
