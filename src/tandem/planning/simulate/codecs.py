"""A cost model of gradient codecs: what they send, how, and their encode and decode time.

Usage::

    codec = codec_model(plan.compress)          # or parse_codec("topk:ratio=0.01")
    codec.collective                             # "allgather"
    codec.payload_bytes(1_000_000)               # 80,000: float32 values and int32 indices
    codec.rounds([2_359_808, 512])               # [("allgather", bytes)]: one bucket's exchange
    codec.encode_s([2_359_808, 512]), codec.decode_s([2_359_808, 512], num_workers=16)

A spec is written as for ``tandem train --compress`` and read by the same code
(:mod:`tandem.spec.codec`, which imports no torch); a test checks the payload sizes against the
real codecs'.

Payloads are those of float32 gradients, per tensor of ``n`` elements (``k = ceil(ratio n)``):

============  ==========  ===================================================================
codec         collective  bytes per worker
============  ==========  ===================================================================
fp16, bf16    allreduce   ``2 n``
qsgd          allgather   ``n`` codes of 2, 4 or 8 bits (``2 levels + 1`` values), packed,
                          and a float32 norm per ``chunk`` elements
sign          allgather   ``ceil(n / 8)`` (one bit each) ``+ 4`` (the scale)
topk          allgather   ``8 k`` (float32 values and int32 indices)
randk         allreduce   ``4 k`` (values; the positions are drawn alike on every worker)
powersgd      allreduce   three rounds: tensors too small to gain ``min_rate`` uncompressed,
                          then ``P`` (``rows x rank``), then ``Q`` (``cols x rank``)
============  ==========  ===================================================================

PowerSGD needs each gradient's matrix shape, which a profile does not record (only a layer's
parameter bytes): a tensor of ``n`` elements is taken as one matrix with ``POWERSGD_ASPECT``
times more columns than rows (``rows = sqrt(n / 4)``): a 3x3 convolution that doubles its
channels has 4.5 (``9 C_in / C_out``), a square linear layer 1, VGG-16's first linear layer 6.
Its steady state is modelled: the first ``start`` steps of plain allreduce are not.

Encode and decode take ``elements x nanoseconds per element``, divided by the device's speed
and by a speed-up the caller gives. Encoding covers what the runtime's DDP hook does before its
collective (the division by the number of workers for summable codecs, error feedback, which
decodes the message to keep the residual, and the serialization of allgathered payloads);
decoding covers what it does after: allgather codecs decode every worker's message (``W``
messages of ``n`` elements each), the others one summed message. ``DEFAULT_SPEEDS`` were
measured on this project's machine, on one CPU thread, by ``benchmarks/compression_sim.py``
(tensors shaped like VGG-16's convolutions, 16 messages); they are the codecs' speeds at their
default options (PowerSGD's grows with its rank; other options are taken not to matter).

What it does not model: payload sizes of gradients that are not float32; per-tensor Python
overhead of the hook (a constant per tensor, not per element); PowerSGD's true matrix shapes and
its warm-up steps; codec speeds that depend on options other than PowerSGD's rank.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from tandem.spec.codec import (
    CodecSpec,
    PowerSGDOptions,
    QSGDOptions,
    SignOptions,
    num_selected,
    width_for,
)
from tandem.errors import UsageError

GRADIENT_ELEMENT_BYTES = 4
"""Bytes of one gradient element: gradients are float32."""

POWERSGD_ASPECT = 4.0
"""Columns per row of the matrix PowerSGD sees in a tensor whose shape is unknown."""

Round = tuple[str, float]
"""One collective of a bucket's exchange: ``(collective, bytes each worker hands to it)``."""


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class CodecSpeed:
    """How fast a codec encodes and decodes, on a device of speed 1."""

    encode_ns: float
    """Nanoseconds to encode one gradient element."""
    decode_ns: float
    """Nanoseconds to decode one gradient element of one message."""

    def __post_init__(self) -> None:
        for name in ("encode_ns", "decode_ns"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise UsageError(f"codec {name} must be a non-negative number (got {value})")


DEFAULT_SPEEDS: dict[str, CodecSpeed] = {
    "fp16": CodecSpeed(encode_ns=0.49, decode_ns=1.95),
    "bf16": CodecSpeed(encode_ns=0.49, decode_ns=0.34),
    "qsgd": CodecSpeed(encode_ns=7.32, decode_ns=2.00),
    "sign": CodecSpeed(encode_ns=2.80, decode_ns=0.80),
    "topk": CodecSpeed(encode_ns=8.45, decode_ns=0.082),
    "randk": CodecSpeed(encode_ns=0.87, decode_ns=0.30),
    "powersgd": CodecSpeed(encode_ns=2.56, decode_ns=1.28),
}
"""Speeds per codec at its default options, measured by ``benchmarks/compression_sim.py`` on
one CPU thread of this project's machine (two vCPUs, quiet: load average 1.5; the run in
docs/benchmarks.md): VGG-16's convolutions, 14.7 M elements; decoding per message of 16 workers
for the allgather codecs. A GPU is much faster: scale them with ``SimOptions.codec_speedup``."""


# -- payloads -----------------------------------------------------------------------------------

def _qsgd(o: QSGDOptions, n: int) -> float:
    return -(-n * width_for(2 * o.levels + 1) // 8) + GRADIENT_ELEMENT_BYTES * -(-n // o.chunk)


def _sign(o: SignOptions, n: int) -> float:
    return -(-n // 8) + GRADIENT_ELEMENT_BYTES


def matrix_shape(numel: int) -> tuple[int, int]:
    """``(rows, cols)`` PowerSGD is taken to see in a tensor of ``numel`` elements."""
    rows = max(1, round(math.sqrt(numel / POWERSGD_ASPECT)))
    return rows, max(1, round(numel / rows))


def powersgd_elements(rows: int, cols: int, rank: int, min_rate: float) -> tuple[int, int, int]:
    """``(uncompressed, P, Q)`` elements PowerSGD allreduces for one ``rows x cols`` matrix: the
    matrix itself unless ``(rows + cols) r min_rate < rows cols`` (``r = min(rank, rows, cols)``),
    else ``rows r`` and ``cols r`` (PyTorch's ``_should_compress``)."""
    r = min(rank, rows, cols)
    if (rows + cols) * r * min_rate < rows * cols:
        return 0, rows * r, cols * r
    return rows * cols, 0, 0


def _powersgd_rounds(o: PowerSGDOptions, numels: Sequence[int]) -> list[float]:
    totals = [0, 0, 0]
    for n in numels:
        rows, cols = matrix_shape(n)
        parts = powersgd_elements(rows, cols, o.rank, o.min_rate)
        if parts[0]:
            parts = (n, 0, 0)  # sent as it is: its true element count
        totals = [t + p for t, p in zip(totals, parts)]
    return [float(GRADIENT_ELEMENT_BYTES * t) for t in totals if t]


@dataclasses.dataclass(frozen=True, slots=True)
class _Kind:
    collective: str
    payload: Callable[[Any, int], float]
    """Bytes of one tensor of ``n`` elements (the sum of its rounds for PowerSGD)."""
    rounds: Callable[[Any, Sequence[int]], list[float]] | None = None
    """Bytes of each collective round, when there are several."""


CODEC_KINDS: dict[str, _Kind] = {
    "fp16": _Kind("allreduce", lambda o, n: 2.0 * n),
    "bf16": _Kind("allreduce", lambda o, n: 2.0 * n),
    "qsgd": _Kind("allgather", _qsgd),
    "sign": _Kind("allgather", _sign),
    "topk": _Kind("allgather", lambda o, n: 8.0 * num_selected(n, o.ratio)),
    "randk": _Kind("allreduce", lambda o, n: 4.0 * num_selected(n, o.ratio)),
    "powersgd": _Kind("allreduce",
                      lambda o, n: sum(_powersgd_rounds(o, [n])), _powersgd_rounds),
}
"""Codec name -> its collective and payload (the names of ``tandem train --compress``)."""


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class CodecModel:
    """One parsed codec: its payloads, collective rounds and encode/decode time."""

    spec: str
    """The ``CODEC[:k=v,...]`` text it was parsed from."""
    name: str
    options: Any
    """The codec's options dataclass (``QSGDOptions``, ...)."""
    speed: CodecSpeed
    """Encode and decode speed on a device of speed 1."""

    @property
    def collective(self) -> str:
        """``allreduce`` (payloads sum) or ``allgather`` (every worker gets every payload)."""
        return CODEC_KINDS[self.name].collective

    @property
    def work(self) -> float:
        """Encode/decode time relative to the codec's default options (PowerSGD: ``rank / 2``)."""
        return self.options.rank / 2 if self.name == "powersgd" else 1.0

    def payload_bytes(self, numel: int) -> float:
        """Bytes a worker hands to collectives for one float32 tensor of ``numel`` elements."""
        return CODEC_KINDS[self.name].payload(self.options, numel)

    def rounds(self, numels: Sequence[int]) -> list[Round]:
        """The collectives that exchange a bucket of tensors of ``numels`` elements, in order."""
        kind = CODEC_KINDS[self.name]
        if kind.rounds is not None:
            return [(kind.collective, b) for b in kind.rounds(self.options, numels)]
        total = sum(self.payload_bytes(n) for n in numels if n > 0)
        return [(kind.collective, total)] if total else []

    def messages(self, num_workers: int) -> int:
        """Messages each worker decodes: one per worker for allgather, one sum otherwise."""
        return num_workers if self.collective == "allgather" else 1

    def encode_s(self, numels: Sequence[int], *, speedup: float = 1.0) -> float:
        """Seconds to encode tensors of ``numels`` elements, ``speedup`` times the speed."""
        return sum(numels) * self.speed.encode_ns * 1e-9 * self.work / speedup

    def decode_s(self, numels: Sequence[int], num_workers: int, *, speedup: float = 1.0) -> float:
        """Seconds to decode what ``num_workers`` workers sent for tensors of ``numels``."""
        return (sum(numels) * self.messages(num_workers) * self.speed.decode_ns * 1e-9
                * self.work / speedup)


def codec_model(spec: CodecSpec, speed: CodecSpeed | None = None) -> CodecModel:
    """The model of the codec ``spec`` (a plan's ``compress``, parsed once), with ``speed`` or
    the codec's default."""
    return CodecModel(spec=spec.text, name=spec.name, options=spec.options,
                      speed=speed or DEFAULT_SPEEDS[spec.name])


def parse_codec(text: str, speed: CodecSpeed | None = None) -> CodecModel:
    """:func:`codec_model` of a spec's text (e.g. ``topk:ratio=0.01``, as tests and benchmarks
    write it); :class:`UsageError` (one line) for an unknown codec or a bad option."""
    return codec_model(CodecSpec.parse(text), speed)
