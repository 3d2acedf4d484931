"""Sharded data parallelism (``--strategy dp --shard S``) against single-process training.

Through the real command line (in this process, workers forked): ``--shard 4`` on 4 workers
(ZeRO-3 / FSDP) and ``--shard 2`` on 4 (hybrid: 2 replicas of 2 shards) end with one process's
parameters, under the model's own names, for mlp, gpt and a Hugging Face GPT-2 built from a
config, with SGD (momentum) and with Adam; levels 1 (optimizer state, ZeroRedundancyOptimizer)
and 2 (+ gradients) too, with gradient accumulation; BatchNorm's buffers end as DDP's (rank 0's).
Each worker holds a shard of the state. Every setting the slice does not support is one line.

Adam on attention: the key part of a query-key-value bias has a zero gradient in exact
arithmetic (softmax ignores a shift shared by every key), so what it gets is rounding noise
(~1e-9) that Adam divides by its own size and turns into steps of the learning rate's order:
DDP itself ends up to 3.5e-4 from one process there (gpt, 20 steps). Those entries are held to
1e-3; every other entry to 1e-5.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from tandem.errors import UsageError
from tandem.plan import Plan
from tandem.runtime.config import RunConfig
from tandem.runtime.job import sketch_job
from tandem.runtime.outputs import plan_summary
from tandem.strategy import plan_from_flags, plan_with_flags

from tests.conftest import SharedRun, max_abs_diff, run_here, run_json
from tests.hf_models import TENSOR_LAYERS, TRAIN as HF

MLP = ("--model", "mlp", "--data", "digits", "--steps", "8", "--batch-size", "32",
       "--lr", "0.05", "--momentum", "0.9", "--seed", "3")
GPT = ("--model", "gpt:layers=2,dim=32,heads=4,dropout=0", "--data",
       "tokens:n=256,seq=12,vocab=32", "--steps", "8", "--batch-size", "16", "--lr", "0.05",
       "--momentum", "0.9", "--seed", "3")
HF_PIECES = (*HF, "--init-fn", "tests.hf_models:init_gpt2")
"""GPT-2 built on the meta device, one module at a time (:mod:`tandem.models.pieces`)."""
ADAM = ("--optimizer", "adam", "--lr", "0.003")
FULL, HYBRID = ("--nproc", "4", "--shard", "4"), ("--nproc", "4", "--shard", "2")
KEY_BIASES = (".attention.qkv.bias", ".attn.c_attn.bias")
"""The query-key-value biases of gpt and GPT-2: their middle third is the key's."""

CASES: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    # name: (model, optimizer, layout)
    "mlp 4 sgd": (MLP, (), FULL), "mlp 2x2 adam": (MLP, ADAM, HYBRID),
    "gpt 4 sgd": (GPT, (), FULL), "gpt 2x2 adam": (GPT, ADAM, HYBRID),
    "gpt2 4 sgd": (HF, (), FULL), "gpt2 2x2 adam": (HF, ADAM, HYBRID),
    "gpt2 in pieces 4 sgd": (HF_PIECES, (), FULL),
    "mlp level 1 2x2 adam": (MLP, ADAM, (*HYBRID, "--shard-level", "1", "--accumulate", "2")),
    "gpt level 2 4 sgd": (GPT, (), (*FULL, "--shard-level", "2", "--accumulate", "2",
                                    "--shard-units", "1,2")),
}


