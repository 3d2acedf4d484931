"""Planner speed: tandem's partitioner vs a direct transcription of PipeDream's dynamic program.

Run: ``python benchmarks/plan_speed.py`` (prints a table; the last stdout line is one JSON object).

Cases: ResNet-50 (PipeDream's profile) on 16 devices at 10 Gb/s against the naive loop nest;
a 1,000-layer chain on 1,024 flat devices; ResNet-50 on 16 servers x 8 devices. Every time,
the references' as much as tandem's, is the best of ``REPEATS`` samples, a sample being enough
back-to-back runs to last ``SAMPLE_S`` (a single run for anything slower) divided by their
number, as ``timeit`` does; every run solves afresh (the partitioner's remembered solves,
``planning/partition/memo.py``, are forgotten before each, outside the timing). Times cover
building the states from a loaded profile; reading the profile is not timed, except in
reference B, which is PipeDream's whole procedure from the file.

The whole planner, as a user runs it: ``tandem plan`` (partitioner, candidates, simulations,
output) for ResNet-50 on 16 devices at 10 Gb/s, on ``4x16GB/s,4x10Gb/s`` with
``--schedule pipedream --memory 16GB`` and for the 1,000-layer chain on 1,024 devices,
the chain in three modes (the default 1F1B, whose free plan fits the flat cluster's 16 GB;
``--schedule pipedream``, whose free plan does not, so the partitioner solves under the limit;
``--memory 120MB``, a limit that binds every plan), each in its own process, once: wall seconds
from start to exit, CPU seconds (user and system: what a loaded machine does not inflate) and
the process's peak resident memory (``os.wait4``'s ``ru_maxrss``).
Targets (issue 28): the chain under 10 s (wall, and CPU) and 1 GB in every mode.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, TypeVar

from tandem.cluster import flat_cluster, parse_cluster
from tandem.planning import PartitionOptions
from tandem.planning.partition import memo
from tandem.planning.partition.pipedream import partition
from tandem.planning.partition.antichain import build_states
from tandem.profile import LayerProfile, ModelProfile, load_profile

ROOT = Path(__file__).resolve().parent.parent
RESNET = ROOT / "tests" / "data" / "profiles" / "resnet50.graph.txt"
T = TypeVar("T")


def naive_dp(
    profile: ModelProfile, machines: int, bandwidth_Bps: float, ratio: float | None
) -> float:
    """PipeDream's final-level recurrence written as plain nested loops (the reference)."""
    states = build_states(profile)
    n = states.num_states
    compute, params, cut = (list(map(float, a)) for a in
                            (states.compute_s, states.parameter_bytes, states.cut_bytes))  # fmt: skip
    below = [[k for k in range(n) if states.below[k, j]] for j in range(n)]
    best = [[math.inf] * machines for _ in range(n)]
    for j in range(n):
        for m in range(machines):
            comm = 4 * m * params[j] / (bandwidth_Bps * (m + 1))
            best[j][m] = (compute[j] + comm) / (m + 1)
    for m in range(1, machines):
        for j in range(1, n):
            value = best[j][m]
            for k in below[j]:
                for r in range(1, m + 1):
                    stage = compute[j] - compute[k]
                    stage_params = params[j] - params[k]
                    t = max(best[k][m - r],
                            (stage + 4 * (r - 1) * stage_params / (bandwidth_Bps * r)) / r)
                    if ratio is not None:
                        t = max(t, 2.0 * cut[k] / (bandwidth_Bps * r) / ratio)
                        if j < n - 1:
                            t = max(t, 2.0 * cut[j] / (bandwidth_Bps * r) / ratio)
                    value = min(value, t)
            best[j][m] = value
    return best[n - 1][machines - 1]


def pipedream_transcription(
    path: Path, machines: int, bandwidth_Bps: float, ratio: float | None
) -> float:
    """PipeDream's whole procedure re-derived in tests/: antichain DAG by its steps, then the DP."""
    reference = ROOT / "tests" / "test_partition_pipedream.py"
    spec = importlib.util.spec_from_file_location("reference", reference)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.reference_optimum(module.reference_states(path), machines, bandwidth_Bps, ratio)


