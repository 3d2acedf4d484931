"""A checkpoint of another number of workers made fit for this run's workers: replicas that
agree continue as they are, replicas that differ start from the mean of the saved ones.

Usage::

    checkpoint = resized_checkpoint(checkpoint, world=4, rank=0, strategy=strategy,
                                    compress=plan.compress)
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tandem.errors import UsageError
from tandem.spec.codec import CodecSpec
from tandem.sync import SyncStrategy

logger = logging.getLogger(__name__)


def resized_checkpoint(checkpoint: dict[str, Any], *, world: int, rank: int,
                   strategy: SyncStrategy, compress: CodecSpec | None) -> dict[str, Any]:
    """A checkpoint of another number of workers, made fit for this run's ``world`` workers
    (``rank`` is this worker's).

    Replicas that agree (dp, ps) continue as they are: the global batch and its order do
    not depend on the workers, so the result is the same. Replicas that differ between
    synchronizations (localsgd, easgd, gossip) all start from the mean of the saved models
    and of their optimizer states (momentum), as after a full averaging round; EASGD keeps
    its center, gossip's neighbours' copies start from that mean. Rank 0 says so. A codec's
    per-worker state (error feedback) cannot be split or merged: refused.
    """
    ranks = checkpoint["ranks"]
    if len(ranks) == world:
        return checkpoint
    if compress:
        raise UsageError(f"the checkpoint holds {len(ranks)} workers' codec state (error "
                         f"feedback) for --compress {compress.text}, which cannot be split "
                         f"among {world}; resume with --nproc {len(ranks)}")
    common = {"rng": ranks[0]["rng"], "components": ranks[0]["components"]}
    if strategy.replicas_agree:
        return {**checkpoint, "ranks": [{**common, "sync": {}}] * world}
    models = [saved["model"] for saved in ranks]
    optimizers = [saved["optimizer"] for saved in ranks]
    keep = strategy.state_agrees
    if rank == 0:
        logger.info(f"the checkpoint holds {len(ranks)} {strategy.name} workers' own models "
                    f"and this run has {world}: each starts from their mean (and the mean of "
                    f"their optimizer state){', with the saved center' if keep else ''}")
    own = {**common, "optimizer": _mean_state(optimizers),
           "sync": ranks[0]["sync"] if keep else {}}
    return {**checkpoint, "model": _mean_state(models), "ranks": [own] * world}


def _mean_state(states: list[Any]) -> Any:
    """The elementwise mean of state dicts of one structure (floating tensors averaged; other
    values, such as step counts, taken from the first)."""
    first = states[0]
    if isinstance(first, torch.Tensor):
        if first.is_floating_point():
            return torch.stack([s.to(first.dtype) for s in states]).mean(dim=0)
        return first.clone()
    if isinstance(first, dict):
        return {key: _mean_state([s[key] for s in states]) for key in first}
    if isinstance(first, (list, tuple)):
        return type(first)(_mean_state(list(parts)) for parts in zip(*states))
    return first
