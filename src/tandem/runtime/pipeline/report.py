"""What a pipeline worker reports once training is done: the test split's score (the test
samples forwarded through the stages), each stage's state written for ``final.pt``, and the
layout's summary with every worker's memory and traffic."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tandem.loss import score_batch
from tandem.runtime import memory
from tandem.runtime.export import ShardedFinal, shards_written
from tandem.runtime.pipeline.shape_header import header_length, read_header, shape_header
from tandem.runtime.user_metrics import KeptOutputs, reduced_evaluation
from tandem.runtime.pipeline.update import Tie
from tandem.runtime.tensor_parallel import gathered_state_dict, local_tensor, memory_report

if TYPE_CHECKING:
    from tandem.runtime.pipeline.trainer import PipelineTrainer

EVAL_CHUNK = 1024
"""Test samples forwarded through the pipeline at once."""
EVAL_TAG_BASE = 1 << 30
"""Message tags of evaluation chunks (above every training tag)."""


@torch.no_grad()
def evaluate_stage(trainer: PipelineTrainer) -> dict[str, float | None]:
    """Forward the test split through the pipeline in chunks; the last stage scores them.

    Activations go through the codec as in training (the model evaluated is the one that
    was trained: stages and codec); these bytes are not counted in
    :meth:`PipelineTrainer.sent_bytes`. A chunk goes through one replica of each stage; a
    sharded stage's forward is collective over its replicas, so every chunk goes through each
    of them (replica ``r`` of every stage), and replica 0's scores count.
    """
    trainer.beat.phase = "evaluate"
    trainer.module.eval()
    num_stages, replicas = trainer.layout.num_stages, trainer.layout.replicas
    place, sharded = trainer.place, trainer.shards is not None

    def worker(stage: int, chunk: int) -> int:
        if sharded:
            return trainer.schedule.worker_of(stage, place.replica)
        return trainer.schedule.worker_for(stage, chunk)

    samples = trainer.task.test_samples.to(trainer.env.device)
    totals = torch.zeros(4, dtype=torch.float64, device=trainer.env.device)
    counted = not (place.tensor_rank or (sharded and place.replica))  # the same samples once
    kept = KeptOutputs(trainer.task.metrics if counted else None)
    for chunk, start in enumerate(range(0, len(samples), EVAL_CHUNK)):
        if chunk % replicas[place.stage] != place.replica and not sharded:
            continue
        end = min(start + EVAL_CHUNK, len(samples))
        batch = samples.rows(start, end) if place.stage in (0, num_stages - 1) else None
        if batch is not None and place.stage == 0:
            x = batch.inputs
        else:
            x = _receive_chunk(trainer, end - start, place.rank_of(worker(place.stage - 1,
                                                                          chunk)), chunk)
        out = trainer.module(x)
        if batch is not None and place.stage == num_stages - 1:
            totals += score_batch(out, batch.targets, trainer.task.loss, batch.size)
            kept.keep(start, out, batch.targets)
        else:
            destination, device = place.rank_of(worker(place.stage + 1, chunk)), trainer.env.device
            outs = trainer.shapes.sent(out)
            if trainer.vary:
                dist.send(shape_header(outs, device), dst=destination,
                          tag=EVAL_TAG_BASE + 2 * chunk + 1)
            dist.send(trainer.wire.pack_many(outs, "activation", device), dst=destination,
                      tag=EVAL_TAG_BASE + 2 * chunk)
    trainer.module.train()
    if trainer.shards is not None:
        trainer.shards.reshard()
    if not counted:
        totals.zero_()
    return reduced_evaluation(totals, kept)


def _receive_chunk(trainer: PipelineTrainer, samples: int, source: int, chunk: int) -> Any:
    """The activations of evaluation chunk ``chunk`` (``samples`` samples) from ``source``,
    as the stage's first block takes them; where batches vary, their shapes come first."""
    specs, device = trainer.shapes.inputs, trainer.env.device
    if trainer.vary:
        header = torch.empty(header_length(specs), dtype=torch.int64, device=device)
        dist.recv(header, src=source, tag=EVAL_TAG_BASE + 2 * chunk + 1)
        shapes = list(read_header(header, specs))
    else:
        shapes = [spec.shape_at(samples) for spec in specs]
    dtypes = [spec.dtype for spec in specs]
    message = trainer.wire.receive_many(shapes, dtypes, device)
    dist.recv(message, src=source, tag=EVAL_TAG_BASE + 2 * chunk)
    return trainer.shapes.assemble(trainer.wire.unpack_many(message, shapes, dtypes,
                                                            "activation"))


def whole_state_dict(trainer: PipelineTrainer) -> ShardedFinal | None:
    """Replica 0 of every stage writes its blocks' state, under the full model's names, into
    ``OUT/final.dcp`` (with tensor parallelism, its tensor-parallel processes gather their
    shares first; a sharded stage's replicas gather their shards), for rank 0 to export one
    tensor at a time: no rank gathers the model, each at most its stage."""
    state: dict[str, torch.Tensor] = {}
    place, split, shards = trainer.place, trainer.split, trainer.shards
    whole = trainer.module.state_dict()
    if split is not None and (place.replica == 0 or shards is not None):
        whole = gathered_state_dict(trainer.module, split.plan, split.mesh["tensor"])
    elif shards is not None:
        whole = gathered_state_dict(trainer.module, {}, shards.mesh)
    if place.replica == 0 and place.tensor_rank == 0:
        state = {name: tensor.detach() for key, tensor in whole.items()
                 for name in trainer.names(key)}
    listed: list[Any] = [None] * trainer.env.world_size if trainer.env.rank == 0 else []
    dist.gather_object(list(state), listed if trainer.env.rank == 0 else None, dst=0)
    names = list(dict.fromkeys(name for part in listed if part for name in part))
    return shards_written(trainer.out, state, trainer.env.rank, names=names)


