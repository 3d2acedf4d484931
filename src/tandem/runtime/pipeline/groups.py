"""The process groups of a pipeline: a link per direction between two workers, and the
workers of stages that share parameters (tied weights)."""

from __future__ import annotations

from torch import nn
import torch.distributed as dist

from tandem.runtime.dist import new_group
from tandem.runtime.pipeline.layout import PipelineLayout
from tandem.runtime.pipeline.setup import shared_parameters
from tandem.runtime.pipeline.update import Tie
from tandem.schedule import Schedule


def point_to_point_links(schedule: Schedule, *, rank: int, tensor_degree: int,
                         timeout_s: float) -> dict[tuple[int, int], dist.ProcessGroup]:
    """A two-process group for each direction of point-to-point traffic between schedule
    workers (one per tensor position), keyed by ``(source, destination)`` worker; every rank
    creates every group and keeps those it is in."""
    pairs = sorted({(worker, action.peer) for worker, actions in enumerate(schedule.workers)
                    for action in actions if action.kind.is_send and action.peer is not None})
    links = {}
    for source, destination in pairs:
        for part in range(tensor_degree):  # the processes at each tensor position
            ranks = (source * tensor_degree + part, destination * tensor_degree + part)
            group = new_group(sorted(ranks), timeout_s=timeout_s)
            if rank in ranks:
                links[(source, destination)] = group
    return links


def tied_groups(blocks: nn.Sequential, layout: PipelineLayout, schedule: Schedule, *,
                stage: int, worker: int, tensor_degree: int, timeout_s: float,
                sharded: bool = False, tensor_rank: int = 0) -> list[Tie]:
    """A process group of the workers of each set of stages that share parameters (every
    rank creates every group), and ``stage``'s share of them (``worker``'s groups). Sharded
    stages have a group per replica: the tied stages' workers at that replica, which hold the
    same shard of the tied tensors, each its whole batch's gradient after its stage's
    reduce-scatter. With tensor parallelism each group is one per tensor position (this
    process's at ``tensor_rank``): a tied parameter is never split (a tensor plan refuses
    one), so every position holds it whole, with the same gradient."""
    ties = []
    shared = shared_parameters(blocks, layout.bounds)
    for stages, params in shared.items():
        rows = ([[schedule.worker_of(s, replica) for s in stages]
                 for replica in range(layout.replicas[stages[0]])] if sharded else
                [[schedule.worker_of(s, replica) for s in stages
                  for replica in range(layout.replicas[s])]])
        for workers in rows:
            for part in range(tensor_degree):
                ranks = sorted(w * tensor_degree + part for w in workers)
                group = new_group(ranks, timeout_s=timeout_s)
                if worker in workers and part == tensor_rank:
                    scale = 1.0 if sharded else 1.0 / layout.replicas[stage]
                    ties.append(Tie(group=group, stages=stages, params=params,
                                    num_workers=len(ranks), scale=scale))
    return ties
