"""A pipeline run's trace speaks the schedule's language: every worker's events, in the order
they were recorded, are named exactly as its actions (``1F3``, ``1SA3>2``, ``2RA3<1``, ``0AR``,
``0ST5``), once each; the simulator names its predicted events the same way.

The runs are the real command line on a tiny model for a few steps: every schedule (GPipe,
1F1B, PipeDream) on 2 and 4 workers and on replicas 2-1; the simulator is checked on the same.
The flush schedules' runs are test_pipeline.py's (20 steps of 4 micro-batches, which must equal
single-process training), shared within the session.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

from tandem.cluster import Cluster, Level
from tandem.planning.simulate.replay import Workload, replay
from tandem.schedule import Action, Schedule, generate
from tandem.timeline import Event, Timeline, event_action, event_kind
from tests.conftest import SharedRun, run_json
from tests.test_pipeline import COMMON as PIPELINE_COMMON

COMMON = ("--model", "mlp", "--data", "digits", "--batch-size", "16", "--strategy", "pipeline")
FLUSH_STEPS, PIPEDREAM_STEPS, MICROBATCHES = 3, 4, 4
FLUSH_RUN_STEPS = 20
"""Steps of the flush schedules' runs (test_pipeline.py's); FLUSH_STEPS is the simulator's."""
LAYOUTS = [(1, 1), (1, 1, 1, 1), (2, 1)]
ALL_CASES = [(kind, replicas) for kind in ("gpipe", "1f1b", "pipedream") for replicas in LAYOUTS]
RUN_CASES = ALL_CASES


def case_id(case: tuple[str, tuple[int, ...]]) -> str:
    return f"{case[0]}-{'-'.join(map(str, case[1]))}"


def expected_actions(kind: str, replicas: tuple[int, ...],
                     flush_steps: int = FLUSH_STEPS) -> list[list[Action]]:
    """Per worker, every action of the run: a flush schedule's per-step list once per step,
    PipeDream's single schedule over all the run's minibatches."""
    if kind == "pipedream":
        return [list(actions) for actions in generate(kind, replicas, PIPEDREAM_STEPS).workers]
    schedule = generate(kind, replicas, MICROBATCHES)
    return [list(actions) * flush_steps for actions in schedule.workers]


def run(shared_run: SharedRun, tmp_path: Path, kind: str,
        replicas: tuple[int, ...]) -> tuple[Path, dict]:
    """The run's ``--out`` and summary: PipeDream's here, a flush schedule's test_pipeline.py's
    (the same arguments, so one run serves both files)."""
    layout: tuple[str, ...] = ("--nproc", str(sum(replicas)))
    replicated = ("--replicas", ",".join(map(str, replicas))) if max(replicas) > 1 else ()
    if kind != "pipedream":
        stages = ("--stages", str(len(replicas))) if replicated else ()
        return shared_run(*PIPELINE_COMMON, "--strategy", "pipeline", "--schedule", kind,
                          "--microbatches", str(MICROBATCHES), *layout, *stages, *replicated)
    layout += replicated
    return tmp_path, run_json("train", *COMMON, "--schedule", kind, "--steps",
                              str(PIPEDREAM_STEPS), *layout, "--out", str(tmp_path))


def worker_events(events: list[Event], worker: int) -> list[Event]:
    """``worker``'s events in the order it recorded them."""
    return [e for e in events if e.worker == worker]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("kind", "replicas"), RUN_CASES, ids=map(case_id, RUN_CASES))
def test_trace_names_every_executed_action_once_in_order(shared_run: SharedRun, tmp_path: Path,
                                                         kind: str,
                                                         replicas: tuple[int, ...]) -> None:
    out, summary = run(shared_run, tmp_path, kind, replicas)
    assert summary["schedule"] == kind and summary["pipeline"] == "-".join(map(str, replicas))
    events = Timeline.from_json(json.loads((out / "trace.json").read_text())).events
    for worker, actions in enumerate(expected_actions(kind, replicas, FLUSH_RUN_STEPS)):
        traced = worker_events(events, worker)
        assert [e.name for e in traced] == [str(a) for a in actions], f"worker {worker}"
        starts = [e.start_s for e in traced]
        assert starts == sorted(starts), f"worker {worker}: events out of execution order"
        assert all(e.end_s >= e.start_s for e in traced)
        per_step = len(actions) // FLUSH_RUN_STEPS
        for index, (event, action) in enumerate(zip(traced, actions)):
            step = action.microbatch if kind == "pipedream" else index // per_step
            if step is not None:
                assert event.step == step, f"worker {worker}: {event}"
            if action.kind.is_compute:
                assert event_kind(event.name) == (action.kind.value, str(action.microbatch))


@pytest.mark.pure
@pytest.mark.parametrize(("kind", "replicas"), ALL_CASES, ids=map(case_id, ALL_CASES))
def test_simulator_names_its_events_like_the_runtime(kind: str,
                                                     replicas: tuple[int, ...]) -> None:
    """The predicted timeline has one event per executed action, under the same names."""
    count = PIPEDREAM_STEPS if kind == "pipedream" else MICROBATCHES
    schedule: Schedule = generate(kind, replicas, count)
    stages, workers = len(replicas), schedule.num_workers
    workload = Workload(forward_s=[1.0] * stages, backward_s=[2.0] * stages,
                        step_s=[0.5] * stages, output_bytes=[100.0] * stages,
                        stash_bytes=[100.0] * stages, allreduce_s=[1.0] * stages,
                        devices=list(range(workers)))
    cluster = Cluster(levels=(Level(num_units=workers, bandwidth_Bps=100.0, latency_s=0.0),))
    num_steps = 1 if kind == "pipedream" else FLUSH_STEPS
    predicted = replay(schedule, workload, cluster, num_steps=num_steps).events
    for worker, actions in enumerate(expected_actions(kind, replicas)):
        names = collections.Counter(e.name for e in predicted if e.worker == worker)
        assert names == collections.Counter(str(a) for a in actions), f"worker {worker}"
        assert all(event_action(name) is not None for name in names)
