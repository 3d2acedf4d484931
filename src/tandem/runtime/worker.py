"""The process entry of a training worker: start it, supervise it, and pick its implementation.

Every worker runs :func:`train_worker` with the same :class:`~tandem.runtime.job.Job`; the
registry :data:`WORKERS` picks its implementation from the type of the plan's sync spec (a
pipelined plan runs the pipeline trainer, a one-stage plan of tensor degree above 1 the tensor
trainer). Rank 0 returns the run's summary and writes the outputs.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import time
from typing import Any, Callable

import torch.distributed as dist

from tandem.errors import Diverged, UsageError, WorkerFailure
from tandem.runtime.base import Worker
from tandem.runtime.job import Job
from tandem.runtime.dist import WorkerEnv, init_worker
from tandem.runtime.faults import attempt
from tandem.runtime.launch import die_with_parent, end_diverged, prepare_worker
from tandem.runtime.trainer import ElasticWorker, ParameterServerWorker, Trainer
from tandem.runtime.watchdog import (
    FENCED_EXIT,
    PERIOD_S,
    SILENT_AFTER_S,
    Heartbeat,
    continue_if_stopped,
    is_communication_error,
)
from tandem.runtime.zygote import child_context
from tandem.spec.sync import (
    AllReduceSync,
    ElasticAveragingSync,
    GossipSync,
    LocalSGDSync,
    ParameterServerSync,
)

SUPERVISED = "TANDEM_SUPERVISED"

logger = logging.getLogger(__name__)


def train_worker(job: Job, *, mirror: Any = None) -> dict[str, Any] | None:
    """Run the whole training job as this worker; rank 0 returns the summary.

    ``mirror`` is set in a supervised worker (see :func:`_supervise`): a shared value its
    heartbeat writes, for the supervisor to see it freeze.
    """
    prepare_worker()
    if _fault_tolerant_worker(job):
        _supervise(job)
        return None
    config = job.run
    start = time.perf_counter()
    env = init_worker(backend=config.backend, timeout_s=config.timeout_s, threads=config.threads)
    store = dist.distributed_c10d._get_default_store()
    diverged = False
    try:
        job.check_world(env.world_size)
        with Heartbeat(store, env.rank, env.world_size, fenceable=SUPERVISED in os.environ,
                       mirror=mirror) as beat:
            try:
                summary = make_worker(job, env, beat).run()
            except RuntimeError as exc:
                if not isinstance(exc, WorkerFailure) and is_communication_error(exc):
                    raise beat.diagnose(exc) from exc
                raise
        if summary is not None:
            summary["wall_s"] = round(time.perf_counter() - start, 3)
            summary.setdefault("restarts", attempt())  # a trainer's: see runtime/membership
            summary.setdefault("resizes", env.resizes)
        return summary
    except Diverged as exc:
        # a diverged worker ends with the process group in place: a background receive (a
        # parameter server's mailbox) may be waiting in it, and tearing it down under that
        # receive aborts the process with a C++ error on stderr; the launcher stops the rest
        diverged = True
        if SUPERVISED not in os.environ:  # a supervised one tells its supervisor first
            end_diverged(exc)
        raise
    finally:
        if not diverged:
            dist.destroy_process_group()


def _fault_tolerant_worker(job: Job) -> bool:
    """Workers of asynchronous parameter-server training (``ps`` and EASGD) may die without
    stopping the job."""
    sync = job.plan.sync
    rank = int(os.environ.get("RANK", "0"))
    return (isinstance(sync, (ParameterServerSync, ElasticAveragingSync)) and sync.asynchronous
            and SUPERVISED not in os.environ and rank >= job.plan.num_servers)


def _supervise(job: Job) -> None:
    """Run this worker in a child process; if it dies, say so and let the job go on.

    The child never outlives this process (it dies with it), and ends when the servers give
    up on it: a stuck one ends itself once fenced (exit ``FENCED_EXIT``), and a frozen one, whose
    heartbeat stops, is killed here after ``SILENT_AFTER_S`` (the servers report both). A
    mistake of the user's that the child finds (``UsageError``), its divergence (``Diverged``)
    and its diagnosis of a server it waited for in vain (``WorkerFailure``) stop the job, as
    elsewhere. Should this process be stopped (SIGSTOP), the child has its servers leave it
    behind and continues this process as it ends (:mod:`tandem.runtime.watchdog`).
    """
    os.environ[SUPERVISED] = "1"
    context = child_context()  # forked before this process starts threads
    mirror = context.Value("d", 0.0, lock=False)
    mistakes, mistake = context.Pipe(duplex=False)  # no semaphores to leak, unlike a queue
    child = context.Process(target=_supervised_worker, args=(job, mirror, mistake), daemon=True)
    child.start()
    while child.exitcode is None:
        child.join(PERIOD_S)
        if mirror.value and time.time() - mirror.value > SILENT_AFTER_S + 4 * PERIOD_S:
            child.kill()
            child.join()
            return
    if mistakes.poll():  # the user's mistake (every worker makes it), divergence, or a server
        kind, message = mistakes.recv()  # that stopped responding: stop the job
        raise _ENDS_THE_JOB.get(kind, UsageError)(message)
    if child.exitcode not in (0, FENCED_EXIT):
        code = child.exitcode or 0
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        logger.warning(f"worker rank {os.environ.get('RANK')} died ({how}); asynchronous "
                       f"training goes on without it")


_ENDS_THE_JOB: dict[str, type[Exception]] = {
    "usage": UsageError, "diverged": Diverged, "failure": WorkerFailure}
"""What a supervised worker tells its supervisor, by kind, and the error it stops the job with."""


def _supervised_worker(job: Job, mirror: Any, mistake: Any) -> None:
    die_with_parent()
    # started as a daemon so that it never outlives the supervisor; it may start processes of
    # its own (the data loader's, which end with it), which daemons may not
    multiprocessing.current_process().daemon = False
    try:
        train_worker(job, mirror=mirror)
    except UsageError as exc:
        mistake.send(("usage", str(exc)))
        sys.exit(2)
    except Diverged as exc:
        mistake.send(("diverged", str(exc)))
        sys.exit(1)
    except WorkerFailure as exc:  # a server it waited for stopped responding: no traceback
        mistake.send(("failure", str(exc)))
        sys.exit(1)
    finally:
        continue_if_stopped(os.getppid())  # a stopped supervisor could not end with it


def make_worker(job: Job, env: WorkerEnv, beat: Heartbeat) -> Worker:
    """This rank's implementation of ``job``: a pipeline stage (or its share, with a tensor
    degree above 1) for a pipelined plan, a share of every split layer for a one-stage plan of
    tensor degree above 1, else the registered worker of the plan's sync spec."""
    if job.plan.pipelined:
        from tandem.runtime.pipeline.trainer import PipelineTrainer

        return PipelineTrainer(job, env, beat)
    if job.plan.tensor_degree > 1:
        from tandem.runtime.tensor_trainer import TensorParallelTrainer

        return TensorParallelTrainer(job, env, beat)
    return WORKERS[type(job.plan.sync)](job, env, beat)


