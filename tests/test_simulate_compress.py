"""The simulator's gradient codecs: payloads against the real codecs, allgather costs worked out
by hand, a data-parallel step with encode and decode drawn as a table, and one-line errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tandem.cluster import Cluster, Level
from tandem.compress import Codec, build_compression, payload_bytes
from tandem.errors import UsageError
from tandem.planning.simulate.codecs import CodecSpeed, matrix_shape, parse_codec, powersgd_elements
from tandem.planning.simulate.collectives import allgather_s, collective_s, ring_allgather_s
from tandem.planning.simulate.replay import overlapped_sync_s
from tandem.planning.simulate.simulator import SimOptions, data_parallel_plan, simulate
from tests.conftest import VGG, run_cli
from tests.test_simulate import drawn, flat, normalized, profile, table, two_level

SIZES = [1, 7, 100, 513, 4097, 100_003]
SPECS = ["fp16", "bf16", "qsgd", "qsgd:levels=1", "qsgd:levels=127,chunk=100", "qsgd:levels=3",
         "sign", "sign:ef=false", "topk:ratio=0.01", "topk:k=0.3", "randk:ratio=0.05"]


# -- the model against the real codecs ----------------------------------------------------------

@pytest.mark.pure
@pytest.mark.parametrize("spec", SPECS)
def test_payload_bytes_match_the_real_codecs(spec: str) -> None:
    codec = build_compression(spec)
    assert isinstance(codec, Codec)
    model = parse_codec(spec)
    assert model.collective == ("allreduce" if codec.summable else "allgather")
    for n in SIZES:
        sent = codec.encode(torch.randn(n), f"t{n}")
        assert model.payload_bytes(n) == payload_bytes(sent), (spec, n)


@pytest.mark.pure
@pytest.mark.parametrize("spec", ["qsgd:levels=0", "qsgd:norm=l1", "sign:ef=false,momentum=0.9",
                                  "topk:ratio=0", "topk:k=0.1,ratio=0.1", "powersgd:start=1",
                                  "fp16:ratio=2", "randk:seed=x"])
def test_options_are_rejected_alike(spec: str) -> None:
    with pytest.raises(UsageError):
        build_compression(spec)
    with pytest.raises(UsageError):
        parse_codec(spec)


@pytest.mark.pure
def test_powersgd_follows_pytorchs_rule() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    for rows, cols in [(64, 27), (512, 4608), (4096, 25088), (10, 10), (3, 1000), (1, 5)]:
        for rank, min_rate in [(1, 2.0), (2, 2.0), (4, 8.0), (64, 2.0)]:
            r = min(rank, rows, cols)
            compress, before, _ = _should_compress(rows, cols, r, min_rate)
            expected = (0, rows * r, cols * r) if compress else (before, 0, 0)
            assert powersgd_elements(rows, cols, rank, min_rate) == expected
    # A tensor of 2,359,296 elements is taken as 768 x 3072 (4 times more columns than rows).
    assert matrix_shape(2_359_296) == (768, 3072)
    model = parse_codec("powersgd:rank=2")
    # Three rounds: the 100-element tensor whole (5 x 20 would not shrink 2 times), then P
    # (768 x 2), then Q (3072 x 2).
    assert model.rounds([2_359_296, 100]) == [("allreduce", 4 * 100), ("allreduce", 4 * 1536),
                                              ("allreduce", 4 * 6144)]


@pytest.mark.pure
def test_encode_and_decode_time() -> None:
    speed = CodecSpeed(encode_ns=2.0, decode_ns=0.5)
    sign, fp16 = parse_codec("sign", speed), parse_codec("fp16", speed)
    # 1e9 elements: 2 s to encode; decoding reads every worker's message for an allgather codec.
    assert sign.encode_s([10**9]) == pytest.approx(2.0)
    assert sign.decode_s([10**9], num_workers=16) == pytest.approx(8.0)
    assert fp16.decode_s([10**9], num_workers=16) == pytest.approx(0.5)
    assert sign.encode_s([10**9], speedup=100) == pytest.approx(0.02)
    # PowerSGD's time grows with its rank (defaults are at rank 2).
    assert parse_codec("powersgd:rank=8", speed).encode_s([10**9]) == pytest.approx(8.0)


# -- collectives ---------------------------------------------------------------------------------

@pytest.mark.pure
def test_allgather_formulas() -> None:
    # Ring over 4 devices, 400 bytes each, 100 B/s, 10 ms: 3 * (0.01 + 400 / 100) = 12.03 s.
    assert ring_allgather_s(4, 400, 0.01, 100) == pytest.approx(12.03)
    cluster = two_level()  # 2 servers of 4: 1000 B/s (1 ms) inside, 100 B/s (10 ms) between
    # Hierarchical on 2 x 4, 100 bytes each: across the servers every device exchanges its own
    # payload with its peer, the 4 devices of a server sharing its port (1 step of 4 x 100
    # bytes); then inside each server the 2 payloads each device holds: 3 steps of 2 x 100.
    across, inside = 1 * (0.01 + 400 / 100), 3 * (0.001 + 200 / 1000)
    assert allgather_s(cluster, range(8), 100, "hierarchical") == pytest.approx(across + inside)
    # A flat ring over the 8 devices crosses the slow link in each of its 7 steps.
    assert allgather_s(cluster, range(8), 100, "ring") == pytest.approx(7 * (0.01 + 1.0))
    assert allgather_s(cluster, range(8), 100, "tree") == pytest.approx(7 * 1.01)
    assert allgather_s(cluster, range(8), 100) == pytest.approx(across + inside)
    assert allgather_s(cluster, [5], 100) == 0.0
    assert collective_s(cluster, "allgather", range(4), 100, "ring") == pytest.approx(3 * 0.101)
    # Inside one server: 3 steps of 100 bytes at 1000 B/s.
    assert collective_s(cluster, "allreduce", range(4), 400, "ring") == pytest.approx(6 * 0.101)


@pytest.mark.pure
def test_overlapped_sync_without_codec_work_is_ddps() -> None:
    # Buckets ready 2 s and 4 s into a 4 s backward, 1 s collectives: the second ends at 5.
    assert overlapped_sync_s(4, [(2, 1), (4, 1)], [(0, 0), (0, 0)]) == 5


# -- a data-parallel step -------------------------------------------------------------------------

# Two layers of 100 float32 parameters (400 bytes); per minibatch forward 2 s and backward 4 s
# each. Two replicas each run half the batch: forward 1 s and backward 2 s per layer.
TINY = profile((2, 4, 10, 400), (2, 4, 10, 400))
# Encoding 100 elements takes 1 s; decoding one message of 100 elements 0.5 s.
SLOW = CodecSpeed(encode_ns=1e7, decode_ns=5e6)


@pytest.mark.pure
def test_data_parallel_step_with_an_allgather_codec() -> None:
    # topk:ratio=0.25 keeps 25 of each layer's 100 elements: 200 bytes (values and indices) per
    # bucket, allgathered over 2 devices at 100 B/s: 1 * 200 / 100 = 2 s. Each bucket encodes in
    # 1 s and decodes the 2 workers' messages in 2 * 0.5 = 1 s.
    plan = data_parallel_plan(TINY, 2)
    options = SimOptions(num_steps=1, bucket_bytes=400, compress="topk:ratio=0.25",
                         codec_speed=SLOW)
    result = simulate(plan, TINY, flat(2), options)
    # The backward starts at 2 and produces layer 1's bucket at 4: its encode runs 4..5 (the
    # backward waits), its allgather 5..7, its decode 7..8 (the backward, resumed at 5, is
    # done at 7 and produces layer 0's bucket then; its encode runs after the decode that came
    # due at 7). Layer 0's bucket: encode 8..9, allgather 9..11, decode 11..12.
    assert normalized(table(result)) == normalized(drawn("""
        w  action  start  end
        0  F0      0      2
        0  B0      2      6
        0  AR      6      12
        1  F1      0      2
        1  B1      2      6
        1  AR      6      12
    """))
    assert result.step_time_s == 12
    assert result.communication_s == 4 and result.codec_s == 4
    assert result.workers[0].busy_s == 6 and result.workers[0].idle_s == 2
    # Blocking (as a pipeline's replicated stage): backward to 6, encode both layers (2 s),
    # allgather 400 bytes (4 s), decode 2 messages of 200 elements (2 s).
    blocking = simulate(plan, TINY, flat(2), dataclasses.replace(options, overlap_allreduce=False))
    assert blocking.step_time_s == 14


@pytest.mark.pure
def test_free_allreduce_codec_is_a_ratio() -> None:
    # fp16 encoding in no time is the old ratio 2, overlapped or not.
    plan = data_parallel_plan(TINY, 2)
    free = CodecSpeed(encode_ns=0, decode_ns=0)
    for overlap in (True, False):
        base = SimOptions(num_steps=1, bucket_bytes=400, overlap_allreduce=overlap)
        codec = simulate(plan, TINY, flat(2),
                         dataclasses.replace(base, compress="fp16", codec_speed=free))
        ratio = simulate(plan, TINY, flat(2), dataclasses.replace(base, gradient_compression=2))
        assert codec.step_time_s == pytest.approx(ratio.step_time_s)
        assert codec.communication_s == pytest.approx(ratio.communication_s)


@pytest.mark.pure
def test_device_speed_and_speedup_scale_codec_time() -> None:
    plan = data_parallel_plan(TINY, 2)
    fast = Cluster(levels=(Level(num_units=2, bandwidth_Bps=100.0),), speed=2.0)
    options = SimOptions(num_steps=1, bucket_bytes=400, compress="topk:ratio=0.25",
                         codec_speed=SLOW, codec_speedup=2)
    # Encode and decode run 2 x 2 = 4 times faster: 4 s of codec work becomes 1 s.
    assert simulate(plan, TINY, fast, options).codec_s == pytest.approx(1.0)
    assert simulate(data_parallel_plan(TINY, 1), TINY, flat(1), options).codec_s == 0


@pytest.mark.pure
def test_codec_and_ratio_are_exclusive() -> None:
    with pytest.raises(UsageError, match="not both"):
        SimOptions(compress="sign", gradient_compression=2)
    with pytest.raises(UsageError, match="speed-up"):
        SimOptions(compress="sign", codec_speedup=0)


# -- command line -------------------------------------------------------------------------------

@pytest.mark.pure
def test_simulate_cli_with_a_codec(capsys) -> None:
    argv = ["simulate", "--plan", "dp", "--profile", VGG, "--devices", "16", "--bandwidth",
            "10Gb/s", "--profile-batch", "128", "--batch-size", "2048", "--json"]
    code, out, err = run_cli(capsys, *argv)
    plain = json.loads(out)
    code, out, err = run_cli(capsys, *argv, "--compress", "topk:ratio=0.01",
                             "--codec-speedup", "100")
    assert code == 0, err
    topk = json.loads(out)
    assert topk["codec_s"] > 0 and topk["communication_s"] < plain["communication_s"] / 5
    assert "encode+decode" in err


@pytest.mark.pure
@pytest.mark.parametrize(("codec", "words"), [
    ("zip", "unknown codec 'zip'"),
    ("topk:ratio=2", "ratio (k) must be in (0, 1]"),
    ("sign:bits=2", "unknown codec option 'bits'"),
])
def test_simulate_cli_rejects_bad_codecs(capsys, codec: str, words: str) -> None:
    code, out, err = run_cli(capsys, "simulate", "--plan", "dp", "--profile", VGG, "--devices",
                             "2", "--bandwidth", "10Gb/s", "--compress", codec)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert words in err


@pytest.mark.pure
def test_scale_cli_with_codecs(capsys) -> None:
    code, out, err = run_cli(capsys, "scale", "--profile", VGG, "--cluster", "8x10Gb/s",
                             "--max-devices", "8", "--compress", "2,topk:ratio=0.01,ef=false",
                             "--plot", "none", "--json")
    assert code == 0, err
    strategies = {p["strategy"] for p in json.loads(out)["points"]}
    assert {"dp", "dp+2x", "dp+topk:ratio=0.01,ef=false"} <= strategies


@pytest.mark.pure
def test_search_cli_with_a_codec(capsys) -> None:
    """The search costs every plan with the codec: its data-parallel reference is the
    simulator's data-parallel step with that codec."""
    argv = ["--profile", VGG, "--devices", "4", "--bandwidth", "10Gb/s", "--iterations", "5",
            "--json"]
    codec = ["--compress", "topk:ratio=0.01", "--codec-speedup", "100"]
    code, out, err = run_cli(capsys, "search", *argv, *codec)
    assert code == 0, err
    found = json.loads(out)
    code, out, err = run_cli(capsys, "simulate", "--plan", "dp", *argv[:6], *codec, "--json")
    assert code == 0, err
    simulated = json.loads(out)
    assert found["data_parallel"]["result"]["step_time_s"] == pytest.approx(
        simulated["step_time_s"])
    code, out, err = run_cli(capsys, "search", *argv, "--compress", "zip")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "unknown codec 'zip'" in err
