"""The gloo process group that carries CPU tensors and receives from any source, beside a
default group that may be NCCL (which moves only GPU tensors, each receive from a known rank).

Parameter servers and AD-PSGD exchange small control messages whose sender is not known in
advance, and stage their payloads through the CPU; under gloo they use the default group (or a
group of their own), under NCCL a gloo group over every rank made here.

Usage (every rank calls it at the same point, as for any new group)::

    group = cpu_group(timeout_s=300)
    work = dist.irecv(header, src=None, group=group)
    sender = source_rank(work, group)
"""

from __future__ import annotations

import datetime

import torch.distributed as dist


def cpu_group(*, timeout_s: float, own: bool = False) -> dist.ProcessGroup | None:
    """A gloo group over every rank whose waits give up after ``timeout_s``: the default group
    (None) when it is gloo itself, unless ``own`` asks for a separate one (for a background
    thread whose messages must not interleave with the main thread's collectives)."""
    if dist.get_backend() == "gloo" and not own:
        return None
    group: dist.ProcessGroup = dist.new_group(backend="gloo",
                                              timeout=datetime.timedelta(seconds=timeout_s))
    return group


def source_rank(work: dist.Work, group: dist.ProcessGroup | None) -> int:
    """The global rank that sent what a completed receive from any source (``src=None``) got."""
    rank = work._source_rank()
    return rank if group is None else dist.get_global_rank(group, rank)
