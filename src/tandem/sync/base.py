"""The interface every synchronization strategy implements for the data-parallel trainer."""

from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch import nn

from tandem.errors import UsageError


MAX_NAMED = 8
"""Parameters an error names before it says how many more there are."""


class SyncStrategy(abc.ABC):
    """How the workers of a data-parallel job keep their models in agreement.

    The trainer calls, per optimizer step: ``accumulating`` around every backward but the last
    (no communication), a plain backward for the last, then :meth:`update`, which synchronizes
    gradients or parameters and applies the step. Strategies that need a process layout of
    their own (parameter servers) say which ranks train through ``data_rank``/``data_world``.
    """

    name: str = ""
    synchronous: bool = True
    """Whether all workers meet every step (False: no global rounds, so losses are logged per
    worker and nothing else is collective until training ends)."""
    local_optimizer: bool = True
    """Whether :meth:`update` steps the worker's own optimizer (and so its learning-rate schedule)."""
    replicas_agree: bool = True
    """Whether every worker holds the same model and optimizer state after each step (False:
    checkpoints keep each worker's own)."""
    state_agrees: bool = False
    """Whether the strategy's own state is the same on every worker even where the models
    differ (EASGD's center), so a checkpoint resized to another worker count keeps one copy."""
    overlapped_allreduce: bool = False
    """Whether gradients are allreduced during the last backward (DDP's buckets), so the
    schedule's ``AR`` spans that backward rather than following it."""
    recorder: Callable[[str, float, float], None] | None = None
    """Where :meth:`action` reports the actions of :meth:`update` (set by the trainer)."""
    checkpoints: bool = True
    """Whether the trainer writes checkpoints of this strategy (False: each worker holds a
    shard that no checkpoint format takes yet; none is written)."""
    sharded_checkpoint: bool = False
    """Whether each worker writes its own shards of the model and optimizer state
    (:mod:`tandem.runtime.sharded_checkpoint`) instead of rank 0 writing them whole."""
    collective_forward: bool = False
    """Whether a forward of the model is collective (its parameters are gathered as it runs),
    so that every worker must run as many forwards as the others, evaluations included."""
    noise_scale_note: str | None = None
    """Why runs of this strategy measure no gradient noise scale, where the trainer's own
    reason (not data parallelism) does not apply; None: see :mod:`tandem.runtime.data_step`."""
    find_unused_parameters: bool = False
    """``--find-unused-parameters``: a parameter that got no gradient in a step is treated as
    having a zero gradient (DDP searches the graph for them); without it, it is an error."""

    @contextlib.contextmanager
    def action(self, code: str) -> Iterator[None]:
        """Time the body as one action of this step's schedule: ``AR``, ``ST``, ``PU``, ``PL``
        or ``GX`` (see :mod:`tandem.schedule.action`), reported to :attr:`recorder`."""
        start = time.perf_counter()
        yield
        if self.recorder is not None:
            self.recorder(code, start, time.perf_counter())

    held_state_bytes: int | None = None
    """The parameter, gradient and optimizer-state bytes this worker held after its first
    :meth:`step_optimizer` (:func:`held_state_bytes`); None before it, or where the worker
    steps no optimizer of its own."""
    memory_limit: float | None = None
    """``--memory-limit`` in bytes: :attr:`held_state_bytes` over it stops the run
    (:func:`check_memory_limit`)."""
    shard_degree: int = 1
    """Workers each group splits the state over (``--shard``; 1: each holds it whole)."""
    builds_in_pieces: bool = False
    """Whether :meth:`wrap` takes a model on the meta device and builds it one unit at a time
    with :attr:`initializer` (FSDP2's sharding: no worker holds the model whole)."""
    initializer: Any = None
    """A :class:`tandem.models.pieces.Initializer` for a model built in pieces (set by the
    trainer before :meth:`wrap`; None: the model comes whole)."""
    casts_forward: bool = False
    """Whether the strategy runs the forward in the run's half precision itself (FSDP2's
    ``MixedPrecisionPolicy``), so that the trainer adds no autocast around it."""

    step_fn: Callable[[torch.optim.Optimizer], None] | None = None
    """How the optimizer applies the gradients (set by the trainer: with fp16 the loss scaler's
    step, which skips an overflowed one); None: ``optimizer.step()``."""

    def step_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Apply the gradients and clear them: the schedule's ``ST``."""
        with self.action("ST"):
            if self.step_fn is not None:
                self.step_fn(optimizer)
            else:
                optimizer.step()
        if self.held_state_bytes is None:
            self.held_state_bytes = held_state_bytes(optimizer)
            if self.memory_limit is not None:
                check_memory_limit(self.held_state_bytes, self.memory_limit,
                                   degree=self.shard_degree, workers=dist.get_world_size())
        optimizer.zero_grad(set_to_none=True)

    @abc.abstractmethod
    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        """Return the module the trainer calls forward on (may be ``model`` itself)."""

    def unwrap(self, module: nn.Module) -> nn.Module:
        """The user's model inside ``module``, with its own parameter names."""
        return module

    def accumulating(self, module: nn.Module) -> ContextManager[None]:
        """Context for a backward whose gradients are only accumulated locally."""
        return contextlib.nullcontext()

    def evaluating(self, module: nn.Module) -> ContextManager[None]:
        """Context for an evaluation's forwards (no backward follows them)."""
        return contextlib.nullcontext()

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer the worker steps, built from ``optimizer`` (after :meth:`wrap`, before
        its learning-rate schedule): ``optimizer`` itself unless the strategy shards its state."""
        return optimizer

    def gathered_state(self, model: nn.Module, rank: int) -> dict[str, torch.Tensor] | None:
        """The whole model's state under its own names, on the CPU, on rank 0 (None elsewhere);
        collective where the workers hold parts of it. ``model`` is :meth:`unwrap`'s."""
        if rank != 0:
            return None
        return {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}

    _trainable: list[tuple[str, nn.Parameter]] | None = None
    """The unwrapped model's parameters that require a gradient (listed at the first check)."""

    def check_gradients(self, module: nn.Module, step: int) -> None:
        """Before :meth:`update`: every parameter that requires a gradient must have one. One
        without is a zero gradient with ``--find-unused-parameters``, else a ``UsageError``
        naming it (before DDP fails on it at the next step with an error that does not)."""
        if self._trainable is None:  # the model's parameters do not change: list them once
            self._trainable = [(name, p) for name, p in self.unwrap(module).named_parameters()
                               if p.requires_grad]
        missing = [(name, p) for name, p in self._trainable if p.grad is None]
        if not missing:
            return
        if not self.find_unused_parameters:
            names = ", ".join(name for name, _ in missing[:MAX_NAMED])
            more = f" and {len(missing) - MAX_NAMED} more" if len(missing) > MAX_NAMED else ""
            raise UsageError(
                f"the model's parameters {names}{more} got no gradient at step {step} (forward "
                f"did not use them); use them, set requires_grad=False on them, or pass "
                f"--find-unused-parameters to train with a zero gradient for them")
        for _, p in missing:
            p.grad = torch.zeros_like(p)

    def update(self, module: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> bool:
        """Synchronize and apply step ``step``'s update; True when training must stop here.

        The default steps the local optimizer (gradients already agree, e.g. through DDP).
        """
        self.step_optimizer(optimizer)
        return False

    def finish(self) -> None:
        """Training is over on this worker: end background exchanges (before evaluation)."""

    def consensus(self, module: nn.Module) -> None:
        """Make every worker hold the job's final model (collective). Default: they agree."""

    def record_loss(self, loss_sum: torch.Tensor, count: int) -> None:
        """This step's summed loss over ``count`` predictions, before :meth:`update`."""

    def state_dict(self) -> dict[str, Any]:
        """This worker's strategy state beyond its model and optimizer, for checkpoints."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s output (after :meth:`wrap`)."""

    def sent_bytes(self) -> float:
        """Bytes this worker has sent to synchronize so far (its ``sync_bytes`` stat)."""
        return float(self.stats().get("sync_bytes", 0.0))

    def stats(self) -> dict[str, float]:
        """Strategy counters for the run's summary (bytes sent, dropped updates, ...)."""
        return {}

    def summary(self) -> dict[str, Any]:
        """Fields of the run's summary that describe this strategy's layout (rank 0's)."""
        return {}


def check_memory_limit(held: int, limit: float, *, degree: int, workers: int) -> None:
    """One line if a worker holding ``held`` bytes of state, split ``degree`` ways, is over
    ``limit``, naming the smallest ``--shard`` among the divisors of ``workers`` under which
    each would hold no more (up to FSDP's padding of a parameter's first dimension), or
    saying that none does."""
    if held <= limit:
        return
    whole = held * degree
    fits = [shards for shards in range(degree + 1, workers + 1)
            if workers % shards == 0 and whole / shards <= limit]
    fix = (f"shard it with --shard {fits[0]} (about {whole / fits[0] / 1e6:.3g} MB each)"
           if fits else f"even --shard {workers} leaves about {whole / workers / 1e6:.3g} MB "
           f"each: add workers or raise --memory-limit")
    raise UsageError(f"worker rank {dist.get_rank()} holds {held / 1e6:.3g} MB of parameters, "
                     f"gradients and optimizer state, over --memory-limit {limit / 1e6:.3g} MB; "
                     f"{fix}")


def held_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the parameters ``optimizer`` updates, their gradients and its state, as this
    worker holds them: each tensor's local part (a sharded or split parameter's own shard; a
    ``ZeroRedundancyOptimizer``'s own share of the state), each tensor once."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local optimizer
    tensors: dict[int, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            for tensor in (param, param.grad):
                if tensor is not None:
                    tensors[id(tensor)] = tensor
    for state in inner.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                tensors[id(value)] = value
    # a DTensor counts its local shard, read without importing DTensor into every worker
    local = (t.to_local() if hasattr(t, "to_local") else t for t in tensors.values())
    return sum(t.numel() * t.element_size() for t in local)
