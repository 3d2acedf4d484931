"""Limits of scalability: predicted speedup against device count for DP, pipelines and hybrids.

Usage::

    analysis = scale(profile, parse_cluster("8x300GB/s,128x25Gb/s"), ScaleOptions(max_devices=1024))
    analysis.points, analysis.crossover["dp"]

Two modes:

- **strong scaling** (the default): the global minibatch is fixed (``SimOptions.batch_scale``
  profile minibatches per step) and shared among more and more devices, so compute per device
  shrinks while data parallelism's allreduce does not: the speedup flattens where communication
  overtakes compute. Speedup at ``N``: one device's step time on the whole minibatch over the
  step time on ``N``.
- **weak scaling** (``ScaleOptions.per_device_batch = B``, the form in which scaling limits are
  usually published): every training device processes ``B`` samples per step, so the global
  batch is ``B`` times the devices that hold a model replica or a stage (a parameter server holds
  none). Speedup at ``N``: throughput in samples per second over that of one device running ``B``
  samples per step, i.e. ``N`` times the scaling efficiency. The profile must record the
  minibatch it was measured at (``ModelProfile.batch_size``) to turn samples into its units.

In both modes the *scaling efficiency* of a point is its speedup divided by its device count.

For each device count ``N`` (powers of two up to the maximum) the cluster keeps its inner
levels and grows its outermost one (``8x300GB/s,128x25Gb/s`` at 64 devices is 8 servers of 8),
and these strategies are simulated:

- ``dp``: data parallelism on ``N`` devices (DDP's overlapped buckets);
- ``dp+Rx``: the same with gradients compressed ``R`` times (fp16 is 2, 1-bit 32);
- ``dp+CODEC``: the same with a gradient codec (``sign``, ``topk:ratio=0.01``, ...), its
  collective and its encode/decode time modelled (:mod:`tandem.planning.simulate.codecs`);
- ``pipeline``: a straight pipeline of ``min(N, layers)`` compute-balanced stages;
- ``hybrid``: the fastest of the planner's plan for the ``N`` devices (replicated stages), as
  it chose its micro-batches and at the pipelines' count below, and ``dp``'s plan: so never
  below ``dp``, and the same figure when the plans are the same;
- ``3d``: tensor + pipeline + data parallelism: the fastest of ``hybrid``'s candidates and, for
  every tensor degree ``T`` of :func:`tandem.planning.simulate.tensor.tensor_degrees` (up to
  ``max_tensor_degree``), data parallelism over ``N / T`` groups of ``T`` adjacent devices and
  the partitioner's plan for those groups on the profile as one device of a group computes it,
  each replica then split ``T`` ways (so never below ``hybrid``);
- ``ps``: synchronous parameter servers: ``ps_servers`` of the ``N`` devices serve, the rest
  train (from 2 devices on);
- ``gossip``: D-PSGD on a ring of the ``N`` devices;
- ``localsgd``: local SGD averaging every ``period`` steps (its step: the mean over a period).

``families`` picks which of the last three are drawn. Their step times are times, not
convergence: gossip and local SGD workers disagree between averagings, so they usually need
more steps than a synchronous method (see :mod:`tandem.planning.simulate.decentralized`).

Pipelines run 1F1B (synchronous, like data parallelism) with ``microbatches_per_stage``
micro-batches per stage, or per replica of the widest stage if that is more, cut from the step's
global batch (capped at its samples and at ``MAX_MICROBATCHES``: :mod:`.scale_counts`). Under
weak scaling a straight pipeline of ``S`` stages thus takes ``S * B`` samples per step in
``K * S`` micro-batches of ``B / K`` samples (``K = microbatches_per_stage``). On one device
the pipeline is the whole model on it: the whole minibatch at once (the baseline itself, 1x)
when that fits, else the fewest micro-batches that do (gradient accumulation).

Only plans that ``tandem train --plan`` runs as written are counted (:mod:`tandem.spec.trainable`:
layouts it accepts, micro-batches that divide a known global batch), and a plan that needs more
memory per device than the cluster's (``--memory``) is no point: both are listed in
``ScaleResult.skipped`` with the reason. The one-device baseline is simulated under the same
limit: when it does not fit (``ScaleResult.single_fits``), the speedups are against a device
with enough memory, a curve has a point on one device only where its own plan fits there,
and ``tandem scale`` says so.

**Every curve is the best plan up to that device count**: the point of a strategy at ``N`` is
the fastest (highest speedup) of its simulations on ``1, 2, 4, ... N`` devices, leaving the
other devices idle when using fewer is faster, so every curve is non-decreasing in ``N``. Such a
point says which count it uses (``ScalePoint.devices_used``; also fewer when the plan itself
leaves devices idle, like a pipeline longer than the model). The simulations at exactly ``N``
devices are kept in ``ScaleResult.simulated``; a strategy's *crossover*, the first device count
at which its communication time per step exceeds its compute time, is read from them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from tandem.cluster import Cluster, Level
from tandem.errors import UsageError
from tandem.plan import Plan
from tandem.planning.search.balance import balanced_plan
from tandem.planning.search.scale_counts import accumulated, micro_plan
from tandem.planning.partition.pipedream import PartitionOptions
from tandem.planning.search.planner import make_plan
from tandem.planning.simulate.simulator import SimOptions, SimResult, data_parallel_plan, simulate
from tandem.planning.simulate.tensor import (
    DEFAULT_MAX_TENSOR_DEGREE,
    grouped_cluster,
    layout_text,
    split_profile,
    tensor_degrees,
)
from tandem.profile import ModelProfile
from tandem.spec.codec import CodecSpec
from tandem.spec.kinds import ScheduleKind
from tandem.spec.sync import SYNC_METHODS, GossipSync, LocalSGDSync, ParameterServerSync, SyncSpec
from tandem.spec.trainable import batch_refusal, layout_refusal

FAMILY_SPECS = (ParameterServerSync, GossipSync, LocalSGDSync)
"""Synchronization families the analysis can draw (each with its defaults, see
:func:`_family_sync`)."""

FAMILIES = tuple(cls.method for cls in FAMILY_SPECS)
"""Their methods' names, as ``--families`` takes them."""


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class ScaleOptions:
    """Which device counts and strategies to analyse."""

    max_devices: int = 1024
    """Largest device count; counts are the powers of two up to it (and it)."""
    compressions: tuple[float | CodecSpec, ...] = (2.0, 32.0)
    """Gradient compressions to show for data parallelism: ratios, or codec specs
    (``topk:ratio=0.01``; a text given is parsed once, here)."""
    microbatches_per_stage: int = 4
    """Pipelines run this many micro-batches per stage and step (bubble ``(S-1)/(M+S-1)``)."""
    batch_samples: int | None = None
    """Global minibatch in samples, when known: no device or micro-batch gets less than one."""
    families: tuple[str, ...] = FAMILIES
    """Synchronization families drawn beside data parallelism and pipelines."""
    ps_servers: int = 1
    """Parameter servers of the ``ps`` curve."""
    period: int = 4
    """Local SGD's averaging period."""
    per_device_batch: int | None = None
    """Weak scaling: samples each training device processes per step, so the global batch grows
    with the devices (``SimOptions.batch_scale`` is then ignored); None: strong scaling, one
    global batch of ``SimOptions.batch_scale`` profile minibatches (``batch_samples`` samples)."""
    max_tensor_degree: int = DEFAULT_MAX_TENSOR_DEGREE
    """Largest tensor degree of the ``3d`` curve; 1: no ``3d`` curve."""

    def __post_init__(self) -> None:
        if isinstance(self.max_tensor_degree, bool) or not isinstance(self.max_tensor_degree, int) \
                or self.max_tensor_degree < 1:
            raise UsageError(f"--max-tensor-degree must be a whole number of at least 1 (got "
                             f"{self.max_tensor_degree!r}); 1 drops the 3d curve")
        unknown = sorted(set(self.families) - set(FAMILIES))
        if unknown:
            raise UsageError(f"--families {unknown[0]!r} is not one of: {', '.join(FAMILIES)} "
                             f"(or none)")
        if self.ps_servers < 1:
            raise UsageError(f"--ps-servers must be at least 1 (got {self.ps_servers})")
        if self.period < 1:
            raise UsageError(f"--period must be at least 1 (got {self.period})")
        if not isinstance(self.max_devices, int) or self.max_devices < 1:
            raise UsageError(f"--max-devices must be at least 1 (got {self.max_devices})")
        ratios = [r for r in self.compressions if not isinstance(r, (str, CodecSpec))]
        if any(not (r >= 1 and math.isfinite(r)) for r in ratios):
            raise UsageError(f"compression ratios must be at least 1 (got {ratios})")
        object.__setattr__(self, "compressions", tuple(  # frozen: codec texts read once, here
            CodecSpec.parse(spec) if isinstance(spec, str) else spec for spec in self.compressions))
        if self.microbatches_per_stage < 1:
            raise UsageError(f"micro-batches per stage must be at least 1 (got {self.microbatches_per_stage})")
        if self.per_device_batch is not None:
            if not isinstance(self.per_device_batch, int) or self.per_device_batch < 1:
                raise UsageError(f"--per-device-batch must be at least 1 sample (got "
                                 f"{self.per_device_batch})")
            if self.batch_samples is not None:
                raise UsageError("give either --per-device-batch (weak scaling) or a global batch "
                                 "(--batch-size or --minibatches: strong scaling), not both")

    @property
    def scaling(self) -> str:
        """``weak`` with a per-device batch, ``strong`` with a fixed global batch."""
        return "strong" if self.per_device_batch is None else "weak"

    def samples(self, workers: int) -> int | None:
        """Samples per step when ``workers`` devices train (None when not known)."""
        if self.per_device_batch is None:
            return self.batch_samples
        return workers * self.per_device_batch


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class ScalePoint:
    """One strategy on one device count."""

    strategy: str
    num_devices: int
    devices_used: int
    """Devices the point's plan occupies: fewer than ``num_devices`` when a plan on fewer devices
    was faster (each curve is the best plan up to its device count) or when the plan itself
    leaves devices idle (a pipeline longer than the model has layers)."""
    config: str
    """The plan (``1024``, ``1-1-1-1``, ``512-324-108-80``, ``4-4 x tensor 8``: each replica on
    8 devices)."""
    step_time_s: float
    speedup: float
    """Throughput (samples per second) relative to the one-device baseline: one device running
    the whole global batch (strong scaling) or the per-device batch (weak scaling)."""
    efficiency: float
    """Scaling efficiency: ``speedup / num_devices`` (idle devices count against it)."""
    batch_scale: float
    """Global batch of one step, in profile minibatches."""
    global_batch: int | None
    """Global batch of one step, in samples (None when the profile's minibatch is unknown)."""
    compute_s: float
    """Compute seconds per step of the busiest worker."""
    communication_s: float
    """Communication seconds per step of the most communicating worker."""


