"""Planning: PipeDream's partitioner over a profile's layer states (pure Python + numpy)."""

from tandem.planning.partition import Partition, PartitionOptions, partition
from tandem.planning.planner import make_plan

__all__ = ["Partition", "PartitionOptions", "make_plan", "partition"]
