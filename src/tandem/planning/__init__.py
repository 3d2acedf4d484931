"""Planning: PipeDream's partitioner (``partition``), the simulator (``simulate``) and the
planner and searches that pick among plans (``search``)."""

from tandem.planning.partition.branches import Compression, compress_for_planning
from tandem.planning.partition.pipedream import NoPlanFits, Partition, PartitionOptions
from tandem.planning.search.planner import make_plan, partition_plan

__all__ = ["Compression", "NoPlanFits", "Partition", "PartitionOptions", "compress_for_planning",
           "make_plan", "partition_plan"]
