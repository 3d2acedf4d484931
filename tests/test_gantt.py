"""Gantt charts of timelines, and the trace and chart a pipeline run writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.profile import LayerProfile, ModelProfile
from tandem.timeline import Event, Timeline, event_kind, plot_gantt
from tests.conftest import run_json

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.pure
@pytest.mark.parametrize(("name", "kind"), [
    ("1F3", ("F", "3")), ("0B12", ("B", "12")), ("0ST", ("ST", "")), ("2ST4", ("ST", "4")),
    ("1SA3>2", ("send", "")), ("1SG0>0", ("send", "")), ("2RA3<1", ("receive", "")),
    ("1RG3<2", ("receive", "")), ("0AR", ("collective", "")), ("0AR5", ("collective", "")),
    ("0PU", ("send", "")), ("0PL3", ("receive", "")), ("0GX", ("collective", "")),
    ("F3", ("F", "3")), ("B12", ("B", "12")), ("ST", ("ST", "")), ("ST4", ("ST", "4")),
    ("forward", ("F", "")), ("step", ("ST", "")), ("SA3", ("send", "")), ("SG0", ("send", "")),
    ("RA3", ("receive", "")), ("RV1", ("receive", "")), ("AR", ("collective", "")),
])
def test_event_kinds(name: str, kind: tuple[str, str]) -> None:
    assert event_kind(name) == kind


@pytest.mark.pure
def test_plot_gantt_writes_a_png(tmp_path: Path) -> None:
    events = []
    for m in range(4):
        events += [
            Event(worker=0, name=f"0F{m}", start_s=0.01 * m, end_s=0.01 * m + 0.009, step=0),
            Event(worker=0, name=f"0SA{m}>1", start_s=0.01 * m + 0.009, end_s=0.01 * m + 0.0095, step=0),
            Event(worker=1, name=f"1RA{m}<0", start_s=0.0, end_s=0.01 * m + 0.0095, step=0),
            Event(worker=1, name=f"1F{m}", start_s=0.01 * m + 0.01, end_s=0.01 * m + 0.019, step=0),
        ]
    events.append(Event(worker=0, name="0ST", start_s=0.1, end_s=0.101, step=0))
    events.append(Event(worker=0, name="0F0", start_s=0.2, end_s=0.21, step=1))
    plot_gantt(Timeline(events=events), tmp_path / "gantt.png", title="test", steps={0})
    assert (tmp_path / "gantt.png").read_bytes()[:8] == PNG_MAGIC
    plot_gantt(Timeline(), tmp_path / "empty.png")
    assert (tmp_path / "empty.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.multiprocess
def test_pipeline_run_writes_an_aligned_trace_and_a_gantt_chart(tmp_path: Path) -> None:
    """Stage 1's forward of a micro-batch starts after stage 0's ends, on one clock."""
    layers = [LayerProfile(name=f"l{i}", forward_s=0.01, backward_s=0.01, activation_bytes=256,
                           parameter_bytes=0) for i in range(2)]
    ModelProfile(layers=layers, batch_size=8).save(str(tmp_path / "p.json"))
    out = tmp_path / "run"
    summary = run_json(
        "train", "--model", f"emulated:profile={tmp_path / 'p.json'}", "--data",
        "images:n=64,size=4,channels=1", "--strategy", "pipeline", "--schedule", "gpipe",
        "--stages", "2", "--nproc", "2", "--microbatches", "2", "--batch-size", "8",
        "--steps", "3", "--out", str(out),
    )
    assert summary["steps"] == 3
    assert (out / "gantt.png").read_bytes()[:8] == PNG_MAGIC
    events = Timeline.from_json(json.loads((out / "trace.json").read_text())).events
    forwards = {(e.worker, e.step, e.name): e for e in events if e.name[1] == "F"}
    for step in range(3):
        for m in range(2):
            sent, received = forwards[(0, step, f"0F{m}")], forwards[(1, step, f"1F{m}")]
            assert received.start_s >= sent.end_s - 0.003  # barrier skew, well under 10 ms
