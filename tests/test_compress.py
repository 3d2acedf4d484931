"""Codecs alone: round trips, payload sizes, QSGD's unbiasedness, error feedback's identity."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.compress import CODECS, Codec, ErrorFeedback, build_compression, payload_bytes
from tandem.compress.bits import pack, unpack
from tandem.compress.qsgd import QSGD
from tandem.errors import UsageError

pytestmark = pytest.mark.pure


def codec(spec: str) -> Codec:
    built = build_compression(spec)
    assert isinstance(built, Codec)
    return built


def dyadic(generator: torch.Generator, n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Integers in [-64, 64] / 64: sums, halvings and means over 2^j elements stay exact."""
    return (torch.randint(-64, 65, (n,), generator=generator) / 64).to(dtype)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_bit_packing_round_trips(bits: int) -> None:
    codes = torch.randint(0, 1 << bits, (37,), generator=torch.Generator().manual_seed(bits))
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(37 * bits / 8)
    assert torch.equal(unpack(packed, bits, 37).long(), codes)


# spec -> payload bytes of a 1,000-element float32 tensor
PAYLOAD_BYTES = {
    "fp16": 2000,
    "bf16": 2000,
    "sign": 125 + 4,                      # 1 bit each, one float32 scale
    "topk:ratio=0.01": 10 * (4 + 4),      # value and int32 index
    "randk:ratio=0.01": 10 * 4,           # values only: positions come from a shared seed
    "qsgd:levels=7": 500 + 2 * 4,         # 15 codes in 4 bits, one norm per 512-element chunk
    "qsgd:levels=1,chunk=1000": 250 + 4,  # 3 codes in 2 bits
    "qsgd:levels=16": 1000 + 2 * 4,       # 33 codes in 8 bits
}


@pytest.mark.parametrize("spec", sorted(PAYLOAD_BYTES))
def test_payload_sizes(spec: str) -> None:
    grad = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert payload_bytes(codec(spec).encode(grad, "w")) == PAYLOAD_BYTES[spec]


@pytest.mark.parametrize(("spec", "tolerance"), [("fp16", 1e-3), ("bf16", 1e-2),
                                                 ("topk:ratio=1,ef=false", 0.0),
                                                 ("randk:ratio=1,ef=false", 0.0)])
def test_lossless_or_nearly(spec: str, tolerance: float) -> None:
    grad = torch.randn(5, 7, generator=torch.Generator().manual_seed(1))
    c = codec(spec)
    decoded = c.decode(c.encode(grad, "w"), grad, "w")
    assert decoded.shape == grad.shape and decoded.dtype == grad.dtype
    assert torch.allclose(decoded, grad, rtol=tolerance, atol=0.0)


def test_topk_keeps_the_largest_magnitudes() -> None:
    grad = torch.tensor([0.1, -5.0, 0.2, 3.0, -0.3, 0.0, 1.0, -0.05])
    c = codec("topk:ratio=0.25,ef=false")
    assert c.decode(c.encode(grad, "w"), grad, "w").tolist() == [0, -5.0, 0, 3.0, 0, 0, 0, 0]


def test_sign_sends_signs_scaled_to_the_l1_norm() -> None:
    grad = torch.tensor([[0.5, -1.5], [0.0, -2.0]])
    c = codec("sign:ef=false")
    assert c.decode(c.encode(grad, "w"), grad, "w").tolist() == [[1.0, -1.0], [1.0, -1.0]]


def test_random_k_positions_agree_across_workers_and_change_every_step() -> None:
    grad = torch.arange(100.0)
    workers = [codec("randk:ratio=0.1,ef=false,seed=7") for _ in range(2)]
    steps = [[set(w.encode(grad, "layer.weight")[0].tolist()) for w in workers] for _ in range(2)]
    assert steps[0][0] == steps[0][1] and steps[1][0] == steps[1][1]
    assert steps[0][0] != steps[1][0] and len(steps[0][0]) == 10


