"""``--compress`` with ``--strategy dp``: DDP hooks on gloo workers and the real command line."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tandem.cli import main
from tandem.compress import ByteMeter, build_compression

from tests.conftest import run_here, run_json
from tests.distributed import run_distributed
from tests.test_train_dp import reference_training

HOOK_SPECS = ["fp16", "bf16", "sign", "topk:ratio=0.1", "topk:ratio=1,ef=false",
              "randk:ratio=0.1", "randk:ratio=1,ef=false", "qsgd:levels=7", "powersgd:start=2"]
SHAPES = {"0.weight": (16, 12), "0.bias": (16,), "2.weight": (4, 16), "2.bias": (4,)}


def _train(specs: list[str | None], rank: int, world_size: int, steps: int = 5) -> dict[str, Any]:
    """Per spec: the parameters after ``steps`` steps on rank-dependent data, and the bytes."""
    results: dict[str, Any] = {}
    for spec in specs:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 4))
        ddp = DistributedDataParallel(model)
        meter = ByteMeter(world_size=world_size)
        if spec is not None:
            ddp.register_comm_hook(*build_compression(spec).ddp_hook(model, meter))
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            x = torch.randn(8, 12, generator=generator)
            loss = ddp(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        results[str(spec)] = (flat.tolist(), meter.payload_bytes / steps,
                              meter.gradient_bytes / steps)
    return results


def _hooks(rank: int, world_size: int) -> dict[str, Any]:
    return _train([None, *HOOK_SPECS], rank, world_size)


@pytest.fixture(scope="module")
def hook_runs() -> list[dict[str, Any]]:
    runs = run_distributed(_hooks, 2)
    return [{spec: (torch.tensor(flat), *rest) for spec, (flat, *rest) in run.items()}
            for run in runs]


@pytest.mark.multiprocess
@pytest.mark.parametrize("spec", HOOK_SPECS)
def test_replicas_stay_identical(hook_runs: list[dict[str, Any]], spec: str) -> None:
    rank0, rank1 = (run[spec][0] for run in hook_runs)
    assert torch.equal(rank0, rank1)


@pytest.mark.multiprocess
@pytest.mark.parametrize("spec", ["topk:ratio=1,ef=false", "randk:ratio=1,ef=false", "fp16"])
def test_lossless_codecs_give_plain_ddp(hook_runs: list[dict[str, Any]], spec: str) -> None:
    tolerance = 1e-3 if spec == "fp16" else 1e-6
    assert torch.allclose(hook_runs[0][spec][0], hook_runs[0]["None"][0], atol=tolerance, rtol=0)


def _sizes() -> list[int]:
    return [math.prod(shape) for shape in SHAPES.values()]


# spec -> payload bytes per step of the model above (every parameter in one bucket)
EXPECTED_BYTES = {
    "fp16": 2 * sum(_sizes()),
    "sign": sum(math.ceil(n / 8) + 4 for n in _sizes()),
    "topk:ratio=0.1": sum(8 * math.ceil(0.1 * n) for n in _sizes()),
    "randk:ratio=0.1": sum(4 * math.ceil(0.1 * n) for n in _sizes()),
    "qsgd:levels=7": sum(math.ceil(n / 2) + 4 for n in _sizes()),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("spec", sorted(EXPECTED_BYTES))
def test_bytes_are_counted(hook_runs: list[dict[str, Any]], spec: str) -> None:
    _, payload, gradient = hook_runs[0][spec]
    assert gradient == 4 * sum(_sizes())
    assert payload == EXPECTED_BYTES[spec]


@pytest.mark.multiprocess
def test_powersgd_counts_plain_steps_then_its_factors(hook_runs: list[dict[str, Any]]) -> None:
    # Steps 0-1 allreduce everything; then 0.weight (16x12) goes as rank-2 factors (16+12)*2.
    plain = 4 * sum(_sizes())
    compressed = 4 * ((16 + 12) * 2 + 16 + 4 * 16 + 4)
    assert hook_runs[0]["powersgd:start=2"][1] == pytest.approx((2 * plain + 3 * compressed) / 5)


COMMON = ("--model", "mlp", "--data", "digits", "--steps", "20", "--batch-size", "32",
          "--lr", "0.05", "--momentum", "0.9", "--seed", "3", "--nproc", "2")


@pytest.mark.multiprocess
def test_fp16_run_equals_uncompressed_within_fp16_tolerance(tmp_path: Path) -> None:
    """Against plain single-process training, which uncompressed dp equals to 1e-5
    (tests/test_train_dp.py): the same run with fp16 gradients differs by fp16 rounding only."""
    half = run_json("train", *COMMON, "--compress", "fp16", "--out", str(tmp_path))
    expected = reference_training(20, 32, 0.05, 0.9, 3)
    got = torch.load(tmp_path / "final.pt")
    difference = max(float((got[key] - expected[key]).abs().max()) for key in expected)
    assert 1e-7 < difference <= 2e-3
    assert half["compressed_bytes_per_step"] * 2 == half["uncompressed_bytes_per_step"]
    assert half["uncompressed_bytes_per_step"] == 4 * half["parameters"]
    assert half["compression_ratio"] == 2.0
    # Bytes sent per step, by both workers together: a ring allreduce of the fp16 gradient
    # sends 2 (W - 1) / W of it from each worker; in the summary and on every metrics line.
    sent = 2 * (2 * (2 - 1) / 2 * 2 * half["parameters"])
    assert half["sent_bytes_per_step"] == sent
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [line["sent_bytes_per_step"] for line in lines if "loss" in line]
    assert len(logged) == 2 and logged == [sent, sent]


@pytest.mark.pure
def test_unknown_codec_exits_2_with_one_line() -> None:
    result = run_here("train", *COMMON, "--compress", "zip")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "tandem train: error: unknown codec 'zip' in --compress 'zip'; choose one of: "
        "bf16, fp16, powersgd, qsgd, randk, sign, topk"]


@pytest.mark.pure
@pytest.mark.parametrize(("args", "message"), [
    (("--compress", "topk:k=0"), "ratio (k) must be in (0, 1] (got 0.0)"),
    (("--compress", "topk:ratio=1.01"), "ratio (k) must be in (0, 1] (got 1.01)"),
    (("--compress", "fp16", "--strategy", "easgd"),
     "--compress fp16 is not supported with --strategy easgd; it works with --strategy dp, ps, "
     "gossip, pipeline"),
    (("--compress", "powersgd", "--strategy", "ps", "--nproc", "3"),
     "--compress powersgd cannot be used with --strategy ps (it is PyTorch's DDP communication "
     "hook); use one of: bf16, fp16, qsgd, randk, sign, topk"),
    (("--compress", "sign:ef=true", "--strategy", "gossip"),
     "with --strategy gossip codecs run without error feedback"),
    (("--compress", "topk:momentum=0.9", "--strategy", "pipeline", "--nproc", "2"),
     "not for --strategy pipeline; drop momentum="),
    (("--compress", "topk:momentum=0.9"), "add --momentum 0"),
])
def test_bad_compression_is_one_line_and_status_2(capsys: pytest.CaptureFixture[str],
                                                  args: tuple[str, ...], message: str) -> None:
    assert main(["train", "--steps", "2", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tandem train: error: ") and message in err