@dataclasses.dataclass(kw_only=True, slots=True)
class ScaleResult:
    """All points, the one-device baseline, and each strategy's crossover."""

    points: list[ScalePoint]
    """Each strategy's best plan up to each device count: non-decreasing speedups."""
    simulated: list[ScalePoint]
    """Each strategy simulated on exactly each device count (what :attr:`points` picks from)."""
    single_step_s: float
    """Step time of the baseline: one device, the whole global batch (strong) or the per-device
    batch (weak)."""
    single_memory_bytes: float = 0.0
    """Peak memory of the baseline's device."""
    single_fits: bool = True
    """Whether the baseline fits the cluster's memory (:attr:`memory_limit_bytes`); when not,
    every speedup is against a device with enough memory, and a curve has a point on one
    device only where another layout fits there (a pipeline of one stage, accumulating)."""
    memory_limit_bytes: float | None = None
    """The cluster's memory per device (None: no limit)."""
    device_counts: list[int]
    skipped: list[str]
    """Points that could not run, with the reason."""
    scaling: str = "strong"
    """``strong`` (fixed global batch) or ``weak`` (fixed per-device batch)."""
    per_device_batch: int | None = None
    """Weak scaling: samples per training device and step."""
    plans: dict[tuple[str, int], Plan] = dataclasses.field(default_factory=dict)
    """The plan of each point of :attr:`simulated`, by ``(strategy, device count)``: what
    ``tandem train --plan`` runs for it."""

    def strategies(self) -> list[str]:
        """Strategy names in the order they were analysed."""
        return list(dict.fromkeys(point.strategy for point in self.simulated))

    def series(self, label: str) -> list[ScalePoint]:
        """The points of one curve (a strategy's label, e.g. ``dp`` or ``ps``), in order."""
        return by_curve(self.points).get(label, [])

    def simulated_series(self, label: str) -> list[ScalePoint]:
        """One strategy's simulations on exactly each device count, in order."""
        return by_curve(self.simulated).get(label, [])

    @property
    def crossover(self) -> dict[str, int | None]:
        """Per strategy, the first device count whose communication exceeds its compute (on
        exactly that many devices)."""
        return {name: next((p.num_devices for p in self.simulated_series(name)
                            if p.communication_s > p.compute_s), None)
                for name in self.strategies()}


