"""What a ``--model`` spec means, without torch: the built-in models' names, options and the
task each trains on (their builders, in :mod:`tandem.models`, need torch).

Usage::

    name, options = read_model_spec("gpt:layers=4,dim=128")   # ("gpt", GPTOptions(layers=4, ...))
    is_builtin("mypkg.models:build")                          # False: a user's builder
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from tandem.errors import UsageError
from tandem.spec.options import fill_options, positive, split_spec

IMAGENET_LAYOUTS: dict[int, tuple[str, tuple[int, ...]]] = {
    18: ("basic", (2, 2, 2, 2)),
    34: ("basic", (3, 4, 6, 3)),
    50: ("bottleneck", (3, 4, 6, 3)),
    101: ("bottleneck", (3, 4, 23, 3)),
    152: ("bottleneck", (3, 8, 36, 3)),
}


@dataclasses.dataclass(kw_only=True, slots=True)
class MLPOptions:
    """Options of ``--model mlp:...``."""

    hidden: int = 128
    """Width of the hidden layers."""
    layers: int = 4
    """Number of blocks (linear layers); each block can become a pipeline stage."""

    def __post_init__(self) -> None:
        positive("hidden", self.hidden, 128)
        if self.layers < 2:
            raise ValueError(f"layers must be at least 2 (got {self.layers})")


@dataclasses.dataclass(kw_only=True, slots=True)
class ResNetOptions:
    """Options of ``--model resnet:...``."""

    depth: int = 20
    """6n+2 for the CIFAR layout (20, 32, 56, ...); 18, 34, 50, 101 or 152 for ImageNet's."""
    width: int = 0
    """Channels of the first stage; 0 picks the layout's own (16 for CIFAR, 64 for ImageNet)."""
    layout: str = "auto"
    """``cifar``, ``imagenet``, or ``auto`` (ImageNet for depths 18/34/50/101/152)."""

    def __post_init__(self) -> None:
        if self.layout not in ("auto", "cifar", "imagenet"):
            raise ValueError(f"layout must be auto, cifar or imagenet (got {self.layout!r})")
        if self.width < 0:
            raise ValueError(f"width must be >= 0 (got {self.width})")
        if self.resolved_layout() == "imagenet" and self.depth not in IMAGENET_LAYOUTS:
            raise ValueError(
                f"no ImageNet layout of depth {self.depth}; use one of {sorted(IMAGENET_LAYOUTS)}"
            )
        if self.resolved_layout() == "cifar" and (self.depth < 8 or (self.depth - 2) % 6):
            raise ValueError(f"CIFAR depth must be 6n+2 with n >= 1, e.g. 20 (got {self.depth})")
        positive("depth", self.depth, 20)

    def resolved_layout(self) -> str:
        """The layout after resolving ``auto``."""
        if self.layout != "auto":
            return self.layout
        return "imagenet" if self.depth in IMAGENET_LAYOUTS else "cifar"


@dataclasses.dataclass(kw_only=True, slots=True)
class VGGOptions:
    """Options of ``--model vgg:...``."""

    width: float = 1.0
    """Multiplier of every layer's channels (0.25 gives a quarter-width VGG-16)."""
    hidden: int = 0
    """Width of the two hidden linear layers; 0 picks 4096 x width."""
    bn: bool = False
    """Add batch normalization after every convolution (VGG-16-BN)."""

    def __post_init__(self) -> None:
        positive("width", self.width, 0.25)
        if self.hidden < 0:
            raise ValueError(f"hidden must be >= 0 (got {self.hidden})")


@dataclasses.dataclass(kw_only=True, slots=True)
class GPTOptions:
    """Options of ``--model gpt:...``."""

    layers: int = 4
    """Number of transformer blocks."""
    dim: int = 128
    """Model width."""
    heads: int = 4
    """Attention heads; must divide ``dim``."""
    mlp_ratio: int = 4
    """Hidden width of each block's MLP, as a multiple of ``dim``."""
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("layers", "dim", "heads", "mlp_ratio"):
            positive(name, getattr(self, name), GPTOptions.__dataclass_fields__[name].default)
        if self.dim % self.heads:
            raise ValueError(f"heads ({self.heads}) must divide dim ({self.dim})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1) (got {self.dropout})")


@dataclasses.dataclass(kw_only=True, slots=True)
class EmulatedOptions:
    """Options of ``--model emulated:...``."""

    profile: str = ""
    """Profile to emulate: JSON or PipeDream ``graph.txt``."""
    scale: float = 1.0
    """Factor on every profiled time (0 for no waiting)."""
    batch: int = 0
    """Minibatch size the profile was measured at (0: the profile's ``batch_size``, if any)."""
    bytes_scale: float = 1.0
    """Factor on activation sizes (and parameter sizes with ``params=profiled``)."""
    params: str = "small"
    """``small`` (a few parameters per block) or ``profiled`` (the profiled parameter bytes)."""

    def __post_init__(self) -> None:
        if not self.profile:
            raise ValueError("emulated needs profile=PATH (a JSON profile or a graph.txt)")
        if not (self.scale >= 0 and math.isfinite(self.scale)):
            raise ValueError(f"scale must be a finite number >= 0 (got {self.scale})")
        if self.batch < 0:
            raise ValueError(f"batch must be >= 0 (got {self.batch})")
        if not (self.bytes_scale > 0 and math.isfinite(self.bytes_scale)):
            raise ValueError(f"bytes_scale must be a finite number > 0 (got {self.bytes_scale})")
        if self.params not in ("small", "profiled"):
            raise ValueError(f"params must be small or profiled (got {self.params!r})")


MODEL_OPTIONS: dict[str, tuple[type, str]] = {
    "mlp": (MLPOptions, "classify"),
    "resnet": (ResNetOptions, "classify"),
    "vgg": (VGGOptions, "classify"),
    "gpt": (GPTOptions, "lm"),
    "emulated": (EmulatedOptions, "any"),
}
"""Name -> (options dataclass, the task it trains on; ``any`` for every task)."""


def is_builtin(spec: str) -> bool:
    """Whether ``spec`` names a built-in model (not a user's ``package.module:function``)."""
    head, _, rest = spec.partition(":")
    return head in MODEL_OPTIONS or not rest or "=" in rest.split(":")[0]


def read_model_spec(spec: str) -> tuple[str, Any]:
    """The name and options of the built-in model ``spec`` (``name[:key=value,...]``); one-line
    :class:`UsageError` for an unknown model or a bad option."""
    name, raw = split_spec(spec, what="model")
    if name not in MODEL_OPTIONS:
        raise UsageError(
            f"unknown model {name!r}; choose one of: {', '.join(sorted(MODEL_OPTIONS))} "
            f"(or give your own as package.module:function)"
        )
    return name, fill_options(MODEL_OPTIONS[name][0], raw, spec=spec, what="model")


def check_model_spec(spec: str) -> None:
    """One-line :class:`UsageError` for a built-in model spec whose syntax or options are wrong
    (a user's builder is checked when it is called)."""
    if is_builtin(spec):
        read_model_spec(spec)