def _parameter_server_role(job: Job, env: WorkerEnv, beat: Heartbeat) -> Worker:
    """Ranks below the plan's server count serve; the others compute gradients."""
    if env.rank < job.plan.num_servers:
        from tandem.runtime.ps import ParameterServer

        return ParameterServer(job, env, beat)
    return ParameterServerWorker(job, env, beat)


def _elastic_role(job: Job, env: WorkerEnv, beat: Heartbeat) -> Worker:
    """Synchronous EASGD: every rank a worker. Asynchronous: ranks below the plan's server count
    hold the center, the others train."""
    if env.rank >= job.plan.num_servers:
        return ElasticWorker(job, env, beat) if job.plan.num_servers else Trainer(job, env, beat)
    from tandem.runtime.ps import ElasticServer

    return ElasticServer(job, env, beat)


WORKERS: dict[type, Callable[[Job, WorkerEnv, Heartbeat], Worker]] = {
    AllReduceSync: Trainer, GossipSync: Trainer, ElasticAveragingSync: _elastic_role,
    LocalSGDSync: Trainer, ParameterServerSync: _parameter_server_role,
}
"""Sync-spec type -> the worker that runs a data-parallel plan with it (the strategy inside a
:class:`Trainer` comes from :data:`tandem.runtime.strategies.SYNC_STRATEGIES`)."""
