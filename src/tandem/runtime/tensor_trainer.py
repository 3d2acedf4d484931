"""Tensor-parallel training, alone or data x tensor: each worker holds a share of every split layer.

A one-stage plan of tensor degree T and D replicas runs on D x T workers laid out on a
``data x pipeline x tensor`` device mesh (pipeline of size 1; a replica's T workers are adjacent
ranks). Each builds a built-in model on the meta device and gives it storage one layer at a time,
initialized by the seed and the layer's name as one process initializes it, cutting each split
layer to its share at once (so it never holds more than one split layer whole); a user's model
is built whole from the run's seed. Each keeps its share of the layers the model's tensor plan
splits (:mod:`tandem.models.tensor`, :mod:`tandem.runtime.tensor_parallel`).
The T workers of a replica train on the same share of the global batch (the whole batch when
D = 1); the collectives inside the split layers keep their whole layers (embeddings, norms,
unsplit linear layers) equal. With D > 1 each worker then sums its gradients (its own shares)
with the workers at its tensor position in the other replicas, the ``data`` dimension. Every
worker steps its own optimizer; the result is single-process training's.

fp16's loss scale and ``--clip-grad-norm`` are agreed by all workers at each step
(:class:`~tandem.runtime.precision.StagePrecision`: one allreduce of the overflow flags and of
the squared gradient norm, each worker of the first replica counting its shares of the split
layers and the first of them the whole layers). Checkpoints go through
``torch.distributed.checkpoint``: each worker writes its own shares (the first replica's; the
others hold the same), and a run resumes on the same tensor degree with any number of replicas.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from tandem.compress import ByteMeter, build_compression
from tandem.compress.codec import Codec
from tandem.compress.hooks import CodecHookState, exchange
from tandem.errors import UsageError
from tandem.loss import evaluation
from tandem.models.tensor import tensor_plan
from tandem.runtime.base import BaseTrainer
from tandem.runtime.config import slowdown
from tandem.runtime.job import Job
from tandem.runtime.data_step import DataParallelStep
from tandem.runtime.dist import WorkerEnv
from tandem.runtime.executor import Executor, Span, compile_program
from tandem.runtime.noise_scale import NoiseScale
from tandem.runtime.precision import StagePrecision
from tandem.runtime.export import ShardedFinal
from tandem.runtime.tensor_checkpoint import TensorCheckpoints
from tandem.runtime.user_metrics import KeptOutputs
from tandem.runtime.tensor_parallel import (
    MESH_DIMS, check_trust_ratios, data_mesh, describe_shares, gathered_state_dict, layout_mesh,
    local_tensor, materialize_split, memory_report, parameter_bytes, split_model,
    split_parameters, sum_gradients,
)
from tandem.runtime.watchdog import Heartbeat
from tandem.sync.sharded import check_units, shard_model
from tandem.schedule import Action, Kind

logger = logging.getLogger(__name__)


class TensorParallelTrainer(BaseTrainer):
    """One worker of a tensor-parallel job (see the module docstring)."""

    precision: StagePrecision

    def __init__(self, job: Job, env: WorkerEnv, beat: Heartbeat) -> None:
        super().__init__(job, env, beat)
        config, degree = job.run, job.plan.tensor_degree
        torch.manual_seed(config.seed)
        model = self.task.build_model(meta=True)
        # a built-in model, or a user's with --init-fn, comes on the meta device: each layer
        # gets storage (and, if split, is cut to this worker's share) one at a time; any other
        # is built whole
        from_meta = any(p.is_meta for p in model.parameters())
        if not from_meta:
            model = model.to(env.device)
        own = job.objects is not None and job.objects.model is not None
        self.tensor_plan = tensor_plan(None if own else config.model, model, degree,
                                       job.plan.tensor_layers)
        check_trust_ratios(self.tensor_plan, config.optimizer)
        self.whole_bytes = parameter_bytes(model)
        num_parameters = sum(p.numel() for p in model.parameters())
        self.replicas, shards = job.plan.replicas[0], job.plan.shard_degree
        layout = layout_mesh(env.device.type, replicas=self.replicas, stages=1, degree=degree,
                             worker_of=lambda stage, replica: replica,
                             shards=shards if job.plan.sharded else None)
        self.mesh = layout["tensor"]
        self.data_group = layout["data"].get_group() if self.replicas > 1 else None
        self.data_rank = env.rank // degree
        if from_meta:
            init = self.task.initializer()
            assert init is not None  # the model came on the meta device
            shares = materialize_split(model, self.tensor_plan, self.mesh, init=init,
                                       device=env.device)
        else:
            shares = split_model(model, self.tensor_plan, self.mesh)
        if shares and env.rank == 0:
            logger.info(f"tensor parallelism: {describe_shares(shares)}")
        split = split_parameters(model, self.tensor_plan)  # before FSDP shards every one
        if job.plan.sharded:
            self._shard(model, data_mesh(layout))
        held = sum(parameter_bytes(model).values()) + sum(b.numel() * b.element_size()
                                                          for b in model.buffers())
        self.started: dict[str, Any] = {
            "parameters": num_parameters, "mesh": dict(zip(MESH_DIMS, (self.replicas, 1, degree))),
            "built_from_meta": from_meta, "held_model_bytes": held,
            "head_shares": {name: list(values) for name, values in shares.items()},
            "shard_mesh": ({"replicate": self.replicas // shards, "shard": shards}
                           if job.plan.sharded else None)}
        """The summary's facts of the start: the attention attributes set to a worker's share of
        the heads (:func:`~tandem.runtime.tensor_parallel.share_heads`) among them."""
        self.codec = self._codec(model) if job.plan.compress is not None else None
        self.module = self.model = model
        model.train()
        self.loss_log.terms_per_sample = 1
        self.reduced_bytes = 0
        self.tensor_rank = self.mesh.get_local_rank()
        replica = f"replica {self.data_rank}, " if self.replicas > 1 else ""
        self.divergence.where = (f"tensor-parallel worker {self.tensor_rank} ({replica}"
                                 f"rank {env.rank})")
        self.noise = NoiseScale.unavailable(
            "the gradient noise scale is measured in data parallelism only (from each worker's "
            "gradient and their allreduced mean); tensor-parallel workers share every batch")
        self.setup_optimizer(model.named_parameters(), model=model)
        # the norm's terms: each share of a split layer once, and each whole layer once (tensor
        # rank 0's); replicas hold the same gradients, unless FSDP shards them over the replicas
        self.precision = StagePrecision(config.precision, env.device, clip=config.clip_grad_norm,
                                        counted=[p for name, p in model.named_parameters()
                                                 if (self.data_rank == 0 or job.plan.sharded)
                                                 and (name in split or self.tensor_rank == 0)])
        TensorCheckpoints(self).restore()
        self.work = DataParallelStep(model, self.precision, self.task.loss, beat,
                                     data_world=self.replicas, slowdown=slowdown(config, env.rank))
        self.work.after_backwards = self._after_backwards
        self.executor = Executor(self.trace)
        self.program = compile_program(job.plan.build_schedule().workers[self.data_rank], {
            Kind.FORWARD: self.work.forward, Kind.BACKWARD: self.work.backward,
            Kind.ALLREDUCE: self._allreduce, Kind.STEP: self._step})
        """This replica's actions of the plan's one-stage schedule, bound to their handlers."""

    def _shard(self, model: torch.nn.Module, mesh: Any) -> None:
        """Sharding x tensor: FSDP2 shards each block's shares over the replicas (the ``data``
        dimension, 2-D parameters as torchtitan lays them out), and reduce-scatters their
        gradients in the backward: no ``AR`` of its own."""
        if "channels" in self.tensor_plan.values():
            raise UsageError(f"--shard {self.replicas} with --tensor-parallel "
                             f"{self.plan.tensor_degree} shards DTensor layers, and this model's "
                             f"convolutions are split by channels; drop --shard")
        shard_model(model, mesh, units=check_units(model, self.plan.shard_units),
                    level=self.plan.shard_level, param_dtype=None)

    def _codec(self, model: torch.nn.Module) -> CodecHookState:
        """``--compress``'s codec on the data dimension: each worker encodes its own shares of
        the gradients (keyed by parameter name) and exchanges them with the workers at its
        tensor position in the other replicas."""
        assert self.plan.compress is not None, "built with --compress only"
        codec = build_compression(self.plan.compress)  # the plan's spec, parsed once
        if not isinstance(codec, Codec):  # refused by the job's checks
            raise UsageError(f"--compress {codec.spec} is not a per-tensor codec")
        names = {id(p): name for name, p in model.named_parameters()}
        return CodecHookState(codec, ByteMeter(world_size=self.replicas), names,
                              group=self.data_group)

    def data_partitions(self) -> int:
        return self.job.plan.replicas[0]

    def _indices(self, step: int) -> torch.Tensor:
        """This worker's replica's share of global batch ``step`` (the whole batch for one)."""
        sampler = self.feed.sampler
        if self.replicas == 1:
            return sampler.global_indices(step)
        return sampler.local_indices(step, rank=self.data_rank, world_size=self.replicas)

    def planned_batches(self, first: int, last: int) -> list[torch.Tensor]:
        return [self._indices(step) for step in range(first, last)]

    def train_step(self, step: int) -> torch.Tensor:
        """One optimizer step on this replica's share of global batch ``step``, in
        ``--accumulate`` micro-batches, its gradients summed over the replicas; returns the
        share's summed loss on the replica's first worker (zero on the others, so that the
        logged sum over workers counts it once).

        The interpreter runs the replica's actions of the plan's one-stage schedule:
        ``0F{m}``/``0B{m}`` for its micro-batches ``m = replica + replicas * k``, ``0AR`` (the
        data dimension's sum, with more than one replica) and ``0ST``."""
        indices = self._indices(step)
        global_count = self.feed.sampler.batch_samples(step)
        divisor = global_count / self.replicas if self.plan.sharded else global_count
        self.work.begin(self.feed.take(indices).split(self.plan.accumulate), step,
                        self.env.device, divisor=divisor)  # FSDP averages the replicas
        self.work.batch = (step, len(indices), global_count)
        self.executor.run(self.program, step)
        loss_total = self.work.loss_total
        return loss_total if self.tensor_rank == 0 else torch.zeros_like(loss_total)

    def _after_backwards(self) -> None:
        """The step's loss to the loss watch (read here on CPU)."""
        self.beat.phase = "step"
        step, samples, _ = self.work.batch
        self.divergence.observe(step, self.work.loss_total, samples)
        self.divergence.poll_if_cheap()

    def _allreduce(self, action: Action, span: Span) -> None:
        """Sum the gradients (this worker's shares) with the workers at its tensor position in
        the other replicas (through the codec with ``--compress``)."""
        self.beat.phase = "allreduce"
        if self.plan.sharded:  # FSDP reduce-scattered them in the backward
            return
        if self.codec is not None:  # the codec averages: from the replicas' sum to their mean
            named = [(name, p.grad) for name, p in self.model.named_parameters()
                     if p.grad is not None]
            grads = [local_tensor(grad) for _, grad in named]
            for grad in grads:
                grad.mul_(self.replicas)
            exchange(self.codec, grads, [name for name, _ in named])
        else:
            assert self.data_group is not None, "an AR action with one replica"
            self.reduced_bytes += sum_gradients(list(self.model.parameters()), self.data_group)

    def _step(self, action: Action, span: Span) -> None:
        """Apply the update (unless fp16 overflowed on any worker; clipped by the model's norm)
        and advance the learning-rate schedule."""
        self.beat.phase = "step"
        self.precision.step(self.optimizer, self.model.parameters())
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float | None]:
        """Accuracy and mean loss on the whole test split, computed together by every worker
        (each forward runs the split layers' collectives)."""
        self.beat.phase = "evaluate"
        test = self.feed.test
        kept = KeptOutputs(self.task.metrics if self.env.rank == 0 else None)
        totals = self.task.score(self.model, 0, len(test), samples=test, keep=kept)
        return {**evaluation(totals), **kept.values(gather=False)}

    def sent_bytes(self) -> float:
        """The data dimension's gradient exchanges (what the codec sent, with ``--compress``;
        the split layers' own collectives are not counted)."""
        if self.codec is not None:
            return float(self.codec.meter.wire_bytes)
        return float(self.reduced_bytes)

    def full_state_dict(self) -> ShardedFinal | None:
        return TensorCheckpoints(self).final_state()  # no rank gathers the model

    def summary_extra(self) -> dict[str, Any]:
        """The tensor degree and the parameter + optimizer memory of the most loaded worker,
        beside the unsplit model's and the bound ``model / T + whole layers``."""
        report = memory_report(self.model, self.optimizer, self.whole_bytes)
        worst = torch.tensor(report["worker_bytes"], dtype=torch.float64, device=self.env.device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        degree = self.plan.tensor_degree
        bound = report["model_bytes"] / degree + report["whole_layer_bytes"]
        return {**self.started, "tensor_parallel": degree, "data_parallel": self.replicas,
                "tensor_memory": {
                    "worker_bytes": int(worst), "model_bytes": int(report["model_bytes"]),
                    "whole_layer_bytes": int(report["whole_layer_bytes"]),
                    "bound_bytes": int(bound),
                    "worker_fraction": float(worst) / max(report["model_bytes"], 1)},
                **self._compression(),
                "precision": self.config.precision, "clip_grad_norm": self.config.clip_grad_norm,
                "skipped_steps": self.precision.skipped_steps}

    def save_checkpoint(self, step: int) -> None:
        TensorCheckpoints(self).save(step)

    def _compression(self) -> dict[str, Any]:
        """With ``--compress``: the gradient bytes per step over what the codec handed to the
        data dimension's collectives (this worker's shares)."""
        if self.codec is None:
            return {}
        meter = self.codec.meter
        return {"compression_ratio": meter.gradient_bytes / max(meter.payload_bytes, 1)}
