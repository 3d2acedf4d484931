"""What checkpoint a run directory holds, the one before it, and which runs can continue it.

A run saves one of two kinds of checkpoint in its ``--out``: ``checkpoint.pt`` (with a folder
``checkpoint-STEP.dcp`` where its state is sharded), written by the workers of dp, pipelines,
tensor parallelism, gossip, localsgd and synchronous EASGD; or ``server-K.pt`` from each
parameter server (ps, asynchronous EASGD), with ``worker-K.pt`` from each compressed ps worker.
Each role resumes from its own file name, so a run that finds none of its own beside another
kind's would silently start afresh: :func:`check_held` refuses it, naming both runs, and
:func:`check_servers` refuses a servers' checkpoint on another number of servers (each holds
its part of the model) or, compressed, of workers (each server holds each worker's codec
state).

The checkpoint a save replaces is kept as ``previous/NAME`` (a hard link: no copy; a sharded
one's folder stays in ``OUT``, beside the latest's), so that a checkpoint found corrupt on load
(:mod:`tandem.runtime.checksum`) comes with the previous one to resume from instead
(:func:`corrupt`). A run resumed from ``previous/`` keeps it there: the newer file it
replaces is the corrupt one.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tandem.errors import UsageError
from tandem.runtime.checksum import verify_file
from tandem.strategy import strategy_of

if TYPE_CHECKING:
    from tandem.runtime.job import Job

PREVIOUS = "previous"
"""The folder in ``OUT`` that holds the checkpoint before the latest."""
TRAINERS = "checkpoint.pt"
"""The checkpoint of every strategy without parameter servers."""
SERVERS = "server-*.pt"
"""The parameter servers' checkpoints, one per server."""
WORKERS = "worker-*.pt"
"""Compressed ps workers' codec states, one per worker."""


def keep_previous(path: Path, resume: str | None) -> None:
    """Before ``path`` is replaced: keep it as ``previous/NAME`` (a hard link), unless this run
    resumed from that very ``previous/NAME`` (``resume``), which stays. A file system without
    hard links keeps no previous checkpoint."""
    previous = path.parent / PREVIOUS / path.name
    if not path.is_file() or _resumed_from(previous, resume):
        return
    with contextlib.suppress(OSError):
        previous.parent.mkdir(exist_ok=True)
        previous.unlink(missing_ok=True)
        os.link(path, previous)


def _resumed_from(previous: Path, resume: str | None) -> bool:
    """Whether ``--resume`` named the folder of ``previous`` (any file in it)."""
    if resume is None or resume == "auto":
        return False
    given = Path(resume)
    folder = given if given.is_dir() else given.parent
    with contextlib.suppress(OSError):
        return folder.resolve() == previous.parent.resolve()
    return False


def previous_sharded(out: Path) -> str | None:
    """The sharded folder that ``OUT/previous/checkpoint.pt`` names (kept beside the latest's;
    None without one)."""
    header = peek(out / PREVIOUS / TRAINERS)
    name = header.get("sharded") if header is not None else None
    return name if isinstance(name, str) else None


def sharded_folder(path: Path, name: str) -> Path:
    """The folder ``name`` that the checkpoint ``path`` names: beside it, or, for a previous
    checkpoint (``OUT/previous/checkpoint.pt``), in the run directory above, where it stays."""
    folder = path.parent / name
    if not folder.is_dir() and path.parent.name == PREVIOUS:
        return path.parent.parent / name
    return folder


def corrupt(path: Path, why: str) -> UsageError:
    """The one line for a checkpoint ``path`` found corrupt (``why``), offering the previous
    checkpoint where one is kept and whole."""
    previous = path.parent / PREVIOUS / path.name
    header = peek(previous) if path.parent.name != PREVIOUS else None
    if header is not None and verify_file(previous) is not False:
        fix = (f"resume from the previous one (step {header.get('step')}) with --resume "
               f"{previous}, or drop --resume and add --overwrite to start over")
    else:
        fix = "drop --resume and add --overwrite to start over (no previous checkpoint is kept)"
    return UsageError(f"checkpoint {path} is corrupt ({why}); {fix}")


def peek(path: Path) -> dict[str, Any] | None:
    """A checkpoint's contents with its tensors left on disk (memory-mapped): enough to read
    its step, settings and layout; None if it is missing or unreadable."""
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception:  # noqa: BLE001 - whatever it is, it tells nothing
        return None
    return state if isinstance(state, dict) else None


