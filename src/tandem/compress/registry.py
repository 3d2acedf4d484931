"""Compressions by name: ``--compress CODEC[:key=value,...]``, parsed into a :class:`Compression`.

Usage::

    compression = build_compression("topk:ratio=0.01")
    check_compress("topk:ratio=0.01", strategy="dp", sgd_momentum=0.9)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from tandem.compress.cast import HalfPrecision
from tandem.compress.codec import Codec, Compression
from tandem.compress.feedback import ErrorFeedback
from tandem.compress.powersgd import PowerSGD, PowerSGDOptions
from tandem.compress.qsgd import MAX_LEVELS, QSGD
from tandem.compress.sign import Sign
from tandem.compress.sparse import RandomK, TopK
from tandem.errors import UsageError
from tandem.options import fill_options, split_spec

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


@dataclasses.dataclass(kw_only=True, slots=True)
class NoOptions:
    """Options of a codec that takes none."""


def _check_momentum(momentum: float, ef: bool) -> None:
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum must be in [0, 1) (got {momentum})")
    if momentum and not ef:
        raise ValueError("momentum before compression needs error feedback (ef=true)")


@dataclasses.dataclass(kw_only=True, slots=True)
class SignOptions:
    """Options of ``--compress sign:...``."""

    ef: bool = True
    """Error feedback (EF-SignSGD); without it, plain scaled signSGD."""
    momentum: float = 0.0
    """Apply this momentum before compressing (Zheng et al. 2019; needs ``ef``; then use
    ``--momentum 0``)."""

    def __post_init__(self) -> None:
        _check_momentum(self.momentum, self.ef)


@dataclasses.dataclass(kw_only=True, slots=True)
class SparseOptions:
    """Options of ``--compress topk:...`` (and ``randk:...``)."""

    ratio: float = 0.01
    """Fraction of each tensor's elements sent, in (0, 1] (``k=`` is a synonym)."""
    ef: bool = True
    """Error feedback: the elements not sent are added to the next step's."""
    momentum: float = 0.0
    """DGC's momentum correction with this momentum (needs ``ef``; then use ``--momentum 0``)."""

    def __post_init__(self) -> None:
        if not 0 < self.ratio <= 1:
            raise ValueError(f"ratio (k) must be in (0, 1] (got {self.ratio})")
        _check_momentum(self.momentum, self.ef)


@dataclasses.dataclass(kw_only=True, slots=True)
class RandomKOptions(SparseOptions):
    """Options of ``--compress randk:...``."""

    seed: int = 0
    """Seed of the positions every worker draws alike."""


@dataclasses.dataclass(kw_only=True, slots=True)
class QSGDOptions:
    """Options of ``--compress qsgd:...``."""

    levels: int = 7
    """Quantization levels per sign, s (7: 4 bits per element, 1: 2 bits, up to 127: 8 bits)."""
    chunk: int = 512
    """Elements sharing one norm (the paper's bucket size d)."""
    norm: str = "l2"
    """``l2`` (the paper's) or ``max`` (lower variance)."""
    ef: bool = False
    """Error feedback (QSGD is unbiased without it)."""
    seed: int = 0
    """Seed of the rounding noise (each worker adds its rank)."""

    def __post_init__(self) -> None:
        if not 1 <= self.levels <= MAX_LEVELS:
            raise ValueError(f"levels must be between 1 and {MAX_LEVELS} (got {self.levels})")
        if self.chunk < 1:
            raise ValueError(f"chunk must be at least 1 (got {self.chunk})")
        if self.norm not in ("l2", "max"):
            raise ValueError(f"norm must be l2 or max (got {self.norm!r})")


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


CODECS: dict[str, tuple[type, Callable[[Any], Compression], str]] = {
    "fp16": (NoOptions, lambda o: HalfPrecision(torch.float16), "IEEE half precision, allreduce"),
    "bf16": (NoOptions, lambda o: HalfPrecision(torch.bfloat16), "bfloat16, allreduce"),
    "qsgd": (QSGDOptions, _qsgd, "unbiased stochastic quantization, allgather"),
    "sign": (SignOptions, _sign, "1 bit per element and a scale, error feedback, allgather"),
    "topk": (SparseOptions, _topk, "largest magnitudes and indices, error feedback, allgather"),
    "randk": (RandomKOptions, _randk, "shared random positions, error feedback, allreduce"),
    "powersgd": (PowerSGDOptions, PowerSGD, "PyTorch's rank-r PowerSGD hook, allreduce"),
}
"""Name -> (options dataclass, builder, what it sends and how)."""


def build_compression(spec: str, *, strategy: str = "dp") -> Compression:
    """The compression ``spec`` names, e.g. ``topk:ratio=0.01``, as ``strategy`` uses it;
    ``UsageError`` if malformed or if the strategy cannot use it."""
    name, raw = split_spec(spec, what="codec")
    if name not in CODECS:
        raise UsageError(f"unknown codec {name!r} in --compress {spec!r}; "
                         f"choose one of: {', '.join(sorted(CODECS))}")
    options_cls, build, _ = CODECS[name]
    if strategy not in STRATEGIES_WITH_COMPRESSION:
        raise UsageError(f"--compress {spec} is not supported with --strategy {strategy}; "
                         f"it works with --strategy {', '.join(STRATEGIES_WITH_COMPRESSION)}")
    why = UNSUPPORTED.get(strategy, {}).get(name)
    if why is not None:
        usable = sorted(set(CODECS) - set(UNSUPPORTED[strategy]))
        raise UsageError(f"--compress {name} cannot be used with --strategy {strategy} ({why}); "
                         f"use one of: {', '.join(usable)}")
    if strategy in STATELESS_STRATEGIES and "ef" in options_cls.__dataclass_fields__:
        if raw.get("ef", "false").lower() not in ("false", "0", "no", "off"):
            raise UsageError(f"--compress {spec}: with --strategy {strategy} codecs run without "
                             f"error feedback ({STATELESS_STRATEGIES[strategy]}); drop ef=")
        if "momentum" in raw:
            raise UsageError(f"--compress {spec}: momentum before compression is for gradients "
                             f"with error feedback, not for --strategy {strategy}; drop momentum=")
        raw["ef"] = "false"
    if "k" in raw and issubclass(options_cls, SparseOptions):
        if "ratio" in raw:
            raise UsageError(f"give k or ratio in --compress {spec!r}, not both (the same option)")
        raw["ratio"] = raw.pop("k")
    compression = build(fill_options(options_cls, raw, spec=spec, what="codec"))
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
