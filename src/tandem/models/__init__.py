"""Reference models by name, each an ``nn.Sequential`` of blocks, or a user's own builder.

Usage::

    model = build_model("gpt:layers=4,dim=128", info)      # built-in, with options
    model = build_model("mypkg.models:build:width=64", info)  # calls mypkg.models.build(width=64)
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from torch import nn

from tandem.data.info import DataInfo
from tandem.errors import UsageError
from tandem.models.emulated import EmulatedOptions, build_emulated
from tandem.models.gpt import GPTOptions, build_gpt
from tandem.models.mlp import MLPOptions, build_mlp
from tandem.models.resnet import ResNetOptions, build_resnet
from tandem.models.vgg import VGGOptions, build_vgg
from tandem.options import fill_options, split_spec, user_function

__all__ = ["MODELS", "build_model"]

Builder = Callable[[Any, DataInfo], nn.Module]

MODELS: dict[str, tuple[type, Builder, str]] = {
    "mlp": (MLPOptions, build_mlp, "classify"),
    "resnet": (ResNetOptions, build_resnet, "classify"),
    "vgg": (VGGOptions, build_vgg, "classify"),
    "gpt": (GPTOptions, build_gpt, "lm"),
    "emulated": (EmulatedOptions, build_emulated, "any"),
}
"""Name -> (options dataclass, builder, the task it trains on; ``any`` for every task)."""


def build_model(spec: str, info: DataInfo | Callable[[], DataInfo]) -> nn.Module:
    """Build the model named by ``spec`` for data described by ``info`` (or by what the function
    ``info`` returns, called only if the model needs it: user data may not tell).

    ``spec`` is ``name[:key=value,...]`` for a built-in model, or
    ``package.module:function[:key=value,...]`` for a user's builder, which is called with the
    options as keyword arguments (plus ``info=`` if it has such a parameter).
    """
    head, _, rest = spec.partition(":")
    if head not in MODELS and rest and "=" not in rest.split(":")[0]:
        return _build_user_model(spec, info)
    name, raw = split_spec(spec, what="model")
    if name not in MODELS:
        raise UsageError(
            f"unknown model {name!r}; choose one of: {', '.join(sorted(MODELS))} "
            f"(or give your own as package.module:function)"
        )
    options_cls, build, task = MODELS[name]
    options = fill_options(options_cls, raw, spec=spec, what="model")
    info = info() if callable(info) else info
    if task not in ("any", info.task):
        needs = "an image dataset (digits, images)" if task == "classify" else "a token dataset"
        raise UsageError(f"model {name!r} needs {needs}; it cannot train on a {info.task} task")
    return build(options, info)


def _build_user_model(spec: str, info: DataInfo | Callable[[], DataInfo]) -> nn.Module:
    function, kwargs = user_function(spec, what="model")
    if "info" in inspect.signature(function).parameters:
        kwargs["info"] = info() if callable(info) else info
    try:
        model = function(**kwargs)
    except TypeError as exc:
        raise UsageError(f"model {spec!r}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise UsageError(
            f"model {spec!r} returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model
