"""Check a job, claim its output directory and launch its workers: what ``tandem train`` and
:func:`tandem.fit` share.

The checks that need neither torch nor the model (:func:`check_flags`) come first, so that the
command line answers a usage error before it imports torch; the modules that need torch are
imported inside the functions that use them (each import marked)."""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from pathlib import Path
from collections.abc import Mapping
from typing import Any

from tandem.errors import UsageError
from tandem.runtime.config import RunConfig, resolve_batch_size
from tandem.runtime.job import Job, sketch_job, stale_updates
from tandem.plan import Plan
from tandem.runtime.faults import check_fault
from tandem.runtime.launcher_env import under_launcher, world_size
from tandem.runtime.learning import warn_learning
from tandem.runtime.placement import place_ranks
from tandem.spec.codec import check_codec
from tandem.spec.data import check_data_spec
from tandem.spec.kinds import CompensationMode
from tandem.spec.model import check_model_spec
from tandem.spec.sync import GossipSync
from tandem.strategy import STRATEGIES, plan_from_flags, strategy_of


def start_forkserver() -> None:
    """Start the forkserver that local workers fork from (:mod:`tandem.runtime.zygote`) once the
    flags are checked, so that its imports of torch and tandem's runtime overlap this process's
    own from here on; not under torchrun, which starts the workers itself."""
    if not under_launcher():
        from tandem.runtime import zygote  # delays torch (and multiprocessing: not for --help)

        zygote.start()


def check_flags(job: Job, *, batches: bool = True) -> None:
    """The checks of :func:`check_job` that need neither torch nor the model, which ``tandem
    train`` runs before it imports torch: on the job read with ``--plan``, or on the one its
    flags sketch before the model decides the stages (:func:`~tandem.runtime.job.sketch_job`).
    Without ``batches``, the job's size and batch are left to the real job's check."""
    run, plan = job.run, job.plan
    if run.max_restarts and under_launcher():
        raise UsageError(f"--max-restarts {run.max_restarts} restarts tandem's own workers; under "
                         f"torchrun give it to torchrun (torchrun --max-restarts "
                         f"{run.max_restarts} ... -m tandem train ... --resume auto)")
    check_fault(world_size() if under_launcher() else run.nproc, run.steps, run.stop_after)
    if run.split_points is not None and not plan.pipelined:
        raise UsageError(f"--split-points cuts a model into pipeline blocks; it needs --strategy "
                         f"pipeline (this run is {strategy_of(plan)})")
    if job.objects is None or job.objects.train is None:
        check_data_spec(run.data)
    if job.objects is None or job.objects.model is None:
        check_model_spec(run.model)
    if plan.compress is not None:
        check_codec(plan.compress, strategy=strategy_of(plan),
                    sgd_momentum=run.momentum if run.optimizer in ("sgd", "lars") else 0.0)
    if not under_launcher():
        if batches:
            job.check_world(run.nproc)
        if isinstance(plan.sync, GossipSync):
            from tandem.topology import build_topology, mixing_matrix, two_colouring

            graph = build_topology(plan.sync.topology, run.nproc)
            mixing_matrix(graph, plan.sync.weights)
            if plan.sync.asynchronous:
                two_colouring(graph)


def model_shares(plan: Plan) -> int:
    """Into how many pieces a worker's model is cut, which its workers build one at a time
    (sharded levels 2 and 3, tensor parallelism; 1 in a pipeline, whose stages hold whole
    blocks)."""
    if plan.pipelined:
        return 1
    return plan.tensor_degree * (plan.shard_degree if plan.sharded and plan.shard_level > 1
                                 else 1)


def check_job(job: Job) -> None:
    """Catch the user's mistakes before any worker starts (one :class:`UsageError`); warn once
    if the local workers will share this machine's cores (:mod:`tandem.runtime.preflight`)."""
    from tandem.runtime import preflight  # delays torch

    run, plan = job.run, job.plan
    check_flags(job)
    shares = model_shares(plan)
    data, model = preflight.build_checked(run, job.objects, shares=shares, meta=shares > 1,
                                          data=job.prepared)
    preflight.check_data(run, data, job.objects)
    from tandem.runtime.learning_rate import check_run_optimizer  # delays torch

    check_run_optimizer(run, job.objects, model, stale=stale_updates(plan) and CompensationMode(
        run.async_compensation).compensates)
    if plan.tensor_degree > 1:
        from tandem.models.tensor import tensor_plan  # delays torch

        tensor_plan(run.model if job.objects is None or job.objects.model is None else None,
                    model, plan.tensor_degree, plan.tensor_layers)
    if plan.sync_batchnorm:
        from tandem.sync.sync_batchnorm import check_batchnorms  # delays torch

        check_batchnorms(model)
    if plan.sharded and plan.shard_level > 1:
        from tandem.sync.sharded import check_offload, check_units  # delays torch

        check_units(model, plan.shard_units)
        check_offload(run.offload, run.backend)
    preflight.check_batch(run, data)
    preflight.check_output(model, data, run, job.objects)
    note = None
    if not under_launcher():
        if plan.pipelined:
            from tandem.runtime.pipeline.setup import (  # delays torch
                batches_vary, example_inputs, pipeline_blocks, pipeline_setup,
            )

            pipeline_setup(job, pipeline_blocks(model, example_inputs(data.train),
                                                what=f"model {run.model!r}",
                                                split_points=run.split_points,
                                                vary=batches_vary(data.train)))
        note = preflight.check_machine(run, model, shares)
    if run.out is not None:
        _check_writable(Path(run.out))
    if run.resume is not None:
        from tandem.runtime.checkpoint import check_resume  # delays torch

        check_resume(job)
    if note is not None:
        preflight.warn(note)


