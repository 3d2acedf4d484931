"""How much a profile varies: per-layer times of one user model profiled again and again, on a
quiet machine and with another process keeping a core busy, and the stage splits they give.

Run: ``python benchmarks/profile_repeat.py [--profiles 10]`` (prints a table; the last stdout
line is one JSON object).

Two user models (not ``nn.Sequential``; a batch of 64, 64 features in), split automatically and
planned on 4 stages: ``stack``, eight identical blocks (layer normalization, then a linear
layer) cut into 16 blocks, and ``taper``, eight linear layers of falling width (256 to 32), each
followed by a ReLU, cut into 16 blocks no two of which are alike. Two statistics are compared
on the same machine, one thread each:

- ``tandem``: :func:`tandem.runtime.profiler.profile_model` as the auto-split runs it (rounds
  over every block, 1 warm-up round, the least of the medians of groups of three of 21
  repeats, identical blocks sharing their median; no fixed-cost fit);
- ``median of 3``: the profiler before issue 28 (each block alone, 1 warm-up, the median of 3
  repeats, every block its own figure).

Figures per condition: the coefficient of variation (standard deviation over mean) of a
layer's repeats within one profile (median over layers and profiles); of a layer's figure
across profiles (median and largest over layers), and of its share of the model's total (what
the split depends on: a busy machine that slows every layer alike moves no cut); the largest
ratio between the own figures of two identical layers in one profile (before tandem's profiler
lets them share one: for ``tandem``, the least of the medians of groups of three of one more
set of 21 rounds); and the number of distinct splits among the profiles.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable

import torch
from torch import nn

from tandem.planning.search.balance import pipeline_bounds
from tandem.profile import LayerProfile, ModelProfile
from tandem.runtime.pipeline.bounds import PROFILE_REPEATS, PROFILE_WARMUP
from tandem.runtime.pipeline.setup import pipeline_blocks
from tandem.runtime.profiler import measure_rounds, profile_model, robust_s, threads_set

STAGES = 4


class Residual(nn.Module):
    """Layer normalization, then a linear layer."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm(x))


