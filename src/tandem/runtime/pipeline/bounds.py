"""Stage bounds of an automatically split model, chosen by the partitioner from a quick profile
of its blocks measured in the launching process before the workers start.

Usage::

    plan = profiled_plan(plan, blocks, data.train, batch_size=64, threads=1)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from tandem.plan import Plan, Stage
from tandem.planning.search.balance import pipeline_bounds
from tandem.runtime.profiler import profile_model

PROFILE_WARMUP = 1
"""Untimed runs per block before the timed ones."""
PROFILE_REPEATS = 3
"""Timed runs per block (their median counts): a few milliseconds for a small model."""


def profiled_plan(plan: Plan, blocks: nn.Sequential, samples: Any, *, batch_size: int,
                  threads: int) -> Plan:
    """``plan`` with its stages cut where the partitioner balances the blocks' forward and
    backward time at the run's micro-batch size, on as many threads as a worker has (more
    threads than idle cores make the timings noise); the replica counts stay."""
    size = max(1, batch_size // (plan.num_microbatches or 1))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        profile = profile_model(blocks, _first(samples, size), warmup=PROFILE_WARMUP,
                                repeats=PROFILE_REPEATS)
    finally:
        torch.set_num_threads(previous)
    replicas = [stage.replicas for stage in plan.stages]
    bounds = pipeline_bounds(profile, replicas)
    stages = [Stage(start=start, end=end, replicas=count,
                    compute_s=sum(layer.compute_s for layer in profile.layers[start:end]))
              for (start, end), count in zip(bounds, replicas)]
    return dataclasses.replace(plan, stages=stages)


def _first(samples: Any, size: int) -> Any:
    """The inputs of the first ``size`` samples (all of them if there are fewer)."""
    size = min(size, len(samples))
    if hasattr(samples, "rows"):
        return samples.rows(0, size).inputs
    return samples.inputs[:size]
