"""Start a job as several ``torchrun`` agents on this machine, each acting as one node."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import ROOT, SOURCE_PATH



@dataclass
class Node:
    """One agent's process, its exit status and what it printed (once it ended)."""

    process: subprocess.Popen[str]
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def agent_command(node_rank: int | None, *, nnodes: str, per_node: int, port: int,
                  train: list[str], max_restarts: int = 0, rdzv_id: str = "job") -> list[str]:
    """``torchrun`` for one node: static rendezvous (``--node-rank K``) when ``node_rank`` is
    given, else the c10d rendezvous at ``127.0.0.1:port`` (``--nnodes MIN:MAX``)."""
    if node_rank is not None:
        rendezvous = ["--nnodes", nnodes, "--node-rank", str(node_rank),
                      "--master-addr", "127.0.0.1", "--master-port", str(port)]
    else:
        rendezvous = ["--nnodes", nnodes, "--rdzv-backend", "c10d", "--rdzv-id", rdzv_id,
                      "--rdzv-endpoint", f"127.0.0.1:{port}",
                      # both agents of a test join the first round, however loaded the machine
                      "--rdzv-conf", "last_call_timeout=20,join_timeout=120"]
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous,
            "--nproc-per-node", str(per_node), "--max-restarts", str(max_restarts),
            "-m", "tandem", "train", *train]


def start(command: list[str], env: dict[str, str] | None = None) -> Node:
    """Start one agent in a session of its own (so that a test can end it and its workers)."""
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": SOURCE_PATH, **(env or {})}
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        environ.pop(key, None)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=environ, cwd=ROOT, start_new_session=True)
    return Node(process)


def finish(nodes: list[Node], timeout_s: float = 300) -> list[Node]:
    """Wait for every agent; on a timeout kill every agent's session and fail."""
    deadline = time.monotonic() + timeout_s
    for node in nodes:
        try:
            node.stdout, node.stderr = node.process.communicate(
                timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in nodes:
                end_session(other)
            raise AssertionError(f"the job did not end within {timeout_s} s:\n" + "\n".join(
                f"--- agent {index} ---\n{other.stderr[-3000:]}"
                for index, other in enumerate(nodes))) from None
        node.returncode = node.process.returncode
    return nodes


def end_session(node: Node) -> None:
    """Kill an agent and every process under it (as a node that leaves the job: torchrun
    starts each worker in a session of its own, so the agent's session is not enough)."""
    for pid in [node.process.pid, *descendants(node.process.pid), *session_left(node)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    out, err = node.process.communicate()
    node.stdout, node.stderr = node.stdout + (out or ""), node.stderr + (err or "")


def _processes() -> list[tuple[int, list[str]]]:
    """Every process's id and the fields of its ``/proc/PID/stat`` after its name (state,
    parent, process group, session, ...)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found.append((int(entry.name), fields))
    return found


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...)."""
    parents: dict[int, list[int]] = {}
    for child, fields in _processes():
        parents.setdefault(int(fields[1]), []).append(child)
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def session_left(node: Node) -> list[int]:
    """Processes of ``node``'s session still alive (its agent's pid is the session's id)."""
    return [pid for pid, fields in _processes()
            if int(fields[3]) == node.process.pid and fields[0] != "Z"]  # the session, state


def run_nodes(train: list[str], *, nodes: int = 2, per_node: int | list[int] = 2,
              nnodes: str | None = None,
              static: bool = True, env: dict[str, str] | None = None,
              timeout_s: float = 240) -> list[Node]:
    """Run ``tandem train TRAIN`` as ``nodes`` agents of ``per_node`` workers each; return
    them once all ended. Each node's ``--out`` is the caller's business (``train`` may hold
    ``{node}``, replaced by the node's index)."""
    port = free_port()
    started = []
    for index in range(nodes):
        args = [arg.replace("{node}", str(index)) for arg in train]
        command = agent_command(index if static else None, nnodes=nnodes or str(nodes),
                                per_node=per_node if isinstance(per_node, int)
                                else per_node[index], port=port, train=args)
        started.append(start(command, env))
    return finish(started, timeout_s)
