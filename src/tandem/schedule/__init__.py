"""Pipeline schedules as data: actions, per-worker lists, generators and a deadlock checker.

Pure Python: nothing here imports ``torch.distributed``.
"""

from tandem.schedule.action import Action, Kind
from tandem.schedule.schedule import SCHEDULE_KINDS, Schedule, make_schedule

__all__ = ["SCHEDULE_KINDS", "Action", "Kind", "Schedule", "make_schedule"]
