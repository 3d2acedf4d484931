"""The end of a parameter-server run on server 0: ``final.pt``, ``config.json``, ``plan.json``,
the merged ``trace.json`` with its ``gantt.png``, and the run's summary."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.runtime.checkpoint import save_atomic
from tandem.runtime.learning_rate import scaled_lr
from tandem.runtime.outputs import (
    merge_worker_traces, plan_summary, write_run_files, write_timeline,
)
from tandem.strategy import strategy_of

if TYPE_CHECKING:
    from tandem.runtime.ps.server import ParameterServer

NO_NOISE_SCALE = ("the gradient noise scale is measured in data parallelism only (--strategy dp, "
                  "from each worker's gradient and their allreduced mean); servers take each "
                  "worker's push on its own")


def finish(server: ParameterServer, evaluation: dict[str, float | None]) -> dict[str, Any]:
    """Write server 0's outputs (with ``--out``) and return the run's summary."""
    stats, config, job = server.stats, server.config, server.job
    steps = server.version // server.pace.per_step
    wall = time.perf_counter() - stats.started
    finished = server.version >= config.steps * server.pace.per_step
    if server.out:
        if finished:
            state = {n: t.detach().cpu() for n, t in server.shard.model.state_dict().items()}
            save_atomic(state, server.out / "final.pt")
        write_run_files(job, server.out)
        write_trace(server, server.out)
    updates = server.updates()
    return {
        **plan_summary(job.plan), **server.mode_summary(), "model": config.model,
        "data": config.data, "world_size": server.env.world_size,
        "servers": server.sync.num_servers, "workers": len(server.workers), "steps": steps,
        "updates": updates, "finished": finished,
        "global_batch_size": server.pace.batch_at(max(steps - 1, 0)),
        "batch_schedule": config.batch_schedule, "lr": scaled_lr(config),
        "final_loss": stats.last_loss, **server.task.summary_fields(),
        "precision": config.precision, "clip_grad_norm": config.clip_grad_norm,
        "skipped_steps": stats.skipped_steps, **evaluation,
        "samples_per_s": stats.samples_per_s(wall), "updates_per_s": updates / max(wall, 1e-9),
        "step_time_s": wall / max(steps, 1), "train_s": round(wall, 4),
        "dropped_pushes": stats.dropped,
        "dead_workers": sorted(server.liveness.dead),
        "pushes": {str(w): stats.pushes[w] for w in server.workers},
        **stats.traffic_summary(steps), "out": str(server.out) if server.out else None,
        **server.components.summary(),
    }


def write_trace(server: ParameterServer, out: Path) -> None:
    """``trace.json`` and ``gantt.png``: every process's actions (workers' ``0F``, ``0B``,
    ``0PU``, ``0PL``; servers' ``0ST`` updates), from the files they saved."""
    others = list(range(1, server.env.world_size))
    timeline = merge_worker_traces(out, others, server.stats.clock_start, server.stats.events)
    write_timeline(out, timeline, name_steps=False,
                   title=f"{strategy_of(server.job.plan)} {server.sync.mode}, "
                         f"{server.config.model.partition(':')[0]}, "
                         f"{server.env.world_size} processes")
