"""Datasets by name (real digits, synthetic images and tokens) and the distributed sampler.

Usage::

    bundle = build_dataset("images:n=1024,size=16")
    sampler = GlobalBatchSampler(len(bundle.train), global_batch_size=64, seed=0)
    local_indices = sampler.local_indices(step=0, rank=1, world_size=4)
"""

from __future__ import annotations

from typing import Any, Callable

from tandem.data.bundle import DataBundle, Split
from tandem.data.digits import DigitsOptions, load_digits
from tandem.data.info import DataInfo
from tandem.data.load import Data, data_of, load_data
from tandem.data.samples import Batch, DatasetSamples, Samples, TensorSamples, samples_of
from tandem.data.sampler import GlobalBatchSampler, RankBatchSampler, shard_sizes
from tandem.data.shards import ShardDataset
from tandem.data.synthetic import ImagesOptions, TokensOptions, make_images, make_tokens
from tandem.errors import UsageError
from tandem.options import fill_options, split_spec

__all__ = [
    "DATASETS", "Batch", "Data", "DataBundle", "DataInfo", "DatasetSamples", "GlobalBatchSampler",
    "RankBatchSampler", "Samples", "ShardDataset", "Split", "TensorSamples", "build_dataset", "data_of",
    "dataset_bytes", "load_data", "samples_of", "shard_sizes",
]

DATASETS: dict[str, tuple[type, Callable[[Any], DataBundle]]] = {
    "digits": (DigitsOptions, load_digits),
    "images": (ImagesOptions, make_images),
    "tokens": (TokensOptions, make_tokens),
}


def build_dataset(spec: str) -> DataBundle:
    """Build the dataset named by ``spec`` (``name`` or ``name:key=value,...``)."""
    name, raw = split_spec(spec, what="dataset")
    if name not in DATASETS:
        raise UsageError(
            f"unknown dataset {name!r}; choose one of: {', '.join(sorted(DATASETS))}, or "
            f"folder:PATH, or your own as package.module:function"
        )
    options_cls, make = DATASETS[name]
    return make(fill_options(options_cls, raw, spec=spec, what="dataset"))


def dataset_bytes(spec: str) -> int | None:
    """About the most memory building dataset ``spec`` takes, from its options alone (their
    ``memory_bytes()``); None where they cannot tell. Errors in ``spec`` raise as in
    :func:`build_dataset`."""
    if spec.partition(":")[0] not in DATASETS:  # folder:PATH, a user's function: unknown
        return None
    name, raw = split_spec(spec, what="dataset")
    options = fill_options(DATASETS[name][0], raw, spec=spec, what="dataset")
    size = getattr(options, "memory_bytes", None)
    return size() if size is not None else None
