"""Compressions by name: a parsed ``--compress`` spec (a plan's ``compress``) built into a
:class:`Compression` for what it compresses.

Usage::

    compression = build_compression(plan.compress)      # or build_compression("topk:ratio=0.01")
    codec = build_codec(plan.compress, strategy=CodecUse.PUSHES)
    check_compress(plan.compress, strategy=CodecUse.GRADIENTS, sgd_momentum=0.9)
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from tandem.spec.codec import (
    CodecSpec,
    CodecUse,
    QSGDOptions,
    RandomKOptions,
    SignOptions,
    SparseOptions,
    check_codec,
    codec_use,
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


def build_compression(spec: CodecSpec | str, *,
                      strategy: CodecUse | str = CodecUse.GRADIENTS) -> Compression:
    """The compression ``spec`` names (a parsed spec, or its text such as ``topk:ratio=0.01``),
    as ``strategy`` uses it; ``UsageError`` if malformed or if the strategy cannot use it."""
    text = spec.text if isinstance(spec, CodecSpec) else spec
    use = codec_use(strategy, text)
    parsed = spec if isinstance(spec, CodecSpec) else CodecSpec.parse(spec)
    compression = CODECS[parsed.name][0](parsed.options_for(use))
    compression.spec = text
    return compression


def check_compress(spec: CodecSpec | str, *, strategy: CodecUse | str,
                   sgd_momentum: float) -> Compression:
    """Build ``spec`` and check that ``strategy`` and the optimizer can use it (the checks are
    :func:`tandem.spec.codec.check_codec`'s, which needs no torch)."""
    check_codec(spec, strategy=strategy, sgd_momentum=sgd_momentum)
    return build_compression(spec, strategy=strategy)


def build_codec(spec: CodecSpec | str, *, strategy: CodecUse | str) -> Codec:
    """The per-tensor codec ``spec`` names, as ``strategy`` (not ``dp``) uses it."""
    compression = build_compression(spec, strategy=strategy)
    assert isinstance(compression, Codec), f"{spec} is not a per-tensor codec"
    return compression
