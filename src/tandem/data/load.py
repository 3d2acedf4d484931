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
from tandem.data.builtin import build_dataset
from tandem.data.folder import load_folder
from tandem.data.run_data import Data
from tandem.data.samples import samples_of
from tandem.data.shards import load_shards
from tandem.spec.data import is_user_data
from tandem.errors import UsageError
from tandem.spec.options import user_function

def load_data(spec: str, *, cache_dir: str | None = None) -> Data:
    """The data named by ``spec`` (see the module docstring); ``cache_dir`` keeps local copies
    of the shards of ``shards:DIR`` (the only data read from storage as training goes)."""
    head = spec.partition(":")[0]
    if head == "shards":
        return load_shards(spec, cache_dir=cache_dir)
    if cache_dir:
        raise UsageError(f"--cache-dir keeps local copies of shards, and --data {spec} is not "
                         f"read from shards; drop --cache-dir or pack the data (tandem pack)")
    if head == "folder":
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
