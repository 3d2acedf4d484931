"""A run's ``--out`` directory: one job at a time, and no run's outputs lost by accident.

Usage::

    with claim_out(job.run):
        launch(train_worker, job, nproc=job.run.nproc)

- A fresh run (no ``--resume``) into a directory that holds another run's outputs is refused,
  unless ``--overwrite``, which removes them first (not ``plan.json``, which may be this run's
  input; it is rewritten at the end).
- A lock, ``flock`` on ``OUT/.tandem.lock``, is held for the whole job by the process that
  runs ``tandem train``: the launcher of the local workers, or under ``torchrun`` each node's
  local rank 0 (the other ranks take no lock). Each node locks its own ``--out``; where the
  nodes share one directory, the first node's lock holds it and the job's other nodes, which
  find the lock held by their own job (the lock file names it), join it without a lock of
  their own. A second job on the same directory fails at once, naming the process that holds
  it. The kernel releases the lock however that process ends (even ``kill -9``), so a dead job
  leaves no stale lock; the file itself stays. ``flock`` is exclusive across machines on NFSv4
  and most cluster file systems (Lustre needs its ``flock`` mount option).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from tandem.errors import UsageError
from tandem.output_files import remove_abandoned, write_failure
from tandem.runtime.config import RunConfig
from tandem.runtime.launcher_env import under_launcher

LOCK_NAME = ".tandem.lock"
RUN_FILES = ("checkpoint.pt", "final.pt", "metrics.jsonl", "metrics.csv", "tensorboard",
             "trace.json", "gantt.png", "config.json", "final.dcp", "previous")
"""Files that show a run wrote to a directory (with :data:`RUN_PATTERNS`)."""
RUN_PATTERNS = ("server-*.pt", "worker-*.pt", "trace-rank*.json", "checkpoint-*.dcp")


RUNS_DIR_VARIABLE = "TANDEM_RUNS_DIR"
"""Where runs without ``--out`` go (default ``runs``, under the working directory)."""


def default_out() -> Path:
    """A new directory for a run without ``--out``: ``runs/<date>_<time>`` (``-2``, ``-3``, ...
    after it when two runs start in the same second), made now so that no other run takes it;
    under ``$TANDEM_RUNS_DIR`` instead of ``runs`` where that is set. Under ``torchrun`` the
    workers could not agree on a name: one line asks for ``--out`` (``tandem train`` does not
    ask for one there; it runs, and says at the end that nothing was written)."""
    if under_launcher():
        raise UsageError("under torchrun, give --out DIR (every worker must name the same "
                         "directory; on several machines, a shared one or one per machine)")
    base = Path(os.environ.get(RUNS_DIR_VARIABLE) or "runs")
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    for attempt in itertools.count(1):
        path = base / (stamp if attempt == 1 else f"{stamp}-{attempt}")
        try:
            path.mkdir(parents=True)
        except FileExistsError:
            continue
        except OSError as exc:
            raise UsageError(f"cannot make {path} for this run's outputs ({exc.strerror}); give "
                             f"--out DIR, or set {RUNS_DIR_VARIABLE}") from None
        return path
    raise AssertionError("unreachable")


def remove_if_unused(out: Path) -> None:
    """Remove ``out`` (a :func:`default_out` of a run that was refused or failed) if it holds
    nothing but the lock file: no run's output is lost, and no empty run is left behind."""
    with contextlib.suppress(OSError):
        if {path.name for path in out.iterdir()} <= {LOCK_NAME}:
            shutil.rmtree(out)


@contextlib.contextmanager
def claim_out(run: RunConfig) -> Iterator[None]:
    """Hold ``run.out`` for the duration of the body (see the module's docstring); on other
    ranks of a ``torchrun`` job, or without ``--out``, do nothing."""
    if run.out is None or (under_launcher() and os.environ.get("LOCAL_RANK", "0") != "0"):
        yield
        return
    if run.overwrite and run.resume is not None:
        raise UsageError("--overwrite starts a run over and --resume continues one; give one")
    out = Path(run.out)
    fd = _lock(out)
    if fd is None:  # another node of this job holds the shared directory, and checked it
        yield
        return
    try:
        if run.resume is None:
            _make_room(out, overwrite=run.overwrite)
        yield
    finally:
        remove_abandoned(out)  # what workers stopped mid-write left (their files stay whole)
        os.close(fd)


def run_outputs(out: Path) -> list[Path]:
    """The outputs of a run found in ``out``, by name."""
    found = [out / name for name in RUN_FILES if (out / name).exists()]
    found += [path for pattern in RUN_PATTERNS for path in out.glob(pattern)]
    return sorted(found)


def _lock(out: Path) -> int | None:
    """Lock ``out``, write this process's id (and its ``torchrun`` job's) into the lock file,
    and return its descriptor; None where another node of this job holds it."""
    path = out / LOCK_NAME
    job = _job_id()
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise write_failure(path, exc) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd, job)
        os.close(fd)
        if job is not None and holder.endswith(f"job {job}"):
            return None
        raise UsageError(f"--out {out} is in use by another tandem job ({holder}); wait for it "
                         f"to end or choose another --out") from None
    try:
        os.ftruncate(fd, 0)
        named = "" if job is None else f", job {job}"
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}{named}\n".encode())
    except OSError as exc:
        os.close(fd)
        raise write_failure(path, exc) from None
    return fd


def _job_id() -> str | None:
    """What every node of this ``torchrun`` job shares, and no other job does: its master's
    address and port, and the rendezvous id (None for local workers)."""
    if not under_launcher():
        return None
    return (f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
            f"/{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}")


def _holder(fd: int, job: str | None) -> str:
    """Who holds the lock, as its lock file says: read again for up to 3 s while it does not
    name ``job`` (a node of this job may have locked it and not yet written its name)."""
    deadline = time.monotonic() + (3.0 if job is not None else 0.0)
    while True:
        os.lseek(fd, 0, os.SEEK_SET)
        holder = os.read(fd, 300).decode(errors="replace").strip() or "pid unknown"
        if job is None or holder.endswith(f"job {job}") or time.monotonic() > deadline:
            return holder
        time.sleep(0.1)


def _make_room(out: Path, *, overwrite: bool) -> None:
    """Refuse to start afresh over another run's outputs, or remove them with ``overwrite``."""
    found = run_outputs(out)
    if not found:
        return
    if not overwrite:
        names = ", ".join(path.name for path in found)
        raise UsageError(f"--out {out} holds another run ({names}); use --resume to continue it "
                         f"or --overwrite to start over")
    for path in found:
        try:
            shutil.rmtree(path) if path.is_dir() else path.unlink()  # a sharded checkpoint
        except OSError as exc:
            raise UsageError(f"--overwrite cannot remove {path} ({exc.strerror}); remove it "
                             f"yourself or choose another --out") from None
