"""Checkpoints written atomically (write, fsync, rename) with a checksum, read back with clear
errors (a corrupt one named as such), and the component that saves them at
``--checkpoint-every`` steps and the last."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

import torch

from tandem.errors import UsageError
from tandem.output_files import atomic
from tandem.runtime.checksum import HashingWrites, WholeWrites, verify_file
from tandem.runtime.component import Component, StepEnd
from tandem.runtime.run_checkpoints import (
    check_held, check_servers, corrupt, keep_previous, peek, resume_where,
)

if TYPE_CHECKING:
    from tandem.runtime.job import Job

logger = logging.getLogger(__name__)

CHECKPOINT_VERSION = 4
"""2: every worker's own state (random stream, codec residuals; models of decentralized
strategies) under ``ranks``. 3: the components' states (precision, noise scale, the grown
batch schedule, a server's codecs), each under its name, in ``components``
(:meth:`~tandem.runtime.component.Components.state_dict`). 4: a tensor-parallel layer's
fused query/key/value rows in the model's order (no ``row_orders``)."""
CHECKSUM = "sha256"
"""What a checkpoint's ``checksum`` entry says: its file ends with the SHA-256 of its bytes
(:mod:`tandem.runtime.checksum`); a file without the entry is of a tandem before checksums."""


