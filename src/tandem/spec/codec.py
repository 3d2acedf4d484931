"""What a ``--compress CODEC[:key=value,...]`` spec means, without torch: the codecs' names,
options and sizes, shared by the runtime's codecs and the simulator's cost model.

Usage::

    spec = CodecSpec.parse("topk:k=0.01")   # name "topk", options SparseOptions(ratio=0.01, ...)
    spec.options_for(CodecUse.ACTIVATIONS)  # SparseOptions(ratio=0.01, ef=False, ...)
    num_selected(1_000, spec.options.ratio)  # 10 elements sent
    ring_bytes("allgather", 80, world_size=4)  # 240 bytes sent by each worker
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable
from typing import Any

from tandem.errors import UsageError
from tandem.spec.options import fill_options, split_spec

MAX_LEVELS = 127
"""Most QSGD levels per sign: ``2 s + 1`` codes must fit in a byte."""

WIDTHS = (1, 2, 4, 8)
"""Bits a packed code may take."""

COLLECTIVES = ("allreduce", "allgather")
"""How workers exchange a codec's payloads."""


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class NoOptions:
    """Options of a codec that takes none."""


def _check_momentum(momentum: float, ef: bool) -> None:
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum must be in [0, 1) (got {momentum})")
    if momentum and not ef:
        raise ValueError("momentum before compression needs error feedback (ef=true)")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class SignOptions:
    """Options of ``--compress sign:...``."""

    ef: bool = True
    """Error feedback (EF-SignSGD); without it, plain scaled signSGD."""
    momentum: float = 0.0
    """Apply this momentum before compressing (Zheng et al. 2019; needs ``ef``; then use
    ``--momentum 0``)."""

    def __post_init__(self) -> None:
        _check_momentum(self.momentum, self.ef)


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
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


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class RandomKOptions(SparseOptions):
    """Options of ``--compress randk:...``."""

    seed: int = 0
    """Seed of the positions every worker draws alike."""


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
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


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class PowerSGDOptions:
    """Options of ``--compress powersgd:...``."""

    rank: int = 2
    """Rank of the approximation of each gradient matrix."""
    start: int = 10
    """Steps of plain allreduce before compressing (at least 2: DDP rebuilds its buckets
    after the first step, and the hook's error feedback is kept per bucket)."""
    min_rate: float = 2.0
    """Compress a matrix only if that shrinks it at least this many times."""
    warm: bool = True
    """Start each step's power iteration from the last step's ``Q``."""
    ef: bool = True
    """Error feedback."""
    seed: int = 0
    """Seed of the random initial ``Q`` (the same on every worker)."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"rank must be at least 1 (got {self.rank})")
        if self.start < 2:
            raise ValueError(f"start must be at least 2 (got {self.start}): DDP rebuilds its "
                             f"buckets after the first step")
        if not self.min_rate > 0:
            raise ValueError(f"min_rate must be positive (got {self.min_rate})")


CODEC_OPTIONS: dict[str, type] = {
    "fp16": NoOptions, "bf16": NoOptions, "qsgd": QSGDOptions, "sign": SignOptions,
    "topk": SparseOptions, "randk": RandomKOptions, "powersgd": PowerSGDOptions,
}
"""Codec name -> its options dataclass: the names ``--compress`` knows."""

HOOK_ONLY = "it is PyTorch's DDP communication hook"
"""Why a codec that only DDP's hooks run serves no other exchange."""


class CodecUse(enum.StrEnum):
    """What a strategy's codec compresses; the value is the strategy's ``--strategy`` name, as
    messages give it."""

    GRADIENTS = "dp"
    """Gradient buckets of an allreduce (DDP communication hooks)."""
    PUSHES = "ps"
    """Gradient pushes to parameter servers and the parameters pulled back."""
    PARAMETERS = "gossip"
    """The parameters gossip's neighbours exchange (CHOCO-gossip)."""
    ACTIVATIONS = "pipeline"
    """Activations and activation gradients between pipeline stages."""

    @classmethod
    def parse(cls, strategy: str) -> CodecUse | None:
        """The use of ``strategy``'s codec; None for a strategy that compresses nothing."""
        try:
            return cls(strategy)
        except ValueError:
            return None

    @property
    def stateless_reason(self) -> str | None:
        """Why this use runs codecs without error feedback; None: with it."""
        if self is CodecUse.PARAMETERS:
            return ("CHOCO-gossip's public copies of the neighbours' parameters already carry "
                    "what compression drops")
        if self is CodecUse.ACTIVATIONS:
            return "a residual would carry one micro-batch's activations into another's"
        return None

    @property
    def unsupported(self) -> dict[str, str]:
        """Codec name -> why this use cannot run it."""
        if self is CodecUse.GRADIENTS:
            return {}
        if self is CodecUse.ACTIVATIONS:
            return {"powersgd": HOOK_ONLY,
                    "randk": "its positions are not sent, and the receiving stage cannot draw "
                             "the sender's"}
        return {"powersgd": HOOK_ONLY}


BUCKET_CODECS = ("powersgd",)
"""Codecs that exchange whole DDP gradient buckets (PyTorch's communication hooks) rather than
each tensor on its own."""


