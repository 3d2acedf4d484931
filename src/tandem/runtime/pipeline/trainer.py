"""Pipeline-parallel training: each worker holds one stage and runs its part of the schedule.

Flush schedules (GPipe, 1F1B) run one schedule per optimizer step: the global batch is cut into
micro-batches whose gradients accumulate, the replicas of a stage sum theirs, and every stage
steps once — the same update as one process on the whole batch. PipeDream's asynchronous
schedule spans the whole run (minibatch ``k`` is the global batch of step ``k``); it is cut into
per-step chunks at consistent points of its dry run, so logging between chunks cannot deadlock.
With ``--compress`` the activations and activation gradients between stages travel encoded
(training and evaluation alike; see ``wire.py``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tandem.models import build_model
from tandem.runtime.base import BaseTrainer
from tandem.runtime.config import Job
from tandem.runtime.dist import WorkerEnv, new_group
from tandem.runtime.pipeline.engine import Microbatch, StageEngine, StageShapes
from tandem.runtime.pipeline.setup import pipeline_setup
from tandem.runtime.pipeline.wire import Wire
from tandem.runtime.trainer import EVAL_CHUNK, score
from tandem.runtime.watchdog import Heartbeat
from tandem.schedule import Action, Kind, Schedule
from tandem.schedule.check import dry_run_times

EVAL_TAG_BASE = 1 << 30


def block_shapes(model: nn.Sequential, sample: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Per-sample output shape and dtype of every block, from one sample in eval mode."""
    shapes = []
    was_training = model.training
    model.eval()
    with torch.no_grad():
        x = sample
        for block in model:
            x = block(x)
            shapes.append((tuple(x.shape[1:]), x.dtype))
    model.train(was_training)
    return shapes


def step_chunks(schedule: Schedule, worker: int, num_steps: int) -> list[list[Action]]:
    """Cut ``worker``'s actions of an asynchronous schedule into one chunk per step.

    Chunk ``k`` ends at the dry-run time by which minibatch ``k`` is done on every stage; all
    workers cut at the same times, so every chunk boundary is a consistent cut of a valid
    execution and a collective between chunks cannot deadlock.
    """
    times = dry_run_times(schedule)
    done_at = [0] * num_steps
    for actions, action_times in zip(schedule.workers, times):
        for action, when in zip(actions, action_times):
            if action.microbatch is not None and action.microbatch < num_steps:
                done_at[action.microbatch] = max(done_at[action.microbatch], when)
    for k in range(1, num_steps):
        done_at[k] = max(done_at[k], done_at[k - 1])
    chunks: list[list[Action]] = [[] for _ in range(num_steps)]
    k = 0
    for action, when in zip(schedule.workers[worker], times[worker]):
        while k < num_steps - 1 and when > done_at[k]:
            k += 1
        chunks[k].append(action)
    return chunks


def no_update_between(actions: list[Action] | tuple[Action, ...]) -> set[int]:
    """Micro-batches whose forward and backward on this worker have no optimizer step between."""
    pending: set[int] = set()
    unchanged: set[int] = set()
    for action in actions:
        if action.kind is Kind.FORWARD:
            pending.add(action.microbatch)  # type: ignore[arg-type]
        elif action.kind is Kind.STEP:
            pending.clear()
        elif action.kind is Kind.BACKWARD and action.microbatch in pending:
            unchanged.add(action.microbatch)
    return unchanged


