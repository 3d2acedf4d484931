"""A user's callbacks in a run (``tandem.fit(callbacks=[...])``): hooks called after every step,
every metrics line, every evaluation and every checkpoint, on rank 0 or on every rank.

Usage::

    class Progress(tandem.Callback):
        def on_step_end(self, step: tandem.StepInfo) -> None: ...
        def on_log(self, step: int, fields: dict[str, Any]) -> None: ...       # loss, lr, ...
        def on_evaluation(self, step: int, metrics: dict[str, Any]) -> None: ...
        def on_checkpoint(self, step: int, path: Path) -> None: ...

    tandem.fit(model, train, test, callbacks=[Progress()], log_every=10)

A callback need not subclass :class:`Callback`: any object with one or more of these methods
will do. Callbacks run in the worker processes, each worker holding its own copy (pickled from
the one given, as the model is), so what a callback records stays there: write what you want
to keep (a file, your logger). They run on rank 0, or on every rank where the callback's
``every_rank`` is true. They observe: a callback that raises stops the run with one line naming
it. Runs whose servers drive the steps (``ps``, EASGD with servers) refuse callbacks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

from tandem.errors import UsageError
from tandem.plan import Plan
from tandem.runtime.component import Component, StepEnd
from tandem.strategy import strategy_of

HOOKS = ("on_step_end", "on_log", "on_evaluation", "on_checkpoint")
"""The methods a callback may have."""


@dataclasses.dataclass(frozen=True, slots=True)
class StepInfo:
    """What :meth:`Callback.on_step_end` is told after each optimizer step."""

    step: int
    """Steps done, this one included."""
    last: int
    """The step the run stops at (``stop_after``, else ``steps``)."""
    lr: float
    """The learning rate of the step just done (the first parameter group's)."""
    rank: int
    """The worker's rank (0 unless the callback runs on every rank)."""


class Callback:
    """Hooks of a run, each doing nothing until overridden (see the module's docstring)."""

    every_rank: ClassVar[bool] = False
    """Run on every worker, not only on rank 0."""

    def on_step_end(self, step: StepInfo) -> None:
        """After every optimizer step."""

    def on_log(self, step: int, fields: dict[str, Any]) -> None:
        """After every metrics line (``log_every``): the line's fields (``loss``, ``lr``,
        ``samples_per_s``, ...)."""

    def on_evaluation(self, step: int, metrics: dict[str, Any]) -> None:
        """After every evaluation (``eval_every``, and the last step's): ``test_loss``,
        ``test_accuracy`` and the user's metrics (``test_<name>``; rank 0's only)."""

    def on_checkpoint(self, step: int, path: Path) -> None:
        """After every checkpoint, with the path of its ``checkpoint.pt``."""


def check_callbacks(callbacks: Any) -> list[Any]:
    """``callbacks`` as :func:`tandem.fit` takes it (None or a list of objects with at least
    one hook), refused in one line otherwise."""
    if callbacks is None:
        return []
    if not isinstance(callbacks, Sequence) or isinstance(callbacks, (str, bytes)):
        raise UsageError(f"callbacks= is a {type(callbacks).__name__}; give a list of "
                         f"callbacks, e.g. callbacks=[MyCallback()]")
    for callback in callbacks:
        if not any(callable(getattr(callback, hook, None)) for hook in HOOKS):
            raise UsageError(f"callbacks=[...] holds a {type(callback).__name__} with none of "
                             f"the hooks {', '.join(HOOKS)}; subclass tandem.Callback and "
                             f"override the ones you need")
    return list(callbacks)


def check_callbacks_plan(plan: Plan, callbacks: Any) -> None:
    """Callbacks run in workers that own the loop: one line for a plan whose servers drive the
    steps."""
    if callbacks and plan.num_servers:
        raise UsageError(f"callbacks= with --strategy {strategy_of(plan)} and servers: the "
                         f"servers drive its steps, which no callback follows yet; use a "
                         f"synchronous strategy (dp, gossip, localsgd, pipeline) or the "
                         f"metrics lines (metrics.jsonl)")


class UserCallbacks(Component):
    """The callbacks one worker runs (rank 0's all, other ranks' those with ``every_rank``),
    as a component (its step hook) and as what the worker tells of its lines, evaluations and
    checkpoints."""

    def __init__(self, callbacks: Sequence[Any], rank: int, lr: Callable[[], float]) -> None:
        self.rank, self.lr = rank, lr
        self.active = [callback for callback in callbacks
                       if rank == 0 or getattr(callback, "every_rank", False)]

    def after_step(self, end: StepEnd) -> None:
        if self.active:
            self.call("on_step_end", StepInfo(step=end.done, last=end.last, lr=self.lr(),
                                              rank=self.rank))

    def logged(self, fields: dict[str, Any]) -> None:
        """A training metrics line (its ``step``, ``loss``, ``lr``, ...)."""
        if self.active:
            values = {key: value for key, value in fields.items() if key != "step"}
            self.call("on_log", int(fields.get("step", 0)), values)

    def evaluated(self, step: int, values: dict[str, Any]) -> None:
        """An evaluation after ``step`` steps."""
        self.call("on_evaluation", step, values)

    def telling(self, save: Callable[[int], None], out: Path | None) -> Callable[[int], None]:
        """``save(done)`` (a worker's checkpoint), followed by the callbacks' ``on_checkpoint``
        where a checkpoint is in ``OUT`` (rank 0 writes ``checkpoint.pt`` last: other ranks are
        told when their part is written)."""
        if not self.active or out is None:
            return save

        def save_and_tell(done: int) -> None:
            save(done)
            if (out / "checkpoint.pt").exists():
                self.call("on_checkpoint", done, out / "checkpoint.pt")

        return save_and_tell

    def call(self, hook: str, *args: Any) -> None:
        """``hook`` of every active callback that has it; one line for one that raises."""
        for callback in self.active:
            method = getattr(callback, hook, None)
            if method is None:
                continue
            try:
                method(*args)
            except UsageError:
                raise
            except Exception as exc:  # the user's code: name it, in one line
                lines = str(exc).strip().splitlines()
                raise UsageError(f"callback {type(callback).__name__}.{hook} raised "
                                 f"{type(exc).__name__}: {lines[0] if lines else ''}") from None