def _check_writable(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise UsageError(
            f"--out {out} is not a writable directory ({exc.strerror}); choose one you can write"
        ) from None


def run_training(job: Job, *, announce: str | None = None) -> dict[str, Any] | None:
    """Check, claim ``--out`` (:func:`~tandem.runtime.out_dir.claim_out`), launch and return
    rank 0's summary (None on the other ranks of a torchrun job), after warning once if its loss
    diverged or stalled (:func:`~tandem.runtime.learning.warn_learning`); ``announce`` is a line
    for stderr once the job is checked (where its outputs go, when the user named no ``--out``).
    """
    from tandem.runtime.launch import launch  # delays torch
    from tandem.runtime.out_dir import claim_out  # delays torch
    from tandem.runtime.worker import train_worker  # delays torch

    placement = place_ranks(job.plan)  # before anything reads RANK
    check_job(job)
    if placement is not None and os.environ.get("RANK") == "0":
        print(f"tandem train: {placement.text()}", file=sys.stderr)
    if announce is not None:
        print(announce, file=sys.stderr)
    if job.prepared is not None:  # the workers build their own
        job = dataclasses.replace(job, prepared=None)
    with claim_out(job.run):
        summary = launch(train_worker, job, nproc=job.run.nproc, threads=job.run.threads,
                         max_restarts=job.run.max_restarts)
    if summary is not None:
        if placement is not None:
            summary["placement"] = placement.summary()
        warn_learning(summary, job.run)
    return summary


def make_job(strategy: str = "dp", flags: Mapping[str, Any] | None = None, *,
             objects: Any = None, **settings: Any) -> Job:
    """The job ``tandem train --strategy STRATEGY FLAGS... SETTINGS...`` runs, for library use:
    ``flags`` are the plan's command-line flags (``{"--servers": 2, "--mode": "async"}``),
    ``settings`` the fields of :class:`RunConfig` (``nproc`` is the number of processes) and
    ``objects`` the user's own model, data and loss (:class:`tandem.runtime.task.UserObjects`).
    The flags are checked (:func:`sketch_job`) before torch is imported and the model built."""
    run = RunConfig(**resolve_batch_size(settings))
    sketch = sketch_job(strategy, flags or {}, run, objects)
    from torch import nn  # delays torch

    from tandem.runtime.preflight import build_checked  # delays torch

    pipelined = strategy in STRATEGIES and STRATEGIES[strategy].pipelined
    # check_job builds it again; a sharded or split model is checked against a worker's share
    data, model = build_checked(run, objects, shares=model_shares(sketch.plan),
                                meta=not pipelined)
    if isinstance(model, nn.Sequential) or not pipelined:
        blocks = len(model) if isinstance(model, nn.Sequential) else None
        plan = plan_from_flags(strategy, flags or {}, num_processes=run.nproc, num_blocks=blocks)
        return Job(run=run, plan=plan, objects=objects, prepared=data)
    from tandem.runtime.pipeline.bounds import profiled_plan  # delays torch
    from tandem.runtime.pipeline.setup import (  # delays torch
        batches_vary, example_inputs, pipeline_blocks,
    )

    split = pipeline_blocks(model, example_inputs(data.train), what=f"model {run.model!r}",
                            split_points=run.split_points, vary=batches_vary(data.train))
    plan = plan_from_flags(strategy, flags or {}, num_processes=run.nproc, num_blocks=len(split))
    # the user's split points are their stages' blocks; under torchrun every process would
    # measure its own profile and could cut elsewhere, so the stages stay even there
    if run.split_points is None and not under_launcher():
        plan = profiled_plan(plan, split, data.train, batch_size=run.batch_size,
                             threads=run.threads)
    return Job(run=run, plan=plan, objects=objects, prepared=data)
