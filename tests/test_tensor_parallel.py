"""Tensor parallelism (``--tensor-parallel T``) against single-process training.

The split layers are checked on one 4-process gloo group for every case (T = 4 on all four
ranks; T = 2 on each half of a 2 x 2 mesh); the trainer, end to end through the real CLI, on mlp
with T = 2; and the 3-D layouts through the CLI: data 2 x tensor 2 and data 2 x pipeline 2 x
tensor 2 (8 workers) on gpt, pipeline 2 x tensor 2 on an mlp whose stage boundary cuts a
column-wise/row-wise pair. Bad input is one line and exit status 2, before any worker starts.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn import functional as F

from tandem.data.info import DataInfo
from tandem.models import build_model

from tests.conftest import SharedRun, max_abs_diff, run_cli
from tests.distributed import run_distributed

IMAGES = DataInfo(task="classify", input_shape=(1, 8, 8), num_classes=10)
TOKENS = DataInfo(task="lm", input_shape=(12,), num_classes=32)
CASES = {  # name: (model spec, data, tensor degree)
    "mlp T=4": ("mlp:hidden=32", IMAGES, 4),
    "gpt T=4": ("gpt:layers=2,dim=32,heads=4", TOKENS, 4),
    "mlp T=2": ("mlp:hidden=32,layers=5", IMAGES, 2),
    "gpt T=2": ("gpt:layers=2,dim=32,heads=4,mlp_ratio=2", TOKENS, 2),
    "vgg T=2": ("vgg:width=0.0625,hidden=32", IMAGES, 2),
}
STEPS, BATCH, LR, MOMENTUM, SEED = 20, 8, 0.05, 0.9, 3


def batches(info: DataInfo) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``STEPS`` fixed batches (the same on every rank and in the reference)."""
    generator = torch.Generator().manual_seed(SEED)
    if info.task == "lm":
        tokens = torch.randint(0, info.num_classes, (STEPS, BATCH, *info.input_shape),
                               generator=generator)
        return [(row, row.roll(-1, dims=-1)) for row in tokens]
    inputs = torch.randn(STEPS, BATCH, *info.input_shape, generator=generator)
    labels = torch.randint(0, info.num_classes, (STEPS, BATCH), generator=generator)
    return list(zip(inputs, labels))


def train(model: torch.nn.Module, info: DataInfo) -> torch.optim.Optimizer:
    """``STEPS`` steps of SGD with momentum on :func:`batches`, mean cross-entropy."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for inputs, targets in batches(info):
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return optimizer


def single_process(spec: str, info: DataInfo) -> dict[str, torch.Tensor]:
    torch.manual_seed(SEED)
    model = build_model(spec, info)
    train(model, info)
    return model.state_dict()


def _split_training(rank: int, world_size: int) -> dict[str, Any]:
    """Every case on this 4-rank group: the whole model's state after training, the names of
    the model's own state, and the parameter + optimizer memory against its bound."""
    from torch.distributed.device_mesh import init_device_mesh

    from tandem.models.pieces import Initializer
    from tandem.models.tensor import tensor_plan
    from tandem.runtime.tensor_parallel import (
        gathered_state_dict, materialize_split, memory_report, parameter_bytes, split_model,
    )

    meshes = {4: init_device_mesh("cpu", (4,)),
              2: init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "tensor"))["tensor"]}
    results: dict[str, Any] = {}
    for name, (spec, info, degree) in CASES.items():
        torch.manual_seed(SEED)
        model = build_model(spec, info)
        names = list(model.state_dict())
        whole = parameter_bytes(model)
        plan = tensor_plan(spec, model, degree)
        meta = build_model(spec, info, device="meta")  # a worker's start, one layer at a time
        materialize_split(meta, plan, meshes[degree], init=Initializer(seed=SEED, by_name=True),
                          device=torch.device("cpu"))
        start = gathered_state_dict(meta, plan, meshes[degree])
        meta_diff = max(float((start[key] - value).abs().max())
                        for key, value in model.state_dict().items())
        split_model(model, plan, meshes[degree])
        optimizer = train(model, info)
        memory = memory_report(model, optimizer, whole)
        state = gathered_state_dict(model, plan, meshes[degree])
        # numpy, pickled by value: a tensor would travel as shared memory that this process
        # may have freed by the time the test reads it
        results[name] = {"state": {key: value.numpy() for key, value in state.items()},
                         "names": names, "memory": memory, "meta_diff": meta_diff,
                         "meta_names": list(start)}
    return results if rank in (0, 2) else {}


@pytest.fixture(scope="module")
def split_results() -> list[dict[str, Any]]:
    return run_distributed(_split_training, 4, timeout_s=300)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(CASES))
