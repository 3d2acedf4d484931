"""The job every worker receives: a run's settings with the plan they execute, checked against
each other (a check that needs the number of processes runs after start-up)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tandem.errors import UsageError
from tandem.plan import Plan
from tandem.runtime.callbacks import check_callbacks_plan
from tandem.runtime.config import RunConfig
from tandem.spec.batch_schedule import AUTO
from tandem.spec.codec import BUCKET_CODECS
from tandem.spec.kinds import CompensationMode
from tandem.spec.optimizer import NOT_ELEMENTWISE, TANDEM_OPTIMIZERS
from tandem.spec.sync import AllReduceSync, ElasticAveragingSync, ParameterServerSync
from tandem.strategy import plan_from_flags, strategy_of


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Job:
    """What every worker receives: the run's settings and the plan it executes."""

    run: RunConfig
    plan: Plan
    objects: Any = None
    """The user's own model, data and loss (a :class:`tandem.runtime.task.UserObjects`, from
    the Python API), or None: the run's specs name them."""
    prepared: Any = dataclasses.field(default=None, compare=False, repr=False)
    """The data the launcher built for this job (:func:`tandem.runtime.run.make_job`), which
    its checks reuse instead of building it again (a user's data function is called once);
    :func:`tandem.runtime.run.run_training` drops it before the job goes to the workers."""

    def __post_init__(self) -> None:
        resumable = (self.run.resume is not None or self.run.stop_after is not None
                     or self.run.checkpoint_every)
        if resumable and self.plan.compress and self.plan.compress.name == "powersgd":
            raise UsageError(
                "--compress powersgd cannot be resumed (PyTorch keeps its state per DDP bucket, "
                "which a restarted job rebuilds); drop --resume/--stop-after/--checkpoint-every "
                "or use another codec")
        if self.run.find_unused_parameters and self.plan.pipelined:
            raise UsageError("--find-unused-parameters is for data-parallel strategies (pipeline "
                             "stages skip a parameter without a gradient); drop it")
        self._check_tensor()
        check_shard(self.plan, self.run)
        if self.run.memory_limit is not None and (
                self.plan.pipelined or self.plan.tensor_degree > 1
                or not isinstance(self.plan.sync, AllReduceSync)):
            raise UsageError(f"--memory-limit {self.run.memory_limit} checks the state a "
                             f"data-parallel worker holds (--strategy dp, with or without "
                             f"--shard); this plan is {strategy_of(self.plan)}: drop "
                             f"--memory-limit")
        self._check_straggler()
        self._check_precision()
        self._check_async_ps()
        if not CompensationMode(self.run.async_compensation).compensates \
                and not stale_updates(self.plan):
            raise UsageError("--async-compensation off applies to strategies whose updates are "
                             "stale (ps --mode async or ssp, --schedule pipedream); this plan's "
                             "are not, so drop it")
        servers = self.plan.num_servers
        if self.run.eval_every and servers > 1:
            raise UsageError(f"--eval-every {self.run.eval_every} evaluates the model during "
                             f"training, which --servers {servers} hold in parts that are at "
                             f"different updates; use --servers 1, or drop --eval-every (the "
                             f"model is evaluated at the end)")
        check_noise_users(self.plan, self.run)
        self._check_nesterov()
        check_optimizer_plan(self.plan, self.run, self.objects)
        check_callbacks_plan(self.plan, getattr(self.objects, "callbacks", None))

    def _check_tensor(self) -> None:
        """Tensor parallelism runs alone, with data parallelism (allreduce's plan) or in a
        pipeline whose every stage has the same replicas under a flush schedule, with an
        elementwise optimizer, and takes clipping, fp16 and checkpoints (resume, stop, restart):
        one line for each setting it would not honour."""
        plan, run = self.plan, self.run
        degree = plan.tensor_degree
        if plan.recompute and len(plan.stages) < 2:
            raise UsageError(f"recompute with {len(plan.stages)} stage would checkpoint the "
                             f"whole model as one piece and save nothing; use --strategy "
                             f"pipeline with 2 or more --stages, or drop --recompute")
        if degree == 1:
            return
        if plan.pipelined:
            if not plan.schedule.flushes:
                raise UsageError(f"--schedule {plan.schedule} with --tensor-parallel {degree}: "
                                 f"pipeline x tensor layouts run flush schedules only; use "
                                 f"--schedule 1f1b or gpipe")
            if len(set(plan.replicas)) > 1:
                raise UsageError(f"replicas {plan.config} with --tensor-parallel {degree}: a "
                                 f"data x pipeline x tensor mesh needs the same replicas on "
                                 f"every stage; use --replicas "
                                 f"{','.join([str(max(plan.replicas))] * len(plan.replicas))}")
        elif not isinstance(plan.sync, AllReduceSync):
            raise UsageError(f"the plan combines tensor degree {degree} with sync "
                             f"{plan.sync.method!r}; tandem runs tensor parallelism with "
                             f"allreduce's data parallelism or a pipeline only")
        self._check_tensor_compress()
        piped = {
            "--resume": run.resume, "--stop-after": run.stop_after,
            "--checkpoint-every": run.checkpoint_every or None,
            "--max-restarts": run.max_restarts or None,
        }
        if plan.compress is not None:  # a codec's per-worker state is not checkpointed here
            for flag, value in piped.items():
                if value is not None:
                    raise UsageError(f"{flag} {value} is not supported with --tensor-parallel "
                                     f"{degree} --compress {plan.compress.text} yet (the codec's "
                                     f"state is not in its checkpoints); drop {flag} or "
                                     f"--compress")
        refused = {
            "--batch-schedule": (run.batch_schedule if run.batch_schedule == AUTO else None,
                                 "it follows the gradient noise scale, which tensor-parallel "
                                 "workers do not measure (they share every batch); give the "
                                 "schedule, e.g. --batch-schedule 64@0,128@200"),
            "--lr-scaling": (run.lr_scaling if run.lr_scaling == "auto" else None,
                             "it follows the gradient noise scale, which tensor-parallel workers "
                             "do not measure (they share every batch): use linear or sqrt"),
            "--find-unused-parameters": (True if run.find_unused_parameters else None,
                                         "it is DDP's, and tensor-parallel workers sum their "
                                         "gradients without DDP (a parameter the forward does "
                                         "not use keeps no gradient)"),
        }
        for flag, (value, why) in refused.items():
            if value is not None:
                shown = "" if value is True else f" {value}"
                raise UsageError(f"{flag}{shown} does not apply with --tensor-parallel "
                                 f"{degree}: {why}; drop {flag}")

    def _check_tensor_compress(self) -> None:
        """``--compress`` with tensor parallelism encodes the data dimension's gradients: it
        needs replicas, no pipeline (whose codec is for activations) and a per-tensor codec."""
        plan = self.plan
        if plan.compress is None:
            return
        spec, degree = plan.compress.text, plan.tensor_degree
        if plan.pipelined:
            raise UsageError(f"--compress {spec} is not supported in a pipeline x tensor layout "
                             f"yet; drop --compress or --tensor-parallel {degree}")
        if plan.replicas[0] == 1:
            raise UsageError(f"--compress {spec} compresses the gradients replicas exchange, and "
                             f"--tensor-parallel {degree} on {degree} workers has one replica; "
                             f"drop --compress, or use --nproc {2 * degree} (data 2 x tensor "
                             f"{degree})")
        if plan.compress.name in BUCKET_CODECS:
            raise UsageError(f"--compress {spec} exchanges whole DDP buckets, which a "
                             f"tensor-parallel job does not use; pick a per-tensor codec (fp16, "
                             f"qsgd, topk, ...) or drop --compress")

    def _check_async_ps(self) -> None:
        """Asynchronous parameter servers: ``--staleness-lr`` is a compensation of its own, and
        a compressed worker's codec state has no point in time that matches the servers'
        checkpoint (they apply its pushes among the others')."""
        sync, run = self.plan.sync, self.run
        if not (isinstance(sync, ParameterServerSync) and sync.asynchronous):
            return
        if sync.staleness_lr and CompensationMode(run.async_compensation).compensates:
            raise UsageError("--staleness-lr divides each update's learning rate by its "
                             "staleness, which --async-compensation auto (the default) already "
                             "does for the expected staleness; add --async-compensation off to "
                             "use --staleness-lr alone, or drop --staleness-lr")
        resumable = run.resume is not None or run.stop_after is not None or run.checkpoint_every
        if self.plan.compress and resumable:
            raise UsageError(f"--compress {self.plan.compress.text} with --mode {sync.mode} cannot "
                             f"be checkpointed (each worker's codec state would not match the "
                             f"servers' checkpoint, which they take among its pushes); drop "
                             f"--resume/--stop-after/--checkpoint-every, or use --mode sync")

    def _check_nesterov(self) -> None:
        """EAMSGD's Nesterov momentum is SGD's, and needs some (``--momentum`` is its delta)."""
        sync = self.plan.sync
        if not (isinstance(sync, ElasticAveragingSync) and sync.nesterov):
            return
        if self.run.optimizer != "sgd":
            raise UsageError(f"--nesterov gives SGD Nesterov momentum, but this run has "
                             f"--optimizer {self.run.optimizer}; use --optimizer sgd or drop "
                             f"--nesterov")
        if self.run.momentum <= 0:
            raise UsageError(f"--nesterov needs a momentum, but this run has --momentum "
                             f"{self.run.momentum:g}; give --momentum 0.9 (say) or drop --nesterov")

    def _check_precision(self) -> None:
        """PipeDream's asynchronous stages step at different times: no loss scale they could
        share, no whole gradient to clip."""
        if not (self.plan.pipelined and self.plan.schedule.asynchronous):
            return
        if self.run.precision == "fp16":
            raise UsageError("--precision fp16 needs one loss scale that every stage changes at "
                             "the same step, but the asynchronous pipedream schedule steps its "
                             "stages at different times; use --precision bf16 (no loss scale), "
                             "or --schedule 1f1b or gpipe")
        if self.run.clip_grad_norm is not None:
            raise UsageError(f"--clip-grad-norm {self.run.clip_grad_norm:g} clips the whole "
                             f"model's gradient, which the asynchronous pipedream schedule never "
                             f"has at once (its stages step at different times); use --schedule "
                             f"1f1b or gpipe, or drop --clip-grad-norm")

    def _check_straggler(self) -> None:
        """``--straggler RANK`` names a rank that computes gradients in this plan (never one
        that would silently ignore it)."""
        straggler = self.run.straggler_factor()
        if straggler is None:
            return
        rank, text = straggler[0], self.run.straggler
        if self.plan.pipelined:
            raise UsageError(f"--straggler {text} is not supported with --strategy pipeline yet "
                             f"(its stages would ignore it); drop it or use a data-parallel "
                             f"strategy")
        first, workers = self.plan.num_servers, self.plan.num_workers
        if not first <= rank < workers:
            servers = f" (parameter servers: {_ranks(0, first - 1)})" if first else ""
            raise UsageError(f"--straggler {text} names rank {rank}, but the job's "
                             f"{workers - first} workers are {_ranks(first, workers - 1)}"
                             f"{servers}; use a rank from {first} to {workers - 1}")

    def check_world(self, world_size: int) -> None:
        """Checks that need the number of processes (run after start-up under ``torchrun``)."""
        if world_size != self.plan.num_workers:
            raise UsageError(
                f"the plan {self.plan.config} needs {self.plan.num_workers} processes but the job "
                f"has {world_size}; use --nproc {self.plan.num_workers} (or torchrun's "
                f"--nproc-per-node) or plan for {world_size}")
        for batch in self.run.batches():
            self._check_batch(batch)

    def _check_batch(self, batch: int) -> None:
        """The global batch ``batch`` (the run's, or one of its schedule's) splits evenly."""
        parts = self.plan.num_microbatches or 1
        name = (f"--batch-size {batch}" if self.run.batch_schedule is None else
                f"the batch {batch} of --batch-schedule {self.run.batch_schedule}")
        if self.plan.pipelined and batch % parts:
            raise UsageError(f"--microbatches {parts} does not divide {name}; choose batches "
                             f"that are multiples of {parts}")
        workers = self.plan.stages[0].replicas
        if not self.plan.pipelined and batch % workers:
            raise UsageError(
                f"{name} is not divisible by the {workers} workers; use a multiple "
                f"of {workers}, e.g. {workers * max(1, round(batch / workers))}")
        if not self.plan.pipelined and batch % parts:
            raise UsageError(
                f"each worker's share of {name} ({batch // workers}) is not divisible by "
                f"--accumulate {self.plan.accumulate}; choose an --accumulate that divides "
                f"{batch // workers}")

    def fingerprint(self) -> dict[str, Any]:
        """Settings a checkpoint must agree with to be resumed."""
        run = self.run
        return {"model": run.model, "data": run.data, "loss": run.loss,
                "strategy": strategy_of(self.plan),
                "batch_size": run.batch_size, "batch_schedule": run.batch_schedule,
                "optimizer": run.optimizer, "no_decay": run.no_decay, "seed": run.seed,
                "compress": self.plan.compress.text if self.plan.compress else None,
                "order": sample_order(self.run, self.objects)}


