"""Simulator fidelity: predicted vs measured step time for GPipe, 1F1B, PipeDream, DP, parameter
servers, gossip and tensor parallelism.

Every measurement is a real run of the command line (``tandem train ... --json``, whose
``step_time_s`` is rank 0's median step after two warm-up steps; for PipeDream's schedule the
steady-state time per minibatch on stage 0, from the run's ``trace.json``), the best of three runs;
every prediction simulates the same plan on a cluster model of this machine
(``tandem.planning.simulate.simulator``, the library behind ``tandem simulate``). Four parts:

- ``emulated``: PipeDream's VGG-16 profile played by the emulated model (each block sleeps its
  profiled time, so 2-8 workers on this 2-core machine behave like devices: sleeping workers do
  not compete for the CPU). Target: every simulated step within 5% of the measured one; for
  the parameter servers (one server and 4 workers, sync and async) and D-PSGD on a ring of 4,
  within 10%. A sync server's step is the run's time per update (server 0's wall / updates);
  an async one's is a worker's time between its own updates (that, times the workers); a
  gossip step is rank 0's median step.
- ``ranking``: six plans of that model on four devices, in the order the simulator ranks them;
  target: the measured order is the same.
- ``real``: a real MLP on the CPU with one and two workers of one thread each (target 15%),
  profiled by ``tandem profile`` at the run's micro-batch size right before each run. Busy
  processes share this machine's ~1.25 cores (and other users' load), so the speed of two
  processes computing at once relative to one is measured right before each two-worker run and
  given to the simulator as the devices' speed; optimizer steps are timed on the same
  parameters. Each quantity is taken at its best of three.

- ``tensor``: a real GPT (:data:`TENSOR_MODEL`, batch 32) trained by ``tandem train
  --tensor-parallel T --nproc T`` for each of ``--tensor-degrees`` (default 1,2; 1 is one
  process, the baseline), target 15% for T = 2. Before each run: ``tandem profile`` (whose layers
  record the allreduces the model's tensor plan adds: two each way per block, none for the
  embedding and the head), the speed of T busy processes and the bandwidth of a gloo allreduce of
  one block's output (2.1 MB) among T processes that compute between allreduces. Once per
  degree: the runtime's cost per tensor allreduce beyond the collective (DTensor's Python), from
  a GPT of the same structure at width 16 run the same way (measured minus simulated, over its
  16 allreduces). Prints each repeat's own prediction against its own run as well, since under
  others' load the bests come from different minutes.

The cluster model of this machine is measured first, not assumed: the latency and bandwidth of a
gloo message between two local processes (ping-pong); the time per step of a small gloo allreduce
among 2, 3, 4 and 8 processes (with more processes than cores each step waits for a process to be
scheduled: ~0.2 ms per step with 2, ~1 ms with 8); and the runtime's cost per forward or backward
beyond the profiled time (one worker running the whole emulated model as one stage of 8
micro-batches: measured minus simulated step, per computation). Calibrated predictions use
gloo's algorithm (ring allreduce); "uncalibrated" ones use link latency and bandwidth only and the
default algorithm choice.

    .venv/bin/python benchmarks/simulator_fidelity.py [--parts emulated,ranking,real,tensor]
        [--steps 10] [--scale 2] [--tensor-degrees 1,2]

Prints a table per part, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from tandem.cluster import Cluster, Level  # noqa: E402
from tandem.plan import Plan  # noqa: E402
from tandem.planning.search.balance import balanced_plan  # noqa: E402
from tandem.planning.simulate.simulator import SimOptions, data_parallel_plan, simulate  # noqa: E402
from tandem.planning.simulate.tensor import tensor_allreduce_count  # noqa: E402
from tandem.profile import ModelProfile, load_profile  # noqa: E402
from tandem.spec.sync import GossipSync, ParameterServerSync  # noqa: E402
from tandem.schedule import Kind  # noqa: E402
from tandem.timeline import event_action  # noqa: E402

VGG = ROOT / "tests" / "data" / "profiles" / "vgg16.graph.txt"
VGG_BATCH = 128
"""PipeDream's VGG-16 profile is for minibatches of 128 (its first output is 128 x 64 x 224²
floats)."""
BYTES_SCALE = 1e-4
"""Activation and parameter sizes are scaled down so that CPU gloo moves them quickly."""
REPEATS = 3
"""Every measurement (runs and calibrations) is the best of this many: other users' load only
ever slows this machine down, and the simulator predicts a machine of one's own."""
REAL_MODEL = "mlp:hidden=1024,layers=6"
REAL_DATA = "images:n=4096,size=16,channels=3"
REAL_BATCH = 256


@dataclasses.dataclass(frozen=True)
class Case:
    """One plan to run and simulate."""

    name: str
    kind: str
    """``gpipe``, ``1f1b``, ``pipedream``, ``dp``, ``ps`` or ``gossip``."""
    replicas: tuple[int, ...]
    microbatches: int | None = None
    mode: str = ""
    """``ps``: its mode (one server); ``gossip``: its topology."""

    @property
    def servers(self) -> int:
        return 1 if self.kind == "ps" else 0

    @property
    def workers(self) -> int:
        """Processes of the run (parameter servers included)."""
        return sum(self.replicas) + self.servers


