"""The fixed cost per micro-batch: measured by the profiler, stored in the profile (with a
documented default for profiles that do not record it), charged by the simulator and waited by
the emulated model, so that the best micro-batch count is no longer always the largest.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from tandem.cluster import Cluster, Level
from tandem.data import build_dataset
from tandem.errors import UsageError
from tandem.models import build_model
from tandem.plan import Plan, Stage
from tandem.planning.simulate.simulator import SimOptions, simulate
from tandem.profile import (
    DEFAULT_BACKWARD_FIXED_S,
    DEFAULT_FORWARD_FIXED_S,
    LayerProfile,
    ModelProfile,
    from_pipedream_graph,
)
from tandem.runtime.profiler import fit_batches, fit_fixed_s, profile_model
from tests.conftest import run_cli

pytestmark = pytest.mark.pure

MICROBATCHES = [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32]


def counts(schedule: str) -> list[int]:
    """The micro-batch counts tried (1F1B needs at least as many as its 4 stages)."""
    return [m for m in MICROBATCHES if schedule == "gpipe" or m >= 4]


def chain(num_layers: int, *, forward_s: float, backward_s: float, forward_fixed_s: float,
          backward_fixed_s: float) -> ModelProfile:
    """Equal layers that send nothing (so only compute shapes the step)."""
    return ModelProfile(layers=[
        LayerProfile(name=f"l{i}", forward_s=forward_s, backward_s=backward_s,
                     activation_bytes=0.0, parameter_bytes=0.0, forward_fixed_s=forward_fixed_s,
                     backward_fixed_s=backward_fixed_s)
        for i in range(num_layers)], batch_size=96)


def pipeline(num_stages: int, schedule: str, microbatches: int) -> Plan:
    return Plan(stages=[Stage(start=i, end=i + 1, replicas=1) for i in range(num_stages)],
                num_layers=num_stages, num_devices=num_stages, schedule=schedule,
                num_microbatches=microbatches)


def step_s(profile: ModelProfile, schedule: str, microbatches: int,
           options: SimOptions | None = None) -> float:
    cluster = Cluster(levels=(Level(num_units=profile.num_layers, bandwidth_Bps=1e12,
                                    latency_s=0.0),))
    plan = pipeline(profile.num_layers, schedule, microbatches)
    return simulate(plan, profile, cluster, options or SimOptions(record=False)).step_time_s


# Four stages; per minibatch 4 ms forward and 8 ms backward each, of which 0.25 ms and 0.75 ms
# are paid per call. A flush pipeline of S equal stages without communication takes
# (M + S - 1) (c + V / M) per step, c = 1 ms the fixed part of a forward plus a backward and
# V = 11 ms the rest: smallest at M = sqrt((S - 1) V / c) = 5.74, so 6 of the counts tried.
FOUR = chain(4, forward_s=4e-3, backward_s=8e-3, forward_fixed_s=0.25e-3, backward_fixed_s=0.75e-3)


def formula_s(microbatches: int, stages: int = 4, fixed_s: float = 1e-3, rest_s: float = 11e-3) -> float:
    return (microbatches + stages - 1) * (fixed_s + rest_s / microbatches)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_best_microbatch_count_is_interior_with_a_fixed_cost(schedule: str) -> None:
    simulated = {m: step_s(FOUR, schedule, m) for m in counts(schedule)}
    for m, seconds in simulated.items():
        assert seconds == pytest.approx(formula_s(m), rel=1e-9)
    best = min(simulated, key=simulated.__getitem__)
    assert best == min(counts(schedule), key=formula_s) == 6
    assert math.floor(math.sqrt(3 * 11)) <= best <= math.ceil(math.sqrt(3 * 11))
    assert simulated[32] > simulated[6] and simulated[4] > simulated[6]  # a U, not a slope


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_without_a_fixed_cost_the_largest_count_is_best(schedule: str) -> None:
    free = chain(4, forward_s=4e-3, backward_s=8e-3, forward_fixed_s=0.0, backward_fixed_s=0.0)
    tried = counts(schedule)
    simulated = {m: step_s(free, schedule, m) for m in tried}
    assert all(simulated[a] > simulated[b] for a, b in zip(tried, tried[1:]))
    for m, seconds in simulated.items():
        assert seconds == pytest.approx(formula_s(m, fixed_s=0.0, rest_s=12e-3), rel=1e-9)
    off = SimOptions(record=False, charge_fixed_costs=False)
    assert step_s(FOUR, schedule, 8, off) == pytest.approx(simulated[8], rel=1e-12)


def test_the_profiled_minibatch_already_holds_one_fixed_cost() -> None:
    # One micro-batch is the profiled minibatch: its time is the profile's, not plus a fixed cost.
    assert step_s(FOUR, "gpipe", 1) == pytest.approx(4 * 12e-3, rel=1e-12)


def test_overhead_option_adds_to_the_profile_fixed_cost() -> None:
    extra = SimOptions(record=False, compute_overhead_s=0.5e-3)
    assert step_s(FOUR, "1f1b", 6, extra) == pytest.approx(formula_s(6, fixed_s=2e-3), rel=1e-9)
    with pytest.raises(UsageError, match="overhead"):
        SimOptions(compute_overhead_s=-1e-3)


def test_data_parallel_families_pay_it_too() -> None:
    # A parameter-server plan (its own model of one stage) charges the fixed cost per call too.
    from tandem.planning.simulate.families import family_costs
    from tandem.spec.sync import ParameterServerSync

    one = chain(1, forward_s=4e-3, backward_s=8e-3, forward_fixed_s=1e-3, backward_fixed_s=2e-3)
    plan = Plan(stages=[Stage(start=0, end=1, replicas=2)], num_layers=1, num_devices=3,
                schedule="1f1b", num_microbatches=2, sync=ParameterServerSync(servers=1))
    cluster = Cluster(levels=(Level(num_units=3, bandwidth_Bps=1e12, latency_s=0.0),))
    costs = family_costs(plan, one, cluster, SimOptions())
    assert costs.forward_s == pytest.approx(1e-3 + 3e-3 / 2)
    assert costs.backward_s == pytest.approx(2e-3 + 6e-3 / 2)


# -- the profile: stored, read back, defaults -----------------------------------------------

def test_json_round_trip_keeps_fixed_costs(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    FOUR.save(str(path))
    again = ModelProfile.load(str(path))
    assert again.to_dict() == FOUR.to_dict()
    assert again.layers[0].forward_fixed_s == 0.25e-3 and again.layers[0].backward_fixed_s == 0.75e-3
    assert again.fixed_costs == "given"


def test_version_1_files_read_with_the_documented_default(tmp_path: Path) -> None:
    old = {"schema_version": 1, "model": "m", "batch_size": 8, "source": "old", "edges": None,
           "layers": [{"name": "big", "forward_s": 0.01, "backward_s": 0.02,
                       "activation_bytes": 4.0, "parameter_bytes": 4.0},
                      {"name": "tiny", "forward_s": 4e-6, "backward_s": 0.0,
                       "activation_bytes": 4.0, "parameter_bytes": 0.0}]}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    profile = ModelProfile.load(str(path))
    big, tiny = profile.layers
    assert (big.forward_fixed_s, big.backward_fixed_s) == (DEFAULT_FORWARD_FIXED_S,
                                                           DEFAULT_BACKWARD_FIXED_S)
    assert (tiny.forward_fixed_s, tiny.backward_fixed_s) == (4e-6, 0.0)  # at most its time
    assert profile.fixed_costs == "default" and profile.batch_size == 8


def test_graph_txt_import_gets_the_documented_default() -> None:
    text = ("node1 -- Input0 -- forward_compute_time=0.000, backward_compute_time=0.000, "
            "activation_size=4.0, parameter_size=0.000\n"
            "node2 -- Conv2d -- forward_compute_time=2.000, backward_compute_time=5.000, "
            "activation_size=8.0, parameter_size=16.000\n"
            "node3 -- ReLU -- forward_compute_time=0.004, backward_compute_time=0.010, "
            "activation_size=8.0, parameter_size=0.000\n"
            "\tnode1 -- node2\n\tnode2 -- node3\n")
    profile = from_pipedream_graph(text)
    conv, relu = profile.layers
    assert conv.forward_fixed_s == DEFAULT_FORWARD_FIXED_S == 10e-6
    assert conv.backward_fixed_s == DEFAULT_BACKWARD_FIXED_S == 20e-6
    assert relu.forward_fixed_s == pytest.approx(4e-6) and relu.backward_fixed_s == pytest.approx(10e-6)
    assert profile.fixed_costs == "default"


def bad_profile(tmp_path: Path, **fields: object) -> str:
    layer = {"name": "l", "forward_s": 0.01, "backward_s": 0.02, "activation_bytes": 1.0,
             "parameter_bytes": 1.0, **fields}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"schema_version": 2, "layers": [layer], "edges": None}))
    return str(path)


@pytest.mark.parametrize("fields,words", [
    ({"forward_fixed_s": -1e-3, "backward_fixed_s": 0.0}, "negative forward_fixed_s"),
    ({"forward_fixed_s": 0.0, "backward_fixed_s": 0.5}, "backward_fixed_s=0.5 above its backward_s"),
    ({"forward_fixed_s": 1e-3}, "has 'forward_fixed_s' but not 'backward_fixed_s'"),
    ({"forward_fixed_s": "1ms", "backward_fixed_s": 0.0}, "'forward_fixed_s' must be a number"),
])  # fmt: skip
def test_bad_fixed_cost_is_one_line(capsys, tmp_path: Path, fields: dict, words: str) -> None:
    code, out, err = run_cli(capsys, "simulate", "--plan", "dp", "--profile",
                             bad_profile(tmp_path, **fields), "--devices", "2",
                             "--bandwidth", "1GB/s")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and words in err


# -- the profiler's fit ---------------------------------------------------------------------

def test_fit_of_exact_points_and_its_clamps() -> None:
    assert fit_batches(64) == [8, 16, 32, 64] and fit_batches(5) == [2, 5] and fit_batches(3) == [3]
    assert fit_fixed_s([(b, 2e-3 + 1e-5 * b) for b in (8, 16, 32, 64)]) == pytest.approx(2e-3)
    assert fit_fixed_s([(8, 1e-3), (64, 9e-3)]) == 0.0  # a negative intercept is no cost
    assert fit_fixed_s([(8, 5e-3), (64, 4e-3)]) == 4e-3  # at most the whole call
    with pytest.raises(ValueError, match="two distinct batch sizes"):
        fit_fixed_s([(8, 1e-3), (8, 2e-3)])


class Clock:
    """The profiler's clock in a test: it moves only when a :class:`Sleepy` layer says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class Sleepy(nn.Module):
    """A forward that takes ``fixed_s`` per call plus ``per_sample_s`` per sample on ``clock``
    (exactly: a real sleep overshoots by milliseconds on a loaded machine)."""

    def __init__(self, fixed_s: float, per_sample_s: float, clock: Clock) -> None:
        super().__init__()
        self.fixed_s, self.per_sample_s, self.clock = fixed_s, per_sample_s, clock
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.now += self.fixed_s + self.per_sample_s * x.shape[0]
        return self.linear(x)