def describe_run(job: Job) -> str:
    """This run as the messages name it: ``--strategy ps (1 server, 2 workers)``."""
    plan = job.plan
    servers = plan.num_servers
    workers = plan.num_workers - servers
    if servers:
        return f"--strategy {strategy_of(plan)} ({_count(servers, 'server')}, " \
               f"{_count(workers, 'worker')})"
    return f"--strategy {strategy_of(plan)} ({_count(workers, 'worker')})"


def _describe_saved(folder: Path) -> str:
    """The checkpoint in ``folder`` as the messages name it."""
    header = peek(folder / TRAINERS)
    servers = sorted(folder.glob(SERVERS))
    if header is None and servers:
        header = peek(servers[0])
    if header is None:
        return "a checkpoint"
    strategy = header.get("fingerprint", {}).get("strategy", "?")
    if "ranks" in header:
        parts = [_count(len(header["ranks"]), "worker")]
    else:
        parts = [_count(int(header.get("servers", len(servers))), "server")]
        if "workers" in header:
            parts.append(_count(int(header["workers"]), "worker"))
    return f"a checkpoint of --strategy {strategy} ({', '.join(parts)}, step {header.get('step')})"


def _count(number: int, what: str) -> str:
    return f"{number} {what}{'' if number == 1 else 's'}"


def resume_where(resume: str, out: str | Path | None) -> str:
    """How messages name the run directory a run resumes from: ``--out DIR`` (auto) or
    ``--resume PATH``."""
    return f"--out {out}" if resume == "auto" else f"--resume {resume}"


def check_held(folder: Path, name: str, job: Job, where: str) -> None:
    """Where this role's own checkpoint ``name`` is missing from ``folder``: refuse the run if
    the folder holds a checkpoint it cannot continue (another kind's, or servers' of another
    number), or only the previous one, instead of letting it start afresh (``where``: ``--out
    DIR`` or ``--resume PATH``)."""
    if name.startswith("worker-"):
        return  # a compressed ps worker: the servers judge their checkpoint
    kept = folder / PREVIOUS / name
    if kept.is_file() and folder.name != PREVIOUS:
        raise UsageError(f"{where} holds no {name} but the previous checkpoint {kept}; resume "
                         f"from it with --resume {kept}, or drop --resume and add --overwrite "
                         f"to start over")
    servers = sorted(folder.glob(SERVERS))
    if name.startswith("server-"):
        if servers:
            _refuse_servers(where, len(servers), job, servers)
            raise UsageError(f"{where} holds the checkpoints of {_count(len(servers), 'server')} "
                             f"but not {name}; resume from a complete copy of the run, or drop "
                             f"--resume and add --overwrite to start over")
        other = (folder / TRAINERS).is_file()
    else:
        other = bool(servers)
    if other:
        raise UsageError(f"{where} holds {_describe_saved(folder)}; this run is "
                         f"{describe_run(job)}, which cannot continue it: resume with the "
                         f"strategy and layout it was saved with, or drop --resume and add "
                         f"--overwrite to start over")


def check_servers(state: dict[str, Any], path: Path, job: Job, where: str) -> None:
    """A servers' checkpoint (``state``, read from ``path``) resumes on as many servers and,
    compressed, on as many workers (each server holds each worker's codec state)."""
    folder, plan = path.parent, job.plan
    servers = int(state.get("servers", len(list(folder.glob(SERVERS)))))
    if servers != plan.num_servers:
        _refuse_servers(where, servers, job, sorted(folder.glob(SERVERS)))
    if plan.compress is None:
        return
    workers = int(state.get("workers", len(list(folder.glob(WORKERS)))))
    now = plan.num_workers - plan.num_servers
    if workers != now:
        raise UsageError(f"checkpoint {path} holds {workers} workers' codec state (error "
                         f"feedback, on the servers and in worker-K.pt) for --compress "
                         f"{plan.compress.text}, which cannot be split among {now}; resume with "
                         f"--nproc {workers + plan.num_servers}")


def _refuse_servers(where: str, servers: int, job: Job, files: list[Path]) -> None:
    """Refuse the checkpoint of ``servers`` parameter servers on this run's number of them."""
    plan = job.plan
    if servers == plan.num_servers:
        return
    names = ", ".join(path.name for path in files[:3]) + (", ..." if len(files) > 3 else "")
    workers = plan.num_workers - plan.num_servers
    raise UsageError(f"{where} holds the checkpoint of {_count(servers, 'parameter server')} "
                     f"({names}), and this run has --servers {plan.num_servers} (each server "
                     f"holds its part of the model); resume with --servers {servers} --nproc "
                     f"{servers + workers}")
