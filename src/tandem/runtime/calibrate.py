"""Calibration of this machine for the simulator: what gloo messages, allreduces and busy
processes cost here, measured in a few seconds on local worker processes.

Usage::

    calibration = calibrate(num_workers=2)
    cluster = calibration.cluster(num_devices=2)
    options = SimOptions(allreduce="ring",
                         allreduce_latency_s=calibration.allreduce_step_latency_s)

One launch of ``num_workers`` local gloo processes (at least 2, one thread each) measures, in
order (the quantities of ``benchmarks/simulator_fidelity.py``, with fewer repetitions):

- the one-way latency and bandwidth of a message between ranks 0 and 1 (ping-pong of 4 KB and
  4 MB, the fastest of each);
- the latency of a small message while every worker exchanges at once, as pipeline stages do
  (each sleeps ``compute_s``, then sends to the next worker of a ring and receives from the
  previous; from the later of the send and the receive to the arrival, so that a worker's
  late wake-up, which the profile's times already hold, is not counted), the slowest worker's
  median (the least of three such loops): the cluster's link latency;
- the latency of one step of a ring allreduce as training meets it (sleep, then allreduce a
  small buffer, from the last worker's start to the end; the median over ``2 (n - 1)`` ring
  steps, the slowest worker's, the least of three loops);
- the speed of each of ``num_workers`` single-thread processes computing at once relative to
  one computing alone (matrix products counted for a short while): the devices' ``speed``
  when workers share this machine's cores (at most 1: a burst of other load during the
  measurement alone must not make them faster together than alone).

What it does not measure: the runtime's own cost per forward or backward (the benchmark runs a
training for it), how much of an allreduce a concurrent computation hides, and gloo's reduction
arithmetic on large gradients; a GPU's NCCL links.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from tandem.cluster import Cluster, Level
from tandem.runtime.optimizer_class import optimizer_class
from tandem.runtime.optimizers import Lars
from tandem.spec.optimizer import canonical_optimizer

SMALL_BYTES = 4096
LARGE_BYTES = 4 * 2**20


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Calibration:
    """What communication and computation cost on this machine, as measured by :func:`calibrate`."""

    num_workers: int
    """Processes the measurements ran on."""
    latency_s: float
    """One-way latency of a small gloo message between two otherwise idle processes."""
    bandwidth_Bps: float
    """Bandwidth of a large gloo message between two processes."""
    hop_latency_s: float
    """Latency of a small message while every worker exchanges at once."""
    allreduce_step_latency_s: float
    """Seconds per step of a ring allreduce of a small buffer, in a training-like loop."""
    speed: float
    """Speed of each of ``num_workers`` busy single-thread processes relative to one alone."""

    def cluster(self, num_devices: int, *, contended: bool = True) -> Cluster:
        """This machine as a flat cluster of ``num_devices`` devices: the hop latency and the
        message bandwidth; ``speed`` when ``contended`` (workers that compute on the shared
        cores), else 1 (workers that wait, such as the emulated model's)."""
        level = Level(num_units=max(num_devices, 2), bandwidth_Bps=self.bandwidth_Bps,
                      latency_s=self.hop_latency_s)
        return Cluster(levels=(level,), speed=self.speed if contended else 1.0,
                       name="this machine (calibrated)")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dictionary."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, slots=True)
class _Settings:
    repeats: int
    iterations: int
    compute_s: float
    spin_s: float


def calibrate(num_workers: int, *, repeats: int = 3, iterations: int = 12,
              compute_s: float = 0.02, spin_s: float = 0.3) -> Calibration:
    """Measure this machine on ``num_workers`` local gloo processes (at least 2); about
    ``2 * repeats * iterations * compute_s + 3 * spin_s`` seconds after the processes start.
    The loops' latencies are the least of ``repeats`` runs: other users' load only ever slows
    this machine down, and the simulator predicts a machine of one's own."""
    from tandem.runtime.launch import launch

    settings = _Settings(repeats=repeats, iterations=iterations, compute_s=compute_s,
                         spin_s=spin_s)
    result = launch(_measure, settings, nproc=max(2, num_workers), threads=1)
    assert result is not None, "rank 0 returns the calibration"
    return result


def optimizer_Bps(num_bytes: float, optimizer: str = "sgd", *, repeats: int = 10) -> float:
    """Parameter bytes per second a step of ``optimizer`` (``sgd`` with momentum, ``adam``,
    ``adamw``, ``lars``, ``lamb``, any other ``--optimizer`` with its default options) updates
    here on one flat tensor of ``num_bytes``, in this process's threads."""
    numel = max(1, int(num_bytes // 4))
    param = torch.nn.Parameter(torch.zeros(numel))
    param.grad = torch.ones(numel)
    if optimizer in ("sgd", "lars"):
        cls = torch.optim.SGD if optimizer == "sgd" else Lars
        opt: torch.optim.Optimizer = cls([param], lr=0.01, momentum=0.9)
    else:
        defaults: dict[str, Any] = {"lr": 0.01}  # the class's own for the rest
        opt = optimizer_class(canonical_optimizer(optimizer))([param], **defaults)
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return numel * 4 / max(statistics.median(times[2:]), 1e-9)


# -- inside the workers ------------------------------------------------------------------------

def _measure(settings: _Settings) -> Calibration:
    from tandem.runtime.dist import init_worker

    env = init_worker(backend="gloo", timeout_s=120, threads=1)
    try:
        latency_s, bandwidth_Bps = _ping_pong(env.rank, settings.iterations)
        hop_s = min(_slowest(_ring_hops(env.rank, env.world_size, settings))
                    for _ in range(settings.repeats))
        per_allreduce = min(_slowest(_allreduces(settings)) for _ in range(settings.repeats))
        speed = _speed(env.rank, settings.spin_s)
    finally:
        dist.destroy_process_group()
    return Calibration(num_workers=env.world_size, latency_s=latency_s,
                       bandwidth_Bps=bandwidth_Bps, hop_latency_s=hop_s,
                       allreduce_step_latency_s=per_allreduce / (2 * (env.world_size - 1)),
                       speed=speed)


def _ping_pong(rank: int, iterations: int) -> tuple[float, float]:
    """Latency and bandwidth between ranks 0 and 1 (the others wait), from the fastest round
    trips (other processes' load only ever slows a message down); rank 0's figures."""
    fastest = []
    for size in (SMALL_BYTES, LARGE_BYTES):
        buf, times = torch.zeros(size // 4), []
        dist.barrier()
        for _ in range(iterations + 2 if rank < 2 else 0):
            start = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            times.append((time.perf_counter() - start) / 2)
        fastest.append(min(times[2:]) if times else 0.0)
    dist.barrier()
    small, large = fastest
    if large <= small:  # noise at a tiny latency: the large message's rate alone
        return small, LARGE_BYTES / max(large, 1e-9)
    return small, (LARGE_BYTES - SMALL_BYTES) / (large - small)


def _ring_hops(rank: int, world_size: int, settings: _Settings) -> float:
    """This worker's median time from the later of its neighbour's send and its own receive to
    the message's arrival (``perf_counter`` is one clock for all processes of a machine), so
    that neither worker's lateness counts as the link's."""
    buf = torch.zeros(64, dtype=torch.float64)
    into = torch.zeros(64, dtype=torch.float64)
    hops = []
    dist.barrier()
    for _ in range(settings.iterations + 2):
        time.sleep(settings.compute_s)
        buf[0] = time.perf_counter()
        work = dist.isend(buf, (rank + 1) % world_size)
        assert work is not None  # None only for a rank outside the (default) group
        posted = time.perf_counter()
        dist.recv(into, (rank - 1) % world_size)
        arrived = time.perf_counter()
        work.wait()
        hops.append(arrived - max(float(into[0]), posted))
    return statistics.median(hops[2:])


def _allreduces(settings: _Settings) -> float:
    """This worker's median allreduce of a small buffer, each after a computation, from the
    last worker's start to this worker's end (one clock for all local processes)."""
    buf, starts, ends = torch.zeros(SMALL_BYTES // 4), [], []
    dist.barrier()
    for _ in range(settings.iterations + 2):
        time.sleep(settings.compute_s)
        starts.append(time.perf_counter())
        dist.all_reduce(buf)
        ends.append(time.perf_counter())
    latest = torch.tensor(starts, dtype=torch.float64)
    dist.all_reduce(latest, op=dist.ReduceOp.MAX)
    return statistics.median(end - float(first) for end, first in zip(ends[2:], latest[2:]))


def _slowest(value: float) -> float:
    """The largest of every worker's ``value``."""
    worst = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def _speed(rank: int, spin_s: float) -> float:
    """Matrix products per second of every worker at once over rank 0's alone (1 on a machine
    with a core per worker)."""
    a, b = torch.randn(128, 512), torch.randn(512, 512)

    def spin() -> float:
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < spin_s:
            a @ b
            count += 1
        return count / (time.perf_counter() - start)

    spin()  # warm-up, all at once
    dist.barrier()
    together = torch.tensor([spin()], dtype=torch.float64)
    dist.all_reduce(together)
    dist.barrier()
    alone = spin() if rank == 0 else 0.0
    dist.barrier()
    return min(1.0, float(together) / dist.get_world_size() / alone) if rank == 0 else 0.0
