"""The settings of a training run apart from its plan (model, data, optimizer, steps, outputs),
each checked on its own (:mod:`tandem.runtime.job` checks them against the plan)."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from typing import Any

from tandem.spec.arguments import annotation_kind, checked_type
from tandem.spec.batch_schedule import AUTO, BatchSchedule, parse_batch_schedule
from tandem.cluster import parse_size
from tandem.errors import UsageError
from tandem.spec.loader import LoaderOptions
from tandem.spec.model import is_builtin
from tandem.spec.optimizer import (
    BUILTIN_OPTIMIZERS, TANDEM_OPTIMIZERS, canonical_optimizer, no_decay_kinds, parse_options,
)
from tandem.spec.options import MAX_SEED

OPTIMIZERS = BUILTIN_OPTIMIZERS
"""``--optimizer`` names tandem has always taken; any ``torch.optim`` class by name, or
``package.module:Class``, is taken too (:mod:`tandem.spec.optimizer`)."""
LR_SCALINGS = ("linear", "sqrt", "auto")
"""``--lr-scaling`` choices: ``--lr`` times B/B0, sqrt(B/B0), or the gain per step the measured
gradient noise scale predicts (see :func:`tandem.runtime.learning_rate.scaled_lr`)."""
DEFAULT_BASE_BATCH = 64
"""``--base-batch`` when ``--lr-scaling`` is given without it."""
SCHEDULES = ("constant", "cosine", "step:FACTOR@STEP,...")
"""``--lr-schedule`` forms: constant, cosine decay, or step decay (``step:0.2@200,400``
multiplies the learning rate by 0.2 at step 200 and again at step 400)."""
BACKENDS = ("auto", "gloo", "nccl")
OFFLOADS = ("optimizer",)
"""``--offload`` choices (FSDP2's CPU offload of the sharded state)."""
PRECISIONS = ("fp32", "bf16", "fp16")
"""``--precision`` choices (:mod:`tandem.runtime.precision` implements them)."""
COMPENSATIONS = ("auto", "off")
"""``--async-compensation`` choices (:mod:`tandem.runtime.asynchrony` implements them)."""
MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""Longest ``--timeout``: a week (a longer wait is no bound at all)."""
MAX_THREADS = 1024
"""Most ``--threads`` per worker."""
MAX_LOADER_WORKERS = 64
"""Most ``--loader-workers`` per worker."""
MAX_STRAGGLER = 1000.0
"""Largest ``--straggler`` factor (a slower worker would outwait any timeout)."""
LOG_SINKS = ("jsonl", "csv", "tensorboard")
"""``--log-to`` choices: ``OUT/metrics.jsonl``, ``OUT/metrics.csv`` and TensorBoard's event
files in ``OUT/tensorboard/`` (:mod:`tandem.runtime.log_sinks` writes them)."""
TENSORBOARD_MISSING = ("--log-to tensorboard needs the tensorboard package: pip install "
                       "tensorboard (or pip install -e .[tensorboard])")


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
    init_fn: str | None = None
    """Build a user's model on the meta device, initialized module by module: ``reset`` or
    ``package.module:function`` (see :mod:`tandem.models.pieces`); None: built whole."""
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
    """Global minibatch: samples per optimizer step over all workers together (with
    ``batch_schedule``, the batch of step 0)."""
    batch_schedule: str | None = None
    """``BATCH@STEP,...`` (``64@0,128@200``): the global batch from each step on, instead of
    (or besides) decaying the learning rate; or ``auto`` (data parallelism: grow the batch toward
    the measured gradient noise scale). See :mod:`tandem.spec.batch_schedule`."""
    optimizer: str = "sgd"
    """``sgd``, ``adam``, ``adamw``, ``lars``, ``lamb``, any other ``torch.optim`` class by name
    (any case) or ``package.module:Class`` (:mod:`tandem.runtime.optimizer_class`)."""
    optimizer_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The optimizer's keyword options besides ``lr`` and ``weight_decay`` (``{"betas": (0.9,
    0.95)}``; ``KEY=VALUE`` words are read as :func:`tandem.spec.optimizer.parse_options` does)."""
    no_decay: str | None = None
    """``norm,bias,embedding`` (any of them): these parameters get weight decay 0, in a second
    group (:mod:`tandem.runtime.param_groups`)."""
    lr: float = 0.05
    momentum: float = 0.9
    """Momentum of SGD and LARS (other optimizers take theirs in ``optimizer_options``)."""
    weight_decay: float = 0.0
    lr_scaling: str | None = None
    """``linear``, ``sqrt`` or ``auto``: ``lr`` is for a global batch of ``base_batch`` and the
    run uses it times B/B0, sqrt(B/B0), or (auto, data parallelism) the gain per step that the
    measured gradient noise scale predicts (:func:`tandem.runtime.learning_rate.scaled_lr`);
    None: ``lr`` as given."""
    base_batch: int | None = None
    """The batch B0 that ``lr`` is for under ``lr_scaling`` (None: ``DEFAULT_BASE_BATCH``)."""
    warmup_steps: int = 0
    """Steps of linear learning-rate warm-up from 0."""
    precision: str = "fp32"
    """``fp32``, or ``bf16``/``fp16`` mixed precision (autocast; fp16 with a loss scaler that
    skips overflowed steps), see :mod:`tandem.runtime.precision`."""
    async_compensation: str = "auto"
    """Compensate the staleness of asynchronous updates (``auto``) or not (``off``); see
    :mod:`tandem.runtime.asynchrony`."""
    clip_grad_norm: float | None = None
    """Clip the gradients' global L2 norm to this (None: no clipping)."""
    lr_schedule: str = "constant"
    """After warm-up: ``constant``, ``cosine`` decay to 0 at the last step, or
    ``step:FACTOR@STEP,...`` (multiply by FACTOR at each STEP)."""
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
    log_to: str = "jsonl"
    """Where the metrics lines go: a comma list of :data:`LOG_SINKS` (``tensorboard,jsonl``;
    a list or tuple of them is taken too); all but ``jsonl`` need ``out``."""
    noise_every: int | None = None
    """Measure the gradient noise scale (data parallelism, two or more workers) every this many
    steps; None: at the ``--log-every`` steps, or every step with ``--batch-schedule auto``,
    whose growth reads the estimate. A measured step reduces its gradients after the backward
    instead of overlapping the reduction with it (without a codec)."""
    threads: int = 1
    """Intra-op threads per worker on CPU."""
    loader_workers: int | None = None
    """Background processes that read batches ahead (:mod:`tandem.data.loader`); None: 1 for
    data streamed from shards, 0 (read in the worker) for a user's ``Dataset``."""
    loader_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """``DataLoader`` options that apply to tandem's batches (``{"drop_last": True,
    "pin_memory": True}``, :class:`tandem.spec.loader.LoaderOptions`; ``tandem.fit``'s
    ``loader_options``)."""
    cache_dir: str | None = None
    """Keep local copies of the shards of ``--data shards:DIR`` here (a slow source read once)."""
    find_unused_parameters: bool = False
    """Data parallelism: a parameter that gets no gradient in a step has a zero gradient (DDP's
    ``find_unused_parameters=True``); without it, such a parameter stops the run, named."""
    memory_limit: str | None = None
    """Data parallelism: the most parameter, gradient and optimizer-state bytes a worker may
    hold (``40MB``, ``16GB``; an emulated device's memory). A worker over it after its first
    step stops the run in one line that names the ``--shard`` degree that would fit."""
    offload: str | None = None
    """``optimizer``: sharded data parallelism keeps its shards of the parameters, gradients and
    optimizer state in CPU memory and steps the optimizer there (FSDP2's ``CPUOffloadPolicy``),
    for GPU runs."""
    backend: str = "auto"
    """``gloo``, ``nccl``, or ``auto`` (NCCL when CUDA is available, else gloo)."""
    timeout_s: float = 300.0
    """Seconds a collective may wait before the worker gives up and the job stops."""
    progress: bool = True
    """Show a progress bar on rank 0 (on stderr)."""

    def __post_init__(self) -> None:
        """Checks of each setting alone and against ``steps``; those that need the data, the
        model, the plan or the machine run in ``Job`` and in ``tandem train``'s ``check_job``."""
        check_types(self)
        self._check_counts()
        check_optimizer_settings(self)
        _check_lr_scaling(self)
        _choice("--backend", self.backend, BACKENDS)
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise UsageError(f"--timeout must be a number of seconds above 0 and at most "
                             f"{MAX_TIMEOUT_S:g} (a week) (got {self.timeout_s}); e.g. --timeout 300")
        if not 0 <= self.seed <= MAX_SEED:
            raise UsageError(f"--seed must be between 0 and {MAX_SEED} (got {self.seed}); "
                             f"e.g. --seed 0")
        self.straggler_factor()
        self.memory_limit_bytes()
        self._check_batch_schedule()
        check_log_to(self)
        _check_init_fn(self.init_fn, self.model)
        if self.resume is not None and self.resume == "auto" and self.out is None:
            raise UsageError("--resume without a path needs --out DIR (it resumes DIR/checkpoint.pt)")

    def memory_limit_bytes(self) -> float | None:
        """``--memory-limit`` in bytes (None without one)."""
        if self.memory_limit is None:
            return None
        try:
            return parse_size(self.memory_limit)
        except UsageError:
            raise UsageError(f"--memory-limit {self.memory_limit!r} is not a memory size; write "
                             f"a positive number with a unit, e.g. --memory-limit 16GB") from None

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
        if self.noise_every is not None:
            _at_least("--noise-every", self.noise_every, 1)
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

    def _check_batch_schedule(self) -> None:
        schedule = self.parsed_batch_schedule()
        if schedule is not None and schedule[0][1] != self.batch_size:
            raise UsageError(f"--batch-schedule {self.batch_schedule} starts with a batch of "
                             f"{schedule[0][1]}, but --batch-size is {self.batch_size}; drop "
                             f"--batch-size (the schedule's first batch is the run's) or make "
                             f"them agree")
        if self.loader.drop_last and self.batch_schedule is not None:
            raise UsageError(f"loader option drop_last drops each epoch's short last batch, "
                             f"which needs one batch size, and --batch-schedule "
                             f"{self.batch_schedule} changes it; drop one of them")
        if self.batch_schedule == AUTO and self.loader_workers:
            raise UsageError(f"--batch-schedule auto decides the batch as training goes, but "
                             f"--loader-workers {self.loader_workers} reads batches ahead; use "
                             f"--loader-workers 0 or a fixed --batch-schedule")

    @property
    def loader(self) -> LoaderOptions:
        """``loader_options``, checked."""
        return LoaderOptions.parse(self.loader_options)

    def parsed_batch_schedule(self) -> BatchSchedule | None:
        """``batch_schedule`` as ``(first_step, batch_size)`` pairs; None without one or for
        ``auto`` (which starts at ``batch_size`` and grows as training goes)."""
        if self.batch_schedule is None or self.batch_schedule == AUTO:
            return None
        return parse_batch_schedule(self.batch_schedule, steps=self.steps)

    def batches(self) -> tuple[int, ...]:
        """Every global batch size the run may use as known before it starts."""
        schedule = self.parsed_batch_schedule()
        return tuple(batch for _, batch in schedule) if schedule else (self.batch_size,)

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


def _check_lr_scaling(config: RunConfig) -> None:
    """``--lr-scaling`` is one of its choices, and ``--base-batch`` goes with it."""
    if config.lr_scaling is not None:
        _choice("--lr-scaling", config.lr_scaling, LR_SCALINGS)
    if config.base_batch is None:
        return
    if config.lr_scaling is None:
        raise UsageError(f"--base-batch {config.base_batch} is the batch --lr is for, which "
                         f"only --lr-scaling uses; add --lr-scaling linear (or sqrt, or "
                         f"auto), or drop --base-batch")
    if config.base_batch < 1:
        raise UsageError(f"--base-batch must be at least 1 (got {config.base_batch}); e.g. "
                         f"--base-batch {DEFAULT_BASE_BATCH}")


def check_optimizer_settings(config: RunConfig) -> None:
    """Check the optimizer's settings and the learning rate's schedule, each alone; keep the
    optimizer's name, options and ``--no-decay`` in their canonical forms
    (:mod:`tandem.spec.optimizer`; the class itself is checked with torch, before launch)."""
    config.optimizer = canonical_optimizer(config.optimizer)
    config.optimizer_options = parse_options(config.optimizer_options)
    kinds = no_decay_kinds(config.no_decay)
    config.no_decay = ",".join(kinds) if kinds else None
    if kinds and config.optimizer in TANDEM_OPTIMIZERS:
        raise UsageError(f"--no-decay {config.no_decay} with --optimizer {config.optimizer}: "
                         f"{config.optimizer} already keeps biases and normalization "
                         f"parameters (every parameter of one dimension) out of weight "
                         f"decay and trust ratios; drop --no-decay")
    if config.lr_schedule.startswith("step:"):
        step_decay(config.lr_schedule, steps=config.steps)
    else:
        _choice("--lr-schedule", config.lr_schedule, SCHEDULES[:2] + ("step:0.2@200,400",))
    _choice("--precision", config.precision, PRECISIONS)
    if config.offload is not None:
        _choice("--offload", config.offload, OFFLOADS)
    _choice("--async-compensation", config.async_compensation, COMPENSATIONS)
    if config.clip_grad_norm is not None and not (config.clip_grad_norm > 0
                                                and math.isfinite(config.clip_grad_norm)):
        raise UsageError(f"--clip-grad-norm must be a positive finite number (got "
                         f"{config.clip_grad_norm}); e.g. --clip-grad-norm 1.0")
    if not (config.lr > 0 and math.isfinite(config.lr)):
        raise UsageError(f"--lr must be a positive finite number (got {config.lr}); "
                         f"e.g. --lr 0.05")
    if not 0 <= config.momentum < 1:
        raise UsageError(f"--momentum must be in [0, 1) (got {config.momentum}); e.g. "
                         f"--momentum 0.9, or 0 for none")
    if not (config.weight_decay >= 0 and math.isfinite(config.weight_decay)):
        raise UsageError(f"--weight-decay must be a finite number >= 0 (got "
                         f"{config.weight_decay}); e.g. --weight-decay 1e-4, or 0 for none")


def log_sinks(value: Any) -> tuple[str, ...]:
    """The sinks ``--log-to`` names (a comma list, or a list of names), each once, in
    :data:`LOG_SINKS`'s order; one line for a name that is not one or for none at all."""
    words = [str(word) for word in value] if isinstance(value, (list, tuple)) else \
        str(value).split(",")
    names = {word.strip() for word in words if word.strip()}
    example = "e.g. --log-to tensorboard,jsonl"
    if not names:
        raise UsageError(f"--log-to {value!r} names no log; give a comma list of "
                         f"{', '.join(LOG_SINKS)}, {example}")
    unknown = sorted(names - set(LOG_SINKS))
    if unknown:
        raise UsageError(f"--log-to {unknown[0]!r} is not one of: {', '.join(LOG_SINKS)} (a "
                         f"comma list, {example})")
    return tuple(name for name in LOG_SINKS if name in names)


def check_log_to(config: RunConfig) -> None:
    """Keep ``--log-to`` as a canonical comma list; one line for a log file with nowhere to
    go (no ``--out``: ``jsonl`` alone writes nothing then, as it always has) and for
    ``tensorboard`` without its package (found, not imported: before any worker starts)."""
    sinks = log_sinks(config.log_to)
    config.log_to = ",".join(sinks)
    files = [name for name in sinks if name != "jsonl"]
    if files and config.out is None:
        raise UsageError(f"--log-to {','.join(files)} writes its logs into the run's --out "
                         f"directory, and none is given; add --out DIR (e.g. --out runs/a)")
    if "tensorboard" in sinks and not tensorboard_installed():
        raise UsageError(TENSORBOARD_MISSING)


def tensorboard_installed() -> bool:
    """Whether the ``tensorboard`` package can be imported (looked up without importing it)."""
    try:
        return importlib.util.find_spec("tensorboard") is not None
    except (ImportError, ValueError):  # ValueError: in sys.modules without a spec
        return False


def resolve_batch_size(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with ``batch_size`` taken from ``batch_schedule`` where only the schedule
    gives it (a ``batch_size`` of None means not given)."""
    settings = dict(settings)
    if settings.get("batch_size") is None:
        settings.pop("batch_size", None)
        text = settings.get("batch_schedule")
        if text is not None and text != AUTO:
            first = parse_batch_schedule(text, steps=2**62)  # RunConfig checks the steps
            settings["batch_size"] = first[0][1]
    return settings


def step_decay(text: str, *, steps: int) -> tuple[float, tuple[int, ...]]:
    """``(factor, steps)`` of ``--lr-schedule step:FACTOR@STEP,...``; one line if malformed."""
    example = "e.g. step:0.2@200,400 (times 0.2 at step 200 and again at 400)"
    factor_text, at, steps_text = text.removeprefix("step:").partition("@")
    try:
        factor = float(factor_text)
        milestones = tuple(int(part) for part in steps_text.split(","))
        if not at:
            raise ValueError(text)
    except ValueError:
        raise UsageError(f"--lr-schedule {text!r} is not step:FACTOR@STEP,STEP,...; "
                         f"{example}") from None
    if not (0 < factor < 1 or 1 < factor) or not math.isfinite(factor):
        raise UsageError(f"--lr-schedule {text!r}: the factor must be a positive finite number "
                         f"other than 1; {example}")
    if any(b <= a for a, b in zip(milestones, milestones[1:])) or milestones[0] < 1:
        raise UsageError(f"--lr-schedule {text!r}: the steps must increase and be at least 1; "
                         f"{example}")
    if milestones[-1] >= steps:
        raise UsageError(f"--lr-schedule {text!r} decays at step {milestones[-1]}, but the run "
                         f"has --steps {steps}; use steps below {steps} or more --steps")
    return factor, milestones


PATH_FIELDS = ("out", "resume", "cache_dir")
"""Settings that take a path (``str`` or ``os.PathLike``; kept as ``str``)."""
MORE_FORMS = ("optimizer_options", "log_to")
"""Settings that take more forms than their annotation says, which their own checks read
(words or a dict: :func:`~tandem.spec.optimizer.parse_options`; a list: :func:`log_sinks`)."""
FLAGS = {"progress": "--no-progress"}
"""Settings whose flag is not ``--`` and their name."""


def check_types(config: RunConfig) -> None:
    """Each of ``config``'s settings of the type its flag gives (what a Python caller passes,
    ``tandem.fit(steps=...)``, is not parsed from words), one line naming one that is not;
    numbers and paths made plain ``int``, ``float`` and ``str``."""
    for field in dataclasses.fields(config):
        found = annotation_kind(str(field.type))
        if found is None or field.name in MORE_FORMS:
            continue
        kind, optional = found
        name = "timeout" if field.name == "timeout_s" else field.name
        value = checked_type(name, getattr(config, field.name),
                             "path" if field.name in PATH_FIELDS else kind,
                             flag=FLAGS.get(name, "--" + name.replace("_", "-")),
                             optional=optional)
        setattr(config, field.name, value)


def _at_least(flag: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise UsageError(f"{flag} must be at least {minimum} (got {value})")


def _choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UsageError(f"{flag} {value!r} is not one of: {', '.join(choices)}")


def _check_init_fn(init_fn: str | None, model: str) -> None:
    """One line if ``--init-fn`` is given for a built-in model (initialized by name already)."""
    if init_fn is not None and is_builtin(model):
        raise UsageError(f"--init-fn {init_fn} initializes a user's model (--model "
                         f"package.module:function); built-in model {model!r} is initialized "
                         f"by module name and always built in pieces where that helps; drop "
                         f"--init-fn")


def slowdown(config: RunConfig, rank: int) -> float:
    """How many times as long ``rank``'s compute takes under ``--straggler`` (1: as is)."""
    straggler = config.straggler_factor()
    return straggler[1] if straggler is not None and straggler[0] == rank else 1.0
