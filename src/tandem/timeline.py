"""What each worker did and when: a list of timed actions, exported as a Chrome/Perfetto trace
and drawn as a Gantt chart."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

from tandem import strict_json
from tandem.output_files import atomic, write_text
from tandem.schedule.action import Action, Kind


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Event:
    """One action of one worker, timed in seconds from the start of the run."""

    worker: int
    """Global rank of the worker."""
    name: str
    """What the worker did: a schedule action's text in pipelines and the simulator (``1F3``,
    ``1SA3>2``, ``2RA3<1``, ``0AR``, ``0ST``; see :func:`event_action`), ``forward``,
    ``backward`` or ``step`` in data-parallel runs."""
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
        """Write the Chrome trace to ``path`` (strict JSON, atomically)."""
        write_text(path, strict_json.dumps(self.to_json()))

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


# -- Gantt chart ---------------------------------------------------------------------------------

_LEGACY = re.compile(r"(?P<kind>F|B|ST|forward|backward|step)(?P<micro>\d*)")
"""Names of compute events in data-parallel runs and in traces written before events were
named by their schedule action (``F3``, ``SA3``, ``RV1``, ``AR``)."""
_LEGACY_KIND = {"forward": "F", "backward": "B", "step": "ST"}
_COLOURS = {
    "F": "#4c72b0", "B": "#55a868", "ST": "#8c8c8c",
    "send": "#dd8452", "receive": "#c44e52", "collective": "#8172b3",
}
_LEGEND = {
    "F": "forward", "B": "backward", "ST": "optimizer step", "send": "send (post)",
    "receive": "receive (post to arrival)", "collective": "allreduce / exchange",
}
_ACTION_KIND = {
    Kind.FORWARD: "F", Kind.BACKWARD: "B", Kind.STEP: "ST",
    Kind.SEND_ACT: "send", Kind.SEND_GRAD: "send", Kind.PUSH: "send",
    Kind.RECV_ACT: "receive", Kind.RECV_GRAD: "receive", Kind.PULL: "receive",
    Kind.ALLREDUCE: "collective", Kind.EXCHANGE: "collective",
}


def event_action(name: str) -> Action | None:
    """The schedule action an event is named after (``2RA3<1``), or None for other names
    (``forward``, ``step``)."""
    try:
        return Action.parse(name)
    except ValueError:
        return None


def event_kind(name: str) -> tuple[str, str]:
    """``(lane colour key, label)`` of an event name: ``("F", "3")`` for ``1F3``,
    ``("send", "")`` for ``1SA3>2``, ``("receive", "")`` for ``2RG3<3``, ``("collective", "")``
    for ``0AR``; data-parallel names (``forward``, ``step``) and older ones (``F3``, ``SA3``)
    too."""
    action = event_action(name)
    if action is not None:
        kind = _ACTION_KIND[action.kind]
        compute = kind in ("F", "B", "ST") and action.microbatch is not None
        return kind, str(action.microbatch) if compute else ""
    match = _LEGACY.fullmatch(name)
    if match:
        kind = match["kind"]
        return _LEGACY_KIND.get(kind, kind), match["micro"]
    if name.startswith("S"):
        return "send", ""
    if name.startswith("R"):
        return "receive", ""
    return "collective", ""


def plot_gantt(timeline: Timeline, path: str | Path, *, title: str = "",
               steps: Collection[int] | None = None, width_in: float = 12.0) -> None:
    """Draw ``timeline`` as a Gantt chart (PNG, or any format matplotlib infers from ``path``).

    One row per worker: computation (forward, backward, optimizer step) as boxes coloured by
    kind, labelled with their micro-batch number when it fits; communication (sends, receives
    from post to completion, allreduces) on a thin lane under them. ``steps`` keeps only the
    events of those optimizer steps (a run of hundreds of steps is unreadable as one chart).
    """
    from matplotlib.figure import Figure

    workers = {e.worker for e in timeline.events if steps is None or e.step in steps}
    fig = Figure(figsize=(width_in, 1.2 + 0.55 * max(1, len(workers))), dpi=110)
    draw_gantt(fig.add_subplot(), timeline, title=title, steps=steps)
    fig.tight_layout()
    with atomic(path) as tmp:
        fig.savefig(tmp)


def draw_gantt(ax: Any, timeline: Timeline, *, title: str = "",
               steps: Collection[int] | None = None, span_ms: float | None = None) -> None:
    """Draw ``timeline`` on the matplotlib axes ``ax`` as :func:`plot_gantt` does, its time
    axis from the first event shown to ``span_ms`` later (default: the last event's end), so
    that charts drawn with the same ``span_ms`` share a scale."""
    from matplotlib.patches import Patch

    events = [e for e in timeline.events if steps is None or e.step in steps]
    workers = sorted({e.worker for e in events})
    if not events:
        ax.text(0.5, 0.5, "no events", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title or f"{timeline.source} timeline", fontsize=10)
        return
    origin = min(e.start_s for e in events)
    span_ms = span_ms or max(max(e.end_s for e in events) - origin, 1e-9) * 1e3
    fig = ax.figure
    px_per_ms = fig.get_figwidth() * fig.dpi * 0.8 / span_ms
    row_of = {worker: index for index, worker in enumerate(workers)}
    for event in events:
        kind, micro = event_kind(event.name)
        row = row_of[event.worker]
        start, width = (event.start_s - origin) * 1e3, (event.end_s - event.start_s) * 1e3
        compute = kind in ("F", "B", "ST")
        bottom, height = (row - 0.2, 0.55) if compute else (row + 0.38, 0.14)
        ax.broken_barh([(start, width)], (bottom, height), facecolors=_COLOURS[kind],
                       edgecolor="white" if compute else "none", linewidth=0.4,
                       alpha=1.0 if compute else 0.7)
        if micro and width * px_per_ms > 7 * len(micro) + 4:
            ax.text(start + width / 2, bottom + height / 2, micro, ha="center", va="center",
                    fontsize=7, color="white")
    ax.set_yticks(range(len(workers)), [f"rank {w}" for w in workers])
    ax.set_ylim(len(workers) - 0.4, -0.45)
    ax.set_xlim(0, span_ms)
    ax.set_xlabel("time (ms)")
    shown = sorted({event_kind(e.name)[0] for e in events}, key=list(_COLOURS).index)
    ax.legend(handles=[Patch(color=_COLOURS[k], label=_LEGEND[k]) for k in shown],
              loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(shown), fontsize=8,
              frameon=False)
    ax.set_title(title or f"{timeline.source} timeline", fontsize=10, pad=22)
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
