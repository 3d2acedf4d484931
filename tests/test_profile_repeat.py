"""Profiles that repeat: two profiles of one user model, taken while another process keeps a
core busy, give the same stage split; identical blocks share one figure; the statistic."""

from __future__ import annotations

import subprocess
import sys
import time
import warnings

import pytest
import torch
from torch import nn

from tandem.errors import MachineWarning
from tandem.plan import Plan, Stage
from tandem.runtime.pipeline.bounds import profiled_plan
from tandem.runtime.pipeline.setup import pipeline_blocks
from tandem.runtime.profiler import profile_model, robust_s, signature
from tandem.spec.kinds import ScheduleKind

pytestmark = pytest.mark.cli  # the busy process is a subprocess


class Residual(nn.Module):
    """A user's block: layer normalization, then a linear layer."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm(x))


class Stack(nn.Module):
    """Eight identical blocks, as a user writes a model (not an ``nn.Sequential``)."""

    def __init__(self, dim: int = 64, depth: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Residual(dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Samples:
    """A dataset's training rows as the run gives them to the auto-split (``.inputs``)."""

    def __init__(self, inputs: torch.Tensor) -> None:
        self.inputs = inputs

    def __len__(self) -> int:
        return len(self.inputs)


def _even_plan(num_blocks: int, num_stages: int) -> Plan:
    step = num_blocks // num_stages
    stages = [Stage(start=s * step, end=(s + 1) * step, replicas=1) for s in range(num_stages)]
    return Plan(stages=stages, num_layers=num_blocks, num_devices=num_stages,
                schedule=ScheduleKind.ONE_F_ONE_B, num_microbatches=num_stages)


def test_two_profiles_under_load_give_the_same_split() -> None:
    """The issue's case: under CPU contention identical LayerNorm layers measured 12.8 ms and
    0.04 ms in one profile, and two runs cut the model differently."""
    torch.manual_seed(0)
    model = Stack()
    data = Samples(torch.randn(64, 64))
    blocks = pipeline_blocks(model, data.inputs[:2], what="model 'Stack'")
    assert len(blocks) == 16  # the norm and the linear layer of each block, automatically
    plan = _even_plan(len(blocks), 4)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", MachineWarning)  # a busy machine may say so
            splits = [[(s.start, s.end) for s in profiled_plan(plan, blocks, data, batch_size=64,
                                                               threads=1).stages]
                      for _ in range(2)]
    finally:
        busy.kill()
        busy.wait()
    assert splits[0] == splits[1] == [(0, 4), (4, 8), (8, 12), (12, 16)]


def test_identical_blocks_share_one_figure() -> None:
    torch.manual_seed(0)
    profile = profile_model(Stack(dim=32, depth=4), torch.randn(16, 32), warmup=1, repeats=3)
    norms, linears = profile.layers[0::2], profile.layers[1::2]
    for group in (norms, linears):
        assert len({(layer.forward_s, layer.backward_s) for layer in group}) == 1
        assert len({(layer.forward_fixed_s, layer.backward_fixed_s) for layer in group}) == 1
    assert profile.layers[0].forward_s > 0 and profile.layers[1].backward_s > 0


def test_signature_tells_different_blocks_apart() -> None:
    x = torch.randn(4, 8)
    same = [signature(nn.Linear(8, 8), x, x), signature(nn.Linear(8, 8), x, x)]
    assert same[0] == same[1]
    assert signature(nn.Linear(8, 8, bias=False), x, x) != same[0]
    assert signature(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), x, x) \
        != signature(nn.Sequential(nn.Linear(8, 8), nn.GELU()), x, x)


def test_robust_s_ignores_a_slow_burst() -> None:
    assert robust_s([1.0, 9.0, 9.0, 2.0, 2.0, 1.5, 3.0, 9.0, 2.5]) == 2.0  # medians 9, 2, 3
    assert robust_s([5.0, 1.0, 3.0]) == 3.0  # one group: its median
    assert robust_s([4.0]) == 4.0
    with pytest.raises(ValueError):
        robust_s([])


class Hidden(nn.Module):
    """A block whose cost hides in a private attribute, so that blocks of different cost look
    identical: the profiler measures them again, warns, and gives both their median."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self._delay_s = delay_s
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self._delay_s)
        return self.linear(x)


def test_identical_blocks_that_disagree_are_measured_again_and_named() -> None:
    model = nn.Sequential(Hidden(0.0), Hidden(2e-2), nn.Linear(4, 2))  # 20 ms: beyond load noise
    with pytest.warns(MachineWarning, match=r"2 identical blocks \(0, 1: Hidden\) took .* ms "
                                            r"forward even when measured again"):
        profile = profile_model(model, torch.randn(8, 4), warmup=0, repeats=3)
    first, second, last = profile.layers
    assert first.forward_s == second.forward_s >= 1.5e-3  # the median of the two
    assert last.forward_s < first.forward_s


def test_profiling_runs_on_one_thread_and_restores_the_setting() -> None:
    seen: list[int] = []

    class Spy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(torch.get_num_threads())
            return x * 2

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        profile_model(nn.Sequential(Spy(), nn.Linear(4, 4)), torch.randn(4, 4), warmup=0, repeats=1)
        assert set(seen) == {1} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