def device_counts(max_devices: int) -> list[int]:
    """1, 2, 4, ... up to ``max_devices`` (included)."""
    counts = [2**k for k in range(max_devices.bit_length()) if 2**k <= max_devices]
    return counts if counts[-1] == max_devices else [*counts, max_devices]


def resized(cluster: Cluster, num_devices: int) -> Cluster:
    """``cluster`` with ``num_devices`` devices: inner levels filled first, the outermost grown."""
    levels, remaining = [], num_devices
    for index, level in enumerate(cluster.levels):
        last = index == len(cluster.levels) - 1
        count = remaining if last else min(level.num_units, remaining)
        if not last and remaining % count:
            count = math.gcd(count, remaining)
        levels.append(Level(num_units=count, bandwidth_Bps=level.bandwidth_Bps,
                            latency_s=level.latency_s))
        remaining //= count
    return dataclasses.replace(cluster, levels=tuple(levels), name=f"{num_devices} devices")


def scale(profile: ModelProfile, cluster: Cluster, options: ScaleOptions | None = None,
          sim: SimOptions | None = None) -> ScaleResult:
    """Simulate every strategy on every device count; see the module docstring."""
    options = options or ScaleOptions()
    sim = dataclasses.replace(sim or SimOptions(), record=False)
    batch = _batch_scales(profile, options, sim)
    counts = device_counts(options.max_devices)
    baseline = simulate(data_parallel_plan(profile, 1), profile, resized(cluster, 1),
                        dataclasses.replace(sim, batch_scale=batch(1)))
    single = baseline.step_time_s
    result = ScaleResult(points=[], simulated=[], single_step_s=single, device_counts=counts,
                         skipped=[], scaling=options.scaling,
                         per_device_batch=options.per_device_batch,
                         single_memory_bytes=baseline.peak_memory_bytes,
                         single_fits=baseline.fits_memory,
                         memory_limit_bytes=baseline.memory_limit_bytes)
    for n in counts:
        sized = resized(cluster, n)
        for name, plan, options_n in _strategies(profile, sized, n, options, sim, batch):
            if isinstance(plan, str):
                result.skipped.append(f"{name} on {n}: {plan}")
                continue
            trained = plan.num_workers - plan.num_servers
            options_n = dataclasses.replace(options_n, batch_scale=batch(trained))
            outcome = simulate(plan, profile, sized, options_n)
            if not outcome.fits_memory:
                assert outcome.memory_limit_bytes is not None  # no limit: everything fits
                result.skipped.append(
                    f"{name} on {n}: {layout_text(plan)} needs "
                    f"{outcome.peak_memory_bytes / 1e9:.3g} GB per device, over the limit of "
                    f"{outcome.memory_limit_bytes / 1e9:g} GB")
                continue
            speedup = (options_n.batch_scale / outcome.step_time_s) / (batch(1) / single)
            result.plans[name, n] = plan
            result.simulated.append(ScalePoint(
                strategy=name, num_devices=n, devices_used=plan.num_workers,
                config=layout_text(plan),
                step_time_s=outcome.step_time_s, speedup=speedup, efficiency=speedup / n,
                batch_scale=options_n.batch_scale, global_batch=options.samples(trained),
                compute_s=outcome.compute_s, communication_s=outcome.communication_s))
    result.points = best_so_far(result.simulated, counts)
    return result


