"""``--compress`` with parameter servers (pushes and tracked pulls) and gossip (CHOCO-gossip).

Whole jobs run in a few gloo processes, one after another in the same process group, through
the runtime's own workers (``make_worker``), so each process group is started only once.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tandem.runtime.run import make_job
from tandem.runtime.dist import WorkerEnv
from tandem.runtime.worker import make_worker
from tandem.runtime.watchdog import Heartbeat
from tandem.runtime.ps import protocol
from tandem.sync.flat import flatten
from tandem.sync.gossip import ChocoGossip, tracking_scale
from tests.conftest import max_abs_diff, run_cli
from tests.distributed import run_distributed

COMMON = {"model": "mlp", "data": "digits", "steps": 20, "batch_size": 32, "lr": 0.05,
          "momentum": 0.9, "seed": 3, "log_every": 10, "progress": False}
SHAPES = [(128, 64), (128,), (128, 128), (128,), (128, 128), (128,), (10, 128), (10,)]
"""The parameters of ``mlp`` on digits, in order."""
SIZES = [math.prod(shape) for shape in SHAPES]


def _jobs(rank: int, world_size: int, jobs: dict[str, dict[str, Any]], root: str) -> dict[str, Any]:
    """Run each job on every rank in turn (in ``root/NAME``, or ``root/DIR`` with a ``dir``
    option); what each rank saw of it."""
    env = WorkerEnv(rank=rank, world_size=world_size, local_rank=0, device=torch.device("cpu"),
                    backend="gloo")
    store = dist.distributed_c10d._get_default_store()
    seen = {}
    for name, options in jobs.items():
        settings = {key: value for key, value in options.items()
                    if key not in ("dir", "strategy") and not key.startswith("--")}
        flags = {key: value for key, value in options.items() if key.startswith("--")}
        out = f"{root}/{options.get('dir', name)}"
        job = make_job(options["strategy"], flags, **{**COMMON, **settings}, nproc=world_size,
                       out=out)
        Path(out).mkdir(exist_ok=True)
        with Heartbeat(store, rank, world_size) as beat:
            trainer = make_worker(job, env, beat)
            before: list[torch.Tensor] = []
            if options["strategy"] == "gossip":
                _record_before_consensus(trainer.strategy, before)
            summary = trainer.run()
        seen[name] = _observe(trainer, summary, before)
        dist.barrier()
    return seen


def _record_before_consensus(strategy: Any, models: list[torch.Tensor]) -> None:
    """Make ``strategy`` append the worker's model to ``models`` before its final average."""
    consensus = strategy.consensus

    def recording(module: torch.nn.Module) -> None:
        models.append(flatten(module.parameters()))
        consensus(module)

    strategy.consensus = recording


def _observe(trainer: Any, summary: dict[str, Any] | None, before: list[torch.Tensor]) -> dict:
    """What a test checks of one rank's job (tensors as lists, to leave the process)."""
    if hasattr(trainer, "codecs"):  # a parameter server
        start, end = trainer.shard.ranges[trainer.env.rank]
        offset = sum(SIZES[:start])
        copies = {worker: encoder.copy.tolist() for worker, encoder in trainer.codecs.encoders.items()
                  if encoder.copy is not None}
        return {"summary": summary, "shard": (offset, offset + sum(SIZES[start:end])),
                "copies": copies}
    seen: dict[str, Any] = {"summary": summary,
                            "params": flatten(trainer.model.parameters()).tolist()}
    if hasattr(trainer.strategy, "traffic"):
        seen["traffic"] = trainer.strategy.traffic
    if before:
        seen["before_consensus"] = before[0].tolist()
    return seen


