"""A run's data: its train and test samples, with what a model needs to know of them
(``DataInfo``), given or inferred from the samples."""

from __future__ import annotations

import torch

from tandem.data.bundle import DataBundle
from tandem.data.info import DataInfo
from tandem.data.samples import DatasetSamples, Samples, TensorSamples
from tandem.errors import UsageError

MAX_SCANNED_TARGETS = 1_000_000
"""Most targets read to count a user dataset's classes (the rest are assumed to repeat them)."""


class Data:
    """Train and test samples of one run, with their ``DataInfo`` (given or inferred)."""

    def __init__(self, name: str, train: Samples, test: Samples,
                 info: DataInfo | None = None) -> None:
        self.name, self.train, self.test = name, train, test
        self._info = info

    @classmethod
    def of_bundle(cls, bundle: DataBundle) -> Data:
        """A built-in (in-memory) dataset."""
        return cls(bundle.name, TensorSamples.of(bundle.train), TensorSamples.of(bundle.test),
                   bundle.info)

    @property
    def info(self) -> DataInfo:
        """Task, input shape and classes: given by the dataset, else inferred from its samples
        (integer targets, one per sample: ``classify``; one per input token: ``lm``)."""
        if self._info is None:
            self._info = infer_info(self.train, self.name)
        return self._info

    @property
    def has_info(self) -> bool:
        """Whether the info was given (not inferred)."""
        return self._info is not None

def infer_info(samples: Samples, name: str) -> DataInfo:
    """The ``DataInfo`` of user data from its samples; raises ``UsageError`` for targets that
    are not class indices (a built-in model needs them; a user's model does not ask)."""
    first = samples.rows(0, 1)
    inputs, targets = first.inputs, first.targets
    if not isinstance(inputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise UsageError(f"the built-in models need tensor inputs and targets, but --data "
                         f"{name} gives structures; use your own model (package.module:function)"
                         f" or return (train, test, tandem.data.DataInfo(...))")
    if targets.is_floating_point():
        raise UsageError(f"--data {name} has float targets, and the built-in models predict "
                         f"class indices; use your own model and --loss, or integer labels")
    most = int(_all_targets(samples).max())
    input_shape = tuple(inputs.shape[1:])
    if targets.dim() == 1:
        return DataInfo(task="classify", input_shape=input_shape, num_classes=most + 1)
    if tuple(targets.shape) == tuple(inputs.shape) and not inputs.is_floating_point():
        return DataInfo(task="lm", input_shape=input_shape, num_classes=most + 1)
    raise UsageError(f"cannot tell the task of --data {name} (targets of shape "
                     f"{tuple(targets.shape[1:])} per sample); return (train, test, "
                     f"tandem.data.DataInfo(...)) from the data function")


def _all_targets(samples: Samples) -> torch.Tensor:
    if isinstance(samples, TensorSamples):
        return samples.targets
    count = min(len(samples), MAX_SCANNED_TARGETS)
    if isinstance(samples, DatasetSamples) and samples.collate is None:
        return torch.stack([torch.as_tensor(samples.pair(i)[1]) for i in range(count)])
    return torch.as_tensor(samples.rows(0, count).targets)
