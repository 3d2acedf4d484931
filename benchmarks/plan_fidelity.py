"""The planner's promises on real profiles: within the memory limit, never slower than data
parallelism or the flat plan at the slowest link, by its own simulator.

Run: ``python benchmarks/plan_fidelity.py`` (a table, then one JSON object on the last line).

Cases: PipeDream's VGG-16, ResNet-50 and GNMT profiles on 4, 8 and 16 devices, flat (10 Gb/s)
and two-level (servers of 4 devices at 16 GB/s, 10 Gb/s between them), without a memory limit
and with 16 GB and 4 GB per device, planned with the default schedule (1F1B) and with
PipeDream's (whose stashed minibatches make the limits bind). For each, the references are
simulated independently here: data parallelism on every device, and PipeDream's partition for
a flat cluster at the slowest link (budgeted for the same schedule), simulated on the real
cluster.
A row passes when the chosen plan's simulated peak fits the limit and its simulated step is no
slower than either reference that fits. ``error`` rows are limits no plan meets (the planner's
one-line message names the smallest memory that would do).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from tandem.cluster import Cluster, Level, flat_cluster, parse_cluster
from tandem.errors import UsageError
from tandem.planning import PartitionOptions, make_plan, partition_plan
from tandem.planning.simulate.simulator import data_parallel_plan, simulate
from tandem.profile import load_profile

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ROOT / "tests" / "data" / "profiles"
LIMITS = (None, 16e9, 4e9)


def clusters(devices: int) -> dict[str, Cluster]:
    """The flat and the two-level cluster of ``devices`` devices."""
    return {"flat": flat_cluster(num_devices=devices, bandwidth="10Gb/s"),
            "two-level": parse_cluster(f"4x16GB/s,{devices // 4}x10Gb/s")}


def flat_at_slowest(cluster: Cluster) -> Cluster:
    """A reference written here: every device on the slowest link."""
    slowest = min(level.bandwidth_Bps for level in cluster.levels)
    return Cluster(levels=(Level(num_units=cluster.num_devices, bandwidth_Bps=slowest),),
                   memory_bytes=cluster.memory_bytes)


def row(name: str, shape: str, cluster: Cluster, limit: float | None, schedule: str) -> dict:
    """Plan one case and check it against the references."""
    profile = load_profile(str(PROFILES / f"{name}.graph.txt"))
    limited = dataclasses.replace(cluster, memory_bytes=limit)
    entry = {"model": name, "devices": cluster.num_devices, "cluster": shape,
             "schedule": schedule, "limit_gb": None if limit is None else limit / 1e9}
    started = time.perf_counter()
    try:
        plan = make_plan(profile, limited, schedule=schedule)
    except UsageError as exc:
        entry.update(plan=None, error=str(exc), plan_s=time.perf_counter() - started, ok=True)
        return entry
    entry["plan_s"] = time.perf_counter() - started
    chosen = simulate(plan, profile, limited)
    dp = simulate(data_parallel_plan(profile, cluster.num_devices), profile, limited)
    references = {"dp": dp}
    try:
        flat = partition_plan(profile, flat_at_slowest(limited),
                              PartitionOptions(memory_bytes=limit, schedule=schedule))
        references["flat"] = simulate(flat.rescheduled(schedule), profile, limited)
    except UsageError:
        pass
    slower = [key for key, ref in references.items()
              if ref.fits_memory and chosen.step_time_s > ref.step_time_s * (1 + 1e-9)]
    entry.update(plan=plan.config, chosen=plan.options.get("chosen"),
                 step_ms=chosen.step_time_s * 1e3, estimate_ms=(plan.estimate_s or 0) * 1e3,
                 dp_ms=dp.step_time_s * 1e3, dp_fits=dp.fits_memory,
                 flat_ms=references["flat"].step_time_s * 1e3 if "flat" in references else None,
                 peak_gb=chosen.peak_memory_bytes / 1e9, fits=chosen.fits_memory,
                 slower_than=slower, ok=chosen.fits_memory and not slower)
    return entry


def cell(entry: dict) -> str:
    """``plan (chosen) ms GB`` or the smallest memory of an error."""
    if entry["plan"] is None:
        need = entry["error"].split("the smallest needs ")[1].split(";")[0]
        return f"none: needs {need}"
    mark = "" if entry["ok"] else " NO"
    return (f"{entry['plan'][:13]} {entry['chosen']} {entry['step_ms']:.1f} ms "
            f"{entry['peak_gb']:.2f} GB{mark}")


def main() -> None:
    rows = []
    print("| model | N | cluster | schedule | dp ms | " +
          " | ".join("no limit" if limit is None else f"{limit / 1e9:g} GB" for limit in LIMITS)
          + " |")
    print("|---|---|---|---|---|" + "---|" * len(LIMITS))
    for name in ("vgg16", "resnet50", "gnmt"):
        for devices in (4, 8, 16):
            for shape, cluster in clusters(devices).items():
                for schedule in ("1f1b", "pipedream"):
                    entries = [row(name, shape, cluster, limit, schedule) for limit in LIMITS]
                    rows += entries
                    dp = next((e["dp_ms"] for e in entries if e["plan"] is not None), None)
                    dp_text = f"{dp:.1f}" if dp is not None else "-"
                    print(f"| {name} | {devices} | {shape} | {schedule} | {dp_text} | "
                          + " | ".join(cell(e) for e in entries) + " |", flush=True)
    print(json.dumps({"cases": len(rows), "passed": sum(r["ok"] for r in rows),
                      "errors": sum(r["plan"] is None for r in rows),
                      "max_plan_s": max(r["plan_s"] for r in rows), "rows": rows}))


if __name__ == "__main__":
    main()
