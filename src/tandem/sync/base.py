"""The interface every synchronization strategy implements for the trainer."""

from __future__ import annotations

import abc
import contextlib
from typing import ContextManager

import torch
from torch import nn


class SyncStrategy(abc.ABC):
    """How the workers of a data-parallel job keep their models in agreement.

    The trainer calls, per optimizer step: ``accumulating`` around every backward but the last
    (no communication), a plain backward for the last, then ``before_step`` and the optimizer
    step, then ``after_step``.
    """

    name: str = ""

    @abc.abstractmethod
    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        """Return the module the trainer calls forward on (may be ``model`` itself)."""

    def unwrap(self, module: nn.Module) -> nn.Module:
        """The user's model inside ``module``, with its own parameter names."""
        return module

    def accumulating(self, module: nn.Module) -> ContextManager[None]:
        """Context for a backward whose gradients are only accumulated locally."""
        return contextlib.nullcontext()

    def before_step(self, module: nn.Module) -> None:
        """Called after the last backward of a step, before the optimizer step."""

    def after_step(self, module: nn.Module) -> None:
        """Called after the optimizer step."""