class Stack(nn.Module):
    """Eight identical blocks."""

    def __init__(self, dim: int = 64, depth: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Residual(dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Taper(nn.Module):
    """Linear layers of falling width, each followed by a ReLU: no two blocks alike."""

    def __init__(self, widths: tuple[int, ...] = (64, 256, 224, 192, 160, 128, 96, 64, 32)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _cv(values: list[float]) -> float:
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean > 0 else 0.0


Measure = Callable[[nn.Sequential, torch.Tensor], tuple[list[float], list[list[float]]]]
"""A way to profile: each block's seconds, and each block's repeats."""


def median_of_3(blocks: nn.Sequential, inputs: torch.Tensor
                ) -> tuple[list[float], list[list[float]]]:
    """Each block's forward+backward seconds as the profiler before issue 28 measured them
    (the block alone: 1 warm-up, the median of 3), and each block's repeats."""
    times, repeats, value = [], [], inputs
    with threads_set(1), torch.no_grad():
        values = []
        for block in blocks:
            values.append(value)
            value = block(value)
    with threads_set(1):
        for block, value in zip(blocks, values):
            samples = measure_rounds([block], [value], warmup=1, repeats=3,
                                     device=torch.device("cpu"))[0]
            sums = [f + b for f, b in zip(samples.forward_s, samples.backward_s)]
            times.append(statistics.median(sums))
            repeats.append(sums)
    return times, repeats


def tandem_profile(blocks: nn.Sequential, inputs: torch.Tensor
                   ) -> tuple[list[float], list[list[float]]]:
    """Each block's forward+backward seconds by tandem's profiler, and each block's repeats of
    one more set of rounds (what the profiler's statistic is taken over)."""
    profile = profile_model(blocks, inputs, warmup=PROFILE_WARMUP, repeats=PROFILE_REPEATS,
                            fit_fixed=False)
    with threads_set(1), torch.no_grad():
        values, value = [], inputs
        for block in blocks:
            values.append(value)
            value = block(value)
    with threads_set(1):
        rounds = measure_rounds(list(blocks), values, warmup=PROFILE_WARMUP,
                                repeats=PROFILE_REPEATS, device=torch.device("cpu"))
    return ([layer.compute_s for layer in profile.layers],
            [[f + b for f, b in zip(s.forward_s, s.backward_s)] for s in rounds])


def _split(times: list[float]) -> tuple[tuple[int, int], ...]:
    profile = ModelProfile(layers=[LayerProfile(name=str(i), forward_s=t / 2, backward_s=t / 2,
                                                activation_bytes=0.0, parameter_bytes=0.0)
                                   for i, t in enumerate(times)])
    return tuple(pipeline_bounds(profile, [1] * STAGES))


def condition(blocks: nn.Sequential, inputs: torch.Tensor, count: int,
              measure: Measure,
              identical: bool) -> dict[str, object]:
    """Profile ``count`` times; the figures of the module docstring."""
    figures: list[list[float]] = []
    within: list[float] = []
    ratios: list[float] = []
    splits: list[tuple[tuple[int, int], ...]] = []
    for _ in range(count):
        times, repeats = measure(blocks, inputs)
        figures.append(times)
        within.extend(_cv(r) for r in repeats if len(r) > 1)
        if identical:
            own = [robust_s(r) for r in repeats]  # each layer's figure before any sharing
            ratios.append(max(max(g) / min(g) for g in (own[0::2], own[1::2])))
        splits.append(_split(times))
    across = [_cv([f[i] for f in figures]) for i in range(len(figures[0]))]
    shares = [[t / sum(f) for t in f] for f in figures]  # what the split depends on
    relative = [_cv([f[i] for f in shares]) for i in range(len(shares[0]))]
    return {"within_cv_median": statistics.median(within),
            "across_cv_median": statistics.median(across), "across_cv_max": max(across),
            "share_cv_median": statistics.median(relative), "share_cv_max": max(relative),
            "identical_ratio_max": max(ratios) if ratios else None,
            "distinct_splits": len(set(splits)),
            "splits": sorted({"|".join(f"{a}-{b - 1}" for a, b in s) for s in splits}),
            "mean_layer_ms": statistics.fmean(statistics.fmean(f) for f in figures) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profiles", type=int, default=10, help="profiles per condition")
    args = parser.parse_args()
    torch.manual_seed(0)
    inputs = torch.randn(64, 64)
    models = {"stack": pipeline_blocks(Stack(), inputs[:2], what="model 'Stack'"),
              "taper": pipeline_blocks(Taper(), inputs[:2], what="model 'Taper'")}
    results: dict[str, dict[str, object]] = {}
    for load in ("quiet", "busy"):
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load == "busy" \
            else None
        try:
            for model, blocks in models.items():
                for name, measure in (("median of 3", median_of_3), ("tandem", tandem_profile)):
                    results[f"{model}, {load}, {name}"] = condition(
                        blocks, inputs, args.profiles, measure, identical=model == "stack")
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
    print(f"{'condition':<28} {'CV in':>6} {'across':>7} {'max':>6} {'share':>6} {'max':>6} "
          f"{'same x':>7} {'splits':>6}  layer ms")
    for name, row in results.items():
        ratio = row["identical_ratio_max"]
        print(f"{name:<28} {row['within_cv_median']:6.3f} {row['across_cv_median']:7.3f} "
              f"{row['across_cv_max']:6.3f} {row['share_cv_median']:6.3f} "
              f"{row['share_cv_max']:6.3f} "
              f"{'-' if ratio is None else format(ratio, '.2f'):>7} {row['distinct_splits']:6d}  "
              f"{row['mean_layer_ms']:.4f}")
    print(json.dumps({"profiles": args.profiles, "cores": os.cpu_count(),
                      "load_average": os.getloadavg()[0], "torch": torch.__version__,
                      "results": results}))


if __name__ == "__main__":
    main()