def _compare(single: Path, sharded: Path) -> tuple[float, float]:
    """Largest difference of ``final.pt`` from one process's: over every entry but the key
    biases' middle thirds, and over those."""
    a, b = torch.load(single), torch.load(sharded)
    assert list(a) == list(b)  # parameters and buffers, under the model's own names
    rest, keys = 0.0, 0.0
    for name, value in a.items():
        diff = (value.double() - b[name].double()).abs()
        if name.endswith(KEY_BIASES):
            third = diff.numel() // 3
            keys = max(keys, float(diff[third:2 * third].max()))
            diff = torch.cat([diff[:third], diff[2 * third:]])
        rest = max(rest, float(diff.max()) if diff.numel() else 0.0)
    return rest, keys


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(CASES))
def test_sharded_training_equals_one_process(shared_run: SharedRun, name: str) -> None:
    model, optimizer, layout = CASES[name]
    if model in (HF, HF_PIECES):
        pytest.importorskip("transformers")
    single, _ = shared_run(*model, *optimizer, "--nproc", "1")
    out, summary = shared_run(*model, *optimizer, *layout)
    shard, level = int(layout[3]), 3
    if "--shard-level" in layout:
        level = int(layout[layout.index("--shard-level") + 1])
    assert (summary["shard"], summary["shard_level"], summary["world_size"]) == (shard, level, 4)
    mesh = {"shard": 4} if shard == 4 else {"replicate": 2, "shard": 2}
    assert summary["shard_mesh"] == mesh and summary["sent_bytes_per_step"] > 0
    if level > 1:  # built-in models and --init-fn: on the meta device, then unit by unit
        assert summary["built"] == ("whole" if model is HF else "pieces"), name
    rest, keys = _compare(single / "final.pt", out / "final.pt")
    assert rest <= 1e-5, name
    assert keys <= (1e-5 if not optimizer else 1e-3), name  # see the module docstring
    copies = 4 if optimizer else 3  # parameters, gradients, momentum or Adam's two moments
    _check_held_state(summary, shard, level, copies)


def _check_held_state(summary: dict[str, Any], shard: int, level: int, copies: int) -> None:
    """Every worker holds its shard of the ``copies`` model-sized tensors of one process (up to
    FSDP's padding of each parameter's first dimension to a multiple of the shards); at level 1
    the whole parameters and gradients, and its share of the optimizer state."""
    held = [worker["held_state_bytes"] for worker in summary["worker_memory"]]
    whole = summary["parameters"] * 4  # fp32 bytes of one whole copy
    assert len(held) == 4 and all(isinstance(value, int) for value in held)
    if level == 1:
        assert 2 * whole < max(held) <= (2 + (copies - 2) / shard) * whole * 1.2
    else:
        assert max(held) <= copies * whole / shard * 1.2, (held, whole)


@pytest.mark.multiprocess
def test_default_units_are_the_blocks_and_the_hf_tie_holds(shared_run: SharedRun) -> None:
    """gpt's blocks are its Sequential's children; GPT-2's its ``transformer.h`` ModuleList's;
    its embedding stays tied to its output layer (both in the root unit)."""
    pytest.importorskip("transformers")
    _, gpt = shared_run(*GPT, *FULL)
    assert gpt["shard_units"] == ["0", "1", "2", "3"]
    out, hf = shared_run(*HF, *FULL)
    assert hf["shard_units"] == ["transformer.h.0", "transformer.h.1"]
    state = torch.load(out / "final.pt")
    assert torch.equal(state["transformer.wte.weight"], state["lm_head.weight"])
    _, level2 = shared_run(*GPT, *FULL, "--shard-level", "2", "--accumulate", "2",
                           "--shard-units", "1,2")
    assert level2["shard_units"] == ["1", "2"]
    assert "--shard-level 2 or 3" in gpt["noise_scale_note"] and gpt["noise_scale"] is None


BN = ("--model", "tests.bn_models:resnet", "--data", "digits", "--steps", "12",
      "--batch-size", "32", "--lr", "0.05", "--log-every", "4")


@pytest.mark.multiprocess
def test_batchnorm_buffers_end_as_ddps(shared_run: SharedRun) -> None:
    """DDP broadcasts rank 0's buffers before each step's first forward and at the end: the
    sharded run (its residual block one unit, the rest the root) ends with the same buffers
    and parameters."""
    dp, _ = shared_run(*BN, "--strategy", "dp", "--nproc", "2")
    out, summary = shared_run(*BN, "--nproc", "2", "--shard", "2", "--shard-units", "block")
    assert summary["shard_units"] == ["block"]
    state = torch.load(out / "final.pt")
    assert int(state["bn.num_batches_tracked"]) == 12
    assert float(state["block.bn2.running_mean"].abs().max()) > 1e-3
    assert max_abs_diff(dp / "final.pt", out / "final.pt") <= 1e-5


