"""Multi-node jobs on one machine: two ``torchrun`` agents act as two nodes of two workers
each, and the job ends where the same job on four local workers does."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import max_abs_diff, run_here, run_json
from tests.nodes import Node, run_nodes, session_left



CHANCE = math.log(10)
"""Cross-entropy of a uniform guess over digits' 10 classes."""


def _summary(nodes: list[Node]) -> dict[str, Any]:
    """The job's summary: rank 0's JSON line, printed by whichever node holds rank 0."""
    for node in nodes:
        assert node.returncode == 0, node.stderr[-3000:]
        assert not session_left(node)
    printed = [node.stdout.strip().splitlines()[-1] for node in nodes if node.stdout.strip()]
    assert len(printed) == 1, [node.stdout for node in nodes]
    return dict(json.loads(printed[0]))


def _against_local(tmp_path: Path, train: list[str], **nodes_options: Any) -> float:
    """Run ``train`` on 2 nodes x 2 workers (each node its own ``--out``) and on 4 local
    workers; the largest difference of their final parameters and buffers."""
    local = run_json("train", *train, "--nproc", "4", "--out", str(tmp_path / "local"))
    nodes = run_nodes([*train, "--out", str(tmp_path / "node{node}"), "--json"],
                      **nodes_options)
    summary = _summary(nodes)
    assert summary["world_size"] == 4 and summary["steps"] == local["steps"]
    written = [tmp_path / f"node{index}" / "final.pt" for index in range(2)]
    final = [path for path in written if path.exists()]
    assert len(final) == 1, written  # rank 0's node writes the outputs
    return max_abs_diff(tmp_path / "local" / "final.pt", final[0])


@pytest.mark.cli
def test_data_parallel_on_two_nodes_equals_four_local_workers(tmp_path: Path) -> None:
    assert _against_local(tmp_path, ["--steps", "8", "--batch-size", "32"]) <= 1e-5


@pytest.mark.cli
def test_sharded_dp_on_three_nodes_of_different_sizes_equals_four_local_workers(
        tmp_path: Path) -> None:
    """Three agents with 1, 2 and 1 processes (``--nproc-per-node`` differs by node) at the
    c10d rendezvous, writing into one shared ``--out`` (rank 0 reads every rank's shards)."""
    train = ["--steps", "6", "--batch-size", "32", "--shard", "4"]
    local = run_json("train", *train, "--nproc", "4", "--out", str(tmp_path / "local"))
    shared = tmp_path / "shared"
    nodes = run_nodes([*train, "--out", str(shared), "--json"], nodes=3, per_node=[1, 2, 1],
                      static=False)
    summary = _summary(nodes)
    assert summary["world_size"] == 4 and summary["steps"] == local["steps"]
    assert max_abs_diff(tmp_path / "local" / "final.pt", shared / "final.pt") <= 1e-5


@pytest.mark.cli
def test_synchronous_ps_with_the_c10d_rendezvous_equals_four_local_workers(
        tmp_path: Path) -> None:
    """``--nnodes 1:3``: the agents meet at the c10d rendezvous (the node ranks go by
    arrival), both nodes write into one shared ``--out``."""
    train = ["--strategy", "ps", "--servers", "1", "--mode", "sync", "--steps", "6",
             "--batch-size", "30"]
    local = run_json("train", *train, "--nproc", "4", "--out", str(tmp_path / "local"))
    shared = tmp_path / "shared"
    nodes = run_nodes([*train, "--out", str(shared), "--json"], nnodes="1:3", static=False)
    summary = _summary(nodes)
    assert summary["world_size"] == 4 and summary["steps"] == local["steps"]
    assert max_abs_diff(tmp_path / "local" / "final.pt", shared / "final.pt") <= 1e-5


@pytest.mark.cli
@pytest.mark.statistical
@pytest.mark.parametrize("strategy", [
    ["--strategy", "gossip"],
    ["--strategy", "ps", "--servers", "1", "--mode", "async"],
])
def test_gossip_and_asynchronous_ps_learn_on_two_nodes(tmp_path: Path,
                                                       strategy: list[str]) -> None:
    nodes = run_nodes([*strategy, "--steps", "80", "--batch-size", "48", "--out",
                       str(tmp_path / "node{node}"), "--json"])
    summary = _summary(nodes)
    assert summary["world_size"] == 4 and summary["finished"]
    # 80 steps of 48 from ln 10 = 2.30: gossip about 1.5, asynchronous ps about 1.9
    assert summary["test_loss"] < 0.9 * CHANCE, summary


@pytest.mark.cli
def test_a_rank_killed_on_node_1_is_named_by_every_survivor(tmp_path: Path) -> None:
    """Rank 3 (node 1) is killed at step 5; node 1's agent stops rank 2 after it. Ranks 0 and
    1, on node 0, name rank 3 — not rank 2, whose heartbeat is as fresh — from the death
    notice rank 2 left as its agent stopped it."""
    nodes = run_nodes(["--steps", "200", "--batch-size", "32", "--timeout", "30",
                       "--out", str(tmp_path / "node{node}")], env={"TANDEM_FAULT": "3:5"})
    assert all(node.returncode != 0 for node in nodes)
    assert not any(session_left(node) for node in nodes)
    named = [line for line in nodes[0].stderr.splitlines() if line.startswith("tandem train:")]
    assert len(named) == 2, nodes[0].stderr[-3000:]
    for line in named:
        assert line.startswith("tandem train: worker rank 3 on ") and " died " in line, line
        assert "rank 2" not in line, line
    assert {f"rank {rank} gave up waiting" in "".join(named) for rank in (0, 1)} == {True}