def by_curve(points: list[ScalePoint]) -> dict[str, list[ScalePoint]]:
    """Points grouped by their curve's label, curves and points in their order."""
    curves: dict[str, list[ScalePoint]] = {}
    for point in points:
        curves.setdefault(point.strategy, []).append(point)
    return curves


def best_so_far(simulated: list[ScalePoint], counts: list[int]) -> list[ScalePoint]:
    """Each strategy's fastest point on at most ``N`` devices, for every ``N`` of ``counts``
    from its first point on (labelled ``N``; its efficiency counts the idle devices), ordered
    by device count. A count a strategy was skipped at keeps the best point before it."""
    curves: list[ScalePoint] = []
    for series in by_curve(simulated).values():
        at = {point.num_devices: point for point in series}
        held: ScalePoint | None = None
        for n in counts:
            point = at.get(n)
            if point is not None and (held is None or point.speedup > held.speedup):
                held = point
            if held is not None:
                curves.append(dataclasses.replace(held, num_devices=n, efficiency=held.speedup / n))
    return sorted(curves, key=lambda point: point.num_devices)


def _batch_scales(profile: ModelProfile, options: ScaleOptions,
                  sim: SimOptions) -> Callable[[int], float]:
    """``workers -> global batch in profile minibatches`` of the options' scaling mode."""
    per_device = options.per_device_batch
    if per_device is None:
        return lambda workers: sim.batch_scale
    if not profile.batch_size:
        raise UsageError(f"--per-device-batch {per_device} counts samples, but the profile does "
                         f"not record the minibatch it was measured at: add --profile-batch N")
    measured = profile.batch_size
    return lambda workers: workers * per_device / measured


