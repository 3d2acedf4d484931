"""This process's resident memory (Linux ``/proc/self/status``): now, at its peak, and at start,
and the component that reports them in a run's summary.

``START_RSS_BYTES`` is taken when this module is first imported, which in a worker is right
after torch and tandem's runtime are (before any model or data exists): subtracting it from the
peak leaves what training itself held.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Callable
from typing import Any

from tandem.runtime.component import Component, StepEnd


def _status_bytes(key: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` in bytes (0 where there is no such file)."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss_bytes() -> int:
    """Resident memory now."""
    return _status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    """The most resident memory this process has held (``VmHWM``, else ``getrusage``)."""
    peak = _status_bytes("VmHWM")
    if peak:
        return peak
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, kB elsewhere
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


START_RSS_BYTES = rss_bytes()
"""Resident memory when this module was first imported."""


class PeakMemory(Component):
    """The summary's memory fields: the peak up to the last step's update
    (``training_peak_rss_bytes``, before the checkpoint, evaluation and ``final.pt`` that
    follow; with ``--checkpoint-every`` the earlier checkpoints count), the peak at the end,
    and the memory at start."""

    def __init__(self) -> None:
        self.training_bytes = 0
        self.checkpoint_growth = 0
        """The most a checkpoint raised this process's peak (0: each stayed under it)."""

    def measured(self, save: Callable[[int], None]) -> Callable[[int], None]:
        """``save`` recording how far each call raises this process's peak resident memory
        above the peak before it (the summary's ``checkpoint_peak_growth_bytes``)."""
        def run(done: int) -> None:
            before = peak_rss_bytes()
            save(done)
            self.checkpoint_growth = max(self.checkpoint_growth, peak_rss_bytes() - before)
        return run

    def after_step(self, end: StepEnd) -> None:
        if end.final:
            self.training_bytes = peak_rss_bytes()

    def training_done(self) -> None:
        """Training has ended (at its last step, or earlier): the peak so far, if not taken."""
        if not self.training_bytes:
            self.training_bytes = peak_rss_bytes()

    def summary(self) -> dict[str, Any]:
        return {"training_peak_rss_bytes": self.training_bytes,
                "checkpoint_peak_growth_bytes": self.checkpoint_growth,
                "peak_rss_bytes": peak_rss_bytes(), "start_rss_bytes": START_RSS_BYTES}
