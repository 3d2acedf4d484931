"""The optimizer class a run names and the keyword arguments it is built with.

``--optimizer`` names any ``torch.optim`` class in any case (``adamw``, ``RMSprop``), tandem's
``lars`` and ``lamb``, or a class of the user's as ``package.module:Class`` (a subclass of
``torch.optim.Optimizer`` whose constructor takes the parameters and ``lr``). Every class gets
``lr`` from ``--lr`` (as scaled and scheduled), ``weight_decay`` from ``--weight-decay`` where it
takes one, SGD and LARS their ``momentum`` from ``--momentum``, and the rest from
``--optimizer-options``: an option the class does not take is one line naming those it does.

Usage::

    cls = optimizer_class("adamw")                   # torch.optim.AdamW
    kwargs = optimizer_kwargs(config, cls, lr=0.01)  # {"lr": 0.01, "weight_decay": 0.0, ...}
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
from typing import Any

import torch

from tandem.errors import UsageError
from tandem.runtime.config import RunConfig
from tandem.runtime.optimizers import Lamb, Lars
from tandem.spec.optimizer import OPTIMIZER_EXAMPLE, class_options, is_user_class

HEAVY_BALL = ("sgd", "lars")
"""Optimizers whose ``momentum`` comes from ``--momentum``."""
REFUSED = {
    "lbfgs": "re-evaluates the model in a closure at every step, which tandem's step (one "
             "forward and backward per micro-batch) does not pass",
    "sparseadam": "takes sparse gradients only, and tandem's layers give dense ones",
}
"""``torch.optim`` classes tandem cannot step, and why."""
GROUP_KEYS = ("params", "param_names")
"""Keys of a parameter group that are no option of its optimizer."""


@functools.cache
def torch_optimizers() -> dict[str, type[torch.optim.Optimizer]]:
    """Every ``torch.optim`` optimizer class by its lower-cased name."""
    return {name.lower(): value for name, value in vars(torch.optim).items()
            if isinstance(value, type) and issubclass(value, torch.optim.Optimizer)
            and value is not torch.optim.Optimizer}


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The class of ``--optimizer name`` (canonical: :func:`tandem.spec.optimizer.
    canonical_optimizer`); one line for an unknown name, a module or class that is not there,
    a class that is no optimizer, and the classes tandem cannot step (:data:`REFUSED`)."""
    if name in ("lars", "lamb"):
        return Lars if name == "lars" else Lamb
    if is_user_class(name):
        return _user_class(name)
    known = torch_optimizers()
    if name not in known:
        close = difflib.get_close_matches(name, [*known, "lars", "lamb"], n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UsageError(f"--optimizer {name!r} is not a torch.optim class "
                         f"({', '.join(sorted(known))}), lars, lamb or package.module:Class; "
                         f"{hint}{OPTIMIZER_EXAMPLE}")
    if name in REFUSED:
        raise UsageError(f"--optimizer {name}: {known[name].__name__} {REFUSED[name]}; use "
                         f"another optimizer, e.g. --optimizer adamw")
    return known[name]


def _user_class(name: str) -> type[torch.optim.Optimizer]:
    module_name, _, attribute = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"--optimizer {name}: cannot import module {module_name!r} ({exc}); "
                         f"check the name and that it is on PYTHONPATH") from None
    found = getattr(module, attribute, None)
    if found is None:
        raise UsageError(f"--optimizer {name}: module {module_name!r} has no {attribute!r}; "
                         f"check the class name")
    if not (isinstance(found, type) and issubclass(found, torch.optim.Optimizer)):
        raise UsageError(f"--optimizer {name} is {type(found).__name__!r}, not a subclass of "
                         f"torch.optim.Optimizer; name the optimizer's class")
    return found


def option_default(cls: type[torch.optim.Optimizer], name: str) -> Any:
    """The default of ``cls``'s option ``name`` (None where it has none)."""
    parameter = inspect.signature(cls.__init__).parameters.get(name)
    if parameter is None or parameter.default is inspect.Parameter.empty:
        return None
    return parameter.default


