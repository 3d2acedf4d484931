"""A run's data from its ``--data`` spec or the user's own datasets: train and test samples and,
where it can be told, what a model needs to know of them (``DataInfo``).

``--data`` takes a built-in name (``digits``, ``images:n=4096``, ``tokens``), ``folder:PATH``
(a directory of images, :mod:`tandem.data.folder`), ``shards:DIR`` (shards written by
``tandem pack``, streamed: :mod:`tandem.data.shards`) or ``package.module:function[:key=value]``,
a function called with the options as keyword arguments that returns the train and test
datasets — ``(train, test)``, ``(train, test, info)`` or a :class:`DataBundle`.

Usage::

    data = load_data("mypkg.data:build:n=1000")
    batch = data.train.take(torch.arange(8))
    info = data.info        # inferred from the samples if the function gave none
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.data.bundle import DataBundle
from tandem.data.info import DataInfo
from tandem.data.samples import DatasetSamples, Samples, TensorSamples, samples_of
from tandem.spec.data import is_user_data
from tandem.errors import UsageError
from tandem.spec.options import user_function

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


def load_data(spec: str, *, cache_dir: str | None = None) -> Data:
    """The data named by ``spec`` (see the module docstring); ``cache_dir`` keeps local copies
    of the shards of ``shards:DIR`` (the only data read from storage as training goes)."""
    from tandem.data import build_dataset

    head = spec.partition(":")[0]
    if head == "shards":
        from tandem.data.shards import load_shards

        return load_shards(spec, cache_dir=cache_dir)
    if cache_dir:
        raise UsageError(f"--cache-dir keeps local copies of shards, and --data {spec} is not "
                         f"read from shards; drop --cache-dir or pack the data (tandem pack)")
    if head == "folder":
        from tandem.data.folder import load_folder

        return Data.of_bundle(load_folder(spec))
    if is_user_data(spec):
        return _call_user_data(spec)
    return Data.of_bundle(build_dataset(spec))


def data_of(train: Any, test: Any, *, name: str = "user data",
            info: DataInfo | None = None) -> Data:
    """Data from dataset objects (the Python API): ``test`` may be None (then the training
    samples are scored at the end, and the summary says so)."""
    if info is None and isinstance(getattr(train, "info", None), DataInfo):
        info = train.info  # a ShardDataset knows its own (from the index)
    train_samples = samples_of(train, what=f"the training data ({name})")
    test_samples = (samples_of(test, what=f"the test data ({name})") if test is not None
                    else train_samples)
    return Data(name, train_samples, test_samples, info)


def _call_user_data(spec: str) -> Data:
    function, kwargs = user_function(spec, what="--data")
    module_name, function_name = spec.split(":")[:2]
    try:
        result = function(**kwargs)
    except UsageError:
        raise
    except Exception as exc:  # the user's function failed: one line naming it and the error
        lines = str(exc).strip().splitlines()
        raise UsageError(f"--data {spec}: {module_name}.{function_name}() raised "
                         f"{type(exc).__name__}: {lines[0] if lines else ''}; fix the function "
                         f"or its options") from None
    return _interpret(result, spec)


def _interpret(result: Any, spec: str) -> Data:
    if isinstance(result, DataBundle):
        return Data.of_bundle(result)
    if isinstance(result, Data):
        return result
    if isinstance(result, (tuple, list)) and len(result) in (2, 3):
        info = result[2] if len(result) == 3 else None
        if info is not None and not isinstance(info, DataInfo):
            raise UsageError(f"--data {spec} returned {type(info).__name__} as its third value; "
                             f"give a tandem.data.DataInfo or return (train, test)")
        if result[1] is None:
            raise UsageError(f"--data {spec} returned no test dataset; return (train, test)")
        return data_of(result[0], result[1], name=spec, info=info)
    raise UsageError(f"--data {spec} returned {type(result).__name__}; return (train, test) "
                     f"datasets (or (train, test, info), or a tandem.data.DataBundle)")


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
    if isinstance(samples, DatasetSamples):
        return torch.stack([torch.as_tensor(samples.dataset[i][1]) for i in range(count)])
    return samples.rows(0, count).targets
