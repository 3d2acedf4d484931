"""Tensor-parallel training: every worker holds a share of every split layer and runs every batch.

A plan of tensor degree T (and, for now, one stage with one replica) runs on T workers that form
one device mesh. Each builds the whole model from the run's seed, keeps its share of the layers
the model's tensor plan splits (:mod:`tandem.models.tensor`, :mod:`tandem.runtime.tensor_parallel`)
and trains on the whole global batch; the collectives inside the split layers keep the workers'
whole layers (embeddings, norms, unsplit linear layers) equal, so each steps its own optimizer
and no gradient is averaged afterwards. The result is single-process training's.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tandem.loss import evaluation
from tandem.models.tensor import tensor_plan
from tandem.runtime.base import BaseTrainer
from tandem.runtime.config import Job
from tandem.runtime.dist import WorkerEnv
from tandem.runtime.noise_scale import NoiseScale
from tandem.runtime.precision import Precision
from tandem.runtime.tensor_parallel import (
    gathered_state_dict, memory_report, parameter_bytes, split_model,
)
from tandem.runtime.watchdog import Heartbeat
from tandem.structures import call_model


class TensorParallelTrainer(BaseTrainer):
    """One worker of a tensor-parallel job (see the module docstring)."""

    def __init__(self, job: Job, env: WorkerEnv, beat: Heartbeat) -> None:
        super().__init__(job, env, beat)
        config, degree = job.run, job.plan.tensor_degree
        torch.manual_seed(config.seed)
        model = self.task.build_model().to(env.device)
        own = job.objects is not None and job.objects.model is not None
        self.tensor_plan = tensor_plan(None if own else config.model, model, degree,
                                       job.plan.tensor_layers)
        self.whole_bytes = parameter_bytes(model)
        self.num_parameters = sum(p.numel() for p in model.parameters())
        self.mesh = init_device_mesh(env.device.type, (degree,))
        split_model(model, self.tensor_plan, self.mesh)
        self.module = self.model = model
        model.train()
        self.loss_terms_per_sample = 1
        self.tensor_rank = self.mesh.get_local_rank()
        self.divergence.where = f"tensor-parallel worker {self.tensor_rank} (rank {env.rank})"
        self.noise = NoiseScale.unavailable(
            "the gradient noise scale is measured in data parallelism only (from each worker's "
            "gradient and their allreduced mean); tensor-parallel workers share every batch")
        self.setup_optimizer(model.parameters())
        self.precision = Precision(config.precision, env.device)

    def planned_batches(self, first: int, last: int) -> list[torch.Tensor]:
        return [self.sampler.global_indices(step) for step in range(first, last)]

    def train_step(self, step: int) -> torch.Tensor:
        """One optimizer step on the whole global batch ``step``, in ``--accumulate``
        micro-batches; returns the batch's summed loss on the mesh's first worker (zero on the
        others, so that the logged sum over workers counts it once)."""
        indices = self.sampler.global_indices(step)
        micros = self.take_batch(indices).split(self.plan.accumulate)
        loss_total = torch.zeros((), device=self.env.device)
        for index, micro in enumerate(micros):
            start = time.perf_counter()
            self.beat.step, self.beat.phase = step, "forward"
            with self.precision.autocast():
                output = call_model(self.model, micro.inputs)
                loss = self.task.loss(output, micro.targets) * micro.size
            middle = time.perf_counter()
            self.beat.phase = "backward"
            self.precision.backward(loss / len(indices))
            loss_total += loss.detach()
            self.trace(f"0F{index}", start, middle, step)
            self.trace(f"0B{index}", middle, time.perf_counter(), step)
        self.beat.phase = "step"
        self.divergence.observe(step, loss_total, len(indices))
        self.divergence.poll_if_cheap()
        start = time.perf_counter()
        self.precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.trace("0ST", start, time.perf_counter(), step)
        return loss_total if self.tensor_rank == 0 else torch.zeros_like(loss_total)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float | None]:
        """Accuracy and mean loss on the whole test split, computed together by every worker
        (each forward runs the split layers' collectives)."""
        self.beat.phase = "evaluate"
        totals = self.task.score(self.model, 0, len(self.test), samples=self.test)
        return evaluation(totals)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        state = gathered_state_dict(self.model, self.tensor_plan, self.mesh)
        return state if self.env.rank == 0 else None

    def summary_extra(self) -> dict[str, Any]:
        """The tensor degree and the parameter + optimizer memory of the most loaded worker,
        beside the unsplit model's and the bound ``model / T + whole layers``."""
        report = memory_report(self.model, self.optimizer, self.whole_bytes)
        worst = torch.tensor(report["worker_bytes"], dtype=torch.float64, device=self.env.device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        degree = self.plan.tensor_degree
        bound = report["model_bytes"] / degree + report["whole_layer_bytes"]
        return {"parameters": self.num_parameters, "tensor_parallel": degree,
                "tensor_memory": {
                    "worker_bytes": int(worst), "model_bytes": int(report["model_bytes"]),
                    "whole_layer_bytes": int(report["whole_layer_bytes"]),
                    "bound_bytes": int(bound),
                    "worker_fraction": float(worst) / max(report["model_bytes"], 1)},
                "precision": self.config.precision, "clip_grad_norm": None, "skipped_steps": 0}
