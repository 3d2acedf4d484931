"""Planning: PipeDream's partitioner, the simulator and the planner that picks among plans."""

from tandem.planning.branches import Compression, compress_for_planning
from tandem.planning.partition import NoPlanFits, Partition, PartitionOptions, partition
from tandem.planning.planner import make_plan, partition_plan

__all__ = ["Compression", "NoPlanFits", "Partition", "PartitionOptions", "compress_for_planning",
           "make_plan", "partition", "partition_plan"]
