"""The optimizer as a run names it, checked as text without torch: its class (``--optimizer``),
its keyword options (``--optimizer-options``) and the parameters kept out of weight decay
(``--no-decay``). :mod:`tandem.runtime.optimizer_class` finds the class and checks the options
against it; :mod:`tandem.runtime.param_groups` makes the groups.

Usage::

    canonical_optimizer("AdamW")                       # "adamw"
    parse_options(["betas=0.9,0.95", "eps=1e-8"])      # {"betas": (0.9, 0.95), "eps": 1e-08}
    no_decay_kinds("norm,bias")                        # ("norm", "bias")
"""

from __future__ import annotations

import inspect

import re
from collections.abc import Mapping, Sequence
from typing import Any

from tandem.errors import UsageError

BUILTIN_OPTIMIZERS = ("sgd", "adam", "adamw", "lars", "lamb")
"""The names tandem has always taken (lars and lamb are tandem's own classes); any other
``torch.optim`` class is taken by its name too (``rmsprop``, ``NAdam``, any case)."""
TANDEM_OPTIMIZERS = ("lars", "lamb")
"""Optimizers of tandem's own (:mod:`tandem.runtime.optimizers`), which build their groups."""
NOT_ELEMENTWISE = ("adafactor", "muon")
"""``torch.optim`` classes whose step of a matrix reads it whole (Adafactor's factored second
moment, Muon's orthogonalization): not for tensor-parallel shares or FSDP2 shards."""
NO_DECAY_KINDS = ("norm", "bias", "embedding")
"""``--no-decay`` words: parameters of normalization layers, parameters whose name ends in
``bias``, weights of ``nn.Embedding`` layers (see :mod:`tandem.runtime.param_groups`)."""
SET_BY_FLAGS = {"lr": "--lr", "weight_decay": "--weight-decay"}
"""Options every optimizer gets from tandem's own flags, never from ``--optimizer-options``."""
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_QUALIFIED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
OPTIMIZER_EXAMPLE = ("e.g. --optimizer adamw, --optimizer rmsprop or "
                     "--optimizer mypackage.optim:Lion")


def canonical_optimizer(name: str) -> str:
    """``--optimizer`` as the run keeps it: a bare class name lower-cased (``AdamW`` and
    ``adamw`` are one optimizer), ``package.module:Class`` as given; one line if it is
    neither."""
    text = name.strip()
    if _NAME.fullmatch(text):
        return text.lower()
    module, colon, attribute = text.partition(":")
    if colon and _QUALIFIED.fullmatch(module) and _NAME.fullmatch(attribute):
        return text
    raise UsageError(f"--optimizer {name!r} is neither a torch.optim class name nor "
                     f"package.module:Class; {OPTIMIZER_EXAMPLE}")


def is_user_class(name: str) -> bool:
    """Whether ``name`` (canonical) is ``package.module:Class``."""
    return ":" in name


def parse_value(text: str) -> Any:
    """An option's value from its command-line spelling: ``true``/``false``, ``none``, a whole
    number, a number, a comma-separated tuple of those (``0.9,0.95``), else the text."""
    if "," in text:
        return tuple(parse_value(part) for part in text.split(",") if part.strip())
    word = text.strip()
    lowered = word.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(word)
        except ValueError:
            pass
    return word


def parse_options(given: str | Sequence[str] | Mapping[str, Any] | None) -> dict[str, Any]:
    """``--optimizer-options`` as a dict: ``KEY=VALUE`` words (a string is split at blanks;
    values as :func:`parse_value` reads them) or a mapping (from Python, taken as given).
    One line for a word that is not ``KEY=VALUE``, a key given twice, or ``lr`` and
    ``weight_decay`` (which ``--lr`` and ``--weight-decay`` set)."""
    if given is None:
        return {}
    if isinstance(given, Mapping):
        options = dict(given)
    else:
        words = given.split() if isinstance(given, str) else [str(word) for word in given]
        options = {}
        for word in words:
            key, equals, value = word.partition("=")
            if not equals or not _NAME.fullmatch(key.strip()) or not value.strip():
                raise UsageError(f"--optimizer-options {word!r} is not KEY=VALUE; e.g. "
                                 f"--optimizer-options betas=0.9,0.95 eps=1e-8")
            if key.strip() in options:
                raise UsageError(f"--optimizer-options gives {key.strip()!r} twice; keep one")
            options[key.strip()] = parse_value(value)
    for key in options:
        if not isinstance(key, str) or not _NAME.fullmatch(key):
            raise UsageError(f"optimizer option {key!r} is not a keyword name; e.g. "
                             f"optimizer_options={{'betas': (0.9, 0.95)}}")
        if key in SET_BY_FLAGS:
            raise UsageError(f"--optimizer-options {key}=... : the {key} comes from "
                             f"{SET_BY_FLAGS[key]}; give {SET_BY_FLAGS[key]} instead")
    return options


def no_decay_kinds(text: str | Sequence[str] | None) -> tuple[str, ...]:
    """``--no-decay`` as its words (``norm,bias`` or a list of them); one line for a word that
    is not one of :data:`NO_DECAY_KINDS`, or none at all."""
    if text is None:
        return ()
    parts = text.split(",") if isinstance(text, str) else list(text)
    words = tuple(dict.fromkeys(part.strip().lower() for part in parts if part.strip()))
    unknown = [word for word in words if word not in NO_DECAY_KINDS]
    if unknown or not words:
        raise UsageError(f"--no-decay {text!r}: {', '.join(map(repr, unknown)) or 'nothing'} is "
                         f"not one of {', '.join(NO_DECAY_KINDS)}; e.g. --no-decay norm,bias")
    return words


def class_options(cls: type[Any]) -> tuple[tuple[str, ...], bool]:
    """The keyword options ``cls`` takes after its parameters, and whether it takes any
    (``**kwargs``)."""
    parameters = list(inspect.signature(cls.__init__).parameters.values())[2:]
    names = tuple(p.name for p in parameters
                  if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    return names, any(p.kind == p.VAR_KEYWORD for p in parameters)
