"""Time to a target loss of a plan at a batch size: its simulated time per step times the steps
McCandlish et al.'s noise-scale model predicts for that batch, and for the plan's staleness.

Usage::

    model = StepsModel(target_loss=0.3, reference_batch=32, reference_steps=118.0,
                       noise_scale=25.0, lr=0.05)
    model.steps(256)                    # S_min (1 + B_noise/256)
    model.steps(256, staleness=3, kind="ps")   # times (1 + 0.36 * 3)
    timed = time_to_target(candidate, 256, model)
    timed.step_time_s, timed.predicted_steps, timed.time_to_target_s

The steps (McCandlish, Kaplan, Amodei et al., "An Empirical Model of Large-Batch Training",
2018, eq. 2.11): a run at batch ``B`` reaches a loss in ``S(B) = S_min (1 + B_noise / B)``
steps, each step at the learning rate that the same model gives,
``lr_B = lr (1 + B_noise/B0) / (1 + B_noise/B)`` for the ``lr`` used at ``B0``
(``--lr-scaling auto``'s factor). One measured point fixes ``S_min``: the steps ``S0`` the
measuring run took to the target at its batch ``B0``, ``S_min = S0 / (1 + B_noise/B0)``.

Staleness: an asynchronous plan computes each update on weights some updates old (``d``:
``W - 1`` for ``W`` asynchronous parameter-server workers, ``S - 1`` for PipeDream's ``S``
stages, the delays that :mod:`tandem.runtime.asynchrony` compensates); each unit of it costs a
measured fraction ``c`` more steps, ``S(B) (1 + c d)``, with ``c`` measured for each kind of
stale plan (:data:`STALENESS_COSTS`, by ``benchmarks/time_to_accuracy.py``).

What it does not model: the learning rate's own limits (a rate scaled past where training is
stable takes more steps, not fewer), a noise scale that changes between the measurement and the
target, warm-up, and the convergence of gossip, local SGD and EASGD (their workers disagree;
no staleness describes them).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from tandem.errors import UsageError
from tandem.plan import Plan
from tandem.planning.search.flexflow import Candidate
from tandem.spec.kinds import ScheduleKind
from tandem.spec.trainable import staleness

STALENESS_COSTS = {"ps": 0.36, str(ScheduleKind.PIPEDREAM): 0.62}
"""More steps per unit of staleness, as a fraction, for each kind of stale plan
(:func:`stale_kind`), measured on digits with the default compensation
(``benchmarks/time_to_accuracy.py``, docs/benchmarks.md: steps to loss 0.3 at batch 64, 3 seeds,
against dp, at c4cb855: the mlp's He initialization, the servers' numbered updates and
momentum): 4 asynchronous parameter-server workers took 2.08x dp's steps (staleness 3: 0.36 a
unit; the mean of two runs, 0.370 and 0.352: asynchronous runs differ between runs), a 4-stage
PipeDream pipeline 2.86x (0.62 a unit, the same in both). Before He's initialization, 0.17 and
0.47: dp took 91-102 steps then, about half of them on the initial plateau, against 32-41 now,
while the servers' extra steps changed less (36-49 then, 31-47 now)."""


