"""What a job trains — the model, the data and the loss — from its specs or from the user's own
objects (the Python API), built the same way on every worker.

Usage::

    task = Task(job.run, job.objects)
    torch.manual_seed(job.run.seed)
    model = task.build_model()
    batch = task.data.train.take(indices)
    loss = checked_loss(task.loss_fn, call_model(model, batch.inputs), batch.targets,
                        name=task.loss_label)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
from typing import Any

import torch
from torch import nn

from tandem import structures
from tandem.data import Data, DataInfo, TensorSamples, data_of, load_data
from tandem.data.user_sampler import SamplerOrder
from tandem.errors import UsageError
from tandem.loss import LossFn, checked_loss, evaluation, load_loss, loss_name, score_batch
from tandem.models import build_model, is_builtin
from tandem.models.pieces import Initializer, materialize
from tandem.runtime.callbacks import check_callbacks
from tandem.runtime.user_metrics import KeptOutputs, check_metrics
from tandem.spec.options import user_function


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class UserObjects:
    """A user's own model, data and loss, given as objects (they pickle to spawned workers:
    define their classes and functions at the top level of a module)."""

    model: Any = None
    """An ``nn.Module`` (each worker trains a copy), or a function that builds one (called
    after seeding, with ``info=`` if it takes that parameter)."""
    train: Any = None
    """The training ``Dataset`` of ``(input, target)`` pairs."""
    test: Any = None
    """The test ``Dataset`` (None: the summary scores the training data and says so)."""
    loss: Any = None
    """``loss(output, targets) -> scalar mean``; None: cross-entropy on the logits."""
    info: DataInfo | None = None
    """What built-in models need to know of the data (inferred when None)."""
    init_fn: Any = None
    """``init_fn(module)``: initializes one module's own weights, for a model built in pieces
    (see :mod:`tandem.models.pieces`); None: ``--init-fn`` says."""
    param_groups: Any = None
    """``param_groups(model)``: the optimizer's parameter groups over the whole model (see
    :mod:`tandem.runtime.param_groups`); None: one group, or ``--no-decay``'s two."""
    scheduler: Any = None
    """``scheduler(optimizer)``: a learning-rate scheduler, stepped after every optimizer step
    (see :func:`tandem.runtime.learning_rate.user_scheduler`); None: tandem's own."""
    callbacks: Any = None
    """Objects with hooks after steps, metrics lines, evaluations and checkpoints (see
    :mod:`tandem.runtime.callbacks`); None: none."""
    metrics: Any = None
    """``{name: metric(outputs, targets)}`` over each whole evaluation (see
    :mod:`tandem.runtime.user_metrics`); None: none."""
    collate_fn: Any = None
    """``collate_fn(items) -> (inputs, targets)``: makes the train and test batches from the
    datasets' items (see :mod:`tandem.data.collate`); None: items are (input, target) pairs
    that tandem stacks."""
    sampler: Any = None
    """A ``Sampler`` (or iterable) of training-set indices that orders each epoch (see
    :mod:`tandem.data.user_sampler`); None: a shuffle by the seed."""


