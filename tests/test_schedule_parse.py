"""Reading schedules written by hand: anything malformed is a ``ScheduleParseError`` (a
``ValueError``, as ``--schedule FILE`` and plans expect) naming the bad text and the fix, also
under ``python -O`` where ``assert`` is gone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tandem.errors import UsageError
from tandem.schedule import Action, Kind, Schedule, ScheduleParseError
from tests.conftest import ROOT

GOOD = "gpipe replicas=1-1 microbatches=1\nw0: 0F0 0SA0>1 0RG0<1 0B0 0ST\nw1: 1RA0<0 1F0 1B0 1SG0>0 1ST"

MALFORMED = {
    "": "empty schedule: its first line must be like '1f1b replicas=2-1 microbatches=4'",
    "gpipe replicas=1-1": "schedule header 'gpipe replicas=1-1' is not like '1f1b replicas=2-1 "
                          "microbatches=4'",
    "gpipe replicas=1-x microbatches=1\nw0: 0F0": "schedule header 'gpipe replicas=1-x "
                                                 "microbatches=1' is not like",
    "gpipe stages=2 microbatches=1\nw0: 0F0": "schedule header 'gpipe stages=2 microbatches=1'",
    "zigzag replicas=1 microbatches=1\nw0: 0F0 0B0 0ST": "unknown schedule kind 'zigzag' (known: "
                                                         "gpipe, 1f1b, pipedream)",
    "gpipe replicas=1-0 microbatches=1\nw0: 0F0": "every stage needs at least one replica "
                                                  "(replicas: 1-0)",
    "gpipe replicas=1 microbatches=0\nw0: 0ST": "a schedule needs at least one micro-batch "
                                                "(microbatches: 0)",
    "gpipe replicas=1-1 microbatches=1\nw0: 0F0 0B0 0ST": "replicas 1-1 make 2 workers but the "
                                                          "schedule lists 1; write one line per "
                                                          "worker, w0 to w1",
    "gpipe replicas=1 microbatches=1\n0F0 0B0 0ST": "schedule line '0F0 0B0 0ST' should be "
                                                    "worker 0's: 'w0: ' and its actions",
    "gpipe replicas=1 microbatches=1\nw1: 0F0 0B0 0ST": "schedule line 'w1: 0F0 0B0 0ST' should "
                                                        "be worker 0's",
    "gpipe replicas=1 microbatches=1\nw0: 0F0 0X0 0ST": "w0: not a schedule action: '0X0' "
                                                        "(expected e.g. 2F0, 1SA3>2",
    "gpipe replicas=1 microbatches=1\nw0: 0F 0B0 0ST": "w0: action '0F': a forward needs a "
                                                       "micro-batch (e.g. 0F0)",
    "gpipe replicas=1-1 microbatches=1\nw0: 0F0 0SA0 0B0 0ST\nw1: 1ST":
        "w0: action '0SA0': sends take '>peer' (1SA3>2), receives '<peer' (2RA3<1)",
    "gpipe replicas=1-1 microbatches=1\nw0: 0F0 0B0 0ST\nw1: 1RA0>0 1ST":
        "w1: action '1RA0>0': sends take '>peer'",
    "gpipe replicas=1 microbatches=1\nw0: 0F0>1 0B0 0ST": "w0: action '0F0>1': sends take",
}


@pytest.mark.pure
@pytest.mark.parametrize("text", sorted(MALFORMED))
def test_malformed_schedules_are_one_clear_line(text: str) -> None:
    with pytest.raises(ScheduleParseError) as caught:
        Schedule.parse(text)
    assert isinstance(caught.value, UsageError) and isinstance(caught.value, ValueError)
    message = str(caught.value)
    assert MALFORMED[text] in message
    assert "\n" not in message


@pytest.mark.pure
def test_actions_built_in_code_are_checked_too() -> None:
    cases = {
        (0, Kind.SEND_ACT, 3, None): "action '0SA3': a send of an activation needs its peer worker "
                                            "(e.g. 0SA3>1)",
        (0, Kind.FORWARD, 3, 1): "a forward of stage 0 takes no peer (peer: 1)",
        (0, Kind.BACKWARD, None, None): "action '0B': a backward needs a micro-batch (e.g. 0B0)",
        (-1, Kind.FORWARD, 0, None): "the stage of a forward must be a whole number of 0 or more "
                                     "(got -1)",
    }
    for (stage, kind, microbatch, peer), expected in cases.items():
        with pytest.raises(ScheduleParseError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            Action(stage, kind, microbatch, peer)


@pytest.mark.pure
def test_a_good_schedule_still_parses() -> None:
    schedule = Schedule.parse(GOOD)
    assert schedule.text() == GOOD
    assert Schedule.parse("\n  " + GOOD.replace("\n", "\n\n  ") + "\n") == schedule


_SCRIPT = """
import json, sys
from tandem.schedule import Schedule
out = []
for text in json.load(sys.stdin):
    try:
        Schedule.parse(text)
        out.append(None)
    except Exception as error:
        out.append([type(error).__name__, str(error)])
print(json.dumps(out))
"""


@pytest.mark.cli
def test_the_same_errors_under_python_O() -> None:
    """``python -O`` strips ``assert``: parsing must not rely on it."""
    texts = sorted(MALFORMED)
    result = subprocess.run([sys.executable, "-O", "-c", _SCRIPT], input=json.dumps(texts),
                            capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    expected = []
    for text in texts:
        with pytest.raises(ScheduleParseError) as caught:
            Schedule.parse(text)
        expected.append(["ScheduleParseError", str(caught.value)])
    assert json.loads(result.stdout) == expected
