"""Pipeline schedules as data: actions, per-worker lists, generators and a deadlock checker.

Pure Python: nothing here imports ``torch``.

Usage::

    from tandem.schedule import ScheduleKind, check, generate, grid

    schedule = generate(ScheduleKind.GPIPE, replicas=[2, 1], num_microbatches=4)
    check(schedule)            # ScheduleError, with the step x worker grid, if it would hang
    print(schedule.text())     # one line per worker; Schedule.parse reads it back
    print(grid(schedule))      # the dry run, one row per step, one column per worker
"""

# Each name is re-exported explicitly (``name as name``), as the package's public API.
from tandem.schedule.action import Action as Action
from tandem.schedule.action import Kind as Kind
from tandem.schedule.action import ScheduleParseError as ScheduleParseError
from tandem.schedule.check import ScheduleError as ScheduleError
from tandem.schedule.check import check as check
from tandem.schedule.check import dry_run_times as dry_run_times
from tandem.schedule.check import grid as grid
from tandem.schedule.generators import GENERATORS as GENERATORS
from tandem.schedule.generators import generate as generate
from tandem.schedule.generators import gpipe as gpipe
from tandem.schedule.generators import num_in_flight as num_in_flight
from tandem.schedule.generators import one_f_one_b as one_f_one_b
from tandem.schedule.generators import pipedream as pipedream
from tandem.schedule.schedule import SCHEDULE_KINDS as SCHEDULE_KINDS
from tandem.schedule.schedule import Schedule as Schedule
from tandem.schedule.schedule import make_schedule as make_schedule
from tandem.schedule.schedule import worker_for as worker_for
from tandem.schedule.schedule import worker_of as worker_of
from tandem.spec.kinds import ScheduleKind as ScheduleKind
