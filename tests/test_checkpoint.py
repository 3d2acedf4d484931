"""Atomic checkpoints: a crash while saving leaves the previous checkpoint readable."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.errors import UsageError, WorkerFailure
from tandem.runtime import checkpoint
from tandem.runtime.checkpoint import CHECKPOINT_VERSION, load_checkpoint, save_atomic

pytestmark = pytest.mark.pure


def _state(step: int) -> dict[str, object]:
    return {"version": CHECKPOINT_VERSION, "step": step, "fingerprint": {"seed": 0}}


def test_crash_mid_save_keeps_the_last_good_checkpoint(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "checkpoint.pt"
    save_atomic(_state(10), path)

    def crash(obj: object, handle: object) -> None:
        handle.write(b"half a checkpoint")  # type: ignore[attr-defined]
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", crash)
    with pytest.raises(WorkerFailure, match=f"cannot write {path}: disk full"):
        save_atomic(_state(20), path)
    monkeypatch.undo()
    assert load_checkpoint(path, {"seed": 0})["step"] == 10
    assert list(tmp_path.iterdir()) == [path]


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "missing.pt", {})
    (tmp_path / "junk.pt").write_bytes(b"junk")
    with pytest.raises(UsageError, match="cannot read checkpoint"):
        load_checkpoint(tmp_path / "junk.pt", {})
    torch.save({"weights": 1}, tmp_path / "other.pt")
    with pytest.raises(UsageError, match="not a tandem checkpoint"):
        load_checkpoint(tmp_path / "other.pt", {})
    save_atomic(_state(1), tmp_path / "ok.pt")
    with pytest.raises(UsageError, match="seed=0"):
        load_checkpoint(tmp_path / "ok.pt", {"seed": 4})


def test_a_checkpoint_of_another_format_version_is_refused_in_one_line(tmp_path: Path) -> None:
    save_atomic({**_state(1), "version": CHECKPOINT_VERSION - 1}, tmp_path / "old.pt")
    with pytest.raises(UsageError) as refused:
        load_checkpoint(tmp_path / "old.pt", {"seed": 0})
    message = str(refused.value)
    assert "\n" not in message
    assert (f"has format version {CHECKPOINT_VERSION - 1} and this tandem reads version "
            f"{CHECKPOINT_VERSION}") in message
