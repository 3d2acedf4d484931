"""Under torchrun, run each process as the plan's device on its node: a node is one of the
plan's servers, and a stage's replicas run on the devices the plan gave them.

torchrun numbers its workers node by node (``RANK = node * LOCAL_WORLD_SIZE + LOCAL_RANK``),
and the plan numbers its devices server by server, so torchrun's rank ``r`` is the plan's device
``r``. A plan whose stages name their devices (an interleaved placement, such as a stage on
devices 2 and 3 before one on 0 and 1) needs the processes renumbered: tandem's worker ``w``
(the schedule's ``w``-th replica, stage by stage) is the process on device ``devices[w]``, so
:func:`place_ranks` sets ``RANK`` to the worker this process runs before the process group is
formed (its ``torchrun`` rank is kept in ``TANDEM_TORCHRUN_RANK``). The groups then follow the
plan's levels: a stage the plan keeps inside a server has its replicas' group on one node.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tandem.errors import UsageError
from tandem.plan import Plan
from tandem.runtime.launcher_env import under_launcher

TORCHRUN_RANK = "TANDEM_TORCHRUN_RANK"
"""The rank torchrun gave this process, where :func:`place_ranks` renumbered it."""


@dataclass(frozen=True)
class Placement:
    """Where a pipeline's stages run: for each stage, its processes' torchrun ranks."""

    per_node: int
    """Processes per node (torchrun's ``--nproc-per-node``)."""
    stages: tuple[tuple[int, ...], ...]
    """Per stage, the torchrun ranks (the plan's devices) of its processes."""

    def node(self, rank: int) -> int:
        return rank // self.per_node

    def summary(self) -> list[dict[str, object]]:
        """The summary's ``placement``: each stage's ranks and the nodes they are on."""
        return [{"stage": index, "ranks": list(ranks),
                 "nodes": sorted({self.node(rank) for rank in ranks})}
                for index, ranks in enumerate(self.stages)]

    def text(self) -> str:
        """One line: where each stage runs."""
        parts = []
        for index, ranks in enumerate(self.stages):
            nodes = sorted({self.node(rank) for rank in ranks})
            where = f"node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))}"
            parts.append(f"stage {index} on {where} (torchrun ranks "
                         f"{', '.join(map(str, ranks))})")
        return "; ".join(parts)


def place_ranks(plan: Plan) -> Placement | None:
    """Under torchrun: check that the job's nodes are the plan's servers, renumber this
    process as the plan's placement asks (see the module's docstring) and return where each
    stage runs (None for a plan without stages to place, and outside torchrun)."""
    if not under_launcher() or TORCHRUN_RANK in os.environ:  # placed once per process
        return None
    world = int(os.environ["WORLD_SIZE"])
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    _check_servers(plan, world, per_node)
    if not plan.pipelined:
        return None
    degree = plan.tensor_degree
    first = [device for stage in plan.stages for device in (stage.devices or [])]
    if not first:  # consecutive: worker w on device w
        first = [worker * degree for worker in range(sum(plan.replicas))]
    devices = [start + part for start in first for part in range(degree)]
    if sorted(devices) != list(range(world - plan.num_servers)):
        raise UsageError(f"the plan places its workers on devices {sorted(devices)}, but this "
                         f"job has ranks 0-{world - 1}; start it with torchrun on "
                         f"{len(devices)} processes in all, or plan for this job's devices")
    rank = int(os.environ["RANK"])
    os.environ[TORCHRUN_RANK] = str(rank)
    os.environ["RANK"] = str(devices.index(rank))
    stages, position = [], 0
    for count in plan.replicas:
        stages.append(tuple(devices[position:position + count * degree]))
        position += count * degree
    return Placement(per_node=per_node, stages=tuple(stages))


def _check_servers(plan: Plan, world: int, per_node: int) -> None:
    """A plan made for servers of ``d`` devices runs on nodes of ``d`` processes."""
    size = plan.devices_per_server
    if size is None or per_node == size:
        return
    servers = -(-plan.num_devices // size)
    raise UsageError(
        f"the plan is for {servers} servers of {size} devices, but this job runs "
        f"{max(1, world // per_node)} node(s) of {per_node} processes; start it with torchrun "
        f"--nnodes {servers} --nproc-per-node {size}, or plan for this job's nodes "
        f"(tandem plan --cluster {per_node}x...,{max(1, world // per_node)}x...)")