def sample_order(run: RunConfig, objects: Any) -> str | None:
    """How a run orders its samples where it is not tandem's shuffle of whole epochs, for
    checkpoints to agree on (None then, as in checkpoints from before these options)."""
    options, sampler = run.loader, getattr(objects, "sampler", None)
    parts = [*([] if options.shuffle else ["shuffle=False"]),
             *(["drop_last=True"] if options.drop_last else []),
             *([] if sampler is None else [f"sampler={type(sampler).__name__}"])]
    return ",".join(parts) or None


def check_shard(plan: Plan, run: RunConfig) -> None:
    """Sharded data parallelism (``--shard S``) runs without compression, for now; at levels 2
    and 3 (sharded gradients) also without what needs each worker's whole gradient: the noise
    scale and ``--find-unused-parameters``. One line for each setting it would not honour."""
    if run.offload is not None and run.clip_grad_norm is not None:
        raise UsageError(f"--clip-grad-norm {run.clip_grad_norm} is not supported with --offload "
                         f"{run.offload} yet: the norm of the offloaded gradients would be taken "
                         f"by a collective on CPU tensors, which the NCCL group does not run; "
                         f"drop one of them")
    if run.offload is not None and (not plan.sharded or plan.shard_level == 1
                                    or plan.tensor_degree > 1):
        raise UsageError(f"--offload {run.offload} moves FSDP2's shards of a data-parallel run "
                         f"to CPU memory, and this run has none (it needs --strategy dp --shard "
                         f"S at --shard-level 2 or 3, without --tensor-parallel); add --shard S "
                         f"or drop --offload")
    if not plan.sharded:
        return
    shard = f"--shard {plan.shard_degree}"
    refused: dict[str, tuple[Any, str]] = {
        "--compress": (plan.compress.text if plan.compress else None,
                       "FSDP's and ZeRO's own collectives reduce the gradients, uncompressed"),
    }
    if plan.shard_level > 1:
        level = (f"--shard-level {plan.shard_level} reduce-scatters each gradient as the "
                 f"backward makes it")
        refused.update({
            "--noise-every": (run.noise_every, f"{level}, and the noise scale needs each "
                              f"worker's whole gradient (--shard-level 1 measures it)"),
            "--batch-schedule": (run.batch_schedule if run.batch_schedule == AUTO else None,
                                 f"it follows the noise scale, which is not measured as "
                                 f"{level} (give the schedule, or --shard-level 1)"),
            "--lr-scaling": (run.lr_scaling if run.lr_scaling == "auto" else None,
                             f"it follows the noise scale, which is not measured as {level} "
                             f"(give --lr-scaling linear or sqrt, or --shard-level 1)"),
            "--find-unused-parameters": (True if run.find_unused_parameters else None,
                                         f"{level}, for the parameters used only "
                                         f"(--shard-level 1 takes it)"),
        })
    if plan.pipelined:
        _check_pipeline_shard(plan)
        shard = f"--strategy pipeline {shard}"
        refused["--compress"] = (plan.compress.text if plan.compress else None,
                                 "the activation codec does not run beside FSDP2's collectives")
    if plan.tensor_degree > 1:
        shard = f"{shard} --tensor-parallel {plan.tensor_degree}"
    for flag, (value, why) in refused.items():
        if value is not None:
            shown = "" if value is True else f" {value}"
            raise UsageError(f"{flag}{shown} is not supported with {shard} yet: {why}; "
                             f"drop {flag} or {shard}")


