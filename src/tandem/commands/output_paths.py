"""Checks that a command's output files can be written, made before the work that produces them
(a plan, a profile, a simulation), so that a bad path costs one line and no lost work.

Usage::

    check_output_files(("-o", args.output), ("--gantt", args.gantt))   # None paths are skipped
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from tandem.errors import UsageError


def check_output_files(*outputs: tuple[str, str | None]) -> None:
    """Raise a :class:`UsageError` naming the flag for the first ``(flag, path)`` whose file
    cannot be created or replaced (as :func:`tandem.output_files.write_text` does: a new file
    in its directory, renamed over it)."""
    for flag, path in outputs:
        if path is not None:
            _check_file(flag, path)


def _check_file(flag: str, path: str) -> None:
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"{flag} {path} is a directory; give the path of a file (in it or "
                         f"elsewhere)")
    folder = target.parent
    if not folder.is_dir():
        raise UsageError(f"{flag} {path}: the directory {folder} does not exist; create it or "
                         f"write elsewhere")
    if target.exists() and not os.access(target, os.W_OK):
        raise UsageError(f"{flag} {path} is not writable (permission denied); choose a path you "
                         f"can write")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".tandem-check-"):
            pass
    except OSError as exc:
        raise UsageError(f"{flag} {path} cannot be written in {folder} "
                         f"({exc.strerror or exc}); choose a path you can write") from None
