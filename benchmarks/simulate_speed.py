"""How long the simulator takes for one step of large plans (target: under 2 s each).

Cases: data parallelism on 1,024 devices (VGG-16, servers of 8 on 25 Gb/s; 1,024 workers, DDP
buckets) and 64-stage pipelines of ResNet-50 (176 layers, compute-balanced stages) under 1F1B and
GPipe with 64 and 256 micro-batches, and PipeDream's asynchronous schedule (its steady state needs
a run of a few hundred minibatches). Each case is simulated ``--repeats`` times, timeline
recorded, and the best time is reported (the machine is shared).

    .venv/bin/python benchmarks/simulate_speed.py [--repeats 3]

Prints a table, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from tandem.cluster import parse_cluster  # noqa: E402
from tandem.plan import Plan  # noqa: E402
from tandem.planning.search.balance import balanced_plan  # noqa: E402
from tandem.planning.simulate.simulator import SimOptions, data_parallel_plan, simulate  # noqa: E402
from tandem.profile import load_profile  # noqa: E402

PROFILES = ROOT / "tests" / "data" / "profiles"
TARGET_S = 2.0


def cases() -> list[tuple[str, Plan, str]]:
    """``(name, plan, cluster spec)``."""
    vgg = load_profile(str(PROFILES / "vgg16.graph.txt"))
    resnet = load_profile(str(PROFILES / "resnet50.graph.txt"))
    servers = "8x300GB/s,128x25Gb/s"
    listed = [("dp, 1024 devices (VGG-16)", data_parallel_plan(vgg, 1024), servers)]
    for kind, micro in (("1f1b", 64), ("1f1b", 256), ("gpipe", 256), ("pipedream", None)):
        plan = balanced_plan(resnet, [1] * 64, schedule=kind, num_microbatches=micro)
        label = f"{kind}, 64 stages" + (f", M={micro}" if micro else "") + " (ResNet-50)"
        listed.append((label, plan, "8x300GB/s,8x25Gb/s"))
    return listed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    profiles = {64: load_profile(str(PROFILES / "resnet50.graph.txt")),
                1024: load_profile(str(PROFILES / "vgg16.graph.txt"))}
    rows = []
    print(f"{'case':<40} {'workers':>7} {'micro':>8} {'events':>8} {'best s':>8} {'target':>7}")
    for name, plan, spec in cases():
        profile = profiles[64 if "ResNet" in name else 1024]
        cluster = parse_cluster(spec)
        times, result = [], None
        for _ in range(args.repeats):
            started = time.perf_counter()
            result = simulate(plan, profile, cluster, SimOptions(num_steps=1))
            times.append(time.perf_counter() - started)
        assert result is not None
        events = len(result.timeline.events)
        best = min(times)
        rows.append({"case": name, "workers": len(result.workers), "events": events,
                     "microbatches": result.num_microbatches, "best_s": best,
                     "step_time_s": result.step_time_s, "under_target": best < TARGET_S})
        print(f"{name:<40} {len(result.workers):>7} {result.num_microbatches:>8} {events:>8} "
              f"{best:8.3f} {'ok' if best < TARGET_S else 'SLOW':>7}")
    print(json.dumps({"target_s": TARGET_S, "all_under_target": all(r["under_target"] for r in rows),
                      "cases": rows}))


if __name__ == "__main__":
    main()
