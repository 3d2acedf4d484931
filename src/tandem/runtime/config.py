"""Configuration of a training run, checked before any worker starts."""

from __future__ import annotations

import dataclasses
from typing import Any

from tandem.errors import UsageError

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "cosine")
BACKENDS = ("auto", "gloo", "nccl")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "pipedream")
PS_MODES = ("sync", "async", "ssp")


@dataclasses.dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything a worker needs to train; plain data, so it pickles to spawned workers."""

    model: str = "mlp"
    """Model spec, e.g. ``mlp:hidden=128`` or ``package.module:function``."""
    data: str = "digits"
    """Dataset spec, e.g. ``digits`` or ``images:n=4096,size=32``."""
    strategy: str = "dp"
    """Synchronization strategy (``dp``: DistributedDataParallel)."""
    schedule: str = "1f1b"
    """Pipeline schedule: ``gpipe``, ``1f1b`` (flush per step) or ``pipedream`` (asynchronous)."""
    microbatches: int | None = None
    """Micro-batches per step of a flush schedule (default: the number of stages)."""
    stages: int | None = None
    """Pipeline stages, splitting the model's blocks evenly (default: one per worker)."""
    replicas: str | None = None
    """Replicas of each pipeline stage, e.g. ``2,1`` (default: 1 each)."""
    plan: str | None = None
    """A ``tandem plan`` JSON file giving the stages and replicas instead."""
    vertical_sync: bool = False
    """Asynchronous pipeline: every stage uses the weight version stage 0 used."""
    servers: int = 1
    """``ps``: parameter-server processes, counted within ``nproc`` (ranks 0..servers-1)."""
    ps_mode: str = "sync"
    """``ps``: ``sync``, ``async`` (apply each push on arrival) or ``ssp`` (bounded staleness)."""
    staleness: int = 2
    """``ps --mode ssp``: how many updates a worker may be ahead of the slowest."""
    staleness_lr: bool = False
    """``ps`` asynchronous modes: scale each update's learning rate by 1 / its staleness."""
    backup: int = 0
    """``ps --mode sync``: backup workers; each step applies the first (workers - backup) pushes."""
    topology: str = "ring"
    """``gossip``: ring, torus, exponential, complete or custom:0-1,1-2,..."""
    mixing: str = "metropolis"
    """``gossip``: mixing weights, ``uniform`` or ``metropolis``."""
    asynchronous_gossip: bool = False
    """``gossip``: AD-PSGD — pairwise averaging with a random neighbour, no global rounds."""
    gossip_step: float | None = None
    """``gossip --compress``: CHOCO-gossip's consensus step size gamma, in (0, 1] (default 0.1,
    or random-k's ratio if smaller)."""
    period: int = 4
    """``localsgd``: average every this many steps; ``easgd``: elastic update period (tau)."""
    rho: float = 1.0
    """``easgd``: elasticity; the moving rate is ``lr * rho``."""
    compress: str | None = None
    """Compression ``CODEC[:k=v,...]``, e.g. ``topk:ratio=0.01``: of gradients (``dp``), pushes
    and pulls (``ps``), exchanged parameters (``gossip``) or activations (``pipeline``)."""
    straggler: str | None = None
    """``RANK:FACTOR``: worker RANK takes FACTOR times as long for each step (experiments)."""
    nproc: int = 1
    """Local worker processes to start (ignored under an external ``torchrun``)."""
    steps: int = 100
    """Optimizer steps in the whole run."""
    batch_size: int = 64
    """Global minibatch: samples per optimizer step over all workers together."""
    accumulate: int = 1
    """Micro-steps per optimizer step (gradient accumulation under ``no_sync``)."""
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    """Momentum of SGD (ignored by Adam/AdamW, which use their betas)."""
    weight_decay: float = 0.0
    warmup_steps: int = 0
    """Steps of linear learning-rate warm-up from 0."""
    lr_schedule: str = "constant"
    """After warm-up: ``constant`` or ``cosine`` decay to 0 at the last step."""
    seed: int = 0
    out: str | None = None
    """Directory for ``final.pt``, ``metrics.jsonl``, ``trace.json`` and checkpoints."""
    resume: str | None = None
    """Checkpoint to resume from (``auto``: ``<out>/checkpoint.pt``)."""
    checkpoint_every: int = 0
    """Save a checkpoint every this many steps (0: only when the run ends or stops)."""
    stop_after: int | None = None
    """Stop after this many steps, checkpointing, as if the job had been cut off."""
    eval_every: int = 0
    """Evaluate on the test split every this many steps (0: only at the end)."""
    log_every: int = 10
    """Write the global loss to ``metrics.jsonl`` every this many steps."""
    threads: int = 1
    """Intra-op threads per worker on CPU."""
    backend: str = "auto"
    """``gloo``, ``nccl``, or ``auto`` (NCCL when CUDA is available, else gloo)."""
    timeout_s: float = 300.0
    """Seconds a collective may wait before the worker gives up and the job stops."""
    progress: bool = True
    """Show a progress bar on rank 0 (on stderr)."""

    def __post_init__(self) -> None:
        _at_least("--nproc", self.nproc, 1)
        _at_least("--steps", self.steps, 1)
        _at_least("--batch-size", self.batch_size, 1)
        _at_least("--accumulate", self.accumulate, 1)
        _at_least("--threads", self.threads, 1)
        _at_least("--checkpoint-every", self.checkpoint_every, 0)
        _at_least("--eval-every", self.eval_every, 0)
        _at_least("--log-every", self.log_every, 1)
        _at_least("--warmup-steps", self.warmup_steps, 0)
        _choice("--optimizer", self.optimizer, OPTIMIZERS)
        _choice("--lr-schedule", self.lr_schedule, SCHEDULES)
        _choice("--backend", self.backend, BACKENDS)
        if not self.lr > 0:
            raise UsageError(f"--lr must be positive (got {self.lr})")
        if self.timeout_s <= 0:
            raise UsageError(f"--timeout must be positive seconds (got {self.timeout_s})")
        if self.stop_after is not None and not 1 <= self.stop_after <= self.steps:
            raise UsageError(
                f"--stop-after {self.stop_after} must be between 1 and --steps ({self.steps})"
            )
        if self.microbatches is not None and self.microbatches < 1:
            raise UsageError(f"--microbatches must be at least 1 (got {self.microbatches})")
        if self.strategy == "pipeline":
            if self.resume is not None or self.stop_after is not None or self.checkpoint_every:
                raise UsageError(
                    "--resume, --stop-after and --checkpoint-every are not supported with "
                    "--strategy pipeline yet; use --strategy dp for resumable runs"
                )
            if self.accumulate != 1:
                raise UsageError("--accumulate does not apply to pipelines: use --microbatches")
            if self.plan is not None and (self.stages is not None or self.replicas is not None):
                raise UsageError("give either --plan or --stages/--replicas, not both")
        if self.strategy != "pipeline":
            self._check_no_pipeline_options()
        if self.strategy == "ps":
            self._check_ps()
        if (self.resume is not None or self.stop_after is not None or self.checkpoint_every) \
                and (self.compress or "").partition(":")[0] == "powersgd":
            raise UsageError(
                "--compress powersgd cannot be resumed (PyTorch keeps its state per DDP bucket, "
                "which a restarted job rebuilds); drop --resume/--stop-after/--checkpoint-every "
                "or use another codec"
            )
        if self.gossip_step is not None and not 0 < self.gossip_step <= 1:
            raise UsageError(f"--gossip-step must be in (0, 1] (got {self.gossip_step}); "
                             f"e.g. 0.5, or 1 with a lossless codec")
        _at_least("--period", self.period, 1)
        if self.rho <= 0:
            raise UsageError(f"--rho must be positive (got {self.rho})")
        self.straggler_factor()
        if self.resume is not None and self.resume == "auto" and self.out is None:
            raise UsageError("--resume without a path needs --out DIR (it resumes DIR/checkpoint.pt)")

    def _check_no_pipeline_options(self) -> None:
        given = {"--microbatches": self.microbatches, "--stages": self.stages,
                 "--replicas": self.replicas, "--plan": self.plan,
                 "--vertical-sync": self.vertical_sync or None}
        for flag, value in given.items():
            if value is not None:
                raise UsageError(f"{flag} applies to --strategy pipeline only (this run has "
                                 f"--strategy {self.strategy}); add --strategy pipeline or drop it")

    def _check_ps(self) -> None:
        _choice("--mode", self.ps_mode, PS_MODES)
        _at_least("--servers", self.servers, 1)
        if self.servers >= self.nproc:
            raise UsageError(
                f"--servers {self.servers} leaves no workers in --nproc {self.nproc}; servers count "
                f"within --nproc, e.g. --nproc {self.servers + 4} --servers {self.servers}"
            )
        if self.staleness < 0:
            raise UsageError(f"--staleness must be >= 0 (got {self.staleness})")
        workers = self.nproc - self.servers
        if self.backup < 0 or self.backup >= workers:
            raise UsageError(
                f"--backup {self.backup} must be between 0 and {workers - 1}: there are {workers} "
                f"workers and each step needs at least one gradient"
            )
        if self.backup and self.ps_mode != "sync":
            raise UsageError(f"--backup applies to --mode sync only (got --mode {self.ps_mode})")
        if self.accumulate != 1:
            raise UsageError("--accumulate is not supported with --strategy ps")

    def straggler_factor(self) -> tuple[int, float] | None:
        """``(rank, factor)`` of ``--straggler``, or None."""
        if self.straggler is None:
            return None
        rank_text, _, factor_text = self.straggler.partition(":")
        try:
            rank, factor = int(rank_text), float(factor_text)
        except ValueError:
            raise UsageError(f"--straggler {self.straggler!r} is not RANK:FACTOR, e.g. 1:4") from None
        if not 0 <= rank or factor < 1:
            raise UsageError(f"--straggler {self.straggler!r}: need a rank >= 0 and a factor >= 1")
        return rank, factor

    def check_world(self, world_size: int) -> None:
        """Checks that need the number of workers (run after start-up under ``torchrun``)."""
        if self.strategy == "pipeline":
            return  # pipelines split the batch into micro-batches, not across workers
        if self.strategy == "ps":
            world_size -= self.servers
        if self.batch_size % world_size:
            raise UsageError(
                f"--batch-size {self.batch_size} is not divisible by the {world_size} workers; "
                f"use a multiple of {world_size}, e.g. {world_size * max(1, round(self.batch_size / world_size))}"
            )
        local = self.batch_size // world_size
        if local % self.accumulate:
            raise UsageError(
                f"each worker's share of the batch ({local}) is not divisible by "
                f"--accumulate {self.accumulate}; choose an --accumulate that divides {local}"
            )

    def fingerprint(self) -> dict[str, Any]:
        """Settings a checkpoint must agree with to be resumed."""
        return {key: getattr(self, key) for key in ("model", "data", "strategy", "batch_size",
                                                    "optimizer", "seed", "compress")}


def _at_least(flag: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise UsageError(f"{flag} must be at least {minimum} (got {value})")


def _choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UsageError(f"{flag} {value!r} is not one of: {', '.join(choices)}")