def chain(num_layers: int, seed: int = 0) -> ModelProfile:
    """A chain of random layers (1-5 ms forward, 2-10 ms backward, MB-sized tensors)."""
    rng = random.Random(seed)
    return ModelProfile(layers=[
        LayerProfile(name=f"layer{i}", forward_s=rng.uniform(1e-3, 5e-3),
                     backward_s=rng.uniform(2e-3, 1e-2), activation_bytes=rng.uniform(1e6, 2e7),
                     parameter_bytes=rng.uniform(1e5, 4e6))
        for i in range(num_layers)])  # fmt: skip


MEASURE = """
import json, os, subprocess, sys, time
started = time.perf_counter()
child = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
_, status, usage = os.wait4(child.pid, 0)
print(json.dumps({"s": time.perf_counter() - started, "kb": usage.ru_maxrss,
                  "cpu": usage.ru_utime + usage.ru_stime,
                  "code": os.waitstatus_to_exitcode(status),
                  "stderr": child.stderr.read().decode()[-500:]}))
"""
"""Runs a command and prints its wall seconds, CPU seconds (user and system) and peak resident
kilobytes. It runs in a fresh
interpreter: a process's peak memory carries over a fork and an exec, so a command started
from this benchmark's own (large) process would report at least that process's memory."""


def plan_command(*argv: str) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds and peak resident megabytes of ``tandem plan ARGV`` in a process
    of its own (its output discarded; a failure raises)."""
    command = [sys.executable, "-m", "tandem", "plan", *argv]
    measured = subprocess.run([sys.executable, "-c", MEASURE, *command], check=True,
                              capture_output=True, text=True)
    result = json.loads(measured.stdout)
    if result["code"] != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {result['stderr']}")
    return result["s"], result["cpu"], result["kb"] / 1024  # ru_maxrss: kilobytes on Linux


CHAIN_MODES = {"": (), "_pipedream": ("--schedule", "pipedream"),
               "_memory120mb": ("--memory", "120MB")}
"""The chain's ``tandem plan`` runs: a key suffix and the flags beside the profile and cluster."""


def whole_commands() -> dict[str, float]:
    """``tandem plan`` on ResNet-50 (16 flat devices; servers of 4 under PipeDream's schedule
    and 16 GB, a hierarchy whose walk down the memory grid solves every point) and on the
    1,000-layer chain (1,024 devices) in each of :data:`CHAIN_MODES`: wall seconds, CPU seconds
    and peak megabytes of each."""
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "chain1000.json")
        chain(1000).save(path)
        runs = {"resnet50_16": ("--profile", str(RESNET), "--devices", "16", "--bandwidth",
                                "10Gb/s"),
                "resnet50_4x4_pipedream": ("--profile", str(RESNET), "--cluster",
                                           "4x16GB/s,4x10Gb/s", "--schedule", "pipedream",
                                           "--memory", "16GB")}
        runs.update({f"chain1000_1024{suffix}": ("--profile", path, "--devices", "1024",
                                                 "--bandwidth", "10Gb/s", *flags)
                     for suffix, flags in CHAIN_MODES.items()})
        for name, argv in runs.items():
            wall, cpu, peak = plan_command(*argv)
            figures.update({f"plan_cmd_{name}_s": wall, f"plan_cmd_{name}_cpu_s": cpu,
                            f"plan_cmd_{name}_peak_mb": peak})
    return figures


REPEATS = 3
"""Each case is timed in this many samples and the best sample reported."""
SAMPLE_S = 0.2
"""A sample runs a case back to back until it lasts about this long (one run when slower)."""


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """``fn()``'s result and its seconds per run in the best of ``REPEATS`` samples (as timeit)."""
    result, first = _run(fn, 1)
    samples = [first] if first >= SAMPLE_S else []
    number = 1 if samples else max(1, math.ceil(SAMPLE_S / _run(fn, 1)[1]))
    while len(samples) < REPEATS:
        samples.append(_run(fn, number)[1])
    return result, min(samples)


def _run(fn: Callable[[], T], number: int) -> tuple[T, float]:
    """The last result of ``number`` back-to-back runs and the seconds per run, each run solving
    afresh (the partitioner's remembered solves forgotten before it, untimed)."""
    total = 0.0
    for _ in range(number):
        memo.forget()
        started = time.perf_counter()
        result = fn()
        total += time.perf_counter() - started
    return result, total / number


Row = tuple[str, float, str, float]
"""A table row: case, best solve seconds, configuration, bottleneck seconds."""