def _strategies(profile: ModelProfile, cluster: Cluster, n: int, options: ScaleOptions,
                sim: SimOptions, batch_scale_of: Callable[[int], float],
                ) -> list[tuple[str, Plan | str, SimOptions]]:
    """``(name, plan or the reason it cannot run, simulation options)`` for ``n`` devices."""
    batch = options.samples(n)
    too_few = f"fewer samples ({batch}) than devices" if batch is not None and batch < n else ""
    dp = too_few or _runnable(data_parallel_plan(profile, n), options)
    strategies: list[tuple[str, Plan | str, SimOptions]] = [("dp", dp, sim)]
    for ratio in options.compressions:
        if isinstance(ratio, CodecSpec):
            strategies.append((f"dp+{ratio.text}", dp, dataclasses.replace(sim, compress=ratio)))
            continue
        strategies.append((f"dp+{ratio:g}x", dp, dataclasses.replace(
            sim, gradient_compression=sim.gradient_compression * ratio)))
    choose = _Chooser(profile, cluster, sim, batch_scale_of)
    stages = min(n, profile.num_layers)
    straight = balanced_plan(profile, [1] * stages, schedule=ScheduleKind.ONE_F_ONE_B,
                             num_microbatches=None)
    strategies.append(("pipeline", _micro(straight, options) if stages > 1 else accumulated(
        straight, options.samples(1), options.microbatches_per_stage, choose.fastest), sim))
    planning = dataclasses.replace(sim, batch_scale=batch_scale_of(n))  # the planner's batch
    hybrid, reasons = _hybrid_candidates(profile, cluster, options, planning, dp)
    strategies.append(("hybrid", choose.fastest(hybrid) if hybrid else reasons[0], sim))
    if options.max_tensor_degree > 1:
        three_d, more = _three_d_candidates(profile, cluster, options, planning)
        plans = hybrid + three_d
        strategies.append(("3d", choose.fastest(plans) if plans else (reasons + more)[0], sim))
    strategies += [(name, _family(name, profile, n, options), sim) for name in options.families]
    return strategies


def _hybrid_candidates(profile: ModelProfile, cluster: Cluster, options: ScaleOptions,
                       sim: SimOptions, dp: Plan | str) -> tuple[list[Plan], list[str]]:
    """The plans ``hybrid`` picks from (the planner's, as it is and at the pipelines'
    micro-batches, and ``dp``'s), those that ``tandem train`` runs; and why others are not."""
    plans: list[Plan] = [] if isinstance(dp, str) else [dp]
    reasons: list[str] = [dp] if isinstance(dp, str) else []
    try:
        planned = make_plan(profile, cluster, PartitionOptions(), sim=sim)
    except UsageError as exc:
        return plans, [*reasons, str(exc)]
    for plan in (_runnable(planned, options), _micro(planned, options)):
        if isinstance(plan, str):
            reasons.append(plan)
        elif all(plan != other for other in plans):
            plans.append(plan)
    return plans, reasons