def _tensors(seen: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`_observe`'s lists back as tensors."""
    for rank in seen:
        for job in rank.values():
            for key in ("params", "before_consensus"):
                if key in job:
                    job[key] = torch.tensor(job[key])
            if "copies" in job:
                job["copies"] = {w: torch.tensor(copy) for w, copy in job["copies"].items()}
    return seen


PS_MODES = {
    "sync": {},
    "backup": {"--backup": 1},
    "async": {"--mode": "async", "optimizer": "adam", "lr": 0.003},
    "ssp": {"--mode": "ssp", "--staleness": 1, "optimizer": "adam", "lr": 0.003},
}
ONE_SERVER = {
    "none": {},
    "topk1": {"--compress": "topk:ratio=1,ef=false"},
    "topk1-ef": {"--compress": "topk:ratio=1"},
    "fp16": {"--compress": "fp16"},
    **{f"topk10-{mode}": {"--compress": "topk:ratio=0.1", **options}
       for mode, options in PS_MODES.items()},
    "randk": {"--compress": "randk:ratio=0.1"},
    "qsgd": {"--compress": "qsgd", "momentum": 0.0},
    "none-long": {"steps": 150, "batch_size": 64},
    "topk10-long": {"steps": 150, "batch_size": 64, "--compress": "topk:ratio=0.1"},
}


@pytest.fixture(scope="module")
def one_server(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """1 server and 2 workers: every job of :data:`ONE_SERVER`."""
    root = tmp_path_factory.mktemp("ps1")
    jobs = {name: {"strategy": "ps", **options} for name, options in ONE_SERVER.items()}
    return root, _tensors(run_distributed(_jobs, 3, jobs, str(root), timeout_s=240))


GOSSIP = {"strategy": "gossip", "--topology": "ring"}
TWO_SERVERS_AND_GOSSIP = {
    "ps-none": {"strategy": "ps", "--servers": 2},
    "ps-topk1": {"strategy": "ps", "--servers": 2, "--compress": "topk:ratio=1,ef=false"},
    "ps-topk10": {"strategy": "ps", "--servers": 2, "--compress": "topk:ratio=0.1"},
    "dpsgd": GOSSIP,
    "choco-lossless": {**GOSSIP, "--compress": "topk:ratio=1", "--gossip-step": 1.0},
    "choco-fp16": {**GOSSIP, "--compress": "fp16", "--gossip-step": 1.0},
    "choco-topk10": {**GOSSIP, "--compress": "topk:ratio=0.1"},
    "choco-cut": {**GOSSIP, "--compress": "topk:ratio=0.1", "stop_after": 10, "dir": "resumed"},
    "choco-resumed": {**GOSSIP, "--compress": "topk:ratio=0.1", "resume": "auto", "dir": "resumed"},
    "dpsgd-long": {**GOSSIP, "steps": 300, "batch_size": 64},
    "choco-topk10-long": {**GOSSIP, "steps": 300, "batch_size": 64, "--compress": "topk:ratio=0.1",
                          "--gossip-step": 0.3},
}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """4 processes: 2 servers and 2 workers, then 4 gossiping workers on a ring."""
    root = tmp_path_factory.mktemp("ps2")
    return root, _tensors(run_distributed(_jobs, 4, TWO_SERVERS_AND_GOSSIP, str(root),
                                          timeout_s=240))


# -- parameter servers ---------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["topk1", "topk1-ef", "fp16"])
def test_lossless_codecs_give_the_uncompressed_parameter_server_run(
        one_server: tuple[Path, list[dict[str, Any]]], name: str) -> None:
    """Pushes of a lossless codec are bit for bit the gradient; pulls track the parameters
    through ``x̂ + fl(x - x̂)``, which is ``x`` only to rounding (1 ulp), hence the tolerance.
    fp16 rounds the pushes too: 3.6e-3 apart at most (2e-3 was the bound before the mlp's He
    initialization, whose larger signal makes larger gradients and roundings)."""
    root, _ = one_server
    tolerance = 5e-3 if name == "fp16" else 1e-6
    assert max_abs_diff(root / "none" / "final.pt", root / name / "final.pt") <= tolerance


@pytest.mark.multiprocess
def test_lossless_codec_with_two_servers(four_ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    root, seen = four_ranks
    assert max_abs_diff(root / "ps-none" / "final.pt", root / "ps-topk1" / "final.pt") <= 1e-6
    assert seen[0]["ps-topk1"]["summary"]["steps"] == 20


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [*(f"topk10-{mode}" for mode in PS_MODES), "randk", "qsgd"])
def test_every_worker_holds_exactly_the_servers_copy_of_its_parameters(
        one_server: tuple[Path, list[dict[str, Any]]], name: str) -> None:
    """Difference tracking is exact: after the run (in every mode) each worker's parameters
    are bit for bit the copy ``x̂_w`` the server keeps for it, though not the server's ``x``."""
    root, seen = one_server
    server = seen[0][name]
    assert sorted(server["copies"]) == [1, 2]
    for worker in (1, 2):
        assert torch.equal(seen[worker][name]["params"], server["copies"][worker])
    final = flatten(torch.load(root / name / "final.pt").values())
    assert not torch.equal(final, server["copies"][1])


@pytest.mark.multiprocess
def test_each_of_two_servers_tracks_its_own_shard(
        four_ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    _, seen = four_ranks
    for server in (0, 1):
        start, end = seen[server]["ps-topk10"]["shard"]
        for worker in (2, 3):
            params = seen[worker]["ps-topk10"]["params"]
            assert torch.equal(params[start:end], seen[server]["ps-topk10"]["copies"][worker])


@pytest.mark.multiprocess
def test_compressed_parameter_servers_run_in_every_mode(
        one_server: tuple[Path, list[dict[str, Any]]]) -> None:
    _, seen = one_server
    for mode in PS_MODES:
        summary = seen[0][f"topk10-{mode}"]["summary"]
        assert summary["steps"] == 20 and math.isfinite(summary["final_loss"]), (mode, summary)
        assert summary["compression_ratio"] > 4, (mode, summary)
    assert seen[0]["topk10-backup"]["summary"]["dropped_pushes"] > 0


@pytest.mark.multiprocess
@pytest.mark.statistical
def test_compressed_parameter_server_learns_like_uncompressed(
        one_server: tuple[Path, list[dict[str, Any]]]) -> None:
    _, seen = one_server
    plain, topk = seen[0]["none-long"]["summary"], seen[0]["topk10-long"]["summary"]
    assert plain["test_accuracy"] >= 0.85
    assert topk["test_accuracy"] >= plain["test_accuracy"] - 0.03, (plain, topk)


def _metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _topk_bytes(sizes: list[int], ratio: float) -> int:
    """A top-k payload: ``ceil(ratio n)`` float32 values and int32 indices per tensor."""
    return sum(8 * math.ceil(ratio * n) for n in sizes)


def _ps_bytes(shards: list[list[int]], bodies: list[int] | None = None) -> dict[str, float]:
    """Bytes per step of a 20-step sync run with 2 workers, from the message formula, for
    shards of tensors of ``shards``' sizes and codec bodies (pushes and pulls alike) of
    ``bodies`` bytes (None: uncompressed)."""
    header, steps, workers = protocol.HEADER_BYTES, 20, 2
    raw = [4 * sum(sizes) for sizes in shards]
    bodies = raw if bodies is None else bodies
    push = pull = sum(header + body for body in bodies)
    first = sum(header + body for body in raw)
    pushed = workers * (steps + 2) * push  # 20 pushes, the first pull request and the goodbye
    pulled = workers * (first + steps * pull)
    return {"pushed_bytes_per_step": pushed / steps, "pulled_bytes_per_step": pulled / steps,
            "sent_bytes_per_step": (pushed + pulled) / steps, "push": push, "pull": pull,
            "uncompressed": workers * (2 * steps + 3) * sum(header + b for b in raw) / steps}


@pytest.mark.multiprocess
def test_parameter_server_bytes_follow_the_codec_formula(
        one_server: tuple[Path, list[dict[str, Any]]]) -> None:
    root, seen = one_server
    none = _ps_bytes([SIZES])
    topk = _ps_bytes([SIZES], [_topk_bytes(SIZES, 0.1)])
    fp16 = _ps_bytes([SIZES], [2 * sum(SIZES)])
    steady = {}
    for name, expected in (("none", none), ("topk10-sync", topk), ("fp16", fp16)):
        summary = seen[0][name]["summary"]
        for key in ("pushed_bytes_per_step", "pulled_bytes_per_step", "sent_bytes_per_step"):
            assert summary[key] == pytest.approx(expected[key], rel=1e-12), (name, key)
        assert summary["uncompressed_bytes_per_step"] == pytest.approx(expected["uncompressed"])
        assert summary["compression_ratio"] == pytest.approx(
            expected["uncompressed"] / expected["sent_bytes_per_step"])
        second = steady[name] = next(line for line in _metrics(root / name)
                                     if line["step"] == 20 and "loss" in line)
        assert second["pushed_bytes_per_step"] == 2 * expected["push"]  # no pull request in it
        assert second["pulled_bytes_per_step"] == 2 * expected["pull"]
        assert second["sent_bytes_per_step"] == 2 * (expected["push"] + expected["pull"])
        worker = seen[1][name]["traffic"]
        assert worker.pushed_bytes == 22 * expected["push"]
        assert seen[1][name]["summary"] is None
    headers = 2 * 2 * protocol.HEADER_BYTES  # 2 workers, a push and a pull each per step
    halved = (steady["none"]["sent_bytes_per_step"] - headers) / 2
    assert steady["fp16"]["sent_bytes_per_step"] - headers == halved


@pytest.mark.multiprocess
def test_two_servers_count_both_shards(four_ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    _, seen = four_ranks
    shards = [SIZES[:3], SIZES[3:]]
    for name, expected in (("ps-none", _ps_bytes(shards)), ("ps-topk10", _ps_bytes(
            shards, [_topk_bytes(sizes, 0.1) for sizes in shards]))):
        summary = seen[0][name]["summary"]
        for key in ("pushed_bytes_per_step", "pulled_bytes_per_step", "sent_bytes_per_step"):
            assert summary[key] == pytest.approx(expected[key], rel=1e-12), (name, key)
        assert summary["compression_ratio"] == pytest.approx(
            expected["uncompressed"] / expected["sent_bytes_per_step"])


SPECS = ["fp16", "bf16", "sign", "topk:ratio=0.1", "randk:ratio=0.1", "qsgd", "qsgd:norm=max"]


@pytest.mark.pure
@pytest.mark.parametrize("spec", SPECS)
def test_pull_tracking_is_exact_and_converges(spec: str) -> None:
    """Property: over random parameter trajectories the worker's parameters always equal the
    server's ``x̂_w`` bit for bit; once ``x`` stops moving, ``x̂_w`` closes in on it."""
    shapes = [torch.Size(shape) for shape in [(7, 9), (9,), (300,)]]
    keys = ["a", "b", "c"]
    generator = torch.Generator().manual_seed(7)
    for trial in range(3):
        encoder = protocol.PullEncoder(protocol.ShardCodec(spec, shapes, keys, feedback=False))
        decoder = protocol.PullDecoder(protocol.ShardCodec(spec, shapes, keys, feedback=False))
        params = [torch.zeros(shape) for shape in shapes]
        x = torch.randn(sum(s.numel() for s in shapes), generator=generator)
        for step in range(90):
            if step < 30:
                x += torch.randn(x.shape, generator=generator) * 0.1 * (trial + 1)
            body = encoder.encode(x)
            assert body.numel() == decoder.next_bytes
            decoder.apply(body.clone(), params)
            assert torch.equal(flatten(params), encoder.copy)
            if step == 30:
                gap = float((x - encoder.copy).norm())
        assert float((x - encoder.copy).norm()) < max(0.2 * gap, 1e-6 * float(x.norm()))


@pytest.mark.pure
def test_qsgd_tracking_is_scaled_to_a_contraction() -> None:
    codec = protocol.ShardCodec("qsgd", [torch.Size([512])], ["w"], feedback=False)
    assert tracking_scale(codec.codec, 512) == pytest.approx(1 / (1 + math.sqrt(512) / 7))
    assert tracking_scale(codec.codec, 10) == pytest.approx(1 / (1 + 10 / 49))
    assert codec.scales == [pytest.approx(1 / (1 + math.sqrt(512) / 7))]


# -- gossip --------------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_choco_gossip_with_a_lossless_codec_and_step_1_is_dpsgd(
        four_ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    root, _ = four_ranks
    assert max_abs_diff(root / "dpsgd" / "final.pt", root / "choco-lossless" / "final.pt") <= 1e-6
    assert max_abs_diff(root / "dpsgd" / "final.pt", root / "choco-fp16" / "final.pt") <= 2e-3


@pytest.mark.multiprocess
def test_choco_gossip_resumes_exactly(four_ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    """Checkpoints keep each worker's model, optimizer, public copies and codec state."""
    root, _ = four_ranks
    assert max_abs_diff(root / "choco-topk10" / "final.pt", root / "resumed" / "final.pt") == 0


def _disagreement(seen: list[dict[str, Any]], name: str) -> float:
    """Distance of the workers' models from their mean before the final average, relative."""
    models = torch.stack([rank[name]["before_consensus"] for rank in seen])
    mean = models.mean(dim=0)
    return float((models - mean).norm() / (mean.norm() * math.sqrt(len(models))))


@pytest.mark.multiprocess
@pytest.mark.statistical
def test_choco_gossip_with_top_10_percent_learns_like_dpsgd(
        four_ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    _, seen = four_ranks
    plain, choco = seen[0]["dpsgd-long"]["summary"], seen[0]["choco-topk10-long"]["summary"]
    assert plain["test_accuracy"] >= 0.9
    assert choco["test_accuracy"] >= plain["test_accuracy"] - 0.03, (plain, choco)
    assert _disagreement(seen, "choco-topk10-long") < 0.05
    assert choco["compression_ratio"] == pytest.approx(4 * 42634 / _topk_bytes(SIZES, 0.1))


@pytest.mark.multiprocess
def test_gossip_bytes_follow_the_codec_formula(
        four_ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    root, seen = four_ranks
    ring_messages = 4 * 2  # every worker sends to its two neighbours
    for name, message in (("dpsgd", 4 * sum(SIZES)), ("choco-fp16", 2 * sum(SIZES)),
                          ("choco-topk10-long", _topk_bytes(SIZES, 0.1))):
        expected = ring_messages * message
        assert seen[0][name]["summary"]["sent_bytes_per_step"] == expected
        assert all(line["sent_bytes_per_step"] == expected
                   for line in _metrics(root / name) if "loss" in line)


@pytest.mark.multiprocess
def test_choco_gossip_keeps_the_mean_and_shrinks_disagreement() -> None:
    """Consensus only (no gradients): the mean of the workers never moves and their
    disagreement shrinks, for a lossy codec with a small enough step."""
    histories = torch.tensor(run_distributed(_choco_rounds, 4, timeout_s=120))
    mean = histories[:, 0].mean(dim=0)
    assert torch.allclose(histories.mean(dim=0), mean.expand_as(histories[0]), atol=1e-5)
    spread = (histories - mean).norm(dim=(0, 2))
    assert spread[-1] < 0.05 * spread[0]


def _choco_rounds(rank: int, world_size: int) -> list[list[float]]:
    from tandem.topology import build_topology, mixing_matrix

    graph = build_topology("ring", world_size)
    gossip = ChocoGossip(graph, mixing_matrix(graph), rank, "topk:ratio=0.1", step=0.2)
    torch.manual_seed(100 + rank)
    model = torch.nn.Linear(50, 20)
    gossip.wrap(model, torch.device("cpu"))
    flat = flatten(model.parameters())
    history = [flat.tolist()]
    for _ in range(150):
        flat = gossip.mix(flat)
        history.append(flat.tolist())
    return history


# -- mistakes ------------------------------------------------------------------------------------


BAD = {
    "powersgd with ps": (("--strategy", "ps", "--nproc", "3", "--compress", "powersgd"),
                         "--compress powersgd cannot be used with --strategy ps"),
    "compressed ad-psgd": (("--strategy", "gossip", "--async-gossip", "--nproc", "4",
                            "--compress", "topk"), "cannot be used with --async-gossip"),
    "gossip step above 1": (("--strategy", "gossip", "--nproc", "4", "--compress", "topk",
                             "--gossip-step", "1.5"), "--gossip-step must be in (0, 1] (got 1.5)"),
    "gossip step zero": (("--strategy", "gossip", "--nproc", "4", "--compress", "topk",
                          "--gossip-step", "0"), "--gossip-step must be in (0, 1] (got 0.0)"),
    "gossip step without codec": (("--strategy", "gossip", "--nproc", "4", "--gossip-step",
                                   "0.5"), "--gossip-step is the step size of compressed gossip"),
}


@pytest.mark.pure
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_and_status_2(capsys: pytest.CaptureFixture[str], case: str) -> None:
    args, expected = BAD[case]
    code, _, err = run_cli(capsys, "train", "--steps", "2", *args)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], err