@pytest.mark.multiprocess
def test_a_sharded_checkpoint_resumes_on_another_world_and_as_dp(shared_run: SharedRun,
                                                                 tmp_path: Path) -> None:
    """``--shard 4`` on 4 ranks stopped after 4 of 8 steps: each rank wrote only its own shards
    (one file each, through ``torch.distributed.checkpoint``; ``checkpoint.pt`` names the
    folder and holds no model). Resumed as ``--shard 2`` on 2 ranks and as plain dp on 2, both
    end within 1e-6 of the uninterrupted run (parameters and SGD's momentum resharded); so does
    a plain dp checkpoint resumed as ``--shard 2``."""
    whole, _ = shared_run(*MLP, *FULL)
    first = tmp_path / "first"
    run_json("train", *MLP, *FULL, "--stop-after", "4", "--out", str(first))
    meta = torch.load(first / "checkpoint.pt", weights_only=False)
    assert meta["sharded"] == "checkpoint-4.dcp" and "model" not in meta
    assert "optimizer" not in meta and meta["step"] == 4
    shards = sorted(path.name for path in (first / "checkpoint-4.dcp").glob("*.distcp"))
    assert len(shards) == 4, shards  # one file per rank
    for name, layout in {"shard 2": ("--nproc", "2", "--shard", "2"),
                         "dp": ("--nproc", "2")}.items():
        again = tmp_path / name.replace(" ", "")
        shutil.copytree(first, again)
        summary = run_json("train", *MLP, *layout, "--resume", "--out", str(again))
        assert summary["steps"] == 8 and summary["finished"]
        assert max_abs_diff(whole / "final.pt", again / "final.pt") <= 1e-6, name
    assert sorted(p.name for p in (tmp_path / "shard2").glob("checkpoint-*.dcp")) == [
        "checkpoint-4.dcp", "checkpoint-8.dcp"]  # the latest and the previous checkpoint's
    assert torch.load(tmp_path / "shard2" / "previous" / "checkpoint.pt",
                      weights_only=False)["sharded"] == "checkpoint-4.dcp"
    # and back: a whole checkpoint of dp on 2 resumed as --shard 2, each rank cutting its shards
    dp = tmp_path / "dp-first"
    run_json("train", *MLP, "--nproc", "2", "--stop-after", "4", "--out", str(dp))
    run_json("train", *MLP, "--nproc", "2", "--shard", "2", "--resume", "--out", str(dp))
    assert max_abs_diff(whole / "final.pt", dp / "final.pt") <= 1e-6


@pytest.mark.multiprocess
def test_a_sharded_checkpoint_holds_no_more_than_each_ranks_shard(tmp_path: Path) -> None:
    """No rank gathers the model to save it: over its checkpoints (steps 2 and 4), no rank's
    peak resident memory rose above the peak before by more than the state it holds (a gpt of
    3.2M parameters, 9.5 MB of parameters, gradients and momentum per rank; measured 0-3.5 MB
    of growth, the first save's own buffers)."""
    summary = run_json("train", "--model", "gpt:layers=4,dim=256,heads=4,dropout=0", "--data",
                       "tokens:n=256,seq=12,vocab=32", "--steps", "4", "--checkpoint-every", "2",
                       "--batch-size", "16", *FULL, "--out", str(tmp_path))
    for worker in summary["worker_memory"]:
        assert worker["checkpoint_peak_growth_bytes"] <= worker["held_state_bytes"], worker
    assert len(list((tmp_path / "checkpoint-4.dcp").glob("*.distcp"))) == 4


@pytest.mark.multiprocess
def test_a_model_four_times_the_memory_limit_trains_only_sharded(shared_run: SharedRun) -> None:
    """``--memory-limit`` emulates a device's memory, checked against what each worker holds
    after its first step. gpt with SGD's momentum holds three fp32 copies of its parameters;
    under a limit of a quarter of that, plain dp on 4 workers stops in one line naming
    ``--shard 4`` (exit 2), and ``--shard 4`` trains, every worker within the limit."""
    _, whole = shared_run(*GPT, *FULL)
    limit = 3 * 4 * whole["parameters"] // 4  # bytes: the whole state is 4x the limit
    refused = run_here("train", *GPT, "--nproc", "4", "--memory-limit", f"{limit}B")
    assert refused.returncode == 2, refused.stderr
    lines = [line for line in refused.stderr.strip().splitlines()  # 4 workers on 2 cores
             if not line.startswith(("tandem: warning: --nproc 4 on", "tandem: writing"))]
    assert len(lines) == 1 and "over --memory-limit" in lines[0], refused.stderr
    assert "shard it with --shard 4" in lines[0], lines[0]
    _, sharded = shared_run(*GPT, *FULL, "--memory-limit", f"{limit}B")
    assert sharded["finished"]
    assert all(w["held_state_bytes"] <= limit for w in sharded["worker_memory"])


