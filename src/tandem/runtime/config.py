"""The settings of a training run apart from its plan (model, data, optimizer, steps, outputs),
and the job every worker receives: those settings with the plan they execute."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from tandem.errors import UsageError
from tandem.options import MAX_SEED
from tandem.plan import Plan
from tandem.sync_spec import ElasticAveragingSync

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "cosine")
BACKENDS = ("auto", "gloo", "nccl")
PRECISIONS = ("fp32", "bf16", "fp16")
"""``--precision`` choices (:mod:`tandem.runtime.precision` implements them)."""
MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""Longest ``--timeout``: a week (a longer wait is no bound at all)."""
MAX_THREADS = 1024
"""Most ``--threads`` per worker."""
MAX_LOADER_WORKERS = 64
"""Most ``--loader-workers`` per worker."""
MAX_STRAGGLER = 1000.0
"""Largest ``--straggler`` factor (a slower worker would outwait any timeout)."""


@dataclasses.dataclass(kw_only=True, slots=True)
class RunConfig:
    """What a run trains and how long, apart from how the workers cooperate (the plan); plain
    data, so it pickles to spawned workers."""

    model: str = "mlp"
    """Model spec, e.g. ``mlp:hidden=128`` or ``package.module:function``."""
    data: str = "digits"
    """Dataset spec: ``digits``, ``images:n=4096,size=32``, ``folder:PATH`` or
    ``package.module:function[:key=value]`` (see :mod:`tandem.data.load`)."""
    loss: str | None = None
    """``package.module:function`` (see :mod:`tandem.loss`); None: cross-entropy."""
    straggler: str | None = None
    """``RANK:FACTOR``: worker RANK takes FACTOR times as long for each step (experiments)."""
    split_points: str | None = None
    """Pipelines of a model that is not an ``nn.Sequential``: cut it into blocks before these
    submodules (comma-separated names, ``transformer.h.2,transformer.h.4``) instead of
    automatically (see :mod:`tandem.split`)."""
    nproc: int = 1
    """Local worker processes to start (the plan's; ignored under an external ``torchrun``)."""
    steps: int = 100
    """Optimizer steps in the whole run."""
    batch_size: int = 64
    """Global minibatch: samples per optimizer step over all workers together."""
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    """Momentum of SGD (ignored by Adam/AdamW, which use their betas)."""
    weight_decay: float = 0.0
    warmup_steps: int = 0
    """Steps of linear learning-rate warm-up from 0."""
    precision: str = "fp32"
    """``fp32``, or ``bf16``/``fp16`` mixed precision (autocast; fp16 with a loss scaler that
    skips overflowed steps), see :mod:`tandem.runtime.precision`."""
    clip_grad_norm: float | None = None
    """Clip the gradients' global L2 norm to this (None: no clipping)."""
    lr_schedule: str = "constant"
    """After warm-up: ``constant`` or ``cosine`` decay to 0 at the last step."""
    seed: int = 0
    out: str | None = None
    """Directory for ``final.pt``, ``metrics.jsonl``, ``trace.json`` and checkpoints."""
    resume: str | None = None
    """Checkpoint to resume from (``auto``: ``<out>/checkpoint.pt``)."""
    overwrite: bool = False
    """Start afresh in an ``out`` that holds another run's outputs, removing them (without it,
    such a run is refused; see :mod:`tandem.runtime.out_dir`)."""
    checkpoint_every: int = 0
    """Save a checkpoint every this many steps (0: only when the run ends or stops)."""
    max_restarts: int = 0
    """Start the workers again after a failure, up to this many times (with ``--resume auto``
    they continue from the latest checkpoint); see :func:`tandem.runtime.launch.launch`."""
    stop_after: int | None = None
    """Stop after this many steps, checkpointing, as if the job had been cut off."""
    eval_every: int = 0
    """Evaluate on the test split every this many steps (0: only at the end)."""
    log_every: int = 10
    """Write the global loss to ``metrics.jsonl`` every this many steps."""
    threads: int = 1
    """Intra-op threads per worker on CPU."""
    loader_workers: int | None = None
    """Background processes that read batches ahead (:mod:`tandem.data.loader`); None: 1 for
    data streamed from shards, 0 (read in the worker) for a user's ``Dataset``."""
    cache_dir: str | None = None
    """Keep local copies of the shards of ``--data shards:DIR`` here (a slow source read once)."""
    find_unused_parameters: bool = False
    """Data parallelism: a parameter that gets no gradient in a step has a zero gradient (DDP's
    ``find_unused_parameters=True``); without it, such a parameter stops the run, named."""
    backend: str = "auto"
    """``gloo``, ``nccl``, or ``auto`` (NCCL when CUDA is available, else gloo)."""
    timeout_s: float = 300.0
    """Seconds a collective may wait before the worker gives up and the job stops."""
    progress: bool = True
    """Show a progress bar on rank 0 (on stderr)."""

    def __post_init__(self) -> None:
        """Checks of each setting alone and against ``steps``; those that need the data, the
        model, the plan or the machine run in ``Job`` and in ``tandem train``'s ``check_job``."""
        self._check_counts()
        self._check_optimizer()
        _choice("--backend", self.backend, BACKENDS)
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise UsageError(f"--timeout must be a number of seconds above 0 and at most "
                             f"{MAX_TIMEOUT_S:g} (a week) (got {self.timeout_s}); e.g. --timeout 300")
        if not 0 <= self.seed <= MAX_SEED:
            raise UsageError(f"--seed must be between 0 and {MAX_SEED} (got {self.seed}); "
                             f"e.g. --seed 0")
        self.straggler_factor()
        if self.resume is not None and self.resume == "auto" and self.out is None:
            raise UsageError("--resume without a path needs --out DIR (it resumes DIR/checkpoint.pt)")

    def _check_counts(self) -> None:
        _at_least("--nproc", self.nproc, 1)
        _at_least("--steps", self.steps, 1)
        _at_least("--batch-size", self.batch_size, 1)
        _at_least("--threads", self.threads, 1)
        if self.threads > MAX_THREADS:
            raise UsageError(f"--threads {self.threads} is more than any machine's cores; use at "
                             f"most {MAX_THREADS}, e.g. --threads 1 (one per worker)")
        _at_least("--checkpoint-every", self.checkpoint_every, 0)
        _at_least("--max-restarts", self.max_restarts, 0)
        if self.max_restarts and self.resume is None:
            raise UsageError(f"--max-restarts {self.max_restarts} starts the workers again after "
                             f"a failure, and without --resume they would start over; add "
                             f"--resume auto --out DIR --checkpoint-every N")
        if self.loader_workers is not None:
            _at_least("--loader-workers", self.loader_workers, 0)
            if self.loader_workers > MAX_LOADER_WORKERS:
                raise UsageError(f"--loader-workers {self.loader_workers} is more processes per "
                                 f"worker than any machine helps with; use at most "
                                 f"{MAX_LOADER_WORKERS}, e.g. --loader-workers 2")
        _at_least("--eval-every", self.eval_every, 0)
        _at_least("--log-every", self.log_every, 1)
        _at_least("--warmup-steps", self.warmup_steps, 0)
        if self.warmup_steps > self.steps:
            raise UsageError(f"--warmup-steps {self.warmup_steps} is more than --steps "
                             f"{self.steps}, so the learning rate would never reach --lr; use at "
                             f"most {self.steps}")
        for flag, value, what in (("--eval-every", self.eval_every, "evaluate"),
                                  ("--checkpoint-every", self.checkpoint_every, "checkpoint")):
            if value > self.steps:
                raise UsageError(f"{flag} {value} is more than --steps {self.steps}, so it would "
                                 f"never {what} before the end; use at most {self.steps}, or 0 "
                                 f"to {what} only at the end")
        if self.stop_after is not None and not 1 <= self.stop_after <= self.steps:
            raise UsageError(
                f"--stop-after {self.stop_after} must be between 1 and --steps ({self.steps})"
            )

    def _check_optimizer(self) -> None:
        _choice("--optimizer", self.optimizer, OPTIMIZERS)
        _choice("--lr-schedule", self.lr_schedule, SCHEDULES)
        _choice("--precision", self.precision, PRECISIONS)
        if self.clip_grad_norm is not None and not (self.clip_grad_norm > 0
                                                    and math.isfinite(self.clip_grad_norm)):
            raise UsageError(f"--clip-grad-norm must be a positive finite number (got "
                             f"{self.clip_grad_norm}); e.g. --clip-grad-norm 1.0")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise UsageError(f"--lr must be a positive finite number (got {self.lr}); "
                             f"e.g. --lr 0.05")
        if not 0 <= self.momentum < 1:
            raise UsageError(f"--momentum must be in [0, 1) (got {self.momentum}); e.g. "
                             f"--momentum 0.9, or 0 for none")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise UsageError(f"--weight-decay must be a finite number >= 0 (got "
                             f"{self.weight_decay}); e.g. --weight-decay 1e-4, or 0 for none")

    def straggler_factor(self) -> tuple[int, float] | None:
        """``(rank, factor)`` of ``--straggler``, or None."""
        if self.straggler is None:
            return None
        rank_text, _, factor_text = self.straggler.partition(":")
        try:
            rank, factor = int(rank_text), float(factor_text)
        except ValueError:
            raise UsageError(f"--straggler {self.straggler!r} is not RANK:FACTOR, e.g. 1:4") from None
        if not (0 <= rank and 1 <= factor <= MAX_STRAGGLER):
            raise UsageError(f"--straggler {self.straggler!r}: need a rank >= 0 and a factor "
                             f"between 1 and {MAX_STRAGGLER:g}, e.g. 1:4")
        return rank, factor



