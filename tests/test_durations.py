"""Every duration option takes units (``1ms``, ``20us``, ``0.5s``) or bare seconds, and says in
one line what it could not read (issue 15, deliverable 7)."""

from __future__ import annotations

import json

import pytest

from tandem.cluster import parse_duration
from tandem.errors import UsageError
from tests.conftest import VGG, run_cli


@pytest.mark.pure
@pytest.mark.parametrize(("text", "seconds"), [
    ("1ms", 1e-3), ("20us", 20e-6), ("0.5s", 0.5), ("300", 300.0), ("0", 0.0), ("2e-3s", 2e-3),
    ("7ns", 7e-9), (" 5 ms ", 5e-3), (0.25, 0.25),
])
def test_durations_read_with_and_without_units(text: str, seconds: float) -> None:
    assert parse_duration(text, "--x") == pytest.approx(seconds, rel=1e-12)


@pytest.mark.pure
@pytest.mark.parametrize(("text", "words"), [
    ("5xs", "--x '5xs' is not a duration; write seconds or a number with a unit (s, ms, us, "
            "ns), e.g. --x 1ms"),
    ("-1ms", "is not a duration"), ("-2", "must be a finite duration of at least 0"),
    ("inf", "must be a finite duration"), ("fast", "is not a duration"),
])
def test_bad_durations_are_one_line(text: str, words: str) -> None:
    with pytest.raises(UsageError, match=None) as caught:
        parse_duration(text, "--x")
    assert words in str(caught.value) and "\n" not in str(caught.value)


def _simulated(capsys: pytest.CaptureFixture[str], *extra: str) -> dict:
    code, out, err = run_cli(capsys, "simulate", "--plan", "dp", "--profile", VGG, "--devices",
                             "4", "--bandwidth", "10Gb/s", "--profile-batch", "128", *extra,
                             "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.mark.pure
def test_simulate_takes_overhead_and_allreduce_latency_with_or_without_units(
        capsys: pytest.CaptureFixture[str]) -> None:
    plain = _simulated(capsys)
    with_units = _simulated(capsys, "--overhead", "2ms", "--allreduce-latency", "50us")
    in_seconds = _simulated(capsys, "--overhead", "0.002", "--allreduce-latency", "0.00005")
    assert with_units == in_seconds
    assert with_units["step_time_s"] > plain["step_time_s"]


@pytest.mark.pure
@pytest.mark.parametrize(("flag", "value"), [("--overhead", "2 parsecs"),
                                             ("--allreduce-latency", "fast")])
def test_simulate_refuses_an_unreadable_duration_in_one_line(
        capsys: pytest.CaptureFixture[str], flag: str, value: str) -> None:
    code, out, err = run_cli(capsys, "simulate", "--plan", "dp", "--profile", VGG, "--devices",
                             "4", "--bandwidth", "10Gb/s", flag, value)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert f"{flag} {value!r} is not a duration" in err


@pytest.mark.multiprocess
def test_train_timeout_takes_units(capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.cli import build_parser
    from tandem.commands.train import job_from_args

    args = build_parser().parse_args(["train", "--timeout", "5000ms", "--steps", "2"])
    assert job_from_args(args).run.timeout_s == 5.0
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(["train", "--timeout", "5 minutes"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "--timeout '5 minutes' is not a duration" in err and len(err.strip().splitlines()) == 1


@pytest.mark.pure
def test_simulate_reports_samples_per_s_when_the_profile_batch_is_given(
        capsys: pytest.CaptureFixture[str]) -> None:
    """PipeDream's graph.txt records no minibatch; with ``--profile-batch`` it is known (issue
    15: ``samples_per_s`` was null)."""
    result = _simulated(capsys)
    assert result["samples_per_s"] == pytest.approx(128 / result["step_time_s"], rel=1e-9)
    scaled = _simulated(capsys, "--batch-size", "256")
    assert scaled["samples_per_s"] == pytest.approx(256 / scaled["step_time_s"], rel=1e-9)
