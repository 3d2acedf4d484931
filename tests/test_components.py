"""A worker's components: called in order after each step, left out when off, their state and
summaries merged (tandem.runtime.component)."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.runtime.checkpoint import Checkpoints
from tandem.runtime.component import Component, Components, StepEnd
from tandem.runtime.memory import PeakMemory
from tandem.runtime.noise_scale import NoiseScale

pytestmark = pytest.mark.pure


class Recorder(Component):
    """Appends ``(name, step)`` to a shared list at every step; state and summary under its name."""

    def __init__(self, name: str, calls: list[tuple[str, int]]) -> None:
        self.name, self.calls, self.loaded = name, calls, None

    def after_step(self, end: StepEnd) -> None:
        self.calls.append((self.name, end.step))

    def state_dict(self) -> dict[str, Any]:
        return {self.name: len(self.calls)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state.get(self.name)

    def summary(self) -> dict[str, Any]:
        return {f"{self.name}_calls": len(self.calls)}


def test_components_act_in_order_and_off_ones_are_left_out() -> None:
    calls: list[tuple[str, int]] = []
    first, second = Recorder("a", calls), Recorder("b", calls)
    components = Components(first, None, second)
    assert list(components) == [first, second]
    for done in (1, 2):
        components.after_step(StepEnd(done=done, last=2))
    assert calls == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    assert components.summary() == {"a_calls": 4, "b_calls": 4}
    assert components.state_dict() == {"a": 4, "b": 4}
    components.load_state_dict({"a": 7, "b": 9})
    assert (first.loaded, second.loaded) == (7, 9)


def test_components_without_a_step_hook_are_not_called_per_step() -> None:
    noise = NoiseScale.unavailable("not measured here")
    calls: list[tuple[str, int]] = []
    components = Components(noise, Recorder("a", calls))
    assert components.stepping == [components.items[1]]
    assert components.summary()["noise_scale"] is None  # its summary still counts


def test_step_end_says_which_step_and_whether_it_is_the_last() -> None:
    end = StepEnd(done=10, last=10, logging=True)
    assert (end.step, end.final, end.saving) == (9, True, False)
    assert not StepEnd(done=3, last=10).final


def test_checkpoints_check_then_save_only_at_saving_steps() -> None:
    events: list[tuple[str, int]] = []
    checkpoints = Checkpoints(lambda done: events.append(("save", done)),
                              check=lambda step: events.append(("check", step)))
    checkpoints.after_step(StepEnd(done=4, last=10))
    checkpoints.after_step(StepEnd(done=5, last=10, saving=True))
    assert events == [("check", 4), ("save", 5)]


def test_peak_memory_is_taken_at_the_last_step() -> None:
    memory = PeakMemory()
    memory.after_step(StepEnd(done=1, last=2))
    assert memory.training_bytes == 0
    memory.after_step(StepEnd(done=2, last=2))
    assert memory.summary()["training_peak_rss_bytes"] == memory.training_bytes > 0
