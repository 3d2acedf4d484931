"""What a run writes besides its metrics: ``config.json`` and ``plan.json``, the workers' events
gathered or merged into ``trace.json`` with its ``gantt.png``, and the summary's fields of the
plan."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tandem import strict_json
from tandem.output_files import write_text
from tandem.plan import Plan
from tandem.runtime.dist import WorkerEnv
from tandem.runtime.job import Job
from tandem.strategy import strategy_of
from tandem.timeline import Event, Timeline, plot_gantt

MAX_TRACED_STEPS = 1000
"""Steps whose actions are recorded in ``trace.json`` (bounds the trace of long runs)."""
GANTT_STEPS = 3
"""``gantt.png`` draws the last this many traced steps (the steady state, readable)."""


def plan_summary(plan: Plan) -> dict[str, Any]:
    """What every run's summary says of its plan: strategy, layout, codec, the schedule and
    micro-batches where it is a pipeline, and a shard degree with its level where it shards."""
    shard = ({"shard": plan.shard_degree, "shard_level": plan.shard_level}
             if plan.sharded else {})
    synced = {"sync_batchnorm": True} if plan.sync_batchnorm else {}
    staged = {"schedule": plan.schedule, "microbatches": plan.num_microbatches} \
        if plan.pipelined else {}  # a data-parallel plan has no pipeline schedule
    return {"strategy": strategy_of(plan), "plan": plan.config, **staged,
            "compress": plan.compress.text if plan.compress else None, **shard, **synced}


def write_run_files(job: Job, out: Path) -> None:
    """``config.json`` (the run's settings and its plan) and ``plan.json`` (the plan alone, which
    ``tandem train --plan`` and ``tandem simulate --plan`` read back)."""
    settings = {"run": dataclasses.asdict(job.run), "plan": job.plan.to_dict()}
    write_text(out / "config.json", strict_json.dumps(settings, indent=2))
    job.plan.save(str(out / "plan.json"))


WORKER_TRACE = "trace-rank{rank}.json"
"""A worker's own events, for runs whose workers meet in no collective (parameter servers)."""


def save_worker_trace(out: Path, rank: int, clock_start: float, events: list[Event]) -> None:
    """Write ``events`` (timed from ``clock_start``, a ``perf_counter`` reading) with the wall
    clock time of ``clock_start``, so that :func:`merge_worker_traces` can align them."""
    epoch_start = time.time() - (time.perf_counter() - clock_start)
    payload = {"epoch_start_s": epoch_start, "events": [dataclasses.asdict(e) for e in events]}
    write_text(out / WORKER_TRACE.format(rank=rank), strict_json.dumps(payload))


def merge_worker_traces(out: Path, ranks: list[int], clock_start: float,
                        events: list[Event]) -> Timeline:
    """``events`` of this process and those saved by the workers ``ranks``, on this process's
    clock (good to the machines' wall-clock agreement); the saved files are removed."""
    epoch_start = time.time() - (time.perf_counter() - clock_start)
    merged = list(events)
    for rank in ranks:
        path = out / WORKER_TRACE.format(rank=rank)
        if not path.exists():  # a worker that died before writing it
            continue
        saved = json.loads(path.read_text())
        shift = saved["epoch_start_s"] - epoch_start
        merged += [dataclasses.replace(Event(**event), start_s=event["start_s"] + shift,
                                       end_s=event["end_s"] + shift) for event in saved["events"]]
        path.unlink()
    return Timeline(events=merged)


def write_timeline(out: Path, timeline: Timeline, title: str, *, name_steps: bool = True) -> None:
    """``trace.json`` (every event of ``timeline``) and ``gantt.png`` (the last
    :data:`GANTT_STEPS` steps), titled ``title`` (followed by the steps drawn if
    ``name_steps``)."""
    timeline.write(out / "trace.json")
    shown = sorted({event.step for event in timeline.events if event.step >= 0})[-GANTT_STEPS:]
    steps = f", steps {shown[0]}-{shown[-1]}" if shown and name_steps else ""
    plot_gantt(timeline, out / "gantt.png", steps=set(shown) or None,
               title=f"{title}{steps} (measured)")


def gather_events(env: WorkerEnv, clock_start: float, events: list[Event]) -> list[Event] | None:
    """Every worker's ``events`` (each timed from its own ``clock_start``) on rank 0's clock,
    on rank 0 (None elsewhere); collective. Each worker reads its clock right after a common
    barrier, so the times agree to the barrier's skew, also across machines."""
    dist.barrier()
    since_start = time.perf_counter() - clock_start
    gathered: list[tuple[float, list[Event]] | None] = [None] * env.world_size
    dist.all_gather_object(gathered, (since_start, events))
    if env.rank != 0:
        return None
    return [dataclasses.replace(event, start_s=event.start_s + since_start - worker_since,
                                end_s=event.end_s + since_start - worker_since)
            for worker_since, worker_events in (part for part in gathered if part)
            for event in worker_events]