EMULATED = [
    Case("gpipe 1-1, M=4", "gpipe", (1, 1), 4),
    Case("dp 2", "dp", (2,)),
    Case("gpipe 1-1-1-1, M=8", "gpipe", (1, 1, 1, 1), 8),
    Case("1f1b 1-1-1-1, M=8", "1f1b", (1, 1, 1, 1), 8),
    Case("pipedream 1-1-1-1", "pipedream", (1, 1, 1, 1)),
    Case("1f1b 2-1-1, M=8", "1f1b", (2, 1, 1), 8),
    Case("pipedream 3-1", "pipedream", (3, 1)),
    Case("dp 4", "dp", (4,)),
    Case("1f1b 8 stages, M=16", "1f1b", (1,) * 8, 16),
    Case("pipedream 8 stages", "pipedream", (1,) * 8),
    Case("dp 8", "dp", (8,)),
    Case("ps sync 1+4", "ps", (4,), mode="sync"),
    Case("ps async 1+4", "ps", (4,), mode="async"),
    Case("gossip ring 4", "gossip", (4,), mode="ring"),
]
RANKING = [
    Case("dp 4", "dp", (4,)),
    Case("pipedream 1-1-1-1", "pipedream", (1, 1, 1, 1)),
    Case("1f1b 2-1-1, M=8", "1f1b", (2, 1, 1), 8),
    Case("gpipe 1-1-1-1, M=8", "gpipe", (1, 1, 1, 1), 8),
    Case("gpipe 1-1-1-1, M=4", "gpipe", (1, 1, 1, 1), 4),
    Case("gpipe 1-1, M=4", "gpipe", (1, 1), 4),
]
REAL = [
    Case("one worker, M=4", "gpipe", (1,), 4),
    Case("gpipe 1-1, M=4", "gpipe", (1, 1), 4),
    Case("dp 2", "dp", (2,)),
]


# -- running the command line ------------------------------------------------------------------