REFUSED: dict[str, tuple[tuple[dict[str, Any], dict[str, Any]], str]] = {
    # flags and settings -> the line that refuses them
    "not a divisor": (({"--shard": 3}, {}), "--shard 3 does not divide --nproc 4: the workers "
                      "are --nproc/S replicas of S-way shards; use --shard 2 or 4"),
    "more than the workers": (({"--shard": 8}, {}), "--shard 8 does not divide --nproc 4"),
    "zero": (({"--shard": 0}, {}), "--shard must be at least 1"),
    "level": (({"--shard": 4, "--shard-level": 4}, {}), "--shard-level 4 is not one of 1"),
    "level without shard": (({"--shard-level": 2}, {}), "--shard-level says how --shard "
                            "shards, but this run shards nothing"),
    "units at level 1": (({"--shard": 4, "--shard-level": 1, "--shard-units": "0"}, {}),
                         "--shard-level 1 (the optimizer state only) does not shard"),
    "offload without shard": (({}, {"offload": "optimizer"}), "--offload optimizer moves "
                              "FSDP2's shards of a data-parallel run to CPU memory, and this run "
                              "has none"),
    "offload and clip": (({"--shard": 4}, {"offload": "optimizer", "clip_grad_norm": 1.0}),
                         "--clip-grad-norm 1.0 is not supported with --offload optimizer yet"),
    "offload at level 1": (({"--shard": 4, "--shard-level": 1}, {"offload": "optimizer"}),
                           "--offload optimizer moves FSDP2's shards"),
    "compress": (({"--shard": 4, "--compress": "fp16"}, {}),
                 "--compress fp16 is not supported with --shard 4 yet: FSDP's and ZeRO's own"),
    "noise every": (({"--shard": 4}, {"noise_every": 2}), "--noise-every 2 is not supported"),
    "auto batch": (({"--shard": 4}, {"batch_schedule": "auto"}),
                   "--batch-schedule auto is not supported with --shard 4"),
    "unused parameters": (({"--shard": 4}, {"find_unused_parameters": True}),
                          "--find-unused-parameters is not supported with --shard 4"),
}


@pytest.mark.pure
@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_settings_are_refused_in_one_line(case: str) -> None:
    (flags, settings), expected = REFUSED[case]
    with pytest.raises(UsageError) as raised:
        sketch_job("dp", flags, RunConfig(nproc=4, **settings))
    assert expected in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.pure
@pytest.mark.parametrize(("strategy", "flags"), [("pipeline", {}), ("localsgd", {}),
                                                 ("dp", {"--tensor-parallel": 2})])
def test_a_memory_limit_applies_to_data_parallelism_only(strategy: str,
                                                        flags: dict[str, Any]) -> None:
    with pytest.raises(UsageError, match="--memory-limit 1GB checks the state a data-parallel "
                       "worker holds") as raised:
        sketch_job(strategy, flags, RunConfig(nproc=4, memory_limit="1GB"))
    assert "\n" not in str(raised.value)
    with pytest.raises(UsageError, match="--memory-limit '1XB' is not a memory size"):
        RunConfig(nproc=4, memory_limit="1XB")


