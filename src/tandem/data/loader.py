"""Reading a worker's batches ahead of training, in background processes (``--loader-workers``).

The order of training is fixed in advance (a sampler addresses every batch by step), so a
worker knows every batch it will take: a ``torch.utils.data.DataLoader`` over that list reads
them in ``workers`` processes, ``prefetch`` batches ahead each, while the worker trains.
:meth:`PlannedLoader.take` hands over the next batch when it is the one asked for; a batch
asked for out of turn is read directly (and the plan waits); planned batches skipped
(a parameter server moving a worker on) are dropped.

What goes wrong in a loader process comes back as what it is: a corrupt shard or a failing
dataset as the one-line :class:`~tandem.errors.UsageError` that names it (not PyTorch's
``Caught UsageError in DataLoader worker process 0`` and a traceback), any other error as one
line naming the loader process, the batch and the error, and a loader process that died (killed,
out of memory) as :class:`LoaderDied`.

Usage::

    loader = PlannedLoader(samples, [sampler.local_indices(s, rank=r, world_size=w)
                                     for s in range(first, last)], workers=2)
    batch = loader.take(indices)      # the batch of ``indices``, read ahead
    loader.close()
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils.data import DataLoader, Dataset

from tandem import structures
from tandem.data.pack import NUMPY_DTYPES
from tandem.data.samples import Batch, Samples
from tandem.errors import UsageError
from tandem.spec.loader import DEFAULT_PREFETCH

PIPE_BYTES = 1 << 20
"""Batches smaller than this travel from a loader process through its pipe as arrays (a third
of the time of passing tensors through shared memory, which larger ones use)."""
SKIP_AHEAD = 16
"""Planned batches a worker may skip (a parameter server moving it on a step) and still be
handed the next one read ahead."""


class LoaderDied(RuntimeError):
    """A loader process ended without handing over its batch (killed, out of memory)."""


class _Failed:
    """What a loader process hands over instead of a batch it could not read: the error,
    re-raised in the worker (:meth:`raise_it`)."""

    def __init__(self, error: BaseException, batch: int) -> None:
        self.usage = isinstance(error, UsageError)
        lines = str(error).strip().splitlines()
        self.text = (lines[0] if lines else "") if self.usage else \
            f"{type(error).__name__}: {lines[0] if lines else ''}"
        self.batch = batch

    def raise_it(self) -> None:
        if self.usage:
            raise UsageError(self.text)
        raise RuntimeError(f"a loader process (--loader-workers) failed reading this worker's "
                           f"planned batch {self.batch}: {self.text}")


class _PlannedBatches(Dataset[Any]):
    """Item ``i``: the ``i``-th planned batch, as ``(inputs, targets, size)``, or the error that
    reading it raised (:class:`_Failed`)."""

    def __init__(self, samples: Samples, plan: Sequence[torch.Tensor]) -> None:
        self.samples, self.plan = samples, plan

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, i: int) -> Any:
        try:
            return self._read(i)
        except Exception as exc:  # handed over whole: PyTorch would wrap it in its traceback
            return _Failed(exc, i)

    def _read(self, i: int) -> tuple[Any, Any, int]:
        batch = self.samples.take(self.plan[i])
        inputs, targets = batch.inputs, batch.targets
        if sum(t.numel() * t.element_size() for t in structures.tensors((inputs, targets))) \
                < PIPE_BYTES:
            inputs, targets = pytree.tree_map(_to_numpy, (inputs, targets))
        return inputs, targets, batch.size


def _to_numpy(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor) and leaf.dtype in NUMPY_DTYPES:
        return _Array(leaf.numpy())
    return leaf


def _from_numpy(leaf: Any) -> Any:
    return torch.from_numpy(leaf.array) if isinstance(leaf, _Array) else leaf


class _Array:
    """A tensor's values sent through the loader's pipe (unwrapped into a tensor again)."""

    __slots__ = ("array",)

    def __init__(self, array: Any) -> None:
        self.array = array

    def __getstate__(self) -> Any:
        return self.array

    def __setstate__(self, state: Any) -> None:
        self.array = state


def _as_is(item: Any) -> Any:
    return item


def _pinned(tree: Any) -> Any:
    """``tree`` with every tensor in pinned memory (those pinned already kept)."""
    return pytree.tree_map(lambda x: x if not isinstance(x, torch.Tensor) or x.is_pinned()
                           else x.pin_memory(), tree)


def _one_thread(worker_id: int) -> None:
    torch.set_num_threads(1)


def _same(planned: torch.Tensor, wanted: torch.Tensor) -> bool:
    return len(planned) == len(wanted) and torch.equal(planned, wanted)


class PlannedLoader:
    """The batches ``plan`` of ``samples`` (on the CPU), read ahead by ``workers`` processes and
    handed over on ``device``; ``context`` is the ``multiprocessing`` context the processes
    start in (None: the platform's default; a training worker passes the one that forks it)."""

    def __init__(self, samples: Samples, plan: Sequence[torch.Tensor], *, workers: int,
                 device: torch.device | None = None, prefetch: int = DEFAULT_PREFETCH,
                 context: Any = None, pin_memory: bool = False) -> None:
        if workers < 1:
            raise ValueError(f"a loader needs at least one worker process (got {workers})")
        if pin_memory and (device is None or device.type != "cuda"):
            raise UsageError(f"loader option pin_memory=True pins batches for their copy to a "
                             f"GPU, and this worker trains on {device or 'the CPU'}; drop it")
        self.plan, self.device, self.position = list(plan), device, 0
        self.pinned = pin_memory
        self.loader = DataLoader(_PlannedBatches(samples, self.plan), batch_size=None,
                                 shuffle=False, num_workers=workers, prefetch_factor=prefetch,
                                 collate_fn=_as_is, worker_init_fn=_one_thread,
                                 multiprocessing_context=context, pin_memory=pin_memory)
        self.batches: Iterator[tuple[Any, Any, int]] | None = (
            iter(self.loader) if self.plan else None)

    def take(self, indices: torch.Tensor) -> Batch | None:
        """The next planned batch if it is the batch of ``indices``; None otherwise (then the
        caller reads it itself)."""
        if self.batches is None:
            return None
        wanted = indices.cpu()
        ahead = next((k for k in range(min(SKIP_AHEAD, len(self.plan) - self.position))
                      if _same(self.plan[self.position + k], wanted)), None)
        if ahead is None:
            return None
        for _ in range(ahead):  # planned batches the worker skipped (a server moved it on)
            self._next()
        self.position += ahead + 1
        inputs, targets, size = pytree.tree_map(_from_numpy, self._next())
        batch = Batch(inputs, targets, size)
        if self.position == len(self.plan):
            self.close()
        if self.device is None:
            return batch
        if self.pinned:  # pinned by the DataLoader's thread (arrays came through the pipe)
            return Batch(structures.to_device(_pinned(inputs), self.device, non_blocking=True),
                         structures.to_device(_pinned(targets), self.device, non_blocking=True),
                         size)
        return batch.to(self.device)

    def _next(self) -> Any:
        """The next item the loader processes hand over; their failure raised here."""
        assert self.batches is not None
        try:
            item = next(self.batches)
        except RuntimeError as exc:
            if not str(exc).startswith("DataLoader worker"):
                raise
            self.close()
            pids = re.search(r"pid\(?s?\)? ([\d, ]+)", str(exc))
            which = f"pid {pids.group(1).strip()}, " if pids else ""
            raise LoaderDied(f"its loader process ({which}--loader-workers) died before handing "
                             f"over a batch: killed, or out of memory") from None
        if isinstance(item, _Failed):
            self.close()
            item.raise_it()
        return item

    def close(self) -> None:
        """Stop the loader processes."""
        if self.batches is not None:
            shutdown = getattr(self.batches, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            self.batches = None
