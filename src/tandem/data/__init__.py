"""Datasets by name (real digits, synthetic images and tokens) and the distributed sampler.

Usage::

    bundle = build_dataset("images:n=1024,size=16")
    sampler = GlobalBatchSampler(len(bundle.train), global_batch_size=64, seed=0)
    local_indices = sampler.local_indices(step=0, rank=1, world_size=4)
"""

from __future__ import annotations

from typing import Any, Callable

from tandem.data.bundle import DataBundle, Split
from tandem.data.digits import load_digits
from tandem.data.info import DataInfo
from tandem.data.load import Data, data_of, load_data
from tandem.data.samples import Batch, DatasetSamples, Samples, TensorSamples, samples_of
from tandem.data.sampler import GlobalBatchSampler, RankBatchSampler, shard_sizes
from tandem.data.shards import ShardDataset
from tandem.data.synthetic import make_images, make_tokens
from tandem.spec.data import DATASET_OPTIONS, read_dataset_spec

__all__ = [
    "DATASETS", "Batch", "Data", "DataBundle", "DataInfo", "DatasetSamples", "GlobalBatchSampler",
    "RankBatchSampler", "Samples", "ShardDataset", "Split", "TensorSamples", "build_dataset", "data_of",
    "dataset_bytes", "load_data", "samples_of", "shard_sizes",
]

MAKERS: dict[str, Callable[[Any], DataBundle]] = {
    "digits": load_digits, "images": make_images, "tokens": make_tokens,
}

DATASETS: dict[str, tuple[type, Callable[[Any], DataBundle]]] = {
    name: (options, MAKERS[name]) for name, options in DATASET_OPTIONS.items()}
"""Name -> (options dataclass, maker): the names and options of :mod:`tandem.spec.data` (which
reads a spec without torch)."""


def build_dataset(spec: str) -> DataBundle:
    """Build the dataset named by ``spec`` (``name`` or ``name:key=value,...``)."""
    name, options = read_dataset_spec(spec)
    return DATASETS[name][1](options)


def dataset_bytes(spec: str) -> int | None:
    """About the most memory building dataset ``spec`` takes, from its options alone (their
    ``memory_bytes()``); None where they cannot tell. Errors in ``spec`` raise as in
    :func:`build_dataset`."""
    if spec.partition(":")[0] not in DATASETS:  # folder:PATH, a user's function: unknown
        return None
    _, options = read_dataset_spec(spec)
    size = getattr(options, "memory_bytes", None)
    return size() if size is not None else None
