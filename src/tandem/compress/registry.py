"""Compressions by name: ``--compress CODEC[:key=value,...]``, parsed into a :class:`Compression`.

Usage::

    compression = build_compression("topk:ratio=0.01")
    check_compress("topk:ratio=0.01", strategy="dp", sgd_momentum=0.9)
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from tandem.spec.codec import (
    QSGDOptions,
    RandomKOptions,
    SignOptions,
    SparseOptions,
    check_codec,
    read_codec_for,
)
from tandem.compress.cast import HalfPrecision
from tandem.compress.codec import Codec, Compression
from tandem.compress.feedback import ErrorFeedback
from tandem.compress.powersgd import PowerSGD
from tandem.compress.qsgd import QSGD
from tandem.compress.sign import Sign
from tandem.compress.sparse import RandomK, TopK


def _with_feedback(codec: Codec, ef: bool, momentum: float = 0.0, masking: bool = False) -> Codec:
    return ErrorFeedback(codec, momentum, masking) if ef else codec


def _qsgd(o: QSGDOptions) -> Codec:
    return _with_feedback(QSGD(o.levels, o.chunk, o.norm, o.seed), o.ef)


def _sign(o: SignOptions) -> Codec:
    return _with_feedback(Sign(), o.ef, o.momentum)


def _topk(o: SparseOptions) -> Codec:
    return _with_feedback(TopK(o.ratio), o.ef, o.momentum, masking=True)


def _randk(o: RandomKOptions) -> Codec:
    return _with_feedback(RandomK(o.ratio, o.seed), o.ef, o.momentum, masking=True)


CODECS: dict[str, tuple[Callable[[Any], Compression], str]] = {
    "fp16": (lambda o: HalfPrecision(torch.float16), "IEEE half precision, allreduce"),
    "bf16": (lambda o: HalfPrecision(torch.bfloat16), "bfloat16, allreduce"),
    "qsgd": (_qsgd, "unbiased stochastic quantization, allgather"),
    "sign": (_sign, "1 bit per element and a scale, error feedback, allgather"),
    "topk": (_topk, "largest magnitudes and indices, error feedback, allgather"),
    "randk": (_randk, "shared random positions, error feedback, allreduce"),
    "powersgd": (PowerSGD, "PyTorch's rank-r PowerSGD hook, allreduce"),
}
"""Name -> (builder from its options (``tandem.spec.codec``), what it sends and how)."""


def build_compression(spec: str, *, strategy: str = "dp") -> Compression:
    """The compression ``spec`` names, e.g. ``topk:ratio=0.01``, as ``strategy`` uses it;
    ``UsageError`` if malformed or if the strategy cannot use it."""
    name, options = read_codec_for(spec, strategy=strategy)
    compression = CODECS[name][0](options)
    compression.spec = spec
    return compression


def check_compress(spec: str, *, strategy: str, sgd_momentum: float) -> Compression:
    """Build ``spec`` and check that ``strategy`` and the optimizer can use it (the checks are
    :func:`tandem.spec.codec.check_codec`'s, which needs no torch)."""
    check_codec(spec, strategy=strategy, sgd_momentum=sgd_momentum)
    return build_compression(spec, strategy=strategy)


def build_codec(spec: str, *, strategy: str) -> Codec:
    """The per-tensor codec ``spec`` names, as ``strategy`` (not ``dp``) uses it."""
    compression = build_compression(spec, strategy=strategy)
    assert isinstance(compression, Codec), f"{spec} is not a per-tensor codec"
    return compression