def test_split_training_equals_one_process(split_results: list[dict[str, Any]],
                                           name: str) -> None:
    spec, info, degree = CASES[name]
    expected = single_process(spec, info)
    ranks = [0, 2] if degree == 2 else [0]  # both halves of the 2 x 2 mesh
    for rank in ranks:
        got = split_results[rank][name]
        assert got["names"] == list(expected) == list(got["state"])  # parameters and buffers
        for key, value in expected.items():
            assert got["state"][key].shape == value.shape, key
            assert float((torch.from_numpy(got["state"][key]) - value).abs().max()) <= 1e-5, key


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(CASES))
def test_layer_by_layer_materialization_starts_from_the_whole_model(
        split_results: list[dict[str, Any]], name: str) -> None:
    """A worker that builds the model on the meta device and gives each layer storage (cut to
    its share) one at a time starts from exactly the weights of the whole model built at once:
    both are initialized by the seed and each module's name."""
    got = split_results[0][name]
    assert got["meta_names"] == got["names"] and got["meta_diff"] == 0.0


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(CASES))
def test_worker_memory_is_a_share_plus_the_whole_layers(split_results: list[dict[str, Any]],
                                                        name: str) -> None:
    degree = CASES[name][2]
    memory = split_results[0][name]["memory"]
    assert memory["worker_bytes"] <= memory["model_bytes"] / degree + memory["whole_layer_bytes"]
    assert memory["worker_bytes"] < memory["model_bytes"]


COMMON = ("--model", "mlp", "--data", "digits", "--steps", "20", "--batch-size", "32",
          "--lr", "0.05", "--momentum", "0.9", "--seed", "3")


@pytest.mark.multiprocess
def test_cli_tensor_parallel_equals_one_process(shared_run: SharedRun) -> None:
    """(With ``--accumulate 2``: every worker runs the global batch in two micro-batches.)"""
    single, _ = shared_run(*COMMON, "--nproc", "1")
    out, summary = shared_run(*COMMON, "--nproc", "2", "--tensor-parallel", "2",
                              "--accumulate", "2")
    assert summary["world_size"] == 2 and summary["tensor_parallel"] == 2
    assert max_abs_diff(single / "final.pt", out / "final.pt") <= 1e-5
    assert list(torch.load(out / "final.pt")) == list(torch.load(single / "final.pt"))
    memory = summary["tensor_memory"]
    assert memory["worker_bytes"] <= memory["bound_bytes"] < memory["model_bytes"]
    assert summary["test_accuracy"] is not None and summary["final_loss"] > 0


GPT = ("--model", "gpt:layers=2,dim=32,heads=4,dropout=0", "--data", "tokens:n=256,seq=12,vocab=32",
       "--steps", "20", "--batch-size", "16", "--lr", "0.05", "--momentum", "0.9", "--seed", "3")
