"""Sharded pipelines (``--strategy pipeline --stages 2 --shard 2``) against single-process training.

Through the real command line (in this process, workers forked), each stage's 2 replicas shard
it with FSDP2 over the ``data`` dimension of the job's mesh, alone (2-D, 4 workers) and with
``--tensor-parallel 2`` (3-D, 8 workers, torchtitan's layout), the ranks laid out as::

    rank     0  1  2  3  4  5  6  7          (2-D: 0  1  2  3)
    stage    0  0  0  0  1  1  1  1                    0  0  1  1
    replica  0  0  1  1  0  0  1  1                    0  1  0  1
    tensor   0  1  0  1  0  1  0  1

and end with one process's parameters and buffers (``final.pt``, the model's own names and
shapes) and test score: gpt at both, level 2 under GPipe with an evaluation mid-run, mlp in 3-D
and a Hugging Face GPT-2 (built from a config, split by tracing, its input embedding on stage 0
tied to its output layer on stage 1) in 2-D, and with ``--tensor-parallel 2`` (its blocks traced
as a worker's share computes, :mod:`tandem.runtime.pipeline.tensor_split`) in 3-D cut at
``transformer.h.1`` and in pipeline 2 x tensor 2 cut inside a block, between ``mlp.c_fc`` and
``c_proj``.
Each gpt and GPT-2 worker holds exactly its stage's split layers over ``D * T`` and the rest over
``D``. Clipping counts every shard and tensor share once. What the sharded pipeline does not
take is one line; it takes checkpoints (test_pipeline_checkpoint.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.errors import UsageError
from tandem.plan import Plan
from tandem.runtime.config import RunConfig
from tandem.runtime.job import Job, sketch_job
from tandem.strategy import plan_from_flags

from tests.conftest import SharedRun, run_here
from tests.hf_models import TENSOR_LAYERS
from tests.hf_models import TRAIN as HF
from tests.test_sharded import GPT, MLP

TWO_D = ("--strategy", "pipeline", "--stages", "2", "--shard", "2", "--nproc", "4")
THREE_D = ("--strategy", "pipeline", "--stages", "2", "--shard", "2", "--tensor-parallel", "2",
           "--nproc", "8")
LEVEL_2 = (*TWO_D, "--shard-level", "2", "--schedule", "gpipe", "--eval-every", "4")
CASES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "gpt 2-D": (GPT, TWO_D), "gpt 3-D": (GPT, THREE_D), "gpt 2-D level 2 gpipe": (GPT, LEVEL_2),
    "mlp 3-D": (MLP, THREE_D), "gpt2 2-D": (HF, TWO_D),
}
"""name: (model and steps, layout)."""
GPT_SPLIT = (".attention.qkv.weight", ".attention.qkv.bias", ".attention.proj.weight",
             ".mlp.0.weight", ".mlp.0.bias", ".mlp.2.weight")
"""gpt's parameters that tensor parallelism splits (a row-wise layer's bias stays whole)."""


def _largest_difference(single: Path, sharded: Path) -> float:
    a, b = torch.load(single / "final.pt"), torch.load(sharded / "final.pt")
    assert sorted(a) == sorted(b)  # parameters and buffers, under the model's own names
    assert all(a[name].shape == b[name].shape for name in a)
    return max(float((a[name].double() - b[name].double()).abs().max()) for name in a)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(CASES))
def test_sharded_pipelines_equal_one_process(shared_run: SharedRun, name: str) -> None:
    model, layout = CASES[name]
    if model is HF:
        pytest.importorskip("transformers")
    single, alone = shared_run(*model, "--nproc", "1")
    out, summary = shared_run(*model, *layout)
    tensor = 2 if "--tensor-parallel" in layout else 1
    assert (summary["pipeline"], summary["shard"], summary["world_size"]) == ("2-2", 2, 4 * tensor)
    assert summary["mesh"] == {"data": 2, "pipeline": 2, "tensor": tensor}
    assert summary["shard_level"] == (2 if layout is LEVEL_2 else 3)
    assert _largest_difference(single, out) <= 1e-5, name
    assert summary["test_loss"] == pytest.approx(alone["test_loss"], abs=1e-5)
    assert summary["test_accuracy"] == alone["test_accuracy"]
    if model is HF:  # the tie across the stages holds, shard by shard
        ties = [tie for worker in summary["workers"] for tie in worker["shared_parameters"]]
        assert len(ties) == 4 * tensor and all(tie["max_abs_diff"] == 0 for tie in ties)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [TWO_D, THREE_D], ids=["2-D", "3-D"])
def test_each_worker_holds_its_stages_shards(shared_run: SharedRun,
                                            layout: tuple[str, ...]) -> None:
    """gpt's stage 0 holds 56,448 bytes and stage 1 55,296: a 2-D worker holds half of its
    stage's, a 3-D one a quarter of its split layers and half of the rest (15,712 bytes on
    stage 0)."""
    single, _ = shared_run(*GPT, "--nproc", "1")
    _, summary = shared_run(*GPT, *layout)
    tensor = 2 if "--tensor-parallel" in layout else 1
    whole = torch.load(single / "final.pt")
    for worker in summary["workers"]:
        start, end = worker["layers"]
        held = 0.0
        for name, value in whole.items():
            if start <= int(name.partition(".")[0]) < end:
                split = tensor if name.endswith(GPT_SPLIT) else 1
                held += value.numel() * value.element_size() / (2 * split)
        assert worker["held_model_bytes"] == held, worker
        assert worker["parameter_bytes"] == held, worker  # gpt's blocks hold no buffers


@pytest.mark.multiprocess
def test_clipping_counts_every_shard_and_share_once(shared_run: SharedRun) -> None:
    """``--clip-grad-norm`` in 3-D, and in a pipeline x tensor layout without sharding (which
    refused it before: its workers now count their tensor shares), ends where one process
    clipping the same norm does, and clipping changed that."""
    clip = ("--clip-grad-norm", "0.05")
    single, _ = shared_run(*GPT, "--nproc", "1")
    clipped, _ = shared_run(*GPT, *clip, "--nproc", "1")
    assert _largest_difference(single, clipped) > 1e-3
    for layout in (THREE_D, ("--strategy", "pipeline", "--stages", "2", "--tensor-parallel", "2",
                             "--nproc", "4")):
        out, summary = shared_run(*GPT, *clip, *layout)
        assert summary["clip_grad_norm"] == 0.05
        assert _largest_difference(clipped, out) <= 1e-5, layout


@pytest.mark.pure
def test_shard_gives_every_stage_its_replicas() -> None:
    plan = plan_from_flags("pipeline", {"--stages": 2, "--shard": 2}, num_processes=4,
                           num_blocks=4)
    assert (plan.config, plan.sharded, plan.shard_degree, plan.shard_level) == ("2-2", True, 2, 3)
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert (again.pipelined, again.sharded, again.shard_degree) == (True, True, 2)
    alone = plan_from_flags("pipeline", {"--shard": 2, "--shard-level": 2}, num_processes=8,
                            num_blocks=4)  # no --stages: as many as the replicas allow
    assert (alone.config, alone.shard_level) == ("2-2-2-2", 2)
    cube = plan_from_flags("pipeline", {"--stages": 2, "--shard": 2, "--tensor-parallel": 2},
                           num_processes=8, num_blocks=4)
    assert (cube.config, cube.tensor_degree, cube.num_workers) == ("2-2", 2, 8)


STAGES = {"--stages": 2, "--shard": 2}
REFUSED: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    "level 1": ({**STAGES, "--shard-level": 1}, {}, "--shard-level 1 shards the optimizer state "
                "over DDP's replicas, which a pipeline's stages do not use; use --shard-level 2 "
                "or 3"),
    "one replica": ({"--stages": 4, "--shard": 1}, {}, "--shard 1 in a pipeline gives each "
                    "stage one replica, with nothing to shard its state with"),
    "other replicas": ({"--replicas": "2,1,1", "--shard": 2}, {}, "--shard 2 in a pipeline "
                       "shards each stage over its replicas, and the plan's are 2-1-1; use "
                       "--replicas 2,2,2"),
    "pipedream": ({**STAGES, "--schedule": "pipedream"}, {}, "--schedule pipedream with --shard "
                  "2: a sharded stage reduces its gradients once per step, after a flush"),
    "compress": ({**STAGES, "--compress": "fp16"}, {}, "--compress fp16 is not supported with "
                 "--strategy pipeline --shard 2 yet: the activation codec does not run beside "
                 "FSDP2's collectives"),
}
CHECKPOINTS = {"resume": "run/checkpoint.pt", "stop_after": 4, "checkpoint_every": 2,
               "max_restarts": 1}
"""What sharded pipelines (2-D and 3-D) and pipeline x tensor layouts take: checkpoints."""


@pytest.mark.pure
@pytest.mark.parametrize("case", list(REFUSED))
def test_what_a_sharded_pipeline_does_not_take_is_one_line(case: str) -> None:
    flags, settings, expected = REFUSED[case]
    with pytest.raises(UsageError) as raised:
        sketch_job("pipeline", flags, RunConfig(**{"nproc": 4, **settings}))
    assert expected in str(raised.value) and "\n" not in str(raised.value), str(raised.value)


@pytest.mark.pure
@pytest.mark.parametrize("flags", [STAGES, {**STAGES, "--tensor-parallel": 2},
                                   {"--stages": 2, "--tensor-parallel": 2}])
def test_sharded_and_tensor_parallel_pipelines_take_checkpoints(flags: dict[str, Any]) -> None:
    """Each stage writes and reads its own shards (test_pipeline_checkpoint.py)."""
    nproc = 4 * (2 if len(flags) == 3 else 1)
    job = sketch_job("pipeline", flags, RunConfig(nproc=nproc, **CHECKPOINTS))
    assert job.run.stop_after == 4 and job.run.max_restarts == 1


@pytest.mark.pure
def test_units_are_the_stages_blocks() -> None:
    plan = plan_from_flags("pipeline", STAGES, num_processes=4, num_blocks=4)
    units = Plan.from_dict({**plan.to_dict(), "shard_units": ["1"]})  # a plan file's
    with pytest.raises(UsageError, match="shard units 1 name the whole model's modules, and a "
                       "sharded pipeline stage's units are its blocks"):
        Job(run=RunConfig(nproc=4), plan=units)
    result = run_here("train", "--strategy", "pipeline", "--nproc", "4", "--shard", "2",
                      "--shard-units", "1")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "--shard-units applies to --strategy dp only" in result.stderr


HF_SHORT = (*HF[:HF.index("--steps") + 1], "2", *HF[HF.index("--steps") + 2:])
"""GPT-2's runs against one process, 2 steps."""
PIECES = ("--init-fn", "tests.hf_models:init_gpt2")
"""GPT-2 traced on the meta device, each worker building its stage alone."""
TRACED_CUTS = {
    "2 x 2 x 2 at transformer.h.1": ("transformer.h.1", THREE_D, ()),
    "2 x 2 between mlp.c_fc and c_proj, in pieces": ("transformer.h.0.mlp.c_proj", (
        "--strategy", "pipeline", "--stages", "2", "--tensor-parallel", "2", "--nproc", "4"),
        PIECES),
}
"""name: (the split point, the layout, how it is built): a cut between blocks, and one inside
a block that parts a column-wise layer from its row-wise one (each split alone there, and
traced twice: the fewer workers)."""
STAGE_0 = {"transformer.h.1": ("transformer.wte.", "transformer.wpe.", "transformer.h.0."),
           "transformer.h.0.mlp.c_proj": ("transformer.wte.", "transformer.wpe.",
                                          "transformer.h.0.ln_", "transformer.h.0.attn.",
                                          "transformer.h.0.mlp.c_fc.")}