@pytest.mark.pure
def test_the_plan_carries_the_sharding_through_json() -> None:
    plan = plan_from_flags("dp", {"--shard": 2, "--shard-level": 2, "--shard-units": "a,b.c"},
                           num_processes=4, num_blocks=3)
    assert (plan.shard_degree, plan.shard_level, plan.shard_units) == (2, 2, ["a", "b.c"])
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert (again.shard_degree, again.shard_level, again.shard_units) == (2, 2, ["a", "b.c"])
    assert plan_summary(again)["shard"] == 2 and "shard" not in plan_summary(
        plan_from_flags("dp", {}, num_processes=4, num_blocks=3))
    with pytest.raises(UsageError, match="shard degree 3 does not divide the plan's 4"):
        Plan.from_dict({**plan.to_dict(), "shard_degree": 3})
    with pytest.raises(UsageError, match="--shard conflicts with --plan p.json"):
        plan_with_flags(again, None, {"--shard": 4}, "p.json")
    one = plan_from_flags("dp", {"--shard": 1}, num_processes=2, num_blocks=3)
    assert (one.sharded, one.shard_degree) == (True, 1)
    assert Plan.from_dict(json.loads(json.dumps(one.to_dict()))).sharded
    older = {key: value for key, value in plan.to_dict().items() if key != "sharded"}
    assert Plan.from_dict(older).sharded  # written before the key: a degree above 1 says it
    assert not plan_from_flags("dp", {}, num_processes=4, num_blocks=3).sharded


