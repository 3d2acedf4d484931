"""The one protocol of what a worker does besides its schedule (the loss watch, the noise
scale, reporting, checkpoints, the batch's growth, precision, compensation, a server's codecs):
a step hook, its state for checkpoints, and its fields of the run's summary.

Usage::

    components = Components(reporter, loss_log, checkpoints if config.checkpoint_every else None)
    for step in range(first, last):
        ...                                            # the step itself
        components.after_step(StepEnd(done=step + 1, last=last, logging=..., saving=...))
    checkpoint = {..., "components": components.state_dict()}    # each state under its name
    components.load_state_dict(checkpoint["components"])         # on resume
    summary = {**fields, **components.summary()}

A component that is off is not in the list, so it costs nothing per step. The model, the
optimizer and the learning-rate schedule are not components: their state stays with the worker
that owns them, and its checkpoint saves it beside the components'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, ClassVar


@dataclasses.dataclass(frozen=True, slots=True)
class StepEnd:
    """What a worker tells its components after an optimizer step."""

    done: int
    """Steps done, this one included (its index plus one)."""
    last: int
    """The step count the run stops at (``--stop-after``, else ``--steps``)."""
    logging: bool = False
    """A metrics line is due: a ``--log-every`` step, or the last."""
    saving: bool = False
    """A checkpoint is taken after this step: a ``--checkpoint-every`` step, or the run's last
    (every worker, trainer or server, sets it so; where the last step's checkpoint is written
    is the saving component's affair)."""

    @property
    def step(self) -> int:
        """The index of the step just done."""
        return self.done - 1

    @property
    def final(self) -> bool:
        """Whether it is the run's last step."""
        return self.done == self.last


class Component:
    """A part of a worker outside its schedule. Every method has a default that does nothing,
    so a component overrides only what it takes part in; one with state to checkpoint
    overrides :meth:`state_dict` and :meth:`load_state_dict`, which a checkpoint keeps under
    its :attr:`name`."""

    __slots__ = ()

    name: ClassVar[str] = ""
    """Where a checkpoint keeps this component's state (one per worker's list); a component
    with state names itself."""

    def after_step(self, end: StepEnd) -> None:
        """Called after every optimizer step, in the order of the worker's components."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds of this component (nothing by default)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state :meth:`state_dict` gave (called only where a checkpoint holds
        some under :attr:`name`)."""

    def summary(self) -> dict[str, Any]:
        """This component's fields of the run's summary."""
        return {}


class Components:
    """A worker's components, called in order; ``None`` entries (components that are off) are
    left out, and so are components without a step hook from the per-step calls, so that
    neither costs anything per step."""

    def __init__(self, *items: Component | None) -> None:
        self.items: list[Component] = [item for item in items if item is not None]
        self.stepping = [item for item in self.items
                         if type(item).after_step is not Component.after_step]
        """The components with a step hook of their own, in order."""
        self.stateful = [item for item in self.items
                         if type(item).state_dict is not Component.state_dict]
        """The components with state to checkpoint, each under its own name."""
        names = [item.name for item in self.stateful]
        assert all(names) and len(set(names)) == len(names), f"components' names: {names}"

    def __iter__(self) -> Iterator[Component]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def after_step(self, end: StepEnd) -> None:
        """Every component's step hook, in order."""
        for item in self.stepping:
            item.after_step(end)

    def state_dict(self) -> dict[str, Any]:
        """Every component's state, each under its :attr:`Component.name`."""
        return {item.name: item.state_dict() for item in self.stateful}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Hand every component its state from :meth:`state_dict`'s (one the checkpoint holds
        none of keeps its own)."""
        for item in self.stateful:
            if item.name in state:
                item.load_state_dict(state[item.name])

    def summary(self) -> dict[str, Any]:
        """Every component's summary fields, merged (later components win a shared key)."""
        fields: dict[str, Any] = {}
        for item in self.items:
            fields.update(item.summary())
        return fields
