"""Reference models by name, each an ``nn.Sequential`` of blocks, or a user's own builder.

Usage::

    model = build_model("gpt:layers=4,dim=128", info)      # built-in, with options
    model = build_model("mypkg.models:build:width=64", info)  # calls mypkg.models.build(width=64)
    blocks = build_model("mlp", info, device="meta")        # shapes only, no storage

A built-in model's weights depend only on the seed (``torch.initial_seed()``, i.e. the last
``torch.manual_seed``, unless ``seed`` is given) and each module's name
(:func:`~tandem.models.init.initialize`), so any part of it can be materialized later from the
meta device with the weights the whole model would have. A user's builder is called as it is.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable

import torch
from torch import nn

from tandem.data.info import DataInfo
from tandem.errors import UsageError
from tandem.spec.model import MODEL_OPTIONS, is_builtin, read_model_spec
from tandem.models.emulated import build_emulated
from tandem.models.gpt import build_gpt
from tandem.models.init import initialize
from tandem.models.mlp import build_mlp
from tandem.models.resnet import build_resnet
from tandem.models.vgg import build_vgg
from tandem.spec.options import user_function

__all__ = ["MODELS", "build_model", "initialize", "is_builtin"]

Builder = Callable[[Any, DataInfo], nn.Module]

BUILDERS: dict[str, Builder] = {"mlp": build_mlp, "resnet": build_resnet, "vgg": build_vgg,
                                "gpt": build_gpt, "emulated": build_emulated}

MODELS: dict[str, tuple[type, Builder, str]] = {
    name: (options, BUILDERS[name], task) for name, (options, task) in MODEL_OPTIONS.items()}
"""Name -> (options dataclass, builder, the task it trains on; ``any`` for every task): the
names and options of :mod:`tandem.spec.model` (which reads a spec without torch)."""


def build_model(spec: str, info: DataInfo | Callable[[], DataInfo], *, seed: int | None = None,
                device: str | torch.device | None = None) -> nn.Module:
    """Build the model named by ``spec`` for data described by ``info`` (or by what the function
    ``info`` returns, called only if the model needs it: user data may not tell).

    ``spec`` is ``name[:key=value,...]`` for a built-in model, or
    ``package.module:function[:key=value,...]`` for a user's builder, which is called with the
    options as keyword arguments (plus ``info=`` if it has such a parameter).

    A built-in model is initialized by module name under ``seed`` (default
    ``torch.initial_seed()``) without drawing from the global random state; with
    ``device="meta"`` it is built without storage and left uninitialized (materialize a part
    with ``to_empty`` and :func:`~tandem.models.init.initialize`).
    """
    if not is_builtin(spec):
        return _build_user_model(spec, info)
    name, options = read_model_spec(spec)
    _, build, task = MODELS[name]
    info = info() if callable(info) else info
    if task not in ("any", info.task):
        needs = "an image dataset (digits, images)" if task == "classify" else "a token dataset"
        raise UsageError(f"model {name!r} needs {needs}; it cannot train on a {info.task} task")
    seed = torch.initial_seed() if seed is None else seed
    with torch.random.fork_rng(devices=[]), \
            torch.device(device) if device is not None else contextlib.nullcontext():
        model = build(options, info)
    if device is None or torch.device(device).type != "meta":
        initialize(model, seed)
    return model


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
