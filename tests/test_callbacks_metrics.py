"""Callbacks and metrics through ``tandem.fit`` (issue 29, deliverable 4).

A macro F1 given as ``metrics={"macro_f1": ...}`` under data parallelism (2 workers, each
scoring its share of the test set) and a 2-stage pipeline (the last stage scoring): it is in the
summary and the last metrics line as ``test_macro_f1``, and equals scikit-learn's ``f1_score``
computed by hand on the returned model. A callback writes what each hook is told to a file: a
step end for every step, the metrics lines, the evaluations (with the metric) and the
checkpoints. What fit refuses, and a failing metric or callback, is one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import tandem
from tandem.errors import UsageError
from tandem.runtime.callbacks import Callback, StepInfo, UserCallbacks, check_callbacks
from tandem.runtime.component import StepEnd
from tandem.runtime.user_metrics import KeptOutputs, check_metrics
from tests.user_data import DigitPairs

SETTINGS: dict[str, Any] = {"steps": 6, "batch_size": 32, "lr": 0.1, "momentum": 0.9,
                            "seed": 3, "log_every": 3, "eval_every": 3, "checkpoint_every": 3}


def macro_f1(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Macro F1 over the classes that occur in the targets or the predictions."""
    predicted = outputs.argmax(-1)
    scores = []
    for label in torch.cat([targets, predicted]).unique():
        hits = int(((predicted == label) & (targets == label)).sum())
        claimed, actual = int((predicted == label).sum()), int((targets == label).sum())
        scores.append(2 * hits / (claimed + actual))
    return sum(scores) / len(scores)