def main() -> None:
    resnet = load_profile(str(RESNET))
    options = PartitionOptions(activation_compression=1.0)
    flat16 = flat_cluster(num_devices=16, bandwidth="10Gb/s")
    solved, tandem_s = timed(lambda: partition(resnet, flat16, options))
    naive, naive_s = timed(lambda: naive_dp(resnet, 16, 1.25e9, 1.0))
    full, full_s = timed(lambda: pipedream_transcription(RESNET, 16, 1.25e9, 1.0))
    for reference in (naive, full):
        assert abs(reference - solved.bottleneck_s) <= 1e-9 * reference, (reference, solved)
    layers = chain(1000)
    flat1024 = flat_cluster(num_devices=1024, bandwidth="10Gb/s")
    big, big_s = timed(lambda: partition(layers, flat1024, options))
    two_level = parse_cluster("8x300GB/s,16x25Gb/s")
    hier, hier_s = timed(lambda: partition(resnet, two_level, options))
    rows: list[Row] = [
        ("resnet50, 16 devices @ 10Gb/s", tandem_s, solved.level_configs[-1], solved.bottleneck_s),
        ("chain 1000 layers, 1024 devices", big_s, f"{len(big.stages)} stages", big.bottleneck_s),
        ("resnet50, 16 servers x 8 devices", hier_s, " / ".join(hier.level_configs),
         hier.bottleneck_s),
        ("naive loop nest on tandem states", naive_s, "(reference A)", naive),
        ("PipeDream procedure transcribed", full_s, "(reference B)", full),
    ]  # fmt: skip
    commands = whole_commands()
    targets = {"speedup_at_least_100x": naive_s / tandem_s >= 100,
               "chain_under_10s": big_s < 10, "hierarchical_under_10s": hier_s < 10}
    for suffix in CHAIN_MODES:
        name = f"plan_cmd_chain{suffix}"
        targets[f"{name}_under_10s"] = commands[f"plan_cmd_chain1000_1024{suffix}_s"] < 10
        targets[f"{name}_under_10s_cpu"] = commands[f"plan_cmd_chain1000_1024{suffix}_cpu_s"] < 10
        targets[f"{name}_under_1gb"] = commands[f"plan_cmd_chain1000_1024{suffix}_peak_mb"] < 1000
    report(rows, naive_s / tandem_s, full_s / tandem_s, targets)
    print("tandem plan, whole command (one run each): wall s, CPU s, peak MB")
    names = {"resnet50_16": "resnet50 on 16 devices",
             "resnet50_4x4_pipedream": "resnet50 on 4x16GB/s,4x10Gb/s, pipedream, 16GB",
             **{f"chain1000_1024{suffix}": f"1000-layer chain on 1024 devices "
                f"{' '.join(flags) or '(default)'}" for suffix, flags in CHAIN_MODES.items()}}
    for key, name in names.items():
        print(f"  {name}: {commands[f'plan_cmd_{key}_s']:.2f} s, "
              f"{commands[f'plan_cmd_{key}_cpu_s']:.2f} s CPU, "
              f"{commands[f'plan_cmd_{key}_peak_mb']:.0f} MB")
    print(json.dumps({
        "resnet50_16_tandem_s": tandem_s, "resnet50_16_naive_s": naive_s,
        "resnet50_16_speedup_vs_loop_nest": naive_s / tandem_s,
        "resnet50_16_transcription_s": full_s,
        "resnet50_16_speedup_vs_transcription": full_s / tandem_s, "chain1000_1024_s": big_s,
        "resnet50_16x8_s": hier_s, "same_bottleneck": True, "repeats": REPEATS, **commands,
        **targets,
    }))


def report(rows: list[Row], vs_loop_nest: float, vs_transcription: float,
           targets: dict[str, bool]) -> None:  # fmt: skip
    """Print the table, the speedups and whether each target is met."""
    case = f"case (best of {REPEATS})"
    print(f"{case:<34} {'solve s':>9}  {'bottleneck ms':>13}  config")
    for name, seconds, config, bottleneck in rows:
        print(f"{name:<34} {seconds:9.3f}  {bottleneck * 1e3:13.4f}  {config[:60]}")
    print(f"speedup: {vs_loop_nest:.0f}x over the loop nest alone, "
          f"{vs_transcription:.0f}x over the whole transcribed procedure")
    print("targets: " + ", ".join(f"{name} {'met' if met else 'MISSED'}"
                                  for name, met in targets.items()))  # fmt: skip


if __name__ == "__main__":
    main()
