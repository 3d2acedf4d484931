"""Datasets by name (real digits, synthetic images and tokens) and the distributed sampler.

Usage::

    bundle = build_dataset("images:n=1024,size=16")
    sampler = GlobalBatchSampler(len(bundle.train), global_batch_size=64, seed=0)
    local_indices = sampler.local_indices(step=0, rank=1, world_size=4)
"""

from __future__ import annotations

from tandem.data.bundle import DataBundle, Split
from tandem.data.info import DataInfo
from tandem.data.builtin import DATASETS, MAKERS, build_dataset, dataset_bytes
from tandem.data.load import data_of, load_data
from tandem.data.run_data import Data
from tandem.data.samples import Batch, DatasetSamples, Samples, TensorSamples, samples_of
from tandem.data.sampler import GlobalBatchSampler, RankBatchSampler, shard_sizes
from tandem.data.shards import ShardDataset

__all__ = [
    "DATASETS", "Batch", "Data", "DataBundle", "DataInfo", "DatasetSamples", "GlobalBatchSampler",
    "RankBatchSampler", "Samples", "ShardDataset", "Split", "TensorSamples", "build_dataset", "data_of",
    "dataset_bytes", "load_data", "samples_of", "shard_sizes",
]
