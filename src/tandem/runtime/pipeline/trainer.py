"""Pipeline-parallel training: each worker holds one stage and runs its part of the schedule.

Flush schedules (GPipe, 1F1B) run one schedule per optimizer step: the global batch is cut into
micro-batches whose gradients accumulate, the replicas of a stage sum theirs, and every stage
steps once — the same update as one process on the whole batch. With ``--shard D`` each
stage's ``D`` replicas shard its state with FSDP2 and reduce-scatter its gradients instead
(2-D, or 3-D with tensor parallelism; see ``sharding.py``). PipeDream's asynchronous
schedule spans the whole run (minibatch ``k`` is the global batch of step ``k``); it is cut into
per-step chunks at consistent points of its dry run, so logging between chunks cannot deadlock.
With ``--compress`` the activations and activation gradients between stages travel encoded
(training and evaluation alike; see ``wire.py``). A model that is not an ``nn.Sequential`` is
split into blocks automatically (:mod:`tandem.split`); weights its stages share are kept equal.
``--precision`` autocasts every stage's forward; with a flush schedule fp16's loss scale is one
for all stages and ``--clip-grad-norm`` clips the whole model's gradient norm, to which each
worker adds its tensor shares and shards once (see
:class:`~tandem.runtime.precision.StagePrecision`).

A built-in model (``--model mlp``, ``gpt``, ...) is built on the meta device and each worker
materializes only its stage's blocks, initialized by name as the whole model would be (see
``materialize.py``); so is a user's ``nn.Sequential`` builder with ``--init-fn`` (every block
built in turn, another stage's freed as soon as it is complete), and a user's model split by
tracing with ``--init-fn`` (traced on the meta device; its modules built in turn, each tensor
of another stage freed as soon as its module is done). Any other user's model (an
``nn.Module``, a builder without ``--init-fn``) is built whole on every worker, then sliced.

Checkpoints hold the whole model's state and the optimizer's by parameter name (see
``checkpoint.py``), so a run resumes on any layout. A flush schedule is saved between steps, each
rank writing its own tensors (its stage's, its shards or tensor shares; ``dcp.py``); an
asynchronous one as every stage was when it applied the checkpoint's step-th update (caught in
passing; the minibatches then in flight are not recorded), and a resumed or ``--stop-after``
run's schedule spans only the steps it runs, filling again at its start and draining at its end.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tandem.runtime.base import BaseTrainer
from tandem.runtime.checkpoint import load_checkpoint, resume_path
from tandem.runtime.job import Job
from tandem.runtime.dist import WorkerEnv, new_group
from tandem.runtime.export import ShardedFinal
from tandem.runtime.faults import announce_resume
from tandem.runtime.pipeline.checkpoint import (
    restore_stage, save_stage_checkpoint, worker_state,
)
from tandem.runtime.pipeline.layout import StagePlace
from tandem.runtime.pipeline.materialize import materialize, traced_blocks
from tandem.runtime.pipeline.microbatch import StageBatches
from tandem.runtime.pipeline.report import evaluate_stage, stage_summary, whole_state_dict
from tandem.runtime.pipeline.groups import point_to_point_links, tied_groups
from tandem.runtime.pipeline.chunks import no_update_between, step_chunks
from tandem.runtime.pipeline.engine import (
    ComputeSpec, LinkSpec, StageEngine, StageShapes, Tie, UpdateSpec,
)
from tandem.runtime.pipeline.setup import (
    batches_vary, boundary_values, example_inputs, model_names, pipeline_setup,
)
from tandem.runtime.pipeline.wire import Wire
from tandem.runtime.pipeline.sharding import StageShards
from tandem.runtime.pipeline.tensor_split import StageSplit, split_stage, tensor_blocks
from tandem.runtime.precision import StagePrecision
from tandem.runtime.tensor_parallel import layout_mesh, local_tensor, split_parameters
from tandem.schedule import Kind
from tandem.runtime.watchdog import Heartbeat
from tandem.split import SplitModel


class PipelineTrainer(BaseTrainer):
    """One stage (or stage replica) of a pipeline, executing its schedule with the engine."""

    precision: StagePrecision

    def __init__(self, job: Job, env: WorkerEnv, beat: Heartbeat) -> None:
        super().__init__(job, env, beat)
        config = job.run
        torch.manual_seed(config.seed)
        init = self.task.initializer()  # shapes only, each stage builds its blocks: materialize
        model = self.task.build_model(meta=init is not None)
        self.loss_log.terms_per_sample = 1
        example = example_inputs(self.feed.data.train)
        what = f"model {config.model!r}"
        blocks = (tensor_blocks(job, model, example, what=what) if isinstance(model, nn.Sequential)
                  else traced_blocks(job, model, self.feed.train, init, env.device, what=what))
        path = resume_path(job, self.out)
        checkpoint = self._load_checkpoint(path) if path is not None else None
        announce_resume(env.rank, path, checkpoint["step"] if checkpoint is not None else None)
        self.first_step = int(checkpoint["step"]) if checkpoint is not None else 0
        self.last_step = config.stop_after if config.stop_after is not None else config.steps
        self.layout, self.schedule = pipeline_setup(job, blocks, first_step=self.first_step)
        degree = job.plan.tensor_degree
        worker, tensor_rank = divmod(env.rank, degree)
        stage, replica = self.schedule.stage_of(worker)
        self.place = place = StagePlace(worker=worker, stage=stage, replica=replica,
                                        tensor_rank=tensor_rank, tensor_degree=degree)
        replica_text = f" replica {replica}" if self.layout.replicas[stage] > 1 else ""
        part = f" tensor part {tensor_rank}" if degree > 1 else ""
        self.divergence.where = f"stage {stage}{replica_text}{part} (rank {env.rank})"
        start, end = self.layout.bounds[stage]
        boundaries, skeletons = boundary_values(blocks, example)
        self.module = materialize(blocks, start, end, init, env.device, model=model)
        self.names = model_names(blocks, start)
        mesh = self._layout_mesh()
        self.split: StageSplit | None = split_stage(
            job, self.module, model, blocks, start=start, end=end, place=place,
            mesh=mesh) if mesh is not None and degree > 1 else None
        """With tensor parallelism, this process's share of the stage's split layers."""
        self.batches = StageBatches(self.feed, first=stage == 0,
                                    last=stage == self.layout.num_stages - 1,
                                    first_step=self.first_step)
        groups = self._stage_groups()
        links = point_to_point_links(self.schedule, rank=env.rank, tensor_degree=degree,
                                     timeout_s=config.timeout_s)
        ties = tied_groups(blocks, self.layout, self.schedule, stage=stage, worker=worker,
                           tensor_degree=degree, timeout_s=config.timeout_s,
                           sharded=job.plan.sharded, tensor_rank=tensor_rank)
        split = split_parameters(self.module, self.split.plan) if self.split else {}
        self.shards = StageShards(self.module, mesh, level=job.plan.shard_level,
                                  ties=ties) if mesh is not None and job.plan.sharded else None
        """With ``--shard``: FSDP2 on this stage over its replicas."""
        ties = self.shards.ties if self.shards is not None else ties
        self.held_model_bytes = sum(local_tensor(t).numel() * t.element_size() for t in
                                    (*blocks.parameters(), *blocks.buffers()) if not t.is_meta)
        """Bytes of the whole model's parameters and buffers this worker materialized (its
        shares of the split layers, with tensor parallelism; its shards, sharded)."""
        named = [(self.names(key)[0], p) for key, p in self.module.named_parameters()]
        self.setup_optimizer(named, model=model, delay=self._delay(),
                             every_stage=bool(job.plan.vertical_sync))
        last = end == len(blocks)
        self.vary = batches_vary(self.feed.data.train)
        """Batches differ in shape (a user's collate_fn): activations carry their shapes."""
        self.shapes = StageShapes(
            inputs=boundaries[start - 1] if start else (),
            outputs=() if last else boundaries[end - 1],
            input_skeleton=skeletons[start - 1] if start else None,
            output_skeleton=None if last else skeletons[end - 1])
        self.wire = Wire.build(job.plan.compress, rank=env.rank, world_size=env.world_size)
        self.asynchronous = self.schedule.kind.asynchronous
        self.precision = StagePrecision(config.precision, env.device, clip=config.clip_grad_norm,
                                        counted=self._counted(ties, split))
        assert not (self.asynchronous and self.precision.agrees), "refused by Job"
        if checkpoint is not None and path is not None:  # before the engine's weight stash
            restore_stage(self, checkpoint, path)
        self.snapshots: dict[int, dict[str, Any]] = {}
        """Asynchronous schedule: step -> this worker's state when it applied that many
        updates, kept until the checkpoint of that step is saved."""
        self.engine = StageEngine(
            links=LinkSpec(worker=worker, links=links, rank_of=place.rank_of,
                           wire=self.wire, vertical_sync=job.plan.vertical_sync,
                           vary=self.vary),
            compute=ComputeSpec(module=self.module, first=stage == 0,
                                last=stage == self.layout.num_stages - 1,
                                loss_fn=self.task.loss, precision=self.precision,
                                recompute=job.plan.recompute,
                                clone_received=not isinstance(blocks, SplitModel),
                                gradient_factor=self.shards.loss_factor if self.shards else 1.0),
            update=UpdateSpec(module=self.module, optimizer=self.optimizer,
                              scheduler=self.scheduler, precision=self.precision,
                              group=groups[stage],
                              num_replicas=self.layout.replicas[stage], ties=ties,
                              reduce=self._reduce() if self.shards is not None else None),
            shapes=self.shapes, asynchronous=self.asynchronous, trace=self.trace, beat=beat,
            device=env.device)
        self.engine.compute.on_loss = self.divergence.observe
        actions = self.schedule.workers[worker]
        if self.asynchronous:
            steps = max(1, self.last_step - self.first_step)
            chunks = step_chunks(self.schedule, worker, steps)
            self.programs = [self.engine.program(chunk) for chunk in chunks]
            self.engine.compute.unchanged_until_backward = no_update_between(actions)
            self.engine.update.after_step = self._snapshot_if_due
        else:
            self.programs = [self.engine.program(actions)]
        """This worker's actions bound to the engine's handlers: one step's (flush schedules),
        or each step's chunk of the whole run's (asynchronous)."""

    def _layout_mesh(self) -> DeviceMesh | None:
        """The job's ``data x pipeline x tensor`` mesh (collective), with tensor parallelism or
        sharding (which runs on its ``data`` dimension); else None."""
        if self.place.tensor_degree == 1 and not self.plan.sharded:
            return None
        return layout_mesh(self.env.device.type, replicas=self.layout.replicas[0],
                           stages=self.layout.num_stages, degree=self.place.tensor_degree,
                           worker_of=self.schedule.worker_of)

    def _delay(self) -> int:
        """How stale this stage's updates count as: none in a flushed schedule; in PipeDream's,
        ``S - 1`` for every stage — the pipeline holds ``S`` minibatches, and a stage's gradient
        depends on every stage's weights (counting only the stages after it, ``S - 1 - s``,
        trained worse: docs/large_batch.md)."""
        if self.schedule.kind.flushes:
            return 0
        return len(self.layout.bounds) - 1

    def _stage_groups(self) -> list[dist.ProcessGroup | None]:
        """A process group for each replicated stage (every rank creates every group; with
        tensor parallelism, the mesh's ``data`` groups; none when sharded: FSDP2 reduces)."""
        groups: list[dist.ProcessGroup | None] = []
        if self.plan.sharded:
            return [None] * self.layout.num_stages
        if self.split is not None:
            group = self.split.mesh["data"].get_group() if self.layout.replicas[0] > 1 else None
            return [group if stage == self.place.stage else None
                    for stage in range(self.layout.num_stages)]
        for stage, count in enumerate(self.layout.replicas):
            ranks = [self.schedule.worker_of(stage, replica) for replica in range(count)]
            groups.append(new_group(ranks, timeout_s=self.config.timeout_s) if count > 1 else None)
        return groups

    def _reduce(self) -> Callable[[], float]:
        """The sharded stage's ``AR``: FSDP2's reduce-scatter of the step's gradients."""
        shards = self.shards
        assert shards is not None, "sharded stages only"
        forwards = sum(action.kind is Kind.FORWARD for action in self.schedule.workers[
            self.place.worker])
        return lambda: shards.reduce(forwards)

    def _counted(self, ties: list[Tie], split: dict[str, bool]) -> list[nn.Parameter]:
        """The parameters whose gradient this worker adds to the whole model's norm: replica 0's
        (every replica's shards, sharded), those a tensor split leaves whole at the first
        tensor position only (``split``: the split ones' names), less the tied ones a lower
        stage holds (their copies' gradients are equal)."""
        if self.place.replica != 0 and not self.plan.sharded:
            return []
        elsewhere = {id(p) for tie in ties if tie.stages[0] != self.place.stage for p in tie.params}
        return [p for name, p in self.module.named_parameters() if id(p) not in elsewhere
                and (name in split or self.place.tensor_rank == 0)]

    # -- training --------------------------------------------------------------------------------

    def planned_batches(self, first: int, last: int) -> list[torch.Tensor]:
        return self.batches.planned(first, last)

    def train_step(self, step: int) -> torch.Tensor:
        """Run this worker's actions of step ``step``: the whole schedule of a flush schedule,
        the step's chunk of the asynchronous one."""
        if self.asynchronous:
            loss = self.engine.execute(self.programs[step - self.first_step],
                                       self.batches.minibatch, step)
            self.engine.prune_sends(before_step=step + 1 - self.layout.num_stages)
            if step == self.last_step - 1:
                self.engine.finish_sends()
            return loss
        micros = self.batches.step_microbatches(step, self.schedule.num_microbatches)
        loss = self.engine.execute(self.programs[0], micros.__getitem__, step)
        self.engine.finish_sends()
        return loss if self.place.tensor_rank == 0 else torch.zeros_like(loss)

    # -- checkpoints -----------------------------------------------------------------------------

    def _load_checkpoint(self, path: Path) -> dict[str, Any]:
        """The checkpoint at ``path``, checked against this run (settings, steps, data)."""
        checkpoint = load_checkpoint(path, self.job.fingerprint(), steps=self.config.steps,
                                     stop_after=self.config.stop_after)
        self.feed.check_position(checkpoint.get("data"), str(path))
        return checkpoint

    def _snapshot_if_due(self, step: int) -> None:
        """After this worker's update for minibatch ``step`` of the asynchronous schedule: if
        its stage has now applied ``done`` updates (whole rounds of its replicas) and a
        checkpoint of step ``done`` will be saved before the schedule drains, keep the state."""
        replicas = self.layout.replicas[self.place.stage]
        done = (step // replicas + 1) * replicas
        every = self.config.checkpoint_every
        if self.out is not None and every and done % every == 0 and done < self.last_step:
            self.snapshots[done] = worker_state(self)

    def save_checkpoint(self, step: int) -> None:
        """Save the state after ``step`` steps (see
        :func:`~tandem.runtime.pipeline.checkpoint.save_stage_checkpoint`)."""
        save_stage_checkpoint(self, step)

    # -- evaluation and outputs (report.py) ------------------------------------------------------

    def evaluate(self) -> dict[str, float | None]:
        """The test split's accuracy and loss, forwarded through the stages (see
        :func:`~tandem.runtime.pipeline.report.evaluate_stage`)."""
        return evaluate_stage(self)

    def full_state_dict(self) -> ShardedFinal | None:
        return whole_state_dict(self)

    def sent_bytes(self) -> float:
        """Bytes sent in training so far: messages between stages (compressed with
        ``--compress``), weight versions and the replicas' allreduces."""
        return self.engine.traffic.total_bytes

    def summary_extra(self) -> dict[str, Any]:
        return stage_summary(self)