def _three_d_candidates(profile: ModelProfile, cluster: Cluster, options: ScaleOptions,
                        sim: SimOptions) -> tuple[list[Plan], list[str]]:
    """Per tensor degree ``T > 1`` (see the module docstring): data parallelism over groups of
    ``T`` devices and the partitioner's plan for those groups, those ``tandem train`` runs."""
    plans: list[Plan] = []
    reasons: list[str] = []
    for degree in tensor_degrees(cluster, options.max_tensor_degree)[1:]:
        groups = cluster.num_devices // degree
        found: list[Plan | str] = [dataclasses.replace(
            data_parallel_plan(profile, groups), num_devices=cluster.num_devices,
            tensor_degree=degree)]
        try:
            split = make_plan(split_profile(profile, degree), grouped_cluster(cluster, degree),
                              PartitionOptions(), sim=sim)
            stages = [dataclasses.replace(stage, devices=None if stage.devices is None
                                          else [d * degree for d in stage.devices])
                      for stage in split.stages]
            found.append(_micro(dataclasses.replace(
                split, stages=stages, num_devices=cluster.num_devices, tensor_degree=degree,
                candidates=[]), options))
        except UsageError as exc:
            reasons.append(str(exc))
        for checked in (p if isinstance(p, str) else _runnable(p, options) for p in found):
            if isinstance(checked, str):
                reasons.append(checked)
            else:
                plans.append(checked)
    return plans, reasons


@dataclasses.dataclass(slots=True)
class _Chooser:
    """Picks the fastest plan per profile minibatch, preferring those that fit in memory."""

    profile: ModelProfile
    cluster: Cluster
    sim: SimOptions
    batch: Callable[[int], float]

    def fastest(self, plans: list[Plan]) -> Plan:
        results = [(simulate(plan, self.profile, self.cluster, dataclasses.replace(
            self.sim, batch_scale=self.batch(plan.num_workers - plan.num_servers))), plan)
            for plan in plans]
        fitting = [pair for pair in results if pair[0].fits_memory] or results
        return min(fitting, key=lambda pair: _seconds_per_minibatch(pair, self.batch))[1]


def _runnable(plan: Plan, options: ScaleOptions) -> Plan | str:
    """``plan``, or why ``tandem train --plan`` would refuse it (its layout, or micro-batches
    that do not divide the step's samples)."""
    samples = options.samples(plan.num_workers - plan.num_servers)
    refusal = layout_refusal(plan) or batch_refusal(plan, samples)
    return plan if refusal is None else f"{layout_text(plan)}: tandem train refuses it: {refusal}"


def _seconds_per_minibatch(pair: tuple[SimResult, Plan], batch: Callable[[int], float]) -> float:
    """Step time per profile minibatch of a simulated plan (weak scaling: batches differ)."""
    result, plan = pair
    return result.step_time_s / batch(plan.num_workers - plan.num_servers)


def _family(name: str, profile: ModelProfile, n: int, options: ScaleOptions) -> Plan | str:
    """A one-stage plan on ``n`` devices synchronized by ``name`` (or why it cannot run)."""
    sync = _family_sync(SYNC_METHODS[name], options)
    servers = sync.num_servers
    workers = n - servers
    if workers < 1:
        return f"{servers} server(s) leave no worker"
    samples = options.samples(workers)
    if samples is not None and samples < workers:
        return f"fewer samples ({samples}) than workers"
    return _runnable(dataclasses.replace(data_parallel_plan(profile, workers), num_devices=n,
                                         sync=sync), options)


def _family_sync(cls: type[SyncSpec], options: ScaleOptions) -> SyncSpec:
    """The spec of family ``cls`` that the analysis draws: ``--ps-servers`` servers, local SGD
    every ``--period`` steps, gossip on a ring (each spec takes the options its flags name)."""
    given: dict[str, Any] = {"--servers": options.ps_servers, "--period": options.period}
    spec: SyncSpec = cls(**{field: given[flag] for flag, field in cls.FLAGS.items()
                            if flag in given})
    return spec


def _micro(plan: Plan, options: ScaleOptions) -> Plan | str:
    """``plan`` on 1F1B with the options' micro-batches per stage (:func:`micro_plan`)."""
    return micro_plan(plan, options.samples(plan.num_workers - plan.num_servers),
                      options.microbatches_per_stage)