@pytest.mark.pure
def test_each_node_locks_its_out_and_a_shared_one_holds_the_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun each node's local rank 0 locks ``--out``: a node that finds the lock
    held by its own job (a directory the nodes share) joins it; another job is refused."""
    from tandem.errors import UsageError
    from tandem.runtime.out_dir import LOCK_NAME, _lock

    for key, value in {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "h0",
                       "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job42"}.items():
        monkeypatch.setenv(key, value)
    held = _lock(tmp_path)  # node 0
    assert held is not None
    assert (tmp_path / LOCK_NAME).read_text().strip().endswith("job h0:29500/job42")
    monkeypatch.setenv("RANK", "2")  # node 1 of the same job, sharing the directory
    assert _lock(tmp_path) is None
    monkeypatch.setenv("MASTER_PORT", "29501")  # another job
    with pytest.raises(UsageError, match=r"is in use by another tandem job \(pid \d+ on .*, "
                                         r"job h0:29500/job42\)"):
        _lock(tmp_path)
    import os

    os.close(held)


@pytest.mark.cli
def test_a_1f1b_plan_for_two_servers_runs_each_stage_on_the_node_it_names(tmp_path: Path) -> None:
    """A 2-2 1F1B pipeline planned for 2 servers of 2 devices, its first stage on server 1's
    devices (2, 3) and its second on server 0's: torchrun's ranks 2 and 3 (node 1) run stage
    0, and the job says so. Each node writes its stages' final shards into its own ``--out``:
    rank 0 (on node 1) says that it cannot assemble ``final.pt`` and how; done as it says,
    ``final.pt`` is that of the same plan on 4 local workers."""
    train = ["--strategy", "pipeline", "--schedule", "1f1b", "--stages", "2", "--replicas",
             "2,2", "--steps", "6", "--batch-size", "32"]
    local = run_json("train", *train, "--nproc", "4", "--out", str(tmp_path / "local"))
    plan = json.loads((tmp_path / "local" / "plan.json").read_text())
    plan["devices_per_server"] = 2
    plan["stages"][0]["devices"], plan["stages"][1]["devices"] = [2, 3], [0, 1]
    (tmp_path / "servers.json").write_text(json.dumps(plan))
    nodes = run_nodes(["--plan", str(tmp_path / "servers.json"), "--steps", "6",
                       "--batch-size", "32", "--out", str(tmp_path / "node{node}"), "--json"])
    summary = _summary(nodes)
    assert summary["world_size"] == 4 and summary["steps"] == local["steps"]
    assert summary["placement"] == [{"stage": 0, "ranks": [2, 3], "nodes": [1]},
                                    {"stage": 1, "ranks": [0, 1], "nodes": [0]}]
    told = "tandem train: stage 0 on node 1 (torchrun ranks 2, 3); stage 1 on node 0 " \
           "(torchrun ranks 0, 1)"
    assert [node.stderr.count(told) for node in nodes] == [0, 1]  # tandem's rank 0: node 1
    warned = [line for line in nodes[1].stderr.splitlines() if "final.pt not written" in line]
    assert len(warned) == 1 and "tandem export" in warned[0], nodes[1].stderr[-2000:]
    assert not (tmp_path / "node1" / "final.pt").exists()
    for shard in (tmp_path / "node0" / "final.dcp").glob("*.distcp"):
        shutil.copy(shard, tmp_path / "node1" / "final.dcp")
    exported = run_here("export", str(tmp_path / "node1"))
    assert exported.returncode == 0, exported.stderr
    assert max_abs_diff(tmp_path / "local" / "final.pt", tmp_path / "node1" / "final.pt") <= 1e-5


@pytest.mark.pure
@pytest.mark.parametrize(("per_node", "expected"), [
    (4, "the plan is for 2 servers of 2 devices, but this job runs 1 node(s) of 4 processes; "
        "start it with torchrun --nnodes 2 --nproc-per-node 2"),
    (2, None),
])
def test_a_plan_for_other_servers_is_refused_in_one_line(
        monkeypatch: pytest.MonkeyPatch, per_node: int, expected: str | None) -> None:
    from tandem.errors import UsageError
    from tandem.plan import Plan, Stage
    from tandem.runtime.placement import TORCHRUN_RANK, place_ranks

    plan = Plan(stages=[Stage(start=0, end=2, replicas=2, devices=[2, 3]),
                        Stage(start=2, end=4, replicas=2, devices=[0, 1])],
                num_layers=4, num_devices=4, devices_per_server=2)
    for key, value in {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "h",
                       "MASTER_PORT": "29500", "LOCAL_WORLD_SIZE": str(per_node)}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv(TORCHRUN_RANK, "")  # recorded, so that the test's own is undone
    monkeypatch.delenv(TORCHRUN_RANK)
    if expected is not None:
        with pytest.raises(UsageError, match=re.escape(expected)):
            place_ranks(plan)
        return
    placement = place_ranks(plan)
    assert placement is not None and placement.stages == ((2, 3), (0, 1))
    import os

    assert (os.environ["RANK"], os.environ[TORCHRUN_RANK]) == ("0", "2")  # stage 0, replica 0
