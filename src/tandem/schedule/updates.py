"""When each worker of a schedule updates its weights: the rules the checker enforces.

Flush schedules (``gpipe``, ``1f1b``) step once (``ST``), after a worker's last backward;
PipeDream steps after each minibatch's backward (``ST{m}`` after ``B{m}``). The replicas of a
replicated stage average their gradients (``AR``, ``AR{m}``) between the backward and the step.
A schedule that breaks these rules may run without hanging and still train wrongly (a stage
that never steps, replicas that drift apart), so :func:`tandem.schedule.check` rejects it.
"""

from __future__ import annotations

from tandem.schedule.action import Kind
from tandem.schedule.schedule import Schedule

Site = tuple[int, int]
"""``(worker, index)`` of one action in a schedule."""

Problems = list[tuple[str, list[Site]]]
"""One line per problem, and the actions to mark in the checker's grid."""


def update_problems(schedule: Schedule, worker: int) -> Problems:
    """What is wrong with how ``worker`` updates its weights (empty when nothing).

    A worker that pushes its gradients to parameter servers (``PU``) leaves the step to them.
    """
    problems: Problems = []
    actions = schedule.workers[worker]
    if not any(action.kind is Kind.PUSH for action in actions):
        stage, _ = schedule.stage_of(worker)
        rules = _async_updates if schedule.kind.asynchronous else _flush_updates
        rules(schedule, worker, stage, problems)
    return problems


def _add(problems: Problems, message: str, *marks: Site) -> None:
    problems.append((message, list(marks)))


def _at(schedule: Schedule, site: Site) -> str:
    return f"{schedule.workers[site[0]][site[1]]} on w{site[0]}"


def _flush_updates(schedule: Schedule, worker: int, stage: int, problems: Problems) -> None:
    """One ``ST`` after the last backward; a replicated stage's ``AR`` between them."""
    actions = schedule.workers[worker]
    backwards = [i for i, action in enumerate(actions) if action.kind is Kind.BACKWARD]
    last = backwards[-1] if backwards else -1
    steps = _sites_of(schedule, worker, Kind.STEP, problems)
    if not steps:
        _add(problems, f"w{worker} never takes its optimizer step: add {stage}ST after its "
             "last backward")
    elif len(steps) > 1:
        _add(problems, f"w{worker} takes {len(steps)} optimizer steps; a {schedule.kind} "
             f"schedule steps once, after the last backward: keep one {stage}ST", *steps[1:])
    elif steps[0][1] < last:
        _add(problems, f"{_at(schedule, steps[0])} comes before the last backward "
             f"{actions[last]}: move it to the end", steps[0])
    if schedule.replicas[stage] == 1:
        return
    reduces = _sites_of(schedule, worker, Kind.ALLREDUCE, problems)
    if not reduces:
        _add(problems, f"w{worker} never averages its gradients with stage {stage}'s other "
             f"replicas: add {stage}AR between its last backward and {stage}ST")
    elif len(reduces) > 1:
        _add(problems, f"w{worker} allreduces {len(reduces)} times; a {schedule.kind} "
             f"schedule allreduces once, after the last backward: keep one {stage}AR",
             *reduces[1:])
    elif reduces[0][1] < last:
        _add(problems, f"{_at(schedule, reduces[0])} comes before the last backward "
             f"{actions[last]}: move it after it", reduces[0])
    elif steps and steps[0][1] < reduces[0][1]:
        _add(problems, f"{_at(schedule, reduces[0])} comes after the step {stage}ST, which "
             "would use this replica's gradients alone: move it before", reduces[0])


def _sites_of(schedule: Schedule, worker: int, kind: Kind, problems: Problems) -> list[Site]:
    """A flush schedule's ``AR`` or ``ST`` actions on ``worker``; those that name a
    micro-batch are reported."""
    sites = []
    for index, action in enumerate(schedule.workers[worker]):
        if action.kind is kind:
            sites.append((worker, index))
            if action.microbatch is not None:
                _add(problems, f"{action} on w{worker}: a {schedule.kind} schedule updates "
                     "once per step, after every micro-batch; write "
                     f"{action.stage}{kind.value} without a micro-batch", (worker, index))
    return sites


def _async_updates(schedule: Schedule, worker: int, stage: int, problems: Problems) -> None:
    """PipeDream: ``B{m}``, then (replicated stages) ``AR{m}``, then ``ST{m}``, once each."""
    replicated = schedule.replicas[stage] > 1
    backward: dict[int, int] = {}
    reduced: set[int] = set()
    stepped: set[int] = set()
    for index, action in enumerate(schedule.workers[worker]):
        site, m = (worker, index), action.microbatch
        if action.kind is Kind.BACKWARD and m is not None:
            backward[m] = index
        elif action.kind not in (Kind.STEP, Kind.ALLREDUCE):
            continue
        elif m is None:
            _add(problems, f"{action} on w{worker}: pipedream updates after each "
                 f"minibatch's backward; write {action}<minibatch>, e.g. {action}0", site)
        elif m not in backward:
            _add(problems, f"{action} on w{worker} comes before (or without) the backward "
                 f"{stage}B{m} on that worker", site)
        elif m in (stepped if action.kind is Kind.STEP else reduced):
            _add(problems, f"{action} on w{worker} is there twice for minibatch {m}", site)
        elif action.kind is Kind.ALLREDUCE:
            reduced.add(m)
        else:
            stepped.add(m)
            if replicated and m not in reduced:
                _add(problems, f"{action} on w{worker} steps before stage {stage}'s "
                     f"replicas average minibatch {m}'s gradients: put {stage}AR{m} between "
                     f"{stage}B{m} and it", site)
    for m, index in sorted(backward.items()):
        if m not in stepped:
            _add(problems, f"w{worker} never steps after {stage}B{m}: add {stage}ST{m} "
                 "after it", (worker, index))