def stale_kind(plan: Plan) -> str:
    """Which :data:`STALENESS_COSTS` applies to ``plan``: ``pipedream`` for a pipeline,
    ``ps`` otherwise (only asynchronous servers are stale there)."""
    return str(ScheduleKind.PIPEDREAM) if plan.pipelined else "ps"


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class StepsModel:
    """Steps to :attr:`target_loss` at any batch, from one measured point and the noise scale."""

    target_loss: float
    """The training loss to reach (the mean loss of a metrics line, as ``tandem train`` logs it)."""
    reference_batch: int
    """The global batch ``B0`` of the measured point."""
    reference_steps: float
    """Optimizer steps the measuring run took to :attr:`target_loss` at ``B0``."""
    noise_scale: float
    """The gradient noise scale ``B_noise`` (tandem measures ``B_simple``)."""
    lr: float | None = None
    """The learning rate of the measuring run at ``B0`` (None: not known)."""
    staleness_costs: dict[str, float] = dataclasses.field(
        default_factory=lambda: dict(STALENESS_COSTS))
    """More steps per unit of staleness, as a fraction, by kind (:data:`STALENESS_COSTS`)."""
    source: str = ""
    """Where the numbers come from (a measuring run, a file), in words."""

    def __post_init__(self) -> None:
        for name in ("target_loss", "reference_steps", "noise_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or (value <= 0 and name != "target_loss"):
                raise UsageError(f"{name} must be a finite positive number (got {value!r})")
        if isinstance(self.reference_batch, bool) or not isinstance(self.reference_batch, int) \
                or self.reference_batch < 1:
            raise UsageError(f"reference_batch must be a whole number of at least 1 (got "
                             f"{self.reference_batch!r})")
        costs = self.staleness_costs
        if not isinstance(costs, dict) or set(costs) != set(STALENESS_COSTS) or not all(
                isinstance(c, (int, float)) and not isinstance(c, bool) and c >= 0
                for c in costs.values()):
            raise UsageError(f"staleness_costs must give a number >= 0 for each of "
                             f"{', '.join(STALENESS_COSTS)} (got {costs!r})")

    @property
    def min_steps(self) -> float:
        """``S_min``: the steps at an infinite batch (a noiseless gradient)."""
        return self.reference_steps / (1.0 + self.noise_scale / self.reference_batch)

    def batch_factor(self, batch: int) -> float:
        """``1 + B_noise / B``: how many times ``S_min`` the steps are at ``batch``."""
        return 1.0 + self.noise_scale / batch

    def staleness_factor(self, staleness: int, kind: str = "ps") -> float:
        """``1 + c staleness``, ``c`` the cost of ``kind`` (:data:`STALENESS_COSTS`)."""
        return 1.0 + self.staleness_costs[kind] * staleness

    def steps(self, batch: int, staleness: int = 0, kind: str = "ps") -> float:
        """Predicted optimizer steps to the target at global ``batch``, ``staleness`` updates
        stale in a plan of ``kind``."""
        return self.min_steps * self.batch_factor(batch) * self.staleness_factor(staleness, kind)

    def lr_at(self, batch: int) -> float | None:
        """The learning rate the prediction assumes at ``batch``: :attr:`lr` times
        ``(1 + B_noise/B0) / (1 + B_noise/B)`` (``--lr-scaling auto``'s factor)."""
        if self.lr is None:
            return None
        return self.lr * self.batch_factor(self.reference_batch) / self.batch_factor(batch)

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON (what :meth:`from_dict` reads back)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> StepsModel:
        """Read :meth:`to_dict`'s object (``noise_scale``, ``reference_batch``,
        ``reference_steps`` and ``target_loss`` required); one-line errors naming ``where``."""
        if not isinstance(data, dict):
            raise UsageError(f"{where}: expected a JSON object with noise_scale, reference_batch, "
                             f"reference_steps and target_loss")
        names = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise UsageError(f"{where}: unknown key(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(names))}")
        missing = [name for name in ("noise_scale", "reference_batch", "reference_steps",
                                     "target_loss") if name not in data]
        if missing:
            raise UsageError(f"{where}: missing {', '.join(missing)}")
        try:
            return cls(**{**data, "source": data.get("source") or where})
        except UsageError as exc:
            raise UsageError(f"{where}: {exc}") from None


def loss_crossing(points: Sequence[tuple[float, float]], target: float) -> float | None:
    """The step at which a loss curve of ``(step, loss)`` points first reaches ``target``,
    linear between the point before and the first point at or below it (that point's step when
    it is the first); None when no point reaches it."""
    previous: tuple[float, float] | None = None
    for step, loss in points:
        if math.isfinite(loss) and loss <= target:
            if previous is None or previous[1] == loss:
                return step
            return previous[0] + (step - previous[0]) * (previous[1] - target) / (previous[1] - loss)
        previous = (step, loss) if math.isfinite(loss) else None
    return None


@dataclasses.dataclass(kw_only=True, slots=True)
class Timed:
    """A simulated plan at a batch size, with its predicted steps and time to the target."""

    batch_size: int
    candidate: Candidate
    label: str
    """What the plan is, in words (``allreduce`` for the search's best, or a family's name)."""
    staleness: int
    predicted_steps: float

    @property
    def step_time_s(self) -> float:
        """Simulated seconds per step (a global batch)."""
        return self.candidate.result.step_time_s

    @property
    def time_to_target_s(self) -> float:
        """``step_time_s * predicted_steps``."""
        return self.step_time_s * self.predicted_steps


def time_to_target(candidate: Candidate, batch: int, model: StepsModel,
                   label: str = "allreduce") -> Timed:
    """``candidate`` at global ``batch``, timed to ``model``'s target."""
    stale = staleness(candidate.plan)
    return Timed(batch_size=batch, candidate=candidate, label=label, staleness=stale,
                 predicted_steps=model.steps(batch, stale, stale_kind(candidate.plan)))


def fastest(timed: Sequence[Timed]) -> Timed:
    """The candidate with the least predicted time to the target (the smaller batch of a tie)."""
    if not timed:
        raise UsageError("no plan fits in memory at any of the batch sizes; raise --memory or "
                         "give smaller --batch-sizes")
    return min(timed, key=lambda t: (t.time_to_target_s, t.batch_size))
