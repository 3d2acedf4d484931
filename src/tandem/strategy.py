"""The ``--strategy`` names and their flags, turned into the one :class:`~tandem.plan.Plan` a run
executes (no torch).

Usage::

    plan = plan_from_flags("ps", {"--servers": 2, "--mode": "async"}, num_processes=6,
                           num_blocks=4)
    strategy_of(plan)                       # "ps"

This is the only place that compares strategy names: each name stands for a sync-spec class
(and ``pipeline`` for a pipelined plan), each flag belongs to the strategies that use it, and a
flag given with a strategy it does not belong to is an error naming both. ``tandem train``
(``--strategy NAME --nproc N``) and ``tandem simulate`` (``--plan NAME`` on ``--devices N``)
build their plans here alike; :class:`Spelling` says how each names those two choices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tandem.spec.codec import CodecSpec
from tandem.errors import UsageError
from tandem.plan import Plan, Stage
from tandem.schedule.schedule import Schedule
from tandem.spec.kinds import ScheduleKind
from tandem.spec.sync import (
    AllReduceSync,
    ElasticAveragingSync,
    GossipSync,
    LocalSGDSync,
    ParameterServerSync,
    SyncSpec,
)

PIPELINE = "pipeline"


@dataclasses.dataclass(frozen=True, slots=True)
class Spelling:
    """How a command spells the two choices the builder's messages name."""

    strategy: str = "--strategy"
    """The option that names the strategy."""
    processes: str = "--nproc"
    """The option that gives the job's processes (devices)."""


TRAIN_SPELLING = Spelling()
"""``tandem train``'s: ``--strategy NAME --nproc N``."""


@dataclasses.dataclass(frozen=True, slots=True)
class StrategyKind:
    """What a ``--strategy`` name stands for."""

    sync: type[SyncSpec]
    """The sync-spec class its plans carry."""
    pipelined: bool = False
    """Whether its plans are pipelines (stages across workers)."""


STRATEGIES: dict[str, StrategyKind] = {
    "dp": StrategyKind(AllReduceSync), "ps": StrategyKind(ParameterServerSync),
    "gossip": StrategyKind(GossipSync), "easgd": StrategyKind(ElasticAveragingSync),
    "localsgd": StrategyKind(LocalSGDSync), PIPELINE: StrategyKind(AllReduceSync, pipelined=True),
}
"""``--strategy`` name -> what it stands for."""

ONE_STAGE = tuple(name for name, kind in STRATEGIES.items() if not kind.pipelined)
"""The strategies whose plans are one stage on every worker (all but ``pipeline``)."""

PIPELINE_FLAGS = ("--schedule", "--microbatches", "--stages", "--replicas", "--vertical-sync",
                  "--recompute")
"""Flags that shape a pipeline (``pipeline`` only)."""

SHARD_FLAG = "--shard"
"""The shard degree: data-parallel workers that share the model's state (ZeRO / FSDP)."""

SHARD_LEVEL_FLAG = "--shard-level"
"""What ``--shard`` shards: 1 optimizer state, 2 + gradients, 3 + parameters (default 3)."""

SHARD_UNITS_FLAG = "--shard-units"
"""The submodules ``--shard`` gathers one at a time, ``NAME,...`` (default: the model's blocks)."""

DATA_PARALLEL_FLAGS = {"--accumulate": ("dp", "gossip", "easgd", "localsgd"),
                       SHARD_FLAG: ("dp", PIPELINE), SHARD_LEVEL_FLAG: ("dp", PIPELINE),
                       SHARD_UNITS_FLAG: ("dp",), "--sync-batchnorm": ("dp",)}
"""Flags of the data-parallel trainer (and of a stage's replicas), by the strategies that take
them."""

TENSOR_FLAG = "--tensor-parallel"
"""The tensor degree: workers each split layer is divided among (``dp`` and ``pipeline``)."""

TENSOR_LAYERS_FLAG = "--tensor-layers"
"""The layers a tensor plan splits, ``NAME=STYLE,...`` (any model; :func:`parse_tensor_layers`)."""

SYNC_FLAGS = tuple(dict.fromkeys(flag for kind in STRATEGIES.values() for flag in kind.sync.FLAGS))
"""Every flag of every sync spec."""

PLAN_FLAGS = (*PIPELINE_FLAGS, *DATA_PARALLEL_FLAGS, "--compress", TENSOR_FLAG,
              TENSOR_LAYERS_FLAG,
              *(flag for kind in STRATEGIES.values() for flag in kind.sync.FLAGS))