def _tie_report(trainer: PipelineTrainer, tie: Tie) -> dict[str, Any]:
    """The stages and names of shared parameters, and how far apart their copies are
    (collective within the tie's group; sharded stages compare their shards)."""
    flat = torch.cat([local_tensor(p.detach()).reshape(-1) for p in tie.params])
    high, low = flat.clone(), flat.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=tie.group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=tie.group)
    keys = {id(p): key for key, p in trainer.module.named_parameters()}
    return {"stages": list(tie.stages),
            "parameters": [trainer.names(keys[id(p)])[0] for p in tie.params],
            "max_abs_diff": float((high - low).abs().max()) if flat.numel() else 0.0}


def stage_summary(trainer: PipelineTrainer) -> dict[str, Any]:
    """The layout, schedule and per-worker memory, and the bytes all workers sent per step:
    ``sent_bytes_per_step`` (everything), ``activation_bytes_per_step`` (activations and
    their gradients as computed), ``compressed_activation_bytes_per_step`` (what was sent
    for them) and ``activation_compression_ratio`` (the first over the second). A worker
    whose stage shares parameters with others lists them in ``shared_parameters``, with
    the largest difference between the copies the stages hold (0 when they are equal).
    ``held_model_bytes``: the model's parameters and buffers the worker materialized (its
    stage's for a built-in model); ``training_peak_rss_bytes``, ``peak_rss_bytes`` and
    ``start_rss_bytes``, its process's resident memory at its peak up to the last
    update (before the last checkpoint and final.pt), at its peak, and at start, and
    ``checkpoint_peak_growth_bytes``, the most a checkpoint raised its peak
    (:mod:`tandem.runtime.memory`). ``precision``,
    ``clip_grad_norm`` and ``skipped_steps`` (fp16 steps every stage skipped together; per
    worker too) as the data-parallel trainer reports them."""
    traffic, place, split = trainer.engine.traffic, trainer.place, trainer.split
    totals = torch.tensor([traffic.total_bytes, traffic.activation_bytes,
                           traffic.message_bytes], dtype=torch.float64, device=trainer.env.device)
    dist.all_reduce(totals)
    sent, activations, messages = (value / max(1, len(trainer.step_times))
                                   for value in totals.tolist())
    stats = {
        "worker": trainer.env.rank, "stage": place.stage, "replica": place.replica,
        "layers": list(trainer.layout.bounds[place.stage]),
        "peak_activation_bytes": trainer.engine.peak_activation_bytes,
        "stash_peak_bytes": trainer.engine.stash.peak_bytes if trainer.engine.stash else 0,
        "parameter_bytes": sum(local_tensor(p).numel() * p.element_size()
                               for p in trainer.module.parameters()),
        "held_model_bytes": trainer.held_model_bytes,
        "training_peak_rss_bytes": trainer.memory.training_bytes,
        "peak_rss_bytes": memory.peak_rss_bytes(),
        "start_rss_bytes": memory.START_RSS_BYTES,
        "checkpoint_peak_growth_bytes": trainer.memory.checkpoint_growth,
        "shared_parameters": [_tie_report(trainer, tie) for tie in trainer.engine.ties],
        "skipped_steps": trainer.precision.skipped_steps,
    }
    tensor: dict[str, Any] = {}
    if split is not None:
        stats["tensor_part"] = place.tensor_rank
        report = memory_report(trainer.module, trainer.optimizer, split.whole_bytes)
        stats["tensor_memory"] = {key: int(value) for key, value in report.items()}
        stats["tensor_whole_layers"] = split.whole_layers
    gathered: list[Any] = [None] * trainer.env.world_size
    dist.all_gather_object(gathered, stats)
    if split is not None:
        whole = {name: None for worker in gathered for name in worker["tensor_whole_layers"]}
        tensor = {"tensor_parallel": place.tensor_degree,
                  "tensor_whole_layers": list(whole)}
    mesh = split.mesh if split is not None else (trainer.shards.layout if trainer.shards
                                                 else None)
    if mesh is not None:
        tensor["mesh"] = dict(zip(mesh.mesh_dim_names or (), mesh.shape))
    return {"pipeline": trainer.layout.text(), **tensor,
            "vertical_sync": trainer.plan.vertical_sync,
            "recompute": trainer.plan.recompute,
            "sent_bytes_per_step": sent, "activation_bytes_per_step": activations,
            "compressed_activation_bytes_per_step": messages,
            "activation_compression_ratio": activations / messages if messages else 1.0,
            "precision": trainer.config.precision, "clip_grad_norm": trainer.config.clip_grad_norm,
            "skipped_steps": max(worker["skipped_steps"] for worker in gathered),
            "workers": gathered}
