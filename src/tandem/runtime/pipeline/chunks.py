"""PipeDream's asynchronous schedule cut into per-step chunks, and what its actions imply.

Pure: reads a :class:`~tandem.schedule.Schedule`, imports no torch.
"""

from __future__ import annotations

from tandem.schedule import Action, Kind, Schedule
from tandem.schedule.check import dry_run_times


def step_chunks(schedule: Schedule, worker: int, num_steps: int) -> list[list[Action]]:
    """Cut ``worker``'s actions of an asynchronous schedule into one chunk per step.

    Chunk ``k`` ends at the dry-run time by which minibatch ``k`` is done on every stage; all
    workers cut at the same times, so every chunk boundary is a consistent cut of a valid
    execution and a collective between chunks cannot deadlock.
    """
    times = dry_run_times(schedule)
    done_at = [0] * num_steps
    for actions, action_times in zip(schedule.workers, times):
        for action, when in zip(actions, action_times):
            if action.microbatch is not None and action.microbatch < num_steps:
                done_at[action.microbatch] = max(done_at[action.microbatch], when)
    for k in range(1, num_steps):
        done_at[k] = max(done_at[k], done_at[k - 1])
    chunks: list[list[Action]] = [[] for _ in range(num_steps)]
    k = 0
    for action, when in zip(schedule.workers[worker], times[worker]):
        while k < num_steps - 1 and when > done_at[k]:
            k += 1
        chunks[k].append(action)
    return chunks


def no_update_between(actions: list[Action] | tuple[Action, ...]) -> set[int]:
    """Micro-batches whose forward and backward on this worker have no optimizer step between."""
    pending: set[int] = set()
    unchanged: set[int] = set()
    for action in actions:
        if action.kind is Kind.FORWARD:
            pending.add(action.microbatch)  # type: ignore[arg-type]
        elif action.kind is Kind.STEP:
            pending.clear()
        elif action.kind is Kind.BACKWARD and action.microbatch in pending:
            unchanged.add(action.microbatch)
    return unchanged
