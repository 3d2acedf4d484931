"""``--compress`` with ``--strategy pipeline``: activations and their gradients between stages,
through the real CLI, against the uncompressed pipeline."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.spec.codec import CodecSpec
from tandem.data import GlobalBatchSampler, build_dataset
from tandem.models import build_model
from tandem.plan import Plan, Stage
from tandem.strategy import even_bounds
from tandem.timeline import Timeline, event_action
from tests.conftest import SharedRun, max_abs_diff, run_cli, run_json

COMMON = ("--model", "mlp", "--data", "digits", "--steps", "20", "--batch-size", "32",
          "--lr", "0.05", "--momentum", "0.9", "--seed", "3", "--strategy", "pipeline",
          "--microbatches", "4")
ONE_F_ONE_B = ("--schedule", "1f1b", "--nproc", "2")
REPLICATED = ("--schedule", "gpipe", "--nproc", "3", "--stages", "2", "--replicas", "2,1")
FLOAT_BYTES, INDEX_BYTES = 4, 4


def boundary_widths(bounds: tuple[tuple[int, int], ...]) -> list[int]:
    """Elements per sample of the activation each stage but the last sends."""
    data = build_dataset("digits")
    model = build_model("mlp", data.info)
    with torch.no_grad():
        return [model[:end](data.train.inputs[:1]).numel() for _, end in bounds[:-1]]


def train(out: Path, *args: str) -> dict[str, Any]:
    return run_json("train", *args, "--out", str(out))


def metrics_bytes(out: Path) -> set[float]:
    """The distinct ``sent_bytes_per_step`` of a run's training records."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["sent_bytes_per_step"] for r in records if "sent_bytes_per_step" in r}


@pytest.fixture(scope="module")
def plain(shared_run: SharedRun) -> dict[str, Path]:
    """The uncompressed pipelines: 1F1B on 2 workers and GPipe on a 2-1 layout (the runs
    test_pipeline.py compares with single-process training)."""
    return {name: shared_run(*COMMON, *layout)[0]
            for name, layout in (("1f1b", ONE_F_ONE_B), ("2-1", REPLICATED))}


@pytest.mark.multiprocess
def test_top_k_of_everything_is_lossless_on_1f1b(plain: dict[str, Path], tmp_path: Path) -> None:
    summary = train(tmp_path, *COMMON, *ONE_F_ONE_B, "--compress", "topk:ratio=1")
    assert max_abs_diff(plain["1f1b"] / "final.pt", tmp_path / "final.pt") == 0.0
    (width,) = boundary_widths(even_bounds(4, 2))
    # per step: 4 micro-batches of 8 samples, each sent forward and its gradient back, every
    # element as a float32 value and an int32 index
    uncompressed = 2 * 4 * 8 * width * FLOAT_BYTES
    assert summary["activation_bytes_per_step"] == uncompressed
    assert summary["compressed_activation_bytes_per_step"] == 2 * 4 * 8 * width * 8
    assert summary["sent_bytes_per_step"] == uncompressed * 2
    assert summary["activation_compression_ratio"] == 0.5
    assert metrics_bytes(tmp_path) == {uncompressed * 2}


@pytest.mark.multiprocess
def test_top_k_of_everything_is_lossless_on_replicated_stages(plain: dict[str, Path],
                                                             tmp_path: Path) -> None:
    summary = train(tmp_path, *COMMON, *REPLICATED, "--compress", "topk:ratio=1")
    assert max_abs_diff(plain["2-1"] / "final.pt", tmp_path / "final.pt") == 0.0
    (width,) = boundary_widths(even_bounds(4, 2))
    # both replicas of stage 0 send their gradients once per step (a 2-worker ring allreduce
    # sends the whole gradient)
    allreduce = 2 * summary["workers"][0]["parameter_bytes"]
    assert summary["sent_bytes_per_step"] == 2 * 4 * 8 * width * 8 + allreduce
    assert metrics_bytes(tmp_path) == {2 * 4 * 8 * width * 8 + allreduce}


def _moved_by_at_most(reference: Path, got: Path, fraction: float) -> None:
    """Every tensor of ``got`` is within ``fraction`` of how far training moved it in
    ``reference``, in L2 norm: the relative error of each tensor's update (SGD amplifies any
    rounding over 20 steps, so plain ``eps`` is too tight; the largest element alone is not a
    fair scale either: with fp16 one element of a bias that barely moved (0.025) ended 0.0037
    away, 0.145 of that move)."""
    torch.manual_seed(3)
    start = build_model("mlp", build_dataset("digits").info).state_dict()
    want, have = torch.load(reference), torch.load(got)
    for name, tensor in want.items():
        moved = float((tensor - start[name]).norm())
        assert float((have[name] - tensor).norm()) <= fraction * moved, name