class _CountingTask:
    """A stand-in for :class:`tandem.runtime.task.Task` that records the ranges it scores."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []

    def score(self, model: Any, start: int, end: int, *, samples: Any = None,
              device: Any = None, keep: Any = None) -> torch.Tensor:
        self.ranges.append((start, end))
        return torch.tensor([1.0, float(end - start), 0.0, float(end - start)],
                            dtype=torch.float64)


@pytest.mark.pure
@pytest.mark.parametrize(("sizes", "rank", "ranges", "counted"), [
    ([2, 1, 1, 0], 3, [(0, 1)], 0.0),  # no test sample: the others' forward, on one, not counted
    ([2, 1, 1, 0], 0, [(0, 2)], 2.0),
    ([1025, 1024], 1, [(1025, 1537), (1537, 2049)], 1024.0),  # as many pieces as rank 0's
    ([1025, 1024], 0, [(0, 513), (513, 1025)], 1025.0),
])
def test_a_collective_forward_evaluates_in_lockstep(sizes: list[int], rank: int,
                                                     ranges: list[tuple[int, int]],
                                                     counted: float) -> None:
    """Every worker runs as many evaluation forwards as the others (FSDP's gather them)."""
    from tandem.runtime.trainer import score_shard

    task = _CountingTask()
    totals = score_shard(cast(Any, task), torch.nn.Linear(1, 1), None, sizes, rank,
                         lockstep=True)
    assert task.ranges == ranges and float(totals[3]) == counted


@pytest.mark.pure
@pytest.mark.parametrize(("strategy", "flag", "owners"), [
    ("ps", "--shard", "dp or pipeline"), ("gossip", "--shard-level", "dp or pipeline"),
    ("pipeline", "--shard-units", "dp")])
def test_shard_flags_belong_to_dp_and_pipelines(strategy: str, flag: str, owners: str) -> None:
    """``--shard`` and ``--shard-level`` shard data parallelism or a pipeline's stages
    (``tests/test_sharded_pipeline.py``), whose units are their blocks."""
    result = run_here("train", "--strategy", strategy, "--nproc", "4", flag, "2")
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1
    assert (f"{flag} applies to --strategy {owners} only (this run has --strategy {strategy}); "
            f"add --strategy dp or drop it") in result.stderr


@pytest.mark.multiprocess
def test_unknown_unit_names_the_modules_there_are() -> None:
    result = run_here("train", *GPT[:4], "--nproc", "2", "--shard", "2", "--shard-units", "1,blok")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--shard-units 'blok' is not a submodule of the model; its " \
        "modules include 0, 1, 2, 3" in lines[0], result.stderr


@pytest.mark.multiprocess
def test_shard_1_is_fsdp_on_each_worker_and_equals_one_process(shared_run: SharedRun) -> None:
    """``--shard 1``: FSDP2 with groups of one (one device: its mixed precision; more workers:
    a replicated mesh of one-worker shards), still the one-process update."""
    single, _ = shared_run(*MLP, "--nproc", "1")
    for nproc, mesh in (("1", {"shard": 1}), ("2", {"replicate": 2, "shard": 1})):
        out, summary = shared_run(*MLP, "--nproc", nproc, "--shard", "1")
        assert (summary["shard"], summary["shard_mesh"]) == (1, mesh)
        assert summary["shard_mixed_precision"] is None
        assert max_abs_diff(single / "final.pt", out / "final.pt") <= 1e-5, nproc


@pytest.mark.multiprocess
def test_bf16_computes_in_bf16_on_fp32_shards(shared_run: SharedRun) -> None:
    """``--precision bf16`` is FSDP2's mixed precision: the parameters end in fp32 near the fp32
    run's, but not equal to them (the forward and backward ran in bf16); BatchNorm keeps fp32
    statistics in a unit of its own."""
    full, fp32 = shared_run(*GPT, *FULL)
    out, bf16 = shared_run(*GPT, *FULL, "--precision", "bf16")
    assert bf16["shard_mixed_precision"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    state = torch.load(out / "final.pt")
    assert all(value.dtype == torch.float32 for value in state.values())
    differs = max_abs_diff(full / "final.pt", out / "final.pt")
    assert 1e-4 < differs < 0.05, differs
    assert abs(bf16["final_loss"] - fp32["final_loss"]) < 0.05 * fp32["final_loss"]
    bn_out, bn = shared_run(*BN, "--nproc", "2", "--shard", "2", "--precision", "bf16")
    bn_state = torch.load(bn_out / "final.pt")
    assert bn["finished"] and bn_state["block.bn2.running_mean"].dtype == torch.float32
    assert float(bn_state["block.bn2.running_mean"].abs().max()) > 1e-3


TENSOR_CASES = {"gpt sgd": (GPT, (), ()),
                "mlp adam level 2": (MLP, (*ADAM, "--optimizer-options", "eps=1e-6"),
                                     ("--shard-level", "2", "--accumulate", "2")),
                "gpt2 sgd": (HF, (), ("--tensor-layers", TENSOR_LAYERS))}
"""name: (model, optimizer, more flags); GPT-2 split by its ``Conv1D`` layers. Adam's eps is
1e-6 for mlp: with 1e-8 its moments turn rounding into steps where a gradient is near 0 (1.4e-5
from one process on an AVX-512 CPU, 7e-7 with 1e-6)."""


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(TENSOR_CASES))
def test_sharding_x_tensor_equals_one_process(shared_run: SharedRun, name: str) -> None:
    """``--shard 2 --tensor-parallel 2`` on 4 workers: FSDP2 shards each tensor share over the
    2 replicas (2-D parameters), and the run ends with one process's parameters; each worker
    holds about a quarter of the model."""
    model, optimizer, extra = TENSOR_CASES[name]
    if model is HF:
        pytest.importorskip("transformers")
    single, _ = shared_run(*model, *optimizer, "--nproc", "1")
    out, summary = shared_run(*model, *optimizer, "--nproc", "4", "--shard", "2",
                              "--tensor-parallel", "2", *extra)
    assert (summary["shard"], summary["tensor_parallel"]) == (2, 2)
    assert summary["mesh"] == {"data": 2, "pipeline": 1, "tensor": 2}
    rest, keys = _compare(single / "final.pt", out / "final.pt")
    assert rest <= 1e-5 and keys <= (1e-3 if optimizer else 1e-5), name
    assert summary["tensor_memory"]["worker_fraction"] < 0.35


@pytest.mark.cli
def test_offload_on_the_cpu_has_nothing_to_offload() -> None:
    result = run_here("train", *MLP, "--nproc", "2", "--shard", "2", "--offload", "optimizer",
                      "--backend", "gloo")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "tandem train: error: --offload optimizer moves FSDP2's shards from the GPU to CPU memory, and "
        "this run is on the CPU, where they already are (it has nothing to offload); drop "
        "--offload"), result.stderr


@pytest.mark.multiprocess
def test_a_level_1_checkpoint_is_each_workers_own_state(shared_run: SharedRun,
                                                        tmp_path: Path) -> None:
    """ZeRO-1 with Adam on 4 workers stopped halfway: each worker writes the optimizer state of
    the parameters it steps (no rank gathers it); resumed at level 1 on 2 workers (where the
    parameters change owners), and as plain dp on 2, it ends within 1e-6 of the uninterrupted
    run."""
    level1 = (*MLP, *ADAM, "--nproc", "4", "--shard", "4", "--shard-level", "1")
    whole, _ = shared_run(*level1)
    first = tmp_path / "first"
    run_json("train", *level1, "--stop-after", "4", "--out", str(first))
    meta = torch.load(first / "checkpoint.pt", weights_only=False)
    assert meta["sharded"] == "checkpoint-4.dcp" and "optimizer" not in meta
    for name, layout in {"level 1 on 2": ("--nproc", "2", "--shard", "2", "--shard-level", "1"),
                         "dp on 2": ("--nproc", "2")}.items():
        again = tmp_path / name.replace(" ", "")
        shutil.copytree(first, again)
        summary = run_json("train", *MLP, *ADAM, *layout, "--resume", "--out", str(again))
        assert summary["finished"], name
        rest, keys = _compare(whole / "final.pt", again / "final.pt")
        assert rest <= 1e-6 and keys <= 1e-6, (name, rest, keys)


