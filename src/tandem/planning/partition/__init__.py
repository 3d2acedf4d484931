"""PipeDream's partitioner: cut states, its dynamic program and the memory model it shares."""
