"""Time-to-accuracy planning: the steps model (McCandlish et al.'s ``S_min (1 + B_noise/B)``
and a cost per unit of staleness), the measuring run's reading of its metrics lines, the search
weighing stale plans, and ``tandem search --objective time-to-accuracy`` with its refusals."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from tandem.cluster import flat_cluster
from tandem.commands.measure_steps import MeasureOptions, crossing, steps_model
from tandem.errors import UsageError
from tandem.plan import Plan, Stage
from tandem.planning.search.flexflow import Candidate, SearchOptions, search
from tandem.planning.search.time_to_accuracy import (
    StepsModel, fastest, loss_crossing, stale_kind, time_to_target,
)
from tandem.planning.simulate.simulator import data_parallel_plan, simulate
from tandem.profile import load_profile
from tandem.spec.sync import ParameterServerSync
from tandem.spec.trainable import staleness
from tests.conftest import PROFILES, run_cli

GNMT = load_profile(str(PROFILES / "gnmt.graph.txt"))
MODEL = StepsModel(target_loss=0.3, reference_batch=32, reference_steps=120.0, noise_scale=32.0,
                   lr=0.05, staleness_costs={"ps": 0.1, "pipedream": 0.5},
                   source="a measuring run")


@pytest.mark.pure
def test_steps_follow_the_noise_scale_model() -> None:
    # S_min = 120 / (1 + 32/32) = 60; S(B) = 60 (1 + 32/B); each unit of staleness +10% on
    # parameter servers, +50% in a PipeDream pipeline.
    assert MODEL.min_steps == pytest.approx(60.0)
    assert [MODEL.steps(b) for b in (32, 64, 128, 1024)] == pytest.approx(
        [120.0, 90.0, 75.0, 61.875])
    assert MODEL.steps(64, staleness=3, kind="ps") == pytest.approx(90.0 * 1.3)
    assert MODEL.steps(64, staleness=3, kind="pipedream") == pytest.approx(90.0 * 2.5)
    assert MODEL.steps(2**40) == pytest.approx(MODEL.min_steps)


@pytest.mark.pure
def test_learning_rate_is_the_auto_scaling_of_the_runtime() -> None:
    from tandem.runtime.learning_rate import auto_lr_factor

    for batch in (32, 64, 256, 1024):
        assert MODEL.lr_at(batch) == pytest.approx(0.05 * auto_lr_factor(batch, 32, 32.0))
    assert MODEL.lr_at(1024) == pytest.approx(0.05 * 2 / (1 + 1 / 32))
    assert StepsModel(target_loss=1, reference_batch=8, reference_steps=9,
                      noise_scale=3).lr_at(64) is None


@pytest.mark.pure
def test_model_json_round_trip_and_errors() -> None:
    assert StepsModel.from_dict(MODEL.to_dict(), "x") == MODEL
    unsourced = {**MODEL.to_dict(), "source": ""}
    assert StepsModel.from_dict(unsourced, "--learning f.json").source == "--learning f.json"
    with pytest.raises(UsageError, match="f.json: missing reference_steps"):
        StepsModel.from_dict({"noise_scale": 3, "reference_batch": 32, "target_loss": 1}, "f.json")
    with pytest.raises(UsageError, match="unknown key"):
        StepsModel.from_dict({**MODEL.to_dict(), "noise": 3}, "f.json")
    with pytest.raises(UsageError, match="noise_scale must be a finite positive number"):
        StepsModel.from_dict({**MODEL.to_dict(), "noise_scale": -1.0}, "f.json")
    with pytest.raises(UsageError, match="reference_batch"):
        StepsModel.from_dict({**MODEL.to_dict(), "reference_batch": 0.5}, "f.json")
    with pytest.raises(UsageError, match="staleness_costs must give a number >= 0 for each of "
                                         "ps, pipedream"):
        StepsModel.from_dict({**MODEL.to_dict(), "staleness_costs": {"ps": 0.1}}, "f.json")


@pytest.mark.pure
def test_staleness_of_plans() -> None:
    dp = data_parallel_plan(GNMT, 4)
    ps_async = dataclasses.replace(dp, num_devices=5, sync=ParameterServerSync(mode="async"))
    ps_sync = dataclasses.replace(dp, num_devices=5, sync=ParameterServerSync(mode="sync"))
    ssp = dataclasses.replace(dp, num_devices=5, sync=ParameterServerSync(mode="ssp"))
    stages = [Stage(start=i * 2, end=(i + 1) * 2 if i < 3 else GNMT.num_layers, replicas=1)
              for i in range(4)]
    pipe = dataclasses.replace(dp, stages=stages, num_microbatches=None)
    assert [staleness(p) for p in (dp, ps_async, ps_sync, ssp)] == [0, 3, 0, 3]
    assert staleness(pipe.rescheduled("pipedream")) == 3
    assert staleness(pipe.rescheduled("1f1b")) == 0
    assert staleness(pipe.rescheduled("gpipe")) == 0
    assert [stale_kind(p) for p in (ps_async, pipe.rescheduled("pipedream"))] == [
        "ps", "pipedream"]


@pytest.mark.pure
def test_loss_crossing() -> None:
    curve = [(2.0, 2.0), (7.0, 1.0), (12.0, 0.5), (17.0, 0.2)]
    assert loss_crossing(curve, 0.75) == pytest.approx(9.5)   # halfway from 1.0 to 0.5
    assert loss_crossing(curve, 1.0) == 7.0
    assert loss_crossing(curve, 3.0) == 2.0                   # the first point is below
    assert loss_crossing(curve, 0.1) is None
    assert loss_crossing([(2.0, math.nan), (7.0, 0.5)], 1.0) == 7.0


def _lines(losses: list[float], noise: list[float | None], every: int = 5) -> list[dict]:
    return [{"step": every * (i + 1), "loss": loss, "noise_scale": n}
            for i, (loss, n) in enumerate(zip(losses, noise))]


@pytest.mark.pure
def test_measuring_run_reads_steps_and_noise_scale() -> None:
    lines = _lines([2.3, 2.2, 1.5, 0.9, 0.5, 0.3, 0.2], [None, 80, 60, 40, 30, 25, 20])
    # each line's loss sits at the middle of its 5 steps (step - 2): 0.5 at 23, 0.3 at 28
    assert crossing(lines, 0.4, 5) == pytest.approx(25.5)
    options = MeasureOptions(model="mlp", data="digits", target_loss=0.4, steps=35)
    model = steps_model(lines, options)
    assert model.reference_steps == pytest.approx(25.5) and model.reference_batch == 32
    assert model.noise_scale == 25  # the line that reaches the target (step 30)
    assert "25.5 steps" in model.source and "--seed 0" in model.source
    early = steps_model(lines, MeasureOptions(model="mlp", data="digits", target_loss=0.4,
                                              steps=35, noise_step=10))
    assert early.noise_scale == 80
    with pytest.raises(UsageError, match=r"did not reach --target-loss 0.1 in 35 steps "
                                         r"\(lowest logged loss 0.2\)"):
        steps_model(lines, MeasureOptions(model="mlp", data="digits", target_loss=0.1, steps=35))
    with pytest.raises(UsageError, match="measured no gradient noise scale"):
        steps_model(_lines([2.3, 0.1], [None, None]),
                    MeasureOptions(model="mlp", data="digits", target_loss=0.4, steps=10))
    with pytest.raises(UsageError, match="multiple of 5"):
        MeasureOptions(model="mlp", data="digits", target_loss=0.4, noise_step=12)
    with pytest.raises(UsageError, match="does not split among its 2 workers"):
        MeasureOptions(model="mlp", data="digits", target_loss=0.4, batch=33)


@pytest.mark.pure
def test_fastest_is_the_least_product() -> None:
    cluster = flat_cluster(num_devices=4, bandwidth="10Gb/s")
    plan = data_parallel_plan(GNMT, 4)
    result = simulate(plan, GNMT, cluster)
    candidate = Candidate(plan=plan, result=result)
    rows = [time_to_target(candidate, b, MODEL) for b in (32, 64, 128)]
    # the same step time everywhere: the largest batch takes the fewest steps
    assert fastest(rows).batch_size == 128
    assert rows[1].time_to_target_s == pytest.approx(result.step_time_s * 90.0)
    with pytest.raises(UsageError, match="no plan fits"):
        fastest([])


@pytest.mark.pure
def test_search_weighs_stale_plans_by_their_steps() -> None:
    # GNMT on 4 devices: PipeDream's schedule has the shortest step, 3 updates stale.
    cluster = flat_cluster(num_devices=4, bandwidth="10Gb/s")
    free = search(GNMT, cluster, SearchOptions(max_iterations=60, seed=0))
    assert staleness(free.best.plan) == 3
    weighed = search(GNMT, cluster, SearchOptions(max_iterations=60, seed=0, staleness_cost=1.0))
    assert staleness(weighed.best.plan) == 0
    assert weighed.best.result.step_time_s < 4 * free.best.result.step_time_s


def _learning(tmp_path: Path, **changes: object) -> str:
    path = tmp_path / "learning.json"
    path.write_text(json.dumps({**MODEL.to_dict(), **changes}))
    return str(path)


@pytest.mark.pure
def test_search_prints_both_factors_and_picks_the_least_time(capsys, tmp_path: Path) -> None:
    target = tmp_path / "best.json"
    code, out, err = run_cli(
        capsys, "search", "--profile", str(PROFILES / "gnmt.graph.txt"), "--profile-batch",
        "64", "--devices", "4", "--bandwidth", "10Gb/s", "--objective", "time-to-accuracy",
        "--target-loss", "0.3", "--learning", _learning(tmp_path), "--batch-sizes",
        "32,128,512", "--iterations", "20", "--json", "-o", str(target))
    assert code == 0, err
    data = json.loads(out)
    tta = data["time_to_accuracy"]
    rows = tta["candidates"]
    assert {row["batch_size"] for row in rows} == {32, 128, 512}
    for row in rows:
        kind = "pipedream" if row["sync"] == "allreduce" else "ps"
        assert row["predicted_steps"] == pytest.approx(
            MODEL.steps(row["batch_size"], row["staleness"], kind))
        assert row["time_to_target_s"] == pytest.approx(row["step_time_s"]
                                                        * row["predicted_steps"])
    best = min(rows, key=lambda row: row["time_to_target_s"])
    assert tta["best"]["time_to_target_s"] == best["time_to_target_s"]
    assert data["batch_size"] == tta["best"]["batch_size"]
    assert tta["steps_model"] == MODEL.to_dict()
    assert Plan.load(str(target)).options["batch_size"] == data["batch_size"]
    assert "ms/step" in err and "steps" in err and "time to target" in err
    assert f"--batch-size {data['batch_size']}" in err


REFUSALS = [
    (["--target-loss", "0.3"], "--target-loss applies to --objective time-to-accuracy"),
    (["--batch-sizes", "32,64"], "--batch-sizes applies to --objective time-to-accuracy"),
    (["--objective", "time-to-accuracy"], "needs --target-loss X"),
    (["--objective", "time-to-accuracy", "--target-loss", "nan"], "needs --target-loss X"),
    (["--objective", "time-to-accuracy", "--target-loss", "0.3", "--batch-size", "64"],
     "--batch-size 64 fixes the batch"),
    (["--objective", "time-to-accuracy", "--target-loss", "0.3", "--families", "gossip"],
     "--families gossip"),
    (["--objective", "time-to-accuracy", "--target-loss", "0.3", "--pick", "ps"],
     "--pick ps chooses by time per step"),
    (["--objective", "time-to-accuracy", "--target-loss", "0.3"], "a --profile cannot train"),
    (["--objective", "time-to-accuracy", "--target-loss", "0.3", "--model", "mlp",
      "--measure-batch", "33"], "the measuring batch 33 does not split among its 2 workers"),
    (["--objective", "time-to-accuracy", "--target-loss", "0.3", "--model", "mlp",
      "--lr", "0"], "--lr 0.0 of the measuring run must be positive"),
    (["--objective", "time-to-accuracy", "--target-loss", "0.3", "--batch-sizes", "32,x",
      "--learning", "{learning}"], "--batch-sizes '32,x'"),
    (["--objective", "time-to-accuracy", "--target-loss", "0.3", "--learning", "{learning}",
      "--lr", "0.1"], "--lr sets the measuring run, which --learning"),
    (["--profile-batch", "64", "--objective", "time-to-accuracy", "--target-loss", "0.5",
      "--learning", "{learning}"],
     "holds steps to loss 0.3, not --target-loss 0.5"),
    (["--profile-batch", "64", "--objective", "time-to-accuracy", "--target-loss", "0.3",
      "--learning", "{missing}"],
     "cannot read --learning"),
    (["--objective", "time-to-accuracy", "--target-loss", "0.3", "--staleness-cost", "-1",
      "--learning", "{learning}"], "--staleness-cost -1.0 must be >= 0"),
    (["--objective", "time-to-accuracy", "--target-loss", "0.3", "--learning", "{learning}"],
     "add --profile-batch N"),
]


@pytest.mark.pure
@pytest.mark.parametrize(("argv", "words"), REFUSALS)
def test_refusals_are_one_line(capsys, tmp_path: Path, argv: list[str], words: str) -> None:
    learning, missing = _learning(tmp_path), str(tmp_path / "nowhere.json")
    argv = [a.format(learning=learning, missing=missing) for a in argv]
    source = [] if "--model" in argv else ["--profile", str(PROFILES / "gnmt.graph.txt")]
    code, out, err = run_cli(capsys, "search", *source, "--devices", "4", "--bandwidth",
                             "10Gb/s", *argv)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert words in err


@pytest.mark.cli
def test_target_loss_alone_exits_2_in_one_line() -> None:
    from tests.conftest import run_tandem

    result = run_tandem("search", "--profile", str(PROFILES / "gnmt.graph.txt"), "--devices",
                        "4", "--bandwidth", "10Gb/s", "--target-loss", "0.3")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "tandem search: error: --target-loss applies to --objective time-to-accuracy; add "
        "--objective time-to-accuracy, or drop --target-loss"]


@pytest.mark.multiprocess
def test_measuring_run_of_a_model(capsys, tmp_path: Path) -> None:
    # A real measuring run (dp on 2 workers) to a loss digits' mlp reaches in a few dozen steps
    # at a high rate; then the search at two batches from it.
    code, out, err = run_cli(
        capsys, "search", "--model", "mlp", "--data", "digits", "--devices", "2",
        "--bandwidth", "10Gb/s", "--objective", "time-to-accuracy", "--target-loss", "1.5",
        "--lr", "0.2", "--measure-steps", "60", "--batch-sizes", "32,256", "--iterations", "5",
        "--json")
    assert code == 0, err
    model = json.loads(out)["time_to_accuracy"]["steps_model"]
    assert 0 < model["reference_steps"] < 60 and model["noise_scale"] > 0
    assert model["reference_batch"] == 32 and model["lr"] == 0.2
    assert "the measuring run (--strategy dp --nproc 2 --batch-size 32 --lr 0.2" in err
