"""A cost model of gradient codecs: what they send, how, and their encode and decode time.

Usage::

    codec = parse_codec("topk:ratio=0.01")
    codec.collective                             # "allgather"
    codec.payload_bytes(1_000_000)               # 80,000: float32 values and int32 indices
    codec.rounds([2_359_808, 512])               # [("allgather", bytes)]: one bucket's exchange
    codec.encode_s([2_359_808, 512]), codec.decode_s([2_359_808, 512], num_workers=16)

A spec is written as for ``tandem train --compress`` (``CODEC[:key=value,...]``, the same names,
options and defaults as :mod:`tandem.compress.registry`); this module mirrors them without
importing torch, and a test checks that both agree, payload sizes included.

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

from tandem.errors import UsageError
from tandem.options import fill_options, split_spec

COLLECTIVES = ("allreduce", "allgather")
"""How workers exchange a codec's payloads."""

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
    "fp16": CodecSpeed(encode_ns=1.03, decode_ns=0.58),
    "bf16": CodecSpeed(encode_ns=1.01, decode_ns=0.64),
    "qsgd": CodecSpeed(encode_ns=15.1, decode_ns=3.72),
    "sign": CodecSpeed(encode_ns=5.78, decode_ns=2.18),
    "topk": CodecSpeed(encode_ns=18.5, decode_ns=0.177),
    "randk": CodecSpeed(encode_ns=1.71, decode_ns=0.505),
    "powersgd": CodecSpeed(encode_ns=5.46, decode_ns=2.73),
}
"""Speeds per codec at its default options, measured by ``benchmarks/compression_sim.py`` on
one CPU thread of this project's machine (two shared vCPUs, load average about 7 while
measuring): VGG-16's convolutions, 14.7 M elements; decoding per message of 16 workers for the
allgather codecs. A GPU is much faster: scale them with ``SimOptions.codec_speedup``."""


# -- options: mirrors of tandem.compress.registry's (tests/test_simulate_compress.py compares) --

@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class NoOptions:
    """Options of a codec that takes none (fp16, bf16)."""


def _check_momentum(momentum: float, ef: bool) -> None:
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum must be in [0, 1) (got {momentum})")
    if momentum and not ef:
        raise ValueError("momentum before compression needs error feedback (ef=true)")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class QSGDOptions:
    """``qsgd:levels=7,chunk=512,norm=l2,ef=false,seed=0``."""

    levels: int = 7
    chunk: int = 512
    norm: str = "l2"
    ef: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.levels <= 127:
            raise ValueError(f"levels must be between 1 and 127 (got {self.levels})")
        if self.chunk < 1:
            raise ValueError(f"chunk must be at least 1 (got {self.chunk})")
        if self.norm not in ("l2", "max"):
            raise ValueError(f"norm must be l2 or max (got {self.norm!r})")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class SignOptions:
    """``sign:ef=true,momentum=0``."""

    ef: bool = True
    momentum: float = 0.0

    def __post_init__(self) -> None:
        _check_momentum(self.momentum, self.ef)


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class SparseOptions:
    """``topk:ratio=0.01,ef=true,momentum=0`` (``k=`` is a synonym of ``ratio=``)."""

    ratio: float = 0.01
    ef: bool = True
    momentum: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.ratio <= 1:
            raise ValueError(f"ratio (k) must be in (0, 1] (got {self.ratio})")
        _check_momentum(self.momentum, self.ef)


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class RandomKOptions(SparseOptions):
    """``randk:ratio=0.01,ef=true,momentum=0,seed=0``."""

    seed: int = 0


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class PowerSGDOptions:
    """``powersgd:rank=2,start=10,min_rate=2,warm=true,ef=true,seed=0``."""

    rank: int = 2
    start: int = 10
    min_rate: float = 2.0
    warm: bool = True
    ef: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"rank must be at least 1 (got {self.rank})")
        if self.start < 2:
            raise ValueError(f"start must be at least 2 (got {self.start})")
        if not self.min_rate > 0:
            raise ValueError(f"min_rate must be positive (got {self.min_rate})")


# -- payloads -----------------------------------------------------------------------------------

def num_selected(numel: int, ratio: float) -> int:
    """Elements a sparse codec keeps of ``numel`` at ``ratio``: at least one, at most all."""
    return min(numel, max(1, math.ceil(ratio * numel)))


def code_bits(levels: int) -> int:
    """Bits QSGD packs each code in: the narrowest of 1, 2, 4, 8 holding ``2 levels + 1``."""
    return next(bits for bits in (1, 2, 4, 8) if 2 * levels + 1 <= 1 << bits)


def _qsgd(o: QSGDOptions, n: int) -> float:
    return -(-n * code_bits(o.levels) // 8) + GRADIENT_ELEMENT_BYTES * -(-n // o.chunk)


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
    options: type
    collective: str
    payload: Callable[[Any, int], float]
    """Bytes of one tensor of ``n`` elements (the sum of its rounds for PowerSGD)."""
    rounds: Callable[[Any, Sequence[int]], list[float]] | None = None
    """Bytes of each collective round, when there are several."""


CODEC_KINDS: dict[str, _Kind] = {
    "fp16": _Kind(NoOptions, "allreduce", lambda o, n: 2.0 * n),
    "bf16": _Kind(NoOptions, "allreduce", lambda o, n: 2.0 * n),
    "qsgd": _Kind(QSGDOptions, "allgather", _qsgd),
    "sign": _Kind(SignOptions, "allgather", _sign),
    "topk": _Kind(SparseOptions, "allgather", lambda o, n: 8.0 * num_selected(n, o.ratio)),
    "randk": _Kind(RandomKOptions, "allreduce", lambda o, n: 4.0 * num_selected(n, o.ratio)),
    "powersgd": _Kind(PowerSGDOptions, "allreduce",
                      lambda o, n: sum(_powersgd_rounds(o, [n])), _powersgd_rounds),
}
"""Codec name -> its options, collective and payload (the names of ``tandem train --compress``)."""


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


def parse_codec(spec: str, speed: CodecSpeed | None = None) -> CodecModel:
    """The model of ``spec`` (e.g. ``topk:ratio=0.01``), with ``speed`` or the codec's default;
    :class:`UsageError` (one line) for an unknown codec or a bad option."""
    name, raw = split_spec(spec, what="codec")
    kind = CODEC_KINDS.get(name)
    if kind is None:
        raise UsageError(f"unknown codec {name!r} in --compress {spec!r}; "
                         f"choose one of: {', '.join(sorted(CODEC_KINDS))}")
    if "k" in raw and issubclass(kind.options, SparseOptions):
        if "ratio" in raw:
            raise UsageError(f"give k or ratio in --compress {spec!r}, not both (the same option)")
        raw["ratio"] = raw.pop("k")
    options = fill_options(kind.options, raw, spec=spec, what="codec")
    return CodecModel(spec=spec, name=name, options=options, speed=speed or DEFAULT_SPEEDS[name])


def wire_bytes(collective: str, payload_bytes: float, num_workers: int) -> float:
    """Bytes one worker sends in a ring ``collective`` of ``payload_bytes`` per worker:
    ``2 (W - 1) / W`` times it for an allreduce, ``W - 1`` times it for an allgather."""
    if collective == "allreduce":
        return 2.0 * (num_workers - 1) / num_workers * payload_bytes
    if collective == "allgather":
        return float(num_workers - 1) * payload_bytes
    raise ValueError(f"unknown collective {collective!r}; expected one of {COLLECTIVES}")