def check_noise_users(plan: Plan, run: RunConfig) -> None:
    """``--batch-schedule auto`` and ``--lr-scaling auto`` read the gradient noise scale, which
    data parallelism's allreduce measures (``--strategy dp``; tensor parallelism and
    ``--shard-level`` 2-3 are refused in their own checks); ``--lr-scaling auto`` also needs two
    or more workers (each one's gradient against their mean), where the batch schedule grows
    from an estimate that never comes (and stays as given)."""
    strategy = strategy_of(plan)
    other = plan.pipelined or not isinstance(plan.sync, AllReduceSync)
    if run.batch_schedule == AUTO and other:
        raise UsageError(f"--batch-schedule auto grows the batch toward the gradient noise "
                         f"scale that --strategy dp measures, and this run is {strategy}; use "
                         f"--strategy dp, or give the schedule (e.g. --batch-schedule "
                         f"64@0,128@200)")
    if run.lr_scaling != "auto":
        return
    if other:
        raise UsageError(f"--lr-scaling auto scales --lr by the gradient noise scale that "
                         f"--strategy dp measures, and this run is {strategy}; use --strategy "
                         f"dp, or --lr-scaling linear or sqrt")
    if plan.stages[0].replicas < 2:
        raise UsageError(f"--lr-scaling auto scales --lr by the gradient noise scale, which is "
                         f"measured from two or more data-parallel workers (each one's gradient "
                         f"against their mean), and this run has {plan.stages[0].replicas}; use "
                         f"--nproc 2 or more, or --lr-scaling linear or sqrt")


