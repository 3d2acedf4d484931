"""What each worker did and when: a list of timed actions, exported as a Chrome/Perfetto trace."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Event:
    """One action of one worker, timed in seconds from the start of the run."""

    worker: int
    """Global rank of the worker."""
    name: str
    """Action name, e.g. ``forward``, ``backward``, ``step``, ``F3``, ``ALLREDUCE``."""
    start_s: float
    end_s: float
    step: int = -1
    """Optimizer step the action belongs to (-1 when none)."""
    bytes: int = 0
    """Bytes the action sent or received (0 for compute)."""
    version: int = -1
    """Weight version a forward or backward used (asynchronous pipelines; -1 when unused)."""


@dataclasses.dataclass(kw_only=True, slots=True)
class Timeline:
    """Events of all workers; produced by the runtime (measured) or the simulator (predicted)."""

    events: list[Event] = dataclasses.field(default_factory=list)
    source: str = "runtime"
    """``runtime`` for a measured run, ``simulator`` for a prediction."""

    @property
    def num_workers(self) -> int:
        """Number of distinct workers that have events."""
        return len({event.worker for event in self.events})

    def to_json(self) -> dict[str, Any]:
        """A Chrome trace (``chrome://tracing``, Perfetto): one process row per worker."""
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": worker, "args": {"name": f"rank {worker}"}}
            for worker in sorted({event.worker for event in self.events})
        ]
        events += [
            {
                "name": event.name, "ph": "X", "pid": event.worker, "tid": 0,
                "ts": event.start_s * 1e6, "dur": (event.end_s - event.start_s) * 1e6,
                "args": {"step": event.step, "bytes": event.bytes, "version": event.version},
            }
            for event in self.events
        ]
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"source": self.source}}

    def write(self, path: str | Path) -> None:
        """Write the Chrome trace to ``path``."""
        Path(path).write_text(json.dumps(self.to_json()))

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Timeline:
        """Read back a trace written by :meth:`to_json`."""
        events = [
            Event(
                worker=int(item["pid"]), name=item["name"], start_s=item["ts"] / 1e6,
                end_s=(item["ts"] + item["dur"]) / 1e6, step=item["args"]["step"],
                bytes=item["args"]["bytes"], version=item["args"].get("version", -1),
            )
            for item in data["traceEvents"] if item.get("ph") == "X"
        ]
        return cls(events=events, source=data.get("otherData", {}).get("source", "runtime"))