def test_profiler_fit_recovers_a_known_fixed_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """The profiler times each layer at several batch sizes and fits a fixed cost per call:
    on a clock that the layers move by a known cost, it finds that cost (a wrong fit: 0, or
    the whole 5.9 ms / 4.8 ms call)."""
    import tandem.runtime.profiler as profiler

    clock = Clock()
    monkeypatch.setattr(profiler, "time", clock)
    torch.manual_seed(0)
    model = nn.Sequential(Sleepy(4e-3, 30e-6, clock), Sleepy(1e-3, 60e-6, clock))
    profile = profile_model(model, torch.randn(64, 4), warmup=1, repeats=3)
    assert profile.fixed_costs == "measured" and profile.batch_size == 64
    first, second = profile.layers
    assert first.forward_fixed_s == pytest.approx(4e-3, rel=1e-6)
    assert second.forward_fixed_s == pytest.approx(1e-3, rel=1e-6)
    for layer in profile.layers:
        assert 0 <= layer.backward_fixed_s <= layer.backward_s


def test_profiler_small_batch_gets_the_default() -> None:
    profile = profile_model(nn.Sequential(nn.Linear(4, 4)), torch.randn(3, 4), warmup=0, repeats=1)
    layer = profile.layers[0]
    assert profile.fixed_costs == "default"
    assert layer.forward_fixed_s == min(DEFAULT_FORWARD_FIXED_S, layer.forward_s)


# -- the emulated model waits what the simulator charges ------------------------------------

def test_emulated_block_waits_fixed_plus_share(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    chain(2, forward_s=8e-3, backward_s=16e-3, forward_fixed_s=2e-3,
          backward_fixed_s=4e-3).save(str(path))
    info = build_dataset("images:n=8,size=4,channels=1,classes=3").info
    model = build_model(f"emulated:profile={path},batch=96,scale=0.5", info)
    timing = model[0].timing
    assert timing.seconds("F", 96) == pytest.approx(4e-3)  # the whole minibatch: the profile's
    assert timing.seconds("F", 12) == pytest.approx(0.5 * (2e-3 + 6e-3 / 8))
    assert timing.seconds("B", 12) == pytest.approx(0.5 * (4e-3 + 12e-3 / 8))
