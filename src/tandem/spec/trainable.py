"""What ``tandem train --plan`` accepts of a plan, and how a plan's updates differ from one
update of the whole minibatch per step, answered without torch for the planners (``search``,
``scale``) that must write and count only plans that run as written.

Usage::

    layout_refusal(plan)                     # None, or why train refuses the layout
    batch_refusal(plan, batch_samples=128)   # None, or why the batch does not split
    update_change(plan)                      # None, or how the plan's updates differ
    staleness(plan)                          # updates by which its gradients are stale

:func:`layout_refusal` and :func:`batch_refusal` state the rules that
:class:`tandem.runtime.job.Job` applies to the plan alone (its tensor-parallel layouts, its
recomputation, and :meth:`~tandem.runtime.job.Job.check_world`'s micro-batches that must divide
the batch); ``tests/test_plans_run.py`` checks that every plan they pass is accepted by the
runtime's own checks. What a plan needs of the model (as many blocks as the plan has layers, no
weights shared between asynchronous stages) is for ``tandem train`` to say.
"""

from __future__ import annotations

from tandem.plan import Plan
from tandem.spec.sync import AllReduceSync, ParameterServerSync


def layout_refusal(plan: Plan) -> str | None:
    """Why ``tandem train`` refuses ``plan``'s layout, or None when it runs it: recomputation
    needs two stages or more; tensor parallelism runs with allreduce's data parallelism or in a
    pipeline under a flush schedule with the same replicas on every stage."""
    degree = plan.tensor_degree
    if plan.recompute and len(plan.stages) < 2:
        return "recompute needs 2 or more stages (one stage would checkpoint the whole model)"
    if degree == 1:
        return None
    if plan.pipelined:
        if not plan.schedule.flushes:
            return (f"tensor degree {degree} with the {plan.schedule} schedule: pipeline x "
                    f"tensor layouts run flush schedules (1f1b, gpipe) only")
        if len(set(plan.replicas)) > 1:
            return (f"replicas {plan.config} with tensor degree {degree}: a data x pipeline x "
                    f"tensor mesh needs the same replicas on every stage")
    elif not isinstance(plan.sync, AllReduceSync):
        return (f"tensor degree {degree} with sync {plan.sync.method!r}: tensor parallelism "
                f"runs with allreduce's data parallelism or a pipeline only")
    return None


def batch_refusal(plan: Plan, batch_samples: int | None) -> str | None:
    """Why ``plan`` cannot split a global minibatch of ``batch_samples`` (None when it can, or
    when the batch is not known): its micro-batches (a data-parallel plan's: a whole number per
    worker) must divide it."""
    if batch_samples is None:
        return None
    parts = plan.num_microbatches or 1
    if batch_samples % parts == 0:
        return None
    if plan.pipelined:
        return f"its {parts} micro-batches do not divide the batch of {batch_samples} samples"
    workers = plan.stages[0].replicas
    share = "" if parts == workers else f" in {parts // workers} micro-batches each"
    return f"the batch of {batch_samples} samples does not split among {workers} workers{share}"


def update_change(plan: Plan) -> str | None:
    """How ``plan``'s weight updates differ from one update of the whole global minibatch per
    step, or None when they do not (stale weights, as in a straight PipeDream pipeline, do not
    count: the number and size of updates are the same).

    PipeDream's replicas of a stage take whole minibatches in turn and average their gradients
    once per round, so a stage on ``r`` replicas makes one update of ``r`` minibatches every
    ``r`` steps; an asynchronous parameter server applies each of ``W`` workers' pushes, an
    update of ``1/W`` of the minibatch, on arrival."""
    if plan.pipelined and plan.schedule.asynchronous and max(plan.replicas) > 1:
        changes = [f"stage {index} makes 1/{r} as many updates, each of {r} minibatches"
                   for index, r in enumerate(plan.replicas) if r > 1]
        return (f"a different training run: under {plan.schedule} the replicas of a stage take "
                f"whole minibatches in turn and average them per update, so "
                f"{'; '.join(changes)}")
    sync = plan.sync
    if isinstance(sync, ParameterServerSync) and sync.asynchronous:
        workers = plan.stages[0].replicas
        return (f"a different training run: {sync.mode} parameter servers apply each of the "
                f"{workers} workers' pushes on arrival, {workers} updates of 1/{workers} of the "
                f"minibatch per step")
    return None


def staleness(plan: Plan) -> int:
    """Updates by which ``plan``'s gradients are stale: ``W - 1`` for ``W`` asynchronous (or
    SSP) parameter-server workers, ``S - 1`` for a PipeDream pipeline of ``S`` stages, else 0."""
    if plan.pipelined:
        return len(plan.stages) - 1 if plan.schedule.asynchronous else 0
    sync = plan.sync
    if isinstance(sync, ParameterServerSync) and sync.asynchronous:
        return plan.stages[0].replicas - 1
    return 0