"""Every flag a plan file fixes (so it cannot be given with ``--plan``)."""

PLAN_FLAG_KINDS: dict[str, str] = {
    **dict.fromkeys(("--microbatches", "--stages", "--accumulate", SHARD_FLAG, SHARD_LEVEL_FLAG,
                     TENSOR_FLAG, "--servers", "--staleness", "--backup", "--period"), "int"),
    **dict.fromkeys(("--gossip-step", "--rho"), "float"),
    **dict.fromkeys(("--vertical-sync", "--recompute", "--sync-batchnorm", "--staleness-lr",
                     "--async-gossip", "--nesterov"), "bool"),
    **dict.fromkeys(("--schedule", "--replicas", "--compress", "--mode", "--topology",
                     "--weights"), "str"),
}
"""What each plan flag's value is once parsed (a kind of :data:`tandem.spec.arguments.KINDS`),
as a Python caller gives it (``tandem.fit(servers=2)``); ``--tensor-layers`` and
``--shard-units`` take more forms there (a dict, a list) and are left out."""


def owners(flag: str) -> tuple[str, ...]:
    """The strategies ``flag`` applies to (empty: it applies to every strategy)."""
    if flag in PIPELINE_FLAGS:
        return (PIPELINE,)
    if flag in DATA_PARALLEL_FLAGS:
        return DATA_PARALLEL_FLAGS[flag]
    return tuple(name for name, kind in STRATEGIES.items()
                 if not kind.pipelined and flag in kind.sync.FLAGS)


def check_strategy(name: str) -> None:
    """:class:`UsageError` for an unknown strategy name."""
    if name not in STRATEGIES:
        raise UsageError(f"unknown strategy {name!r}; choose one of: {', '.join(sorted(STRATEGIES))}")


def check_applicable(strategy: str, given: Mapping[str, Any],
                     spelling: Spelling = TRAIN_SPELLING) -> None:
    """One line naming the first flag in ``given`` that ``strategy`` does not use and the
    strategy it belongs to."""
    option = spelling.strategy
    for flag in given:
        belongs = owners(flag)
        if belongs and strategy not in belongs:
            choices = ", ".join(belongs[:-1]) + (" or " if len(belongs) > 1 else "") + belongs[-1]
            raise UsageError(f"{flag} applies to {option} {choices} only (this run has "
                             f"{option} {strategy}); add {option} {belongs[0]} or drop it")


def strategy_of(plan: Plan) -> str:
    """The ``--strategy`` name that builds ``plan``."""
    if plan.pipelined:
        return PIPELINE
    return next(name for name, kind in STRATEGIES.items()
                if not kind.pipelined and isinstance(plan.sync, kind.sync))


