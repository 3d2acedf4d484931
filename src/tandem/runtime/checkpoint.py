"""Checkpoints written atomically (write, fsync, rename) and read back with clear errors, and
the component that saves them at ``--checkpoint-every`` steps and the last."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, cast

import torch

from tandem.errors import UsageError
from tandem.output_files import atomic, write_all

logger = logging.getLogger(__name__)
from tandem.runtime.component import Component, StepEnd

CHECKPOINT_VERSION = 4
"""2: every worker's own state (random stream, codec residuals; models of decentralized
strategies) under ``ranks``. 3: the components' states (precision, noise scale, the grown
batch schedule, a server's codecs), each under its name, in ``components``
(:meth:`~tandem.runtime.component.Components.state_dict`). 4: a tensor-parallel layer's
fused query/key/value rows in the model's order (no ``row_orders``)."""


def save_atomic(obj: Any, path: str | Path) -> None:
    """Save ``obj`` to ``path`` so that a crash leaves either the old file or the new one.

    A failed write (disk full, permissions) is one line naming ``path`` and the cause
    (:func:`~tandem.output_files.write_failure`), and leaves no temporary file.
    """
    with atomic(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        writer = _WholeWrites(fd)
        try:
            torch.save(obj, cast(IO[bytes], writer))  # it writes, flushes, and needs no more
        except RuntimeError:
            if writer.error is None:
                raise
            raise writer.error from None  # torch's own error on the way out hides it
        finally:
            os.close(fd)


class _WholeWrites:
    """A file for ``torch.save`` whose writes are never short and whose failure is kept: torch
    reports a short or failed write as ``RuntimeError: [enforce fail at inline_container.cc]``,
    with neither the path nor the cause; this keeps the ``OSError`` (``ENOSPC``) it is."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            write_all(self.fd, data)
        except OSError as exc:
            self.error = self.error or exc
            raise
        return memoryview(data).nbytes

    def flush(self) -> None:
        """Nothing is buffered here."""


def resume_path(resume: str | None, out: str | Path | None,
                name: str = "checkpoint.pt") -> Path | None:
    """The checkpoint a run resumes from: None without ``--resume``; with ``--resume auto``
    (or a bare ``--resume``), ``OUT/name`` if it exists and None (start afresh) if not, so the
    same command line serves every attempt of a restarted job; with ``--resume PATH``, that
    file's folder's ``name`` (which must exist)."""
    if resume is None:
        return None
    if resume == "auto":
        if out is None:
            raise UsageError("--resume auto needs --out DIR (it resumes DIR/checkpoint.pt)")
        path = Path(out) / name
        return path if path.is_file() else None
    given = Path(resume)
    return given if name == "checkpoint.pt" else given.with_name(name)


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
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's to fix
        raise UsageError(f"cannot read checkpoint {path}: {exc}") from None
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