def check_optimizer_plan(plan: Plan, run: RunConfig, objects: Any = None) -> None:
    """The optimizer against the plan, without torch: an optimizer that reads whole matrices on
    split or sharded parameters, the user's groups with LARS/LAMB or ``--no-decay``, and the
    user's scheduler beside tandem's schedule or on workers that keep their own clocks."""
    name = run.optimizer
    split = plan.tensor_degree > 1 or (plan.sharded and plan.shard_level > 1)
    if name in NOT_ELEMENTWISE and split:
        raise UsageError(f"--optimizer {name} steps each matrix as a whole, and this plan splits "
                         f"parameters ({strategy_of(plan)} with --tensor-parallel or --shard at "
                         f"level 2 or 3); use an elementwise optimizer (adamw, sgd, ...), or "
                         f"--shard-level 1")
    if getattr(objects, "param_groups", None) is not None:
        if name in TANDEM_OPTIMIZERS:
            raise UsageError(f"param_groups with --optimizer {name}: {name} makes its own groups "
                             f"(weights, then biases and norms without decay or trust ratio); "
                             f"drop param_groups")
        if run.no_decay:
            raise UsageError(f"--no-decay {run.no_decay} and param_groups both make the "
                             f"parameter groups; give one (put the weight decay in your groups)")
    if getattr(objects, "scheduler", None) is None:
        return
    schedule = {"--warmup-steps": run.warmup_steps or None, "--lr-scaling": run.lr_scaling,
                "--lr-schedule": None if run.lr_schedule == "constant" else run.lr_schedule}
    for flag, value in schedule.items():
        if value is not None:
            raise UsageError(f"scheduler= replaces tandem's learning-rate schedule, of which "
                             f"{flag} {value} is a part; drop {flag}, or do it in your scheduler")
    sync = plan.sync
    if isinstance(sync, (ParameterServerSync, ElasticAveragingSync)) and sync.asynchronous:
        raise UsageError(f"scheduler= with --strategy {strategy_of(plan)} --mode {sync.mode}: "
                         f"its servers and workers keep clocks of their own, which a scheduler "
                         f"stepped per update would not follow; use --mode sync, or "
                         f"--warmup-steps and --lr-schedule")