def save_atomic(obj: Any, path: str | Path, *, checksum: bool = False) -> None:
    """Save ``obj`` to ``path`` so that a crash leaves either the old file or the new one; with
    ``checksum``, the file ends with the SHA-256 of its bytes (:mod:`tandem.runtime.checksum`).

    A failed write (disk full, permissions) is one line naming ``path`` and the cause
    (:func:`~tandem.output_files.write_failure`), and leaves no temporary file.
    """
    with atomic(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        writer = HashingWrites(fd) if checksum else WholeWrites(fd)
        try:
            torch.save(obj, cast(IO[bytes], writer))  # it writes, flushes, and needs no more
            writer.finish()
        except RuntimeError:
            if writer.error is None:
                raise
            raise writer.error from None  # torch's own error on the way out hides it
        finally:
            writer.close()
            os.close(fd)


def save_checkpoint(state: dict[str, Any], path: Path, *, resume: str | None) -> None:
    """Save a checkpoint's ``state`` to ``path`` (atomically, with a checksum), keeping the
    checkpoint it replaces as ``previous/NAME`` beside it (:func:`keep_previous`; not when this
    run resumed from that one, ``resume``)."""
    keep_previous(path, resume)
    save_atomic({**state, "checksum": CHECKSUM}, path, checksum=True)


def resume_path(job: Job, out: str | Path | None, name: str = "checkpoint.pt") -> Path | None:
    """The checkpoint a run resumes from: None without ``--resume``; with ``--resume auto``
    (or a bare ``--resume``), ``OUT/name`` if it exists and None (start afresh) if not, so the
    same command line serves every attempt of a restarted job; with ``--resume PATH``, that
    file's folder's ``name`` (a folder's own ``name``), which must exist. Where ``name`` is
    missing but the folder holds a checkpoint this run cannot continue (another strategy's,
    other servers'), one line refuses it (:func:`~tandem.runtime.run_checkpoints.check_held`)."""
    resume = job.run.resume
    if resume is None:
        return None
    if resume == "auto":
        if out is None:
            raise UsageError("--resume auto needs --out DIR (it resumes DIR/checkpoint.pt)")
        folder = Path(out)
        path = folder / name
    else:
        given = Path(resume)
        folder = given if given.is_dir() else given.parent
        path = given if name == "checkpoint.pt" and not given.is_dir() else folder / name
    if not path.is_file() and folder.is_dir():
        check_held(folder, name, job, resume_where(resume, folder))
    return path if path.is_file() or resume != "auto" else None


def check_resume(job: Job) -> None:
    """Before any worker starts (the launcher's check): refuse a ``--resume`` whose run
    directory holds a checkpoint this run cannot continue, as the workers would on loading it
    (another strategy's; servers' of another number or, compressed, of other workers); the
    checksums are left to the workers, which read the files anyway."""
    servers = job.plan.num_servers
    path = resume_path(job, job.run.out, "server-0.pt" if servers else "checkpoint.pt")
    if not servers or path is None or job.run.resume is None:
        return
    header = peek(path)
    if header is not None:
        check_servers(header, path, job, resume_where(job.run.resume, job.run.out))


BY_NAME = {"dp", "pipeline"}
"""Strategies whose checkpoints hold the model's and optimizer's state under the model's names
(a folder of shards through DCP, or a data-parallel run's whole state with its optimizer's
``parameter_names``) and resume as one another: a data-parallel run's on a pipeline's stages,
a flush pipeline's as data parallelism."""


def load_checkpoint(path: str | Path, fingerprint: dict[str, Any], *, steps: int | None = None,
                    stop_after: int | None = None) -> dict[str, Any]:
    """Load a checkpoint and check that it belongs to a run with the same ``fingerprint`` and,
    given this run's ``--steps`` (and ``--stop-after``), that it was not saved after more."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"no checkpoint at {path}; run without --resume first, or pass its path")
    verified = verify_file(path)
    if verified is False:
        raise corrupt(path, "its bytes do not match the SHA-256 checksum saved with it")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's to fix
        raise UsageError(f"cannot read checkpoint {path}: {exc}") from None
    if isinstance(state, dict) and state.get("checksum") and verified is None:
        raise corrupt(path, "the checksum saved at its end is damaged")
    if not isinstance(state, dict) or "version" not in state:
        raise UsageError(f"{path} is not a tandem checkpoint")
    if state["version"] != CHECKPOINT_VERSION:
        raise UsageError(f"checkpoint {path} has format version {state['version']} and this "
                         f"tandem reads version {CHECKPOINT_VERSION}; resume it with the tandem "
                         f"that wrote it, or start afresh without --resume")
    for key, value in fingerprint.items():
        saved = state["fingerprint"].get(key)
        if key == "strategy" and {saved, value} <= BY_NAME and saved != value:
            if "sharded" in state or "parameter_names" in state:
                continue  # the model and optimizer state by name, which any layout reads
            how = ("a plain dp run's whole state from an older tandem, its optimizer's by "
                   "position" if saved == "dp" else "an asynchronous pipeline's whole state")
            fix = (", or checkpoint it again with this tandem (which names the optimizer's "
                   "parameters)" if saved == "dp" else "")
            raise UsageError(f"checkpoint {path} holds {how}, which --strategy {value} does not "
                             f"read; resume it with --strategy {saved}{fix}")
        if key == "strategy" and saved != value:
            raise UsageError(f"checkpoint {path} is of --strategy {saved}, and this run is "
                             f"--strategy {value}, which cannot continue it: resume with "
                             f"--strategy {saved}, or start afresh without --resume")
        if saved != value:
            raise UsageError(
                f"checkpoint {path} was made with {key}={state['fingerprint'].get(key)!r}, "
                f"this run has {key}={value!r}; resume with the same settings"
            )
    for flag, limit in (("--steps", steps), ("--stop-after", stop_after)):
        if limit is not None and int(state["step"]) > limit:
            raise UsageError(f"checkpoint {path} was saved after {state['step']} steps, but this "
                             f"run has {flag} {limit}; resume with {flag} {state['step']} or more")
    return state


def load_schedule(optimizer: torch.optim.Optimizer, scheduler: Any, state: dict[str, Any],
                  *, announce: bool) -> None:
    """Continue the saved learning-rate schedule ``state`` at this run's learning rate.

    A checkpoint's optimizer and schedule hold the learning rate it was trained with; resuming
    with another ``--lr`` (the fix for a run that diverged) must use the new one, so the base
    rates this run's optimizer was built with replace the saved ones, and (``announce``) one
    line says so. The same ``--lr`` changes nothing. A user's scheduler that is no
    ``LambdaLR`` (``tandem.fit(..., scheduler=...)``) continues as saved.
    """
    base_lrs = list(scheduler.base_lrs)
    scheduler.load_state_dict(state)
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return
    saved = list(scheduler.base_lrs)
    if saved == base_lrs:
        return
    scheduler.base_lrs = base_lrs
    for group, base, factor in zip(optimizer.param_groups, base_lrs, scheduler.lr_lambdas):
        group["initial_lr"] = base
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # noqa: SLF001
    if announce:
        logger.info(f"resuming with the learning rate {base_lrs[0]:g} (the checkpoint was "
                    f"trained with {saved[0]:g})")


class Checkpoints(Component):
    """Save a checkpoint after every step that calls for one (:attr:`StepEnd.saving`):
    ``check(step)`` first (it raises if the parameters must not be saved, e.g. diverged), then
    ``save(done)``."""

    def __init__(self, save: Callable[[int], None], *,
                 check: Callable[[int], None] | None = None) -> None:
        self.save, self.check = save, check

    def after_step(self, end: StepEnd) -> None:
        if not end.saving:
            return
        if self.check is not None:
            self.check(end.step)
        self.save(end.done)
