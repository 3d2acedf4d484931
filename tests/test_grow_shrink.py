"""A torchrun job that grows and shrinks (``--nnodes 1:2``): a node that leaves at step 30, a
node that joins; each ends where the checkpoint-resume run it amounts to ends, and counts its
restarts and resizes. Below them: the worker groups' handshake, the counts a checkpoint
carries, and shards re-dealt to another number of ranks (every sample once per epoch)."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist

from tandem.data.shard_sampler import ShardBatchSampler
from tandem.errors import WorkerFailure
from tandem.runtime.faults import last_progress
from tandem.runtime.membership import Membership
from tandem.runtime import worker_group
from tandem.runtime.worker_group import PREFIX, WorkerGroup, join_group
from tests.conftest import max_abs_diff, run_json
from tests.nodes import Node, agent_command, end_session, finish, free_port, session_left, start

RUN = ["train", "--steps", "60", "--batch-size", "60", "--checkpoint-every", "10", "--seed", "3",
       "--no-progress"]
"""The job: dp on digits, 60 steps, a checkpoint every 10 (60 divides among 4 and 2)."""
SLOW = ["--straggler", "0:60"]
"""Rank 0 computes 60 times as long (about 0.1 s a step), so that a node leaves or joins
while the job runs; the result does not depend on it."""
NO_SHARED_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""What a job that grows needs (README, "Many machines"): with the store shared between the
agents and the workers, torch's rank-0 agent does not publish the store's address to a round
that a node joins, and the joining agent waits for it until the rendezvous times out."""


GO = ("import os, runpy, sys, time\n"
      "import torch.distributed.run\n"
      "while not os.path.exists(sys.argv[1]):\n"
      "    time.sleep(0.02)\n"
      "sys.argv = ['torchrun', *sys.argv[2:]]\n"
      "runpy.run_module('torch.distributed.run', run_name='__main__')\n")
"""An agent that has imported torch already and starts when the file ``argv[1]`` appears: a
node that joins at a given step, however long torch's import takes on a loaded machine."""


def _agent(port: int, out: Path, progress: Path, env: dict[str, str], *,
           last_call_s: int = 20, go: Path | None = None) -> Node:
    """An agent of the job; the rendezvous closes a round once both nodes joined, or
    ``last_call_s`` after the first one when the other does not come."""
    command = agent_command(None, nnodes="1:2", per_node=2, port=port, max_restarts=3,
                            train=[*RUN[1:], *SLOW, "--out", str(out), "--resume", "auto",
                                   "--json"])
    command[command.index("--rdzv-conf") + 1] = \
        f"last_call_timeout={last_call_s},join_timeout=120"
    if go is not None:
        command = [command[0], "-c", GO, str(go), *command[3:]]  # for "-m torch.distributed.run"
    return start(command, {"TANDEM_PROGRESS_DIR": str(progress), **env})


def _wait_for_step(progress: Path, rank: int, step: int, nodes: list[Node]) -> None:
    deadline = time.monotonic() + 240
    while (last_progress(progress, rank) or 0) < step:
        if time.monotonic() > deadline or any(node.process.poll() is not None for node in nodes):
            for node in nodes:
                end_session(node)
            raise AssertionError(f"rank {rank} did not reach step {step}: "
                                 + "\n".join(node.process.stderr.read()[-3000:]  # type: ignore[union-attr]
                                             for node in nodes))
        time.sleep(0.02)


