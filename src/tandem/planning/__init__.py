"""Planning: PipeDream's partitioner, the simulator and the planner that picks among plans."""

from tandem.planning.partition import NoPlanFits, Partition, PartitionOptions, partition
from tandem.planning.planner import make_plan, partition_plan

__all__ = ["NoPlanFits", "Partition", "PartitionOptions", "make_plan", "partition",
           "partition_plan"]
