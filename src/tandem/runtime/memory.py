"""This process's resident memory (Linux ``/proc/self/status``): now, at its peak, and at start.

``START_RSS_BYTES`` is taken when this module is first imported, which in a worker is right
after torch and tandem's runtime are (before any model or data exists): subtracting it from the
peak leaves what training itself held.
"""

from __future__ import annotations

import resource
import sys


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