@pytest.mark.parametrize("options", ["levels=4,norm=l2", "levels=1,norm=max", "levels=16,norm=l2"])
def test_qsgd_is_unbiased(options: str) -> None:
    """The mean of 20,000 independent encodings of x is within 5 standard errors of x."""
    x = torch.randn(64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    draws = 20_000
    c = codec(f"qsgd:{options},chunk=64,seed=11")
    assert isinstance(c, QSGD)
    copies = x.repeat(draws)
    decoded = c.decode(c.encode(copies, "x"), copies, "x").view(draws, 64)
    # Exact variance of one encoding: (norm / s)^2 p (1 - p), p the fractional part of |x|/norm*s.
    norm = x.norm() if c.norm == "l2" else x.abs().max()
    scaled = x.abs() / norm * c.levels
    p = scaled - scaled.floor()
    standard_error = (norm / c.levels) * torch.sqrt(p * (1 - p) / draws)
    error = (decoded.mean(0) - x).abs()
    assert bool((error <= 5 * standard_error + 1e-12).all()), (error / standard_error).max()
    assert float(decoded.var(0).sum()) > 0  # it does quantize


def test_qsgd_draws_differ_between_workers() -> None:
    x = torch.randn(256, generator=torch.Generator().manual_seed(0))
    a, b = codec("qsgd:levels=2"), codec("qsgd:levels=2")
    a.start(0, 2)
    b.start(1, 2)
    assert not torch.equal(a.encode(x, "x")[0], b.encode(x, "x")[0])


EF_SPECS = ["sign", "topk:ratio=0.1", "randk:ratio=0.1", "sign:momentum=0.5",
            "topk:ratio=0.1,momentum=0.5", "randk:ratio=0.25,momentum=0.75",
            "qsgd:levels=4,norm=max,chunk=16,ef=true"]


@pytest.mark.parametrize("spec", EF_SPECS)
def test_error_feedback_sends_the_sum_of_gradients_minus_the_residual_exactly(spec: str) -> None:
    """sum(sent) == sum(g) - residual, bit for bit (with momentum: sum(u) - residual, u the
    velocity, masked where sent for sparse codecs). Dyadic gradients keep float64 exact."""
    c = codec(spec)
    assert isinstance(c, ErrorFeedback)
    generator = torch.Generator().manual_seed(5)
    keys = ["a.weight", "b.bias"]
    sent = {key: torch.zeros(16, dtype=torch.float64) for key in keys}
    fed = {key: torch.zeros(16, dtype=torch.float64) for key in keys}
    velocity = {key: torch.zeros(16, dtype=torch.float64) for key in keys}
    for _ in range(8):
        for key in keys:
            grad = dyadic(generator, 16)
            velocity[key] = velocity[key] * c.momentum_correction + grad
            update = velocity[key] if c.momentum_correction else grad
            message = c.decode(c.encode(grad, key), grad, key)
            sent[key] += message
            fed[key] += update
            if c.masking:
                velocity[key][message != 0] = 0.0
    for key in keys:
        assert torch.equal(sent[key], fed[key] - c.residuals[key]), key
        assert float(c.residuals[key].abs().sum()) > 0  # something was held back


def test_error_feedback_identity_holds_to_rounding_on_float32() -> None:
    c = codec("sign")
    generator = torch.Generator().manual_seed(0)
    sent, total = torch.zeros(300, dtype=torch.float64), torch.zeros(300, dtype=torch.float64)
    for _ in range(50):
        grad = torch.randn(300, generator=generator)
        sent += c.decode(c.encode(grad, "w"), grad, "w").double()
        total += grad.double()
    assert torch.allclose(sent, total - c.residuals["w"].double(), atol=1e-4)


@pytest.mark.parametrize("spec", EF_SPECS)
def test_error_feedback_does_not_modify_the_gradient(spec: str) -> None:
    grad = torch.randn(50, generator=torch.Generator().manual_seed(0))
    before = grad.clone()
    c = codec(spec)
    for _ in range(3):
        c.encode(grad, "w")
    assert torch.equal(grad, before)


def test_decode_mean_averages_the_workers_messages() -> None:
    grads = [torch.randn(40, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    for spec in ("topk:ratio=0.2,ef=false", "sign:ef=false", "qsgd:levels=3"):
        c = codec(spec)
        payloads = [c.encode(g, "w") for g in grads]
        expected = sum(c.decode(p, grads[0], "w") for p in payloads) / 3
        assert torch.allclose(c.decode_mean(payloads, grads[0], "w"), expected, atol=1e-6), spec


@pytest.mark.parametrize(("spec", "message"), [
    ("zip", "unknown codec 'zip' in --compress 'zip'; choose one of: " + ", ".join(sorted(CODECS))),
    ("topk:ratio=0", "ratio (k) must be in (0, 1] (got 0.0)"),
    ("topk:k=1.5", "ratio (k) must be in (0, 1] (got 1.5)"),
    ("randk:ratio=-0.1", "ratio (k) must be in (0, 1] (got -0.1)"),
    ("topk:k=0.1,ratio=0.1", "give k or ratio"),
    ("topk:ratio=abc", "codec option ratio='abc' in 'topk:ratio=abc' is not a valid float"),
    ("qsgd:levels=200", "levels must be between 1 and 127 (got 200)"),
    ("qsgd:norm=l1", "norm must be l2 or max"),
    ("sign:ratio=0.1", "unknown codec option 'ratio' in 'sign:ratio=0.1'; valid options: ef, mom"),
    ("fp16:x=1", "unknown codec option 'x'"),
    ("topk:momentum=0.9,ef=false", "momentum before compression needs error feedback"),
    ("sign:momentum=0.9,ef=false", "momentum before compression needs error feedback"),
    ("powersgd:start=1", "start must be at least 2"),
    ("powersgd:rank=0", "rank must be at least 1"),
])
def test_bad_specs_are_usage_errors(spec: str, message: str) -> None:
    with pytest.raises(UsageError) as raised:
        build_compression(spec)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_every_registered_codec_builds_with_its_defaults() -> None:
    for name in CODECS:
        assert build_compression(name).spec == name
