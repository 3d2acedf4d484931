"""Pipeline schedules as data: actions, per-worker lists, generators and a deadlock checker.

Pure Python: nothing here imports ``torch``.

Usage::

    from tandem.schedule import check, generate, grid

    schedule = generate("gpipe", replicas=[2, 1], num_microbatches=4)
    check(schedule)            # ScheduleError, with the step x worker grid, if it would hang
    print(schedule.text())     # one line per worker; Schedule.parse reads it back
    print(grid(schedule))      # the dry run, one row per step, one column per worker
"""

from tandem.schedule.action import Action, Kind, ScheduleParseError
from tandem.schedule.check import ScheduleError, check, dry_run_times, grid
from tandem.schedule.generators import (
    GENERATORS,
    generate,
    gpipe,
    num_in_flight,
    one_f_one_b,
    pipedream,
)
from tandem.schedule.schedule import (
    SCHEDULE_KINDS,
    Schedule,
    make_schedule,
    worker_for,
    worker_of,
)

__all__ = [
    "GENERATORS", "SCHEDULE_KINDS", "Action", "Kind", "Schedule", "ScheduleError",
    "ScheduleParseError", "check",
    "dry_run_times",
    "generate", "gpipe", "grid", "make_schedule", "num_in_flight", "one_f_one_b", "pipedream",
    "worker_for", "worker_of",
]
