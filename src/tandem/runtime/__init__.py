"""Runtime: workers, process groups, trainer, checkpoints, profiler (uses torch.distributed)."""
