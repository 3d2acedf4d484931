"""Timelines export to Chrome traces and read back unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.timeline import Event, Timeline

pytestmark = pytest.mark.pure


def test_chrome_trace_round_trip(tmp_path: Path) -> None:
    timeline = Timeline(events=[
        Event(worker=0, name="forward", start_s=0.0, end_s=0.5, step=0),
        Event(worker=1, name="SEND_ACT", start_s=0.25, end_s=0.75, step=0, bytes=4096),
    ], source="simulator")
    data = timeline.to_json()
    names = [e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M"]
    assert names == ["rank 0", "rank 1"]
    timeline.write(tmp_path / "trace.json")
    import json

    again = Timeline.from_json(json.loads((tmp_path / "trace.json").read_text()))
    assert again == timeline and again.num_workers == 2