@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Job:
    """What every worker receives: the run's settings and the plan it executes."""

    run: RunConfig
    plan: Plan
    objects: Any = None
    """The user's own model, data and loss (a :class:`tandem.runtime.task.UserObjects`, from
    the Python API), or None: the run's specs name them."""

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
        if self.plan.tensor_degree != 1:
            raise UsageError(f"the plan has tensor degree {self.plan.tensor_degree}, but tandem "
                             f"does not run tensor parallelism yet; use a plan of degree 1")
        self._check_straggler()
        self._check_precision()
        self._check_nesterov()

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
        if not (self.plan.pipelined and self.plan.schedule == "pipedream"):
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
        parts, batch = self.plan.num_microbatches or 1, self.run.batch_size
        if self.plan.pipelined and batch % parts:
            raise UsageError(f"--microbatches {parts} does not divide --batch-size {batch}; "
                             f"choose a batch size that is a multiple of {parts}")
        workers = self.plan.stages[0].replicas
        if not self.plan.pipelined and batch % workers:
            raise UsageError(
                f"--batch-size {batch} is not divisible by the {workers} workers; use a multiple "
                f"of {workers}, e.g. {workers * max(1, round(batch / workers))}")
        if not self.plan.pipelined and batch % parts:
            raise UsageError(
                f"each worker's share of the batch ({batch // workers}) is not divisible by "
                f"--accumulate {self.plan.accumulate}; choose an --accumulate that divides "
                f"{batch // workers}")

    def fingerprint(self) -> dict[str, Any]:
        """Settings a checkpoint must agree with to be resumed."""
        from tandem.strategy import strategy_of

        run = self.run
        return {"model": run.model, "data": run.data, "loss": run.loss,
                "strategy": strategy_of(self.plan),
                "batch_size": run.batch_size, "optimizer": run.optimizer, "seed": run.seed,
                "compress": self.plan.compress.text if self.plan.compress else None}