@pytest.mark.multiprocess
@pytest.mark.parametrize(("codec", "fraction"), [("fp16", 0.1), ("bf16", 0.2)])
def test_half_precision_stays_close_and_halves_the_bytes(plain: dict[str, Path], tmp_path: Path,
                                                         codec: str, fraction: float) -> None:
    summary = train(tmp_path, *COMMON, *ONE_F_ONE_B, "--compress", codec)
    _moved_by_at_most(plain["1f1b"] / "final.pt", tmp_path / "final.pt", fraction)
    (width,) = boundary_widths(even_bounds(4, 2))
    uncompressed = 2 * 4 * 8 * width * FLOAT_BYTES
    assert summary["compress"] == codec
    assert summary["activation_bytes_per_step"] == uncompressed
    assert summary["sent_bytes_per_step"] == uncompressed / 2
    assert summary["activation_compression_ratio"] == 2.0
    assert metrics_bytes(tmp_path) == {uncompressed / 2}
    timeline = Timeline.from_json(json.loads((tmp_path / "trace.json").read_text()))
    sends = {e.bytes for e in timeline.events if (a := event_action(e.name)) and a.kind.is_send}
    assert sends == {8 * width * 2}


STILL_TRAINS = ("--model", "mlp", "--data", "digits", "--strategy", "pipeline", "--steps", "200",
                "--batch-size", "64", "--optimizer", "adam", "--schedule", "pipedream",
                "--nproc", "3", "--seed", "3")


def batch_sizes(steps: int, batch_size: int) -> list[int]:
    """Samples of each step's global batch (an epoch's last batch is short)."""
    sampler = GlobalBatchSampler(len(build_dataset("digits").train), global_batch_size=batch_size,
                                 seed=3)
    return [len(sampler.global_indices(step)) for step in range(steps)]


def _trained(summary: dict[str, Any]) -> None:
    """Below the initial loss (ln 10 = 2.3) and far above chance (0.1): QSGD's run ends at
    1.27 and 0.66 (0.89 and 0.70 before the mlp's He initialization)."""
    assert summary["final_loss"] < 1.5 and summary["test_accuracy"] >= 0.5, summary


@pytest.mark.multiprocess
@pytest.mark.statistical
def test_qsgd_on_pipedream_still_trains(tmp_path: Path) -> None:
    summary = train(tmp_path, *STILL_TRAINS, "--lr", "0.004", "--compress", "qsgd")
    _trained(summary)
    widths, sizes = boundary_widths(even_bounds(4, 3)), batch_sizes(200, 64)
    # 7 levels: 15 codes in 4 bits, two to a byte, and a float32 norm per 512 elements
    messages = sum(math.ceil(n * w / 2) + FLOAT_BYTES * math.ceil(n * w / 512)
                   for w in widths for n in sizes)
    assert summary["compressed_activation_bytes_per_step"] == pytest.approx(2 * messages / 200)
    assert summary["activation_bytes_per_step"] == pytest.approx(
        2 * sum(sizes) * sum(widths) * FLOAT_BYTES / 200)


@pytest.mark.multiprocess
@pytest.mark.statistical
def test_top_k_on_pipedream_with_vertical_sync_and_a_plan_still_trains(tmp_path: Path) -> None:
    # written out rather than planned: what `tandem plan` chooses depends on timings it measures
    plan = tmp_path / "plan.json"
    stages = [Stage(start=0, end=1, replicas=1), Stage(start=1, end=2, replicas=1),
              Stage(start=2, end=4, replicas=1)]
    Plan(stages=stages, num_layers=4, num_devices=3, schedule="pipedream", vertical_sync=True,
         compress=CodecSpec.parse("topk:ratio=0.25")).save(str(plan))
    run_settings = [arg for arg in STILL_TRAINS if arg not in ("--schedule", "pipedream")]
    summary = train(tmp_path / "run", *run_settings, "--lr", "0.002", "--plan", str(plan))
    _trained(summary)
    assert summary["pipeline"] == "1-1-1"
    assert [worker["layers"] for worker in summary["workers"]] == [[0, 1], [1, 2], [2, 4]]
    widths, sizes = boundary_widths(((0, 1), (1, 2), (2, 4))), batch_sizes(200, 64)
    messages = sum(math.ceil(0.25 * n * w) * (FLOAT_BYTES + INDEX_BYTES)
                   for w in widths for n in sizes)
    versions = 8 * len(widths)  # the weight version travels with each activation (int64)
    assert summary["compressed_activation_bytes_per_step"] == pytest.approx(2 * messages / 200)
    assert summary["sent_bytes_per_step"] == pytest.approx(2 * messages / 200 + versions)


BAD_INPUT = {
    "powersgd": (("--compress", "powersgd"),
                 "--compress powersgd cannot be used with --strategy pipeline"),
    "error feedback": (("--compress", "topk:ef=true"), "run without error feedback"),
    "randk": (("--compress", "randk:ratio=0.1"),
              "--compress randk cannot be used with --strategy pipeline (its positions"),
}


@pytest.mark.pure
@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_compression_is_one_line_and_status_2(case: str, capsys: Any) -> None:
    args, expected = BAD_INPUT[case]
    code, _, err = run_cli(capsys, "train", "--strategy", "pipeline", "--nproc", "2", "--steps",
                           "2", *args)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], err