"""GPT-2's parameters on stage 0 at each split point (stage 1: the rest and ``lm_head``,
tied to ``transformer.wte``)."""
HF_SPLIT = ("attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "mlp.c_fc.weight",
            "mlp.c_fc.bias", "mlp.c_proj.weight")
"""GPT-2's parameters that ``TENSOR_LAYERS`` splits (a row-wise layer's bias stays whole)."""


@pytest.mark.multiprocess
@pytest.mark.parametrize("cut", list(TRACED_CUTS))
def test_a_traced_model_in_pipeline_x_tensor_equals_one_process(shared_run: SharedRun,
                                                                cut: str) -> None:
    """GPT-2 (split by tracing, its blocks traced as a worker's share computes) in a pipeline
    x tensor layout ends within 1e-5 of one process, every stage holding a share of each of
    its tensor layers, cut between blocks or inside one (it once left a stage's layers whole
    while its blocks computed shares: 'mat1 and mat2 shapes cannot be multiplied'). Built
    whole on every worker, or with ``--init-fn`` traced on the meta device and each worker
    building its own stage only (as one process, built whole, draws)."""
    pytest.importorskip("transformers")
    split_point, layout, build = TRACED_CUTS[cut]
    single, alone = shared_run(*HF_SHORT, *build, "--nproc", "1")
    out, summary = shared_run(*HF_SHORT, *build, *layout, "--tensor-layers", TENSOR_LAYERS,
                              "--split-points", split_point)
    assert summary["mesh"]["tensor"] == 2 and summary["tensor_whole_layers"] == []
    assert _largest_difference(single, out) <= 1e-5, cut
    assert summary["test_loss"] == pytest.approx(alone["test_loss"], abs=1e-5)
    assert summary["test_accuracy"] == alone["test_accuracy"]
    whole = torch.load(single / "final.pt")
    shard = summary["mesh"]["data"]
    for worker in summary["workers"]:
        held = 0.0
        for name, value in whole.items():
            if name.startswith(STAGE_0[split_point]) == (worker["stage"] == 0):
                split = 2 if name.endswith(HF_SPLIT) else 1
                held += value.numel() * value.element_size() / (shard * split)
        assert worker["parameter_bytes"] == held, worker
        if build:  # nothing of the other stage's
            assert worker["held_model_bytes"] == held, worker
    ties = [tie for worker in summary["workers"] for tie in worker["shared_parameters"]]
    assert len(ties) == len(summary["workers"]) and all(tie["max_abs_diff"] == 0 for tie in ties)