class PipelineTrainer(BaseTrainer):
    """One stage (or stage replica) of a pipeline, executing its schedule with the engine."""

    def __init__(self, job: Job, env: WorkerEnv, beat: Heartbeat) -> None:
        super().__init__(job, env, beat)
        config = job.run
        torch.manual_seed(config.seed)
        model = build_model(config.model, self.data.info)
        self.layout, self.schedule = pipeline_setup(job, model)
        self.stage, self.replica = self.schedule.stage_of(env.rank)
        start, end = self.layout.bounds[self.stage]
        shapes = block_shapes(model, self.data.train.inputs[:1])
        self.module = nn.Sequential(*list(model)[start:end]).to(env.device)
        self.param_offset = start
        self.groups = self._stage_groups()
        self.links = self._links()
        self.setup_optimizer(self.module.parameters())
        input_shape, input_dtype = ((tuple(self.train.inputs.shape[1:]), self.train.inputs.dtype)
                                    if start == 0 else shapes[start - 1])
        self.shapes = StageShapes(input_shape=input_shape, input_dtype=input_dtype,
                                  output_shape=shapes[end - 1][0], output_dtype=shapes[end - 1][1])
        self.wire = Wire.build(job.plan.compress.text if job.plan.compress else None,
                               rank=env.rank, world_size=env.world_size)
        self.asynchronous = self.schedule.kind == "pipedream"
        self.engine = StageEngine(
            module=self.module, stage=self.stage, num_stages=self.layout.num_stages,
            shapes=self.shapes, group=self.groups[self.stage], links=self.links, rank=env.rank,
            num_replicas=self.layout.replicas[self.stage], optimizer=self.optimizer,
            scheduler=self.scheduler, device=env.device, asynchronous=self.asynchronous,
            vertical_sync=job.plan.vertical_sync, trace=self.trace, beat=beat, wire=self.wire,
        )
        self.chunks = (step_chunks(self.schedule, env.rank, config.steps)
                       if self.asynchronous else None)
        if self.asynchronous:
            self.engine.unchanged_until_backward = no_update_between(self.schedule.workers[env.rank])

    def _stage_groups(self) -> list[dist.ProcessGroup | None]:
        """A process group for each replicated stage (every rank creates every group)."""
        groups: list[dist.ProcessGroup | None] = []
        for stage, count in enumerate(self.layout.replicas):
            ranks = [self.schedule.worker_of(stage, replica) for replica in range(count)]
            groups.append(new_group(ranks, timeout_s=self.config.timeout_s) if count > 1 else None)
        return groups

    def _links(self) -> dict[tuple[int, int], dist.ProcessGroup]:
        """A two-worker process group for each direction of point-to-point traffic."""
        pairs = sorted({(worker, action.peer) for worker, actions in enumerate(self.schedule.workers)
                        for action in actions if action.kind.is_send and action.peer is not None})
        links = {}
        for source, destination in pairs:
            group = new_group(sorted((source, destination)), timeout_s=self.config.timeout_s)
            if self.env.rank in (source, destination):
                links[(source, destination)] = group
        return links

    # -- training --------------------------------------------------------------------------------

    def _microbatch(self, step: int, parts: tuple[torch.Tensor, ...], m: int) -> Microbatch:
        indices = parts[m]
        scale = 1.0 / (sum(len(p) for p in parts) * self.predictions_per_sample)
        first, last = self.stage == 0, self.stage == self.layout.num_stages - 1
        return Microbatch(
            size=len(indices), scale=scale, step=step,
            inputs=self.train.inputs[indices] if first else None,
            targets=self.train.targets[indices] if last else None,
        )

    @functools.lru_cache(maxsize=64)  # noqa: B019 - bounded, per trainer
    def _minibatch(self, m: int) -> Microbatch:
        """Minibatch ``m`` of the asynchronous schedule: the global batch of step ``m``."""
        return self._microbatch(m, (self.sampler.global_indices(m),), 0)

    def train_step(self, step: int) -> torch.Tensor:
        if self.chunks is not None:
            loss = self.engine.execute(self.chunks[step], self._minibatch, step)
            self.engine.prune_sends(before_step=step + 1 - self.layout.num_stages)
            if step == self.config.steps - 1:
                self.engine.finish_sends()
            return loss
        parts = self.sampler.global_indices(step).tensor_split(self.schedule.num_microbatches)
        cache: dict[int, Microbatch] = {}

        def batch(m: int) -> Microbatch:
            if m not in cache:
                cache[m] = self._microbatch(step, parts, m)
            return cache[m]

        loss = self.engine.execute(self.schedule.workers[self.env.rank], batch, step)
        self.engine.finish_sends()
        return loss

    # -- evaluation and outputs ------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Forward the test split through the pipeline in chunks; the last stage scores them.

        Activations go through the codec as in training (the model evaluated is the one that
        was trained: stages and codec); these bytes are not counted in :meth:`sent_bytes`.
        """
        self.beat.phase = "evaluate"
        self.module.eval()
        num_stages, replicas = self.layout.num_stages, self.layout.replicas
        totals = torch.zeros(3, dtype=torch.float64, device=self.env.device)
        for chunk, start in enumerate(range(0, len(self.test), EVAL_CHUNK)):
            if chunk % replicas[self.stage] != self.replica:
                continue
            end = min(start + EVAL_CHUNK, len(self.test))
            if self.stage == 0:
                x = self.test.inputs[start:end]
            else:
                shape, dtype = (end - start, *self.shapes.input_shape), self.shapes.input_dtype
                message = self.wire.receive_buffer(shape, dtype, self.env.device)
                dist.recv(message, src=self.schedule.worker_for(self.stage - 1, chunk),
                          tag=EVAL_TAG_BASE + chunk)
                x = self.wire.unpack(message, shape, dtype, "activation")
            if self.stage == num_stages - 1:
                totals += score(self.module, x, self.test.targets[start:end])
            else:
                dist.send(self.wire.pack(self.module(x), "activation"),
                          dst=self.schedule.worker_for(self.stage + 1, chunk),
                          tag=EVAL_TAG_BASE + chunk)
        self.module.train()
        dist.all_reduce(totals)
        correct, loss, count = totals.tolist()
        return {"test_accuracy": correct / count, "test_loss": loss / count}

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Replica 0 of every stage sends its blocks' state to rank 0, under the full model's names."""
        state = None
        if self.replica == 0:
            state = {}
            for name, tensor in self.module.state_dict().items():
                index, _, rest = name.partition(".")
                state[f"{int(index) + self.param_offset}.{rest}"] = tensor.detach().cpu()
        gathered: list[Any] = [None] * self.env.world_size if self.env.rank == 0 else []
        dist.gather_object(state, gathered if self.env.rank == 0 else None, dst=0)
        if self.env.rank != 0:
            return None
        return {name: t for part in gathered if part for name, t in part.items()}

    def sent_bytes(self) -> float:
        """Bytes sent in training so far: messages between stages (compressed with
        ``--compress``), weight versions and the replicas' allreduces."""
        return self.engine.traffic.total_bytes

    def summary_extra(self) -> dict[str, Any]:
        """The layout, schedule and per-worker memory, and the bytes all workers sent per step:
        ``sent_bytes_per_step`` (everything), ``activation_bytes_per_step`` (activations and
        their gradients as computed), ``compressed_activation_bytes_per_step`` (what was sent
        for them) and ``activation_compression_ratio`` (the first over the second)."""
        traffic = self.engine.traffic
        totals = torch.tensor([traffic.total_bytes, traffic.activation_bytes,
                               traffic.message_bytes], dtype=torch.float64, device=self.env.device)
        dist.all_reduce(totals)
        sent, activations, messages = (value / max(1, len(self.step_times))
                                       for value in totals.tolist())
        stats = {
            "worker": self.env.rank, "stage": self.stage, "replica": self.replica,
            "layers": list(self.layout.bounds[self.stage]),
            "peak_activation_bytes": self.engine.peak_activation_bytes,
            "stash_peak_bytes": self.engine.stash.peak_bytes if self.engine.stash else 0,
            "parameter_bytes": sum(p.numel() * p.element_size() for p in self.module.parameters()),
        }
        gathered: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(gathered, stats)
        return {"pipeline": self.layout.text(), "vertical_sync": self.plan.vertical_sync,
                "sent_bytes_per_step": sent, "activation_bytes_per_step": activations,
                "compressed_activation_bytes_per_step": messages,
                "activation_compression_ratio": activations / messages if messages else 1.0,
                "workers": gathered}
