"""The samples of one split, whatever holds them: in-memory tensors or a user's ``Dataset``.

Training addresses samples by index (see :mod:`tandem.data.sampler`): ``take(indices)`` gives
the batch of those samples as ``Batch(inputs, targets, size)``, where inputs and targets are
tensors or structures of tensors (:mod:`tandem.structures`) with the batch in dim 0.

A user's dataset gives each sample as an ``(input, target)`` pair (the convention of
torchvision's datasets and of ``TensorDataset``); either part may be a tensor, a number, or a
tuple/dict of them, and samples are stacked with ``torch.utils.data.default_collate``. With the
user's ``collate_fn`` the items may be anything it takes, and it makes the batches
(:mod:`tandem.data.collate`). An ``IterableDataset`` is read once, in order, into memory when
the run starts (it must be finite). A ``DataLoader`` is refused: tandem makes the batches.

An error the user's dataset raises (``__len__``, ``__getitem__``, ``__iter__``), wherever it is
read (the launching process's checks, a worker, a loader process), is one line naming the
dataset, the item and the error (a :class:`~tandem.errors.UsageError`).
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, default_collate

from tandem import structures
from tandem.data.bundle import Split
from tandem.data.collate import Collate, collated, function_label
from tandem.data.sampler import GlobalBatchSampler
from tandem.errors import UsageError

MAX_ITERABLE_SAMPLES = 10_000_000
"""Most samples read from an ``IterableDataset`` (one that never ends is refused)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Batch:
    """Inputs and targets of ``size`` samples (tensors or structures of tensors)."""

    inputs: Any
    targets: Any
    size: int

    def to(self, device: torch.device) -> Batch:
        """This batch with its tensors on ``device``."""
        return Batch(structures.to_device(self.inputs, device),
                     structures.to_device(self.targets, device), self.size)

    def split(self, parts: int) -> list[Batch]:
        """Consecutive micro-batches (sizes differ by at most one)."""
        if parts == 1:
            return [self]
        inputs = structures.split_batch(self.inputs, parts)
        targets = structures.split_batch(self.targets, parts)
        return [Batch(x, y, structures.batch_size(x) or structures.batch_size(y))
                for x, y in zip(inputs, targets)]


class Samples(abc.ABC):
    """The samples of one split, taken by index."""

    streams = False
    """Whether the samples are read from storage as training goes (shards), not held."""
    collate: Collate | None = None
    """The user's ``collate_fn`` that makes the batches (None: tandem's own stacking); then
    batches may differ in shape besides their samples (a collate that pads each to its
    longest item)."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of samples."""

    @abc.abstractmethod
    def take(self, indices: torch.Tensor) -> Batch:
        """The batch of samples ``indices`` (a 1-D integer tensor), in that order."""

    @abc.abstractmethod
    def to(self, device: torch.device) -> Samples:
        """Samples whose batches come on ``device``."""

    def rows(self, start: int, end: int) -> Batch:
        """Samples ``start`` to ``end - 1`` (evaluation walks a split in order)."""
        return self.take(torch.arange(start, end))

    def batch_sampler(self, *, global_batch_size: int, seed: int, partitions: int,
                      schedule: Sequence[tuple[int, int]] | None = None,
                      order: Callable[[int], torch.Tensor] | None = None,
                      num_samples: int | None = None, shuffle: bool = True,
                      drop_last: bool = False) -> GlobalBatchSampler:
        """The order of training: global batches addressed by step, each cut into
        ``partitions`` shares (the data-parallel ranks); ``schedule`` changes the batch size
        at given steps (``(first_step, batch_size)`` pairs, see :class:`GlobalBatchSampler`).
        Held samples are shuffled as one whole, so the batches do not depend on
        ``partitions``; streamed ones are not. ``order``: each epoch's ``num_samples``
        indices (a user's sampler, :mod:`tandem.data.user_sampler`) instead of a shuffle
        (or, without ``shuffle``, the samples in turn); ``drop_last``: no short last batch."""
        return GlobalBatchSampler(len(self) if num_samples is None else num_samples,
                                  global_batch_size=global_batch_size, seed=seed,
                                  schedule=schedule, order=order, shuffle=shuffle,
                                  drop_last=drop_last)


class TensorSamples(Samples):
    """Samples held as one inputs tensor and one targets tensor (row ``i`` is sample ``i``)."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        if len(inputs) != len(targets):
            raise UsageError(f"the data has {len(inputs)} inputs but {len(targets)} targets; "
                             f"give one target per input")
        self.inputs, self.targets = inputs, targets

    @classmethod
    def of(cls, split: Split) -> TensorSamples:
        """The samples of a built-in dataset's split."""
        return cls(split.inputs, split.targets)

    def __len__(self) -> int:
        return len(self.inputs)

    def take(self, indices: torch.Tensor) -> Batch:
        index = indices.to(self.inputs.device)
        return Batch(self.inputs[index], self.targets[index], len(indices))

    def rows(self, start: int, end: int) -> Batch:
        return Batch(self.inputs[start:end], self.targets[start:end], end - start)

    def to(self, device: torch.device) -> TensorSamples:
        return TensorSamples(self.inputs.to(device), self.targets.to(device))