def tandem(*args: str, timeout_s: float = 600) -> str:
    """Run ``python -m tandem ARGS`` with one thread per process; its stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    done = subprocess.run([sys.executable, "-m", "tandem", *args], capture_output=True,
                          text=True, env=env, timeout=timeout_s, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"tandem {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def train_args(case: Case, plan_path: str, model: str, data: str, batch: int, steps: int) -> list[str]:
    """``tandem train`` arguments that run ``case``."""
    common = ["train", "--model", model, "--data", data, "--batch-size", str(batch),
              "--steps", str(steps), "--nproc", str(case.workers), "--json", "--no-progress",
              "--log-every", str(steps)]
    if case.kind == "dp":
        return [*common, "--strategy", "dp"]
    if case.kind == "ps":
        return [*common, "--strategy", "ps", "--servers", "1", "--mode", case.mode]
    if case.kind == "gossip":
        return [*common, "--strategy", "gossip", "--topology", case.mode]
    return [*common, "--strategy", "pipeline", "--plan", plan_path]  # the plan fixes the schedule


def measure(case: Case, plan_path: str, model: str, data: str, batch: int, steps: int,
            tmp: Path) -> float:
    """Measured step time of ``case``: rank 0's median step (flush schedules, DP), or for
    PipeDream the steady-state time per minibatch on stage 0, from the run's trace."""
    if case.kind == "ps":  # time per update over the run: a worker's step is that x workers
        # The servers time the run from the first push; workers that start later (seconds
        # apart under load) leave fewer pushing at first, which async runs feel in full: run
        # them long enough (16 updates per worker per 10 steps) to make that small.
        updates = 3 * steps if case.mode == "sync" else 4 * steps * sum(case.replicas)
        out = tandem(*train_args(case, plan_path, model, data, batch, updates))
        per_update = float(json.loads(out.strip().splitlines()[-1])["step_time_s"])
        return per_update * (sum(case.replicas) if case.mode != "sync" else 1)
    if case.kind != "pipedream":
        out = tandem(*train_args(case, plan_path, model, data, batch, steps))
        return float(json.loads(out.strip().splitlines()[-1])["step_time_s"])
    rounds = math.lcm(*case.replicas)  # its allreduces pair up once per round of the replicas
    steps = -(-max(2 * steps, 3 * (case.workers + len(case.replicas))) // rounds) * rounds
    out_dir = tmp / f"run-{case.kind}-{'-'.join(map(str, case.replicas))}"
    tandem(*train_args(case, plan_path, model, data, batch, steps), "--out", str(out_dir))
    return pipedream_minibatch_s(out_dir / "trace.json", case.replicas[0], rounds, steps)


def pipedream_minibatch_s(trace: Path, stage0_workers: int, rounds: int, steps: int) -> float:
    """Time per minibatch between the updates of minibatches a and b on stage 0 (the middle
    third of the run, whole rounds), as the simulator measures it."""
    events = json.loads(trace.read_text())["traceEvents"]
    done = {e["args"]["step"]: (e["ts"] + e["dur"]) / 1e6 for e in events
            if e.get("ph") == "X" and e["pid"] < stage0_workers
            and getattr(event_action(e["name"]), "kind", None) is Kind.STEP}
    first = max(rounds, steps // 3 // rounds * rounds)
    last = max(first + rounds, 2 * steps // 3 // rounds * rounds)
    return (done[last] - done[first]) / (last - first)


def make_plan(case: Case, profile: ModelProfile) -> Plan:
    if case.kind in ("ps", "gossip"):
        sync = (ParameterServerSync(servers=1, mode=case.mode) if case.kind == "ps"
                else GossipSync(topology=case.mode))
        plan = data_parallel_plan(profile, sum(case.replicas))
        return dataclasses.replace(plan, num_devices=case.workers, sync=sync)
    if case.kind == "dp":
        return data_parallel_plan(profile, case.workers)
    return balanced_plan(profile, list(case.replicas), schedule=case.kind,
                         num_microbatches=case.microbatches)


# -- the cluster model of this machine ---------------------------------------------------------

def ping_pong(sizes: list[int], repeats: int, tmp: Path) -> dict[int, float]:
    """One-way seconds of a gloo message of each size between two local processes."""
    script = tmp / "ping_pong.py"
    script.write_text(f"""
import json, statistics, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, out = dist.get_rank(), {{}}
for size in {sizes!r}:
    buf, times = torch.zeros(size // 4), []
    for _ in range({repeats}):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        times.append((time.perf_counter() - start) / 2)
    out[size] = statistics.median(times)
if rank == 0:
    print(json.dumps(out))
dist.destroy_process_group()
""")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(script)],
                          capture_output=True, text=True, env=env, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    line = [x for x in done.stdout.splitlines() if x.startswith("{")][-1]
    return {int(k): v for k, v in json.loads(line).items()}


def local_link(tmp: Path) -> tuple[float, float]:
    """Latency (s) and bandwidth (B/s) of a gloo message on this machine."""
    small, large = 4096, 4 * 2**20
    runs = [ping_pong([small, large], 40, tmp) for _ in range(REPEATS)]
    latency = min(times[small] for times in runs)
    transfer = min(times[large] for times in runs)
    return latency, (large - small) / max(transfer - latency, 1e-9)


def _run_script(script: Path, num_workers: int) -> str:
    """Run ``script`` on ``num_workers`` local gloo processes (torchrun); its stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(num_workers), str(script)],
                          capture_output=True, text=True, env=env, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return done.stdout


def _value(stdout: str, label: str) -> float:
    return float([x for x in stdout.splitlines() if x.startswith(label)][-1].split()[1])


COMPUTE_S = 0.05
"""What the workers of a calibration loop do between exchanges: sleep this long, as an
emulated layer does (the loops measure communication as training meets it, not in isolation)."""


def timed_allreduce_s(num_workers: int, num_bytes: int, compute: str, iterations: int,
                      warmup: int, tmp: Path) -> float:
    """Median seconds of a gloo allreduce of ``num_bytes`` among ``num_workers`` local processes
    in a loop that runs the Python lines ``compute`` before each (with ``a`` and ``b``, two
    matrices, at hand), from the end of the computation to the end of the allreduce; the first
    ``warmup`` iterations left out; the slowest worker's."""
    body = "\n".join("    " + line for line in compute.splitlines())
    script = tmp / "timed_allreduce.py"
    script.write_text(f"""
import statistics, time, torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
a, b = torch.randn(256, 1024), torch.randn(1024, 1024)
buf, times = torch.zeros({num_bytes} // 4), []
dist.barrier()
for _ in range({iterations}):
{body}
    start = time.perf_counter()
    dist.all_reduce(buf)
    times.append(time.perf_counter() - start)
worst = torch.tensor([statistics.median(times[{warmup}:])])
dist.all_reduce(worst, op=dist.ReduceOp.MAX)
if dist.get_rank() == 0:
    print("median", float(worst))
dist.destroy_process_group()
""")
    return _value(_run_script(script, num_workers), "median")


def allreduce_step_latency(num_workers: int, num_bytes: int, tmp: Path) -> float:
    """Seconds per step of a gloo ring allreduce among ``num_workers`` local processes, as
    training meets it: each iteration of a loop sleeps ``COMPUTE_S`` (compute) and then
    allreduces; the median time from the end of a worker's sleep to the end of its allreduce,
    over the ring's ``2 (n - 1)`` steps, the slowest worker's. Workers leave each allreduce at
    different instants (with more processes than cores each wakes when the scheduler lets it),
    so the next one starts skewed; a loop includes that skew, an allreduce timed alone after a
    barrier does not."""
    seconds = timed_allreduce_s(num_workers, num_bytes, f"time.sleep({COMPUTE_S})", 30, 4, tmp)
    return max(seconds, 0.0) / (2 * (num_workers - 1))


def hop_latency(num_workers: int, tmp: Path) -> float:
    """Latency of a small gloo message while ``num_workers`` local processes exchange at once,
    as a pipeline's stages do: every iteration each worker sleeps ``COMPUTE_S``, sends to the
    next worker of a ring and receives from the previous; the median time from the end of a
    worker's sleep to its neighbour's message (which includes the neighbours' skew), the
    slowest worker's."""
    script = tmp / "ring.py"
    script.write_text(f"""
import statistics, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, n = dist.get_rank(), dist.get_world_size()
buf, into, hops = torch.zeros(1024), torch.zeros(1024), []
dist.barrier()
for _ in range(30):
    time.sleep({COMPUTE_S})
    slept = time.perf_counter()
    work = dist.isend(buf, (rank + 1) % n)
    dist.recv(into, (rank - 1) % n)
    work.wait()
    now = time.perf_counter()
    hops.append(now - slept)
worst = torch.tensor([statistics.median(hops[4:])])
dist.all_reduce(worst, op=dist.ReduceOp.MAX)
if rank == 0:
    print("median", float(worst))
dist.destroy_process_group()
""")
    return _value(_run_script(script, num_workers), "median")


def local_cluster(num_devices: int, latency_s: float, bandwidth_Bps: float) -> Cluster:
    return Cluster(levels=(Level(num_units=num_devices, bandwidth_Bps=bandwidth_Bps,
                                 latency_s=latency_s),), name="this machine")


def action_overhead(profile: ModelProfile, model: str, data: str, batch: int, steps: int,
                    cluster: Cluster, tmp: Path) -> float:
    """Seconds the runtime adds to each forward or backward beyond the profiled time (sleep
    overshoot, autograd and engine bookkeeping): one worker runs the whole model as a single
    stage with 8 micro-batches; the difference from the simulated step, per computation."""
    case = Case("calibration", "gpipe", (1,), 8)
    plan = make_plan(case, profile)
    plan_path = tmp / "plan-calibration.json"
    plan.save(str(plan_path))
    measured = min(measure(case, str(plan_path), model, data, batch, steps, tmp)
                   for _ in range(REPEATS))
    simulated = simulate(plan, profile, cluster, SimOptions(record=False)).step_time_s
    return max(0.0, (measured - simulated) / (2 * 8))


# -- the parts ---------------------------------------------------------------------------------

def scaled_vgg(scale: float, path: Path) -> ModelProfile:
    """VGG-16's profile with times x ``scale`` and sizes x ``BYTES_SCALE``, as a chain."""
    profile = load_profile(str(VGG))
    layers = [dataclasses.replace(layer, forward_s=layer.forward_s * scale,
                                  backward_s=layer.backward_s * scale,
                                  forward_fixed_s=layer.forward_fixed_s * scale,
                                  backward_fixed_s=layer.backward_fixed_s * scale,
                                  activation_bytes=layer.activation_bytes * BYTES_SCALE,
                                  parameter_bytes=layer.parameter_bytes * BYTES_SCALE)
              for layer in profile.layers]
    scaled = ModelProfile(layers=layers, model=f"vgg16 x{scale}", batch_size=VGG_BATCH,
                          source="benchmarks/simulator_fidelity.py")
    scaled.save(str(path))
    return scaled


def run_cases(cases: list[Case], profile: ModelProfile, model: str, data: str, batch: int,
              steps: int, cluster_for: Any, options: SimOptions, bare: SimOptions,
              tmp: Path, memo: dict[Case, float],
              collective_latency: dict[int, float],
              bare_cluster_for: Any = None) -> list[dict[str, Any]]:
    """Simulate and run every case (a case measured before is not run again)."""
    rows = []
    for case in cases:
        plan = make_plan(case, profile)
        plan_path = tmp / f"plan-{case.kind}-{'-'.join(map(str, case.replicas))}.json"
        plan.save(str(plan_path))
        cluster = cluster_for(case.workers)
        if collective_latency:
            options = dataclasses.replace(options,
                                          allreduce_latency_s=collective_latency.get(case.workers))
        predicted = simulate(plan, profile, cluster, options).step_time_s
        predicted_bare = simulate(plan, profile, (bare_cluster_for or cluster_for)(case.workers),
                                  bare).step_time_s
        started = time.perf_counter()
        if case not in memo:
            memo[case] = min(measure(case, str(plan_path), model, data, batch, steps, tmp)
                             for _ in range(REPEATS))
        measured = memo[case]
        row = {"case": case.name, "workers": case.workers, "measured_s": measured,
               "simulated_s": predicted, "error": predicted / measured - 1,
               "simulated_bare_s": predicted_bare, "error_bare": predicted_bare / measured - 1,
               "wall_s": round(time.perf_counter() - started, 1)}
        print(f"  {case.name:<22} {case.workers:>2} workers: measured {measured * 1e3:8.1f} ms, "
              f"simulated {predicted * 1e3:8.1f} ms ({row['error']:+.1%}; "
              f"{row['error_bare']:+.1%} uncalibrated)", file=sys.stderr, flush=True)
        rows.append(row)
    return rows


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{title}")
    print(f"{'plan':<24} {'workers':>7} {'measured ms':>12} {'simulated ms':>13} {'error':>7} "
          f"{'uncalibrated':>12} {'error':>7}")
    for r in rows:
        print(f"{r['case']:<24} {r['workers']:>7} {r['measured_s'] * 1e3:12.1f} "
              f"{r['simulated_s'] * 1e3:13.1f} {r['error']:+7.1%} {r['simulated_bare_s'] * 1e3:12.1f} "
              f"{r['error_bare']:+7.1%}")


def real_profile(batch: int, tmp: Path) -> ModelProfile:
    """The MLP profiled by ``tandem profile`` on this machine (one process, one thread), at the
    micro-batch size the run will compute (CPU matrix products are less efficient on fewer rows,
    which the simulator's linear scaling would miss)."""
    path = _profile_path(batch, tmp)
    tandem("profile", "--model", REAL_MODEL, "--data", REAL_DATA, "--batch-size", str(batch),
           "--repeats", "15", "-o", str(path))
    return ModelProfile.load(str(path))


def contention_speed(num_workers: int, tmp: Path) -> float:
    """Speed of each of ``num_workers`` single-thread processes computing at once, relative to
    one computing alone (the same matrix products, counted for a few seconds)."""
    script = tmp / "spin.py"
    script.write_text("""
import sys, time, torch
torch.set_num_threads(1)
a, b = torch.randn(256, 1024), torch.randn(1024, 1024)
start = float(sys.argv[1])
while time.time() < start:
    time.sleep(0.001)
count, end = 0, start + 3.0
while time.time() < end:
    a @ b
    count += 1
print(count)
""")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def rate(processes: int) -> float:
        start = f"{time.time() + 6.0}"
        procs = [subprocess.Popen([sys.executable, str(script), start], env=env, text=True,
                                  stdout=subprocess.PIPE) for _ in range(processes)]
        counts = [int(proc.communicate(timeout=120)[0]) for proc in procs]
        return statistics.mean(counts)

    alone = rate(1)
    return rate(num_workers) / alone


def busy_allreduce_bandwidth(num_workers: int, num_bytes: int, step_latency_s: float,
                             tmp: Path) -> float:
    """Bandwidth of a gloo ring allreduce of ``num_bytes`` among ``num_workers`` local processes
    that compute between allreduces (one thread of matrix products for 30 ms, as a backward
    does): the median allreduce, the slowest worker's, less its ``2 (n - 1)`` step latencies,
    for the ``2 (n - 1) / n`` of the bytes each worker sends. On a CPU this includes what the
    simulator does not model: gloo's reduction arithmetic and copies, competing for the cores."""
    compute = ("start = time.perf_counter()\n"
               "while time.perf_counter() - start < 0.03:\n"
               "    a @ b")
    seconds = timed_allreduce_s(num_workers, num_bytes, compute, 12, 2, tmp)
    steps = 2 * (num_workers - 1)
    sent = steps / num_workers * num_bytes
    return sent / max(seconds - steps * step_latency_s, 1e-9)


def exposed_allreduce(num_workers: int, num_bytes: int, tmp: Path) -> float:
    """How much of an allreduce a concurrent computation fails to hide on this machine: the
    time of (allreduce started asynchronously, then compute, then wait) minus the compute
    alone, over the allreduce alone (0: fully hidden, as on a GPU with its own copy engines;
    1: not at all, when gloo's threads and the computation share the same cores)."""
    script = tmp / "overlap.py"
    script.write_text(f"""
import statistics, time, torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
a, b = torch.randn(256, 1024), torch.randn(1024, 1024)
buf = torch.zeros({num_bytes} // 4)
def compute():  # about as long as the allreduce, so that the difference is not lost in noise
    for _ in range(4):
        a @ b
times = {{"compute": [], "allreduce": [], "both": []}}
for _ in range(24):
    dist.barrier()
    start = time.perf_counter(); compute(); times["compute"].append(time.perf_counter() - start)
    dist.barrier()
    start = time.perf_counter(); dist.all_reduce(buf); times["allreduce"].append(time.perf_counter() - start)
    dist.barrier()
    start = time.perf_counter()
    work = dist.all_reduce(buf, async_op=True)
    compute()
    work.wait()
    times["both"].append(time.perf_counter() - start)
m = {{key: statistics.median(value[2:]) for key, value in times.items()}}
if dist.get_rank() == 0:
    print("exposed", (m["both"] - m["compute"]) / m["allreduce"])
dist.destroy_process_group()
""")
    return _value(_run_script(script, num_workers), "exposed")


def optimizer_rate(profile: ModelProfile) -> float:
    """Parameter bytes per second an SGD-with-momentum step updates here (one thread)."""
    import torch

    torch.set_num_threads(1)
    numel = int(sum(layer.parameter_bytes for layer in profile.layers) // 4)
    param = torch.nn.Parameter(torch.zeros(numel))
    param.grad = torch.ones(numel)
    optimizer = torch.optim.SGD([param], lr=0.01, momentum=0.9)
    times = []
    for _ in range(12):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return numel * 4 / statistics.median(times[2:])


def real_part(steps: int, tmp: Path, cluster_for: Any, collective: dict[int, float],
              cases: list[str]) -> list[dict[str, Any]]:
    """Each real case ``REPEATS`` times, each run right after a profile at its micro-batch and a
    measurement of how fast busy processes run at once; every quantity is then taken at its
    least loaded (fastest layer times, highest speed, fastest run) and the case simulated."""
    print("real:", file=sys.stderr)
    rows = []
    for case in REAL:
        if cases and case.name not in cases:
            continue
        micro = REAL_BATCH // (case.workers if case.kind == "dp" else case.microbatches or 1)
        profiles = [real_profile(micro, tmp)]
        plan = make_plan(case, profiles[0])
        plan_path = tmp / f"real-plan-{case.kind}-{case.workers}.json"
        plan.save(str(plan_path))
        speeds: list[float] = []
        rates: list[float] = []
        bandwidths: list[float] = []
        exposed: list[float] = []
        measured: list[float] = []
        for repeat in range(REPEATS):
            if repeat:
                profiles.append(real_profile(micro, tmp))
            speeds.append(1.0 if case.workers == 1 else contention_speed(case.workers, tmp))
            rates.append(optimizer_rate(profiles[-1]))
            if case.kind == "dp":
                gradient = int(sum(layer.parameter_bytes for layer in profiles[-1].layers))
                bandwidths.append(busy_allreduce_bandwidth(
                    case.workers, gradient, collective.get(case.workers, 0.0), tmp))
                exposed.append(exposed_allreduce(case.workers, gradient, tmp))
            measured.append(measure(case, str(plan_path), REAL_MODEL, REAL_DATA, REAL_BATCH,
                                    steps, tmp))
            print(f"  {case.name}: profile {profiles[-1].total_compute_s() * 1e3:.1f} ms per "
                  f"micro-batch of {micro}, {case.workers} busy processes at {speeds[-1]:.2f}x, "
                  f"run {measured[-1] * 1e3:.1f} ms", file=sys.stderr, flush=True)
        profile = _fastest(profiles)
        cluster = dataclasses.replace(cluster_for(case.workers), speed=max(speeds))
        if bandwidths:  # the allreduce's own bandwidth on this machine, measured
            level = dataclasses.replace(cluster.levels[0], bandwidth_Bps=max(bandwidths))
            cluster = dataclasses.replace(cluster, levels=(level,))
        # DDP's overlap of the allreduce with the backward, as far as this machine allows it.
        overlap = statistics.median(exposed) < 0.5 if exposed else None
        options = SimOptions(batch_scale=REAL_BATCH / micro, optimizer_Bps=max(rates),
                             allreduce="ring", record=False, overlap_allreduce=overlap,
                             allreduce_latency_s=collective.get(case.workers))
        bare = SimOptions(batch_scale=REAL_BATCH / micro, record=False)
        predicted = simulate(plan, profile, cluster, options).step_time_s
        predicted_bare = simulate(plan, profile, cluster_for(case.workers), bare).step_time_s
        best = min(measured)
        rows.append({"case": case.name, "workers": case.workers, "measured_s": best,
                     "simulated_s": predicted, "error": predicted / best - 1,
                     "simulated_bare_s": predicted_bare, "error_bare": predicted_bare / best - 1,
                     "speed": max(speeds), "optimizer_Bps": max(rates), "profile_batch": micro,
                     "profile_s": profile.total_compute_s(), "runs_s": measured,
                     "speeds": speeds, "allreduce_Bps": max(bandwidths, default=None),
                     "exposed_allreduce": exposed})
    print_table(f"real: {REAL_MODEL} on the CPU, 1-2 workers of one thread", rows)
    return rows


TENSOR_MODEL = "gpt:layers=4,dim=256,heads=4,dropout=0"
TENSOR_DATA = "tokens:n=2048,seq=64,vocab=128"
TENSOR_BATCH = 32


TINY_MODEL = "gpt:layers=4,dim=16,heads=4,dropout=0"
TINY_DATA = "tokens:n=256,seq=8,vocab=16"
TINY_BATCH = 4
"""The tensor part's calibration model: the GPT's structure (four blocks, the same tensor plan)
at a width where compute is negligible, so that a tensor-parallel step of it is the framework's
work per split layer and the collectives' latency."""


def tensor_profile(tmp: Path, model: str = TENSOR_MODEL, data: str = TENSOR_DATA,
                   batch: int = TENSOR_BATCH) -> ModelProfile:
    """The GPT profiled by ``tandem profile`` on this machine (one process, one thread) at the
    run's batch (every tensor-parallel worker computes the whole batch); its layers record the
    allreduces tensor parallelism adds to each (``tensor_allreduces``)."""
    path = tmp / f"tensor-profile-{batch}.json"
    tandem("profile", "--model", model, "--data", data, "--batch-size", str(batch),
           "--repeats", "10", "-o", str(path))
    return ModelProfile.load(str(path))


def measure_tensor(degree: int, steps: int, model: str = TENSOR_MODEL, data: str = TENSOR_DATA,
                   batch: int = TENSOR_BATCH) -> float:
    """Rank 0's median step of ``tandem train --tensor-parallel degree --nproc degree``."""
    out = tandem("train", "--model", model, "--data", data, "--batch-size", str(batch),
                 "--steps", str(steps), "--nproc", str(degree), "--tensor-parallel", str(degree),
                 "--json", "--no-progress", "--log-every", str(steps))
    return float(json.loads(out.strip().splitlines()[-1])["step_time_s"])


def tensor_overhead(degree: int, steps: int, cluster: Cluster, options: SimOptions,
                    tmp: Path) -> tuple[float, list[float]]:
    """Seconds the runtime adds per tensor allreduce beyond the collective (DTensor's Python per
    split layer, and the trainer's per-step work the profile does not see, spread over them):
    the tiny GPT (:data:`TINY_MODEL`) run with ``degree`` workers, best of ``REPEATS``, minus its
    simulation on the calibrated ``cluster`` without it, over its allreduces per step."""
    profile = tensor_profile(tmp, TINY_MODEL, TINY_DATA, TINY_BATCH)
    plan = dataclasses.replace(data_parallel_plan(profile, 1), num_devices=degree,
                               tensor_degree=degree)
    runs = [measure_tensor(degree, steps, TINY_MODEL, TINY_DATA, TINY_BATCH)
            for _ in range(REPEATS)]
    simulated = simulate(plan, profile, cluster, options).step_time_s
    count = tensor_allreduce_count(profile, range(profile.num_layers), False) \
        + tensor_allreduce_count(profile, range(profile.num_layers), True)
    return max(0.0, (min(runs) - simulated) / count), runs


def tensor_part(steps: int, tmp: Path, cluster_for: Any, collective: dict[int, float],
                degrees: list[int]) -> list[dict[str, Any]]:
    """Tensor-parallel GPT with each of ``degrees`` (1: the baseline, one process), each
    ``REPEATS`` times, each run right after a profile, a measurement of how fast that many busy
    processes run at once and of the bandwidth of a gloo allreduce of one layer's output among
    them between computations (what a tensor allreduce meets); every quantity at its best of
    three, as in the real part, then the plan (one replica on ``degree`` devices) simulated."""
    print("tensor:", file=sys.stderr)
    rows = []
    for degree in degrees:
        profiles: list[ModelProfile] = []
        speeds: list[float] = []
        rates: list[float] = []
        bandwidths: list[float] = []
        measured: list[float] = []
        loads: list[float] = []
        for _ in range(REPEATS):
            profiles.append(tensor_profile(tmp))
            speeds.append(1.0 if degree == 1 else contention_speed(degree, tmp))
            rates.append(optimizer_rate(profiles[-1]))
            activation = int(max(layer.activation_bytes for layer in profiles[-1].layers))
            if degree > 1:
                bandwidths.append(busy_allreduce_bandwidth(
                    degree, activation, collective.get(degree, 0.0), tmp))
            measured.append(measure_tensor(degree, steps))
            loads.append(os.getloadavg()[0])
            print(f"  tensor {degree}: profile {profiles[-1].total_compute_s() * 1e3:.1f} ms, "
                  f"{degree} busy processes at {speeds[-1]:.2f}x, allreduce of {activation / 1e6:.1f}"
                  f" MB at {bandwidths[-1] / 1e9 if bandwidths else 0:.2f} GB/s, run "
                  f"{measured[-1] * 1e3:.1f} ms  (load {os.getloadavg()[0]:.1f})",
                  file=sys.stderr, flush=True)
        profile = _fastest(profiles)
        plan = dataclasses.replace(data_parallel_plan(profile, 1), num_devices=degree,
                                   tensor_degree=degree)
        cluster = dataclasses.replace(cluster_for(degree), speed=max(speeds))
        if bandwidths:
            level = dataclasses.replace(cluster.levels[0], bandwidth_Bps=max(bandwidths))
            cluster = dataclasses.replace(cluster, levels=(level,))
        options = SimOptions(optimizer_Bps=max(rates), allreduce="ring", record=False,
                             allreduce_latency_s=collective.get(degree))
        overhead, tiny_runs = (0.0, []) if degree == 1 else tensor_overhead(
            degree, steps, cluster, options, tmp)
        print(f"  tensor {degree}: runtime cost {overhead * 1e3:.2f} ms per tensor allreduce "
              f"(tiny gpt runs {', '.join(f'{r * 1e3:.1f}' for r in tiny_runs)} ms)",
              file=sys.stderr, flush=True)
        without = simulate(plan, profile, cluster, options).step_time_s
        options = dataclasses.replace(options, tensor_overhead_s=overhead)
        predicted = simulate(plan, profile, cluster, options).step_time_s
        # Each repeat on its own: its profile, speed and bandwidth, measured within a minute of
        # its run, against that run (under others' load the bests above come from different
        # minutes; these pairs show how far that moves the prediction).
        paired = []
        for index, run_s in enumerate(measured):
            own = dataclasses.replace(cluster_for(degree), speed=speeds[index] or 1e-3)
            if bandwidths:
                level = dataclasses.replace(own.levels[0], bandwidth_Bps=bandwidths[index])
                own = dataclasses.replace(own, levels=(level,))
            own_options = dataclasses.replace(options, optimizer_Bps=rates[index])
            paired.append(simulate(plan, profiles[index], own, own_options).step_time_s / run_s - 1)
        predicted_bare = simulate(plan, profile, cluster_for(degree),
                                  SimOptions(record=False)).step_time_s
        best = min(measured)
        rows.append({"case": f"tensor {degree}", "workers": degree, "measured_s": best,
                     "simulated_s": predicted, "error": predicted / best - 1,
                     "simulated_bare_s": predicted_bare, "error_bare": predicted_bare / best - 1,
                     "speed": max(speeds), "optimizer_Bps": max(rates),
                     "profile_s": profile.total_compute_s(), "runs_s": measured,
                     "speeds": speeds, "allreduce_Bps": max(bandwidths, default=None),
                     "tensor_overhead_s": overhead, "tiny_runs_s": tiny_runs,
                     "simulated_without_overhead_s": without, "paired_errors": paired,
                     "loads": loads})
    print_table(f"tensor: {TENSOR_MODEL}, batch {TENSOR_BATCH}, on the CPU", rows)
    for r in rows:
        print(f"{r['case']}: each repeat against its own run: "
              f"{', '.join(f'{e:+.1%}' for e in r['paired_errors'])} (load "
              f"{', '.join(f'{x:.1f}' for x in r['loads'])})")
    return rows


def _profile_path(batch: int, tmp: Path) -> Path:
    return tmp / f"real-{batch}.json"


def _fastest(profiles: list[ModelProfile]) -> ModelProfile:
    """The profile with the least total time (best of several, as runs are): a whole profile,
    not each layer at its own minimum, which would add up the luckiest layers."""
    return min(profiles, key=lambda profile: profile.total_compute_s())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="emulated,ranking,real")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cases", default="",
                        help="only these emulated/ranking cases, by name, separated by ';' "
                        "(e.g. 'dp 8;1f1b 8 stages, M=16')")
    parser.add_argument("--tensor-degrees", default="1,2",
                        help="tensor part: the degrees to run (default 1,2; 4 oversubscribes "
                        "the two cores)")
    parser.add_argument("--scale", type=float, default=2.0,
                        help="factor on VGG-16's profiled times (default 2: ~0.3-0.9 s steps)")
    args = parser.parse_args()
    parts = args.parts.split(",")
    summary: dict[str, Any] = {"steps": args.steps, "scale": args.scale}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        latency_s, bandwidth_Bps = local_link(tmp)
        print(f"gloo link here: {latency_s * 1e6:.0f} us latency, {bandwidth_Bps / 1e9:.2f} GB/s",
              file=sys.stderr, flush=True)
        summary["link"] = {"latency_s": latency_s, "bandwidth_Bps": bandwidth_Bps}
        profile = scaled_vgg(args.scale, tmp / "vgg.json")
        model = f"emulated:profile={tmp / 'vgg.json'},params=profiled,scale=1"

        degrees = [int(d) for d in args.tensor_degrees.split(",")] if "tensor" in parts else []
        chosen_cases = [case for part, cases in (("emulated", EMULATED), ("ranking", RANKING),
                                                 ("real", REAL)) if part in parts for case in cases]
        counts = sorted({case.workers for case in chosen_cases} - {1} | set(degrees) - {1})
        hops = {n: min(hop_latency(n, tmp) for _ in range(REPEATS)) for n in counts}
        print("message latency with every worker exchanging: " + ", ".join(
            f"{n} workers {v * 1e3:.2f} ms" for n, v in hops.items()), file=sys.stderr)
        summary["hop_latency_s"] = hops

        def cluster_for(n: int) -> Cluster:
            return local_cluster(max(n, 2), hops.get(n, latency_s), bandwidth_Bps)

        def bare_cluster_for(n: int) -> Cluster:
            return local_cluster(max(n, 2), latency_s, bandwidth_Bps)

        memo: dict[Case, float] = {}
        collective = {n: min(allreduce_step_latency(n, 55544, tmp) for _ in range(REPEATS))
                      for n in counts}
        print("allreduce step latency here: " + ", ".join(
            f"{n} workers {v * 1e3:.2f} ms" for n, v in collective.items()), file=sys.stderr)
        summary["allreduce_step_latency_s"] = collective
        if "emulated" in parts or "ranking" in parts:
            overhead = action_overhead(profile, model, "digits", VGG_BATCH, args.steps,
                                       bare_cluster_for(1), tmp)
            print(f"runtime cost per forward/backward: {overhead * 1e3:.2f} ms", file=sys.stderr)
            summary["action_overhead_s"] = overhead
            options = SimOptions(compute_overhead_s=overhead, allreduce="ring", record=False)
            bare = SimOptions(record=False)
        for part, cases in (("emulated", EMULATED), ("ranking", RANKING)):
            if part not in parts:
                continue
            print(f"{part}:", file=sys.stderr)
            chosen = [case for case in cases if not args.cases
                      or any(name.strip() == case.name for name in args.cases.split(";"))]
            rows = run_cases(chosen, profile, model, "digits", VGG_BATCH, args.steps, cluster_for,
                             options, bare, tmp, memo, collective, bare_cluster_for)
            print_table(f"{part}: VGG-16 profile on the emulated model (times x{args.scale})", rows)
            summary[part] = rows
        if "real" in parts:
            summary["real"] = real_part(args.steps, tmp, bare_cluster_for, collective,
                                        [name.strip() for name in args.cases.split(";") if name])
        if "tensor" in parts:
            summary["tensor"] = tensor_part(args.steps, tmp, bare_cluster_for, collective, degrees)
    summary.update(_verdicts(summary))
    print(json.dumps(summary))


def _verdicts(summary: dict[str, Any]) -> dict[str, Any]:
    verdict: dict[str, Any] = {}
    if "emulated" in summary:
        verdict["emulated_max_error"] = max(abs(r["error"]) for r in summary["emulated"])
        verdict["emulated_within_5pct"] = verdict["emulated_max_error"] <= 0.05
        families = [r for r in summary["emulated"] if r["case"].startswith(("ps ", "gossip "))]
        if families:
            verdict["families_max_error"] = max(abs(r["error"]) for r in families)
            verdict["families_within_10pct"] = verdict["families_max_error"] <= 0.10
    if "ranking" in summary:
        rows = summary["ranking"]
        by_sim = [r["case"] for r in sorted(rows, key=lambda r: r["simulated_s"])]
        by_measured = [r["case"] for r in sorted(rows, key=lambda r: r["measured_s"])]
        verdict["ranking_simulated"] = by_sim
        verdict["ranking_measured"] = by_measured
        verdict["ranking_matches"] = by_sim == by_measured
    if "real" in summary:
        verdict["real_max_error"] = max(abs(r["error"]) for r in summary["real"])
        verdict["real_within_15pct"] = verdict["real_max_error"] <= 0.15
    if "tensor" in summary:
        two = [r for r in summary["tensor"] if r["workers"] == 2]
        if two:
            verdict["tensor_2_error"] = two[0]["error"]
            verdict["tensor_2_within_15pct"] = abs(two[0]["error"]) <= 0.15
    return verdict


if __name__ == "__main__":
    main()