class Task:
    """The model builder, the data and the loss of one job."""

    def __init__(self, run: Any, objects: UserObjects | None = None, *,
                 data: Data | None = None) -> None:
        self.run, self.objects = run, objects or UserObjects()
        objects = self.objects
        if data is not None:  # built already, by the launcher's first check
            self.data: Data = data
        elif objects.train is not None:
            self.data = data_of(objects.train, objects.test, name=run.data,
                                info=objects.info, collate=objects.collate_fn)
        else:
            if objects.collate_fn is not None:
                raise UsageError("collate_fn makes batches of the datasets given to tandem.fit "
                                 "(train=, test=); a --data function returns its own: "
                                 "(train, test, collate_fn)")
            self.data = load_data(run.data, cache_dir=getattr(run, "cache_dir", None))
        self.loader_workers = self._loader_workers(getattr(run, "loader_workers", None))
        self.order = self._order(run)
        """The user's sampler as each epoch's order (None: tandem's shuffle)."""
        self.scores_training_data = objects.train is not None and objects.test is None
        self.loss_fn: LossFn = objects.loss if objects.loss is not None else load_loss(run.loss)
        self.loss_label = loss_name(objects.loss if objects.loss is not None else run.loss)
        self.callbacks = check_callbacks(objects.callbacks)
        self.metrics = check_metrics(objects.metrics)

    def _loader_workers(self, given: int | None) -> int:
        """Background loader processes: as given, else 1 for streamed data and 0 otherwise;
        refused for samples held in memory (nothing to read ahead). The loader options that
        tune them need some."""
        train = self.data.train
        if given and isinstance(train, TensorSamples):
            raise UsageError(f"--loader-workers {given} reads batches ahead from storage, and "
                             f"--data {self.run.data} is held in memory; drop --loader-workers "
                             f"(or stream it: tandem pack, then --data shards:DIR)")
        workers = (1 if train.streams else 0) if given is None else given
        options = self.run.loader
        for key, value in (("prefetch_factor", options.prefetch_factor),
                           ("pin_memory", options.pin_memory or None)):
            if value is not None and not workers:
                raise UsageError(f"loader option {key}={value} tunes the loader processes that "
                                 f"read batches ahead, and this run has none; add "
                                 f"loader_workers=1 (DataLoader's num_workers) or drop {key}")
        return workers

    def _order(self, run: Any) -> SamplerOrder | None:
        """The user's sampler over the training samples, which tandem's own order then
        leaves to it; refused with streamed data (ordered by its shards) and with ``shuffle``
        (as a ``DataLoader`` refuses both)."""
        sampler, options = self.objects.sampler, run.loader
        streams = self.data.train.streams
        for given, value in (("shuffle=False", not options.shuffle),
                             ("drop_last=True", options.drop_last)):
            if value and streams:
                raise UsageError(f"loader option {given} orders held samples, and --data "
                                 f"{run.data} streams from shards in their own order; drop it")
        if sampler is None:
            return None
        if streams:
            raise UsageError(f"sampler orders held samples, and --data {run.data} streams from "
                             f"shards in their own order; drop sampler")
        if not options.shuffle:
            raise UsageError("loader option shuffle=False conflicts with sampler (the sampler "
                             "gives the order); drop one of them")
        return SamplerOrder(sampler, seed=run.seed, num_items=len(self.data.train))

    def initializer(self) -> Initializer | None:
        """How a model built in pieces is initialized: a built-in one by module name, a user's
        builder by ``--init-fn``; None when the model cannot be built in pieces (a user's
        builder without ``--init-fn``, or a model given as an object)."""
        if self.objects.model is None and is_builtin(self.run.model):
            return Initializer(seed=self.run.seed, by_name=True)
        init_fn = getattr(self.run, "init_fn", None)
        if init_fn is None:
            return None
        if isinstance(self.objects.model, nn.Module):  # tandem.fit refuses it
            raise UsageError("init_fn initializes a model that tandem builds; drop it")
        function = self.objects.init_fn
        if function is None and init_fn != "reset":
            function, _ = user_function(init_fn, what="--init-fn")
        return Initializer(seed=self.run.seed, by_name=False, function=function)

    def build_model(self, *, meta: bool = False) -> nn.Module:
        """A fresh model: built from ``--model``, a copy of the user's module, or what the
        user's builder returns (call under the run's seed for identical replicas). A model that
        can be built in pieces (:meth:`initializer`) comes, with ``meta``, on the meta device,
        uninitialized (the caller materializes it: :func:`tandem.models.pieces.materialize`);
        without, whole on the CPU (a user's builder initialized module by module all the same,
        so both ways give the same weights)."""
        given = self.objects.model
        if given is None and is_builtin(self.run.model):
            return build_model(self.run.model, lambda: self.data.info, seed=self.run.seed,
                               device="meta" if meta else None)
        if isinstance(given, nn.Module):
            return copy.deepcopy(given)
        init = self.initializer()
        with torch.device("meta") if init is not None else contextlib.nullcontext():
            model = self._call_builder()
        if init is not None and not meta:
            materialize(model, init, torch.device("cpu"))
        return model

    def _call_builder(self) -> nn.Module:
        """What the user's builder (``--model package.module:function`` or a function given
        to ``tandem.fit``) returns."""
        given = self.objects.model
        if given is None:
            return build_model(self.run.model, lambda: self.data.info)
        if not callable(given):
            raise UsageError(f"model is a {type(given).__name__}; give an nn.Module or a "
                             f"function that returns one")
        kwargs = ({"info": self.data.info}
                  if "info" in inspect.signature(given).parameters else {})
        model = given(**kwargs)
        if not isinstance(model, nn.Module):
            raise UsageError(f"the model function returned {type(model).__name__}, not a "
                             f"torch.nn.Module")
        return model

    def loss(self, output: Any, targets: Any) -> torch.Tensor:
        """The batch's mean loss, checked to be a scalar."""
        return checked_loss(self.loss_fn, output, targets, name=self.loss_label)

    @torch.no_grad()
    def score(self, model: nn.Module, start: int, end: int, *, samples: Any = None,
              chunk: int = 1024, device: torch.device | None = None,
              keep: KeptOutputs | None = None) -> torch.Tensor:
        """``[correct, predictions, summed loss, samples]`` of ``model`` on test samples
        ``start`` to ``end - 1`` (of ``samples``, e.g. already on the model's device; default
        :attr:`test_samples`), in eval mode, in chunks (see :func:`tandem.loss.score_batch`), on
        ``device`` (default: the model's parameters'; a model whose shards are offloaded to CPU
        memory computes on the worker's device); ``keep`` keeps the outputs and targets for
        the user's metrics."""
        samples = self.test_samples if samples is None else samples
        was_training = model.training
        model.eval()
        if device is None:
            device = next(model.parameters(), torch.empty(0)).device
        totals = torch.zeros(4, dtype=torch.float64, device=device)
        for low in range(start, end, chunk):
            batch = samples.rows(low, min(end, low + chunk)).to(device)
            output = structures.call_model(model, batch.inputs)
            totals += score_batch(output, batch.targets, self.loss, batch.size).to(device)
            if keep is not None:
                keep.keep(low, output, batch.targets)
        model.train(was_training)
        return totals

    def evaluated(self, model: nn.Module) -> dict[str, float | None]:
        """``test_accuracy``, ``test_loss`` and the user's metrics (``test_<name>``) of
        ``model`` on the whole test split, scored by this worker alone."""
        kept = KeptOutputs(self.metrics)
        totals = self.score(model, 0, len(self.test_samples), keep=kept)
        return {**evaluation(totals), **kept.values(gather=False)}

    def summary_fields(self) -> dict[str, Any]:
        """What a run's summary says of its task: the loss, and what the evaluation scored."""
        return {"loss": self.loss_label,
                "scored_on": "training data (no test data was given)"
                if self.scores_training_data else "test data"}

    @property
    def test_samples(self) -> Any:
        """The samples evaluation scores (the training samples when no test data was given)."""
        return self.data.test
