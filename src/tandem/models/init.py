"""Initialization of a reference model's weights from the seed and each module's name alone.

Usage::

    initialize(model, seed=3)                       # the whole model
    initialize(stage_block, seed=3, prefix="5")     # block 5 alone, as the whole model has it

Each module that holds parameters or buffers of its own is reset (``reset_parameters``) under
a seed drawn from the run's seed and the module's full name, on the CPU's generator inside
:func:`torch.random.fork_rng` (initialize on the CPU: a GPU's generator draws other numbers). So a block gets the same weights whether the whole model is
built or only that block is materialized from the meta device (what a pipeline stage does),
and initializing leaves the global random state alone.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn


def seed_of(seed: int, name: str) -> int:
    """The seed of the module named ``name`` under the run's ``seed`` (the same in every process)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def owns_state(module: nn.Module) -> bool:
    """Whether ``module`` holds parameters or buffers itself (not only through children)."""
    return any(True for _ in module.parameters(recurse=False)) or \
        any(True for _ in module.buffers(recurse=False))


def initialize(module: nn.Module, seed: int, prefix: str = "") -> None:
    """Reset every module in ``module`` that holds state, each under the seed of its full name
    (``prefix`` + its name within ``module``).

    Raises ``RuntimeError`` for a module that holds state but has no ``reset_parameters``: the
    reference models give every such module one.
    """
    for name, sub in module.named_modules():
        if owns_state(sub):
            reset_module(sub, seed, ".".join(part for part in (prefix, name) if part))


def reset_module(module: nn.Module, seed: int, name: str) -> None:
    """Reset ``module``'s own state (``reset_parameters``) under the seed of its full ``name``
    (its children are left as they are)."""
    reset = getattr(module, "reset_parameters", None)
    if reset is None:
        raise RuntimeError(f"module {name!r} ({type(module).__name__}) holds weights but has no "
                           f"reset_parameters, so it cannot be initialized by name")
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.default_generator.manual_seed(seed_of(seed, name))  # the CPU's alone
        reset()