def _wait_for_port(port: int, node: Node) -> None:
    """Until the agent ``node`` listens on ``port`` (it hosts the rendezvous's store)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline or node.process.poll() is not None:
                end_session(node)
                raise AssertionError(f"the first agent did not listen on {port}") from None
            time.sleep(0.05)


def _summary(nodes: list[Node]) -> dict[str, Any]:
    for node in nodes:
        assert node.returncode == 0, node.stderr[-4000:]
        assert not session_left(node)
    printed = [node.stdout.strip().splitlines()[-1] for node in nodes if node.stdout.strip()]
    assert len(printed) == 1, [node.stdout[-500:] for node in nodes]
    return dict(json.loads(printed[0]))


def _resumed_step(nodes: list[Node]) -> int:
    """The step the resized group resumed from, as its rank 0 said."""
    said = "".join(node.stderr for node in nodes)
    found = re.findall(r"restart 1: (?:resuming from step|the job continues from step) (\d+)",
                       said)
    assert found, said[-3000:]
    return int(found[0])


def _reference(tmp_path: Path, before: int, after: int, step: int) -> Path:
    """The checkpoint-resume run a resized job amounts to: ``before`` local workers stopped
    after ``step``, resumed on ``after``."""
    out = tmp_path / "reference"
    run_json(*RUN, "--nproc", str(before), "--out", str(out), "--stop-after", str(step))
    resumed = run_json(*RUN, "--nproc", str(after), "--out", str(out), "--resume", "auto")
    assert resumed["finished"] and resumed["world_size"] == after
    return out / "final.pt"


@pytest.mark.cli
def test_a_node_that_leaves_at_step_30_leaves_the_job_to_finish_on_one(tmp_path: Path) -> None:
    port, out, progress = free_port(), tmp_path / "out", tmp_path / "progress"
    progress.mkdir()
    go = tmp_path / "go"
    # torch imported beforehand, the second agent joins within a second of the first's round:
    # a 5 s last call holds both in round 0 however loaded, and the round re-formed after the
    # kill waits only that
    second = _agent(port, out, progress, {}, last_call_s=5, go=go)
    first = _agent(port, out, progress, {}, last_call_s=5)
    _wait_for_port(port, first)  # the first agent hosts the rendezvous: the other one leaves
    go.touch()
    _wait_for_step(progress, 3, 30, [first, second])
    end_session(second)  # the node is gone: its agent and its workers
    nodes = finish([first], timeout_s=240)
    summary = _summary(nodes)
    assert summary["finished"] and summary["world_size"] == 2
    assert (summary["restarts"], summary["resizes"]) == (1, 1)
    assert "on 2 workers (the checkpoint's group had 4; resize 1)" in nodes[0].stderr
    step = _resumed_step(nodes)
    assert max_abs_diff(_reference(tmp_path, 4, 2, step), out / "final.pt") <= 1e-6


@pytest.mark.cli
def test_a_node_that_joins_grows_the_job_from_its_last_checkpoint(tmp_path: Path) -> None:
    port, out, progress = free_port(), tmp_path / "out", tmp_path / "progress"
    progress.mkdir()
    go = tmp_path / "go"
    first = _agent(port, out, progress, NO_SHARED_STORE, last_call_s=2)  # alone at first
    second = _agent(port, out, progress, NO_SHARED_STORE, go=go)
    _wait_for_step(progress, 0, 20, [first])
    go.touch()  # the second node joins now
    nodes = finish([first, second], timeout_s=240)
    summary = _summary(nodes)
    assert summary["finished"] and summary["world_size"] == 4
    assert (summary["restarts"], summary["resizes"]) == (1, 1)
    step = _resumed_step(nodes)
    assert 20 <= step < 60
    assert max_abs_diff(_reference(tmp_path, 2, 4, step), out / "final.pt") <= 1e-6


def _join_all(store: dist.Store, world: int) -> list[WorkerGroup]:
    """Every rank of a group, each a thread, as if each were a new process."""
    worker_group._LED = False  # noqa: SLF001 (this process led the group before)
    groups: list[WorkerGroup | None] = [None] * world

    def join(rank: int) -> None:
        groups[rank] = join_group(store, rank=rank, world_size=world,
                                  deadline=time.monotonic() + 20)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in reversed(range(world))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert all(group is not None for group in groups)
    return [group for group in groups if group is not None]


@pytest.mark.pure
def test_each_worker_group_gets_a_name_of_its_own_that_stale_keys_cannot_fool() -> None:
    store = dist.HashStore()
    first = _join_all(store, 4)
    assert len({group.name for group in first}) == 1
    assert [(group.restarts, group.resizes) for group in first] == [(0, 0)] * 4
    # the previous group's nonces and answers stay in the store, as under a torchrun agent
    assert store.check([f"{PREFIX}/answer/3", f"{PREFIX}/nonce/3"])
    second = _join_all(store, 4)
    assert len({group.name for group in second}) == 1 and second[0].name != first[0].name
    assert [(group.restarts, group.resizes) for group in second] == [(1, 0)] * 4
    third = _join_all(store, 2)
    assert len({group.name for group in third} | {first[0].name, second[0].name}) == 3
    assert [(group.restarts, group.resizes) for group in third] == [(2, 1)] * 2
    # each group's own keys live under its name
    third[0].store.set("k", "v")
    assert not second[0].store.check(["k"]) and third[1].store.get("k") == b"v"


@pytest.mark.pure
def test_a_missing_rank_is_named_when_the_group_does_not_form() -> None:
    store = dist.HashStore()
    follower = threading.Thread(target=join_group, args=(store,), kwargs={
        "rank": 1, "world_size": 3, "deadline": time.monotonic() + 6}, daemon=True)
    follower.start()  # rank 1 joins (rank 0 answers it); rank 2 never comes
    with pytest.raises(WorkerFailure, match=r"^worker rank 2 of 3 did not join this worker "
                                            r"group in time \(--timeout\)"):
        join_group(store, rank=0, world_size=3, deadline=time.monotonic() + 3)
    follower.join(10)
    assert not follower.is_alive()


@pytest.mark.pure
def test_a_checkpoint_of_the_same_job_counts_one_restart_and_a_resize_more(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    for name in ("TANDEM_ATTEMPT", "TORCHELASTIC_RESTART_COUNT", "TANDEM_GROUP_RESTARTS",
                 "TANDEM_LAUNCHED"):
        monkeypatch.delenv(name, raising=False)
    saved = {"job": "job", "world_size": 4, "restarts": 1, "resizes": 0, "step": 30}
    same = Membership(2, rank=1)
    same.load_state_dict(saved)
    assert same.summary() == {"restarts": 2, "resizes": 1}
    unchanged = Membership(4, rank=1)
    unchanged.load_state_dict(saved)
    assert unchanged.summary() == {"restarts": 2, "resizes": 0}
    other = Membership(2, rank=1)
    other.load_state_dict({**saved, "job": "another"})  # a new job resuming: no restart
    assert other.summary() == {"restarts": 0, "resizes": 0}
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default: every job's
    unnamed = Membership(2, rank=1)
    unnamed.load_state_dict({**saved, "job": "none"})
    assert unnamed.summary() == {"restarts": 0, "resizes": 0}
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TANDEM_GROUP_RESTARTS", "3")  # the agents' store counted more
    counted = Membership(2, rank=1, resizes=2)
    counted.load_state_dict(saved)
    assert counted.summary() == {"restarts": 3, "resizes": 2}


SHARDS = [10, 7, 13, 9, 11, 4]


@pytest.mark.pure
@pytest.mark.parametrize("batch", [4, 6, 9])
@pytest.mark.parametrize(("counts"), [(4, 2), (2, 4), (1, 3), (4, 2, 4), (3, 1, 2)])
def test_shards_resized_mid_epoch_give_every_sample_once_per_epoch(
        batch: int, counts: tuple[int, ...]) -> None:
    """Resized after 2, then 3 more steps: the steps before each resize read what they read,
    and each epoch reads every sample once."""
    total = sum(SHARDS)
    sampler = ShardBatchSampler(SHARDS, global_batch_size=batch, seed=1, partitions=counts[0],
                                shuffle_buffer=4)
    stop = 0
    for index, count in enumerate(counts[1:]):
        stop += 2 + 3 * index
        where = sampler.position(stop)
        resized = ShardBatchSampler(SHARDS, global_batch_size=batch, seed=1, partitions=count,
                                    shuffle_buffer=4)
        resized.resize(where["epoch"], where["samples_into_epoch"],
                       sampler.epoch_cuts(where["epoch"]))
        for step in sampler.epoch_steps(where["epoch"]):
            if step < stop:
                assert (resized.global_indices(step).tolist()
                        == sampler.global_indices(step).tolist())
        sampler = resized
    for epoch in range(3):
        order = sampler.epoch_order(epoch).numpy()
        assert np.array_equal(np.sort(order), np.arange(total)), (epoch, order)
        for step in sampler.epoch_steps(epoch):
            shares = [sampler.local_indices(step, rank=rank, world_size=counts[-1])
                      for rank in range(counts[-1])]
            assert sum(len(share) for share in shares) == len(sampler.global_indices(step))
