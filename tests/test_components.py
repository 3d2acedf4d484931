"""A worker's components: called in order after each step, left out when off, each one's state
under its name, summaries merged (tandem.runtime.component)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tandem.data.sampler import GlobalBatchSampler
from tandem.runtime.batches import BatchFeed, BatchGrowth
from tandem.runtime.checkpoint import Checkpoints
from tandem.runtime.component import Component, Components, StepEnd
from tandem.runtime.config import RunConfig
from tandem.runtime.divergence import DivergenceCheck, LossWatch
from tandem.runtime.memory import PeakMemory
from tandem.runtime.noise_scale import NoiseScale
from tandem.runtime.precision import Precision, StagePrecision
from tandem.runtime.ps.codecs import WireCodecs
from tandem.runtime.ps.server import Pace

pytestmark = pytest.mark.pure


class Recorder(Component):
    """Appends ``(name, step)`` to a shared list at every step; its state is the count of calls
    (both recorders' keys are the same: the list keeps them apart by name)."""

    def __init__(self, name: str, calls: list[tuple[str, int]]) -> None:
        self.label, self.calls = name, calls
        self.loaded: dict[str, Any] | None = None

    @property
    def name(self) -> str:  # type: ignore[override]  # a class attribute in real components
        return self.label

    def after_step(self, end: StepEnd) -> None:
        self.calls.append((self.label, end.step))

    def state_dict(self) -> dict[str, Any]:
        return {"calls": len(self.calls)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state

    def summary(self) -> dict[str, Any]:
        return {f"{self.label}_calls": len(self.calls)}


def test_components_act_in_order_and_off_ones_are_left_out() -> None:
    calls: list[tuple[str, int]] = []
    first, second = Recorder("a", calls), Recorder("b", calls)
    components = Components(first, None, second)
    assert list(components) == [first, second]
    for done in (1, 2):
        components.after_step(StepEnd(done=done, last=2))
    assert calls == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    assert components.summary() == {"a_calls": 4, "b_calls": 4}
    assert components.state_dict() == {"a": {"calls": 4}, "b": {"calls": 4}}
    components.load_state_dict({"a": {"calls": 7}})
    assert (first.loaded, second.loaded) == ({"calls": 7}, None)  # b's state: none saved


def test_components_with_state_need_names_of_their_own() -> None:
    calls: list[tuple[str, int]] = []
    with pytest.raises(AssertionError, match="names"):
        Components(Recorder("a", calls), Recorder("a", calls))
    memory, checkpoints = PeakMemory(), Checkpoints(lambda done: None)
    assert Components(memory, checkpoints).state_dict() == {}  # stateless: nothing to name


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


def test_a_server_step_end_means_what_a_trainers_does() -> None:
    """Metrics at --log-every steps and the last, a checkpoint at --checkpoint-every steps and
    the last (as BaseTrainer.train_steps sets them)."""
    pace = Pace(per_step=2, last_step=5, required=2, batch_schedule=((0, 8),), log_every=2,
                checkpoint_every=3)
    ends = [pace.step_end(version) for version in range(2, 11, 2)]
    assert [(end.done, end.logging, end.saving) for end in ends] == [
        (1, False, False),
        (2, True, False),
        (3, False, True),
        (4, True, False),
        (5, True, True),
    ]
    assert not Pace(per_step=1, last_step=4, required=1,
                    batch_schedule=((0, 8),)).step_end(3).saving


def test_stateful_components_round_trip_under_their_names() -> None:
    config = RunConfig()
    stage = StagePrecision("fp16", torch.device("cpu"))
    assert stage.loss_scale is not None
    stage.loss_scale.scale, stage.loss_scale.good_steps, stage.skipped_steps = 512.0, 7, 3
    watch = LossWatch(config, where="worker 0 (rank 0)", rank=0, device=torch.device("cpu"))
    watch.rule.judge(2.5)  # the first loss, L0: a resumed run learns its own
    noise = NoiseScale()
    noise.update(2.0, 40.0, steps=5)
    saved = Components(stage, DivergenceCheck(watch, lambda: 0), noise).state_dict()
    assert set(saved) == {"precision", "noise_scale"}
    assert saved["precision"] == {"loss_scale": {"scale": 512.0, "good_steps": 7},
                                  "skipped_steps": 3}

    stage2 = StagePrecision("fp16", torch.device("cpu"))
    watch2 = LossWatch(config, where="worker 0 (rank 0)", rank=0, device=torch.device("cpu"))
    noise2 = NoiseScale()
    Components(stage2, DivergenceCheck(watch2, lambda: 0), noise2).load_state_dict(saved)
    assert stage2.loss_scale is not None
    assert (stage2.loss_scale.scale, stage2.loss_scale.good_steps, stage2.skipped_steps) == (
        512.0, 7, 3)
    assert watch2.rule.first is None
    assert noise2.estimate() == noise.estimate()
    plain = Precision("fp32", torch.device("cpu"))
    assert Components(plain).state_dict() == {"precision": {"scaler": None, "skipped_steps": 0}}


def test_a_servers_codecs_save_the_snapshot_of_the_last_saving_step() -> None:
    """The codecs' state a checkpoint holds is the one at its step's end, before the replies
    that follow advance the encoders."""
    shapes, keys = [torch.Size([4])], ["w"]
    codecs = WireCodecs("topk:ratio=0.5", shapes, keys)
    codecs.encode(1, torch.arange(4.0))
    codecs.after_step(StepEnd(done=1, last=3))  # no checkpoint after it: no snapshot
    assert codecs.snapshot is None
    codecs.after_step(StepEnd(done=2, last=3, saving=True))
    at_step_2 = codecs.state_dict()
    codecs.encode(1, torch.arange(4.0) * 3)  # a reply after the step advances the copy
    assert torch.equal(codecs.state_dict()["encoders"][1]["copy"],
                       at_step_2["encoders"][1]["copy"])
    assert not torch.equal(codecs.current_state()["encoders"][1]["copy"],
                           at_step_2["encoders"][1]["copy"])


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


def test_a_grown_batch_schedule_is_restored_with_its_learning_rate() -> None:
    """``--batch-schedule auto``: the resumed sampler continues with the grown batches, and
    the scheduler's current rate is set again for the batch it has grown to."""
    feed = BatchFeed.__new__(BatchFeed)  # only the parts BatchGrowth reads
    feed.config = RunConfig(steps=40)
    feed.sampler = GlobalBatchSampler(1000, global_batch_size=32, seed=0)
    grown = BatchGrowth(feed, lambda: None, lambda: None)
    feed.sampler.extend(10, 64)
    saved = grown.state_dict()
    assert saved == {"schedule": "32@0,64@10"}

    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    feed.sampler = GlobalBatchSampler(1000, global_batch_size=32, seed=0)
    sampler = feed.sampler
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: sampler.batch_size_at(step) / 32)
    for _ in range(12):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 1.0  # the schedule not yet restored
    BatchGrowth(feed, lambda: None, lambda: scheduler).load_state_dict(saved)
    assert [sampler.batch_size_at(step) for step in (9, 10, 39)] == [32, 64, 64]
    assert (scheduler.last_epoch, optimizer.param_groups[0]["lr"]) == (12, 2.0)

