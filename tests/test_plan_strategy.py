"""The plan is the strategy: flags, plan files and runs describe and run the same thing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.spec.codec import CodecSpec
from tandem.errors import UsageError
from tandem.plan import Plan, Stage
from tandem.strategy import STRATEGIES, owners, plan_from_flags, strategy_of
from tandem.spec.sync import (
    ElasticAveragingSync,
    GossipSync,
    LocalSGDSync,
    ParameterServerSync,
    sync_from_dict,
)
from tests.conftest import ROOT, SharedRun, max_abs_diff, run_cli, run_here, run_json

INAPPLICABLE = {
    "dp --mode": (("--mode", "async"), "--mode applies to --strategy ps or easgd only (this run "
                                       "has --strategy dp); add --strategy ps or drop it"),
    "dp --backup": (("--backup", "1"), "--backup applies to --strategy ps only"),
    "dp --topology": (("--topology", "ring"), "--topology applies to --strategy gossip only"),
    "dp --rho": (("--rho", "0.5"), "--rho applies to --strategy easgd only"),
    "dp --period": (("--period", "3"), "--period applies to --strategy easgd or localsgd only"),
    "dp --servers": (("--servers", "1"), "--servers applies to --strategy ps or easgd only"),
    "dp --nesterov": (("--nesterov",), "--nesterov applies to --strategy easgd only"),
    "dp --schedule": (("--schedule", "gpipe"), "--schedule applies to --strategy pipeline only"),
    "dp --vertical-sync": (("--vertical-sync",), "--vertical-sync applies to --strategy pipeline"),
    "dp --async-gossip": (("--async-gossip",), "--async-gossip applies to --strategy gossip only"),
    "gossip --servers": (("--strategy", "gossip", "--nproc", "4", "--servers", "2"),
                         "--servers applies to --strategy ps or easgd only (this run has "
                         "--strategy gossip)"),
    "ps --topology": (("--strategy", "ps", "--nproc", "3", "--topology", "torus"),
                      "--topology applies to --strategy gossip only (this run has --strategy ps)"),
    "ps --stages": (("--strategy", "ps", "--nproc", "3", "--stages", "2"),
                    "--stages applies to --strategy pipeline only (this run has --strategy ps)"),
    "ps --accumulate": (("--strategy", "ps", "--nproc", "3", "--accumulate", "2"),
                        "--accumulate applies to --strategy dp, gossip, easgd or localsgd only"),
    "ps sync --staleness": (("--strategy", "ps", "--nproc", "3", "--staleness", "3"),
                            "--staleness applies to --mode ssp only (got --mode sync)"),
    "ps sync --staleness-lr": (("--strategy", "ps", "--nproc", "3", "--staleness-lr"),
                               "--staleness-lr applies to --mode async or ssp only"),
    "localsgd --rho": (("--strategy", "localsgd", "--nproc", "2", "--rho", "2"),
                       "--rho applies to --strategy easgd only (this run has --strategy localsgd)"),
    "easgd --weights": (("--strategy", "easgd", "--nproc", "2", "--weights", "uniform"),
                        "--weights applies to --strategy gossip only"),
    "pipeline --mode": (("--strategy", "pipeline", "--nproc", "2", "--mode", "sync"),
                        "--mode applies to --strategy ps or easgd only (this run has --strategy "
                        "pipeline)"),
    "pipeline --accumulate": (("--strategy", "pipeline", "--nproc", "2", "--accumulate", "2"),
                              "(this run has --strategy pipeline)"),
    "1f1b --vertical-sync": (("--strategy", "pipeline", "--nproc", "2", "--vertical-sync"),
                             "--vertical-sync applies to --schedule pipedream only"),
    "pipedream --microbatches": (("--strategy", "pipeline", "--nproc", "2", "--schedule",
                                  "pipedream", "--microbatches", "4"),
                                 "--microbatches 4 does not apply"),
    "gossip --gossip-step without codec": (("--strategy", "gossip", "--nproc", "2",
                                            "--gossip-step", "0.5"), "--gossip-step is the step"),
    "one-stage pipeline": (("--strategy", "pipeline", "--nproc", "1"),
                           "a one-stage 1F1B pipeline is data parallelism"),
}


@pytest.mark.pure
@pytest.mark.parametrize("case", sorted(INAPPLICABLE))
def test_an_option_of_another_strategy_is_one_line_and_status_2(
        capsys: pytest.CaptureFixture[str], case: str) -> None:
    args, expected = INAPPLICABLE[case]
    code, out, err = run_cli(capsys, "train", "--steps", "1", "--no-progress", *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and expected in err, err


@pytest.mark.pure
def test_every_plan_flag_belongs_to_a_strategy() -> None:
    """The table the errors come from: each strategy's own flags, and nobody else's."""
    assert owners("--servers") == ("ps", "easgd")
    assert owners("--nesterov") == ("easgd",)
    assert owners("--period") == ("easgd", "localsgd")
    assert owners("--microbatches") == ("pipeline",)
    assert owners("--compress") == ()
    assert set(STRATEGIES) == {"dp", "ps", "gossip", "easgd", "localsgd", "pipeline"}


@pytest.mark.pure
@pytest.mark.parametrize(("strategy", "flags", "processes", "sync"), [
    ("dp", {}, 4, None),
    ("ps", {"--servers": 2, "--mode": "ssp", "--staleness": 3}, 6,
     ParameterServerSync(servers=2, mode="ssp", staleness=3)),
    ("gossip", {"--topology": "torus", "--weights": "uniform"}, 4,
     GossipSync(topology="torus", weights="uniform")),
    ("easgd", {"--rho": 0.5, "--period": 2}, 4, ElasticAveragingSync(rho=0.5, period=2)),
    ("easgd", {"--mode": "async", "--servers": 2, "--nesterov": True}, 6,
     ElasticAveragingSync(mode="async", servers=2, nesterov=True)),
    ("localsgd", {"--period": 8}, 4, LocalSGDSync(period=8)),
    ("pipeline", {"--replicas": "2,1", "--schedule": "gpipe", "--microbatches": 6}, 3, None),
])
def test_flags_build_one_plan_that_round_trips(strategy: str, flags: dict, processes: int,
                                               sync: object) -> None:
    plan = plan_from_flags(strategy, {**flags, "--compress": "fp16"}, num_processes=processes,
                           num_blocks=4)
    assert strategy_of(plan) == strategy and plan.num_workers == processes
    if sync is not None:
        assert plan.sync == sync
    assert plan.compress == CodecSpec.parse("fp16")
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan and strategy_of(again) == strategy


@pytest.mark.pure
def test_micro_batch_defaults_are_decided_by_the_plan() -> None:
    """One stage: one micro-batch per worker (times --accumulate); a pipeline: max(stages,
    most replicas); PipeDream: one whole minibatch."""
    def count(strategy: str, flags: dict, processes: int) -> int | None:
        return plan_from_flags(strategy, flags, num_processes=processes,
                               num_blocks=4).num_microbatches
    assert count("dp", {}, 4) == 4 and count("dp", {"--accumulate": 3}, 2) == 6
    assert count("ps", {"--servers": 1}, 5) == 4
    assert count("pipeline", {}, 4) == 4 and count("pipeline", {"--replicas": "3,1"}, 4) == 3
    assert count("pipeline", {"--schedule": "pipedream"}, 2) == 1


@pytest.mark.pure
def test_malformed_plans_are_one_line_errors(tmp_path: Path) -> None:
    good = plan_from_flags("ps", {}, num_processes=3, num_blocks=4).to_dict()
    with pytest.raises(UsageError, match="no option 'shards'"):
        Plan.from_dict({**good, "sync": {"method": "ps", "shards": 2}})
    with pytest.raises(UsageError, match="needs a method"):
        sync_from_dict({"method": "paxos"})
    with pytest.raises(UsageError, match="schedule_version|schema_version"):
        Plan.from_dict({**good, "schema_version": 7})
    with pytest.raises(UsageError, match="pipeline's stage replicas synchronize by allreduce"):
        Plan(stages=[Stage(start=0, end=2, replicas=1), Stage(start=2, end=4, replicas=1)],
             num_layers=4, num_devices=3, sync=ParameterServerSync())
    with pytest.raises(UsageError, match="unknown codec"):
        Plan.from_dict({**good, "compress": "zip"})


@pytest.mark.pure
def test_a_schema_1_plan_file_is_still_read() -> None:
    """Plans written before the sync spec existed: allreduce, their predictions PipeDream's."""
    old = {"schema_version": 1, "stages": [{"start": 0, "end": 3, "replicas": 2, "sync": "allreduce"},
                                           {"start": 3, "end": 4, "replicas": 1}],
           "num_layers": 4, "num_devices": 3, "bottleneck_s": 0.1, "schedule": "1f1b",
           "num_microbatches": None}
    plan = Plan.from_dict(old)
    assert strategy_of(plan) == "pipeline" and plan.num_microbatches == 2
    assert plan.predicted_schedule == "pipedream"