def check_option_names(cls: type[torch.optim.Optimizer], names: list[str], where: str) -> None:
    """One line if ``cls`` takes none of ``names`` (``where``: what gave them)."""
    known, any_name = class_options(cls)
    unknown = [name for name in names if name not in known and name not in GROUP_KEYS]
    if unknown and not any_name:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UsageError(f"{where} {unknown[0]!r}: {cls.__name__} takes no such option; "
                         f"{hint}its options: {', '.join(known)}")


def optimizer_kwargs(config: RunConfig, cls: type[torch.optim.Optimizer], *, lr: float,
                     nesterov: bool = False) -> dict[str, Any]:
    """The keyword arguments ``cls`` is built with: ``lr``, ``--weight-decay`` (one line if it
    is not 0 and the class takes no weight decay), ``--momentum`` for SGD and LARS (one line
    for a ``momentum`` option there), ``nesterov`` for SGD, and ``--optimizer-options``."""
    known, any_name = class_options(cls)
    if "lr" not in known and not any_name:
        raise UsageError(f"--optimizer {config.optimizer}: {cls.__name__} takes no lr, and "
                         f"tandem sets and schedules the learning rate through it; give a class "
                         f"whose constructor takes lr")
    kwargs: dict[str, Any] = {"lr": lr}
    if "weight_decay" in known or any_name:
        kwargs["weight_decay"] = config.weight_decay
    elif config.weight_decay:
        raise UsageError(f"--weight-decay {config.weight_decay:g}: {cls.__name__} takes no "
                         f"weight decay; drop --weight-decay or choose an optimizer with one")
    options = config.optimizer_options
    if config.optimizer in HEAVY_BALL:
        if "momentum" in options:
            raise UsageError(f"--optimizer-options momentum=... : {config.optimizer}'s momentum "
                             f"comes from --momentum; give --momentum {options['momentum']}")
        kwargs["momentum"] = config.momentum
    if nesterov:
        kwargs["nesterov"] = True
    check_option_names(cls, list(options), "--optimizer-options")
    return {**kwargs, **options}


def momentum_coefficient(config: RunConfig) -> tuple[float, bool]:
    """The run's momentum as asynchrony compensates it (:mod:`tandem.runtime.asynchrony`): SGD's
    and LARS's ``--momentum`` (heavy ball), or an optimizer's ``beta1`` (an average: not heavy
    ball), or its ``momentum`` option; 0 for an optimizer with neither."""
    if config.optimizer in HEAVY_BALL:
        return config.momentum, True
    cls = optimizer_class(config.optimizer)
    options = config.optimizer_options
    known, _ = class_options(cls)
    if "betas" in known or "betas" in options:
        betas = options.get("betas", option_default(cls, "betas"))
        return float(betas[0]) if betas else 0.0, False
    if "momentum" in known or "momentum" in options:
        return float(options.get("momentum", option_default(cls, "momentum")) or 0.0), True
    return 0.0, True


def check_optimizer(config: RunConfig) -> None:
    """Build the run's optimizer once over a small parameter, so that its class, options and
    values are checked before any worker starts: one line naming what the class refused."""
    cls = optimizer_class(config.optimizer)
    kwargs = optimizer_kwargs(config, cls, lr=config.lr)
    try:
        cls([torch.nn.Parameter(torch.zeros(2, 2))], **kwargs)
    except (TypeError, ValueError, RuntimeError) as exc:
        lines = str(exc).strip().splitlines()
        shown = " ".join(f"{key}={value}" for key, value in config.optimizer_options.items())
        given = f" --optimizer-options {shown}" if shown else ""
        raise UsageError(f"--optimizer {config.optimizer}{given}: {cls.__name__} refused them "
                         f"({lines[0] if lines else type(exc).__name__}); fix the options "
                         f"(its options: {', '.join(class_options(cls)[0])})") from None