def even_bounds(num_blocks: int, num_stages: int) -> list[tuple[int, int]]:
    """Split ``num_blocks`` blocks into ``num_stages`` contiguous ranges of near-equal length."""
    if num_stages > num_blocks:
        raise UsageError(
            f"more stages ({num_stages}) than layers ({num_blocks}) in the model; "
            f"use --stages {num_blocks} or fewer, or a model with more blocks"
        )
    base, extra = divmod(num_blocks, num_stages)
    bounds, start = [], 0
    for stage in range(num_stages):
        end = start + base + (1 if stage < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def parse_replicas(text: str) -> tuple[int, ...]:
    """``2,1`` (or ``2-1``) into ``(2, 1)``."""
    try:
        replicas = tuple(int(part) for part in text.replace("-", ",").split(",") if part.strip())
    except ValueError:
        raise UsageError(f"--replicas {text!r} is not a list of integers like 2,1") from None
    if not replicas or min(replicas) < 1:
        raise UsageError(f"--replicas {text!r}: every stage needs at least 1 replica, e.g. 2,1")
    return replicas


def build_sync(strategy: str, given: Mapping[str, Any]) -> SyncSpec:
    """The sync spec of ``strategy`` with the options of its flags in ``given``."""
    cls = STRATEGIES[strategy].sync
    sync = cls(**{cls.FLAGS[flag]: value for flag, value in given.items() if flag in cls.FLAGS})
    if isinstance(sync, ParameterServerSync):
        sync.check_given(dict(given))
    return sync


def plan_from_flags(strategy: str, given: Mapping[str, Any], *, num_processes: int,
                    num_blocks: int | None, spelling: Spelling = TRAIN_SPELLING) -> Plan:
    """The plan the command-line flags ``given`` (only those the user set) describe for a job
    of ``num_processes`` processes and a model of ``num_blocks`` blocks (None: not an
    ``nn.Sequential``, so it cannot be cut into stages); messages name the choices as
    ``spelling`` says the command spells them."""
    check_strategy(strategy)
    check_applicable(strategy, given, spelling)
    nproc = spelling.processes
    if num_processes < 1:
        raise UsageError(f"{nproc} must be at least 1 (got {num_processes})")
    compress = CodecSpec.parse(given["--compress"]) if given.get("--compress") else None
    degree = tensor_degree(strategy, given, num_processes)
    if given.get(TENSOR_LAYERS_FLAG) and degree == 1:
        raise UsageError(f"{TENSOR_LAYERS_FLAG} names the layers to split, but the tensor degree "
                         f"is 1, which splits none; add {TENSOR_FLAG} T (e.g. {TENSOR_FLAG} 2 "
                         f"--nproc 2), or drop {TENSOR_LAYERS_FLAG}")
    sync = build_sync(strategy, given)
    _check_gossip(sync, compress, spelling)
    if STRATEGIES[strategy].pipelined:
        return _pipeline_plan(given, num_processes, num_blocks, compress, degree)
    servers = sync.num_servers
    workers = num_processes - servers
    if workers < 1:
        raise UsageError(
            f"--servers {servers} leaves no workers in {nproc} {num_processes}; servers count "
            f"within {nproc}, e.g. {nproc} {servers + 4} --servers {servers}"
        )
    if isinstance(sync, ParameterServerSync) and sync.backup >= workers:
        raise UsageError(f"--backup {sync.backup} must be between 0 and {workers - 1}: there are "
                         f"{workers} workers and each step needs at least one gradient")
    accumulate = int(given.get("--accumulate", 1))
    if accumulate < 1:
        raise UsageError(f"--accumulate must be at least 1 (got {accumulate})")
    layers, replicas = num_blocks or 1, workers // degree
    shard, level, units = shard_options(given, replicas, degree, spelling)
    return Plan(stages=[Stage(start=0, end=layers, replicas=replicas)], num_layers=layers,
                num_devices=num_processes, sharded=shard > 0, schedule=ScheduleKind.ONE_F_ONE_B,
                num_microbatches=replicas * accumulate, tensor_degree=degree,
                tensor_layers=parse_tensor_layers(given.get(TENSOR_LAYERS_FLAG)), sync=sync,
                compress=compress, shard_degree=max(shard, 1), shard_level=level, shard_units=units,
                sync_batchnorm=bool(given.get("--sync-batchnorm")))


def shard_options(given: Mapping[str, Any], workers: int, tensor: int = 1,
                  spelling: Spelling = TRAIN_SPELLING) -> tuple[int, int, list[str] | None]:
    """``--shard S`` (not given: none; 1: each worker's own group, FSDP2 on one device),
    ``--shard-level`` (default 3) and ``--shard-units`` (default None: the model's blocks),
    checked against the ``workers`` that share each batch: ``S`` must divide them (``workers /
    S`` replicas of ``S``-way shards, HSDP). The degree is 0 when the run is not sharded."""
    nproc = spelling.processes
    extra = next((flag for flag in (SHARD_LEVEL_FLAG, SHARD_UNITS_FLAG) if flag in given), None)
    if SHARD_FLAG not in given:
        if extra is not None:
            raise UsageError(f"{extra} says how {SHARD_FLAG} shards, but this run shards "
                             f"nothing; add {SHARD_FLAG} S (e.g. {SHARD_FLAG} {max(2, workers)}) "
                             f"or drop {extra}")
        return 0, 3, None
    degree = int(given[SHARD_FLAG])
    if degree < 1:
        raise UsageError(f"{SHARD_FLAG} must be at least 1 (got {degree}); e.g. {SHARD_FLAG} "
                         f"{max(2, workers)}, or leave it out to shard nothing")
    if degree > workers or workers % degree:
        divisors = [d for d in range(2, workers + 1) if workers % d == 0] or [1]
        raise UsageError(f"{SHARD_FLAG} {degree} does not divide {nproc} {workers}: the workers "
                         f"are {nproc}/S replicas of S-way shards; use {SHARD_FLAG} "
                         f"{' or '.join(map(str, divisors))}")
    level = given.get(SHARD_LEVEL_FLAG, 3)
    if isinstance(level, bool) or level not in (1, 2, 3):
        raise UsageError(f"{SHARD_LEVEL_FLAG} {level} is not one of 1 (optimizer state), "
                         f"2 (+ gradients) or 3 (+ parameters)")
    if level == 1 and tensor > 1:
        raise UsageError(f"{SHARD_LEVEL_FLAG} 1 is torch's ZeroRedundancyOptimizer, which "
                         f"broadcasts plain tensors and has no rule for the DTensor shares of "
                         f"{TENSOR_FLAG} {tensor}; use {SHARD_LEVEL_FLAG} 2 (FSDP2 shards the "
                         f"optimizer state and gradients, and keeps the parameters whole "
                         f"between forward and backward)")
    if level == 1 and SHARD_UNITS_FLAG in given:
        raise UsageError(f"{SHARD_UNITS_FLAG} picks the modules whose parameters are gathered "
                         f"together, which {SHARD_LEVEL_FLAG} 1 (the optimizer state only) does "
                         f"not shard; use {SHARD_LEVEL_FLAG} 2 or 3, or drop {SHARD_UNITS_FLAG}")
    return degree, int(level), parse_shard_units(given.get(SHARD_UNITS_FLAG))


def parse_shard_units(value: Any) -> list[str] | None:
    """``--shard-units transformer.h.0,transformer.h.1`` (or a list, from the Python API) into
    the plan's ``shard_units``; None when not given. The names are checked against the model
    when it is built."""
    if value is None:
        return None
    names = ([str(name).strip() for name in value] if isinstance(value, (list, tuple))
             else [name.strip() for name in str(value).split(",")])
    if not names or not all(names):
        raise UsageError(f"{SHARD_UNITS_FLAG} {value!r}: write submodule names separated by "
                         f"commas, e.g. transformer.h.0,transformer.h.1")
    return names


def parse_tensor_layers(value: Any) -> dict[str, str] | None:
    """``--tensor-layers fc1=colwise,fc2=rowwise`` (or the same as a dict, from the Python API)
    into the plan's ``tensor_layers``; None when not given. Styles are checked by the plan."""
    if value is None or isinstance(value, dict):
        return value
    layers: dict[str, str] = {}
    for item in str(value).split(","):
        name, sign, style = item.strip().partition("=")
        if not (name and sign and style):
            raise UsageError(f"{TENSOR_LAYERS_FLAG} {value!r}: write NAME=STYLE pairs separated "
                             f"by commas, e.g. fc1=colwise,fc2=rowwise")
        layers[name.strip()] = style.strip()
    return layers


def tensor_degree(strategy: str, given: Mapping[str, Any], num_processes: int) -> int:
    """``--tensor-parallel T`` (default 1), checked against the strategy and the job's size:
    with ``--strategy dp`` the job is data ``nproc / T`` x tensor ``T``; with ``--strategy
    pipeline`` every stage replica is ``T`` adjacent workers."""
    degree = int(given.get(TENSOR_FLAG, 1))
    if degree < 1:
        raise UsageError(f"{TENSOR_FLAG} must be at least 1 (got {degree}); e.g. "
                         f"{TENSOR_FLAG} 2, or 1 for none")
    if degree == 1:
        return 1
    if STRATEGIES[strategy].sync is not AllReduceSync and not STRATEGIES[strategy].pipelined:
        raise UsageError(f"{TENSOR_FLAG} {degree} runs with --strategy dp or pipeline (this run "
                         f"has --strategy {strategy}); use one of those or drop {TENSOR_FLAG}")
    if num_processes % degree:
        raise UsageError(f"{TENSOR_FLAG} {degree} does not divide --nproc {num_processes}: the "
                         f"data (or pipeline) degree times the tensor degree must be the number "
                         f"of workers; use --nproc {degree * max(1, num_processes // degree)}")
    return degree


def _check_gossip(sync: SyncSpec, compress: CodecSpec | None, spelling: Spelling) -> None:
    """Compression is CHOCO-gossip, for synchronous gossip only; its step needs it."""
    if not isinstance(sync, GossipSync):
        return
    if sync.asynchronous and compress is not None:
        raise UsageError(f"--compress {compress.text} cannot be used with --async-gossip: "
                         f"AD-PSGD's pairwise averages exchange whole models; drop --async-gossip "
                         f"(CHOCO-gossip compresses synchronous gossip) or --compress")
    if sync.step is not None and (compress is None or sync.asynchronous):
        raise UsageError(f"--gossip-step is the step size of compressed gossip; it needs "
                         f"{spelling.strategy} gossip --compress CODEC (plain D-PSGD averages "
                         f"fully)")


def _pipeline_plan(given: Mapping[str, Any], num_processes: int, num_blocks: int | None,
                   compress: CodecSpec | None, degree: int = 1) -> Plan:
    """Stages and replicas of ``num_processes // degree`` pipeline workers (each a group of
    ``degree`` tensor-parallel processes); with ``--shard D`` each stage has ``D`` replicas
    unless ``--replicas`` says otherwise (:func:`tandem.runtime.job.check_shard` checks them)."""
    if num_blocks is None:
        raise UsageError("--strategy pipeline needs a model that is an nn.Sequential of blocks; "
                         "use --strategy dp for this model")
    replicas = parse_replicas(given["--replicas"]) if given.get("--replicas") else None
    workers = num_processes // degree
    per = f" / {TENSOR_FLAG} {degree}" if degree > 1 else ""
    each = max(1, int(given.get(SHARD_FLAG) or 1))  # a stage's replicas unless --replicas
    num_stages = given.get("--stages", len(replicas) if replicas else max(1, workers // each))
    if num_stages < 1:
        raise UsageError(f"--stages must be at least 1 (got {num_stages})")
    chosen = replicas or (each,) * num_stages
    if len(chosen) != num_stages:
        raise UsageError(f"--replicas gives {len(chosen)} stages but --stages is {num_stages}; "
                         f"give one replica count per stage")
    shard, level, units = shard_options(given, chosen[0], degree)
    if sum(chosen) != workers:
        raise UsageError(
            f"the stages' replicas ({'-'.join(map(str, chosen))}) add up to {sum(chosen)} "
            f"workers but the job has {workers} (--nproc {num_processes}{per}); use --nproc "
            f"{sum(chosen) * degree} or change --replicas")
    name: str = given.get("--schedule") or ScheduleKind.ONE_F_ONE_B
    count, text = given.get("--microbatches"), None
    schedule = ScheduleKind.parse(name)
    if schedule is None:
        written = read_schedule_file(name)
        if written.kind.asynchronous:
            raise UsageError(f"--schedule {name}: a hand-written schedule must be a flush "
                             f"schedule (gpipe or 1f1b); use --schedule pipedream for PipeDream's")
        if count is not None:
            raise UsageError(f"--microbatches conflicts with --schedule {name}, which has "
                             f"{written.num_microbatches}; drop --microbatches")
        schedule, count, text = written.kind, written.num_microbatches, written.text()
    plan = Plan(stages=[Stage(start=start, end=end, replicas=count) for (start, end), count
                        in zip(even_bounds(num_blocks, num_stages), chosen)],
                num_layers=num_blocks, num_devices=num_processes, schedule=schedule,
                num_microbatches=count, schedule_text=text, tensor_degree=degree,
                tensor_layers=parse_tensor_layers(given.get(TENSOR_LAYERS_FLAG)),
                vertical_sync=bool(given.get("--vertical-sync")),
                recompute=bool(given.get("--recompute")), compress=compress,
                sharded=shard > 0, shard_degree=max(shard, 1), shard_level=level,
                shard_units=units)
    if not plan.pipelined:  # one stage under 1F1B would be data parallelism: say so
        raise UsageError("a one-stage 1F1B pipeline is data parallelism: use --strategy dp "
                         "(or --schedule gpipe/pipedream, or more --stages)")
    return plan


def read_schedule_file(path: str) -> Schedule:
    """A schedule written in its text form (``Schedule.text``) by hand or by a tool."""
    try:
        with open(path, encoding="utf-8") as handle:
            return Schedule.parse(handle.read())
    except OSError as exc:
        raise UsageError(
            f"--schedule {path!r} is neither gpipe, 1f1b, pipedream nor a readable schedule "
            f"file ({exc.strerror})"
        ) from None
    except (ValueError, AssertionError) as exc:
        raise UsageError(f"--schedule {path}: not a schedule in tandem's text form ({exc})") from None


def plan_with_flags(plan: Plan, strategy: str | None, given: Mapping[str, Any],
                    path: str) -> Plan:
    """``plan`` read from ``--plan path``; flags that the plan fixes are errors."""
    if strategy is not None:
        check_strategy(strategy)
        if strategy_of(plan) != strategy:
            raise UsageError(f"--strategy {strategy} contradicts --plan {path}, which is a "
                             f"{strategy_of(plan)} plan; drop --strategy")
    for flag in given:
        if flag in PLAN_FLAGS:
            raise UsageError(f"{flag} conflicts with --plan {path}, which fixes the strategy; "
                             f"drop {flag} or edit the plan")
    return plan