class Journal(Callback):
    """Writes every hook's call as a JSON line to ``path`` (callbacks run in the workers)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def _write(self, **entry: Any) -> None:
        with open(self.path, "a") as file:
            file.write(json.dumps(entry, default=str) + "\n")

    def on_step_end(self, step: StepInfo) -> None:
        self._write(hook="step", step=step.step, last=step.last, lr=step.lr, rank=step.rank)

    def on_log(self, step: int, fields: dict[str, Any]) -> None:
        self._write(hook="log", step=step, loss=fields["loss"])

    def on_evaluation(self, step: int, metrics: dict[str, Any]) -> None:
        self._write(hook="evaluation", step=step, **metrics)

    def on_checkpoint(self, step: int, path: Path) -> None:
        self._write(hook="checkpoint", step=step, path=str(path))


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [{"nproc": 2},
                                    {"strategy": "pipeline", "stages": 2, "nproc": 2}],
                         ids=["dp", "pipeline"])
def test_a_metric_and_a_callback_through_fit(tmp_path: Path, layout: dict[str, Any]) -> None:
    from sklearn.metrics import f1_score

    journal = tmp_path / "journal.jsonl"
    result = tandem.fit("mlp", DigitPairs("train"), DigitPairs("test"), out=tmp_path / "out",
                        metrics={"macro_f1": macro_f1}, callbacks=[Journal(journal)],
                        **SETTINGS, **layout)
    summary = result.summary
    assert result.model is not None and summary["finished"]
    test = DigitPairs("test")
    with torch.no_grad():
        predicted = result.model.eval()(test.images).argmax(-1)
    by_hand = f1_score(test.labels.numpy(), predicted.numpy(), average="macro")
    assert summary["test_macro_f1"] == pytest.approx(by_hand, abs=1e-9)
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").open()]
    assert lines[-1]["test_macro_f1"] == summary["test_macro_f1"]
    assert [line["step"] for line in lines if "test_macro_f1" in line] == [3, 6]
    calls = [json.loads(line) for line in journal.open()]
    assert [c["step"] for c in calls if c["hook"] == "step"] == [1, 2, 3, 4, 5, 6]
    assert {c["rank"] for c in calls if c["hook"] == "step"} == {0}  # rank 0 only
    assert [c["step"] for c in calls if c["hook"] == "log"] == [3, 6]
    evaluations = [c for c in calls if c["hook"] == "evaluation"]
    assert [c["step"] for c in evaluations] == [3, 6]
    assert evaluations[-1]["test_macro_f1"] == summary["test_macro_f1"]
    assert evaluations[-1]["test_accuracy"] == summary["test_accuracy"]
    checkpoints = [c for c in calls if c["hook"] == "checkpoint"]
    assert [c["step"] for c in checkpoints] == [3, 6]
    assert checkpoints[0]["path"] == str(tmp_path / "out" / "checkpoint.pt")


@pytest.mark.pure
def test_what_fit_refuses_is_one_line() -> None:
    cases = {
        "not a dict": (lambda: check_metrics([macro_f1]), "give a dict of names"),
        "bad name": (lambda: check_metrics({"macro f1": macro_f1}), "not an identifier"),
        "not callable": (lambda: check_metrics({"f1": 0.5}), "not a function"),
        "no hooks": (lambda: check_callbacks([object()]), "none of the hooks"),
        "not a list": (lambda: check_callbacks(Journal(Path("x"))), "give a list"),
    }
    for name, (call, expected) in cases.items():
        with pytest.raises(UsageError) as raised:
            call()
        assert expected in str(raised.value) and "\n" not in str(raised.value), name


@pytest.mark.pure
def test_callbacks_with_servers_are_refused_before_launch() -> None:
    with pytest.raises(UsageError, match="servers drive its steps"):
        tandem.fit("mlp", data="digits", strategy="ps", servers=1, nproc=2, steps=1,
                   callbacks=[Journal(Path("unused"))])


def _raise(outputs: Any, targets: Any) -> float:
    raise ValueError("no classes\nsecond line")


@pytest.mark.pure
def test_metrics_see_the_whole_evaluation_in_order_and_fail_in_one_line() -> None:
    """Chunks kept out of order (a pipeline's replicas) are put back in the samples' order,
    tensors concatenated, 0-dimensional ones stacked; a metric that raises or returns no number
    is one line naming it."""
    kept = KeptOutputs({"first": lambda out, y: float(out["logits"][0, 0]),
                        "parts": lambda out, y: float(out["aux"].sum()),
                        "size": lambda out, y: torch.tensor(float(len(y)))})
    kept.keep(4, {"logits": torch.full((2, 3), 4.0), "aux": torch.tensor(1.0)}, torch.ones(2))
    kept.keep(0, {"logits": torch.zeros(4, 3), "aux": torch.tensor(2.0)}, torch.ones(4))
    assert kept.values(gather=False) == {"test_first": 0.0, "test_parts": 3.0, "test_size": 6.0}
    assert KeptOutputs(None).values(gather=False) == {}
    padded = KeptOutputs({"lengths": lambda out, y: float(sum(part.shape[1] for part in out))})
    padded.keep(0, torch.zeros(2, 5), torch.zeros(2))
    padded.keep(2, torch.zeros(2, 7), torch.zeros(2))  # batches padded to their own lengths
    assert padded.values(gather=False) == {"test_lengths": 12.0}
    for metric, expected in [(_raise, "metric 'bad' failed: ValueError: no classes"),
                             (lambda out, y: "high", "returned str")]:
        failing = KeptOutputs({"bad": metric})
        failing.keep(0, torch.zeros(1, 2), torch.zeros(1))
        with pytest.raises(UsageError) as raised:
            failing.values(gather=False)
        assert expected in str(raised.value) and "\n" not in str(raised.value)


class EveryRank(Journal):
    every_rank = True


class Failing(Callback):
    def on_step_end(self, step: StepInfo) -> None:
        raise RuntimeError("disk full")


@pytest.mark.pure
def test_callbacks_choose_their_ranks_and_fail_in_one_line(tmp_path: Path) -> None:
    on_zero, everywhere = Journal(tmp_path / "a"), EveryRank(tmp_path / "b")
    other_rank = UserCallbacks([on_zero, everywhere], rank=1, lr=lambda: 0.5)
    assert other_rank.active == [everywhere]
    other_rank.after_step(StepEnd(done=2, last=4))
    other_rank.logged({"step": 2, "loss": 1.5})
    other_rank.evaluated(2, {"test_loss": 1.0, "test_accuracy": 0.5})
    calls = [json.loads(line) for line in (tmp_path / "b").open()]
    assert calls == [{"hook": "step", "step": 2, "last": 4, "lr": 0.5, "rank": 1},
                     {"hook": "log", "step": 2, "loss": 1.5},
                     {"hook": "evaluation", "step": 2, "test_loss": 1.0, "test_accuracy": 0.5}]
    assert not (tmp_path / "a").exists()
    with pytest.raises(UsageError) as raised:
        UserCallbacks([Failing()], rank=0, lr=lambda: 0.1).after_step(StepEnd(done=1, last=1))
    assert str(raised.value) == "callback Failing.on_step_end raised RuntimeError: disk full"
