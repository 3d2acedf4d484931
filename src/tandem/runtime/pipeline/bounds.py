"""Stage bounds of an automatically split model, chosen by the partitioner from a quick profile
of its blocks measured in the launching process before the workers start.

Usage::

    plan = profiled_plan(plan, blocks, data.train, batch_size=64, threads=1)

The profile is measured anew by every run, so that a run's split can differ from the last
one's on a busy machine (the profiler's rounds and shared figures for identical blocks make
that rare, see :mod:`tandem.runtime.profiler`); the run's ``OUT/plan.json`` records the split,
and ``tandem train --plan OUT/plan.json`` runs that split again without profiling.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from torch import nn

from tandem.plan import Plan, Stage
from tandem.planning.search.balance import pipeline_bounds
from tandem.runtime.profiler import profile_model

PROFILE_WARMUP = 1
"""Untimed runs per block before the timed ones."""
PROFILE_REPEATS = 21
"""Timed rounds of every block (the least of the medians of seven groups of three counts, see
:func:`tandem.runtime.profiler.robust_s`): tens of milliseconds for a small model. Only the
micro-batch size is timed (the split needs no fixed costs), so this costs less than the 9
rounds at four batch sizes of ``tandem profile``."""

LOG = logging.getLogger(__name__)


def profiled_plan(plan: Plan, blocks: nn.Sequential, samples: Any, *, batch_size: int,
                  threads: int) -> Plan:
    """``plan`` with its stages cut where the partitioner balances the blocks' forward and
    backward time at the run's micro-batch size, on as many threads as a worker has (more
    threads than idle cores make the timings noise); the replica counts stay."""
    size = max(1, batch_size // (plan.num_microbatches or 1))
    profile = profile_model(blocks, _first(samples, size), warmup=PROFILE_WARMUP,
                            repeats=PROFILE_REPEATS, threads=threads, fit_fixed=False)
    replicas = [stage.replicas for stage in plan.stages]
    bounds = pipeline_bounds(profile, replicas)
    stages = [Stage(start=start, end=end, replicas=count,
                    compute_s=sum(layer.compute_s for layer in profile.layers[start:end]))
              for (start, end), count in zip(bounds, replicas)]
    LOG.info("split the model's %d blocks into stages %s by a profile measured now; to keep "
             "this split, train again with --plan OUT/plan.json (written by a run with --out OUT)",
             len(blocks), " | ".join(f"{start}-{end - 1}" for start, end in bounds))
    return dataclasses.replace(plan, stages=stages)


def _first(samples: Any, size: int) -> Any:
    """The inputs of the first ``size`` samples (all of them if there are fewer)."""
    size = min(size, len(samples))
    if hasattr(samples, "rows"):
        return samples.rows(0, size).inputs
    return samples.inputs[:size]
