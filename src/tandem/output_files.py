"""Output files written whole or not at all; a write that fails (disk full, permissions) is one
line naming the file and the cause, and leaves no temporary file behind.

Usage::

    write_text(out / "trace.json", text)          # atomically: temporary file, fsync, rename
    with atomic(out / "gantt.png") as tmp:        # for writers that take a path
        figure.savefig(tmp)
    log = AppendLog(out / "metrics.jsonl")        # one whole line at a time
    log.write_line(line)

A failure raises :class:`~tandem.errors.WorkerFailure` (exit status 1: the machine's state, not
the user's input); whatever file was there before stays as it was. :func:`os_error_line` words
any other failed read or write (an ``OSError`` that reaches the command line) the same way.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path

from tandem.errors import WorkerFailure

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_DENIED = (errno.EACCES, errno.EPERM)


def cause(exc: OSError) -> str:
    """What went wrong, in the system's words (``No space left on device``)."""
    return exc.strerror or str(exc) or type(exc).__name__


def write_fix(exc: OSError) -> str:
    """What to do about a failed write, by its cause."""
    if exc.errno in _NO_SPACE:
        return "free space on its file system, or write elsewhere"
    if exc.errno == errno.EROFS:
        return "its file system is mounted read-only: write elsewhere"
    if exc.errno in _DENIED:
        return "make it writable for this user, or write elsewhere"
    return "check its directory and permissions, or write elsewhere"


def write_failure(path: str | Path, exc: OSError) -> WorkerFailure:
    """The one-line error of a failed write of ``path``."""
    return WorkerFailure(f"cannot write {path}: {cause(exc)}; {write_fix(exc)}")


def os_error_line(exc: OSError) -> str:
    """One line for an ``OSError`` that no writer or reader named: the file it names (both of
    a rename), the cause and, for the causes a user can act on, the fix."""
    paths = [str(name) for name in (exc.filename, exc.filename2) if name is not None]
    where = f"{' -> '.join(paths)}: " if paths else ""
    if exc.errno in (*_NO_SPACE, errno.EROFS):
        return f"{where}{cause(exc)}; {write_fix(exc)}"
    if exc.errno in _DENIED:
        return f"{where}{cause(exc)}; check its permissions"
    return f"{where}{cause(exc)}"


def temporary_path(path: Path) -> Path:
    """A hidden name beside ``path``, unique to this process on this machine (its id and the
    machine's name: a directory may be shared by the nodes of a job), with the same suffix
    (writers such as matplotlib choose the format from it)."""
    return path.with_name(f".{path.stem}.tmp{os.getpid()}@{_HOST}{path.suffix}")


_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"
"""This machine's name as temporary files carry it (no dots: the suffix comes after it)."""
_TEMPORARY = re.compile(
    r"\.(?P<stem>.+)\.tmp(?P<pid>\d+)(?:@(?P<host>[A-Za-z0-9-]+))?(?P<suffix>\.[^.]*)?")


def remove_abandoned(directory: Path) -> list[Path]:
    """Remove the temporary files in ``directory`` whose writer has ended without renaming them
    (a worker killed mid-write by a stop signal); returns what was removed. The file they were
    to replace keeps its last whole content."""
    removed = []
    for path in directory.glob(".*.tmp*"):
        match = _TEMPORARY.fullmatch(path.name)
        if match is None or match.group("host") not in (None, _HOST):
            continue  # another machine's writer: only that machine can tell if it ended
        if _alive(int(match.group("pid"))):
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextlib.contextmanager
def atomic(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path to write ``path``'s new content to; when the body ends, the file
    is synced and renamed over ``path``. If anything fails, the temporary file is removed and
    ``path`` keeps its old content (an ``OSError`` becomes a :func:`write_failure`)."""
    path = Path(path)
    tmp = temporary_path(path)
    try:
        yield tmp
        _fsync(tmp, os.O_RDONLY)
        os.replace(tmp, path)
        _fsync(path.parent, os.O_RDONLY)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise write_failure(path, exc) from None
        raise


def write_text(path: str | Path, text: str) -> None:
    """Replace ``path`` by a file holding ``text`` (UTF-8), atomically."""
    with atomic(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            write_all(fd, text.encode())
        finally:
            os.close(fd)


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write every byte of ``data`` to ``fd``: a short write (a file system that is filling
    up) is continued, so that a full disk shows as ``OSError(ENOSPC)``."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


class AppendLog:
    """A file that grows one line at a time (``metrics.jsonl``). A line that cannot be written
    whole is taken back, so the file stays valid JSON lines, and the failure is reported."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise write_failure(self.path, exc) from None

    def write_line(self, text: str) -> None:
        """Append ``text`` and a newline."""
        size = os.fstat(self._fd).st_size
        try:
            write_all(self._fd, (text + "\n").encode())
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, size)
            raise write_failure(self.path, exc) from None

    def close(self) -> None:
        os.close(self._fd)


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
