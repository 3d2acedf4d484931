"""A stage's forwards and backwards, the compute handlers of its schedule.

Flush schedules accumulate gradients into the live parameters; the asynchronous schedule binds
a stashed weight version to each minibatch (see ``stash.py``). With ``--precision`` each forward
(and the last stage's loss) runs under autocast and what crosses to the next stage is cast back
to the dtype its boundary was traced with. With ``recompute`` each forward keeps only the stage's
input and its backward runs it again (see ``recompute.py``), on the same weight version under
PipeDream's weight stashing. ``peak_activation_bytes`` is the most this worker held at once of
what autograd saves for backwards (the stage's weights excepted): every micro-batch in flight's,
plus, with ``recompute``, what the backward's recomputation saves. What a forward saves is
counted (by a saved-tensors hook) on the first forward of each micro-batch size only (of each
size and input shape, where batches vary): the hook costs a Python call per saved tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from tandem import structures
from tandem.errors import UsageError
from tandem.runtime.executor import Span
from tandem.runtime.pipeline.links import ACT, GRAD, VERSION, StageLinks, StageShapes
from tandem.runtime.pipeline.recompute import Recompute, saved_bytes, storages
from tandem.runtime.pipeline.stash import WeightVersions
from tandem.runtime.precision import StagePrecision
from tandem.schedule import Action
from tandem.split import TensorSpec


@dataclasses.dataclass(frozen=True, slots=True)
class Microbatch:
    """The data a stage needs for one micro-batch."""

    size: int
    """Samples in the micro-batch."""
    scale: float
    """Factor of its summed loss: 1 / samples in the whole (global) batch."""
    step: int
    """Optimizer step it belongs to (for the trace)."""
    inputs: Any = None
    """Model inputs (first stage only): a tensor, or a tuple or dict of tensors."""
    targets: Any = None
    """Targets (last stage only), for the loss."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ComputeSpec:
    """What a stage computes, and how."""

    module: nn.Module
    first: bool
    last: bool
    loss_fn: Callable[[Any, Any], torch.Tensor]
    """The last stage's loss: ``loss_fn(output, targets)``, the micro-batch's mean."""
    precision: StagePrecision
    recompute: bool = False
    clone_received: bool = False
    """Give the module copies of the received tensors (its first layer may update its input in
    place, which autograd forbids on a received leaf)."""
    gradient_factor: float = 1.0
    """What the last stage's loss is multiplied by besides the loss scale: the stages'
    replicas when FSDP2 averages their gradients where the allreduce sums them (sharded)."""


def _select(values: Sequence[Any], specs: Sequence[TensorSpec]) -> list[Any]:
    """The ``values`` whose spec says a gradient comes back for them."""
    return [value for value, spec in zip(values, specs) if spec.requires_grad]


def _as_specs(outputs: Sequence[torch.Tensor],
              specs: Sequence[TensorSpec]) -> tuple[torch.Tensor, ...]:
    """``outputs`` in the dtypes of their boundary (autocast may have computed them in another)."""
    if len(outputs) != len(specs):
        raise UsageError(f"a stage passes {len(outputs)} tensors to the next one where the "
                         f"first sample gave {len(specs)}; return the same structure for every "
                         f"batch")
    return tuple(t.to(spec.dtype) if t.dtype != spec.dtype else t
                 for t, spec in zip(outputs, specs, strict=True))


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _or_zeros(grads: Sequence[torch.Tensor | None], like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, like)]


