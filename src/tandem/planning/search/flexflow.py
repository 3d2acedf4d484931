"""Strategy search in the manner of FlexFlow: Metropolis–Hastings with the simulator as cost.

Usage::

    found = search(profile, cluster, SearchOptions(budget_s=30))
    found.best.plan.config, found.best.result.step_time_s, found.data_parallel.step_time_s

A strategy is a plan: stage boundaries along a layer order, replicas per stage (devices may be
left idle), a tensor degree (each replica on that many adjacent devices), recomputation on or
off, a schedule (GPipe, 1F1B, PipeDream) and micro-batches per step. Each iteration proposes a
small random change — move a boundary, split or merge stages, move a replica, change the tensor
degree (the replicas rescaled to the devices), turn recomputation on or off, change the schedule
or the micro-batches — simulates it, and accepts it with probability
``min(1, exp(-(new - current) / (temperature * current)))`` on step time. A plan whose peak
memory exceeds the devices' is never reported; the chain may pass through one at a cost raised
by how far it overflows. Only plans that ``tandem train --plan`` runs as written are
simulated (:mod:`tandem.spec.trainable`: layouts it accepts, micro-batches that divide a known
batch), and only those that train as data parallelism does (one update of the whole minibatch
per step) may be the answer: a PipeDream plan with replicated stages averages several minibatches
per update, a different training run, so the fastest such plan is reported apart
(:attr:`SearchResult.apart`) and never as faster. Chains start from data parallelism and from the partitioner's plan
(and from a balanced straight pipeline, and data parallelism at the largest tensor degree when
tensor degrees are searched), share the budget in turns, and the best plan any chain
has seen is the answer — so it is never slower than either starting point. When data
parallelism does not fit the memory limit, its sharded forms
(:func:`~tandem.planning.simulate.sharded.sharded_plans`) are weighed too. With
:attr:`SearchOptions.staleness_cost` (``--objective time-to-accuracy``) a plan whose gradients
are stale (a PipeDream pipeline) costs its step time times the steps it is predicted to lose.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Callable

from tandem.cluster import Cluster
from tandem.errors import UsageError
from tandem.plan import Plan, Stage
from tandem.planning.search.balance import balanced_bounds, layer_order
from tandem.planning.simulate.sharded import sharded_plans
from tandem.planning.simulate.simulator import SimOptions, SimResult, data_parallel_plan, simulate
from tandem.planning.simulate.tensor import DEFAULT_MAX_TENSOR_DEGREE, tensor_degrees
from tandem.profile import ModelProfile
from tandem.schedule import SCHEDULE_KINDS
from tandem.spec.kinds import ScheduleKind
from tandem.spec.trainable import batch_refusal, layout_refusal, staleness, update_change

OVERFLOW_PENALTY = 10.0
"""A plan overflowing memory by a fraction ``x`` costs ``(1 + 10 x)`` times its step time."""


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class SearchOptions:
    """Budget and moves of the search."""

    budget_s: float = 30.0
    """Wall-clock seconds to search."""
    max_iterations: int | None = None
    """Stop after this many proposals (for repeatable runs); None: only the budget."""
    seed: int = 0
    temperature: float = 0.03
    """Relative slowdown accepted with probability 1/e."""
    schedules: tuple[ScheduleKind, ...] = tuple(ScheduleKind)
    """Schedules the search may choose (names given are read into kinds)."""
    max_microbatches: int = 64
    batch_samples: int | None = None
    """Global minibatch in samples, when known: micro-batch counts must divide it."""
    max_tensor_degree: int = DEFAULT_MAX_TENSOR_DEGREE
    """Largest tensor degree to try; degrees are the divisors of the device count up to it that
    divide a server (:func:`tandem.planning.simulate.tensor.tensor_degrees`); 1: no tensor parallelism."""
    recompute: bool = True
    """Try activation recomputation as well (False: never)."""
    staleness_cost: float = 0.0
    """Weigh a plan whose gradients are ``d`` updates stale (:func:`staleness`: PipeDream) at
    ``(1 + staleness_cost d)`` times its step time, the steps it is predicted to lose
    (``--objective time-to-accuracy``); 0: step time alone."""

    def __post_init__(self) -> None:
        if isinstance(self.max_tensor_degree, bool) or not isinstance(self.max_tensor_degree, int) \
                or self.max_tensor_degree < 1:
            raise UsageError(f"--max-tensor-degree must be a whole number of at least 1 (got "
                             f"{self.max_tensor_degree!r}); 1 turns tensor parallelism off")
        if not self.budget_s > 0:
            raise UsageError(f"--budget must be positive (got {self.budget_s} s)")
        if self.max_iterations is not None and self.max_iterations < 0:
            raise UsageError(f"--iterations must not be negative (got {self.max_iterations})")
        if not self.temperature > 0:
            raise UsageError(f"--temperature must be positive (got {self.temperature})")
        unknown = set(self.schedules) - set(SCHEDULE_KINDS)
        if unknown or not self.schedules:
            raise UsageError(f"unknown schedule {sorted(unknown)} (known: {', '.join(SCHEDULE_KINDS)})")
        object.__setattr__(self, "schedules", tuple(ScheduleKind(name) for name in self.schedules))


@dataclasses.dataclass(frozen=True, slots=True)
class Strategy:
    """A point of the search space (hashable: simulated once)."""

    order: tuple[int, ...]
    """Layer order the stages cut (topological)."""
    ends: tuple[int, ...]
    """End position of each stage (exclusive); the last is the number of layers."""
    replicas: tuple[int, ...]
    schedule: ScheduleKind
    microbatches: int
    tensor: int = 1
    """Tensor degree: devices per replica."""
    recompute: bool = False

    def plan(self, num_devices: int) -> Plan:
        """The plan of this point; a one-stage 1F1B plan (data parallelism) gets its micro-batch
        count rounded up to a multiple of its replicas, which share them round-robin."""
        starts = (0, *self.ends[:-1])
        count = self.microbatches
        if len(self.replicas) == 1 and self.schedule.accumulates:
            count = -(-count // self.replicas[0]) * self.replicas[0]
        identity = self.order == tuple(range(len(self.order)))
        return Plan(stages=[Stage(start=s, end=e, replicas=r)
                            for s, e, r in zip(starts, self.ends, self.replicas)],
                    num_layers=len(self.order), num_devices=num_devices,
                    layer_order=None if identity else list(self.order), schedule=self.schedule,
                    num_microbatches=None if self.schedule.whole_minibatches else count,
                    tensor_degree=self.tensor, recompute=self.recompute)


@dataclasses.dataclass(kw_only=True, slots=True)
class Candidate:
    """A simulated plan."""

    plan: Plan
    result: SimResult
    note: str = ""
    """Why the plan is not comparable with data parallelism (``tandem train`` refuses it, or its
    updates differ: :mod:`tandem.spec.trainable`); empty when it runs as the same training."""


@dataclasses.dataclass(kw_only=True, slots=True)
class SearchResult:
    """The best plan found, the two references, and how the search went."""

    best: Candidate
    data_parallel: Candidate | None
    """Data parallelism on every device (None if it cannot run: see :attr:`data_parallel_refusal`)."""
    partitioner: Candidate | None
    """PipeDream's partitioner's plan, simulated as it is (None if it has none)."""
    iterations: int
    accepted: int
    elapsed_s: float
    evaluated: int
    """Distinct strategies simulated."""
    trace: list[tuple[int, float]]
    """``(iteration, best step time)`` each time the best improved."""
    apart: Candidate | None = None
    """The fastest plan seen that fits but trains differently (its :attr:`Candidate.note` says
    how), never the answer; None when the search met none faster than the best."""
    data_parallel_refusal: str = ""
    """Why ``tandem train`` would refuse data parallelism on every device (e.g. the batch does
    not split among them); empty when it runs it."""


def search(profile: ModelProfile, cluster: Cluster, options: SearchOptions | None = None,
           sim: SimOptions | None = None, partitioner_plan: Plan | None = None) -> SearchResult:
    """Search plans for ``profile`` on ``cluster``; see the module docstring."""
    options = options or SearchOptions()
    sim = dataclasses.replace(sim or SimOptions(), record=False)
    return _Search(profile, cluster, options, sim).run(partitioner_plan)


class _Search:
    def __init__(self, profile: ModelProfile, cluster: Cluster, options: SearchOptions,
                 sim: SimOptions) -> None:
        self.profile, self.cluster, self.options, self.sim = profile, cluster, options, sim
        self.num_devices = cluster.num_devices
        self.degrees = tensor_degrees(cluster, options.max_tensor_degree)
        self.random = random.Random(options.seed)
        self.cache: dict[Strategy, tuple[float, Candidate | None]] = {}
        self.best: tuple[float, Candidate] | None = None
        self.apart: tuple[float, Candidate] | None = None
        self.refused: dict[Strategy, str] = {}
        self.trace: list[tuple[int, float]] = []
        self.iteration = 0

    # -- cost ----------------------------------------------------------------------------------

    def cost(self, strategy: Strategy) -> float:
        """Step time, raised for memory overflow; inf for a plan that cannot run."""
        if strategy.schedule.whole_minibatches:  # no micro-batch count
            strategy = dataclasses.replace(strategy, microbatches=0)
        if strategy not in self.cache:
            self.cache[strategy] = self._evaluate(strategy)
        value, candidate = self.cache[strategy]
        if candidate is not None:
            self._offer(value, candidate)
        return value if candidate is None else self._penalized(candidate)

    def _offer(self, value: float, candidate: Candidate) -> None:
        """Keep ``candidate`` as the best (or the fastest apart) if it fits and is faster."""
        if not candidate.result.fits_memory:
            return
        if candidate.note:
            if self.apart is None or value < self.apart[0]:
                self.apart = (value, candidate)
        elif self.best is None or value < self.best[0]:
            self.best = (value, candidate)
            self.trace.append((self.iteration, value))

    def _evaluate(self, strategy: Strategy) -> tuple[float, Candidate | None]:
        plan = strategy.plan(self.num_devices)
        refusal = layout_refusal(plan) or batch_refusal(plan, self.options.batch_samples)
        if refusal is not None:  # tandem train would not run it: not worth simulating
            self.refused[strategy] = refusal
            return math.inf, None
        try:
            result = simulate(plan, self.profile, self.cluster, self.sim)
        except UsageError:
            return math.inf, None
        return result.step_time_s * self._weight(plan), Candidate(
            plan=plan, result=result, note=update_change(plan) or "")

    def _weight(self, plan: Plan) -> float:
        """What multiplies ``plan``'s step time for its staleness (1 without a cost)."""
        return 1.0 + self.options.staleness_cost * staleness(plan)

    def _penalized(self, candidate: Candidate) -> float:
        result = candidate.result
        weighted = result.step_time_s * self._weight(candidate.plan)
        if result.fits_memory or result.memory_limit_bytes is None:
            return weighted
        overflow = result.peak_memory_bytes / result.memory_limit_bytes - 1
        return weighted * (1 + OVERFLOW_PENALTY * overflow)

    # -- chains --------------------------------------------------------------------------------

    def run(self, partitioner_plan: Plan | None) -> SearchResult:
        started = time.perf_counter()
        order = tuple(layer_order(self.profile))
        dp = self._dp_strategy(order, self.num_devices)
        starts = [dp, self._straight(order)]
        if partitioner_plan is not None:
            starts.insert(1, self._from_plan(partitioner_plan))
        if self.degrees[-1] > 1:  # the least memory per device
            starts.append(self._repair(self._retensored(dp, self.degrees[-1])))
        chains = [(s, self.cost(s)) for s in starts if s is not None]
        if dp in self.refused:  # e.g. the batch does not split among every device
            narrower = self._dp_strategy(order, self._dp_width())
            chains.append((narrower, self.cost(narrower)))
        dp_candidate = self.cache[dp][1] if dp in self.cache else None
        part_candidate = self._as_is(partitioner_plan)
        accepted = 0
        limit = self.options.max_iterations
        deadline = started + self.options.budget_s
        while (limit is None or self.iteration < limit) and time.perf_counter() < deadline:
            index = self.iteration % len(chains)
            current, current_cost = chains[index]
            self.iteration += 1
            proposal = self.propose(current)
            if proposal is None:
                continue
            value = self.cost(proposal)
            if self._accept(current_cost, value):
                chains[index] = (proposal, value)
                accepted += 1
        if dp_candidate is None or not dp_candidate.result.fits_memory:  # memory forces it
            sharded = self._sharded(dp)
            if sharded is not None and (self.best is None or sharded[0] < self.best[0]):
                self.best = sharded
        if self.best is None:
            memory = self.cluster.memory_bytes
            where = ("that tandem train runs as written" if memory is None
                     else f"fits in {memory / 1e9:g} GB per device")
            raise UsageError(
                f"no plan {where} on {self.num_devices} devices (among those that train as data "
                f"parallelism does): raise --memory, add devices, use a smaller batch or a "
                f"longer --budget")
        apart = self.apart[1] if self.apart and self.apart[0] < self.best[0] else None
        return SearchResult(best=self.best[1], data_parallel=dp_candidate,
                            partitioner=part_candidate, iterations=self.iteration,
                            accepted=accepted, elapsed_s=time.perf_counter() - started,
                            evaluated=len(self.cache), trace=self.trace, apart=apart,
                            data_parallel_refusal=self.refused.get(dp, ""))

    def _sharded(self, dp: Strategy) -> tuple[float, Candidate] | None:
        """The fastest sharded data-parallel plan that fits (:func:`sharded_plans`), if any."""
        fitting = []
        for plan in sharded_plans(dp.plan(self.num_devices), self.cluster):
            refusal = batch_refusal(plan, self.options.batch_samples)
            try:
                result = simulate(plan, self.profile, self.cluster, self.sim)
            except UsageError:
                continue
            if refusal is None and result.fits_memory:
                fitting.append((result.step_time_s, Candidate(plan=plan, result=result)))
        return min(fitting, key=lambda pair: pair[0], default=None)

    def _accept(self, current: float, value: float) -> bool:
        if value <= current:
            return True
        if not math.isfinite(value) or not math.isfinite(current):
            return not math.isfinite(current)
        return self.random.random() < math.exp(-(value - current) / (self.options.temperature * current))

    def _as_is(self, plan: Plan | None) -> Candidate | None:
        """The partitioner's plan simulated exactly as it was written (the answer only if
        ``tandem train`` runs it and it trains as data parallelism does)."""
        if plan is None:
            return None
        try:
            result = simulate(plan, self.profile, self.cluster, self.sim)
        except UsageError:
            return None
        refusal = layout_refusal(plan) or batch_refusal(plan, self.options.batch_samples)
        note = f"tandem train refuses it: {refusal}" if refusal else update_change(plan) or ""
        candidate = Candidate(plan=plan, result=result, note=note)
        if not refusal:
            self._offer(result.step_time_s * self._weight(plan), candidate)
        return candidate

    # -- starting points -------------------------------------------------------------------------

    def _dp_strategy(self, order: tuple[int, ...], replicas: int) -> Strategy:
        plan = data_parallel_plan(self.profile, replicas)
        return Strategy(order=order, ends=(len(order),), replicas=(replicas,),
                        schedule=plan.schedule, microbatches=plan.num_microbatches or replicas)

    def _dp_width(self) -> int:
        """Most data-parallel replicas among which a known batch splits evenly."""
        batch = self.options.batch_samples
        return max(r for r in range(1, self.num_devices + 1) if batch is None or batch % r == 0)

    def _from_plan(self, plan: Plan) -> Strategy | None:
        replicas = tuple(stage.replicas for stage in plan.stages)
        schedule = plan.schedule if plan.schedule in self.options.schedules else self.options.schedules[0]
        count = plan.num_microbatches or 1
        return self._repair(Strategy(order=tuple(plan.layers()), ends=tuple(s.end for s in plan.stages),
                                     replicas=replicas, schedule=schedule, microbatches=count,
                                     tensor=plan.tensor_degree, recompute=plan.recompute))

    def _straight(self, order: tuple[int, ...]) -> Strategy | None:
        stages = min(self.num_devices, len(order))
        times = [self.profile.layers[layer].compute_s for layer in order]
        bounds = balanced_bounds(times, [1] * stages)
        flush = ScheduleKind.ONE_F_ONE_B
        schedule = flush if flush in self.options.schedules else self.options.schedules[0]
        return self._repair(Strategy(order=order, ends=tuple(e for _, e in bounds),
                                     replicas=(1,) * stages, schedule=schedule,
                                     microbatches=2 * stages))

    # -- proposals -------------------------------------------------------------------------------

    def propose(self, current: Strategy) -> Strategy | None:
        """A random neighbour of ``current`` (None when the drawn move does not apply)."""
        moves: list[Callable[[Strategy], Strategy | None]] = [
            self._shift, self._split, self._merge, self._move_replica, self._schedule,
            self._microbatches]
        if len(self.degrees) > 1:
            moves.append(self._tensor)
        if self.options.recompute:
            moves.append(self._recompute)
        proposal = self.random.choice(moves)(current)
        return None if proposal is None or proposal == current else self._repair(proposal)

    def _shift(self, s: Strategy) -> Strategy | None:
        if len(s.ends) < 2:
            return None
        index = self.random.randrange(len(s.ends) - 1)
        low = s.ends[index - 1] + 1 if index else 1
        high = s.ends[index + 1] - 1
        step = max(1, int(self.random.expovariate(0.5)))
        moved = s.ends[index] + self.random.choice((-step, step))
        if not low <= moved <= high:
            return None
        ends = s.ends[:index] + (moved,) + s.ends[index + 1:]
        return dataclasses.replace(s, ends=ends)

    def _split(self, s: Strategy) -> Strategy | None:
        index = self.random.randrange(len(s.ends))
        start = s.ends[index - 1] if index else 0
        if s.ends[index] - start < 2:
            return None
        cut = self.random.randrange(start + 1, s.ends[index])
        count, idle = s.replicas[index], self._groups(s) - sum(s.replicas)
        if count >= 2:
            first = self.random.randrange(1, count)
            pair = (first, count - first)
        elif idle >= 1:
            pair = (1, 1)
        else:
            return None
        return dataclasses.replace(s, ends=s.ends[:index] + (cut,) + s.ends[index:],
                                   replicas=s.replicas[:index] + pair + s.replicas[index + 1:])

    def _merge(self, s: Strategy) -> Strategy | None:
        if len(s.ends) < 2:
            return None
        index = self.random.randrange(len(s.ends) - 1)
        merged = s.replicas[index] + s.replicas[index + 1]
        return dataclasses.replace(s, ends=s.ends[:index] + s.ends[index + 1:],
                                   replicas=s.replicas[:index] + (merged,) + s.replicas[index + 2:])

    def _move_replica(self, s: Strategy) -> Strategy | None:
        replicas = list(s.replicas)
        idle = self._groups(s) - sum(replicas)
        sources = [i for i, r in enumerate(replicas) if r > 1] + ([-1] if idle else [])
        if not sources:
            return None
        source = self.random.choice(sources)
        target = self.random.choice([i for i in range(-1, len(replicas)) if i != source])
        if target == -1 and source == -1:
            return None
        if source >= 0:
            replicas[source] -= 1
        if target >= 0:
            replicas[target] += 1
        return dataclasses.replace(s, replicas=tuple(replicas))

    def _groups(self, s: Strategy) -> int:
        """Stage replicas the devices hold at ``s``'s tensor degree."""
        return self.num_devices // s.tensor

    def _tensor(self, s: Strategy) -> Strategy | None:
        return self._retensored(s, self.random.choice([t for t in self.degrees if t != s.tensor]))

    def _retensored(self, s: Strategy, degree: int) -> Strategy | None:
        """``s`` at tensor ``degree``, every stage's replicas scaled by the ratio of degrees
        (at least 1 each); None when its stages do not fit the devices then."""
        replicas = tuple(max(1, r * s.tensor // degree) for r in s.replicas)
        if sum(replicas) * degree > self.num_devices:
            return None
        return dataclasses.replace(s, tensor=degree, replicas=replicas)

    def _recompute(self, s: Strategy) -> Strategy | None:
        return dataclasses.replace(s, recompute=not s.recompute)

    def _schedule(self, s: Strategy) -> Strategy | None:
        others = [k for k in self.options.schedules if k != s.schedule]
        return dataclasses.replace(s, schedule=self.random.choice(others)) if others else None

    def _microbatches(self, s: Strategy) -> Strategy | None:
        if s.schedule.whole_minibatches:
            return None
        choices = self._counts()
        position = min(range(len(choices)), key=lambda i: abs(choices[i] - s.microbatches))
        position += self.random.choice((-2, -1, 1, 2))
        if not 0 <= position < len(choices):
            return None
        return dataclasses.replace(s, microbatches=choices[position])

    def _counts(self) -> list[int]:
        """Micro-batch counts allowed: divisors of the batch (when known) up to the maximum."""
        top = self.options.max_microbatches
        batch = self.options.batch_samples
        return [m for m in range(1, top + 1) if batch is None or batch % m == 0]

    def _repair(self, s: Strategy | None) -> Strategy | None:
        """Raise the micro-batches to what the schedule needs; None if impossible."""
        if s is None or s.schedule.whole_minibatches:
            return s
        needed = (max(s.replicas) if s.schedule.forwards_first
                  else max(len(s.ends), max(s.replicas)))
        if s.microbatches >= needed:
            return s
        fits = [m for m in self._counts() if m >= needed]
        if not fits and self.options.batch_samples is not None:
            return None
        return dataclasses.replace(s, microbatches=fits[0] if fits else needed)
