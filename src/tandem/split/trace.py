"""Tracing a model with ``torch.export`` into flat graphs, one per mode, for any batch size.

Usage::

    traced = trace(model, inputs, what="model 'mypkg:build'")
    traced.graphs[True]    # the training-mode graph (an unlifted fx.GraphModule)
    traced.graphs[False]   # the evaluation-mode graph

``inputs`` are what the model is called with: a tensor (``model(x)``), a tuple of tensors
(``model(*inputs)``) or a dict (``model(**inputs)``), each with the batch in dim 0. The batch is
traced as a dynamic dimension, so the graphs run on any number of samples; with ``vary`` (batches
padded to their longest sample by a ``collate_fn``) every other size of the inputs is traced
dynamic too, unless the model fixes it (``torch.export.Dim.AUTO``). Both modes are traced
because a trace bakes ``self.training`` in (BatchNorm's statistics, dropout). A model that
cannot be traced raises one :class:`~tandem.errors.UsageError` naming the line that failed.
A model with a ``config.use_cache`` (Hugging Face) is traced with it off: training never uses a
key-value cache, and the cache object is not made of tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import re
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import sympy
import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from tandem.errors import UsageError
from tandem.split.spec import BATCH, input_size

TORCH_DIR = str(Path(torch.__file__).parent)
TANDEM_DIR = str(Path(__file__).parent.parent)


@dataclasses.dataclass(frozen=True, slots=True)
class Traced:
    """A model's graphs in training (``True``) and evaluation (``False``) mode."""

    graphs: dict[bool, fx.GraphModule]
    """Unlifted graphs: parameters and buffers are ``get_attr`` nodes under the model's names."""
    in_spec: pytree.TreeSpec
    """How ``(args, kwargs)`` flatten into the graphs' placeholders."""
    out_spec: pytree.TreeSpec
    """How the graphs' flat outputs build the model's output (a tensor, tuple, dict, ...)."""


def call_args(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` of the call ``model(inputs)`` stands for."""
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    if isinstance(inputs, dict):
        return (), dict(inputs)
    raise UsageError(f"model inputs must be a tensor, a tuple or a dict of tensors "
                     f"(got {type(inputs).__name__})")


def trace(model: nn.Module, inputs: Any, *, what: str, vary: bool = False) -> Traced:
    """Export ``model`` called on ``inputs`` in both modes (its own mode is restored); with
    ``vary``, the inputs' sizes besides the batch are dynamic too."""
    args, kwargs = call_args(inputs)
    was_training = model.training
    graphs: dict[bool, fx.GraphModule] = {}
    specs: list[Any] = []
    try:
        with without_cache(model):
            for mode in (True, False):
                model.train(mode)
                program = _export(model, args, kwargs, what, vary)
                graphs[mode] = program.module()
                specs.append(program.call_spec)
    finally:
        model.train(was_training)
    return Traced(graphs=graphs, in_spec=specs[0].in_spec, out_spec=specs[0].out_spec)


@contextlib.contextmanager
def without_cache(model: nn.Module) -> Iterator[None]:
    """``model.config.use_cache`` set to False while tracing, then restored (a Hugging Face
    model returns its key-value cache by default; the trace keeps only tensors)."""
    config: Any = getattr(model, "config", None)
    if getattr(config, "use_cache", None) is not True:
        yield
        return
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = True


def size_symbols(graph: fx.Graph) -> dict[sympy.Symbol, sympy.Symbol]:
    """The symbols a traced graph calls its inputs' sizes, each mapped to tandem's own: the
    batch (dim 0) to :data:`~tandem.split.spec.BATCH`, any other dynamic size to
    :func:`~tandem.split.spec.input_size` in the order the inputs have them (the same in
    both modes' traces)."""
    found: dict[sympy.Symbol, sympy.Symbol] = {}
    for node in graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        for dim, size in enumerate(value.shape):
            expr = size.node.expr if isinstance(size, torch.SymInt) else None
            if isinstance(expr, sympy.Symbol) and expr not in found:
                found[expr] = BATCH if dim == 0 else input_size(
                    sum(symbol != BATCH for symbol in found.values()))
    return found


def _export(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            what: str, vary: bool) -> torch.export.ExportedProgram:
    batch = torch.export.Dim("batch")
    shapes = torch.export.ShapesCollection()  # type: ignore[no-untyped-call]  # torch's
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            shapes[leaf] = {0: batch, **dict.fromkeys(range(1, leaf.dim()) if vary else (),
                                                       torch.export.Dim.AUTO)}
    with quiet(), torch.random.fork_rng(devices=[]):
        try:
            return torch.export.export(
                model, args, kwargs, strict=False,
                dynamic_shapes=shapes.dynamic_shapes(  # type: ignore[no-untyped-call]
                    model, args, kwargs))
        except Exception as exc:  # noqa: BLE001 - any failure of the trace is the user's model
            raise UsageError(failure_message(exc, what)) from None


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence the tracer's warnings, logs and prints (a failure is one line instead)."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


def failure_message(exc: BaseException, what: str) -> str:
    """One line: what failed, where in the user's code, and the ways out."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    reason = lines[0] if lines else type(exc).__name__
    reason = re.sub(r"\s*\(unhinted:.*$", "", reason).rstrip(". ")
    if "Cache" in reason:
        reason += (" (a key-value cache is not made of tensors: where your code calls a Hugging "
                   "Face model, pass use_cache=False)")
    return (f"cannot trace {what} to split it into pipeline blocks: {reason}{_where(exc)}; make "
            f"that code traceable by torch.export (no Python branch on a tensor's value), or "
            f"build the model as an nn.Sequential of blocks")


def _where(exc: BaseException) -> str:
    """`` at file.py:12 `code``` for the user's line that failed, if it can be told."""
    match = re.search(r'The following call raised this error:\s*\n\s*File "([^"]+)", line (\d+), '
                      r"in \S+\n\s*(.+)", str(exc))
    if match:
        return f" at {Path(match[1]).name}:{match[2]} `{match[3].strip()}`"
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__)
              if not frame.filename.startswith((TORCH_DIR, TANDEM_DIR))]
    if frames:
        frame = frames[-1]
        return f" at {Path(frame.filename).name}:{frame.lineno} `{(frame.line or '').strip()}`"
    return ""
