"""The ``DataLoader`` options that mean something to tandem's batches, and why the others do not.

tandem makes every batch itself: a sampler addresses each global batch by step (so a run resumes
exactly and every number of workers sees the same batches), each worker takes its share, and
background processes read the planned batches ahead (``--loader-workers``,
:mod:`tandem.data.loader`). Of ``torch.utils.data.DataLoader``'s options, those below change
what tandem does; any other is refused in one line that says where its job is done instead.
``num_workers`` is ``loader_workers`` (``tandem.fit`` takes either).

Usage::

    options = LoaderOptions.parse({"pin_memory": True, "drop_last": True})
    options.shuffle         # True: each epoch is a shuffle by the seed
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tandem.errors import UsageError

DEFAULT_PREFETCH = 4
"""Batches each loader process reads ahead when ``prefetch_factor`` is not given."""

ELSEWHERE = {
    "batch_size": "give batch_size= (the global batch, all workers together)",
    "sampler": "give sampler= to tandem.fit (it orders each epoch; tandem batches and shards)",
    "batch_sampler": "tandem makes batches of batch_size itself; give a sampler of indices "
                     "(sampler=)",
    "collate_fn": "give collate_fn= to tandem.fit",
    "num_workers": "give it as loader_workers=",
    "persistent_workers": "tandem's loader processes already live for the whole run",
    "generator": "tandem draws each epoch's order from seed=",
    "worker_init_fn": "tandem starts and sets up its loader processes itself",
    "multiprocessing_context": "tandem starts its loader processes from its worker's own",
    "timeout": "a worker waits for its batches as long as for its collectives (timeout=)",
    "in_order": "tandem hands over the planned batches in order, always",
    "pin_memory_device": "pin_memory pins for the worker's own GPU",
}
"""DataLoader options tandem does not take, and where their job is done."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LoaderOptions:
    """How a run's batches are ordered and read ahead, in ``DataLoader``'s terms."""

    shuffle: bool = True
    """Each epoch is a shuffle of the samples by the seed; False: the samples in turn."""
    drop_last: bool = False
    """Drop each epoch's last global batch when it is short (needs a fixed batch size)."""
    prefetch_factor: int | None = None
    """Batches each loader process reads ahead (needs ``loader_workers``; None:
    :data:`DEFAULT_PREFETCH`)."""
    pin_memory: bool = False
    """Loader processes' batches are pinned in host memory and copied to the GPU without
    blocking (needs ``loader_workers`` and a GPU)."""

    @classmethod
    def parse(cls, options: Mapping[str, Any] | None) -> LoaderOptions:
        """The options of ``options`` (``DataLoader`` keyword names), each checked."""
        options = dict(options or {})
        fields = {field.name for field in dataclasses.fields(cls)}
        for key in options:
            if key in ELSEWHERE:
                raise UsageError(f"loader option {key!r} does not apply: {ELSEWHERE[key]}")
            if key not in fields:
                raise UsageError(f"unknown loader option {key!r}; tandem takes "
                                 f"{', '.join(sorted(fields))} (DataLoader's names)")
        for key in ("shuffle", "drop_last", "pin_memory"):
            if key in options and not isinstance(options[key], bool):
                raise UsageError(f"loader option {key}={options[key]!r} must be True or False")
        prefetch = options.get("prefetch_factor")
        if prefetch is not None and (isinstance(prefetch, bool) or not isinstance(prefetch, int)
                                     or prefetch < 1):
            raise UsageError(f"loader option prefetch_factor={prefetch!r} must be a whole number "
                             f"of batches, 1 or more")
        return cls(**options)

    @property
    def prefetch(self) -> int:
        """Batches each loader process reads ahead."""
        return DEFAULT_PREFETCH if self.prefetch_factor is None else self.prefetch_factor
