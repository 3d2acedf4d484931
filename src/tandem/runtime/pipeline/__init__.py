"""Pipeline parallelism: stages of an ``nn.Sequential`` on workers, driven by a schedule."""
