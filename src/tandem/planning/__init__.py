"""Planning: PipeDream's partitioner over a profile's layer states (pure Python + numpy)."""

from tandem.planning.branches import Compression, compress_for_planning
from tandem.planning.partition import Partition, PartitionOptions, partition
from tandem.planning.planner import make_plan

__all__ = ["Compression", "Partition", "PartitionOptions", "compress_for_planning", "make_plan",
           "partition"]