@pytest.mark.multiprocess
def test_sharding_x_tensor_clips_the_whole_norm_and_resumes(shared_run: SharedRun,
                                                             tmp_path: Path) -> None:
    """2 x 2 with ``--clip-grad-norm``: every worker counts its piece of each 2-D shard (whole
    layers on the first tensor position only), so the run ends where one process clipping the
    same norm does, and clipping changed it; stopped halfway, its checkpoint (each worker's
    2-D shards through DCP) resumes to the uninterrupted run, on the same layout and as plain
    dp on 2 workers."""
    clip = ("--clip-grad-norm", "0.05")
    layout = ("--nproc", "4", "--shard", "2", "--tensor-parallel", "2")
    single, _ = shared_run(*GPT, "--nproc", "1")
    clipped, _ = shared_run(*GPT, *clip, "--nproc", "1")
    out, _ = shared_run(*GPT, *clip, *layout)
    assert max_abs_diff(clipped / "final.pt", out / "final.pt") <= 1e-5
    assert max_abs_diff(single / "final.pt", clipped / "final.pt") > 1e-3
    again, as_dp = tmp_path / "again", tmp_path / "as-dp"
    run_json("train", *GPT, *clip, *layout, "--stop-after", "4", "--out", str(again))
    saved = torch.load(again / "checkpoint.pt", weights_only=False)
    assert saved["tensor_degree"] == 2 and "row_orders" not in saved  # the model's order
    shutil.copytree(again, as_dp)
    run_json("train", *GPT, *clip, *layout, "--resume", "--out", str(again))
    assert max_abs_diff(out / "final.pt", again / "final.pt") <= 1e-6
    # as plain dp on 2: whole tensors, the query/key/value rows back in the model's order
    run_json("train", *GPT, *clip, "--nproc", "2", "--resume", "--out", str(as_dp))
    assert max_abs_diff(out / "final.pt", as_dp / "final.pt") <= 1e-6


@pytest.mark.cli
def test_final_pt_is_exported_from_the_shards_one_tensor_at_a_time(
        shared_run: SharedRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A sharded run writes its final shards (``final.dcp``, each worker its own) and rank 0
    joins them into ``final.pt`` a batch at a time (one tensor at a time with batch 0), a zip
    whose CRCs check; ``tandem export`` writes the same file again from the shards, and
    refuses in one line a directory without them."""
    from tandem.cli import main

    import zipfile

    from tandem.runtime.export import export_final

    out, _ = shared_run(*GPT, *FULL)
    assert (out / "final.dcp" / ".metadata").is_file()
    again = tmp_path / "again.pt"
    assert main(["export", str(out), "-o", str(again), "--json"]) == 0
    exported = json.loads(capsys.readouterr().out)
    whole, copy = torch.load(out / "final.pt"), torch.load(again)
    assert list(whole) == list(copy) and exported["tensors"] == len(whole)
    assert all(torch.equal(whole[name], copy[name]) for name in whole)
    with zipfile.ZipFile(again) as archive:
        assert archive.testzip() is None  # every record's CRC-32 is set
    one = export_final(out / "final.dcp", tmp_path / "one.pt", batch_bytes=0)  # one at a time
    largest = max(t.numel() * t.element_size() for t in whole.values())
    assert one.largest_tensor_bytes == largest < one.num_bytes / 4
    assert main(["export", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().endswith(
        f"{tmp_path} has no final.dcp (the final shards that sharded (--shard-level 2 or 3), "
        f"tensor-parallel and pipeline runs write); export the --out of such a run")