@pytest.mark.multiprocess
def test_a_gpipe_plan_with_8_micro_batches_runs_exactly_that(tmp_path: Path) -> None:
    """``tandem plan --schedule gpipe --microbatches 8 -o`` then ``train --plan``: the summary,
    the recorded plan and the trace (8 forwards per step on each stage) all say GPipe with 8."""
    plan_file = tmp_path / "plan.json"
    written = run_here("plan", "--model", "mlp", "--data", "digits", "--devices", "2",
                       "--bandwidth", "10Gb/s", "--schedule", "gpipe", "--microbatches", "8",
                       "-o", str(plan_file))
    assert written.returncode == 0, written.stderr
    recorded = json.loads(plan_file.read_text())
    assert (recorded["schedule"], recorded["num_microbatches"]) == ("gpipe", 8)
    # its predicted time is the simulator's for the schedule it runs
    assert recorded["predicted_schedule"] == "gpipe"
    out = tmp_path / "run"
    summary = run_json("train", "--plan", str(plan_file), "--steps", "2", "--batch-size", "32",
                       "--out", str(out))
    assert (summary["strategy"], summary["schedule"], summary["microbatches"]) == ("pipeline", "gpipe", 8)
    assert summary["world_size"] == 2  # --nproc comes from the plan
    assert Plan.load(str(out / "plan.json")) == Plan.load(str(plan_file))
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    # the profile, measured now, decides 1-1 or one stage on 2 replicas (each runs half)
    per_worker = 8 // recorded["stages"][0]["replicas"]
    for worker in (0, 1):
        forwards = [e for e in events if e.get("pid") == worker and e.get("ph") == "X"
                    and e["name"].lstrip("0123456789").startswith("F")]
        assert len(forwards) == 2 * per_worker, [e["name"] for e in forwards]
        # GPipe: within a step every forward comes before every backward
        names = [e["name"].lstrip("0123456789") for e in events
                 if e.get("pid") == worker and e.get("ph") == "X" and e["args"]["step"] == 1]
        compute = [name[0] for name in names if name[:1] in ("F", "B") and name[1:2].isdigit()]
        assert compute == ["F"] * per_worker + ["B"] * per_worker, names


