"""Checkpoints written atomically (write, flush, rename) and read back with clear errors."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tandem.errors import UsageError

CHECKPOINT_VERSION = 2
"""2: every worker's own state (random stream, codec residuals; models of decentralized
strategies) under ``ranks``."""


def save_atomic(obj: Any, path: str | Path) -> None:
    """Save ``obj`` to ``path`` so that a crash leaves either the old file or the new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def load_checkpoint(path: str | Path, fingerprint: dict[str, Any]) -> dict[str, Any]:
    """Load a checkpoint and check that it belongs to a run with the same ``fingerprint``."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"no checkpoint at {path}; run without --resume first, or pass its path")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's to fix
        raise UsageError(f"cannot read checkpoint {path}: {exc}") from None
    if not isinstance(state, dict) or state.get("version") != CHECKPOINT_VERSION:
        raise UsageError(f"{path} is not a tandem checkpoint (version {CHECKPOINT_VERSION})")
    for key, value in fingerprint.items():
        if state["fingerprint"].get(key) != value:
            raise UsageError(
                f"checkpoint {path} was made with {key}={state['fingerprint'].get(key)!r}, "
                f"this run has {key}={value!r}; resume with the same settings"
            )
    return state