def read_codec_spec(spec: str, *,
                    adjust: Callable[[str, dict[str, str]], None] | None = None) -> tuple[str, Any]:
    """The codec's name and options of ``spec``; ``adjust(name, raw)`` may check or change the
    raw ``key=value`` strings first. :class:`UsageError` (one line) for an unknown codec or a
    bad option."""
    name, raw = split_spec(spec, what="codec")
    if name not in CODEC_OPTIONS:
        raise UsageError(f"unknown codec {name!r} in --compress {spec!r}; "
                         f"choose one of: {', '.join(sorted(CODEC_OPTIONS))}")
    if adjust is not None:
        adjust(name, raw)
    options_cls = CODEC_OPTIONS[name]
    if "k" in raw and issubclass(options_cls, SparseOptions):
        if "ratio" in raw:
            raise UsageError(f"give k or ratio in --compress {spec!r}, not both (the same option)")
        raw["ratio"] = raw.pop("k")
    return name, fill_options(options_cls, raw, spec=spec, what="codec")


def codec_use(strategy: CodecUse | str, text: str) -> CodecUse:
    """The use of ``strategy``'s codec; :class:`UsageError` for a strategy that compresses
    nothing (``text``: the codec, for the message)."""
    use = CodecUse.parse(strategy)
    if use is None:
        raise UsageError(f"--compress {text} is not supported with --strategy {strategy}; "
                         f"it works with --strategy {', '.join(CodecUse)}")
    return use


def check_codec(spec: CodecSpec | str, *, strategy: CodecUse | str, sgd_momentum: float) -> None:
    """Check that ``strategy`` and the optimizer (SGD's ``sgd_momentum``) can use ``spec``; the
    checks of :func:`tandem.compress.check_compress`, without building the codec."""
    text = spec.text if isinstance(spec, CodecSpec) else spec
    use = codec_use(strategy, text)
    options = (spec if isinstance(spec, CodecSpec) else CodecSpec.parse(spec)).options_for(use)
    if getattr(options, "momentum", 0.0) and sgd_momentum:
        raise UsageError(f"--compress {text} applies momentum itself, before compressing; "
                         f"add --momentum 0 so that SGD does not apply it again")


def num_selected(numel: int, ratio: float) -> int:
    """Elements a sparse codec keeps of ``numel`` at ``ratio``: at least one, at most all."""
    return min(numel, max(1, math.ceil(ratio * numel)))


def width_for(num_values: int) -> int:
    """The narrowest of :data:`WIDTHS` that holds ``num_values`` distinct codes."""
    for bits in WIDTHS:
        if num_values <= 1 << bits:
            return bits
    raise ValueError(f"{num_values} codes do not fit in 8 bits")


def ring_bytes(collective: str, payload_bytes: float, world_size: int) -> float:
    """Bytes one worker sends in a ring ``collective`` of ``payload_bytes`` per worker.

    A ring allreduce sends ``2 (W - 1) / W`` times the payload (reduce-scatter, then
    allgather); a ring allgather forwards every other worker's payload, ``(W - 1)`` times it.
    """
    if collective == "allreduce":
        return 2.0 * (world_size - 1) / world_size * payload_bytes
    if collective == "allgather":
        return float(world_size - 1) * payload_bytes
    raise ValueError(f"unknown collective {collective!r}; expected one of {COLLECTIVES}")


@dataclasses.dataclass(frozen=True, slots=True)
class CodecSpec:
    """A ``--compress`` spec parsed once: its text, the codec's name and its typed options."""

    text: str
    """The spec as written, e.g. ``topk:ratio=0.01`` (what a plan file records)."""
    name: str
    options: Any
    """The codec's options dataclass (:data:`CODEC_OPTIONS`)."""
    given: frozenset[str] = frozenset()
    """The options the text sets (``k`` counted as ``ratio``); the others are defaults."""

    @classmethod
    def parse(cls, text: str) -> CodecSpec:
        """Read ``CODEC[:k=v,...]``; one-line :class:`UsageError` for an unknown codec or option."""
        given: set[str] = set()
        name, options = read_codec_spec(text, adjust=lambda _, raw: given.update(raw))
        return cls(text=text.strip(), name=name, options=options,
                   given=frozenset("ratio" if key == "k" else key for key in given))

    def options_for(self, use: CodecUse) -> Any:
        """The options as ``use`` runs the codec (a stateless use's without error feedback);
        :class:`UsageError` naming the value and the fix if ``use`` cannot run it as written."""
        why = use.unsupported.get(self.name)
        if why is not None:
            usable = sorted(set(CODEC_OPTIONS) - set(use.unsupported))
            raise UsageError(f"--compress {self.name} cannot be used with --strategy {use} "
                             f"({why}); use one of: {', '.join(usable)}")
        stateless = use.stateless_reason
        if stateless is None or not hasattr(self.options, "ef"):
            return self.options
        if "ef" in self.given and self.options.ef:
            raise UsageError(f"--compress {self.text}: with --strategy {use} codecs run without "
                             f"error feedback ({stateless}); drop ef=")
        if "momentum" in self.given:
            raise UsageError(f"--compress {self.text}: momentum before compression is for "
                             f"gradients with error feedback, not for --strategy {use}; drop "
                             f"momentum=")
        return dataclasses.replace(self.options, ef=False)