@pytest.mark.multiprocess
def test_a_run_reruns_from_its_own_plan_file(shared_run: SharedRun, tmp_path: Path) -> None:
    """``plan.json`` of a run is its strategy: running it again gives the same model. (The
    first run is the ``ps`` run whose trace is checked below.)"""
    common = ("--steps", "2", "--batch-size", "32")
    first, _ = shared_run("--strategy", "ps", "--nproc", "3", *common)
    summary = run_json("train", *common, "--plan", str(first / "plan.json"),
                       "--out", str(tmp_path))
    assert summary["strategy"] == "ps" and summary["world_size"] == 3
    assert max_abs_diff(first / "final.pt", tmp_path / "final.pt") == 0.0


@pytest.mark.pure
def test_no_strategy_name_is_compared_outside_the_registry() -> None:
    found = [f"{path}:{number}" for path in sorted((ROOT / "src").rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if "strategy ==" in line]
    assert found == []


DATA_PARALLEL_TRACES = {
    # strategy flags: each worker's actions in step 1, as the one-stage schedule names them
    ("dp", "--nproc", "2", "--accumulate", "2"): {
        0: "0F0 0B0 0F2 0B2 0AR 0ST", 1: "0F1 0B1 0F3 0B3 0AR 0ST"},
    ("ps", "--nproc", "3"): {0: "0ST", 1: "0F0 0B0 0PU 0PL", 2: "0F1 0B1 0PU 0PL"},
    ("gossip", "--nproc", "2"): {0: "0F0 0B0 0GX 0ST", 1: "0F1 0B1 0GX 0ST"},
    ("easgd", "--nproc", "2", "--period", "2"): {0: "0F0 0B0 0ST 0AR", 1: "0F1 0B1 0ST 0AR"},
    ("localsgd", "--nproc", "2", "--period", "2"): {0: "0F0 0B0 0ST 0AR", 1: "0F1 0B1 0ST 0AR"},
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("flags", list(DATA_PARALLEL_TRACES), ids=lambda flags: flags[0])
def test_data_parallel_traces_use_the_schedule_vocabulary(shared_run: SharedRun,
                                                         flags: tuple) -> None:
    """Micro-batch ``m`` of a one-stage plan runs on worker ``m % workers`` (the generator's
    round-robin); the sync method's own actions follow: allreduce, push/pull, exchange, step."""
    out, _ = shared_run("--strategy", *flags, "--steps", "2", "--batch-size", "32")
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    seen = {worker: " ".join(e["name"] for e in events if e.get("ph") == "X"
                             and e["pid"] == worker and e["args"]["step"] == 1)
            for worker in DATA_PARALLEL_TRACES[flags]}
    assert seen == DATA_PARALLEL_TRACES[flags]


@pytest.mark.multiprocess
def test_a_schedule_file_without_a_step_is_refused_with_the_grid(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The tester's case: a 1F1B file with ``0ST`` deleted used to run, and stage 0 never
    trained; now the plan refuses it before any worker starts, showing the dry run."""
    from tandem.schedule import one_f_one_b

    schedule = tmp_path / "no-step.txt"
    schedule.write_text(one_f_one_b([1, 1], 2).text().replace(" 0ST", ""))
    code, out, err = run_cli(capsys, "train", "--strategy", "pipeline", "--nproc", "2",
                             "--schedule", str(schedule), "--steps", "2", "--batch-size", "32")
    assert code == 2 and out == ""
    assert "w0 never takes its optimizer step: add 0ST after its last backward" in err
    assert "step  w0      w1" in err  # the step-by-worker grid of the dry run


@pytest.mark.pure
def test_the_simulator_runs_the_plans_codec() -> None:
    """A data-parallel plan's codec is what ``tandem simulate --plan`` models, exactly as if it
    had been given with ``--compress``."""
    from tandem.cluster import flat_cluster
    from tandem.planning.simulate.simulator import SimOptions, simulate
    from tandem.profile import load_profile
    from tests.conftest import VGG

    profile, cluster = load_profile(VGG), flat_cluster(num_devices=4, bandwidth="10Gb/s")
    plain = plan_from_flags("dp", {}, num_processes=4, num_blocks=profile.num_layers)
    coded = plan_from_flags("dp", {"--compress": "fp16"}, num_processes=4,
                            num_blocks=profile.num_layers)
    from_plan = simulate(coded, profile, cluster)
    from_flag = simulate(plain, profile, cluster, SimOptions(compress="fp16"))
    assert from_plan.codec_s > 0 and from_plan.step_time_s == from_flag.step_time_s
    assert simulate(plain, profile, cluster).codec_s == 0


@pytest.mark.pure
def test_the_simulator_replays_a_plans_hand_written_schedule() -> None:
    """A plan built from ``--schedule FILE`` carries the file's schedule; the simulator replays
    that one (the runtime runs it), not the generated schedule of the same kind."""
    from tandem.planning.simulate.simulator import plan_schedule
    from tandem.schedule import gpipe, one_f_one_b

    written = one_f_one_b([1, 1], 3).text()
    plan = Plan(stages=[Stage(start=0, end=2, replicas=1), Stage(start=2, end=4, replicas=1)],
                num_layers=4, num_devices=2, schedule="1f1b", num_microbatches=3,
                schedule_text=written)
    assert plan_schedule(plan).text() == written
    generated = Plan(stages=plan.stages, num_layers=4, num_devices=2, schedule="gpipe",
                     num_microbatches=3)
    assert plan_schedule(generated).text() == gpipe([1, 1], 3).text()


@pytest.mark.pure
def test_a_data_parallel_summary_names_no_pipeline_schedule() -> None:
    from tandem.runtime.outputs import plan_summary

    dp = plan_summary(plan_from_flags("dp", {}, num_processes=4, num_blocks=3))
    assert dp["strategy"] == "dp" and "schedule" not in dp and "microbatches" not in dp
    staged = plan_summary(plan_from_flags("pipeline", {"--stages": 2, "--schedule": "gpipe"},
                                          num_processes=2, num_blocks=3))
    assert (staged["schedule"], staged["strategy"]) == ("gpipe", "pipeline")