def make_job(strategy: str = "dp", flags: Mapping[str, Any] | None = None, *,
             objects: Any = None, **settings: Any) -> Job:
    """The job ``tandem train --strategy STRATEGY FLAGS... SETTINGS...`` runs, for library use:
    ``flags`` are the plan's command-line flags (``{"--servers": 2, "--mode": "async"}``),
    ``settings`` the fields of :class:`RunConfig` (``nproc`` is the number of processes) and
    ``objects`` the user's own model, data and loss (:class:`tandem.runtime.task.UserObjects`)."""
    from torch import nn

    from tandem.runtime.preflight import build_checked
    from tandem.strategy import STRATEGIES, plan_from_flags

    run = RunConfig(**settings)
    data, model = build_checked(run, objects)
    if isinstance(model, nn.Sequential) or not (strategy in STRATEGIES
                                                and STRATEGIES[strategy].pipelined):
        blocks = len(model) if isinstance(model, nn.Sequential) else None
        plan = plan_from_flags(strategy, flags or {}, num_processes=run.nproc, num_blocks=blocks)
        return Job(run=run, plan=plan, objects=objects)
    from tandem.runtime.dist import under_launcher
    from tandem.runtime.pipeline.bounds import profiled_plan
    from tandem.runtime.pipeline.setup import example_inputs, pipeline_blocks

    split = pipeline_blocks(model, example_inputs(data.train), what=f"model {run.model!r}",
                            split_points=run.split_points)
    plan = plan_from_flags(strategy, flags or {}, num_processes=run.nproc, num_blocks=len(split))
    # the user's split points are their stages' blocks; under torchrun every process would
    # measure its own profile and could cut elsewhere, so the stages stay even there
    if run.split_points is None and not under_launcher():
        plan = profiled_plan(plan, split, data.train, batch_size=run.batch_size,
                             threads=run.threads)
    return Job(run=run, plan=plan, objects=objects)


def _ranks(first: int, last: int) -> str:
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def _at_least(flag: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise UsageError(f"{flag} must be at least {minimum} (got {value})")


def _choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UsageError(f"{flag} {value!r} is not one of: {', '.join(choices)}")
