"""Compressions by name: ``--compress CODEC[:key=value,...]``, parsed into a :class:`Compression`.

Usage::

    compression = build_compression("topk:ratio=0.01")
    check_compress("topk:ratio=0.01", strategy="dp", sgd_momentum=0.9)
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from tandem.codec_spec import (
    CODEC_OPTIONS,
    QSGDOptions,
    RandomKOptions,
    SignOptions,
    SparseOptions,
    read_codec_spec,
)
from tandem.compress.cast import HalfPrecision
from tandem.compress.codec import Codec, Compression
from tandem.compress.feedback import ErrorFeedback
from tandem.compress.powersgd import PowerSGD
from tandem.compress.qsgd import QSGD
from tandem.compress.sign import Sign
from tandem.compress.sparse import RandomK, TopK
from tandem.errors import UsageError

STRATEGIES_WITH_COMPRESSION = ("dp", "ps", "gossip", "pipeline")
"""Strategies ``--compress`` applies to: ``dp`` (gradient buckets, as DDP hooks), ``ps``
(gradient pushes and parameter pulls), ``gossip`` (the parameters neighbours exchange) and
``pipeline`` (activations and activation gradients between stages)."""

STATELESS_STRATEGIES = {
    "gossip": "CHOCO-gossip's public copies of the neighbours' parameters already carry what "
              "compression drops",
    "pipeline": "a residual would carry one micro-batch's activations into another's",
}
"""Strategies whose codecs run without error feedback, and why."""

UNSUPPORTED: dict[str, dict[str, str]] = {
    "ps": {"powersgd": "it is PyTorch's DDP communication hook"},
    "gossip": {"powersgd": "it is PyTorch's DDP communication hook"},
    "pipeline": {"powersgd": "it is PyTorch's DDP communication hook",
                 "randk": "its positions are not sent, and the receiving stage cannot draw "
                          "the sender's"},
}
"""Strategy -> codec -> why the strategy cannot use it."""


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
"""Name -> (builder from its options (``tandem.codec_spec``), what it sends and how)."""


def build_compression(spec: str, *, strategy: str = "dp") -> Compression:
    """The compression ``spec`` names, e.g. ``topk:ratio=0.01``, as ``strategy`` uses it;
    ``UsageError`` if malformed or if the strategy cannot use it."""
    if strategy not in STRATEGIES_WITH_COMPRESSION:
        raise UsageError(f"--compress {spec} is not supported with --strategy {strategy}; "
                         f"it works with --strategy {', '.join(STRATEGIES_WITH_COMPRESSION)}")

    def for_strategy(name: str, raw: dict[str, str]) -> None:
        why = UNSUPPORTED.get(strategy, {}).get(name)
        if why is not None:
            usable = sorted(set(CODECS) - set(UNSUPPORTED[strategy]))
            raise UsageError(f"--compress {name} cannot be used with --strategy {strategy} "
                             f"({why}); use one of: {', '.join(usable)}")
        if strategy in STATELESS_STRATEGIES and "ef" in CODEC_OPTIONS[name].__dataclass_fields__:
            if raw.get("ef", "false").lower() not in ("false", "0", "no", "off"):
                raise UsageError(f"--compress {spec}: with --strategy {strategy} codecs run "
                                 f"without error feedback ({STATELESS_STRATEGIES[strategy]}); "
                                 f"drop ef=")
            if "momentum" in raw:
                raise UsageError(f"--compress {spec}: momentum before compression is for "
                                 f"gradients with error feedback, not for --strategy "
                                 f"{strategy}; drop momentum=")
            raw["ef"] = "false"

    name, options = read_codec_spec(spec, adjust=for_strategy)
    compression = CODECS[name][0](options)
    compression.spec = spec
    return compression


def check_compress(spec: str, *, strategy: str, sgd_momentum: float) -> Compression:
    """Build ``spec`` and check that ``strategy`` and the optimizer can use it."""
    compression = build_compression(spec, strategy=strategy)
    if compression.momentum_correction and sgd_momentum:
        raise UsageError(f"--compress {spec} applies momentum itself, before compressing; "
                         f"add --momentum 0 so that SGD does not apply it again")
    return compression


def build_codec(spec: str, *, strategy: str) -> Codec:
    """The per-tensor codec ``spec`` names, as ``strategy`` (not ``dp``) uses it."""
    compression = build_compression(spec, strategy=strategy)
    assert isinstance(compression, Codec), f"{spec} is not a per-tensor codec"
    return compression