class StageCompute:
    """Runs a stage's forwards and backwards and keeps what lies between them."""

    def __init__(self, spec: ComputeSpec, shapes: StageShapes, links: StageLinks,
                 stash: WeightVersions | None, beat: Any, device: torch.device) -> None:
        self.spec, self.shapes, self.links, self.stash, self.beat = spec, shapes, links, stash, beat
        self.module = spec.module
        self.recompute = Recompute(spec.module) if spec.recompute else None
        """Runs the forwards so that their backwards recompute them (None: they keep theirs)."""
        self.on_loss: Callable[[int, torch.Tensor, int], None] | None = None
        """The last stage calls it with each micro-batch's step, summed loss and samples."""
        self.unchanged_until_backward: set[int] = set()
        """Minibatches with no weight update between their forward and backward on this worker
        (PipeDream's last stage): they run on the live parameters, which is the same version."""
        self.on_live: set[int] = set()
        self.saved: dict[int, tuple[list[torch.Tensor], Any, int]] = {}
        """Micro-batch -> (tensors received, outputs or scaled loss, weight version)."""
        self.input_grads: dict[int, list[torch.Tensor]] = {}
        self.param_grads: dict[int, list[torch.Tensor | None]] = {}
        self.versions: dict[int, int] = {}
        self.saved_bytes: dict[int, int] = {}
        self.peak_activation_bytes = 0
        self.forward_bytes: dict[Any, int] = {}
        """Samples (and, where batches vary, the input's shapes) -> what a forward of them
        saves for its backward (counted once for each)."""
        self.loss_total = torch.zeros((), device=device)
        self.live_weights = storages(self.module.parameters())
        """Storages of the live parameters (updated in place, so read once)."""

    def _weights_version(self, m: int) -> int:
        """The weight version minibatch ``m`` uses here (stage 0's under vertical sync)."""
        assert self.stash is not None
        if self.links.spec.vertical_sync and not self.spec.first:
            version = int(self.links.arrived(m, VERSION).buffer)
            self.stash.keep_from(version)
            return version
        return self.stash.version

    def _weights(self, version: int) -> set[int]:
        """Storages of the weights a forward of ``version`` runs on (live and stashed)."""
        if self.stash is None:
            return self.live_weights
        return self.live_weights | storages(self.stash.snapshots.get(version, {}).values())

    def forward(self, action: Action, span: Span, micro: Microbatch) -> None:
        """Forward of micro-batch ``action.microbatch`` (and the loss, on the last stage)."""
        m = action.microbatch
        assert m is not None
        spec = self.spec
        self.beat.step, self.beat.phase = micro.step, "forward"
        received: list[torch.Tensor] = []
        if spec.first:
            x = micro.inputs
        else:
            received = self.links.wait(m, ACT)
            for tensor in _select(received, self.shapes.inputs):
                tensor.requires_grad_(True)
            given = [t.clone() if spec.clone_received and t.requires_grad else t for t in received]
            x = self.shapes.assemble(given)
        assert x is not None
        version = self._weights_version(m) if self.stash else -1
        span.start = time.perf_counter()
        size: Any = micro.size if not self.links.spec.vary else (
            micro.size, tuple(tuple(t.shape) for t in structures.tensors(x)))
        known = self.forward_bytes.get(size)
        saved = [0]
        weights: set[int] = set()
        counting: Any = contextlib.nullcontext()
        if known is None:  # the first forward of this size counts what autograd saves
            weights = self._weights(version)

            def pack(tensor: torch.Tensor) -> torch.Tensor:
                saved[0] += saved_bytes(tensor, weights)
                return tensor

            counting = torch.autograd.graph.saved_tensors_hooks(pack, _unpack)
        params: dict[str, torch.Tensor] | None = None  # None: the live parameters
        if self.stash is not None:
            if m in self.unchanged_until_backward and version == self.stash.version:
                self.on_live.add(m)
            else:
                params = self.stash.acquire(version)

        def forward(x: Any) -> Any:  # run again by a recomputing backward: no side effects
            if params is None:
                return self.module(x)
            return functional_call(self.module, params, (x,))

        with counting, spec.precision.autocast():
            if self.recompute is not None:
                if known is None:
                    saved[0] += sum(saved_bytes(t, weights) for t in structures.tensors(x))
                out = self.recompute(forward, x)
            else:
                out = forward(x)
            if spec.last:
                assert micro.targets is not None
                loss = spec.loss_fn(out, micro.targets) * micro.size
                self.loss_total += loss.detach()
                if self.on_loss is not None:
                    self.on_loss(micro.step, loss.detach(), micro.size)
                out = loss * (micro.scale * spec.precision.loss_factor * spec.gradient_factor)
            else:
                out = _as_specs(self.shapes.sent(out), self.shapes.outputs)
        if known is None:
            known = self.forward_bytes[size] = saved[0]
        self.saved[m] = (received, out, version)
        self.versions[m] = version
        self.saved_bytes[m] = known
        self.peak_activation_bytes = max(self.peak_activation_bytes, sum(self.saved_bytes.values()))
        span.version = version

    def backward(self, action: Action, span: Span, micro: Microbatch) -> None:
        """Backward of micro-batch ``action.microbatch``: its parameters' gradients (added to
        the live ones, or kept for its update under weight stashing) and its input's."""
        m = action.microbatch
        assert m is not None
        self.beat.step, self.beat.phase = micro.step, "backward"
        grads: list[torch.Tensor | None] = [] if self.spec.last else [*self.links.wait(m, GRAD)]
        received, out, version = self.saved.pop(m)
        span.start = time.perf_counter()
        inputs = _select(received, self.shapes.inputs)
        outputs = [out] if self.spec.last else _select(out, self.shapes.outputs)
        pairs = [(o, g) for o, g in zip(outputs, grads or [None] * len(outputs)) if o.requires_grad]
        if self.recompute is not None:
            self.recompute.weights = self._weights(version)
            self.recompute.bytes = 0
        if self.stash is not None:
            self._stashed_backward(m, version, pairs, inputs)
        else:
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            self.input_grads[m] = _or_zeros([t.grad for t in inputs], inputs)
        if self.spec.first:
            self.input_grads.pop(m)
        if self.recompute is not None:
            self.peak_activation_bytes = max(self.peak_activation_bytes,
                                             sum(self.saved_bytes.values()) + self.recompute.bytes)
        del self.saved_bytes[m]
        self.versions.pop(m, None)
        span.version = version

    def _stashed_backward(self, m: int, version: int, pairs: list[tuple[Any, Any]],
                          inputs: list[torch.Tensor]) -> None:
        """The gradients of micro-batch ``m``'s weight version and inputs, kept apart."""
        assert self.stash is not None
        live = m in self.on_live
        self.on_live.discard(m)
        params = list(self.module.parameters() if live else self.stash.snapshots[version].values())
        found: Sequence[torch.Tensor | None]
        if pairs:
            found = torch.autograd.grad([o for o, _ in pairs], [*params, *inputs],
                                        grad_outputs=[g for _, g in pairs], allow_unused=True)
        else:
            found = [None for _ in range(len(params) + len(inputs))]
        self.param_grads[m] = list(found[: len(params)])
        self.input_grads[m] = _or_zeros(found[len(params):], inputs)
        if not live:
            self.stash.release(version)

    def outputs(self, m: int) -> list[torch.Tensor]:
        """Micro-batch ``m``'s outputs, to send on."""
        return [t.detach() for t in self.saved[m][1]]
