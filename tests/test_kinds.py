"""Kinds are types: schedule kinds, parameter-server and EASGD modes and codec uses are str enums
read once from the names users write, asked by their properties, printed as those names."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from tandem.commands.simulate import SIMULATE_SPELLING, load_plan
from tandem.cluster import parse_cluster
from tandem.errors import UsageError
from tandem.plan import Plan, Stage
from tandem.profile import load_profile
from tandem.schedule import Schedule, generate
from tandem.spec.codec import CodecSpec, CodecUse
from tandem.spec.kinds import CompensationMode, ElasticMode, PsMode, ScheduleKind
from tandem.spec.sync import ElasticAveragingSync, ParameterServerSync, sync_to_dict
from tandem.strategy import plan_from_flags

pytestmark = pytest.mark.pure

SRC = Path(__file__).resolve().parents[1] / "src" / "tandem"
VGG = str(Path(__file__).resolve().parent / "data" / "profiles" / "vgg16.graph.txt")


def test_schedule_kinds_answer_by_property() -> None:
    #                     asynchronous flushes whole_minibatches accumulates forwards_first
    table = {
        ScheduleKind.GPIPE:       (False, True,  False, False, True),
        ScheduleKind.ONE_F_ONE_B: (False, True,  False, True,  False),
        ScheduleKind.PIPEDREAM:   (True,  False, True,  False, False),
    }  # fmt: skip
    for kind, expected in table.items():
        assert (kind.asynchronous, kind.flushes, kind.whole_minibatches, kind.accumulates,
                kind.forwards_first) == expected
    assert [kind.unit for kind in ScheduleKind] == ["micro-batch", "micro-batch", "minibatch"]


def test_modes_answer_by_property() -> None:
    assert [(m.asynchronous, m.bounded) for m in PsMode] == [(False, False), (True, False),
                                                              (True, True)]
    assert [m.asynchronous for m in ElasticMode] == [False, True]
    assert [m.compensates for m in CompensationMode] == [True, False]


@pytest.mark.parametrize("kind", [*ScheduleKind, *PsMode, *ElasticMode, *CompensationMode,
                                  *CodecUse])
def test_a_kind_prints_and_serializes_as_the_name_the_user_wrote(kind: str) -> None:
    name = kind.value
    assert f"{kind}" == str(kind) == "%s" % kind == format(kind, "") == name
    assert f"{kind:>12}" == f"{name:>12}"
    assert json.dumps(kind) == json.dumps(name) and json.dumps({kind: 1}) == json.dumps({name: 1})
    assert kind == name and hash(kind) == hash(name)


def test_names_are_read_once_into_kinds() -> None:
    assert ScheduleKind.parse("gpipe") is ScheduleKind.GPIPE
    assert ScheduleKind.parse("GPipe") is None and PsMode.parse("bsp") is None
    sync = ParameterServerSync(mode="ssp")
    assert sync.mode is PsMode.SSP and sync_to_dict(sync)["mode"] == "ssp"
    assert ElasticAveragingSync(mode="async").mode is ElasticMode.ASYNC
    plan = Plan(stages=[Stage(start=0, end=2, replicas=1), Stage(start=2, end=4, replicas=1)],
                num_layers=4, num_devices=2, schedule="pipedream")
    assert plan.schedule is ScheduleKind.PIPEDREAM and plan.num_microbatches == 1
    assert generate("gpipe", [2, 1], 4).kind is ScheduleKind.GPIPE
    assert Schedule.parse(generate("1f1b", [1, 1], 2).text()).kind is ScheduleKind.ONE_F_ONE_B


def test_unknown_names_are_one_line_errors_naming_the_known_ones() -> None:
    with pytest.raises(UsageError, match=r"^--mode 'bsp' is not one of: sync, async, ssp$"):
        ParameterServerSync(mode="bsp")
    with pytest.raises(UsageError, match=r"^schedule 'zb' is not one of: gpipe, 1f1b, pipedream$"):
        Plan(stages=[Stage(start=0, end=1, replicas=1)], num_layers=1, num_devices=1,
             schedule="zb")


def test_a_plan_file_is_byte_for_byte_what_the_names_wrote(tmp_path: Path) -> None:
    plan = plan_from_flags("pipeline", {"--schedule": "pipedream", "--stages": 2},
                           num_processes=2, num_blocks=4)
    ps = plan_from_flags("ps", {"--mode": "ssp", "--staleness": 3}, num_processes=3,
                         num_blocks=4)
    for one in (plan, ps):
        path = tmp_path / "plan.json"
        one.save(str(path))
        text = path.read_text()
        assert Plan.from_dict(json.loads(text)).to_dict() == json.loads(text)
        assert '"schedule": "' + one.schedule.value + '"' in text
    assert '"mode": "ssp"' in path.read_text()


def test_codec_uses_replace_tables_keyed_by_strategy_names() -> None:
    topk = CodecSpec.parse("topk:k=0.1")
    assert topk.given == {"ratio"} and topk.options_for(CodecUse.GRADIENTS).ef
    assert not topk.options_for(CodecUse.PARAMETERS).ef  # gossip and pipelines: no feedback
    assert not topk.options_for(CodecUse.ACTIVATIONS).ef
    with pytest.raises(UsageError, match="drop ef="):
        CodecSpec.parse("sign:ef=true").options_for(CodecUse.PARAMETERS)
    with pytest.raises(UsageError, match=r"randk cannot be used with --strategy pipeline"):
        CodecSpec.parse("randk").options_for(CodecUse.ACTIVATIONS)
    assert CodecUse.parse("easgd") is None and CodecUse.parse("ps") is CodecUse.PUSHES


def test_simulate_builds_its_plan_as_train_does() -> None:
    profile, cluster = load_profile(VGG), parse_cluster("5x10Gb/s")
    names = ("servers", "mode", "staleness", "staleness_lr", "backup", "topology", "weights",
             "async_gossip", "gossip_step", "period", "rho", "nesterov")
    args = argparse.Namespace(**dict.fromkeys(names), codec="fp16")
    args.servers, args.mode = 1, "async"
    simulated = load_plan("ps", profile, cluster, args)
    trained = plan_from_flags("ps", {"--servers": 1, "--mode": "async", "--compress": "fp16"},
                              num_processes=5, num_blocks=profile.num_layers)
    assert simulated.to_dict() == {**trained.to_dict(),
                                   "layer_order": simulated.layer_order}
    args.servers, args.mode = 5, None
    with pytest.raises(UsageError, match=r"^--servers 5 leaves no workers in --devices 5"):
        load_plan("ps", profile, cluster, args)
    assert SIMULATE_SPELLING.strategy == "--plan"


def test_no_name_string_chooses_behaviour_outside_the_parsing_module() -> None:
    """``"pipedream"`` and ``mode == "..."`` appear in tandem.spec.kinds alone."""
    found = [f"{path.relative_to(SRC)}:{number}"
             for path in sorted(SRC.rglob("*.py")) if path.name != "kinds.py"
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if '"pipedream"' in line or re.search(r'mode == "', line)]
    assert found == []


def test_a_plans_codec_is_built_from_its_spec_not_its_text(monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.compress import build_codec, build_compression
    from tandem.compress.feedback import ErrorFeedback

    spec = CodecSpec.parse("topk:ratio=0.25")

    def reparse(cls: type, text: str) -> CodecSpec:
        raise AssertionError(f"{text!r} parsed again")

    monkeypatch.setattr(CodecSpec, "parse", classmethod(reparse))
    gradients = build_compression(spec)
    assert isinstance(gradients, ErrorFeedback) and gradients.spec == "topk:ratio=0.25"
    activations = build_codec(spec, strategy=CodecUse.ACTIVATIONS)
    assert not isinstance(activations, ErrorFeedback)  # pipelines run codecs without feedback
