"""A run's data from its ``--data`` spec or the user's own datasets: train and test samples and,
where it can be told, what a model needs to know of them (``DataInfo``).

``--data`` takes a built-in name (``digits``, ``images:n=4096``, ``tokens``), ``folder:PATH``
(a directory of images, :mod:`tandem.data.folder`), ``shards:DIR`` (shards written by
``tandem pack``, streamed: :mod:`tandem.data.shards`) or ``package.module:function[:key=value]``,
a function called with the options as keyword arguments that returns the train and test
datasets — ``(train, test)``, ``(train, test, info)`` or a :class:`DataBundle` — and, for
datasets whose items a function of the user's makes batches of (a ``collate_fn``, as a
``DataLoader`` takes: padding sequences, say), ``(train, test, collate_fn)``, ``(train, test,
info, collate_fn)`` or a dict with keys ``train``, ``test`` and optionally ``info`` and
``collate_fn``.

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
from tandem.data.collate import Collate
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
            info: DataInfo | None = None, collate: Collate | None = None) -> Data:
    """Data from dataset objects (the Python API): ``test`` may be None (then the training
    samples are scored at the end, and the summary says so); ``collate`` makes the batches of
    both from their items."""
    if info is None and isinstance(getattr(train, "info", None), DataInfo):
        info = train.info  # a ShardDataset knows its own (from the index)
    train_samples = samples_of(train, what=f"the training data ({name})", collate=collate)
    test_samples = (samples_of(test, what=f"the test data ({name})", collate=collate)
                    if test is not None else train_samples)
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


RETURNED = ("(train, test) datasets (or (train, test, info), (train, test, collate_fn), "
            "(train, test, info, collate_fn), a dict of those, or a tandem.data.DataBundle)")
"""What a ``--data`` function may return, for messages."""


def _interpret(result: Any, spec: str) -> Data:
    if isinstance(result, DataBundle):
        return Data.of_bundle(result)
    if isinstance(result, Data):
        return result
    if isinstance(result, dict):
        unknown = set(result) - {"train", "test", "info", "collate_fn"}
        if unknown or "train" not in result:
            raise UsageError(f"--data {spec} returned a dict with keys {sorted(result)}; give "
                             f"train and test, and optionally info and collate_fn")
        parts = (result["train"], result.get("test"), result.get("info"),
                 result.get("collate_fn"))
    elif isinstance(result, (tuple, list)) and len(result) in (2, 3, 4):
        rest = list(result[2:])
        info = rest.pop(0) if rest and (len(rest) == 2 or isinstance(rest[0], DataInfo)) \
            else None
        parts = (result[0], result[1], info, rest[0] if rest else None)
    else:
        raise UsageError(f"--data {spec} returned {type(result).__name__}; return {RETURNED}")
    train, test, info, collate = parts
    if info is not None and not isinstance(info, DataInfo):
        raise UsageError(f"--data {spec} returned {type(info).__name__} as its info; give a "
                         f"tandem.data.DataInfo, or return {RETURNED}")
    if collate is not None and not callable(collate):
        raise UsageError(f"--data {spec} returned {type(collate).__name__} as its collate_fn; "
                         f"give a function of a list of items, or return {RETURNED}")
    if test is None:
        raise UsageError(f"--data {spec} returned no test dataset; return (train, test)")
    return data_of(train, test, name=spec, info=info, collate=collate)