def _check_pipeline_shard(plan: Plan) -> None:
    """A sharded pipeline: every stage's replicas shard it (FSDP2 over the ``data`` dimension,
    at level 2 or 3), under a flush schedule, its units the stage's blocks."""
    degree, text = plan.shard_degree, f"--shard {plan.shard_degree}"
    if plan.shard_level == 1:
        raise UsageError(f"--shard-level 1 shards the optimizer state over DDP's replicas, "
                         f"which a pipeline's stages do not use; use --shard-level 2 or 3")
    if degree == 1:
        raise UsageError(f"{text} in a pipeline gives each stage one replica, with nothing to "
                         f"shard its state with; use --shard 2 or more (each stage's "
                         f"replicas), or drop --shard")
    if any(stage.replicas != degree for stage in plan.stages):
        raise UsageError(f"{text} in a pipeline shards each stage over its replicas, and the "
                         f"plan's are {plan.config}; use --replicas "
                         f"{','.join([str(degree)] * len(plan.stages))} (or leave --replicas out)")
    if not plan.schedule.flushes:
        raise UsageError(f"--schedule {plan.schedule} with {text}: a sharded stage reduces its "
                         f"gradients once per step, after a flush; use --schedule 1f1b or gpipe")
    if plan.shard_units is not None:
        raise UsageError(f"shard units {', '.join(plan.shard_units)} name the whole model's "
                         f"modules, and a sharded pipeline stage's units are its blocks; drop "
                         f"them (--shard-units, shard_units in a plan file)")


def sketch_job(strategy: str, flags: Mapping[str, Any], run: RunConfig,
               objects: Any = None) -> Job:
    """The job of ``tandem train --strategy STRATEGY FLAGS...`` as far as its flags tell, without
    torch: every check of the plan and of the job runs on it. Its plan cuts as many blocks as
    the job has processes (enough for every stage count the flags can give); in the job that
    :func:`tandem.runtime.run.make_job` builds only the stages' blocks differ, as the model
    decides them."""
    plan = plan_from_flags(strategy, flags, num_processes=run.nproc, num_blocks=max(1, run.nproc))
    return Job(run=run, plan=plan, objects=objects)


def stale_updates(plan: Plan) -> bool:
    """Whether ``plan``'s updates are computed on stale weights (compensated; see
    :mod:`tandem.runtime.asynchrony`)."""
    if plan.pipelined:
        return plan.schedule.asynchronous
    return isinstance(plan.sync, ParameterServerSync) and plan.sync.asynchronous


def _ranks(first: int, last: int) -> str:
    return f"rank {first}" if first == last else f"ranks {first}-{last}"
