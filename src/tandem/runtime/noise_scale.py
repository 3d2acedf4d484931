"""The gradient noise scale B_simple = tr(Σ)/|G|², estimated from gradients of two batch sizes.

McCandlish, Kaplan, Amodei et al., "An Empirical Model of Large-Batch Training" (2018),
Appendix A.1: the squared norm of a mean gradient over ``b`` samples has expectation
``|G|² + tr(Σ)/b``, so the squared norms of two batch sizes ``b < B`` give unbiased estimates
of ``|G|²`` and ``tr(Σ)`` (:func:`two_batch_estimates`). Each is noisy, and their ratio is
biased, so the two are smoothed separately, with exponential moving averages, before dividing
(:class:`NoiseScale`). In data parallelism the two batch sizes come at no extra communication:
each worker's own gradient (``b``) and their average (``B``), see ``docs/large_batch.md``.

Usage::

    noise = NoiseScale()
    sq_norm, trace = two_batch_estimates(local_sq_norm, mean_sq_norm, 16, 64)
    noise.update(sq_norm, trace, steps=1)
    noise.estimate()          # tr(Σ)/|G|² of the averages, or None
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from tandem.runtime.component import Component

EMA_STEPS = 100
"""Time constant, in optimizer steps, of the moving averages of ``|G|²`` and ``tr(Σ)``."""

if TYPE_CHECKING:
    import torch

Number = TypeVar("Number", float, "torch.Tensor")
"""A float, or a tensor (the formulas are plain arithmetic)."""


def two_batch_estimates(small_sq_norm: Number, big_sq_norm: Number, small_batch: float,
                        big_batch: float, *, population: int | None = None,
                        ) -> tuple[Number, Number]:
    """Unbiased estimates ``(|G|², tr(Σ))`` from the squared norms of two mean gradients, over
    ``small_batch`` and over ``big_batch`` samples (McCandlish et al., eqs. A.2-A.3)::

        |G|² = (B |G_B|² - b |G_b|²) / (B - b)
        S    = (|G_b|² - |G_B|²) / (1/b - 1/B)

    These hold for samples drawn independently. With ``population`` N, the batches are drawn
    without replacement from N samples (a shuffled epoch), where the noise of a mean over ``b``
    is ``tr(Σ) (N - b) / (b (N - 1))`` rather than ``tr(Σ) / b``, with ``G`` and ``Σ`` the mean
    and covariance of the N per-sample gradients; the same two equations are solved with that
    factor (it matters when B is not small against N: without it, ``|G|²`` comes out low by
    about ``tr(Σ)/N``).
    """
    if not 0 < small_batch < big_batch or (population is not None and big_batch > population):
        raise ValueError(f"two batch sizes 0 < b < B (<= N) are needed (b: {small_batch}, "
                         f"B: {big_batch}, N: {population})")
    small_noise, big_noise = (_noise_factor(n, population) for n in (small_batch, big_batch))
    trace = (small_sq_norm - big_sq_norm) / (small_noise - big_noise)
    sq_norm = (small_noise * big_sq_norm - big_noise * small_sq_norm) / (small_noise - big_noise)
    return sq_norm, trace


def _noise_factor(batch: float, population: int | None) -> float:
    """What multiplies tr(Σ) in the expected squared norm of a mean over ``batch`` samples."""
    if population is None:
        return 1.0 / batch
    return (population - batch) / (batch * (population - 1))


def noise_scale(trace: float, sq_norm: float) -> float | None:
    """``tr(Σ)/|G|²``, or None where the estimate of ``|G|²`` is not positive (the noise then
    hides the gradient at these batch sizes: B_simple is far above them) or that of ``tr(Σ)``
    is not (the averaged gradient's norm exceeds the workers': a codec's decoded mean)."""
    return trace / sq_norm if sq_norm > 0 and trace > 0 else None


class NoiseScale(Component):
    """Moving averages of the estimates of ``|G|²`` and ``tr(Σ)``, and their ratio.

    Estimates arrive as means over a span of steps (a logging window); a span of ``n`` steps
    decays the averages by ``(1 - 1/ema_steps)**n``, as ``n`` per-step updates of its mean would.
    The averages are bias-corrected (as Adam's are), so the first spans are not pulled to zero.
    ``note`` says why there is no estimate, or what to know about it.
    """

    name = "noise_scale"

    def __init__(self, note: str | None = None, *, measured: bool = True,
                 ema_steps: int = EMA_STEPS) -> None:
        self.note = note
        self.measured = measured
        """Whether estimates come in at all (False: ``noise_scale`` is null for ``note``)."""
        self.ema_steps = ema_steps
        self.sq_norm = 0.0
        self.trace = 0.0
        self.weight = 0.0
        """The averages' total weight (1 minus the decay since the first update)."""
        self.steps = 0
        """Steps measured so far."""

    @classmethod
    def unavailable(cls, reason: str) -> NoiseScale:
        """No estimate in this run, for ``reason``."""
        return cls(reason, measured=False)

    def update(self, sq_norm: float, trace: float, *, steps: int) -> None:
        """Fold in the mean estimates of a span of ``steps`` steps."""
        decay = (1.0 - 1.0 / self.ema_steps) ** steps
        self.sq_norm = decay * self.sq_norm + (1.0 - decay) * sq_norm
        self.trace = decay * self.trace + (1.0 - decay) * trace
        self.weight = decay * self.weight + (1.0 - decay)
        self.steps += steps

    def averages(self) -> tuple[float, float] | None:
        """The averaged ``(|G|², tr(Σ))``, or None before the first update."""
        if self.weight <= 0.0:
            return None
        return self.sq_norm / self.weight, self.trace / self.weight

    def estimate(self) -> float | None:
        """B_simple from the averages; None before any, or while ``|G|²``'s is not positive."""
        parts = self.averages()
        return None if parts is None else noise_scale(parts[1], parts[0])

    def summary(self) -> dict[str, Any]:
        """``noise_scale``, ``noise_scale_note`` (why it is null, or a caveat) and
        ``gradient_noise`` (the averages of ``|G|²`` and ``tr(Σ)``), for a run's summary."""
        parts = self.averages()
        note = self.note
        if self.measured and parts is None:
            note = "no step was measured (every step's gradients overflowed, or none ran)"
        elif parts is not None and parts[0] <= 0:
            note = (f"the estimate of |G|² is not positive ({parts[0]:.3g}): the gradient noise "
                    f"hides the gradient at these batch sizes, so B_simple is far above them; "
                    f"measure over more steps or with fewer workers (a smaller per-worker batch)")
        elif parts is not None and parts[1] <= 0:
            note = (f"the estimate of tr(Σ) is not positive ({parts[1]:.3g}): the averaged "
                    f"gradient's squared norm exceeds the workers' own, which exact averaging "
                    f"cannot do; {self.note or 'measure over more steps'}")
        detail = None if parts is None else {
            "gradient_sq_norm": parts[0], "noise_trace": parts[1], "steps_measured": self.steps,
            "ema_steps": self.ema_steps}
        return {"noise_scale": self.estimate(), "noise_scale_note": note,
                "gradient_noise": detail}

    def state_dict(self) -> dict[str, float]:
        """The averages, for checkpoints."""
        return {"sq_norm": self.sq_norm, "trace": self.trace, "weight": self.weight,
                "steps": self.steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.sq_norm = float(state.get("sq_norm", 0.0))
        self.trace = float(state.get("trace", 0.0))
        self.weight = float(state.get("weight", 0.0))
        self.steps = int(state.get("steps", 0))