class DatasetSamples(Samples):
    """Samples of a map-style ``Dataset`` whose items are ``(input, target)`` pairs, or any
    items the user's ``collate`` makes batches of."""

    def __init__(self, dataset: Any, *, what: str, device: torch.device | None = None,
                 collate: Collate | None = None) -> None:
        self.dataset, self.what, self.device, self.collate = dataset, what, device, collate
        try:
            self.length = len(dataset)
        except TypeError:
            raise UsageError(f"{what} ({type(dataset).__name__}) has no len(); give a map-style "
                             f"Dataset with __len__ and __getitem__, or an IterableDataset"
                             ) from None
        except Exception as exc:  # the user's __len__ failed
            raise dataset_failure(what, dataset, "len({})", exc) from None

    def __len__(self) -> int:
        return self.length

    def take(self, indices: torch.Tensor) -> Batch:
        if self.collate is not None:
            items = [self.get(i) for i in indices.tolist()]
            inputs, targets = collated(self.collate, items, what=self.what)
        else:
            items = [self.pair(int(i)) for i in indices.tolist()]
            inputs, targets = default_collate(items)
        batch = Batch(inputs, targets, len(items))
        return batch.to(self.device) if self.device is not None else batch

    def get(self, index: int) -> Any:
        """The dataset's item ``index``, as its ``__getitem__`` gives it."""
        try:
            return self.dataset[index]
        except UsageError:
            raise
        except Exception as exc:  # the user's __getitem__ failed: one line, named
            raise dataset_failure(self.what, self.dataset, f"{{}}[{index}]", exc) from None

    def pair(self, index: int) -> tuple[Any, Any]:
        """The dataset's item ``index`` as an ``(input, target)`` pair."""
        item = self.get(index)
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise UsageError(f"{self.what} item {index} is {structures.describe(item)}; each item "
                             f"must be an (input, target) pair")
        return item[0], item[1]

    def to(self, device: torch.device) -> DatasetSamples:
        moved = DatasetSamples.__new__(DatasetSamples)
        moved.dataset, moved.what, moved.length, moved.device, moved.collate = (
            self.dataset, self.what, self.length, device, self.collate)
        return moved


def dataset_failure(what: str, dataset: Any, call: str, exc: Exception) -> UsageError:
    """The one-line error of a user's dataset that raised ``exc`` in ``call`` (``{}[12]``,
    ``len({})``, ``iter({})``, formatted with the dataset's class name)."""
    lines = str(exc).strip().splitlines()
    return UsageError(f"{what}: {call.format(type(dataset).__name__)} raised "
                      f"{type(exc).__name__}: {lines[0] if lines else ''}; fix the dataset or "
                      f"the files it reads")


def samples_of(dataset: Any, *, what: str, collate: Collate | None = None) -> Samples:
    """The samples of a user's dataset: a ``TensorDataset`` of two tensors or a tandem ``Split``
    as tensors, a map-style ``Dataset`` (or any sequence of pairs) by index, and an
    ``IterableDataset`` (or any other iterable) read into memory first; with ``collate``, a
    dataset of items that it makes batches of (a ``TensorDataset`` too)."""
    if isinstance(dataset, DataLoader):
        raise UsageError(f"{what} is a DataLoader; tandem makes the batches itself (--batch-size"
                         f" is the global batch, split over the workers): give its dataset "
                         f"(loader.dataset), with collate_fn=loader.collate_fn and "
                         f"sampler=... to tandem.fit if it has its own")
    if collate is not None:
        return _collated_samples(dataset, what=what, collate=collate)
    if isinstance(dataset, Samples):
        return dataset
    streamed = getattr(dataset, "tandem_samples", None)
    if isinstance(streamed, Samples):  # a ShardDataset
        return streamed
    if isinstance(dataset, Split):
        return TensorSamples.of(dataset)
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
        return TensorSamples(*dataset.tensors)
    return _items(dataset, what=what, collate=None)


def _collated_samples(dataset: Any, *, what: str, collate: Collate) -> Samples:
    """A user's dataset of items that ``collate`` makes batches of; data that tandem reads
    and batches itself (shards, built-in data) is refused."""
    if not callable(collate):
        raise UsageError(f"collate_fn is a {type(collate).__name__}, not a function; give a "
                         f"function of a list of items that returns (inputs, targets)")
    if isinstance(dataset, (Samples, Split)) or hasattr(dataset, "tandem_samples"):
        raise UsageError(f"collate_fn {function_label(collate)} makes batches of a Dataset's "
                         f"items, and {what} is read and batched by tandem itself (shards or "
                         f"built-in data); drop collate_fn, or give a Dataset")
    return _items(dataset, what=what, collate=collate)


def _items(dataset: Any, *, what: str, collate: Collate | None) -> Samples:
    """A map-style dataset by index, an iterable one read into memory first."""
    if isinstance(dataset, IterableDataset) or (
            not hasattr(dataset, "__getitem__") and hasattr(dataset, "__iter__")):
        try:
            items = list(itertools.islice(iter(dataset), MAX_ITERABLE_SAMPLES + 1))
        except UsageError:
            raise
        except Exception as exc:  # the user's __iter__ failed
            raise dataset_failure(what, dataset, "iter({})", exc) from None
        if len(items) > MAX_ITERABLE_SAMPLES:
            raise UsageError(f"{what} gave more than {MAX_ITERABLE_SAMPLES:,} samples; tandem "
                             f"reads an IterableDataset into memory, so it must be finite")
        if not items:
            raise UsageError(f"{what} is empty; give at least one (input, target) sample")
        return DatasetSamples(items, what=what, collate=collate)
    if isinstance(dataset, Dataset) or hasattr(dataset, "__getitem__"):
        samples = DatasetSamples(dataset, what=what, collate=collate)
        if not len(samples):
            raise UsageError(f"{what} is empty; give at least one (input, target) sample")
        return samples
    raise UsageError(f"{what} is a {type(dataset).__name__}, not a dataset; give a "
                     f"torch.utils.data.Dataset of (input, target) pairs")