MLP5 = ("--model", "mlp:hidden=32,layers=5", *COMMON[2:])
LAYOUTS = {  # name: (common args, layout args, mesh, layers left whole)
    "data 2 x tensor 2": (GPT, ("--nproc", "4", "--tensor-parallel", "2"),
                          {"data": 2, "pipeline": 1, "tensor": 2}, None),
    "pipeline 2 x tensor 2": (MLP5, ("--strategy", "pipeline", "--stages", "2", "--nproc", "4",
                                     "--tensor-parallel", "2", "--schedule", "gpipe",
                                     "--recompute"),
                              {"data": 1, "pipeline": 2, "tensor": 2}, []),
    "data 2 x pipeline 2 x tensor 2": (GPT, ("--strategy", "pipeline", "--replicas", "2,2",
                                             "--nproc", "8", "--tensor-parallel", "2"),
                                       {"data": 2, "pipeline": 2, "tensor": 2}, []),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_3d_layouts_equal_one_process(shared_run: SharedRun, name: str) -> None:
    """Every layout ends with single-process training's parameters (and names); each worker
    holds a share of its split layers. mlp's 5 blocks cut 3 + 2 put the pair (2.0, 3.0) in
    two stages: the first gathers its output, the second splits its whole input; that run also
    recomputes its stages' activations in the backward (whose split layers run their
    collectives again)."""
    common, layout, mesh, whole = LAYOUTS[name]
    single, _ = shared_run(*common, "--nproc", "1")
    out, summary = shared_run(*common, *layout)
    assert summary["mesh"] == mesh and summary["tensor_parallel"] == 2
    assert list(torch.load(out / "final.pt")) == list(torch.load(single / "final.pt"))
    assert max_abs_diff(single / "final.pt", out / "final.pt") <= 1e-5
    if whole is not None:
        assert summary["tensor_whole_layers"] == whole
    assert summary.get("recompute", False) == ("--recompute" in layout)
    memories = ([summary["tensor_memory"]] if "workers" not in summary
                else [worker["tensor_memory"] for worker in summary["workers"]])
    for memory in memories:
        assert memory["worker_bytes"] <= memory["model_bytes"] / 2 + memory["whole_layer_bytes"]
        assert memory["worker_bytes"] < memory["model_bytes"]


@pytest.mark.multiprocess
def test_data_dimension_compresses_in_bf16(shared_run: SharedRun) -> None:
    """Data 2 x tensor 2 with ``--compress fp16 --precision bf16`` ends where data parallelism
    with the same codec and precision does, within bf16's rounding (bf16 against fp32 is 3e-4
    apart here; the same run in fp32 is 9e-6 from data parallelism's), and halves the bytes the
    replicas exchange: each worker encodes its own shares of the gradients."""
    options = ("--compress", "fp16", "--precision", "bf16")
    dp, _ = shared_run(*GPT, "--nproc", "2", *options)
    out, summary = shared_run(*GPT, "--nproc", "4", "--tensor-parallel", "2", *options)
    assert summary["compress"] == "fp16" and summary["compression_ratio"] == 2.0
    assert summary["precision"] == "bf16"
    assert max_abs_diff(dp / "final.pt", out / "final.pt") <= 2e-3


BAD = {
    "heads": (("--model", "gpt:layers=1,dim=24,heads=3", "--data", "tokens:n=64,seq=8,vocab=16",
               "--tensor-parallel", "2", "--nproc", "2"),
              "--tensor-parallel 2 does not divide gpt's attention heads (3)"),
    "hidden": (("--model", "mlp:hidden=30", "--tensor-parallel", "4", "--nproc", "4"),
               "--tensor-parallel 4 does not divide the hidden size of mlp (30"),
    "channels": (("--model", "vgg:width=0.0625", "--tensor-parallel", "3", "--nproc", "3"),
                 "--tensor-parallel 3 does not divide the 4 output channels of vgg's "
                 "convolution 0.0"),
    "not a product": (("--tensor-parallel", "2", "--nproc", "3"),
                      "--tensor-parallel 2 does not divide --nproc 3"),
    "not the product of the stages": (
        ("--strategy", "pipeline", "--replicas", "2,2", "--tensor-parallel", "2", "--nproc", "6"),
        "add up to 4 workers but the job has 3 (--nproc 6 / --tensor-parallel 2); use --nproc 8"),
    "uneven replicas": (("--strategy", "pipeline", "--replicas", "2,1", "--tensor-parallel", "2",
                         "--nproc", "6"), "needs the same replicas on every stage"),
    "pipedream": (("--strategy", "pipeline", "--stages", "2", "--schedule", "pipedream",
                   "--tensor-parallel", "2", "--nproc", "4"), "run flush schedules only"),
    "with gossip": (("--strategy", "gossip", "--tensor-parallel", "2", "--nproc", "2"),
                    "runs with --strategy dp or pipeline"),
    "zero": (("--tensor-parallel", "0", "--nproc", "2"), "--tensor-parallel must be at least 1"),
    "dropout": (("--model", "gpt:layers=1,dim=16,dropout=0.1", "--data",
                 "tokens:n=64,seq=8,vocab=16", "--tensor-parallel", "2", "--nproc", "2"),
                "needs a model without dropout"),
    "compress and resume": (("--tensor-parallel", "2", "--nproc", "4", "--compress", "topk",
                             "--stop-after", "1"),
                            "--stop-after 1 is not supported with --tensor-parallel 2 --compress "
                            "topk"),
    "auto batch": (("--tensor-parallel", "2", "--nproc", "2", "--batch-schedule", "auto"),
                   "--batch-schedule auto does not apply with --tensor-parallel 2: it follows "
                   "the gradient noise scale"),
    "compress one replica": (("--tensor-parallel", "2", "--nproc", "2", "--compress", "fp16"),
                             "has one replica; drop --compress, or use --nproc 4"),
    "compress powersgd": (("--tensor-parallel", "2", "--nproc", "4", "--compress", "powersgd"),
                          "pick a per-tensor codec"),
    "compress in a pipeline": (("--strategy", "pipeline", "--stages", "2", "--tensor-parallel",
                                "2", "--nproc", "4", "--compress", "fp16"),
                               "not supported in a pipeline x tensor layout"),
    "user model": (("--model", "tests.odd_models:linear:outputs=10", "--tensor-parallel", "2",
                    "--nproc", "2"), "splits the reference models mlp, gpt, vgg only"),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_tensor_parallel_input_is_one_line(capsys: pytest.CaptureFixture[str],
                                               name: str) -> None:
    args, message = BAD[name]
    code, _, err = run_cli(capsys, "train", "--steps", "2", "--batch-size", "8", *args)
    assert code == 2, err
    assert err.count("\n") == 1 and message in err, err
